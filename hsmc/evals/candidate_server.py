"""The untrusted side of a sandboxed test run: started by `jail.py` as `python -I candidate_server.py LIMITS FD`.

It sets the candidate's rlimits and adds a seccomp filter so that it can create no process or thread and
run no other program (RLIMIT_NPROC alone would not bind root, whom the kernel exempts), then serves the
harness over stdin (requests) and FD (answers), length-prefixed pickles: `("load", program, entry_point)`
executes the program and answers `("ready",)`; each `("call", args, kwargs)` calls the entry point and
answers `("return", value)` or `("raise", type name, message)`. Standard library and `jail.py` (its
directory is put on sys.path) only.
"""

from __future__ import annotations

import json
import os
import pickle
import resource
import struct
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from jail import PROCESS_SYSCALLS, install_seccomp  # noqa: E402

LIMITS = {  # job limit name -> (rlimit, scale to the rlimit's unit)
    "cpu_s": (resource.RLIMIT_CPU, 1),
    "memory_mb": (resource.RLIMIT_AS, 1 << 20),
    "file_size_mb": (resource.RLIMIT_FSIZE, 1 << 20),
    "open_files": (resource.RLIMIT_NOFILE, 1),
}


def _read(n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = os.read(0, n - len(data))
        if not chunk:
            sys.exit(0)  # the harness is done
        data += chunk
    return data


def _receive() -> tuple:
    (size,) = struct.unpack("<Q", _read(8))
    return pickle.loads(_read(size))


def _send(fd: int, message: tuple) -> None:
    try:
        data = pickle.dumps(message)
    except Exception as e:  # e.g. the function returned a generator or a lambda
        data = pickle.dumps(("raise", "TypeError", f"the result cannot be sent back: {e}"))
    os.write(fd, struct.pack("<Q", len(data)))
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def main() -> None:
    limits, answer_fd = json.loads(sys.argv[1]), int(sys.argv[2])
    for name, (which, scale) in LIMITS.items():
        value = int(limits[name] * scale)
        resource.setrlimit(which, (value, value + 1 if which == resource.RLIMIT_CPU else value))  # SIGXCPU first
    resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    install_seccomp(PROCESS_SYSCALLS)
    _, program, entry_point = _receive()
    namespace = {"__name__": "candidate"}
    try:
        exec(compile(program, "candidate.py", "exec"), namespace)
        function = namespace[entry_point]
    except Exception as e:
        _send(answer_fd, ("raise", type(e).__name__, str(e)[:500]))
        return
    _send(answer_fd, ("ready",))
    while True:
        _, args, kwargs = _receive()
        try:
            answer = ("return", function(*args, **kwargs))
        except Exception as e:
            answer = ("raise", type(e).__name__, str(e)[:500])
        _send(answer_fd, answer)


if __name__ == "__main__":
    main()
