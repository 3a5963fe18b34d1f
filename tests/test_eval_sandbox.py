"""The sandbox: hostile programs fail with nothing outside their temporary directory touched, only the
harness's nonce counts as a pass, HumanEval's canonical solutions pass and corrupted ones fail.

Every hostile program would *pass* its test if its attack worked (it returns the right answer only then),
so each test shows the attack was stopped, not merely that something failed. They run in each isolation mode
with filesystem isolation that works on this machine (namespaces, landlock)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import tempfile
import textwrap
import time

import pytest

from hsmc.errors import HsmcError
from hsmc.evals import sandbox as sandbox_module
from hsmc.evals.sandbox import ISOLATION_MODES, Limits, Program, Sandbox, execute, probe

CHECK = "def check(candidate):\n    assert abs(candidate(2) - 4) < 1e-9\n"
LIMITS = Limits(timeout_s=6, cpu_s=1, memory_mb=512)
ISOLATING = [
    pytest.param(mode, marks=pytest.mark.skipif(not probe(mode).passed, reason=f"{mode}: {probe(mode).reason}"))
    for mode in ("namespaces", "landlock")
]


def run(program: str, mode: str, limits: Limits = LIMITS):
    return execute(Program("", textwrap.dedent(program), CHECK, "f"), mode, limits)


@pytest.mark.parametrize("mode", ISOLATION_MODES)
def test_an_honest_program_passes_and_a_wrong_one_fails(mode):
    assert run("def f(x):\n    return x * 2\n", mode).passed
    outcome = run("def f(x):\n    return x * 3\n", mode)
    assert not outcome.passed and outcome.reason.startswith("AssertionError at test.py line 2")


def test_namespaces_work_wherever_the_unshare_tool_does():
    """The strongest mode is used here whenever the OS allows namespaces (checked with util-linux unshare)."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare binary to cross-check with")
    flags = ["--mount", "--net", "--pid", "--fork"] if os.geteuid() == 0 else ["-rmn", "--pid", "--fork"]
    works = subprocess.run(["unshare", *flags, "true"], capture_output=True).returncode == 0
    assert probe("namespaces").passed == works
    if works:
        assert Sandbox().isolation == "namespaces"
        assert Sandbox().describe().startswith("namespaces (mount: read-only outside the work dir")


def test_explicit_isolation_mode_that_does_not_exist_is_one_clear_error():
    with pytest.raises(HsmcError, match="isolation 'chroot' is not one of auto, namespaces, landlock, rlimits"):
        Sandbox(isolation="chroot")


@pytest.mark.parametrize("mode", ISOLATING)
def test_rm_rf_outside_the_temp_dir_leaves_the_sentinel(mode, tmp_path):
    sentinel = tmp_path / "keep" / "sentinel.txt"
    sentinel.parent.mkdir()
    sentinel.write_text("precious")
    outcome = run(
        f"""
        import os, shutil
        shutil.rmtree({str(sentinel.parent)!r}, ignore_errors=True)
        os.system("rm -rf {sentinel.parent}")
        def f(x):
            return 4 if not os.path.exists({str(sentinel)!r}) else 0
        """,
        mode,
    )
    assert not outcome.passed
    assert sentinel.read_text() == "precious"


@pytest.mark.parametrize("mode", ISOLATING)
def test_writing_outside_the_temp_dir_fails(mode, tmp_path):
    target = tmp_path / "evil.txt"
    outcome = run(
        f"""
        def f(x):
            try:
                open({str(target)!r}, "w").write("pwned")
            except OSError:
                return 0
            return 4
        """,
        mode,
    )
    assert not outcome.passed and not target.exists()
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("mode", ISOLATING)
def test_socket_to_localhost_is_refused(mode):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.setblocking(False)
        port = server.getsockname()[1]
        outcome = run(
            f"""
            import socket
            def f(x):
                with socket.create_connection(("127.0.0.1", {port}), timeout=2) as s:
                    s.sendall(b"exfiltrated")
                return 4
            """,
            mode,
        )
        assert not outcome.passed and "PermissionError" in outcome.reason
        with pytest.raises(BlockingIOError):
            server.accept()  # nobody connected


@pytest.mark.parametrize("mode", ISOLATING)
@pytest.mark.parametrize(
    "spawn",
    [
        "os.system('echo 4 > out.txt') == 0 and open('out.txt').read().strip() == '4'",
        "subprocess.run(['sh', '-c', 'echo 4'], capture_output=True).stdout.strip() == b'4'",
        "os.fork() >= 0",
        "os.execv('/bin/sh', ['sh', '-c', 'true']) is None",
    ],
    ids=["os.system", "subprocess", "fork", "exec"],
)
def test_spawning_a_shell_or_process_fails(mode, spawn):
    outcome = run(f"import os, subprocess\ndef f(x):\n    return 4 if {spawn} else 0\n", mode)
    assert not outcome.passed


