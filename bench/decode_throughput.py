"""Decode throughput of degs_jax generation (random Qwen2.5 shapes, bf16, prompt 256,
512 new tokens, EOS suppressed, greedy as HF's default), and percent of the HBM roofline.
The cache has the library's default buffer, prompt + 3072 slots (`--buffer`; the default
is `hyperparameters_for("temperature").max_new_tokens`), whatever
the number of tokens drawn; `--kv-read all` reads every slot of it (the cost before
issue 17), the default reads the live length.

    python bench/decode_throughput.py --shapes qwen2.5-0.5b:1,64,256 qwen2.5-7b:1,16,64
    python bench/decode_throughput.py --shapes tiny:2 --prompt 8 --new 8 --buffer 32 --copy-gib 0.1  # CPU
"""

from __future__ import annotations

import argparse

from common import (BUFFER_NEW, copy_bandwidth, decode_seconds, decode_step_bytes, emit, environment,
                    random_model)


def run(name: str, batches: list[int], prompt: int, new: int, temperature: float, bw: float, buffer: int,
        kv_read: str):
    cfg, params = random_model(name, kv_read=kv_read)
    for B in batches:
        sec, compile_s = decode_seconds(cfg, params, B, prompt, new, temperature, buffer_new=buffer)
        step_s = sec / (new + 1)  # the last token is consumed too (its lens statistics)
        step_bytes = decode_step_bytes(cfg, params, B, prompt, new)
        emit({"bench": "decode", "shape": name, "batch": B, "prompt": prompt, "new_tokens": new,
              "buffer_slots": prompt + buffer, "kv_read": kv_read,
              "temperature": temperature, "seconds": sec, "compile_seconds": compile_s,
              "tokens_per_s": B * new / sec, "ms_per_step": 1e3 * step_s,
              "roofline_fraction": step_bytes / step_s / bw, "bytes_per_step": step_bytes},
             "decode.jsonl")


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shapes", nargs="+", default=["qwen2.5-0.5b:1,64,256", "qwen2.5-7b:1,16,64"])
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--new", type=int, default=512)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--buffer", type=int, default=BUFFER_NEW, help="cache slots after the prompt")
    ap.add_argument("--kv-read", default="auto", choices=["auto", "kernel", "loop", "buckets", "all"])
    ap.add_argument("--copy-gib", type=float, default=4.0,
                    help="size of the array of the bandwidth measurement (GiB; small for CPU smoke tests)")
    args = ap.parse_args()
    env = environment()
    bw = copy_bandwidth(gib=args.copy_gib)
    emit({"bench": "environment", **env, "copy_bandwidth_GBps": bw / 1e9}, "decode.jsonl")
    for item in args.shapes:
        name, batches = item.split(":")
        run(name, [int(b) for b in batches.split(",")], args.prompt, args.new, args.temperature, bw,
            args.buffer, args.kv_read)


if __name__ == "__main__":
    main()
