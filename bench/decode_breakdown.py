"""Where a decode step's time goes at a real shape (issue 17: the 7B batch-64 decode runs
at 56% of the HBM roofline, 2.37x HF's dynamic cache against a 2.5x goal). One call, one
card, random bf16 weights, greedy, EOS suppressed, the library's default buffer (prompt +
3072 slots), rows advancing from the prompt's end; each part is timed over the same steps:

  generate     the decode loop users run (`generation.generate`), ms per step
  forward      the model step alone (`TransformerLM.step`, one token per row, argmax of
               the logits fed back) in a `lax.fori_loop`: generate without the sampler's
               per-step work (softmax, entropy, buffer writes, the loop's bookkeeping)
  forward_all  the same with kv_read="all" (every slot of the buffer): what the
               live-length attention saves
  forward_<r>  the same with kv_read=<r> for each --reads entry (e.g. kernel, buckets)
  parity       per --reads entry: the largest |logit difference| to kv_read="all" over
               --parity-steps teacher-forced steps (the same tokens for every read), and
               how many rows' argmax differ
  cache_copies per --reads entry: cache-sized copies in the compiled `generate` (2, k
               and v on entry, means the decode loop updates the cache in place)
  matmuls      only the weight matmuls of every layer on [B, D] rows (q, k, v, o, gate,
               up, down) and the unembedding, chained so that none is dropped: the floor
               set by reading the weights through XLA's GEMMs at this many rows
  roofline     bytes a step must read (weights + live KV cache) / measured copy bandwidth

    python bench/decode_breakdown.py --shape qwen2.5-7b --batch 64
    python bench/decode_breakdown.py --shape qwen2.5-7b --batch 64 --reads kernel buckets
    python bench/decode_breakdown.py --shape tiny --batch 4 --prompt 16 --steps 8   # CPU smoke test

Prints one JSON record per part (and appends them to $OUT/decode_breakdown.jsonl).
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp

from common import (BUFFER_NEW, copy_bandwidth, decode_seconds, decode_step_bytes, emit, environment,
                    random_model, shape_config)
from degs_jax.generation import prefill
from degs_jax.models import TransformerLM
from degs_jax.models.compilation import large_copies

OUT = "decode_breakdown.jsonl"


def _median_seconds(run, repeats: int) -> tuple[float, float]:
    """(median seconds of run() over `repeats` calls after a first one; first call's seconds)."""
    t0 = time.perf_counter()
    jax.block_until_ready(run())
    first = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(run())
        times.append(time.perf_counter() - t)
    return sorted(times)[repeats // 2], first


def forward_seconds(cfg, params, batch: int, prompt: int, steps: int, repeats: int) -> tuple[float, float]:
    """`steps` model steps of every row after a `prompt`-token prefill (not timed)."""
    model = TransformerLM(cfg)
    tokens = jax.random.randint(jax.random.key(batch), (batch, prompt), 0, cfg.vocab_size, jnp.int32)
    lengths = jnp.full((batch,), prompt, jnp.int32)

    @functools.partial(jax.jit, donate_argnums=(1,))
    def loop(params, cache, last):
        def body(i, carry):
            cache, token = carry
            positions = jnp.full((batch, 1), prompt + i, jnp.int32)
            out = model.step(params, token, positions, cache)
            return out.cache, jnp.argmax(out.logits[:, 0], axis=-1).astype(jnp.int32)[:, None]
        return jax.lax.fori_loop(0, steps, body, (cache, last))  # the cache too: updated in place

    def run():
        state = prefill(model, params, tokens, lengths, prompt + BUFFER_NEW, jnp.bfloat16)
        jax.block_until_ready(state.cache)
        t = time.perf_counter()
        jax.block_until_ready(loop(params, state.cache, tokens[:, -1:]))
        return time.perf_counter() - t

    run()  # compile
    times = sorted(run() for _ in range(repeats))
    return times[repeats // 2], times[0]


def parity(cfg_all, cfg_read, params, batch: int, prompt: int, steps: int) -> dict:
    """Logits of `steps` teacher-forced model steps (tokens from kv_read="all"'s argmax)
    under cfg_read against cfg_all: the largest absolute difference, the largest |logit|,
    and the rows x steps whose argmax differs."""
    tokens = jax.random.randint(jax.random.key(batch + 1), (batch, prompt), 0, cfg_all.vocab_size, jnp.int32)
    lengths = jnp.full((batch,), prompt, jnp.int32)

    def run(cfg, forced):
        model = TransformerLM(cfg)
        cache = prefill(model, params, tokens, lengths, prompt + BUFFER_NEW, jnp.bfloat16).cache

        @jax.jit
        def loop(params, cache):
            def body(carry, i):
                cache, token = carry
                out = model.step(params, token, jnp.full((batch, 1), prompt + i, jnp.int32), cache)
                logits = out.logits[:, 0].astype(jnp.float32)
                chosen = jnp.argmax(logits, axis=-1).astype(jnp.int32) if forced is None else forced[:, i]
                return (out.cache, chosen[:, None]), (logits, jnp.argmax(logits, axis=-1))
            return jax.lax.scan(body, (cache, tokens[:, -1:]), jnp.arange(steps))[1]
        return loop(params, cache)

    want_logits, want_top = run(cfg_all, None)
    got_logits, got_top = run(cfg_read, want_top.T.astype(jnp.int32))
    return {"max_abs_diff": float(jnp.max(jnp.abs(got_logits - want_logits))),
            "max_abs_logit": float(jnp.max(jnp.abs(want_logits))),
            "argmax_differs": int(jnp.sum(got_top != want_top)), "compared": int(want_top.size)}


def cache_copies(cfg, params, batch: int, prompt: int) -> list[str]:
    """Cache-sized copies in the compiled `generate` (tests/test_live_attention.py's check)."""
    from degs_jax.generation import Proposal, SamplerSpec, generate
    model = TransformerLM(cfg)
    state = prefill(model, params, jnp.ones((batch, prompt), jnp.int32), jnp.full((batch,), prompt, jnp.int32),
                    prompt + BUFFER_NEW, jnp.bfloat16)
    hlo = generate.lower(model, params, state, jnp.full((batch,), 8, jnp.int32),
                         jax.random.split(jax.random.key(0), batch), SamplerSpec(Proposal(0.0), eos_ids=())
                         ).compile().as_text()
    return large_copies(hlo, state.cache.k.size // 2)


def matmul_seconds(cfg, params, batch: int, steps: int, repeats: int) -> float:
    """`steps` passes of the weight matmuls alone (per layer q, k, v, o, gate, up, down on
    [batch, D] rows, then the unembedding), each result feeding the next."""
    layers = params.layers
    w_u = params.unembedding()

    @jax.jit
    def loop(params_layers, w_u, x):
        def body(_, x):
            for layer in params_layers:
                q, k, v = x @ layer.q, x @ layer.k, x @ layer.v
                x = x + q @ layer.o + (jnp.sum(k) + jnp.sum(v)).astype(x.dtype)
                x = x + (jax.nn.silu(x @ layer.gate) * (x @ layer.up)) @ layer.down
            logits = jnp.einsum("bd,vd->bv", x, w_u, preferred_element_type=jnp.float32)
            return x + jnp.max(logits, axis=-1, keepdims=True).astype(x.dtype) * 0
        return jax.lax.fori_loop(0, steps, body, x)

    x = jnp.ones((batch, cfg.hidden_size), jnp.bfloat16) * 0.01
    return _median_seconds(lambda: loop(layers, w_u, x), repeats)[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen2.5-7b")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--steps", type=int, default=512, help="decode steps timed (default: 512, as real_shape.py)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--reads", nargs="*", default=[], choices=["kernel", "buckets", "loop"],
                    help="kv_read settings also timed, checked against 'all' and for cache copies")
    ap.add_argument("--parity-steps", type=int, default=32)
    ap.add_argument("--only-reads", action="store_true", help="skip generate, matmuls and roofline")
    args = ap.parse_args()
    if any(v <= 0 for v in (args.batch, args.prompt, args.steps, args.repeats)):
        ap.error("--batch, --prompt, --steps and --repeats must be positive")

    cfg, params = random_model(args.shape)
    bandwidth = copy_bandwidth(gib=0.25 if args.shape == "tiny" else 4.0)
    env = {**environment(), "shape": args.shape, "batch": args.batch, "prompt": args.prompt,
           "steps": args.steps, "buffer_slots": args.prompt + BUFFER_NEW, "copy_bandwidth_GBps": bandwidth / 1e9}
    per_step = lambda seconds: 1e3 * seconds / args.steps

    for read in args.reads:
        read_cfg = shape_config(args.shape, kv_read=read)
        emit({"bench": "decode_breakdown", "part": "parity", "kv_read": read,
              **parity(shape_config(args.shape, kv_read="all"), read_cfg, params, args.batch, args.prompt,
                       args.parity_steps), **env}, OUT)
        emit({"bench": "decode_breakdown", "part": "cache_copies", "kv_read": read,
              "copies": cache_copies(read_cfg, params, args.batch, args.prompt), **env}, OUT)
        median, fastest = forward_seconds(read_cfg, params, args.batch, args.prompt, args.steps, args.repeats)
        emit({"bench": "decode_breakdown", "part": f"forward_{read}", "kv_read": read,
              "ms_per_step": per_step(median), "fastest_ms_per_step": per_step(fastest), **env}, OUT)
    if args.only_reads:
        return
    generate_s, generate_first = decode_seconds(cfg, params, args.batch, args.prompt, args.steps,
                                                repeats=args.repeats, buffer_new=BUFFER_NEW)
    emit({"bench": "decode_breakdown", "part": "generate", "ms_per_step": per_step(generate_s),
          "first_call_s": generate_first, **env}, OUT)
    for part, read in (("forward", "auto"), ("forward_all", "all")):
        read_cfg = shape_config(args.shape, kv_read=read)
        median, fastest = forward_seconds(read_cfg, params, args.batch, args.prompt, args.steps, args.repeats)
        emit({"bench": "decode_breakdown", "part": part, "kv_read": read, "ms_per_step": per_step(median),
              "fastest_ms_per_step": per_step(fastest), **env}, OUT)
    emit({"bench": "decode_breakdown", "part": "matmuls",
          "ms_per_step": per_step(matmul_seconds(cfg, params, args.batch, args.steps, args.repeats)), **env}, OUT)
    step_bytes = decode_step_bytes(cfg, params, args.batch, args.prompt, args.steps)
    emit({"bench": "decode_breakdown", "part": "roofline", "bytes_per_step": step_bytes,
          "ms_per_step": 1e3 * step_bytes / bandwidth, **env}, OUT)


if __name__ == "__main__":
    main()
