"""JAX's persistent compilation cache as degs_jax uses it: an entry cut short (a full
disk, a killed process) is removed at start-up, so the next run writes it anew instead
of compiling it on every run."""

import os
import subprocess
import sys
import time

import pytest

from degs_jax.models import compilation

# Compiles one small program (and nothing else) with the cache in DIR; prints "hit" when
# it came from the cache (JAX's own event), "miss" otherwise.
_RUN = r'''
import sys
import jax
import numpy as np
from jax import monitoring
from degs_jax.models.compilation import enable_compilation_cache
hits = []
monitoring.register_event_listener(
    lambda name, **kw: hits.append(name) if name == "/jax/compilation_cache/cache_hits" else None)
enable_compilation_cache(sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.jit(lambda x: (x @ x.T).sum() * 3.0)(np.ones((8, 8), np.float32)).block_until_ready()
print("hit" if hits else "miss")
'''


def run(directory):
    done = subprocess.run([sys.executable, "-c", _RUN, str(directory)], capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert done.returncode == 0, done.stderr
    return done.stdout.strip(), done.stderr


def age(path, seconds):
    stamp = time.time() - seconds
    os.utime(path, (stamp, stamp))


def test_a_truncated_entry_is_removed_and_written_again(tmp_path):
    cache = tmp_path / "xla"
    assert run(cache)[0] == "miss"
    (entry,) = cache.glob("*-cache")
    # Intact entries are kept and recorded; a recorded one is not read again.
    age(entry, 2 * compilation.SETTLED_SECONDS)
    assert compilation.remove_damaged_entries(cache) == []
    young = cache / "young-cache"
    young.write_bytes(b"still being written")
    garbled = cache / "garbled-cache"
    garbled.write_bytes(b"not compressed")
    (cache / "garbled-atime").write_bytes(b"\0" * 8)
    age(garbled, 2 * compilation.SETTLED_SECONDS)
    reads = []
    real = compilation.Path.read_bytes
    compilation.Path.read_bytes = lambda self: reads.append(self.name) or real(self)
    try:
        assert compilation.remove_damaged_entries(cache) == ["garbled-cache"]
    finally:
        compilation.Path.read_bytes = real
    assert reads == ["garbled-cache"]  # not the recorded entry, not yet the young one
    assert sorted(p.name for p in cache.iterdir()) == sorted(
        [entry.name, "young-cache", "degs-verified.json"])
    young.unlink()
    # Cut short as a full disk leaves it, long enough ago that no writer is still at it:
    # removed at start-up, compiled and written anew, then read from the cache again.
    entry.write_bytes(entry.read_bytes()[: entry.stat().st_size // 2])
    age(entry, 2 * compilation.SETTLED_SECONDS)
    outcome, err = run(cache)
    assert outcome == "miss" and "removed 1 damaged entries" in err, err
    assert run(cache)[0] == "hit"


def test_a_test_cannot_leave_the_persistent_cache_on(tmp_path, monkeypatch):
    """conftest puts JAX's persistent-cache options back after every test, and resets JAX's
    cache object (a bench script's main run in-process turned the cache on for the rest of a
    worker, whose later compilations then wrote into that test's temporary directory).
    Nothing is compiled here."""
    import jax
    from jax._src import compilation_cache as jax_cache

    from conftest import persistent_cache_restored

    resets = []
    monkeypatch.setattr(jax_cache, "reset_cache", lambda: resets.append(1))
    options = lambda: (jax.config.jax_compilation_cache_dir,
                       jax.config.jax_persistent_cache_min_compile_time_secs)
    before = options()
    with persistent_cache_restored():
        compilation.enable_compilation_cache(tmp_path / "xla")
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 2.0)
        assert options() == (str(tmp_path / "xla"), 2.0) != before
    assert options() == before and resets == [1]
    with persistent_cache_restored():  # nothing changed: nothing reset
        pass
    assert resets == [1]


def test_clearing_jax_caches_unmaps_the_compiled_programs():
    """What conftest's `_memory_maps_kept_below_limit` relies on: each executable compiled
    for the CPU holds memory mappings of its own while JAX's caches keep it, and
    `jax.clear_caches()` gives them back (a CI worker that had compiled through half the
    suite reached vm.max_map_count and crashed in LLVM at its next compilation)."""
    import gc

    import jax
    import jax.numpy as jnp

    from conftest import memory_map_count

    if memory_map_count() == 0:
        pytest.skip("no /proc/self/maps here")
    jax.clear_caches()
    gc.collect()
    start = memory_map_count()
    # 60 programs of functions that stay alive, as the library's module-level jitted ones do
    functions = [jax.jit(lambda x, i=i: jnp.tanh(x * i) @ x.T) for i in range(60)]
    for f in functions:
        f(jnp.ones((4, 4))).block_until_ready()
    grown = memory_map_count() - start
    assert grown >= 120, grown  # measured: about 6 mappings per executable
    jax.clear_caches()
    gc.collect()
    given_back = start + grown - memory_map_count()
    assert given_back >= 120, (grown, given_back)  # measured: 180 of 257 (the rest: thread pools)


# A library user's script: imports degs_jax.models (the default cache's switch) and compiles
# one small program; prints "hit"/"miss" as _RUN does, and JAX's cache directory.
_LIBRARY_USER = r'''
import jax
import numpy as np
from jax import monitoring
hits = []
monitoring.register_event_listener(
    lambda name, **kw: hits.append(name) if name == "/jax/compilation_cache/cache_hits" else None)
import degs_jax.models
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.jit(lambda x: (x @ x.T).sum() * 3.0)(np.ones((8, 8), np.float32)).block_until_ready()
print("hit" if hits else "miss", jax.config.jax_compilation_cache_dir)
'''


def run_library_user(**env):
    done = subprocess.run([sys.executable, "-c", _LIBRARY_USER], capture_output=True, text=True,
                          timeout=120, env={k: v for k, v in dict(os.environ, JAX_PLATFORMS="cpu", **env).items()
                                            if v is not None})
    assert done.returncode == 0, done.stderr
    return done.stdout.split(), done.stderr


def test_the_cache_is_on_by_default_for_library_users_and_theirs_wins(tmp_path):
    cache = tmp_path / "degs"
    default = {"DEGS_JAX_CACHE": str(cache), "JAX_COMPILATION_CACHE_DIR": None,
               compilation.DEFAULT_SWITCH: None}
    (outcome, where), err = run_library_user(**default)
    assert (outcome, where) == ("miss", str(cache / "xla")) and list((cache / "xla").glob("*-cache"))
    line = f"degs_jax: compiled programs are kept in {cache / 'xla'} (JAX's persistent compilation cache"
    assert err.count(line) == 1, err
    assert run_library_user(**default)[0] == ["hit", str(cache / "xla")]  # the next script loads it
    # the user's own directory wins, without the line; the switch turns the default off
    (outcome, where), err = run_library_user(**{**default, "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "mine")})
    assert (outcome, where) == ("miss", str(tmp_path / "mine")) and "degs_jax:" not in err
    assert list((tmp_path / "mine").glob("*-cache"))
    (outcome, *where), err = run_library_user(**{**default, compilation.DEFAULT_SWITCH: "0",
                                                 "DEGS_JAX_CACHE": str(tmp_path / "off")})
    assert outcome == "miss" and where in ([], ["None"]) and not (tmp_path / "off").exists() and "degs_jax:" not in err
