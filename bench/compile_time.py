"""Compile time of the two programs a new shape needs before its first token: the probed
decode loop (`generation.generate` with the default L_sub lens) and one MCMC block
(`mcmc.mcmc_block`: proposal extension + 10 MH steps, beta = 5), lowered from shapes only
(no weights are allocated, so 7B shapes compile on a laptop).

Layouts: `list` (layers unrolled into the program, the layout `load` returns) and
`stacked` (one `lax.scan` over the layers: `degs_jax.models.stack_layers`). kv_read: the
attention read (`auto` = `loop` on CPU and for prefills, the Pallas `kernel` for GPU decode steps with list layers, `buckets` for other decode steps). With --persistent-cache
DIR each program is compiled twice: cold (written to DIR) and again after
`jax.clear_caches()` (read back from DIR), the cost of a later process.

Buffer: the library defaults (`degs_jax.methods`): 16 blocks x 192 = 3072 new-token
slots after the prompt, for both programs; the MCMC block is degs_mcmc's defaults
(10 MH steps, alpha 4, beta 5, default L_sub).

    python bench/compile_time.py --shapes smollm2-135m qwen2.5-7b --layouts list stacked
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

from common import default_mcmc, emit, environment, shape_config
from degs_jax.generation import Proposal, SamplerSpec, generate, prefill
from degs_jax.mcmc import mcmc_block
from degs_jax.models import TransformerLM
from degs_jax.models import param_shapes
from degs_jax.models.compilation import enable_compilation_cache

OUT = "compile.jsonl"


def abstract_programs(cfg, layout: str, batch: int, prompt: int):
    """(name, jitted function, abstract arguments) of the two programs."""
    sds = jax.ShapeDtypeStruct
    shapes = param_shapes(cfg, stacked=layout == "stacked")
    params = jax.tree.map(lambda s: sds(s, jnp.bfloat16), shapes, is_leaf=lambda x: isinstance(x, tuple))
    model = TransformerLM(cfg)
    mcmc_config = default_mcmc("degs_mcmc", cfg.num_layers, eos_ids=(0,))
    keys = jax.eval_shape(lambda: jax.random.split(jax.random.key(0), batch))
    lengths = sds((batch,), jnp.int32)
    state = jax.eval_shape(lambda p: prefill(model, p, jnp.zeros((batch, prompt), jnp.int32),
                                             jnp.full((batch,), prompt, jnp.int32),
                                             prompt + mcmc_config.max_new_tokens, jnp.bfloat16), params)
    spec = SamplerSpec(Proposal(1.0), eos_ids=(0,), lens=mcmc_config.lens)
    return [("generate", generate, (model, params, state, lengths, keys, spec)),
            ("mcmc_block", mcmc_block,
             (model, params, state, keys, sds((), jnp.int32), mcmc_config))]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["smollm2-135m", "qwen2.5-7b"])
    ap.add_argument("--layouts", nargs="+", default=["list", "stacked"], choices=["list", "stacked"])
    ap.add_argument("--kv-reads", nargs="+", default=["auto"], choices=["auto", "kernel", "loop", "buckets", "all"])
    ap.add_argument("--programs", nargs="+", default=["generate", "mcmc_block"])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--persistent-cache", default=None, metavar="DIR")
    args = ap.parse_args()
    if args.persistent_cache:
        enable_compilation_cache(args.persistent_cache)
    emit({"bench": "environment", **environment()}, OUT)
    for shape in args.shapes:
        for kv_read in args.kv_reads:
            cfg = shape_config(shape, kv_read=kv_read)
            for layout in args.layouts:
                for name, fn, fn_args in abstract_programs(cfg, layout, args.batch, args.prompt):
                    if name not in args.programs:
                        continue
                    t0 = time.perf_counter()
                    lowered = fn.lower(*fn_args)
                    t1 = time.perf_counter()
                    lowered.compile()
                    t2 = time.perf_counter()
                    record = {"bench": "compile", "shape": shape, "program": name, "layout": layout,
                              "kv_read": kv_read, "batch": args.batch, "prompt": args.prompt,
                              "max_new_tokens": fn_args[2].tokens.shape[1] - args.prompt,
                              "lower_seconds": t1 - t0, "compile_seconds": t2 - t1}
                    if args.persistent_cache:
                        jax.clear_caches()
                        t3 = time.perf_counter()
                        fn.lower(*fn_args).compile()
                        record["warm_cache_seconds"] = time.perf_counter() - t3
                    emit(record, OUT)


if __name__ == "__main__":
    main()
