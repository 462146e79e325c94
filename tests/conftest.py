"""Shared fixtures. Every test session writes its degs_jax cache into a pytest temp dir,
never into the user's ~/.cache (tests that need a fresh cache pass `cache_dir` explicitly).

JAX sees four host CPU devices, so that test_sharding can build 2x2, 1x4 and 4x1 meshes;
everything else runs on the first one as usual. The flag must be set before JAX starts its
backend, and conftest is imported before any test module."""

import os

import pytest

os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=4"]).strip()


@pytest.fixture(autouse=True, scope="session")
def _isolated_degs_cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DEGS_JAX_CACHE", str(tmp_path_factory.mktemp("degs_jax_cache")))
        yield
