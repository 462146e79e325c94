"""JAX's persistent compilation cache for degs_jax programs.

A new shape (model, batch, buffer) compiles its programs once per process; with the
persistent cache on, XLA's output is stored on disk and a later process with the same
shapes, flags and jax/jaxlib versions loads it instead of compiling. The degs_jax
command line turns it on at start-up; library users call :func:`enable_compilation_cache`
once, before the first jitted call.

Location: `$DEGS_JAX_CACHE/xla` (default `~/.cache/degs_jax/xla`), unless JAX already has
a cache directory (the `JAX_COMPILATION_CACHE_DIR` environment variable or
`jax.config.update("jax_compilation_cache_dir", ...)`), which is then kept. Entries are
keyed by the program and the versions; stale ones are never used, and the directory can
be deleted at any time.

:func:`large_copies` reads a compiled program's HLO text for the copies an in-place update
should not make (a decode loop that copies its KV cache each step, say); the tests and
`bench/decode_breakdown.py` check generate's programs with it.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Optional

import jax

from .loading import default_cache_dir

# Programs that compile faster than this are not written to disk (JAX's default is 1 s;
# a decode step of a small model on CPU compiles in about that time, so keep them too).
MIN_COMPILE_SECONDS = 0.5


def enable_compilation_cache(directory: Optional[str | Path] = None) -> Path:
    """Turn on JAX's persistent compilation cache and return its directory.

    directory: where to keep it (default: an already configured JAX cache directory, else
    `default_cache_dir() / "xla"`). Idempotent; safe to call before any computation.
    """
    configured = jax.config.jax_compilation_cache_dir
    if directory is None and configured:
        path = Path(configured)
    else:
        path = Path(directory) if directory is not None else default_cache_dir() / "xla"
        path.mkdir(parents=True, exist_ok=True)
        jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    return path


# An HLO instruction that makes a new array out of another: `%name = f32[4,2,256]{...} copy(...`
# (also inside a tuple-shaped fusion's result, hence the optional parenthesis).
_HLO_COPY = re.compile(r"= \(?[a-z0-9]+\[([\d,]*)\][^=]*? (copy|transpose|concatenate)\(")


def large_copies(hlo_text: str, min_elements: int) -> list[str]:
    """The copies, transposes and concatenations of at least `min_elements` elements in the
    HLO text of a compiled program (`jitted.lower(...).compile().as_text()`), each as
    `"copy[2,4,2,16,256]"` (the operation and the result's shape), in program order."""
    return [f"{m.group(2)}[{m.group(1)}]" for m in _HLO_COPY.finditer(hlo_text)
            if math.prod(int(d) for d in m.group(1).split(",") if d) >= min_elements]
