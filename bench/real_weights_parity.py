"""A built-in model's logits and greedy tokens against transformers' own GGUF loader, one
model copy in memory at a time (the real-weight tests keep three fp32 copies, which a
24 GB machine cannot hold for the 1.5B model; this is the check for models too large for
them, run once and recorded in docs/reproduction.md).

    python bench/real_weights_parity.py --model qwen2.5-coder-1.5b      # CPU, fp32: ~10 min, ~8 GB

Both sides dequantise the same GGUF file to fp32, so what differs is the config mapping,
the q/k layout and fp32 kernel order. Per prompt: the largest KL(HF || ours) over the
prompt's positions, the largest |logit difference|, and whether `--new-tokens` greedy steps
(ours: prefill then cached one-token steps; HF: `generate`, no EOS) give the same tokens.
Prints one JSON record (appended to $OUT/real_weights_parity.jsonl when $OUT is set).
"""

from __future__ import annotations

import argparse
import gc
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from common import emit, environment
from degs_jax.models import forward, init_cache, load
from degs_jax.models import loading
from degs_jax.models import transformer as transformer_module
from degs_jax.text import encode_prompt

PROMPTS = [  # chat prompts of the kinds the benchmarks ask, plus raw source code below
    "What is 12 * 13? Put the answer in \\boxed{}.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in "
    "May. How many clips did Natalia sell altogether in April and May? Reason step by step and "
    "put the final answer in \\boxed{}.",
    "Complete the function.\n\ndef is_palindrome(s: str) -> bool:\n    \"\"\"Return True if s "
    "reads the same backwards.\"\"\"\n",
]


def _log_softmax64(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def _ours(model, ids: np.ndarray, n: int):
    cfg, params = model.cfg, model.params
    T = len(ids)
    cache = init_cache(cfg, 1, T + n, jnp.float32)
    out = forward(params, cfg, jnp.asarray(ids, jnp.int32)[None], jnp.arange(T, dtype=jnp.int32)[None], cache)
    logits = np.asarray(out.logits[0])
    tokens = [int(np.argmax(logits[-1]))]
    for pos in range(T, T + n - 1):
        out = forward(params, cfg, jnp.full((1, 1), tokens[-1], jnp.int32),
                      jnp.full((1, 1), pos, jnp.int32), out.cache)
        tokens.append(int(jnp.argmax(out.logits[0, -1])))
    return logits, tokens


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b", choices=sorted(loading.BUILTIN_MODELS))
    ap.add_argument("--new-tokens", type=int, default=32, help="greedy steps compared per prompt")
    ap.add_argument("--code-tokens", type=int, default=520,
                    help="tokens of in-repo source code used as one more raw prompt")
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    ours = load(args.model, "float32")
    tokenizer = ours.tokenizer
    prompts = [np.asarray(encode_prompt(tokenizer, p, True)) for p in PROMPTS]
    code = tokenizer(Path(transformer_module.__file__).read_text())["input_ids"][:args.code_tokens]
    prompts.append(np.asarray(code))
    mine = [_ours(ours, ids, args.new_tokens) for ids in prompts]
    cfg = ours.cfg
    path = loading.builtin_gguf(args.model)
    del ours
    gc.collect()
    jax.clear_caches()

    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    rows = []
    for ids, (got, our_tokens) in zip(prompts, mine):
        with torch.no_grad():
            want = hf(torch.from_numpy(ids)[None]).logits[0].numpy()
            gen = GenerationConfig(do_sample=False, max_new_tokens=args.new_tokens, eos_token_id=None,
                                   pad_token_id=cfg.pad_token_id or 0)
            hf_tokens = hf.generate(torch.from_numpy(ids)[None],
                                    attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                    generation_config=gen)[0, len(ids):].tolist()
        lp_hf, lp_ours = _log_softmax64(want), _log_softmax64(got)
        kl = (np.exp(lp_hf) * (lp_hf - lp_ours)).sum(-1)
        rows.append({"prompt_tokens": int(len(ids)), "max_kl": float(kl.max()),
                     "max_abs_logit_diff": float(np.abs(want - got).max()),
                     "max_abs_logit": float(np.abs(want).max()),
                     "greedy_equal": our_tokens == hf_tokens,
                     "first_difference": next((i for i, (a, b) in enumerate(zip(our_tokens, hf_tokens))
                                               if a != b), None)})
    emit({"bench": "real_weights_parity", "model": args.model, "gguf_sha256": loading.BUILTIN_MODELS[args.model].sha256,
          "architecture": cfg.architecture, "num_layers": cfg.num_layers, "dtype": "float32",
          "new_tokens": args.new_tokens, "prompts": rows, **environment()}, "real_weights_parity.jsonl")


if __name__ == "__main__":
    main()
