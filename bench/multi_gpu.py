"""Multi-GPU: tensor-parallel decode of a model too big for one GPU (Qwen2.5-72B shape,
bf16, random weights drawn straight into their shards), data-parallel replicas of a
smaller shape, and DEGS-MCMC on the sharded model (the unchanged sampler code).

    python bench/multi_gpu.py --parts tp dp mcmc           # every GPU of the machine

tp:   mesh 1 x N (N = all local devices); prompt 256, 512 new tokens in the library's
      default buffer (prompt + 3072 slots), EOS suppressed, greedy, per batch size, the
      state donated (as `decode` does: the cache is updated in place);
      roofline = (weights + KV cache read per step) / N per device over one device's
      measured copy bandwidth.
      With --compilation-cache DIR, run it twice: the second run's first call loads the
      programs from the persistent cache (the warm compile).
dp:   the same decode on a smaller shape: one device at batch B against an N x 1 mesh
      at batch N·B (scaling efficiency = throughput ratio / N), for each N of --dp-sizes
      and each cache read of --dp-reads (the read each side took is recorded).
mcmc: degs_mcmc on the tensor-parallel model, a few problems, the default 16 x 192
      buffer, 2 MH steps, every completion ending with EOS at --mcmc-length tokens.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from common import (BUFFER_NEW, copy_bandwidth, decode_seconds, decode_step_bytes, emit, environment,
                    forced_eos_model, param_bytes, shape_config)
from degs_jax.decoders import decode
from degs_jax.methods import hyperparameters_for
from degs_jax.models import init_params
from degs_jax.models.attention import read_mode
from degs_jax.models.compilation import enable_compilation_cache
from degs_jax.models.sharding import make_mesh, param_shardings

OUT = "multi_gpu.jsonl"


def sharded_model(name: str, data: int, model: int, kv_read: str = "auto"):
    cfg = shape_config(name, kv_read=kv_read)
    mesh = make_mesh(data, model)
    t = time.perf_counter()
    params = init_params(cfg, jax.random.key(0), jnp.bfloat16, shardings=param_shardings(cfg, mesh))
    jax.block_until_ready(params)
    return cfg, mesh, params, time.perf_counter() - t


def decode_read(cfg, mesh, batch: int, prompt: int) -> str:
    """The cache read a decode step of this batch takes (`attention.read_mode`)."""
    with jax.set_mesh(mesh):
        return read_mode(cfg, 1, prompt + BUFFER_NEW, batch)


def tensor_parallel(args, n: int, bw: float):
    cfg, mesh, params, init_s = sharded_model(args.tp_shape, 1, n)
    with jax.set_mesh(mesh):
        for batch in args.tp_batches:
            sec, first = decode_seconds(cfg, params, batch, args.prompt, args.new, repeats=args.repeats,
                                        buffer_new=BUFFER_NEW, donate=True)
            step = sec / (args.new + 1)
            emit({"bench": "tensor_parallel_decode", "shape": args.tp_shape, "mesh": [1, n],
                  "batch": batch, "read": decode_read(cfg, mesh, batch, args.prompt), "state_donated": True, "prompt": args.prompt, "new_tokens": args.new,
                  "seconds": sec, "seconds_first_call": first, "init_seconds": init_s,
                  "tokens_per_s": batch * args.new / sec, "ms_per_step": 1e3 * step,
                  "param_GB": param_bytes(params) / 1e9,
                  "roofline_fraction":
                      decode_step_bytes(cfg, params, batch, args.prompt, args.new) / n / step / bw},
                 OUT)
    return cfg, mesh, params


def data_parallel(args, sizes: list[int]):
    """One device at dp_batch rows, then an n x 1 mesh at n · dp_batch rows for each n in
    `sizes` and each read in --dp-reads (same weights: drawn with the same key)."""
    one_cfg, one_mesh, one, _ = sharded_model(args.dp_shape, 1, 1)
    one_read = decode_read(one_cfg, one_mesh, args.dp_batch, args.prompt)
    single, _ = decode_seconds(one_cfg, one, args.dp_batch, args.prompt, args.new, repeats=args.repeats,
                               buffer_new=BUFFER_NEW)
    del one
    one_tps = args.dp_batch * args.new / single
    for n in sizes:
        for kv_read in args.dp_reads:
            cfg, mesh, params, _ = sharded_model(args.dp_shape, n, 1, kv_read)
            mesh_read = decode_read(cfg, mesh, n * args.dp_batch, args.prompt)
            with jax.set_mesh(mesh):
                sec, first = decode_seconds(cfg, params, n * args.dp_batch, args.prompt, args.new,
                                            repeats=args.repeats, buffer_new=BUFFER_NEW)
            del params
            all_tps = n * args.dp_batch * args.new / sec
            emit({"bench": "data_parallel_decode", "shape": args.dp_shape, "mesh": [n, 1],
                  "batch_per_device": args.dp_batch, "prompt": args.prompt, "new_tokens": args.new,
                  "buffer_new_slots": BUFFER_NEW, "one_device_read": one_read, "mesh_kv_read": kv_read,
                  "mesh_read": mesh_read, "one_device_seconds": single, "mesh_seconds": sec,
                  "mesh_seconds_first_call": first,
                  "one_device_tokens_per_s": one_tps, "mesh_tokens_per_s": all_tps,
                  "scaling_efficiency": all_tps / one_tps / n}, OUT)


def mcmc(args, cfg, mesh, params):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size - 1, rng.integers(128, 321)).tolist()
               for _ in range(args.mcmc_problems)]
    eos = cfg.vocab_size - 1  # never in a prompt
    defaults = hyperparameters_for("degs_mcmc", mh_steps=args.mcmc_mh_steps)  # the default block sizes
    chain_sizes = dict(block_len=defaults.block_len, num_blocks=defaults.num_blocks, mh_steps=defaults.mh_steps)
    model = forced_eos_model(cfg, np.full(len(prompts), args.mcmc_length), [len(p) for p in prompts], eos)
    with jax.set_mesh(mesh):
        times = []
        for _ in range(2):  # the first includes compilation
            t = time.perf_counter()
            res = decode(model, params, prompts, "degs_mcmc", jax.random.key(0), eos_ids=(eos,), **chain_sizes)
            times.append(time.perf_counter() - t)
    acc = [a for o in res.outputs for a in (o.chosen.acceptance or [])]
    emit({"bench": "tensor_parallel_mcmc", "method": "degs_mcmc", "shape": args.tp_shape,
          "mesh": list(mesh.devices.shape), "problems": args.mcmc_problems, **chain_sizes,
          "buffer_new_slots": defaults.max_new_tokens,
          "seconds": times[1], "seconds_with_compile": times[0],
          "seconds_per_problem": times[1] / args.mcmc_problems,
          "generated_tokens_per_s": res.counters["generated_tokens"] / times[1],
          "mean_acceptance": float(np.mean(acc)) if acc else None,
          "completion_tokens": int(np.mean([len(o.chosen.tokens) for o in res.outputs]))}, OUT)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", nargs="+", default=["tp", "dp", "mcmc"], choices=["tp", "dp", "mcmc"])
    ap.add_argument("--devices", type=int, default=None, help="devices to use (default: all local)")
    ap.add_argument("--tp-shape", default="qwen2.5-72b")
    ap.add_argument("--tp-batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16, 64])
    ap.add_argument("--dp-shape", default="qwen2.5-7b")
    ap.add_argument("--dp-batch", type=int, default=64, help="rows per device")
    ap.add_argument("--dp-sizes", type=lambda s: [int(x) for x in s.split(",")], default=None,
                    help="data-parallel mesh sizes, comma-separated (default: --devices)")
    ap.add_argument("--dp-reads", type=lambda s: s.split(","), default=["auto"],
                    help="kv_read of the mesh runs, comma-separated (e.g. auto,buckets: the kernel "
                         "per shard against the switch over windows; the one-device run uses auto)")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--new", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--mcmc-problems", type=int, default=16)
    ap.add_argument("--mcmc-length", type=int, default=128, help="completion tokens (EOS forced there)")
    ap.add_argument("--mcmc-mh-steps", type=int, default=2)
    ap.add_argument("--compilation-cache", default=None, metavar="DIR",
                    help="turn on JAX's persistent compilation cache in DIR: run the same command twice "
                         "and the second run's seconds_first_call is the warm compile (default: off)")
    ap.add_argument("--copy-gib", type=float, default=4.0,
                    help="size of the array of the bandwidth measurement (GiB; small for CPU smoke tests)")
    args = ap.parse_args()
    if args.compilation_cache:
        enable_compilation_cache(args.compilation_cache)
    n = args.devices or jax.local_device_count()
    bw = copy_bandwidth(gib=args.copy_gib)
    emit({"bench": "environment", **environment(), "devices_used": n,
          "copy_bandwidth_GBps": bw / 1e9, "compilation_cache": args.compilation_cache}, OUT)
    if "dp" in args.parts:
        data_parallel(args, args.dp_sizes or [n])
    if "tp" in args.parts or "mcmc" in args.parts:
        cfg, mesh, params = tensor_parallel(args, n, bw) if "tp" in args.parts else (
            sharded_model(args.tp_shape, 1, n)[:3])
        if "mcmc" in args.parts:
            mcmc(args, cfg, mesh, params)


if __name__ == "__main__":
    main()
