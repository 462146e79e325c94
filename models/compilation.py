"""JAX's persistent compilation cache for degs_jax programs.

A new shape (model, batch, buffer) compiles its programs once per process; with the
persistent cache on, XLA's output is stored on disk and a later process with the same
shapes, flags and jax/jaxlib versions loads it instead of compiling. The degs_jax
command line turns it on at start-up (:func:`enable_compilation_cache`). For library
users it is on by default (:func:`enable_default_compilation_cache`, run when
`degs_jax.models` is imported, i.e. by every script that loads or builds a model; the
samplers, which know no model, do not import it): unless JAX already has a
cache setting of the user's own (`JAX_COMPILATION_CACHE_DIR`, `jax_compilation_cache_dir`,
or `jax_enable_compilation_cache` off), which wins, and unless
`DEGS_JAX_COMPILATION_CACHE=0`; the first compilation that uses it prints one line saying
where it lives. A script's first decode on a CPU compiles for about a minute; run again,
it loads the programs in seconds.

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


# Set to 0 (or off, false, no) to keep the default cache off for library users.
DEFAULT_SWITCH = "DEGS_JAX_COMPILATION_CACHE"
_FIRST_USE_EVENT = "/jax/compilation_cache/compile_requests_use_cache"  # before JAX reads the cache
_default = {"directory": None, "announced": False}  # the default cache's state in this process


def enable_default_compilation_cache() -> Optional[Path]:
    """Turn on JAX's persistent compilation cache in `default_cache_dir() / "xla"` for a
    library user's process (module docstring), unless the user has a setting of their own:
    `JAX_COMPILATION_CACHE_DIR` or `jax_compilation_cache_dir` (a directory of their own),
    `jax_enable_compilation_cache` set off, or `DEGS_JAX_COMPILATION_CACHE=0`. Nothing is
    read or written until the first compilation that uses the cache: then damaged entries
    are removed (:func:`remove_damaged_entries`) and one line on stderr says where the
    cache is, unless the directory has been changed meanwhile. Returns the directory, or
    None where the user's setting stands. Idempotent."""
    if _default["directory"] is not None:
        return _default["directory"]
    if (os.environ.get(DEFAULT_SWITCH, "").strip().lower() in ("0", "off", "false", "no")
            or jax.config.jax_compilation_cache_dir or not jax.config.jax_enable_compilation_cache):
        return None
    path = default_cache_dir() / "xla"
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    _default["directory"] = path
    from jax import monitoring  # (the listener lives as long as the process)

    monitoring.register_event_listener(_on_cache_event)
    return path


def _on_cache_event(event: str, **_) -> None:
    """At the first compilation that uses the default cache: its damaged entries removed and
    its one line printed (not when the directory was changed, or chosen explicitly with
    `enable_compilation_cache`, since the default was set)."""
    if event != _FIRST_USE_EVENT or _default["announced"]:
        return
    _default["announced"] = True
    path = _default["directory"]
    if jax.config.jax_compilation_cache_dir != str(path):
        return
    if path.is_dir():
        _report_removed(path, remove_damaged_entries(path))
    print(f"degs_jax: compiled programs are kept in {path} (JAX's persistent compilation cache, on "
          f"by default; your own JAX_COMPILATION_CACHE_DIR or jax_compilation_cache_dir replaces it, "
          f"{DEFAULT_SWITCH}=0 turns it off)", file=sys.stderr)


def enable_compilation_cache(directory: Optional[str | Path] = None) -> Path:
    """Turn on JAX's persistent compilation cache and return its directory.

    directory: where to keep it (default: an already configured JAX cache directory, else
    `default_cache_dir() / "xla"`). Idempotent; safe to call before any computation. A
    choice of its own: the default cache's line (`enable_default_compilation_cache`) is
    not printed.
    """
    _default["announced"] = True
    configured = jax.config.jax_compilation_cache_dir
    if _default["directory"] is not None and configured == str(_default["directory"]):
        configured = None  # the default's, not a setting of the user's: `directory` decides
    if directory is None and configured:
        path = Path(configured)
    else:
        path = Path(directory) if directory is not None else default_cache_dir() / "xla"
        path.mkdir(parents=True, exist_ok=True)
        jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    _report_removed(path, remove_damaged_entries(path))
    return path


def _report_removed(path: Path, removed: list[str]) -> None:
    if removed:
        print(f"degs_jax: removed {len(removed)} damaged entries of the XLA compilation cache "
              f"{path} (cut short, e.g. by a full disk); they are compiled again once",
              file=sys.stderr)


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
