"""Shared fixtures. Every test run writes its degs_jax cache into a pytest temp dir, never
into the user's ~/.cache (tests that need a fresh cache pass `cache_dir` explicitly).

The cache is shared by the whole run: this process, the other xdist workers (it is in the
run's temp root, beside the workers' own temp dirs) and the processes tests start
(through $DEGS_JAX_CACHE). So the built-in model is converted once per run, not once per
worker (concurrent loads wait on the entry's lock, then read it); it starts empty in every
run, so no test depends on an earlier one.

No test leaves JAX's persistent compilation cache on for the tests after it
(`_no_persistent_cache_left_on`): a script's `main` run in-process (bench/grpo_run.py in
test_grpo) turns it on for the whole process, and a CI worker that went on compiling with
it on crashed inside XLA's executable serialization (SIGABRT, then SIGSEGV, twice at the same
later test). Processes a test starts (the `degs` command) keep it, as users have it.

JAX sees four host CPU devices, so that test_sharding can build 2x2, 1x4 and 4x1 meshes;
everything else runs on the first one as usual. The flag must be set before JAX starts its
backend, and conftest is imported before any test module."""

import contextlib
import os

import pytest

os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=4"]).strip()


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
def _no_persistent_cache_left_on():
    with persistent_cache_restored():
        yield
