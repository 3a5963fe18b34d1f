"""Run one untrusted program's tests in isolation; started by `hsmc.evals.sandbox` as
`python -I -S jail.py WORK/job.json` in a fresh temporary directory WORK, with the pass nonce on stdin.

Standard library only: it runs without site-packages, before anything untrusted.

Isolation (`job["isolation"]`):
  namespaces  new mount, pid, network, ipc and uts namespaces (plus a user namespace when not root): every
              mount read-only, nosuid and nodev except WORK, a fresh /proc that shows only this program's
              processes, no network interfaces but a down loopback. Killing this process group ends them all.
  landlock    Linux Landlock: writes allowed beneath WORK only; TCP bind/connect and signals or abstract unix
              sockets reaching outside denied where the kernel's Landlock ABI has them.
  rlimits     neither is available: only the layers below.
Always: no new privileges, every capability dropped, a seccomp filter that refuses sockets, ptrace, process
memory access, namespaces, mounts and other kernel attack surface (x86_64, aarch64), the core dump limit 0.

The program never runs in this process. This process (the *harness*) executes the trusted problem prompt
and test code; the candidate program runs in a child process (`candidate_server.py`, under rlimits that
forbid it any child process or thread) and `check` calls it through a pipe: arguments go over as pickles,
results come back as pickles that may contain plain data only. The candidate cannot patch the harness's
builtins, return objects that compare equal to anything, or end the harness early. When `check` returns
and the candidate has been killed, the harness reads the nonce from stdin (the candidate never holds that
pipe and cannot read this non-dumpable process's file descriptors) and writes it to stdout: only that line
counts as a pass. The last stderr line is a JSON status for the parent.
"""

from __future__ import annotations

import builtins
import ctypes
import io
import json
import os
import pickle
import platform
import resource
import signal
import struct
import subprocess
import sys
import traceback

SETUP_FAILED = 3
MAX_MESSAGE = 64 << 20
SERVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "candidate_server.py")

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_REC, MS_PRIVATE = 2, 4, 8, 4096, 16384, 1 << 18
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID, MOUNT_ATTR_NODEV = 1, 2, 4
AT_FDCWD, AT_RECURSIVE = -100, 0x8000
PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP = 4, 24, 38, 22
SYS_MOUNT_SETATTR, SYS_LANDLOCK_CREATE, SYS_LANDLOCK_ADD_RULE, SYS_LANDLOCK_RESTRICT = 442, 444, 445, 446

# Syscalls the sandboxed processes never need (name: x86_64 number, aarch64 number).
DENIED_SYSCALLS = {
    "socket": (41, 198),
    "socketpair": (53, 199),
    "ptrace": (101, 117),
    "process_vm_readv": (310, 270),
    "process_vm_writev": (311, 271),
    "setsid": (112, 157),  # leaving the process group would escape the timeout's kill
    "setpgid": (109, 154),
    "mount": (165, 40),
    "umount2": (166, 39),
    "pivot_root": (155, 41),
    "chroot": (161, 51),
    "unshare": (272, 97),
    "setns": (308, 268),
    "bpf": (321, 280),
    "perf_event_open": (298, 241),
    "userfaultfd": (323, 282),
    "keyctl": (250, 219),
    "add_key": (248, 217),
    "request_key": (249, 218),
    "kexec_load": (246, 104),
    "init_module": (175, 105),
    "finit_module": (313, 273),
    "io_uring_setup": (425, 425),
    "io_uring_enter": (426, 426),
    "io_uring_register": (427, 427),
    "open_tree": (428, 428),
    "move_mount": (429, 429),
    "fsopen": (430, 430),
    "fsmount": (432, 432),
    "pidfd_getfd": (438, 438),
    "mount_setattr": (442, 442),
}
# What the candidate process additionally may not do: create processes or threads, run other programs, or
# send signals (as root outside a pid namespace, kill(-1) would reach every process of the machine).
PROCESS_SYSCALLS = {
    "kill": (62, 129),
    "tkill": (200, 130),
    "tgkill": (234, 131),
    "rt_sigqueueinfo": (129, 138),
    "rt_tgsigqueueinfo": (297, 240),
    "pidfd_send_signal": (424, 424),
    "fork": (57, None),
    "vfork": (58, None),
    "clone": (56, 220),
    "clone3": (435, 435),
    "execve": (59, 221),
    "execveat": (322, 281),
}
AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}


