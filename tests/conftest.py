"""Shared fixtures. Every test run writes its degs_jax cache into a pytest temp dir, never
into the user's ~/.cache (tests that need a fresh cache pass `cache_dir` explicitly).

The cache is shared by the whole run: this process, the other xdist workers (it is in the
run's temp root, beside the workers' own temp dirs) and the processes tests start
(through $DEGS_JAX_CACHE). So the built-in model is converted once per run, not once per
worker (concurrent loads wait on the entry's lock, then read it); it starts empty in every
run, so no test depends on an earlier one.

JAX sees four host CPU devices, so that test_sharding can build 2x2, 1x4 and 4x1 meshes;
everything else runs on the first one as usual. The flag must be set before JAX starts its
backend, and conftest is imported before any test module."""

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
