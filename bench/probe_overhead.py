"""Cost of the fused logit-lens probe (K = 7 layers) inside the forward pass vs the
plain forward, for a Qwen2.5-7B-shaped random model: prefill of 2048 tokens (batch 1)
and decode steps at batch 1, 16, 64 inside the generation loop (prompt 2048, 64 steps,
temperature 1, cache of the library's default prompt + 3072 slots), where the cache is
carried in place as in real sampling.

    python bench/probe_overhead.py
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp

from common import BUFFER_NEW, emit, environment, random_model, timed
from degs_jax.generation import Proposal, SamplerSpec, generate, prefill
from degs_jax.lens import LensConfig, default_lsub
from degs_jax.models import TransformerLM
from degs_jax.models import forward


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shape", default="qwen2.5-7b")
    ap.add_argument("--prefill", type=int, default=2048)
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--chunk", type=int, default=None,
                    help="stream the lens in chunks of this size (default: the model's choice)")
    ap.add_argument("--steps", type=int, default=64, help="decode steps timed per batch size")
    args = ap.parse_args()
    emit({"bench": "environment", **environment()}, "probe.jsonl")
    cfg, params = random_model(args.shape)
    lsub = default_lsub(cfg.num_layers)

    @functools.partial(jax.jit, static_argnames=("lens",))
    def prefill_forward(params, tokens, positions, lens):
        out = forward(params, cfg, tokens, positions, lens_layers=lens, lens_chunk=args.chunk,
                      logits_at=jnp.full((tokens.shape[0],), tokens.shape[1] - 1, jnp.int32))
        return out.logits, out.lens

    T = args.prefill
    tokens = jax.random.randint(jax.random.key(0), (1, T), 0, cfg.vocab_size, jnp.int32)
    pos = jnp.arange(T, dtype=jnp.int32)[None]
    base = timed(prefill_forward, params, tokens, pos, (), repeats=5)
    probed = timed(prefill_forward, params, tokens, pos, lsub, repeats=5)
    emit({"bench": "probe_prefill", "shape": args.shape, "tokens": T, "chunk": args.chunk, "lsub": lsub,
          "plain_ms": 1e3 * base, "probed_ms": 1e3 * probed, "ratio": probed / base}, "probe.jsonl")

    # Decode steps inside the real generation loop (cache carried in place), prompt T.
    lens = LensConfig(lsub=lsub)
    model = TransformerLM(cfg, lens_chunk=args.chunk)
    for B in (int(b) for b in args.batches.split(",")):
        toks = jax.random.randint(jax.random.key(B), (B, T), 0, cfg.vocab_size, jnp.int32)
        lengths = jnp.full((B,), T, jnp.int32)
        keys = jax.random.split(jax.random.key(1), B)
        times = {}
        for label, l in (("plain", None), ("probed", lens)):
            spec = SamplerSpec(Proposal(1.0), eos_ids=(), lens=l)

            def run():
                st = prefill(model, params, toks, lengths, T + BUFFER_NEW, jnp.bfloat16)
                jax.block_until_ready(st.length)
                t = time.perf_counter()
                jax.block_until_ready(generate(model, params, st, lengths + args.steps, keys, spec).length)
                return time.perf_counter() - t

            run()
            times[label] = sorted(run() for _ in range(3))[1] / (args.steps + 1)
        emit({"bench": "probe_decode", "shape": args.shape, "batch": B, "prompt": T, "chunk": args.chunk,
              "buffer_slots": T + BUFFER_NEW,
              "steps": args.steps, "lsub": lsub, "plain_ms_per_step": 1e3 * times["plain"],
              "probed_ms_per_step": 1e3 * times["probed"],
              "ratio": times["probed"] / times["plain"]}, "probe.jsonl")


if __name__ == "__main__":
    main()
