"""The XLA flags of the test processes, set by conftest.py before JAX starts its backend
(and inherited by the processes tests start).

HOST_DEVICES: JAX sees four host CPU devices, so that test_sharding can build 2x2, 1x4
and 4x1 meshes; everything else runs on the first one as usual.

FAST_COMPILE: XLA compiles the tests' programs without LLVM's optimizations (two of the
options `JAX_DISABLE_MOST_OPTIMIZATIONS=1` sets) and with its older loop emitters for
fusions (LOOP_EMITTERS) instead of the MLIR fusion emitters. Compiling is most of a CPU
test's time (86% of tests/test_decoders.py's, measured with JAX's compile-time events by
bench/suite_profile.py): the first two flags cut it by 43%, the loop emitters by 43% of
the rest (docs/benchmarks.md, "Tests compiled without LLVM's optimizations" and "The loop
emitters"). The loop emitters' code runs slower where the work is decoding real weights (a
135M-shape decode 1.4x, bench/loop_emitters.py), so the processes tests start to do mostly
that (the notebooks' kernels) compile without them (`decoding_flags`).

The programs are the same (the same HLO from the same code); their floats may round
differently from a user's (measured with the first two flags: bfloat16 entropies of the
golden model moved by 1e-3 relative, float32 values within the golden file's host
tolerance, no token or other discrete outcome). So every test that compares two runs
compares them compiled alike, and the one that compares numbers with a record made at a
user's optimization, tests/test_golden.py, computes its records in a process of its own
without FAST_COMPILE (`users_flags`). test_eval_cli's SIGKILL test starts its `degs`
processes without it too: they decode real weights batch-invariantly, where the
unoptimized code is slow. DEGS_TESTS_FULL_OPTIMIZATION=1 runs the whole suite as a user's
process compiles."""

from __future__ import annotations

import os

HOST_DEVICES = "--xla_force_host_platform_device_count=4"
LOOP_EMITTERS = "--xla_cpu_use_fusion_emitters=false"
FAST_COMPILE = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true", LOOP_EMITTERS)
FULL_OPTIMIZATION = os.environ.get("DEGS_TESTS_FULL_OPTIMIZATION") == "1"


def with_test_flags(flags: str) -> str:
    """`flags` (a process's XLA_FLAGS) with the test processes' flags added."""
    return " ".join([flags, HOST_DEVICES, *(() if FULL_OPTIMIZATION else FAST_COMPILE)]).strip()


def _without(flags: str, dropped) -> str:
    """`flags` (a process's XLA_FLAGS) without the flags for which `dropped(flag)` holds."""
    return " ".join(flag for flag in flags.split() if not dropped(flag))


def users_flags(flags: str) -> str:
    """`flags` without FAST_COMPILE: what a user's process compiles with."""
    return _without(flags, lambda flag: flag in FAST_COMPILE)


def compiles_fast(flags: str) -> bool:
    """Whether `flags` hold FAST_COMPILE (the test session's, unless
    DEGS_TESTS_FULL_OPTIMIZATION=1)."""
    return any(flag in FAST_COMPILE for flag in flags.split())


def decoding_flags(flags: str) -> str:
    """`flags` without LOOP_EMITTERS: for a process that spends its time decoding real
    weights rather than compiling (module docstring)."""
    return _without(flags, lambda flag: flag == LOOP_EMITTERS)


def one_host_device(flags: str) -> str:
    """`flags` without a host device count: a process with one CPU device (as the processes
    of a multi-process run each are), compiled as this one compiles."""
    return _without(flags, lambda flag: flag.startswith("--xla_force_host_platform_device_count"))
