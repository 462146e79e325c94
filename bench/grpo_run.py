"""GPU run of issue 14: GRPO on Qwen2.5-Coder-0.5B-Instruct from GSM8K train, greedy GSM8K
test (first 500) and MATH500 accuracy before and after with the evaluation harness, and a
tuned lens with its D(x) predictive validity against the logit lens on one candidate pool.

Two independent parts (`--part`), each resumable inside OUT and each sized to fit one call
of at most ~9 minutes on one H100 with the defaults:

  grpo   1. eval_before   greedy GSM8K test[:500] and MATH500, base model (degs eval's runner)
         2. train         GRPO steps (degs_jax.train.train_grpo) until --steps or the budget
         3. eval_after    the same evaluations on the newest checkpoint (OUT/eval_after_step<N>)
         4. report        training-curve PNG and summary.json
  lens   1. lens          tuned lens of the base model on GSM8K train solutions (L_sub layers)
         2. pool          Best-of-8 candidates at temperature 1 on GSM8K test problems, all graded
         3. compare       AUC / Spearman / pairwise / DEGS-rerank accuracy of D(x) under the logit
                          and the tuned lens on that pool (analysis.lsub_sweep)

Every phase skips what OUT already holds, so rerunning the same command continues (a phase
that does not fit the remaining --budget is left for the next call; training stops at a
checkpoint). Resuming needs OUT itself (GRPO checkpoints are ~7.5 GB: fp32 masters and Adam
moments), so later calls must run where OUT is, e.g. on the same warm machine.
`--copy-to DIR` copies the small artifacts there (at most 5 files: summary, curve, log, an
archive of the evaluation records and reports).

Prints JSON records (bench/common.environment: device, versions, UTC date, command), one
per phase, and a FLOP-based estimate of the time per step before training.

  python bench/grpo_run.py --part grpo --out runs/grpo_qwen --copy-to $OUT
  python bench/grpo_run.py --part lens --out runs/grpo_qwen --copy-to $OUT
  python bench/grpo_run.py --preset tiny --model smollm2-135m --out /tmp/t   (CPU smoke test)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tarfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/common.py

H100_BF16_FLOPS = 989e12  # dense bf16 peak of an H100 SXM
ASSUMED_MFU = 0.35  # assumption for the estimate, not a measurement

PRESETS = {
    # The GPU run. Rollouts: 8 prompts x 16 completions of <= 512 tokens per step; two
    # updates of 64 sequences (micro-batches of 8). lr 1e-6 is DeepSeekMath's GRPO rate; the
    # paper's recipe (degs_jax/train/grpo.py) uses 5e-7 over far larger batches on 7B models.
    "gpu": dict(model="qwen2.5-coder-0.5b", steps=45, prompts_per_step=8, group_size=16,
                max_prompt_len=256, max_new_tokens=512, learning_rate=1e-6, warmup_steps=10,
                updates_per_step=2, micro_batch=8, checkpoint_every=5,
                eval_limit=500, gsm8k_new_tokens=1024, math_new_tokens=2048,
                gsm8k_batch=250, math_batch=100,
                pool_problems=100, pool_n=8, pool_new_tokens=512, pool_batch=25,
                lens_steps=150, lens_seq_len=512, lens_batch=32, lens_micro=8, lens_heldout=32,
                compare_batch=16, budget=530.0),
    # CPU smoke test of the whole script (SmolLM2-135M or a tiny model): every phase, tiny.
    "tiny": dict(model="smollm2-135m", steps=2, prompts_per_step=2, group_size=2,
                 max_prompt_len=256, max_new_tokens=8, learning_rate=1e-6, warmup_steps=1,
                 updates_per_step=2, micro_batch=1, checkpoint_every=1,
                 eval_limit=2, gsm8k_new_tokens=8, math_new_tokens=8, gsm8k_batch=2, math_batch=2,
                 pool_problems=2, pool_n=2, pool_new_tokens=8, pool_batch=2,
                 lens_steps=2, lens_seq_len=32, lens_batch=2, lens_micro=1, lens_heldout=2,
                 compare_batch=2, budget=None),
}

# Seconds a phase needs at the GPU preset (measured or estimated; used to decide whether to
# start it with the budget left).
PHASE_SECONDS = {"eval": 150.0, "lens": 100.0, "pool": 80.0, "compare": 120.0}


def record(**fields) -> None:
    """One JSON line (NaN, e.g. an AUC with one class only, written as null: the run files'
    own rule, `degs_jax.eval.results.strict_json`)."""
    from common import environment

    from degs_jax.eval.results import strict_json

    print(json.dumps(strict_json({**fields, **environment()}), allow_nan=False), flush=True)


class Budget:
    def __init__(self, seconds):
        self.start, self.seconds = time.perf_counter(), seconds

    def left(self) -> float:
        return float("inf") if self.seconds is None else self.seconds - (time.perf_counter() - self.start)

    def allows(self, need: float) -> bool:
        return self.left() >= need


def flops_per_step(cfg, config) -> dict:
    """FLOP estimate of one GRPO step: the training forward + backward (3x a forward) +
    remat recompute (1x) over every position of the padded [rows, prompt + completion]
    buffer, plus forward-only passes for the reference and the old policy."""
    d, f, V, L = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_layers
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    S = config.max_prompt_len + config.max_new_tokens
    per_layer = 2 * (d * q + 2 * d * kv + q * d + 3 * d * f) + 2 * 2 * S * q  # matmuls + attention
    forward = L * per_layer + 2 * d * V  # per token
    passes = 3 + (1 if config.remat else 0) + (1 if config.reference_kl else 0) \
        + (1 if config.updates_per_step > 1 else 0)
    tokens = config.rows * S
    total = forward * tokens * passes
    return {"forward_flops_per_token": forward, "positions_per_step": tokens, "forward_passes": passes,
            "train_flops_per_step": total,
            "train_seconds_at_assumed_mfu": total / (H100_BF16_FLOPS * ASSUMED_MFU),
            "assumed": f"{ASSUMED_MFU:.0%} of {H100_BF16_FLOPS / 1e12:.0f} TFLOP/s (H100 bf16 dense)"}


# ----------------------------------------------------------------------------- phases

def evaluate(model, out: Path, tag: str, p: dict, data_dir) -> dict:
    from degs_jax.eval.runner import run_eval

    results = {}
    for bench, new, batch in (("gsm8k", p["gsm8k_new_tokens"], p["gsm8k_batch"]),
                              ("math500", p["math_new_tokens"], p["math_batch"])):
        t0 = time.perf_counter()
        summary = run_eval(model, out / f"{tag}_{bench}", benchmark=bench, method="greedy",
                           hyperparameters={"max_new_tokens": new}, limit=p["eval_limit"],
                           batch_size=batch, progress=False, data_dir=data_dir,
                           argv=sys.argv[1:], print_table=False)
        results[bench] = {**summary["accuracy"], "seconds": time.perf_counter() - t0,
                          "max_new_tokens": new}
        record(bench="grpo_run", phase=tag, benchmark=bench, **results[bench])
    return results


def part_grpo(args, p: dict, budget: Budget) -> dict:
    from degs_jax.models import load
    from degs_jax.train import GRPOConfig, MathReward, gsm8k_train_tasks, train_grpo
    from degs_jax.train.checkpoints import latest_checkpoint

    out = args.out
    base = load(p["model"], progress=False)
    state = {}
    if not all((out / f"eval_before_{b}" / "summary.json").exists() for b in ("gsm8k", "math500")):
        if not budget.allows(PHASE_SECONDS["eval"]):
            return {"left": "eval_before"}
    state["before"] = evaluate(base, out, "eval_before", p, args.data_dir)

    config = GRPOConfig(group_size=p["group_size"], prompts_per_step=p["prompts_per_step"],
                        max_prompt_len=p["max_prompt_len"], max_new_tokens=p["max_new_tokens"],
                        learning_rate=p["learning_rate"], warmup_steps=p["warmup_steps"],
                        updates_per_step=p["updates_per_step"], micro_batch=p["micro_batch"])
    estimate = flops_per_step(base.cfg, config)
    record(bench="grpo_run", phase="estimate", grpo=dataclasses.asdict(config), **estimate)
    reserve = PHASE_SECONDS["eval"] * 0.6 + 20  # eval_after reuses eval_before's compiled programs
    ckpt = latest_checkpoint(out / "grpo")
    if ckpt is None or int(ckpt.name.split("-")[1]) < p["steps"]:
        if not budget.allows(reserve + 120):  # compilation and a first step
            return {**state, "left": "train"}
        tasks = gsm8k_train_tasks(base.tokenizer, max_prompt_len=config.max_prompt_len)
        with MathReward(base.tokenizer) as reward:
            result = train_grpo(base, out / "grpo", config, tasks=tasks, reward_fn=reward,
                                steps=p["steps"], checkpoint_every=p["checkpoint_every"],
                                progress=False, argv=sys.argv[1:],
                                time_limit=None if budget.seconds is None else budget.left() - reserve)
        log = [json.loads(x) for x in (out / "grpo" / "log.jsonl").read_text().splitlines()]
        later = log[1:] or log  # step 0 of a call includes compilation
        record(bench="grpo_run", phase="train", **result,
               mean_step_seconds=sum(r["seconds"]["total"] for r in later) / len(later),
               mean_train_seconds=sum(r["seconds"]["train"] for r in later) / len(later),
               mean_rollout_seconds=sum(r["seconds"]["rollout"] for r in later) / len(later))
        state["train"] = result
        if result["steps_done"] < p["steps"]:
            return {**state, "left": "train"}
        ckpt = latest_checkpoint(out / "grpo")
    step = int(ckpt.name.split("-")[1])
    tag = f"eval_after_step{step}"
    if not all((out / f"{tag}_{b}" / "summary.json").exists() for b in ("gsm8k", "math500")) \
            and not budget.allows(PHASE_SECONDS["eval"] * 0.6):
        return {**state, "left": "eval_after"}
    del base
    trained = load(ckpt, progress=False)
    state["after"] = evaluate(trained, out, tag, p, args.data_dir)
    state["report"] = report(out, state, step)
    return state


def report(out: Path, state: dict, step: int) -> dict:
    import numpy as np

    from degs_jax.plots import plot_training_curve

    log = [json.loads(x) for x in (out / "grpo" / "log.jsonl").read_text().splitlines()]
    before, after = state.get("before", {}), state.get("after", {})
    plot_training_curve(log, out / "training_curve.png", "GRPO, " + ", ".join(
        f"{b}: {before[b]['accuracy']:.3f} → {after[b]['accuracy']:.3f}"
        for b in before if b in after) + f" (greedy, after {step} steps)")
    summary = {"before": before, "after": after, "steps": step,
               "reward_first5": float(np.mean([r["reward_mean"] for r in log[:5]])),
               "reward_last5": float(np.mean([r["reward_mean"] for r in log[-5:]])),
               "mean_step_seconds": float(np.mean([r["seconds"]["total"] for r in log[1:]] or [0])),
               "run": json.loads((out / "grpo" / "run.json").read_text())["config"]}
    (out / "grpo_summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def part_lens(args, p: dict, budget: Budget) -> dict:
    from degs_jax.analysis import lsub_sweep
    from degs_jax.eval.runner import run_eval
    from degs_jax.lens import default_lsub
    from degs_jax.models import load
    from degs_jax.train.tuned_lens import (TunedLensConfig, fit_tuned_lens, gsm8k_lens_corpus,
                                           load_tuned_lens, params_fingerprint, save_tuned_lens)

    out = args.out
    model = load(p["model"], progress=False)
    L = model.cfg.num_layers
    lsub = default_lsub(L)
    lens_file, lens_report = out / "lens" / "tuned_lens.safetensors", out / "lens" / "report.json"
    fingerprint = params_fingerprint(model.params)
    state = {}
    if not lens_report.exists():
        if not budget.allows(PHASE_SECONDS["lens"]):
            return {"left": "lens"}
        config = TunedLensConfig(layers=tuple(l for l in lsub if l < L), steps=p["lens_steps"],
                                 seq_len=p["lens_seq_len"], batch_size=p["lens_batch"],
                                 micro_batch=p["lens_micro"], heldout=p["lens_heldout"])
        sequences = gsm8k_lens_corpus(model.tokenizer, config.seq_len)
        lens, rep = fit_tuned_lens(model.params, model.cfg, sequences, config, progress=False)
        save_tuned_lens(lens, lens_file, model.cfg, fingerprint, rep)
        lens_report.write_text(json.dumps(rep, indent=1))
        record(bench="grpo_run", phase="lens", layers=rep["layers"], heldout_kl_logit=rep["heldout_kl_logit"],
               heldout_kl_tuned=rep["heldout_kl_tuned"], seconds=rep["seconds"],
               tokens_seen=rep["tokens_seen"])
    lens = load_tuned_lens(lens_file, model.cfg, fingerprint)
    state["lens"] = json.loads(lens_report.read_text())
    pool = out / "pool_gsm8k"
    if not (pool / "summary.json").exists() or \
            json.loads((pool / "summary.json").read_text())["n_problems"] < p["pool_problems"]:
        if not budget.allows(PHASE_SECONDS["pool"]):  # run_eval resumes a partial pool
            return {**state, "left": "pool"}
        t0 = time.perf_counter()
        summary = run_eval(model, pool, benchmark="gsm8k", method="best_of_n",
                           hyperparameters={"n": p["pool_n"], "max_new_tokens": p["pool_new_tokens"]},
                           limit=p["pool_problems"], batch_size=p["pool_batch"], keep_candidates=True,
                           progress=False, data_dir=args.data_dir, argv=sys.argv[1:], print_table=False)
        record(bench="grpo_run", phase="pool", seconds=time.perf_counter() - t0,
               candidates=summary.get("candidates"), accuracy=summary["accuracy"])
    compare = out / "lens_compare"
    if not (compare / "lsub_sweep.json").exists():
        if not budget.allows(PHASE_SECONDS["compare"]):
            return {**state, "left": "compare"}
        result = lsub_sweep(model, pool, [lsub], batch_size=p["compare_batch"], out_dir=compare,
                            data_dir=args.data_dir,
                            lenses={"logit": None, "tuned": lens}, quiet=True)
        for row in result["rows"]:
            record(bench="grpo_run", phase="compare", **row)
    state["compare"] = json.loads((compare / "lsub_sweep.json").read_text())["rows"]
    return state


# ----------------------------------------------------------------------------- main

def copy_artifacts(out: Path, dest: Path) -> list[str]:
    """summary, curve and log as files; evaluation records and reports in one archive."""
    dest.mkdir(parents=True, exist_ok=True)
    copied = []
    for name in ("grpo_summary.json", "training_curve.png"):
        if (out / name).exists():
            shutil.copy(out / name, dest / name)
            copied.append(name)
    if (out / "grpo" / "log.jsonl").exists():
        shutil.copy(out / "grpo" / "log.jsonl", dest / "grpo_log.jsonl")
        copied.append("grpo_log.jsonl")
    with tarfile.open(dest / "grpo_run_artifacts.tar.gz", "w:gz") as tar:
        for path in sorted(out.rglob("*")):
            rel = path.relative_to(out)
            if path.is_file() and rel.parts[0] not in ("grpo", "cache", "jax_cache") and \
                    path.suffix in (".json", ".jsonl", ".png"):
                tar.add(path, arcname=str(rel))
        if (out / "grpo" / "run.json").exists():
            tar.add(out / "grpo" / "run.json", arcname="grpo/run.json")
    copied.append("grpo_run_artifacts.tar.gz")
    return copied


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="run directory (kept between calls)")
    ap.add_argument("--part", choices=["grpo", "lens", "all"], default="all")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="gpu")
    ap.add_argument("--model", default=None, help="override the preset's model (name, HF dir or .gguf)")
    ap.add_argument("--steps", type=int, default=None, help="override the preset's GRPO steps")
    ap.add_argument("--budget", type=float, default=None, help="seconds for this call (preset: 530)")
    ap.add_argument("--data-dir", default=None, help="benchmark files (default $DEGS_JAX_DATA)")
    ap.add_argument("--copy-to", type=Path, default=None, help="copy the small artifacts here")
    args = ap.parse_args(argv)
    p = dict(PRESETS[args.preset])
    for key in ("model", "steps", "budget"):
        if getattr(args, key) is not None:
            p[key] = getattr(args, key)
    budget = Budget(p["budget"])
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("DEGS_JAX_CACHE", str(args.out.resolve() / "cache"))
    if args.data_dir:
        os.environ["DEGS_JAX_DATA"] = str(Path(args.data_dir).resolve())
    import jax

    # Compiled programs persist in OUT: a later call on the same machine skips compilation.
    jax.config.update("jax_compilation_cache_dir", str(args.out.resolve() / "jax_cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 2.0)
    states = {}
    for part in (("grpo", "lens") if args.part == "all" else (args.part,)):
        states[part] = (part_grpo if part == "grpo" else part_lens)(args, p, budget)
    left = {part: s["left"] for part, s in states.items() if "left" in s}
    copied = copy_artifacts(args.out, args.copy_to) if args.copy_to else []
    record(bench="grpo_run", phase="done" if not left else "partial", left=left,
           seconds=time.perf_counter() - budget.start, copied=copied, preset=args.preset, settings=p)
    if left:
        print(f"not finished ({left}); rerun the same command to continue", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
