"""Programs compiled by a sweep over beta: DEGS-MCMC at each beta in turn through `decode`
(the host driver `degs sample/eval` use), then the same sweep as one `jax.vmap` of
`decode_tokens` over beta. Per value: the functions JAX traced, the programs XLA compiled
(JAX's own monitoring events) and the wall seconds. With beta as data of the program
(`degs_jax.traced_fields`) only the first value traces and compiles; where beta is part of
the program, every value compiles its own and the vmap cannot be written.

Shape: random weights of `--shape` (bench/common.py), float32, `--prompts` prompts of 16
tokens, DEGS-MCMC with `--block-len`, `--num-blocks`, `--mh-steps` (one chain per
prompt), the library's default alpha, tau and L_sub. The persistent compilation cache is
off (every compilation counts).

    python bench/sweep_compiles.py --shape smollm2-135m --betas 1,2,5,10
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from common import emit, environment, shape_config
from degs_jax.decoders import decode, decode_tokens
from degs_jax.generation import pad_prompts
from degs_jax.methods import DegsMCMC
from degs_jax.models import TransformerLM, init_params

OUT = "sweep_compiles.jsonl"
EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "traced",
          "/jax/core/compile/backend_compile_duration": "compiled"}


class Counter:
    """Counts JAX's trace and compile events from its creation on."""

    def __init__(self):
        self.counts = {name: 0 for name in EVENTS.values()}
        jax.monitoring.register_event_duration_secs_listener(self._seen)

    def _seen(self, event, duration, **kwargs):
        if event in EVENTS:
            self.counts[EVENTS[event]] += 1

    def since(self, before: dict) -> dict:
        return {name: self.counts[name] - before[name] for name in self.counts}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="tiny", help="model shape of bench/common.py, random weights")
    ap.add_argument("--betas", default="1,2,5,10", help="comma-separated values of beta (each > 0)")
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--block-len", type=int, default=16)
    ap.add_argument("--num-blocks", type=int, default=2)
    ap.add_argument("--mh-steps", type=int, default=2)
    ap.add_argument("--tag", default="", help="a label stored in each record (e.g. the code version)")
    args = ap.parse_args()
    betas = [float(b) for b in args.betas.split(",")]
    jax.config.update("jax_enable_compilation_cache", False)

    cfg = shape_config(args.shape, max_len=4096)
    model = TransformerLM(cfg)
    params = init_params(cfg, jax.random.key(0), jnp.float32)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, cfg.vocab_size, 16).tolist() for _ in range(args.prompts)]
    keys = jax.random.split(jax.random.key(1), args.prompts)
    chain = dict(block_len=args.block_len, num_blocks=args.num_blocks, mh_steps=args.mh_steps)
    emit({"bench": "environment", **environment(), "tag": args.tag}, OUT)
    counter = Counter()

    for beta in betas:
        before, t0 = dict(counter.counts), time.perf_counter()
        result = decode(model, params, prompts, DegsMCMC(beta=beta, **chain), keys=keys, eos_ids=())
        emit({"bench": "sweep_compiles", "tag": args.tag, "driver": "decode", "shape": args.shape, "beta": beta,
              **chain, "prompts": args.prompts, **counter.since(before), "seconds": round(time.perf_counter() - t0, 3),
              "log_p": [round(o.chosen.log_p, 4) for o in result.outputs]}, OUT)

    tokens, lengths = pad_prompts(prompts)
    before, t0 = dict(counter.counts), time.perf_counter()
    record = {"bench": "sweep_compiles", "tag": args.tag, "driver": "vmap(decode_tokens)", "shape": args.shape,
              "betas": betas, **chain, "prompts": args.prompts}
    try:
        sweep = lambda params, beta: decode_tokens(model, params, jnp.asarray(tokens), jnp.asarray(lengths), keys,
                                                   DegsMCMC(beta=beta, **chain))
        swept = jax.jit(jax.vmap(sweep, in_axes=(None, 0)))(params, jnp.asarray(betas, jnp.float32))
        record["log_p"] = np.round(np.asarray(swept.log_p), 4).tolist()
    except Exception as e:  # beta as part of the program: a traced beta cannot be hashed
        record["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    emit({**record, **counter.since(before), "seconds": round(time.perf_counter() - t0, 3)}, OUT)


if __name__ == "__main__":
    main()
