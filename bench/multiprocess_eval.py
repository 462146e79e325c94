"""`degs eval` as N processes of one jax.distributed job (one GPU each, one host) against
one process on one GPU: wall-clock, speed-up, and whether the records are the same.

    python bench/multiprocess_eval.py --modes invariant        # run 51: every GPU of the host
    python bench/multiprocess_eval.py --method degs_mcmc --eval-args "--num-blocks 2 --mh-steps 2"

For each mode of --modes (`invariant`: with --batch-invariant; `default`: without), in
one invocation:
  1. a warm-up: the N-process run of 3 below, into its own directory. It fills the
     persistent compilation cache shared by every run (--cache) with the programs of
     every prompt-length bucket, so neither timed run pays XLA compilation (both still
     load the model and the cached programs);
  2. one process on GPU 0 (`CUDA_VISIBLE_DEVICES=0`), --limit problems;
  3. N processes, process k on GPU k, coordinator on loopback (the README's launch
     command), the same problems.
Each run is timed from the first process's start to the last one's exit. The records of
3 are compared with those of 2, field by field, the timings (`decode_s`, `grade_s`,
`wall_clock_s`) aside; a JSON record per mode gives the seconds, the speed-up, how many
problems differ and in which fields. Goal (issue 28): speed-up >= 1.9 on 2 GPUs, and the
same records with --batch-invariant.

Every run is a `python -m degs_jax.cli` process; --eval-args (one string) goes to all of
them. The defaults (SmolLM2-135M, GSM8K 0-255, temperature sampling capped at 384 tokens,
batches of 64) take about 4 minutes per mode on 2 H200s; DEGS-MCMC chains at 135M with
--batch-invariant take minutes per batch (docs/benchmarks.md, run 51).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import emit

OUT = "multiprocess_eval.jsonl"
TIMINGS = ("decode_s", "grade_s", "wall_clock_s")
MODE_FLAGS = {"invariant": ["--batch-invariant"], "default": []}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(argvs: list[list[str]], gpus: list[str], env: dict, logs: Path, timeout: float) -> float:
    """Start one process per argv (process k sees GPU gpus[k]); wait for all; return the
    seconds from the first start to the last exit. A failure raises with its log's tail."""
    procs, files = [], []
    start = time.perf_counter()
    try:
        for k, (argv, gpu) in enumerate(zip(argvs, gpus)):
            log = open(logs.with_suffix(f".p{k}.log"), "w")
            files.append(log)
            procs.append(subprocess.Popen(argv, env={**env, "CUDA_VISIBLE_DEVICES": gpu},
                                          stdout=log, stderr=subprocess.STDOUT))
        deadline = start + timeout
        for proc in procs:
            proc.wait(timeout=max(1.0, deadline - time.perf_counter()))
        seconds = time.perf_counter() - start
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for log in files:
            log.close()
    for k, proc in enumerate(procs):
        if proc.returncode != 0:
            tail = logs.with_suffix(f".p{k}.log").read_text()[-3000:]
            raise RuntimeError(f"process {k} of {len(procs)} exited with {proc.returncode}:\n{tail}")
    return seconds


def records(run_dir: Path) -> list[dict]:
    lines = (run_dir / "results.jsonl").read_text().splitlines()
    return sorted((json.loads(line) for line in lines), key=lambda r: r["index"])


