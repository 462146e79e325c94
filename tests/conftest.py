"""Shared fixtures. Every test run writes its degs_jax cache into a pytest temp dir, never
into the user's ~/.cache (tests that need a fresh cache pass `cache_dir` explicitly).

The cache is shared by the whole run: this process, the other xdist workers (it is in the
run's temp root, beside the workers' own temp dirs) and the processes tests start
(through $DEGS_JAX_CACHE). So the built-in model is converted once per run, not once per
worker (concurrent loads wait on the entry's lock, then read it); it starts empty in every
run, so no test depends on an earlier one.

A worker process never runs out of memory mappings (`_memory_maps_kept_below_limit`):
every executable XLA compiles for the CPU is loaded into mappings of its own (about 6 for a
small program, measured) and JAX's caches keep them all, so a worker that has compiled
through half the suite nears the kernel's `vm.max_map_count` (65,530 by default). There
the next compilation fails inside LLVM ("Cannot allocate memory") and the interpreter dies
(SIGSEGV or SIGABRT): CI lost a worker that way at the same test in four runs, and the
crash is reproduced by filling the mappings to 300 below the limit before that test.
After a test that leaves the process above half the limit, JAX's caches are cleared.

The whole run shares one JAX persistent compilation cache (`_run_wide_compilation_cache`),
`xla/` in that shared degs_jax cache: the directory the `degs` processes tests start use
by default (`models/compilation.py`), and every xdist worker's own compilations. A program
compiled once in the run (the same method, shapes and settings in another test, the other
worker, or after `_memory_maps_kept_below_limit` cleared JAX's caches) is loaded, not
compiled again: XLA's compilation is most of the suite's time on a CPU, and a loaded
executable is the compiled one, so no result changes. No test leaves other persistent-cache
settings behind for the tests after it (`_persistent_cache_settings_kept`): a script's `main`
run in-process (bench/grpo_run.py in test_grpo) points the cache at its own directory, and
the later compilations of the process would write into that test's temporary directory.

The tests run on the built-in SmolLM2-135M where they need real weights
(`_tests_default_to_the_135m_model`): the library's default model, Qwen2.5-Coder-0.5B, is
four times the work per token; its own tests (test_real_weights, test_gguf_tokenizer)
name it. Processes a test starts name `--model smollm2-135m` themselves.

XLA's flags for the run (tests/xla_flags.py: four host CPU devices, and compilation
without LLVM's optimizations) must be set before JAX starts its backend, and conftest is
imported before any test module."""

import contextlib
import os
import shutil
import tempfile

import pytest

from xla_flags import with_test_flags

os.environ["XLA_FLAGS"] = with_test_flags(os.environ.get("XLA_FLAGS", ""))
# The library's default persistent cache (models/compilation.py) stays off in this process
# and in the Python processes tests start, whose stderr the tests read: the run's own cache
# is turned on explicitly (`_run_wide_compilation_cache`, the `degs` program), and
# tests/test_compilation_cache.py tests the default in processes of its own.
os.environ["DEGS_JAX_COMPILATION_CACHE"] = "0"


def _free_disk_gib() -> float:
    return shutil.disk_usage(tempfile.gettempdir()).free / 2**30


# The free disk under the temp root (the run's caches and temp dirs), at the start and at its
# lowest after any test phase, printed at the end: CI's disk is shared, and a run that finds too
# little fails in whichever test writes next.
_free_disk = {}


def pytest_sessionstart(session):
    _free_disk["start"] = _free_disk["lowest"] = _free_disk_gib()
    _free_disk["after"] = "the start"


def pytest_runtest_logreport(report):
    """After each phase of each test (the xdist controller sees every worker's reports); a
    test's temp dir is still there after its call phase."""
    free = _free_disk_gib()
    if free < _free_disk["lowest"]:
        _free_disk["lowest"], _free_disk["after"] = free, f"{report.nodeid} ({report.when})"


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line(
        f"free disk under {tempfile.gettempdir()}: {_free_disk['start']:.1f} GiB at the start, "
        f"{_free_disk['lowest']:.1f} GiB at the lowest (after {_free_disk['after']})")


@pytest.fixture(autouse=True, scope="session")
def _isolated_degs_cache(tmp_path_factory):
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # a worker's basetemp is <run root>/popen-gwN
        root = root.parent
    cache = root / "degs_jax_cache"
    cache.mkdir(exist_ok=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DEGS_JAX_CACHE", str(cache))
        yield


# Programs that compile faster than this stay out of the run's persistent cache: a
# compilation of a few elementwise operations (~0.05 s) costs about what writing and
# reading its entry does.
RUN_CACHE_MIN_COMPILE_SECONDS = 0.2


@pytest.fixture(autouse=True, scope="session")
def _run_wide_compilation_cache(_isolated_degs_cache):
    """JAX's persistent compilation cache on for the whole run, in the run's degs_jax cache
    (module docstring); off again when the session ends."""
    import jax

    from degs_jax.models.compilation import enable_compilation_cache

    with persistent_cache_restored():
        enable_compilation_cache(os.path.join(os.environ["DEGS_JAX_CACHE"], "xla"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", RUN_CACHE_MIN_COMPILE_SECONDS)
        yield


TEST_MODEL = "smollm2-135m"


@pytest.fixture(autouse=True, scope="session")
def _tests_default_to_the_135m_model():
    from degs_jax.models import loading

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(loading, "DEFAULT_MODEL", TEST_MODEL)
        yield


_PERSISTENT_CACHE_OPTIONS = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")


@contextlib.contextmanager
def persistent_cache_restored():
    """On leaving, JAX's persistent-cache options are as they were on entering, and JAX's
    cache object is reset where they had changed (module docstring)."""
    import jax
    from jax._src import compilation_cache  # reset_cache: JAX's own way back to no cache

    before = {name: getattr(jax.config, name) for name in _PERSISTENT_CACHE_OPTIONS}
    try:
        yield
    finally:
        changed = {name: value for name, value in before.items() if getattr(jax.config, name) != value}
        for name, value in changed.items():
            jax.config.update(name, value)
        if changed:
            compilation_cache.reset_cache()


@pytest.fixture(autouse=True)
def _persistent_cache_settings_kept():
    with persistent_cache_restored():
        yield


def memory_map_count() -> int:
    """The number of memory mappings of this process (lines of /proc/self/maps; 0 where
    there is no /proc)."""
    try:
        with open("/proc/self/maps", "rb") as maps:
            return sum(1 for _ in maps)
    except OSError:
        return 0


def _memory_map_limit() -> int:
    try:
        with open("/proc/sys/vm/max_map_count") as limit:
            return int(limit.read())
    except (OSError, ValueError):
        return 65530  # the kernel's default


MEMORY_MAP_LIMIT = _memory_map_limit()
# Clear JAX's caches once the process holds more mappings than this; raised when a clearing
# gives back too little (what JAX does not hold), so that it never runs after every test.
_clear_above = [MEMORY_MAP_LIMIT // 2]


@pytest.fixture(autouse=True)
def _memory_maps_kept_below_limit():
    """Clear JAX's caches (and with them the compiled executables' mappings) after a test
    that leaves more than half of vm.max_map_count mapped (module docstring)."""
    yield
    if memory_map_count() > _clear_above[0]:
        import gc

        import jax

        jax.clear_caches()
        gc.collect()
        _clear_above[0] = max(MEMORY_MAP_LIMIT // 2, memory_map_count() + MEMORY_MAP_LIMIT // 4)
