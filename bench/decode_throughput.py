"""Decode throughput of degs_jax generation (random Qwen2.5 shapes, bf16, prompt 256,
512 new tokens, EOS suppressed, greedy as HF's default), and percent of the HBM roofline.

    python bench/decode_throughput.py --shapes qwen2.5-0.5b:1,64,256 qwen2.5-7b:1,16,64
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

from common import copy_bandwidth, emit, environment, param_bytes, random_model
from degs_jax.generation import SamplerSpec, generate, prefill


def run(name: str, batches: list[int], prompt: int, new: int, temperature: float, bw: float):
    cfg, params = random_model(name)
    spec = SamplerSpec(temperature=temperature, eos_ids=())
    S = prompt + new
    for B in batches:
        tokens = jax.random.randint(jax.random.key(B), (B, prompt), 0, cfg.vocab_size, jnp.int32)
        lengths = jnp.full((B,), prompt, jnp.int32)
        keys = jax.random.split(jax.random.key(1), B)
        limit = lengths + new

        def one():
            st = prefill(params, cfg, tokens, lengths, S, jnp.bfloat16)
            jax.block_until_ready(st.length)
            t = time.perf_counter()
            st = generate(params, cfg, st, limit, keys, spec)
            jax.block_until_ready(st.length)
            return time.perf_counter() - t, st

        t0 = time.perf_counter()
        one()  # compile
        compile_s = time.perf_counter() - t0
        sec = sorted(one()[0] for _ in range(3))[1]
        steps = new + 1  # the last token is consumed too (its lens statistics)
        # Bytes a step must read: every weight but the embedding table (only B rows are
        # gathered), plus the KV cache up to the mean length.
        weight_bytes = param_bytes(params) - (0 if cfg.tie_word_embeddings else params.embed.size * 2)
        kv_bytes = 2 * cfg.num_layers * B * (prompt + new / 2) * cfg.num_kv_heads * cfg.head_dim * 2
        step_s = sec / steps
        emit({"bench": "decode", "shape": name, "batch": B, "prompt": prompt, "new_tokens": new,
              "temperature": temperature, "seconds": sec, "compile_seconds": compile_s,
              "tokens_per_s": B * new / sec, "ms_per_step": 1e3 * step_s,
              "roofline_fraction": (weight_bytes + kv_bytes) / step_s / bw,
              "bytes_per_step": weight_bytes + kv_bytes}, "decode.jsonl")


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shapes", nargs="+", default=["qwen2.5-0.5b:1,64,256", "qwen2.5-7b:1,16,64"])
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--new", type=int, default=512)
    ap.add_argument("--temperature", type=float, default=0.0)
    args = ap.parse_args()
    env = environment()
    bw = copy_bandwidth()
    emit({"bench": "environment", **env, "copy_bandwidth_GBps": bw / 1e9}, "decode.jsonl")
    for item in args.shapes:
        name, batches = item.split(":")
        run(name, [int(b) for b in batches.split(",")], args.prompt, args.new, args.temperature, bw)


if __name__ == "__main__":
    main()
