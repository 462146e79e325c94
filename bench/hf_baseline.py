"""Hugging Face transformers `generate` baseline on the same GPU: random weights of the
shapes in bench/common.py, bf16, prompt 256, 512 new tokens, EOS suppressed, greedy;
dynamic and static cache (HF sizes its static cache to prompt + new tokens). Runs on
the CPU when there is no GPU (for smoke tests).

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

from common import shape_config

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
    device = "cuda" if torch.cuda.is_available() else "cpu"
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    emit({"bench": "environment", "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
          "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
          "command": " ".join(["python"] + sys.argv),
          "versions": {"torch": torch.__version__, "transformers": transformers.__version__}})
    for item in args.shapes:
        name, batches = item.split(":")
        ours = shape_config(name)
        cfg = transformers.AutoConfig.for_model(**{**ours.to_hf(), "eos_token_id": None, "pad_token_id": 0})
        with torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
        for B in (int(b) for b in batches.split(",")):
            ids = torch.randint(0, ours.vocab_size, (B, args.prompt), device=device)
            for cache in args.caches.split(","):
                kw = dict(max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
                if cache == "static":
                    kw["cache_implementation"] = "static"
                t0 = time.perf_counter()
                with torch.no_grad():
                    model.generate(ids, **kw)  # warm-up (compiles the static-cache forward)
                sync()
                warm = time.perf_counter() - t0
                t = time.perf_counter()
                with torch.no_grad():
                    out = model.generate(ids, **kw)
                sync()
                sec = time.perf_counter() - t
                assert out.shape[1] == args.prompt + args.new
                emit({"bench": "hf_generate", "shape": name, "batch": B, "cache": cache,
                      "prompt": args.prompt, "new_tokens": args.new, "seconds": sec,
                      "warmup_seconds": warm, "tokens_per_s": B * args.new / sec,
                      "ms_per_step": 1e3 * sec / args.new})
        del model
        if device == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