@pytest.mark.parametrize("mode", ISOLATING)
def test_fork_bomb_fails_fast_and_the_suite_goes_on(mode):
    outcome = run("import os\nwhile True:\n    os.fork()\n", mode)
    assert not outcome.passed and "PermissionError" in outcome.reason
    assert outcome.seconds < LIMITS.timeout_s


@pytest.mark.parametrize("mode", ISOLATING)
def test_infinite_loop_is_stopped_by_the_cpu_limit(mode):
    outcome = run("def f(x):\n    while True:\n        pass\n", mode)
    assert not outcome.passed and "SIGXCPU" in outcome.reason
    assert outcome.seconds < LIMITS.timeout_s


@pytest.mark.parametrize("mode", ISOLATING)
def test_sleeping_forever_is_killed_by_the_wall_clock(mode):
    limits = Limits(timeout_s=1.5, cpu_s=1, memory_mb=512)
    start = time.perf_counter()
    outcome = run("import time\ndef f(x):\n    time.sleep(600)\n", mode, limits)
    assert not outcome.passed and outcome.reason == "timeout after 1.5 s"
    assert time.perf_counter() - start < limits.timeout_s + 3


@pytest.mark.parametrize("mode", ISOLATING)
def test_memory_bomb_fails(mode):
    # zero-filling 512 MB costs CPU time, more on a loaded machine: a CPU budget the address space runs out before
    limits = Limits(timeout_s=20, cpu_s=5, memory_mb=512)
    outcome = run("blocks = []\nwhile True:\n    blocks.append(bytearray(50 << 20))\n", mode, limits)
    assert not outcome.passed and "MemoryError" in outcome.reason


@pytest.mark.parametrize("mode", ISOLATING)
def test_environment_secret_of_the_parent_is_not_visible(mode, monkeypatch):
    monkeypatch.setenv("HSMC_TEST_SECRET", "hunter2")
    outcome = run(
        """
        import glob, os
        def found():
            if "hunter2" in str(os.environ):
                return True
            for path in glob.glob("/proc/*/environ"):
                try:
                    if b"hunter2" in open(path, "rb").read():
                        return True
                except OSError:
                    pass
            return False
        def f(x):
            return 4 if found() else 0
        """,
        mode,
    )
    assert not outcome.passed and outcome.reason.startswith("AssertionError")


@pytest.mark.parametrize("mode", ISOLATION_MODES)
@pytest.mark.parametrize(
    "exit_code",
    [
        "import sys\nsys.exit(0)\n",
        "import os\nos._exit(0)\n",
        "raise SystemExit(0)\n",
        "def f(x):\n    raise SystemExit(0)\n",
        "import os\ndef f(x):\n    os._exit(0)\n",
    ],
    ids=["sys.exit", "os._exit", "SystemExit", "SystemExit-in-call", "os._exit-in-call"],
)
def test_exiting_before_the_asserts_fails(mode, exit_code):
    outcome = run(exit_code, mode)
    assert not outcome.passed and "exited with status 0" in outcome.reason


@pytest.mark.parametrize("mode", ISOLATION_MODES)
def test_monkey_patching_builtins_does_not_make_asserts_vanish(mode):
    outcome = run(
        """
        import builtins, sys
        builtins.abs = lambda value: 0
        builtins.AssertionError = type("Harmless", (Exception,), {})
        builtins.compile = lambda *a, **k: compile("pass", "x", "exec")
        sys.modules["builtins"].__dict__["isinstance"] = lambda *a: True
        def f(x):
            return 5
        """,
        mode,
    )
    assert not outcome.passed and outcome.reason.startswith("AssertionError at test.py line 2")


@pytest.mark.parametrize("mode", ISOLATION_MODES)
def test_objects_that_equal_anything_do_not_pass(mode):
    outcome = run(
        """
        class Anything(float):
            def __eq__(self, other): return True
            def __sub__(self, other): return 0.0
            def __lt__(self, other): return True
        def f(x):
            return Anything(0)
        """,
        mode,
    )
    assert not outcome.passed and "cannot be sent back" in outcome.reason


