"""Speed at the shapes users run (issue 17), on one H100/H200 (times from the H100 runs
28-33 in bench/results/; one device call may last 10 minutes):

    python bench/real_shape.py --parts hf decode   # > 10 min on an H100: run 28 (HF 5.3 min)
                                                   # was cut after the batch-64 runs of both reads
    python bench/real_shape.py --parts decode --decode-runs qwen2.5-7b:1 --no-stacked
    python bench/real_shape.py --parts probe       # ~1.5 min
    python bench/real_shape.py --parts mcmc --mcmc-cap 576   # ~3.5 min at 64 problems
    python bench/real_shape.py --all               # every part in one call: ~15 min, too long for one
    python bench/real_shape.py --all --tiny        # CPU smoke test: the same code at a tiny shape

JSON records go to stdout and to $OUT/real_shape.jsonl (the HF part also to $OUT/hf.jsonl).
Every buffer is the library default: prompt + 3072 slots for the decoders
(`hyperparameters_for("temperature").max_new_tokens`), 16 blocks x 192 for MCMC
(`hyperparameters_for("power_mcmc")`, the library defaults); random bf16 weights.

Parts (--parts, default with --all: all of them, in this order):

hf       HF transformers `generate` (bench/hf_baseline.py) in a subprocess, run first, before
         JAX takes the GPU: Qwen2.5-0.5B and 7B shapes, batch 64, prompt 256, 512 new
         tokens, greedy, EOS suppressed, static and dynamic cache.
decode   Ours, same settings, buffer prompt + 3072, for each --kv-reads entry (default:
         `kv_read="auto"`, the GPU default: the Pallas decode kernel reads each row's
         live slots, and "buckets", the GPU default before it; "all", every slot of the
         buffer, is the cost before issue 17), list layers; plus stacked layers (one
         `lax.scan`) with the first entry. Each record has the first call (compilation included)
         and the timed call, and the share of the HBM roofline (weights + live KV cache).
probe    Decode steps with the fused K = 7 lens against without, 7B shape, batch 64 and 128,
         prompt 1024 (a mid-chain length), 64 steps: the DEGS probe's share of a step.
mcmc     The MATH500-shaped MCMC workload at realistic lengths, 7B shape: 64 problems
         (prompts 128..320 tokens), one chain each, 16 x 192 buffer, 10 MH steps, alpha 4;
         degs_mcmc (beta 5) and power_mcmc (beta 0) on the same keys. Each problem's
         completion ends with EOS at its own target length, drawn from a lognormal with
         median 600 tokens and sigma 0.7 (P(> 3072) = 1%), capped at --mcmc-cap tokens
         (default 768 to fit the time budget: the longest chain's MH steps are serial, see
         the record's `serial_steps`); EOS is forced at the target and impossible before
         (the random model never ends on its own), for the first draft and every MH
         proposal alike. The compilation is timed separately (ahead of time, into a
         persistent cache the run then reads).

    python bench/real_shape.py --parts mcmc --mcmc-cap 3072   # the full tail (long: see docs)
    python bench/real_shape.py --parts mcmc --mcmc-problems 128 --mcmc-cap 960 --lens-rows live all
        # degs_mcmc with the lens of live rows (the default) and of all rows: H200 run 36, ~10 min
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")  # 7B at batch 128 + caches

import argparse
import dataclasses
import hashlib
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from common import (BUFFER_NEW, SHAPES, copy_bandwidth, decode_seconds, decode_step_bytes, emit,
                    environment, forced_eos_model, shape_config, target_lengths)
from degs_jax.decoders import decode
from degs_jax.methods import hyperparameters_for
from degs_jax.lens import LensConfig
from degs_jax.models import ModelConfig, init_params, stack_layers
from degs_jax.models.compilation import enable_compilation_cache
from degs_jax.models.config import LENS_ROWS

OUT = "real_shape.jsonl"

# What each part runs: full = the GPU plan, tiny = the CPU smoke test of the same code.
PLANS = {
    "full": dict(hf=["qwen2.5-0.5b:64", "qwen2.5-7b:64"], prompt=256, new=512, buffer=BUFFER_NEW,
                 decode=[("qwen2.5-0.5b", 64), ("qwen2.5-7b", 64), ("qwen2.5-7b", 1)],
                 stacked=[("qwen2.5-7b", 64), ("qwen2.5-7b", 1)],
                 probe=dict(shape="qwen2.5-7b", batches=[64, 128], prompt=1024, steps=64),
                 mcmc=dict(shape="qwen2.5-7b", problems=64, median=600, sigma=0.7,
                           sizes=dict())),  # the library's default sizes (16 x 192, 10 MH steps, alpha 4)
    "tiny": dict(hf=["tiny:4"], prompt=16, new=24, buffer=BUFFER_NEW,
                 decode=[("tiny", 4), ("tiny", 1)], stacked=[("tiny", 4)],
                 probe=dict(shape="tiny", batches=[4], prompt=64, steps=8),
                 mcmc=dict(shape="tiny", problems=16, median=20, sigma=0.7,
                           sizes=dict(block_len=8, num_blocks=6, mh_steps=3))),
}


def run_hf(plan):
    """The HF baseline in its own process (it must not share the GPU with JAX's pool)."""
    cmd = [sys.executable, str(Path(__file__).with_name("hf_baseline.py")), "--shapes", *plan["hf"],
           "--prompt", str(plan["prompt"]), "--new", str(plan["new"])]
    done = subprocess.run(cmd, capture_output=True, text=True)
    for line in done.stdout.splitlines():
        print(line, flush=True)
    if done.returncode:
        emit({"bench": "hf_generate", "error": done.stderr[-2000:]}, OUT)


def run_decode(plan, bw: float, kv_reads: list[str], stacked: bool):
    runs = [(s, b, "list", r) for s, b in plan["decode"] for r in kv_reads]
    runs += [(s, b, "stacked", kv_reads[0]) for s, b in plan["stacked"]] if stacked else []
    models = {}
    for shape, _, _, _ in runs:
        if shape not in models:
            models[shape] = init_params(shape_config(shape), jax.random.key(0), jnp.bfloat16)
    for shape, batch, layout, kv_read in runs:
        cfg = shape_config(shape, kv_read=kv_read)
        params = stack_layers(models[shape]) if layout == "stacked" else models[shape]
        sec, first = decode_seconds(cfg, params, batch, plan["prompt"], plan["new"], repeats=1,
                                    buffer_new=plan["buffer"])
        step = sec / (plan["new"] + 1)  # the last token is consumed too
        emit({"bench": "decode", "shape": shape, "batch": batch, "layout": layout, "kv_read": kv_read,
              "prompt": plan["prompt"], "new_tokens": plan["new"], "buffer_slots": plan["prompt"] + plan["buffer"],
              "seconds": sec, "seconds_first_call": first, "compile_seconds": first - sec,
              "tokens_per_s": batch * plan["new"] / sec, "ms_per_step": 1e3 * step,
              "roofline_fraction": decode_step_bytes(cfg, params, batch, plan["prompt"], plan["new"]) / step / bw},
             OUT)
        del params


def run_probe(plan):
    probe = plan["probe"]
    cfg = shape_config(probe["shape"])
    params = init_params(cfg, jax.random.key(0), jnp.bfloat16)
    lens = LensConfig.default(cfg.num_layers)
    for batch in probe["batches"]:
        times = {}
        for label, with_lens in (("plain", None), ("probed", lens)):
            sec, first = decode_seconds(cfg, params, batch, probe["prompt"], probe["steps"], temperature=1.0,
                                        repeats=1, buffer_new=plan["buffer"], lens=with_lens)
            times[label] = sec / (probe["steps"] + 1)
        emit({"bench": "probe_decode", "shape": probe["shape"], "batch": batch, "prompt": probe["prompt"],
              "steps": probe["steps"], "buffer_slots": probe["prompt"] + plan["buffer"], "lsub": lens.lsub,
              "plain_ms_per_step": 1e3 * times["plain"], "probed_ms_per_step": 1e3 * times["probed"],
              "ratio": times["probed"] / times["plain"]}, OUT)


def run_mcmc(plan, cap: int, lens_rows: list[str]):
    spec = plan["mcmc"]
    cfg = shape_config(spec["shape"])
    params = init_params(cfg, jax.random.key(0), jnp.bfloat16)
    rng = np.random.default_rng(0)
    lo, hi = (128, 321) if spec["shape"] != "tiny" else (4, 12)
    prompts = [rng.integers(0, cfg.vocab_size - 1, rng.integers(lo, hi)).tolist() for _ in range(spec["problems"])]
    base = hyperparameters_for("power_mcmc", **spec["sizes"])
    sizes = dict(block_len=base.block_len, num_blocks=base.num_blocks, mh_steps=base.mh_steps, alpha=base.alpha)
    cap = min(cap, base.max_new_tokens)
    targets = target_lengths(spec["problems"], spec["median"], spec["sigma"], cap)
    eos = cfg.vocab_size - 1  # never in a prompt
    runs = [("power_mcmc", 0.0, None)] + [("degs_mcmc", 5.0, rows) for rows in lens_rows]
    for method, beta, rows in runs:
        # lens_rows "all": the lens of every row of a decode step, as before the live-rows lens.
        run_cfg = cfg if rows is None else dataclasses.replace(cfg, lens_rows=rows)
        model = forced_eos_model(run_cfg, targets, [len(p) for p in prompts], eos)
        compile_s = compile_mcmc_block(model, params, prompts, method, beta, sizes, eos)
        t = time.perf_counter()
        res = decode(model, params, prompts, method, jax.random.key(0), eos_ids=(eos,), beta=beta, **sizes)
        sec = time.perf_counter() - t
        lengths = np.array([len(o.chosen.tokens) for o in res.outputs])
        acc = [a for o in res.outputs for a in (o.chosen.acceptance or [])]
        emit({"bench": "mcmc_realistic", "method": method, "shape": spec["shape"], "problems": len(prompts),
              **sizes, "lens_rows": rows, "buffer_slots": max(len(p) for p in prompts) + base.max_new_tokens,
              "target_lengths": dict(distribution=f"lognormal(median {spec['median']}, sigma {spec['sigma']})",
                                     cap=cap, median=float(np.median(targets)),
                                     mean=float(targets.mean()), max=int(targets.max())),
              "lengths_match_targets": bool((lengths == targets).all()),
              "seconds": sec, "compile_seconds": compile_s, "seconds_per_problem": sec / len(prompts),
              "generated_tokens": res.counters["generated_tokens"],
              "generated_tokens_per_s": res.counters["generated_tokens"] / sec,
              "forward_equivalents": res.forward_equivalents(cfg.num_layers),
              "mean_acceptance": float(np.mean(acc)) if acc else None,
              # equal digests: the same chains (e.g. degs_mcmc with the lens of live rows and of all rows)
              "chosen_tokens_sha256": hashlib.sha256(
                  np.concatenate([np.asarray(o.chosen.tokens, np.int64) for o in res.outputs]).tobytes()).hexdigest()},
             OUT)


def compile_mcmc_block(model, params, prompts, method, beta, sizes, eos) -> float:
    """Seconds to compile the prefill and the block program ahead of time, as `decode`
    calls them (its host loop's `advance_chunk` with the method's block as the advance;
    they land in the persistent compilation cache, from which the timed run then loads
    them)."""
    from degs_jax.decoders import advance_chunk
    from degs_jax.generation import pad_prompts, prefill
    from degs_jax.rows import repeat_rows

    config = hyperparameters_for(method, beta=beta, **sizes)
    settings = config.plan(model, (eos,))
    tokens, lengths = pad_prompts(prompts)
    prefill_args = (model, params, jnp.asarray(tokens), jnp.asarray(lengths),
                    tokens.shape[1] + config.max_new_tokens, jnp.bfloat16)
    state = jax.eval_shape(lambda p: repeat_rows(prefill(*prefill_args[:1], p, *prefill_args[2:]), 1), params)
    keys = jax.eval_shape(lambda: jax.random.split(jax.random.key(0), len(prompts)))
    carry = jax.eval_shape(lambda s, k: config.init(model, params, s, k, settings), state, keys)
    t = time.perf_counter()
    prefill.lower(*prefill_args).compile()
    max_advances = jax.ShapeDtypeStruct((), jnp.int32)
    advance_chunk.lower(model, params, carry, keys, max_advances, config, settings).compile()
    return time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--all", action="store_true", help="every part (hf, decode, probe, mcmc)")
    ap.add_argument("--parts", nargs="+", default=[], choices=["hf", "decode", "probe", "mcmc"])
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke test)")
    ap.add_argument("--mcmc-cap", type=int, default=768,
                    help="longest completion of the MCMC workload (tokens; 3072 = the full tail)")
    ap.add_argument("--kv-reads", nargs="+", default=["auto", "buckets"], choices=["auto", "kernel", "buckets", "all"],
                    help="decode part: attention reads of the list-layout runs; the stacked runs use "
                         "the first (default: auto, i.e. the decode kernel on GPUs, and buckets, the "
                         "GPU default before it; `all` is the cost before issue 17)")
    ap.add_argument("--decode-runs", nargs="+", default=None, metavar="SHAPE:BATCH",
                    help="decode part: the list-layout runs (default: the plan's, e.g. qwen2.5-7b:64); "
                         "the stacked runs then use the same")
    ap.add_argument("--no-stacked", action="store_true",
                    help="decode part: skip the stacked-layer (lax.scan) runs")
    ap.add_argument("--mcmc-problems", type=int, default=None,
                    help="mcmc part: problems decoded as one batch (default: the plan's, 64 at the 7B shape)")
    ap.add_argument("--lens-rows", nargs="+", default=[ModelConfig.lens_rows], choices=LENS_ROWS,
                    help="mcmc part: degs_mcmc runs, one per entry, with ModelConfig.lens_rows = `live` "
                         "(the default: a decode step's lens runs on its live rows only) or `all` (every "
                         "row's, as before)")
    ap.add_argument("--probe-batches", nargs="+", type=int, default=None,
                    help="probe part: batch sizes (default: the plan's, 64 and 128 at the 7B shape; "
                         "128 fits an 80 GB H100 since prefills run in chunks, run 33)")
    args = ap.parse_args()
    parts = ["hf", "decode", "probe", "mcmc"] if args.all else args.parts
    if not parts:
        ap.error("name --all or --parts")
    plan = PLANS["tiny" if args.tiny else "full"]
    if args.probe_batches:
        plan = {**plan, "probe": {**plan["probe"], "batches": args.probe_batches}}
    if args.decode_runs:
        runs = []
        for run in args.decode_runs:
            name, _, batch = run.rpartition(":")
            if name not in SHAPES or not batch.isdigit() or int(batch) < 1:
                ap.error(f"--decode-runs takes SHAPE:BATCH with SHAPE one of {', '.join(SHAPES)}, got {run!r}")
            runs.append((name, int(batch)))
        plan = {**plan, "decode": runs, "stacked": runs}
    if args.mcmc_problems:
        plan = {**plan, "mcmc": {**plan["mcmc"], "problems": args.mcmc_problems}}
    if "hf" in parts:  # before JAX allocates the GPU
        run_hf(plan)
    with tempfile.TemporaryDirectory(prefix="degs_real_shape_xla_") as scratch:  # removed at exit
        cache_dir = enable_compilation_cache(scratch)
        bw = copy_bandwidth(gib=0.25 if args.tiny else 4.0)
        emit({"bench": "environment", **environment(), "copy_bandwidth_GBps": bw / 1e9, "parts": parts,
              "plan": "tiny" if args.tiny else "full", "compilation_cache": str(cache_dir)}, OUT)
        if "decode" in parts:
            run_decode(plan, bw, args.kv_reads, not args.no_stacked)
        if "probe" in parts:
            run_probe(plan)
        if "mcmc" in parts:
            run_mcmc(plan, args.mcmc_cap, args.lens_rows)


if __name__ == "__main__":
    main()
