"""Shared fixtures. Every test session writes its degs_jax cache into a pytest temp dir,
never into the user's ~/.cache (tests that need a fresh cache pass `cache_dir` explicitly)."""

import pytest


@pytest.fixture(autouse=True, scope="session")
def _isolated_degs_cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DEGS_JAX_CACHE", str(tmp_path_factory.mktemp("degs_jax_cache")))
        yield
