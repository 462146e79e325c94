"""Hugging Face transformers `generate` baseline on the same GPU: random Qwen2.5 shapes,
bf16, prompt 256, 512 new tokens, EOS suppressed, greedy; dynamic and static cache.

    python bench/hf_baseline.py --shapes qwen2.5-0.5b:64 qwen2.5-7b:64
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import torch
import transformers

from common import SHAPES

# mirrors bench/common.emit without importing JAX into this process
def emit(record):
    line = json.dumps(record)
    print(line, flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "hf.jsonl"), "a") as f:
            f.write(line + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shapes", nargs="+", default=["qwen2.5-0.5b:64", "qwen2.5-7b:64"])
    ap.add_argument("--caches", default="dynamic,static")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--new", type=int, default=512)
    args = ap.parse_args()
    emit({"bench": "environment", "device": torch.cuda.get_device_name(),
          "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
          "command": " ".join(["python"] + sys.argv),
          "versions": {"torch": torch.__version__, "transformers": transformers.__version__}})
    for item in args.shapes:
        name, batches = item.split(":")
        s = SHAPES[name]
        cfg = transformers.Qwen2Config(
            hidden_size=s["hidden_size"], intermediate_size=s["intermediate_size"],
            num_hidden_layers=s["num_layers"], num_attention_heads=s["num_heads"],
            num_key_value_heads=s["num_kv_heads"], vocab_size=s["vocab_size"],
            tie_word_embeddings=s["tie_word_embeddings"], rope_theta=1e6,
            max_position_embeddings=32768, eos_token_id=None, pad_token_id=0)
        with torch.device("cuda"):
            model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
        for B in (int(b) for b in batches.split(",")):
            ids = torch.randint(0, s["vocab_size"], (B, args.prompt), device="cuda")
            for cache in args.caches.split(","):
                kw = dict(max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
                if cache == "static":
                    kw["cache_implementation"] = "static"
                t0 = time.perf_counter()
                with torch.no_grad():
                    model.generate(ids, **kw)  # warm-up (compiles the static-cache forward)
                torch.cuda.synchronize()
                warm = time.perf_counter() - t0
                t = time.perf_counter()
                with torch.no_grad():
                    out = model.generate(ids, **kw)
                torch.cuda.synchronize()
                sec = time.perf_counter() - t
                assert out.shape[1] == args.prompt + args.new
                emit({"bench": "hf_generate", "shape": name, "batch": B, "cache": cache,
                      "prompt": args.prompt, "new_tokens": args.new, "seconds": sec,
                      "warmup_seconds": warm, "tokens_per_s": B * args.new / sec,
                      "ms_per_step": 1e3 * sec / args.new})
        del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
