"""Shared fixtures. Every test run writes its degs_jax cache into a pytest temp dir, never
into the user's ~/.cache (tests that need a fresh cache pass `cache_dir` explicitly).

JAX sees four host CPU devices, so that test_sharding can build 2x2, 1x4 and 4x1 meshes;
everything else runs on the first one as usual. The flag must be set before JAX starts its
backend, and conftest is imported before any test module.

Both caches below are shared by the whole run: this process, the other xdist workers (the
directories are in the run's temp root, beside the workers' own temp dirs) and the
processes the tests start (through the environment). They start empty in every run, so no
test depends on an earlier one.
  * degs_jax's converted weights ($DEGS_JAX_CACHE): the built-in model is converted once
    per run, not once per worker (concurrent loads wait on the entry's lock, then read it).
  * JAX's persistent compilation cache, with no minimum compile time: a program that one
    worker or process compiled is read, not compiled again, by the others. Tests about the
    cache itself, or that need a cold one, pass their own directory."""

import os

import pytest

os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=4"]).strip()


def _run_directory(tmp_path_factory, name):
    """`name` in the temp root of this run, the same directory in every xdist worker."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # a worker's basetemp is <run root>/popen-gwN
        root = root.parent
    directory = root / name
    directory.mkdir(exist_ok=True)
    return directory


@pytest.fixture(autouse=True, scope="session")
def _isolated_degs_cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DEGS_JAX_CACHE", str(_run_directory(tmp_path_factory, "degs_jax_cache")))
        yield


@pytest.fixture(autouse=True, scope="session")
def _shared_compilation_cache(tmp_path_factory):
    import jax

    settings = {"jax_compilation_cache_dir": str(_run_directory(tmp_path_factory, "xla")),
                "jax_persistent_cache_min_compile_time_secs": 0}
    before = {name: getattr(jax.config, name) for name in settings}
    with pytest.MonkeyPatch.context() as mp:
        for name, value in settings.items():
            jax.config.update(name, value)
            mp.setenv(name.upper(), str(value))  # for the processes the tests start
        yield
    for name, value in before.items():
        jax.config.update(name, value)
