"""SMC and SPS on the MATH500-shaped workload: power_smc, degs_smc and scalable_power vs
power_mcmc / degs_mcmc at the decoders' (the papers') settings, random Qwen2.5-7B-shaped
weights in bf16, and the public Power-SMC code (HF transformers / PyTorch) on the same
shape, settings and GPU, in one command.

Workload: `--problems` prompts of 128..320 random tokens (MATH500-shaped), EOS suppressed
so every completion uses the whole `--new-tokens` budget (default 384 = 2 blocks of 192,
to fit the time box; the paper's completions average ~600), alpha 4, beta 5 for the degs
variants. power_smc / degs_smc: N = 16 particles, ramp 400 tokens, ESS < N/2 checked every
64 tokens; scalable_power: blocks of 192, L = 32 candidates, K = 8 kept, M = 8 rollouts of
horizon 192, jackknife; MCMC: blocks of 192, 10 MH steps per block. All problems of a
method run as one batch (scalable_power: `--sps-chunk` problems at a time, its P·(L + K·M)
rows with their own KV caches do not fit at 64). Each method is compiled first on a copy
of its state whose rows are all finished (same shapes and static arguments, so the same
executable, and no work), then timed from the prefill to the last token.

Public reference (`--reference PATH/TO/smc_samp_utils.py`, from ArminAzizi98/Power-SMC;
never committed here): `smc_power_sample_memopt`, one prompt at a time (batch over
particles), HF `Qwen2ForCausalLM` with random weights of the same shape in bf16, the same
alpha, N, ESS threshold, ESS interval (`block_size`), ramp, proposal temperature 1/alpha,
no top-k / top-p, no `\\boxed{}` stop, EOS masked for the whole budget (`min_new_tokens` =
the budget: every particle runs every token, as ours with EOS suppressed). It runs first,
in a subprocess (before JAX takes the GPU), one untimed warm-up problem of 8 tokens, then
problems until `--reference-problems` or `--reference-seconds`; its seconds per problem
are the mean over those problems (an extrapolation to the whole set, stated as such).

    python bench/smc_workload.py --reference .reference/smc_samp_utils.py

Prints JSON records (and appends them to $OUT/smc.jsonl when $OUT is set).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

OUT_NAME = "smc.jsonl"
# power_smc_resample_every_check: power_smc with ESS threshold 1 (resampling, with its KV
# row copies, at every check). On random weights p is nearly uniform, the weights stay
# equal and the default threshold never resamples; this run measures the copies' cost.
METHODS = ("power_smc", "degs_smc", "scalable_power", "power_mcmc", "degs_mcmc", "power_smc_resample_every_check")
STARTED = time.perf_counter()


def emit(record: dict) -> None:
    """One JSON line to stdout and $OUT/smc.jsonl (no JAX import: the reference process
    must not touch the GPU through JAX)."""
    line = json.dumps(record)
    print(line, flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], OUT_NAME), "a") as f:
            f.write(line + "\n")


def make_prompts(problems: int, vocab: int, shortest: int, longest: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(0)
    return [rng.integers(0, vocab, rng.integers(shortest, longest + 1)).tolist() for _ in range(problems)]


# ------------------------------------------------------------------ the public Power-SMC code


def reference_part(args) -> None:
    """Time the public Power-SMC sampler (HF / PyTorch) one prompt at a time."""
    import importlib.util
    import types

    import torch
    import transformers

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from common import SHAPES

    spec = importlib.util.spec_from_file_location("power_smc_reference", args.reference)
    ref = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ref)
    s = SHAPES[args.shape]
    device = torch.device(args.reference_device)
    hf_cfg = transformers.Qwen2Config(
        hidden_size=s["hidden_size"], intermediate_size=s["intermediate_size"],
        num_hidden_layers=s["num_layers"], num_attention_heads=s["num_heads"],
        num_key_value_heads=s["num_kv_heads"], vocab_size=s["vocab_size"],
        tie_word_embeddings=s["tie_word_embeddings"], rope_theta=1e6, max_position_embeddings=32768,
        eos_token_id=s["vocab_size"] - 1, pad_token_id=0)
    t0 = time.perf_counter()
    torch.manual_seed(0)
    with device:
        model = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.bfloat16).eval()
    init_s = time.perf_counter() - t0
    # The sampler reads eos/pad ids and decodes text only for its \boxed{} stop (off here).
    tokenizer = types.SimpleNamespace(eos_token_id=hf_cfg.eos_token_id, pad_token_id=0,
                                      decode=lambda ids, skip_special_tokens=True: "")
    settings = dict(alpha=args.alpha, n_particles=args.particles, ess_threshold=0.5, temperature=1.0 / args.alpha,
                    block_size=args.resample_every, alpha_ramp_tokens=args.ramp_tokens, top_k=0, top_p=1.0,
                    repetition_penalty=1.0, stop_on_boxed=False)
    prompts = make_prompts(args.problems, s["vocab_size"], args.prompt_min, args.prompt_max)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def one(prompt, new):
        cfg = ref.SMCSamplingConfig(max_new_tokens=new, min_new_tokens=new, **settings)
        ids = torch.tensor([prompt], device=device)
        sync()
        t = time.perf_counter()
        with torch.no_grad():
            out = ref.smc_power_sample_memopt(model, tokenizer, ids, cfg)
        sync()
        return time.perf_counter() - t, out

    one(prompts[0], min(8, args.new_tokens))  # warm-up: kernels, allocator
    times = []
    started = time.perf_counter()
    for i, prompt in enumerate(prompts[: args.reference_problems]):
        sec, out = one(prompt, args.new_tokens)
        times.append(sec)
        emit({"bench": "reference_problem", "code": "ArminAzizi98/Power-SMC smc_power_sample_memopt",
              "problem": i, "prompt_tokens": len(prompt), "seconds": sec,
              "completion_tokens": int(out["sequences"].shape[1] - len(prompt)),
              "resamples": out["stats"]["resample_count"]})
        if time.perf_counter() - started > args.reference_seconds:
            break
    per_problem = sum(times) / len(times)
    emit({"bench": "reference", "code": "ArminAzizi98/Power-SMC smc_power_sample_memopt",
          "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
          "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
          "shape": args.shape, "settings": settings, "new_tokens": args.new_tokens,
          "eos": "masked for the whole budget (min_new_tokens = max_new_tokens)",
          "model_init_seconds": init_s, "problems_timed": len(times),
          "seconds_per_problem": per_problem,
          "seconds_for_all_problems_extrapolated": per_problem * args.problems,
          "note": "one prompt at a time; mean over the timed problems, extrapolated to the whole set"})


def run_reference_subprocess(args) -> dict | None:
    """The reference in its own process, before JAX allocates the GPU; its records are
    re-emitted here. Returns its summary record (None if it failed)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--reference-only"] + sys.argv[1:]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.reference_seconds + 300)
    except subprocess.TimeoutExpired:
        emit({"bench": "reference", "error": "timed out"})
        return None
    summary = None
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            print(line, flush=True)  # the child already appended it to $OUT
            if record.get("bench") == "reference":
                summary = record
    if proc.returncode != 0:
        emit({"bench": "reference", "error": proc.stderr[-2000:]})
    return summary