def compare(one: list[dict], many: list[dict]) -> dict:
    """Problems present in both runs whose records differ (timings aside), and the fields."""
    by_index = {r["index"]: r for r in many}
    differing, fields = [], set()
    for r in one:
        other = by_index.get(r["index"])
        if other is None:
            differing.append(r["index"])
            fields.add("<missing>")
            continue
        changed = {k for k in set(r) | set(other) if k not in TIMINGS and r.get(k) != other.get(k)}
        if changed:
            differing.append(r["index"])
            fields |= changed
    return {"problems_compared": len(one), "problems_in_n_process_run": len(many),
            "problems_differing": len(differing), "differing_fields": sorted(fields),
            "first_differing": differing[:10]}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--benchmark", default="gsm8k")
    ap.add_argument("--method", default="temperature")
    ap.add_argument("--limit", type=int, default=256, help="problems of each timed run")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--processes", type=int, default=None,
                    help="processes of the N-process run, one GPU each (default: every local GPU)")
    ap.add_argument("--modes", default="invariant,default",
                    help="comma-separated: invariant (--batch-invariant), default (without)")
    ap.add_argument("--eval-args", default="--max-new-tokens 384",
                    help="further `degs eval` arguments for every run, one string (default: %(default)s)")
    ap.add_argument("--work", default=None, help="directory of the runs (default: a temporary one)")
    ap.add_argument("--cache", default=None, help="persistent compilation cache (default: under --work)")
    ap.add_argument("--timeout", type=float, default=580.0, help="seconds per run before it is killed")
    args = ap.parse_args()
    modes = args.modes.split(",")
    unknown = sorted(set(modes) - set(MODE_FLAGS))
    if unknown:
        ap.error(f"--modes: unknown {unknown}; choose from {sorted(MODE_FLAGS)}")

    # This process only counts the devices and records the environment: it must not take
    # the GPUs' memory from the runs it starts (JAX preallocates 75% of each by default).
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    import jax

    from common import environment
    n = args.processes or jax.local_device_count()
    if n < 2:
        ap.error(f"--processes: need at least 2 (this host has {jax.local_device_count()} device(s))")
    emit({"bench": "environment", **environment(), "processes": n}, OUT)

    work = Path(args.work or tempfile.mkdtemp(prefix="multiprocess_eval_"))
    work.mkdir(parents=True, exist_ok=True)
    cache = Path(args.cache) if args.cache else work / "xla"
    # gRPC honours proxy variables (the coordinator is on loopback); XLA_FLAGS could fake
    # several host devices (one device per process is meant).
    env = {k: v for k, v in os.environ.items()
           if "proxy" not in k.lower() and k not in ("XLA_FLAGS", "XLA_PYTHON_CLIENT_PREALLOCATE")}
    env.update(JAX_COMPILATION_CACHE_DIR=str(cache), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               PYTHONUNBUFFERED="1")
    base = [sys.executable, "-m", "degs_jax.cli", "eval", "--model", args.model, "--benchmark", args.benchmark,
            "--method", args.method, "--batch-size", str(args.batch_size), "--no-progress",
            *shlex.split(args.eval_args)]

    def n_processes(flags: list[str], out: Path) -> float:
        port = free_port()
        return launch([[*base, *flags, "--limit", str(args.limit), "--out", str(out),
                        "--coordinator", f"127.0.0.1:{port}", "--num-processes", str(n),
                        "--process-id", str(k)] for k in range(n)],
                      [str(k) for k in range(n)], env, out, args.timeout)

    for mode in modes:
        flags = MODE_FLAGS[mode]
        runs = {name: work / f"{mode}_{name}" for name in ("warmup", "one", "many")}
        warm = n_processes(flags, runs["warmup"])
        one = launch([[*base, *flags, "--limit", str(args.limit), "--out", str(runs["one"])]],
                     ["0"], env, runs["one"], args.timeout)
        many = n_processes(flags, runs["many"])
        one_records, many_records = records(runs["one"]), records(runs["many"])
        emit({"bench": "multiprocess_eval", "mode": mode, "flags": flags, "model": args.model,
              "benchmark": args.benchmark, "method": args.method, "eval_args": args.eval_args,
              "problems": args.limit, "batch_size": args.batch_size, "processes": n,
              "warmup_seconds": warm, "one_process_seconds": one, "n_process_seconds": many,
              "speedup": one / many, "efficiency": one / many / n,
              "accuracy_one": sum(r["correct"] for r in one_records) / len(one_records),
              **compare(one_records, many_records)}, OUT)


if __name__ == "__main__":
    main()