@pytest.mark.parametrize("mode", ISOLATION_MODES)
def test_the_program_cannot_learn_the_nonce(mode, monkeypatch):
    """It reads every file descriptor of its own, of its parent (the harness) and of pid 1 (the harness in a
    pid namespace), prints what it finds and exits 0: the nonce never reaches it, and the run fails."""
    nonce = "5ecret0nce" * 3
    monkeypatch.setattr(sandbox_module.secrets, "token_hex", lambda _: nonce)
    outcome = run(
        """
        import glob, os, sys
        paths = ["/dev/stdin"] + [p for pid in ("self", os.getppid(), 1) for p in glob.glob(f"/proc/{pid}/fd/*")]
        for path in paths:
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
                print(path, os.read(fd, 100))
            except OSError as e:
                print(path, e)
        sys.stdout.flush()
        os._exit(0)
        """,
        mode,
    )
    assert not outcome.passed and "/proc/" in outcome.output  # it did look
    assert nonce not in outcome.output


@pytest.mark.parametrize("mode", ISOLATING)
def test_signals_reach_no_process_outside(mode):
    outcome = run("import os\ndef f(x):\n    os.kill(-1, 0)\n    os.kill(os.getppid(), 0)\n    return 4\n", mode)
    assert not outcome.passed and ("PermissionError" in outcome.reason or "ProcessLookupError" in outcome.reason)


def test_capabilities_are_dropped():
    outcome = run(
        "def f(x):\n    return 4 if 'CapEff:\\t0000000000000000' not in open('/proc/self/status').read() else 0\n",
        "rlimits",
    )
    assert not outcome.passed


def test_parallel_workers_keep_order_and_overlap():
    sandbox = Sandbox(Limits(timeout_s=20), workers=4)
    programs = [
        Program("", f"import time\ndef f(x):\n    time.sleep(1.5)\n    return {4 if i % 2 else 5}\n", CHECK, "f")
        for i in range(4)
    ]
    start = time.perf_counter()
    outcomes = list(sandbox.run_all(programs))
    elapsed = time.perf_counter() - start
    assert [o.passed for o in outcomes] == [False, True, False, True]
    assert elapsed < 4 * 1.5  # run one after another they would need at least 6 s


def test_temporary_directories_are_removed():
    before = set(os.listdir(tempfile.gettempdir()))
    outcome = run("import os\nos.chmod('.', 0)\ndef f(x):\n    return 4\n", Sandbox().isolation)
    assert outcome.passed
    leftover = {d for d in set(os.listdir(tempfile.gettempdir())) - before if d.startswith("hsmc-sandbox-")}
    assert leftover == set()


def _unprivileged_python() -> str | None:
    """A system python >= 3.10 an unprivileged user can run (a venv under /root usually is not)."""
    python = shutil.which("python3", path="/usr/bin:/bin")
    if os.geteuid() != 0 or shutil.which("setpriv") is None or python is None:
        return None
    probe_run = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", python, "-c"]
    ok = subprocess.run([*probe_run, "import sys; assert sys.version_info >= (3, 10)"], capture_output=True)
    return python if ok.returncode == 0 else None


@pytest.mark.skipif(_unprivileged_python() is None, reason="needs root, setpriv and a system python >= 3.10")
@pytest.mark.parametrize("mode", ["namespaces", "landlock"])
def test_an_unprivileged_user_gets_the_same_isolation(mode):
    """Non-root users take the user-namespace path of the jail. As uid 65534 (nobody): a directory nobody
    owns is deletable by it outside the sandbox (the control), and survives the same attack inside."""
    python = _unprivileged_python()
    as_nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    target, control, work = (tempfile.mkdtemp(prefix="hsmc-test-") for _ in range(3))
    try:
        for d in (target, control, work):
            os.chown(d, 65534, 65534)
        attack = "import shutil\nshutil.rmtree({!r})\n"
        subprocess.run([*as_nobody, python, "-c", attack.format(control)], check=True)
        assert not os.path.exists(control)
        program = attack.format(target) + "def f(x):\n    return 4\n"
        job = {**vars(Program("", program, CHECK, "f")), "isolation": mode, "limits": vars(LIMITS)}
        job_path = os.path.join(work, "job.json")
        with open(job_path, "w") as f:
            json.dump(job, f)
        os.chown(job_path, 65534, 65534)
        for script in (sandbox_module.JAIL, sandbox_module.JAIL.with_name("candidate_server.py")):
            shutil.copy(script, work)  # the checkout may sit where nobody cannot read
        jail = [python, "-I", "-S", os.path.join(work, sandbox_module.JAIL.name), job_path]
        done = subprocess.run([*as_nobody, *jail], input=b"n0nce\n", capture_output=True, cwd=work, timeout=60)
        status = done.stderr.decode().strip().splitlines()[-1]
        assert done.stdout == b"" and '"status": "failed"' in status  # no nonce: the attack failed
        assert "Read-only file system" in status or "Permission denied" in status
        assert os.path.isdir(target)
    finally:
        for d in (target, control, work):
            shutil.rmtree(d, ignore_errors=True)
