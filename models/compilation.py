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

Damaged entries: JAX writes an entry in place (not into a temporary renamed into place)
and never rewrites a key that exists, so an entry cut short by a full disk or a killed
process would be read, fail to load, be compiled again and not replaced, on every later
run (minutes each time). :func:`remove_damaged_entries`, run by
:func:`enable_compilation_cache`, deletes the entries that do not decompress (JAX's own
codec; an entry is read once, then remembered by size and mtime in
`degs-verified.json`), so the next compilation writes them anew. Entries younger than
:data:`SETTLED_SECONDS` may still be being written and are judged by a later run.

:func:`large_copies` reads a compiled program's HLO text for the copies an in-place update
should not make (a decode loop that copies its KV cache each step, say); the tests and
`bench/decode_breakdown.py` check generate's programs with it.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import time
from pathlib import Path
from typing import Optional

import jax

from .loading import default_cache_dir

# Programs that compile faster than this are not written to disk (JAX's default is 1 s;
# a decode step of a small model on CPU compiles in about that time, so keep them too).
MIN_COMPILE_SECONDS = 0.5
# Cache entries younger than this may still be being written (by another process).
SETTLED_SECONDS = 60.0
_VERIFIED_FILE = "degs-verified.json"


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
    removed = remove_damaged_entries(path)
    if removed:
        print(f"degs_jax: removed {len(removed)} damaged entries of the XLA compilation cache "
              f"{path} (cut short, e.g. by a full disk); they are compiled again once",
              file=sys.stderr)
    return path


def remove_damaged_entries(directory: str | Path) -> list[str]:
    """Delete the entries of JAX's persistent cache in `directory` that do not decompress
    (module docstring); returns their names. Entries already found intact (same size and
    mtime, recorded in `degs-verified.json`) are not read again; entries younger than
    SETTLED_SECONDS are left for a later run. Nothing happens if this JAX's cache codec
    cannot be found."""
    try:  # jax's private codec: looked up where used, as it may move between versions
        from jax._src.compilation_cache import decompress_executable
    except ImportError:
        return []
    path = Path(directory)
    record = path / _VERIFIED_FILE
    try:
        verified = json.loads(record.read_text())
        verified = verified if isinstance(verified, dict) else {}
    except (OSError, ValueError):
        verified = {}
    now, intact, removed = time.time(), {}, []
    for entry in sorted(path.glob("*-cache")):
        try:
            stat = entry.stat()
            stamp = [stat.st_size, stat.st_mtime_ns]
            if verified.get(entry.name) != stamp:
                if now - stat.st_mtime < SETTLED_SECONDS:
                    continue  # maybe still being written
                decompress_executable(entry.read_bytes())
            intact[entry.name] = stamp
        except OSError:  # gone meanwhile, or unreadable: not judged
            continue
        except Exception:  # zlib.error, zstd's ZstdError: cut short or garbled
            for damaged in (entry, entry.with_name(entry.name[:-len("-cache")] + "-atime")):
                damaged.unlink(missing_ok=True)
            removed.append(entry.name)
    if intact != verified:
        try:
            tmp = record.with_name(f"{record.name}.tmp{os.getpid()}")
            tmp.write_text(json.dumps(intact))
            os.replace(tmp, record)
        except OSError:  # a full disk or a read-only cache: checked again next time
            pass
    return removed


# An HLO instruction that makes a new array out of another: `%name = f32[4,2,256]{...} copy(...`
# (also inside a tuple-shaped fusion's result, hence the optional parenthesis).
_HLO_COPY = re.compile(r"= \(?[a-z0-9]+\[([\d,]*)\][^=]*? (copy|transpose|concatenate)\(")


def large_copies(hlo_text: str, min_elements: int) -> list[str]:
    """The copies, transposes and concatenations of at least `min_elements` elements in the
    HLO text of a compiled program (`jitted.lower(...).compile().as_text()`), each as
    `"copy[2,4,2,16,256]"` (the operation and the result's shape), in program order."""
    return [f"{m.group(2)}[{m.group(1)}]" for m in _HLO_COPY.finditer(hlo_text)
            if math.prod(int(d) for d in m.group(1).split(",") if d) >= min_elements]
