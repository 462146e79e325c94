"""How collapse depths d_t are distributed on real weights (issue 17, item 5): greedy
completions of the first MATH500 problems, and the share of scored tokens at each probed
layer (d_t = the first layer of L_sub whose lens entropy is <= tau; L when none is).

    python bench/collapse_depths.py                        # qwen2.5-coder-0.5b, 16 problems, 256 tokens (CPU: ~4 min)
    python bench/collapse_depths.py --model smollm2-135m --problems 8

It tells what a lens that stops at a row's first collapse could skip: a row needs every
probed layer up to its d_t, so only the layers past it. Prints one JSON record (and
appends it to $OUT/collapse_depths.jsonl); needs the model's weights (`degs_jax.models.load`)
and the MATH500 file (the copy installed with degs_jax, or $DEGS_JAX_DATA).
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from common import emit, environment
from degs_jax.eval.benchmarks import default_data_dir
from degs_jax.generation import Proposal, SamplerSpec, generate, pad_prompts, prefill
from degs_jax.lens import DEFAULT_TAU, LensConfig
from degs_jax.models import TransformerLM
from degs_jax.models import load
from degs_jax.text import encode_prompt


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b", help="a model `degs_jax.models.load` takes")
    ap.add_argument("--problems", type=int, default=16, help="the first N MATH500 problems")
    ap.add_argument("--new-tokens", type=int, default=256, help="greedy tokens per problem")
    ap.add_argument("--tau", type=float, default=DEFAULT_TAU)
    args = ap.parse_args()
    model = load(args.model, dtype="float32")
    cfg, params, tok = model.cfg, model.params, model.tokenizer
    lm = TransformerLM(cfg)
    with open(default_data_dir() / "math500.jsonl") as f:
        rows = [json.loads(line) for line in f][:args.problems]
    prompts = [encode_prompt(tok, r["problem"] + " Put the answer in \\boxed{}.", True) for r in rows]
    tokens, lengths = pad_prompts(prompts)
    lens = LensConfig.default(cfg.num_layers, tau=args.tau)
    spec = SamplerSpec(Proposal(0.0), lens=lens, eos_ids=model.eos_ids)
    state = prefill(lm, params, jnp.asarray(tokens), jnp.asarray(lengths),
                    tokens.shape[1] + args.new_tokens + 1, jnp.float32)
    keys = jax.random.split(jax.random.key(0), len(prompts))
    state = generate(lm, params, state, state.prompt_len + args.new_tokens, keys, spec)
    depth, length, prompt_len = (np.asarray(x) for x in (state.depth, state.length, state.prompt_len))
    # d_t of a generated token comes from the step that consumed it: every generated token
    # but each row's last (docs/design.md §3), EOS included here (what the lens computed).
    scored = np.concatenate([depth[r, prompt_len[r]:length[r] - 1] for r in range(len(prompts))])
    share = {int(layer): float(np.mean(scored == layer)) for layer in lens.lsub}
    emit({"bench": "collapse_depths", **environment(), "model": args.model, "problems": len(prompts),
          "new_tokens": args.new_tokens, "tau": args.tau, "lsub": list(lens.lsub), "scored_tokens": int(scored.size),
          "share_by_depth": share}, "collapse_depths.jsonl")


if __name__ == "__main__":
    main()