def _check(result: int, what: str) -> int:
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return result


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64), ("propagation", ctypes.c_uint64),
                ("userns_fd", ctypes.c_uint64)]  # fmt: skip


def _mount(source: str | None, target: str, fstype: str | None, flags: int) -> None:
    enc = [None if s is None else s.encode() for s in (source, target, fstype)]
    _check(_libc.mount(enc[0], enc[1], enc[2], ctypes.c_ulong(flags), None), f"mount {target}")


def _mount_setattr(path: str, recursive: bool, set_flags: int, clear_flags: int) -> None:
    attr = _MountAttr(set_flags, clear_flags, 0, 0)
    flags = AT_RECURSIVE if recursive else 0
    args = (SYS_MOUNT_SETATTR, AT_FDCWD, path.encode(), flags, ctypes.byref(attr), ctypes.sizeof(attr))
    _check(_libc.syscall(*args), f"mount_setattr {path}")


def enter_namespaces(work: str) -> None:
    """Enter fresh namespaces with a read-only view of the filesystem except `work`. Forks: the parent stays
    outside the new pid namespace and waits; the child (pid 1 inside it) returns and goes on."""
    uid, gid = os.getuid(), os.getgid()
    as_root = os.geteuid() == 0
    flags = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS
    _check(_libc.unshare(flags if as_root else flags | CLONE_NEWUSER), "unshare")
    if not as_root:
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    _mount(work, work, None, MS_BIND)
    _mount_setattr("/", True, MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV, 0)
    _mount_setattr(work, False, 0, MOUNT_ATTR_RDONLY)
    pid = os.fork()
    if pid:
        os.close(0)
        os.close(1)
        _libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        os._exit(code if code >= 0 else 128 - code)
    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)


class _LandlockRulesetAttr(ctypes.Structure):
    _fields_ = [("fs", ctypes.c_uint64), ("net", ctypes.c_uint64), ("scoped", ctypes.c_uint64)]


class _LandlockPathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def restrict_writes_to(work: str) -> int:
    """Landlock: from now on this process and its children may change files beneath `work` only. Returns the
    Landlock ABI version used."""
    abi = _check(_libc.syscall(SYS_LANDLOCK_CREATE, None, 0, 1), "landlock_create_ruleset (version)")
    fs = sum(1 << b for b in (1, 4, 5, 6, 7, 8, 9, 10, 11, 12))  # write, remove, make anything
    fs |= (1 << 13 if abi >= 2 else 0) | (1 << 14 if abi >= 3 else 0) | (1 << 15 if abi >= 5 else 0)
    net = 0b11 if abi >= 4 else 0  # TCP bind and connect
    scoped = 0b11 if abi >= 6 else 0  # abstract unix sockets and signals outside the domain
    attr = _LandlockRulesetAttr(fs, net, scoped)
    size = 8 if abi < 4 else 16 if abi < 6 else 24
    ruleset = _check(_libc.syscall(SYS_LANDLOCK_CREATE, ctypes.byref(attr), size, 0), "landlock_create_ruleset")
    rule = _LandlockPathBeneath(fs, os.open(work, os.O_PATH | os.O_CLOEXEC))
    _check(_libc.syscall(SYS_LANDLOCK_ADD_RULE, ruleset, 1, ctypes.byref(rule), 0), "landlock_add_rule")
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    _check(_libc.syscall(SYS_LANDLOCK_RESTRICT, ruleset, 0), "landlock_restrict_self")
    os.close(rule.parent_fd)
    os.close(ruleset)
    return abi


