"""Cost of the fused logit-lens probe (K = 7 layers) inside the forward pass vs the
plain forward, for a Qwen2.5-7B-shaped random model: prefill of 2048 tokens (batch 1)
and one decode step at batch 1, 16, 64 (cache of 2048 + 64 slots).

    python bench/probe_overhead.py
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp

from common import emit, environment, random_model, timed
from degs_jax.lens import default_lsub
from degs_jax.models import forward, init_cache


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shape", default="qwen2.5-7b")
    ap.add_argument("--prefill", type=int, default=2048)
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--chunk", type=int, default=8192)
    args = ap.parse_args()
    emit({"bench": "environment", **environment()}, "probe.jsonl")
    cfg, params = random_model(args.shape)
    lsub = default_lsub(cfg.num_layers)

    @functools.partial(jax.jit, static_argnames=("lens",))
    def step(params, tokens, positions, cache, lens):
        out = forward(params, cfg, tokens, positions, cache, lens_layers=lens,
                      lens_chunk=args.chunk, logits_at=positions[:, -1] * 0 + tokens.shape[1] - 1)
        return out.logits, out.cache, out.lens

    T = args.prefill
    tokens = jax.random.randint(jax.random.key(0), (1, T), 0, cfg.vocab_size, jnp.int32)
    pos = jnp.arange(T, dtype=jnp.int32)[None]
    cache = init_cache(cfg, 1, T, jnp.bfloat16)
    base = timed(step, params, tokens, pos, cache, (), repeats=5)
    probed = timed(step, params, tokens, pos, cache, lsub, repeats=5)
    emit({"bench": "probe_prefill", "shape": args.shape, "tokens": T, "lsub": lsub,
          "plain_ms": 1e3 * base, "probed_ms": 1e3 * probed, "ratio": probed / base}, "probe.jsonl")

    S = T + 64
    for B in (int(b) for b in args.batches.split(",")):
        cache = init_cache(cfg, B, S, jnp.bfloat16)
        tok = jax.random.randint(jax.random.key(B), (B, 1), 0, cfg.vocab_size, jnp.int32)
        p = jnp.full((B, 1), T, jnp.int32)
        base = timed(step, params, tok, p, cache, (), repeats=20)
        probed = timed(step, params, tok, p, cache, lsub, repeats=20)
        emit({"bench": "probe_decode", "shape": args.shape, "batch": B, "cache_slots": S,
              "lsub": lsub, "plain_ms": 1e3 * base, "probed_ms": 1e3 * probed,
              "ratio": probed / base}, "probe.jsonl")


if __name__ == "__main__":
    main()
