"""Where the test suite's time goes: a pytest plugin that records, for every test, its wall
seconds and the seconds JAX spent tracing, lowering to MLIR and compiling with XLA in the
test's process (JAX's own monitoring events; the processes a test starts are not seen),
one JSON line per test, and the run's environment (device, versions, date, command) as
the last line. Run as a module, it sums a recording per test file.

    PYTHONPATH=bench python -m pytest -n 2 -q -p suite_profile [TESTS]
    python bench/suite_profile.py suite_profile.jsonl

The recording goes to $SUITE_PROFILE (default suite_profile.jsonl, appended to: xdist's
workers write their own lines to it)."""

from __future__ import annotations

import collections
import json
import os
import sys
import time

import pytest

EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "trace_s",
          "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
          "/jax/core/compile/backend_compile_duration": "compile_s"}
_seconds: collections.Counter = collections.Counter()
_listening = []


def _path() -> str:
    return os.environ.get("SUITE_PROFILE", "suite_profile.jsonl")


def _append(record: dict) -> None:
    with open(_path(), "a") as out:
        out.write(json.dumps(record) + "\n")


def _on_event(event: str, duration: float, **_) -> None:
    name = EVENTS.get(event)
    if name:
        _seconds[name] += duration
        if name == "compile_s":
            _seconds["compiles"] += 1


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if not _listening:  # after conftest.py has set XLA's flags
        import jax.monitoring

        jax.monitoring.register_event_duration_secs_listener(_on_event)
        _listening.append(True)
    _seconds.clear()
    start = time.perf_counter()
    yield
    _append({"test": item.nodeid, "wall_s": round(time.perf_counter() - start, 3),
             **{name: round(value, 3) for name, value in _seconds.items()},
             "worker": os.environ.get("PYTEST_XDIST_WORKER", "main")})


def pytest_sessionfinish(session):
    if hasattr(session.config, "workerinput"):  # an xdist worker: the controller writes it
        return
    from common import environment

    _append({"environment": {**environment(), "XLA_FLAGS": os.environ.get("XLA_FLAGS", "")}})


def per_file(lines: list[dict]) -> list[dict]:
    """Each test file's wall and JAX seconds, slowest file first."""
    files = collections.defaultdict(collections.Counter)
    for line in lines:
        if "test" in line:
            total = files[line["test"].split("::")[0]]
            total.update({k: v for k, v in line.items() if k not in ("test", "worker")})
            total["tests"] += 1
    rows = [{"file": name, **{k: round(v, 1) for k, v in total.items()}} for name, total in files.items()]
    return sorted(rows, key=lambda row: -row["wall_s"])


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python bench/suite_profile.py RECORDING.jsonl")
    with open(sys.argv[1]) as recording:
        lines = [json.loads(line) for line in recording if line.strip()]
    rows = per_file(lines)
    wall, compile_s = sum(r["wall_s"] for r in rows), sum(r.get("compile_s", 0) for r in rows)
    print(json.dumps({"tests": sum(r["tests"] for r in rows), "wall_s": round(wall, 1),
                      "compile_s": round(compile_s, 1)}))
    for row in rows:
        print(json.dumps(row))
