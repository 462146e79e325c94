"""`--batch-size auto` against the memory it really takes: for each method, the batch the
library picks (`degs_jax.batching.choose_batch_size`, the library's defaults: the default
buffer of prompt + 3,072 slots, the method's pool) is decoded, and the device's measured
peak is set beside the estimate.

    python batch_auto.py --shape qwen2.5-7b                 # every method, one GPU
    python batch_auto.py --shape qwen2.5-0.5b --methods degs_smc power_mcmc

Each method runs in its own process (the device's peak counter cannot be reset):
random bf16 weights of `--shape`, `--prompts` prompts of `--prompt` random tokens, every
completion ended with EOS at `--completion` tokens (`ForcedEOSLM`: one target for every
row, so the run is short; the cache, the programs and their temporaries are those of the
full buffer). Recorded per method: the chosen batch (prompts), the estimate
batch × bytes_per_row, the bytes in use after the weights were drawn (`before`), the
process's peak, `measured` = peak − before, measured / estimate, the fraction of the free
memory the estimate may take (`batching.DEFAULT_MEMORY_FRACTION`), and whether it ran out
of memory. Goal (issue 28): no run out of memory, and measured within 15% of the estimate.
Each child claims the card as the `degs` program does (`batching.claim_device_memory`:
XLA's pool is `DEVICE_MEMORY_FRACTION` of the card unless XLA_PYTHON_CLIENT_MEM_FRACTION
is set) and records the setting, the card's size and what fraction of the card the peak
and the estimate took (issue 39).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

# Timings here are of compilations as they happen: the library's default persistent cache
# (models/compilation.py) stays off unless a script turns a cache on itself.
os.environ.setdefault("DEGS_JAX_COMPILATION_CACHE", "0")

import numpy as np

OUT = "batch_auto.jsonl"


def one(args) -> dict:
    from degs_jax.batching import claim_device_memory

    claim_device_memory()  # before JAX starts its backend, as the `degs` program does
    import jax
    import jax.numpy as jnp

    from common import forced_eos_model, shape_config
    from degs_jax.batching import choose_batch_size, peak_memory
    from degs_jax.decoders import decode
    from degs_jax.methods import hyperparameters_for
    from degs_jax.models import init_params

    cfg = shape_config(args.shape)
    params = init_params(cfg, jax.random.key(0), jnp.bfloat16)
    jax.block_until_ready(params)
    device = jax.local_devices()[0]
    before = (device.memory_stats() or {}).get("bytes_in_use")
    eos = cfg.vocab_size - 1
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, eos, (args.prompts, args.prompt)).tolist()
    model = forced_eos_model(cfg, [args.completion], [args.prompt], eos)
    config = hyperparameters_for(args.one)
    choice = choose_batch_size("auto", model, config, args.prompt, args.prompts, jnp.bfloat16)
    batch = choice["batch_size"]
    record = {"bench": "batch_auto", "shape": args.shape, "method": args.one, "prompts": args.prompts,
              "prompt": args.prompt, "completion": args.completion, "max_new_tokens": config.max_new_tokens,
              "sequences_per_prompt": config.sequences_per_prompt, "batch": batch,
              "bytes_per_row": choice["bytes_per_row"], "free_bytes": choice["free_bytes"],
              "fraction": choice["fraction"], "estimate_bytes": batch * choice["bytes_per_row"],
              "bytes_in_use_before": before, "device_memory": choice.get("device_memory")}
    t = time.perf_counter()
    try:
        result = decode(model, params, prompts[:batch], config, jax.random.key(1), eos_ids=(eos,))
        record["out_of_memory"] = False
        record["completion_tokens"] = float(np.mean([len(o.chosen.tokens) for o in result.outputs]))
    except Exception as err:  # noqa: BLE001 - recorded, then the next method runs
        record["out_of_memory"] = "RESOURCE_EXHAUSTED" in str(err) or "out of memory" in str(err).lower()
        record["error"] = f"{type(err).__name__}: {str(err)[:300]}"
    record["seconds"] = time.perf_counter() - t
    peak = peak_memory()["peak_bytes"]
    record["peak_bytes"] = peak
    if peak is not None and before is not None:
        record["measured_bytes"] = peak - before
        record["measured_over_estimate"] = (peak - before) / record["estimate_bytes"]
        record["peak_over_free_plus_before"] = peak / (choice["free_bytes"] + before)
    if peak is not None and record["device_memory"]:
        card = record["device_memory"]["card_bytes"]
        record["peak_over_card"] = peak / card
        record["estimate_over_card"] = record["estimate_bytes"] / card
    return record


def main():
    from degs_jax.methods import METHODS

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen2.5-7b")
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    ap.add_argument("--prompts", type=int, default=256, help="prompts on offer (the batch is at most this)")
    ap.add_argument("--prompt", type=int, default=256, help="tokens per prompt")
    ap.add_argument("--completion", type=int, default=64, help="completion tokens (EOS forced there)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per method's process")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # the child process
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args)), flush=True)
        return
    from common import emit, environment

    emit({"bench": "environment", **environment()}, OUT)
    for method in args.methods:
        cmd = [sys.executable, os.path.abspath(__file__), "--one", method, "--shape", args.shape,
               "--prompts", str(args.prompts), "--prompt", str(args.prompt), "--completion", str(args.completion)]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
            lines = [l for l in done.stdout.splitlines() if l.startswith("{")]
            record = json.loads(lines[-1]) if lines else {
                "bench": "batch_auto", "shape": args.shape, "method": method,
                "error": f"exit {done.returncode}: {done.stderr[-600:]}"}
        except subprocess.TimeoutExpired:
            record = {"bench": "batch_auto", "shape": args.shape, "method": method,
                      "error": f"no result in {args.timeout:.0f} s"}
        emit(record, OUT)


if __name__ == "__main__":
    main()