# ------------------------------------------------------------------ ours


def method_configs(method: str, args, num_layers: int):
    """The decoder's hyperparameters for this workload (its defaults with the budget) and
    its kernel config, EOS suppressed (no eos_ids), as `decode` builds it."""
    from degs_jax.methods import hyperparameters_for

    if method in ("power_smc", "degs_smc", "power_smc_resample_every_check"):
        always = method == "power_smc_resample_every_check"
        config = hyperparameters_for(
            "power_smc" if always else method, max_new_tokens=args.new_tokens, n_particles=args.particles,
            alpha=args.alpha, ramp_tokens=args.ramp_tokens, resample_every=args.resample_every,
            **(dict(ess_threshold=1.0) if always else {}))
        return config.to_dict(), config.kernel_config(num_layers, ())
    if method == "scalable_power":
        config = hyperparameters_for(method, max_new_tokens=args.new_tokens, alpha=args.alpha,
                                     block_len=args.block_len, rollout_horizon=args.block_len)
        return config.to_dict(), config.kernel_config(0, ())
    blocks = -(-args.new_tokens // args.block_len)
    config = hyperparameters_for(method, block_len=args.block_len, num_blocks=blocks, alpha=args.alpha)
    return config.to_dict(), config.kernel_config(num_layers, ())


def run_ours(method: str, lm, params, tokens, lengths, config, key, sps_chunk: int) -> dict:
    """Compile on finished rows, then time prefill + decoding. Returns counters/timings."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    from degs_jax.generation import prefill
    from degs_jax.rows import repeat_rows
    from degs_jax.mcmc import mcmc_block_donating
    from degs_jax.smc import final_weights, init_state, run_smc, smc_steps
    from degs_jax.sps import run_sps, sps_block

    S = tokens.shape[1] + config.max_new_tokens
    finished = lambda g: dataclasses.replace(g, ended=jnp.ones_like(g.ended))

    def rows_of(tok, lens, n):
        return repeat_rows(prefill(lm, params, jnp.asarray(tok), jnp.asarray(lens), S, jnp.bfloat16), n)

    def work(g):
        return [int(x) for x in jax.device_get((g.n_generated.sum(), g.n_forward.sum(), g.n_probed.sum()))]

    extra = {}
    if method in ("power_smc", "degs_smc", "power_smc_resample_every_check"):
        n = config.n_particles
        keys = jax.random.split(key, tokens.shape[0] * n)
        # The warm-up state is donated to smc_steps and its result dropped before the timed
        # run allocates its own (two 7B-shape states at 64 x 16 rows do not fit one card).
        warm = smc_steps(lm, params, init_state(finished(rows_of(tokens, lengths, n)), config,
                                                lm.num_layers), keys, config)
        jax.block_until_ready(final_weights(warm, keys, n))
        del warm
        t = time.perf_counter()
        state = run_smc(lm, params, rows_of(tokens, lengths, n), keys, config)
        weights, log_z, _ = final_weights(state, keys, n)
        jax.block_until_ready(weights)
        seconds = time.perf_counter() - t
        counters = work(state.gen)
        extra = dict(resamples_per_problem=float(state.resamples.mean()),
                     copied_rows=int(state.copied_rows.sum()))
    elif method == "scalable_power":
        counters, rollouts, seconds = [0, 0, 0], 0, 0.0
        block_keys = jax.random.split(key, tokens.shape[0])
        warm = finished(rows_of(tokens[:sps_chunk], lengths[:sps_chunk], 1))
        jax.block_until_ready(sps_block(lm, params, warm, block_keys[:sps_chunk], jnp.int32(0), config))
        del warm
        for start in range(0, tokens.shape[0], sps_chunk):
            part = slice(start, start + sps_chunk)
            t = time.perf_counter()
            state, r = run_sps(lm, params, rows_of(tokens[part], lengths[part], 1), block_keys[part], config)
            jax.block_until_ready(state.length)
            seconds += time.perf_counter() - t
            counters = [a + b for a, b in zip(counters, work(state))]
            rollouts += int(r.sum())
        extra = dict(rollouts=rollouts, problems_per_batch=sps_chunk)
    else:
        keys = jax.random.split(key, tokens.shape[0])
        warm = finished(rows_of(tokens, lengths, 1))
        jax.block_until_ready(mcmc_block_donating(lm, params, warm, keys, jnp.int32(0), config))
        del warm
        t = time.perf_counter()
        state = rows_of(tokens, lengths, 1)
        accepted = []
        for block in range(config.num_blocks):
            state, decisions, _ = mcmc_block_donating(lm, params, state, keys, jnp.int32(block), config)
            acc = decisions.accepted_steps()
            accepted.append(float(jax.device_get(acc).mean()) / config.mh_steps)
        jax.block_until_ready(state.length)
        seconds = time.perf_counter() - t
        counters = work(state)
        extra = dict(mean_acceptance=sum(accepted) / len(accepted))
    gen, fwd, probed = counters
    return dict(seconds=seconds, generated_tokens=gen, forward_tokens=fwd, probed_token_layers=probed,
                forward_equivalents=fwd + probed / lm.num_layers, **extra)


def jax_part(args, reference: dict | None) -> None:
    import jax

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from common import environment, random_model
    from degs_jax.generation import pad_prompts
    from degs_jax.models import TransformerLM

    emit({"bench": "environment", **environment()})
    cfg, params = random_model(args.shape)
    lm = TransformerLM(cfg)
    prompts = make_prompts(args.problems, cfg.vocab_size, args.prompt_min, args.prompt_max)
    tokens, lengths = pad_prompts(prompts)  # one padded width for every method and chunk
    results = {}
    for method in args.methods.split(","):
        if time.perf_counter() - STARTED > args.time_budget:
            emit({"bench": "smc_workload", "method": method, "skipped": "time budget"})
            continue
        hp, config = method_configs(method, args, cfg.num_layers)
        try:
            r = run_ours(method, lm, params, tokens, lengths, config, jax.random.key(0), args.sps_chunk)
        except jax.errors.JaxRuntimeError as e:  # e.g. RESOURCE_EXHAUSTED: record and go on
            emit({"bench": "smc_workload", "method": method, "error": str(e)[:500]})
            continue
        results[method] = r
        emit({"bench": "smc_workload", "method": method, "shape": args.shape, "problems": args.problems,
              "new_tokens": args.new_tokens, "hyperparameters": {k: v for k, v in hp.items() if v is not None},
              **r, "seconds_per_problem": r["seconds"] / args.problems,
              "forward_equivalents_per_problem": r["forward_equivalents"] / args.problems,
              "generated_tokens_per_s": r["generated_tokens"] / r["seconds"]})
    if reference and "power_smc" in results:
        ours = results["power_smc"]["seconds"] / args.problems
        emit({"bench": "smc_vs_reference", "problems": args.problems,
              "ours_seconds_per_problem": ours, "reference_seconds_per_problem": reference["seconds_per_problem"],
              "speedup_per_problem": reference["seconds_per_problem"] / ours,
              "note": f"ours: {args.problems} problems in one batch; reference: one at a time, "
                      f"mean of {reference['problems_timed']} problems"})
    emit({"bench": "smc_workload_done", "seconds_since_start": time.perf_counter() - STARTED})


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen2.5-7b", help="bench/common.py shape (tiny: CPU check)")
    ap.add_argument("--problems", type=int, default=64)
    ap.add_argument("--prompt-min", type=int, default=128)
    ap.add_argument("--prompt-max", type=int, default=320)
    ap.add_argument("--new-tokens", type=int, default=384)
    ap.add_argument("--alpha", type=float, default=4.0)
    ap.add_argument("--particles", type=int, default=16)
    ap.add_argument("--ramp-tokens", type=int, default=400)
    ap.add_argument("--resample-every", type=int, default=64)
    ap.add_argument("--block-len", type=int, default=192, help="SPS / MCMC block and SPS rollout horizon")
    ap.add_argument("--sps-chunk", type=int, default=8, help="scalable_power problems per batch")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--time-budget", type=float, default=330.0,
                    help="seconds from the start after which no further method is started (the "
                         "skipped ones are recorded as such; rerun them with --methods)")
    ap.add_argument("--reference", default=None, help="path of the public Power-SMC smc_samp_utils.py")
    ap.add_argument("--reference-problems", type=int, default=3)
    ap.add_argument("--reference-seconds", type=float, default=90.0)
    ap.add_argument("--reference-device", default="cuda")
    ap.add_argument("--reference-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.reference_only:
        reference_part(args)
        return
    reference = run_reference_subprocess(args) if args.reference else None
    jax_part(args, reference)


if __name__ == "__main__":
    main()