def drop_privileges() -> None:
    """No capabilities, now or after exec; no gaining any through setuid or file capabilities."""
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    for cap in range(64):
        if _libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) < 0 and ctypes.get_errno() != 1:  # EINVAL: past the last
            break
    header = struct.pack("Ii", 0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    _check(_libc.capset(header, bytes(24)), "capset")


def install_seccomp(denied: dict[str, tuple[int | None, int | None]]) -> str:
    """Refuse the `denied` syscalls with EPERM (and kill on a foreign syscall ABI); filters stack, so a later
    call only adds to what is refused. Returns what was done."""
    machine = platform.machine()
    if machine not in AUDIT_ARCH:
        return f"no seccomp filter (hsmc has no syscall table for {machine})"
    numbers = sorted({nrs[machine == "aarch64"] for nrs in denied.values()} - {None})
    ld, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06
    m = len(numbers)
    prog = [(ld, 0, 0, 4), (jeq, 1, 0, AUDIT_ARCH[machine]), (ret, 0, 0, 0x80000000), (ld, 0, 0, 0)]
    if machine == "x86_64":
        prog.append((jge, m + 1, 0, 0x40000000))  # the x32 ABI
    prog += [(jeq, m - i, 0, nr) for i, nr in enumerate(numbers)]
    prog += [(ret, 0, 0, 0x7FFF0000), (ret, 0, 0, 0x00050000 | 1)]  # allow; EPERM
    filters = b"".join(struct.pack("HBBI", *insn) for insn in prog)
    buffer = ctypes.create_string_buffer(filters)
    fprog = struct.pack("HxxxxxxP", len(prog), ctypes.addressof(buffer))
    if _libc.prctl(PR_SET_SECCOMP, 2, fprog, 0, 0) < 0:
        return f"no seccomp filter ({os.strerror(ctypes.get_errno())})"
    return f"seccomp (refuses {', '.join(sorted(denied))})"


class CandidateGone(BaseException):
    """The candidate process died or broke the protocol; a BaseException so test code cannot swallow it."""


class _PlainData(pickle.Unpickler):
    SAFE = frozenset({"set", "frozenset", "complex", "bytearray", "range", "slice"})

    def find_class(self, module: str, name: str):
        if module == "builtins" and name in self.SAFE:
            return getattr(builtins, name)
        raise pickle.UnpicklingError(f"the candidate returned a {module}.{name}, not plain data")


class Channel:
    """Length-prefixed pickles to and from the candidate process."""

    def __init__(self, write_fd: int, read_fd: int) -> None:
        self.write_fd, self.read_fd = write_fd, read_fd

    def send(self, message: object) -> None:
        data = pickle.dumps(message)
        try:
            os.write(self.write_fd, struct.pack("<Q", len(data)))
            view = memoryview(data)
            while view:
                view = view[os.write(self.write_fd, view) :]
        except OSError as e:
            raise CandidateGone(f"candidate process gone ({e.strerror})") from None

    def _read(self, n: int) -> bytes:
        chunks = []
        while n:
            chunk = os.read(self.read_fd, min(n, 1 << 20))
            if not chunk:
                raise CandidateGone("candidate process exited before answering")
            chunks.append(chunk)
            n -= len(chunk)
        return b"".join(chunks)

    def receive(self) -> tuple:
        (size,) = struct.unpack("<Q", self._read(8))
        if size > MAX_MESSAGE:
            raise CandidateGone(f"candidate sent {size} bytes (limit {MAX_MESSAGE})")
        try:
            message = _PlainData(io.BytesIO(self._read(size))).load()
        except CandidateGone:
            raise
        except Exception as e:  # anything a hostile pickle can provoke
            raise CandidateGone(f"unreadable answer from the candidate ({type(e).__name__}: {e})") from None
        if not isinstance(message, tuple) or not message or message[0] not in ("ready", "return", "raise"):
            raise CandidateGone("candidate broke the protocol")
        return message


def _reraise(name: object, text: object) -> None:
    cls = getattr(builtins, str(name), None)
    if isinstance(cls, type) and issubclass(cls, Exception):
        raise cls(str(text))
    raise RuntimeError(f"{name}: {text}")


def run_tests(job: dict, work: str) -> tuple[bool, str]:
    """Execute the trusted prompt and test code here, the candidate in a child process; True when `check`
    returned normally with the candidate alive and well-behaved throughout."""
    namespace: dict = {"__name__": "harness"}
    exec(compile(job["prompt"], "prompt.py", "exec"), namespace)
    exec(compile(job["test"], "test.py", "exec"), namespace)
    check = namespace["check"]
    request_r, request_w = os.pipe()
    answer_r, answer_w = os.pipe()
    log = os.open(os.path.join(work, "candidate.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    env = {"PATH": "/usr/bin:/bin", "HOME": work, "TMPDIR": work, "LANG": "C.UTF-8"}
    limits = json.dumps(job["limits"])
    server = subprocess.Popen(
        [sys.executable, "-I", SERVER, limits, str(answer_w)],
        stdin=request_r,
        stdout=log,
        stderr=log,
        pass_fds=(answer_w,),
        cwd=work,
        env=env,
    )
    for fd in (request_r, answer_w, log):
        os.close(fd)
    channel = Channel(request_w, answer_r)

    def candidate(*args: object, **kwargs: object) -> object:
        channel.send(("call", args, kwargs))
        answer = channel.receive()
        if answer[0] == "return" and len(answer) == 2:
            return answer[1]
        if answer[0] == "raise" and len(answer) == 3:
            _reraise(answer[1], answer[2])
        raise CandidateGone("candidate broke the protocol")

    namespace[job["entry_point"]] = candidate  # tests may call it by name (HumanEval/33 does)
    try:
        channel.send(("load", job["program"], job["entry_point"]))
        answer = channel.receive()
        if answer[0] == "raise":
            return False, f"program failed to load: {answer[1]}: {answer[2]}"
        check(candidate)
        return True, "passed"
    except CandidateGone as e:
        return False, f"{e}: {_how_it_ended(server)}"
    except Exception as e:
        frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename == "test.py"]
        where = f" at test.py line {frames[-1].lineno}" if frames else ""
        return False, f"{type(e).__name__}{where}: {e}"[:500]
    finally:
        server.kill()
        server.wait()


def _how_it_ended(server: subprocess.Popen) -> str:
    try:
        code = server.wait(timeout=1)
    except subprocess.TimeoutExpired:
        return "it is still running"
    if code < 0:
        name = signal.Signals(-code).name
        return f"killed by {name}" + (" (CPU time limit)" if name == "SIGXCPU" else "")
    return f"it exited with status {code}"


def _status(**fields: object) -> None:
    sys.stderr.write(json.dumps(fields) + "\n")
    sys.stderr.flush()


def main() -> None:
    job_path = sys.argv[1]
    work = os.path.dirname(os.path.abspath(job_path))
    with open(job_path) as f:
        job = json.load(f)
    os.unlink(job_path)  # the candidate must not read the tests
    mode = job["isolation"]
    try:
        if mode == "namespaces":
            enter_namespaces(work)
        elif mode == "landlock":
            restrict_writes_to(work)
        drop_privileges()
        _libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        seccomp = install_seccomp(DENIED_SYSCALLS)
    except OSError as e:
        _status(status="setup", reason=f"{mode} isolation unavailable: {e}")
        sys.exit(SETUP_FAILED)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    passed, reason = run_tests(job, work)
    if passed:
        nonce = sys.stdin.readline()
        sys.stdout.write(nonce)
        sys.stdout.flush()
    _status(status="passed" if passed else "failed", reason=reason, layers=seccomp)


if __name__ == "__main__":
    main()
