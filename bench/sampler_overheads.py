"""Host-loop and sampler overheads of issue 11 / 17 (random weights, bf16, EOS suppressed):

- chunk: the host round trip of one call of `decode`'s host loop
  (`decoders.advance_on_host`, Ctrl-C responsive): a zero-advance `advance_chunk` call,
  and the chunked decode with fixed chunk sizes against one `generate` call;
- truncations: a decode with each proposal truncation (top-k 50, what
  `reference_quirks=True` adds, by the threshold search `generation.kth_largest` and by
  `lax.top_k`; top-p 0.9; min-p 0.05; typical 0.95) against plain sampling;
- memory: peak device memory of one MCMC block with and without donating the state
  (`mcmc_block_donating` vs `mcmc_block`), each in a fresh process.

    python bench/sampler_overheads.py --shape qwen2.5-0.5b --batch 64          # GPU
    python bench/sampler_overheads.py --shape tiny --batch 8 --new 64 --prompt 16  # CPU check
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

import jax
import jax.numpy as jnp

from common import SHAPES, default_mcmc, emit, environment, random_model

from degs_jax import decoders, generation
from degs_jax.generation import Proposal, SamplerSpec, generate, prefill, truncations
from degs_jax.methods import Temperature
from degs_jax.models import TransformerLM
from degs_jax.models import ModelConfig, init_params

TINY = ModelConfig(architecture="Qwen2ForCausalLM", vocab_size=4096, hidden_size=128,
                   intermediate_size=256, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32,
                   rope_theta=1e4, rms_norm_eps=1e-6, max_position_embeddings=4096, qkv_bias=True,
                   tie_word_embeddings=False, eos_token_ids=(0,))


def model_of(shape: str):
    if shape == "tiny":
        return TINY, init_params(TINY, jax.random.key(0), jnp.bfloat16)
    return random_model(shape)


def prompts(cfg, batch, prompt):
    tokens = jax.random.randint(jax.random.key(batch), (batch, prompt), 0, cfg.vocab_size, jnp.int32)
    return tokens, jnp.full((batch,), prompt, jnp.int32), jax.random.split(jax.random.key(1), batch)


def bench_chunks(args, cfg, params):
    """Per-call host cost of `decode`'s loop: an `advance_chunk` call that runs no advance
    (dispatch, the donated carry passed through, the device_get of done and progress
    that the host loop does), minimum and median over many calls; and the host loop
    (`advance_on_host`, sampling: an advance is a decode step) at fixed chunk sizes
    against one `generate` call."""
    model = TransformerLM(cfg)
    tokens, lengths, keys = prompts(cfg, args.batch, args.prompt)
    method = Temperature(temperature=1.0, max_new_tokens=args.new, probe=False)
    spec = method.plan(model, ())  # the sampler's settings: temperature 1, no EOS, no probing
    steps = args.new + 1  # every row draws `new` tokens and consumes its last one
    limit = lengths + args.new
    state = lambda: jax.block_until_ready(prefill(model, params, tokens, lengths, args.prompt + args.new))

    carry = method.init(model, params, state(), keys, spec)
    empty = []
    for i in range(args.empty_calls + 1):
        t = time.perf_counter()
        carry, done, progress, _ = decoders.advance_chunk(model, params, carry, keys, jnp.int32(0), method, spec)
        jax.device_get((done, progress))
        if i:  # the first call compiles
            empty.append(time.perf_counter() - t)
    empty.sort()

    def whole():
        jax.block_until_ready(generate(model, params, state(), limit, keys, spec).length)

    def chunked(chunk):
        def run():
            decoders.FIRST_CHUNK_ADVANCES = decoders.MAX_CHUNK_ADVANCES = chunk  # fixed chunk size
            out = decoders.advance_on_host(model, params, method.init(model, params, state(), keys, spec), keys,
                                           method, spec)
            jax.block_until_ready(out.state.length)
        return run

    # Interleaved repeats (one of each variant per round), minimum per variant: load from
    # other processes then disturbs every variant alike.
    variants = {"one_call": whole, **{chunk: chunked(chunk) for chunk in args.chunks}}
    times = {name: [] for name in variants}
    for round_ in range(args.repeats + 1):
        for name, fn in variants.items():
            t = time.perf_counter()
            fn()
            if round_:  # round 0 compiles
                times[name].append(time.perf_counter() - t)
    one_call = min(times["one_call"])
    record = {"bench": "chunk_overhead", "shape": args.shape, "batch": args.batch, "prompt": args.prompt,
              "new_tokens": args.new, "empty_chunk_ms_min": 1e3 * empty[0],
              "empty_chunk_ms_median": 1e3 * empty[len(empty) // 2], "one_call_seconds": one_call,
              "ms_per_step": 1e3 * one_call / steps, "chunked": []}
    for chunk in args.chunks:
        sec = min(times[chunk])
        calls = -(-steps // chunk)
        record["chunked"].append({"chunk_steps": chunk, "calls": calls, "seconds": sec,
                                  "overhead_per_chunk_ms": 1e3 * (sec - one_call) / calls,
                                  "overhead_fraction": sec / one_call - 1})
    emit(record, "sampler_overheads.jsonl")


# The truncations timed (`generation.truncations` keywords): the reference's top-k 50 and
# common settings of the others.
TRUNCATIONS = {"plain": {}, "top_k_50": dict(top_k=50), "top_p_0.9": dict(top_p=0.9),
               "min_p_0.05": dict(min_p=0.05), "typical_0.95": dict(typical_p=0.95)}


def bench_truncations(args, cfg, params):
    """A decode of `new` tokens at temperature 0.25 with each proposal truncation, against
    plain sampling; top-k 50 also with `lax.top_k` in place of the threshold search."""
    model = TransformerLM(cfg)
    tokens, lengths, keys = prompts(cfg, args.batch, args.prompt)
    threshold_search = generation.kth_largest
    by_sort = lambda z, k: jax.lax.top_k(z, k)[0][:, -1:]
    runs = [(label, cut, threshold_search) for label, cut in TRUNCATIONS.items()]
    runs.append(("top_k_50_lax_top_k", TRUNCATIONS["top_k_50"], by_sort))
    times = {}
    for label, cut, kth in runs:
        generation.kth_largest = kth
        jax.clear_caches()
        spec = SamplerSpec(Proposal(0.25, truncations(**cut)), eos_ids=())

        def run():
            s = jax.block_until_ready(prefill(model, params, tokens, lengths, args.prompt + args.new))
            t = time.perf_counter()
            jax.block_until_ready(generate(model, params, s, lengths + args.new, keys, spec).length)
            return time.perf_counter() - t

        run()
        times[label] = sorted(run() for _ in range(args.repeats))[args.repeats // 2]
    generation.kth_largest = threshold_search
    emit({"bench": "truncation_cost", "shape": args.shape, "batch": args.batch, "prompt": args.prompt,
          "new_tokens": args.new, "temperature": 0.25, "seconds": times,
          "over_plain": {label: sec / times["plain"] for label, sec in times.items()}},
         "sampler_overheads.jsonl")


def peak_memory(args, cfg, params, donate: bool):
    from degs_jax.mcmc import mcmc_block, mcmc_block_donating

    model = TransformerLM(cfg)
    tokens, lengths, keys = prompts(cfg, args.batch, args.prompt)
    mcmc_config = default_mcmc("power_mcmc", cfg.num_layers, block_len=args.new // 2, num_blocks=2, mh_steps=2)
    state = prefill(model, params, tokens, lengths, args.prompt + mcmc_config.max_new_tokens)
    block = mcmc_block_donating if donate else mcmc_block
    for b in range(mcmc_config.num_blocks):
        state, _, _ = block(model, params, state, keys, jnp.int32(b), mcmc_config)
    jax.block_until_ready(state.length)
    stats = jax.devices()[0].memory_stats() or {}
    emit({"bench": "mcmc_peak_memory", "shape": args.shape, "batch": args.batch,
          "prompt": args.prompt, "block_len": mcmc_config.block_len, "donated": donate,
          "peak_bytes_in_use": stats.get("peak_bytes_in_use"),
          "cache_bytes": sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state.cache))},
         "sampler_overheads.jsonl")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen2.5-0.5b", choices=["tiny", *SHAPES])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--new", type=int, default=512)
    ap.add_argument("--chunks", type=int, nargs="+", default=[8, 32, 128])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--empty-calls", type=int, default=50, help="zero-step chunk calls timed")
    ap.add_argument("--only", choices=["chunk", "truncations", "memory"], nargs="+",
                    default=["chunk", "truncations", "memory"])
    ap.add_argument("--peak-memory", choices=["donated", "plain"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    cfg, params = model_of(args.shape)
    if args.peak_memory:  # child process: one measurement on a fresh device
        peak_memory(args, cfg, params, args.peak_memory == "donated")
        return
    emit({"bench": "environment", **environment()}, "sampler_overheads.jsonl")
    if "chunk" in args.only:
        bench_chunks(args, cfg, params)
    if "truncations" in args.only:
        bench_truncations(args, cfg, params)
    if "memory" in args.only:
        for variant in ("plain", "donated"):
            subprocess.run([sys.executable, *sys.argv, "--peak-memory", variant], check=True)


if __name__ == "__main__":
    main()
