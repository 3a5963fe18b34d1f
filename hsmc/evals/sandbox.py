"""Run untrusted programs against their tests: each in its own process group and temporary directory, under
rlimits, without network or environment, isolated as strongly as this machine allows (see `jail.py`).

A program passes only when the harness prints the random nonce this process handed it, which it does after
`check(...)` returned; `sys.exit(0)`, `os._exit(0)` or a crash before that are failures.
"""

from __future__ import annotations

import functools
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from hsmc.errors import HsmcError

JAIL = Path(__file__).with_name("jail.py")
ISOLATION_MODES = ("namespaces", "landlock", "rlimits")  # strongest first
ISOLATION_DESCRIPTIONS = {
    "namespaces": "namespaces (mount: read-only outside the work dir, pid, net, ipc, uts)",
    "landlock": "landlock (writes only in the work dir, no TCP)",
    "rlimits": "rlimits only (NO filesystem isolation: neither namespaces nor Landlock work here)",
}


@dataclass(frozen=True)
class Limits:
    timeout_s: float = 10.0  # wall clock for the whole run; then the process group is killed
    cpu_s: int = 10  # the candidate's CPU seconds
    memory_mb: int = 1024  # the candidate's address space
    file_size_mb: int = 16  # largest file the candidate may write
    open_files: int = 64


@dataclass(frozen=True)
class Program:
    prompt: str  # trusted code the tests may use (HumanEval's prompt: imports, helper functions)
    program: str  # the untrusted program; it must define `entry_point`
    test: str  # trusted test code defining `check(candidate)`
    entry_point: str


@dataclass
class Outcome:
    passed: bool
    reason: str  # "passed", or why not: the failing assertion, "timeout", the candidate's exit
    seconds: float
    output: str  # the tail of what the candidate printed
    layers: str = ""  # what the harness added to the isolation mode (the seccomp filter, or why none)


class Sandbox:
    def __init__(self, limits: Limits = Limits(), isolation: str = "auto", workers: int | None = None) -> None:
        self.limits = limits
        self.workers = workers or os.cpu_count() or 1
        if isolation not in ("auto", *ISOLATION_MODES):
            raise HsmcError(f"isolation {isolation!r} is not one of auto, {', '.join(ISOLATION_MODES)}")
        candidates = ISOLATION_MODES if isolation == "auto" else (isolation,)
        problems = []
        for mode in candidates:
            outcome = probe(mode)
            if outcome.passed:
                self.isolation, self.layers = mode, outcome.layers
                break
            problems.append(f"{mode}: {outcome.reason}")
        else:
            raise HsmcError(f"no sandbox can run programs here ({'; '.join(problems)})")

    def describe(self) -> str:
        return f"{ISOLATION_DESCRIPTIONS[self.isolation]} + {self.layers} + rlimits; {self.workers} workers"

    def run(self, program: Program) -> Outcome:
        return execute(program, self.isolation, self.limits)

    def run_all(self, programs: Sequence[Program]) -> Iterator[Outcome]:
        """Outcomes in the order of `programs`, computed by parallel workers."""
        with ThreadPoolExecutor(self.workers) as pool:
            yield from pool.map(self.run, programs)


def execute(program: Program, isolation: str, limits: Limits) -> Outcome:
    """One run of `program` through `jail.py`, in a fresh temporary directory removed afterwards."""
    work = tempfile.mkdtemp(prefix="hsmc-sandbox-")
    try:
        job = {**asdict(program), "isolation": isolation, "limits": asdict(limits)}
        job_path = os.path.join(work, "job.json")
        with open(job_path, "w") as f:
            json.dump(job, f)
        nonce = secrets.token_hex(16)
        start = time.perf_counter()
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", str(JAIL), job_path],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=work,
            env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
            start_new_session=True,
        )
        try:
            out, err = proc.communicate(f"{nonce}\n".encode(), timeout=limits.timeout_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            timed_out = True
        seconds = time.perf_counter() - start
        status = _last_status(err.decode(errors="replace"))
        passed = out.decode(errors="replace").strip() == nonce and not timed_out
        if timed_out:
            reason = f"timeout after {limits.timeout_s:g} s"
        elif passed:
            reason = "passed"
        else:
            reason = status.get("reason") or f"harness exited with status {proc.returncode} without a verdict"
        layers = str(status.get("layers", ""))
        return Outcome(passed, str(reason), seconds, _tail(Path(work) / "candidate.log"), layers)
    finally:
        _remove(work)


def _last_status(stderr: str) -> dict:
    for line in reversed(stderr.strip().splitlines()):
        try:
            status = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(status, dict):
            return status
    return {"reason": stderr.strip()[-300:]} if stderr.strip() else {}


def _tail(path: Path, size: int = 2000) -> str:
    try:
        with path.open("rb") as f:
            f.seek(max(0, path.stat().st_size - size))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def _remove(work: str) -> None:
    """Delete the temporary directory even where the program took away its own permissions."""

    def make_writable_and_retry(function, path, _exc) -> None:
        os.chmod(os.path.dirname(path), 0o700)
        if os.path.isdir(path) and not os.path.islink(path):
            os.chmod(path, 0o700)
        function(path)

    if sys.version_info >= (3, 12):
        shutil.rmtree(work, onexc=make_writable_and_retry)
    else:
        shutil.rmtree(work, onerror=make_writable_and_retry)


PROBE = Program(
    prompt="", program="def f():\n    return 1\n", test="def check(c):\n    assert c() == 1\n", entry_point="f"
)


@functools.cache
def probe(isolation: str) -> Outcome:
    """One trivial program run through `isolation`: it passes where the mode works on this machine."""
    return execute(PROBE, isolation, Limits(timeout_s=30))
