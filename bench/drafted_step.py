r"""What a verification forward costs (issue 55): milliseconds per step of
`generation.drafted_decode_step` against the number of draft tokens k and the number of
active rows, at real model shapes with random weights (bf16, the DEGS-MCMC sampler of the
library's defaults: temperature 1/alpha = 0.25, the default lens L_sub, tau 0.25).

    python bench/drafted_step.py --shapes qwen2.5-1.5b qwen2.5-7b --batches 1,8,64 --draft-tokens 0,2,4,8,16
    python bench/drafted_step.py --shapes tiny --batches 1,2 --draft-tokens 0,2 --context 8 --steps 4  # CPU

Per (shape, batch, k): the rows are prefilled with `--context` random tokens (a chain deep
in its completion), then `--steps` steps run in one jitted `lax.fori_loop`, every row
active and drafting k tokens (k + 1 positions per forward); the median of `--repeats`
timed calls, its compile separately. Random weights reject nearly every draft token, so a
step here draws about one token: the number is the cost of the forward and of the
vocabulary work over k + 1 slots, which does not depend on what is kept. Seconds per
generated token are then ms_per_step / (tokens per step), the latter measured on real
chains (`bench/self_draft_chain.py`): drafting pays where ms_per_step(k) / ms_per_step(0)
is below the tokens per step it buys.
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp

from common import emit, environment, random_model
from degs_jax.generation import Proposal, SamplerSpec, drafted_decode_step, prefill
from degs_jax.lens import LensConfig
from degs_jax.methods import hyperparameters_for
from degs_jax.models import TransformerLM


def _ints(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated ints >= 0, got {text!r}")
    return values


@functools.partial(jax.jit, static_argnames=("model", "steps", "k"))
def run_steps(model, params, state, keys, sampler, steps: int, k: int):
    B = state.length.shape[0]
    limit = jnp.full((B,), state.max_len, jnp.int32)
    active = jnp.ones((B,), bool)

    def body(i, state):
        draft = jax.random.randint(jax.random.fold_in(jax.random.key(7), i), (B, k), 0, model.cfg.vocab_size,
                                   jnp.int32)
        state, _ = drafted_decode_step(model, params, state, active, limit, keys, state.length, sampler, draft,
                                       jnp.full((B,), k, jnp.int32))
        return state

    return jax.lax.fori_loop(0, steps, body, state)


def measure(model, params, sampler, batch: int, k: int, context: int, steps: int, repeats: int) -> dict:
    cfg = model.cfg
    prompts = jax.random.randint(jax.random.key(batch), (batch, context), 0, cfg.vocab_size, jnp.int32)
    lengths = jnp.full((batch,), context, jnp.int32)
    keys = jax.random.split(jax.random.key(1), batch)
    max_len = context + steps * (k + 1) + 1

    def once():
        state = prefill(model, params, prompts, lengths, max_len, jnp.bfloat16)
        jax.block_until_ready(state.length)
        t = time.perf_counter()
        state = run_steps(model, params, state, keys, sampler, steps, k)
        jax.block_until_ready(state.length)
        return time.perf_counter() - t, state

    t0 = time.perf_counter()
    once()
    first = time.perf_counter() - t0
    runs = sorted((once() for _ in range(repeats)), key=lambda r: r[0])
    seconds, state = runs[repeats // 2]
    drawn = float(jnp.mean(state.length - lengths))
    return {"batch": batch, "draft_tokens": k, "context": context, "steps": steps, "seconds": seconds,
            "first_call_seconds": first, "ms_per_step": 1e3 * seconds / steps,
            "tokens_per_step_random_weights": drawn / steps}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["qwen2.5-1.5b", "qwen2.5-7b"])
    ap.add_argument("--batches", type=_ints, default=[1, 8, 64], metavar="B,B,...")
    ap.add_argument("--draft-tokens", type=_ints, default=[0, 2, 4, 8, 16], metavar="K,K,...")
    ap.add_argument("--context", type=int, default=1536, help="tokens in each row before the steps (default: "
                                                               "1536, half the paper's 3072-token completion)")
    ap.add_argument("--steps", type=int, default=256, help="steps per timed call")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    hp = hyperparameters_for("degs_mcmc")
    for name in args.shapes:
        cfg, params = random_model(name)
        model = TransformerLM(cfg)
        sampler = SamplerSpec(Proposal(1.0 / hp.alpha), eos_ids=(),
                              lens=LensConfig.default(cfg.num_layers, hp.tau, hp.lsub))
        head = {"bench": "drafted_step", **environment(), "shape": name, "temperature": 1.0 / hp.alpha,
                "lsub": list(sampler.lens.lsub)}
        for batch in args.batches:
            base = None
            for k in args.draft_tokens:
                record = measure(model, params, sampler, batch, k, args.context, args.steps, args.repeats)
                if k == 0:
                    base = record["ms_per_step"]
                record["relative_to_k0"] = None if base is None else record["ms_per_step"] / base
                emit({**head, **record}, "drafted_step.jsonl")
        del params


if __name__ == "__main__":
    main()
