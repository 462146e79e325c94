"""Does a prompt's output depend on the batch it shares? (issue 16)

One fixed prompt (row 0) is run alone and as row 0 of batches of other sizes whose other
rows have prompts of other lengths (so other padded lengths). Each batch runs a prefill
and `--steps` greedy decode steps (every row feeds back its own argmax), capturing every
layer's residual, the logits and the lens entropies of the probed layers. For each batch
size and each setting of `ModelConfig.batch_invariant` the script prints one JSON record:

- `first_difference`: the first output of row 0 (phase `prefill` or `step k`, then layer
  by layer: residual after block l, logits, lens entropies) that is not bitwise equal to
  the run alone, with the largest absolute difference there; `null` when every output is
  bitwise equal;
- `first_op` (with `--ops`): inside the forward call of that phase, run op by op (each
  jaxpr equation dispatched on its own, nested jits inlined), the first equation whose
  row-0 output differs between the run alone and the batch: the primitive, its source
  scope (e.g. `block_0/attention`) and the shapes. Op-by-op dispatch compiles each op for
  its own shapes, which is where kernels and tilings are chosen per batch size (matmul
  algorithms, split-K, reduction trees); fusion effects of the compiled program are not
  reproduced, which is what `first_difference` measures;
- `step_ms`: median wall-clock of one decode step (the model's forward with the DEGS
  probe, no capture; its logits and lens entropies returned) at the library's default
  buffer (prompt + 3072 slots), i.e. the speed cost of the option; `cache_only_step_ms`:
  the same step returning only its cache, so that XLA drops the head and the probe (what
  `step_ms` measured until 2026-11-30); `prefill_ms`: the same for a prefill of `--prompt` tokens
  per row (the cache it writes; no output head, no probe).

Random weights (bench/common.py shapes), stacked layers (one compiled scan: fast to
compile; numerics are those of the stacked program). Run on GPU:
    python bench/batch_invariance.py --shape qwen2.5-7b --batches 1,16,64,128 --row-tiles 64,8
CPU smoke test:
    python bench/batch_invariance.py --shape tiny --batches 1,3,8 --ops --dtype float32
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from common import BUFFER_NEW, emit, environment, shape_config
from degs_jax.methods import hyperparameters_for
from degs_jax.models import forward, init_cache, init_params
from degs_jax.models.params import stack_layers

OUT_NAME = "batch_invariance.jsonl"


def batch_tokens(cfg, batch: int, prompt: int, pad_to: int = 0, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """[batch, P] tokens and [batch] lengths: row 0 the fixed prompt of `prompt` tokens,
    the others random prompts of prompt/2 .. 2·prompt tokens, right-padded to
    P = max(longest, pad_to) (row 0 with zeros)."""
    rng = np.random.default_rng(seed + batch)
    lengths = np.concatenate([[prompt], rng.integers(max(1, prompt // 2), 2 * prompt + 1, batch - 1)])
    tokens = rng.integers(0, cfg.vocab_size, (batch, max(int(lengths.max()), pad_to)))
    tokens[0] = 0
    tokens[0, :prompt] = (np.arange(prompt) * 7919 + 11) % cfg.vocab_size
    return tokens.astype(np.int32), lengths.astype(np.int32)


@dataclasses.dataclass
class Run:
    outputs: list  # (phase, name, row-0 array) in order
    calls: list  # (phase, forward's positional args) for the op-by-op pass
    tokens: list  # row 0's greedy tokens


def run_row0(cfg, params, batch: int, prompt: int, steps: int, lens_layers, dtype, pad_to: int = 0) -> Run:
    tokens, lengths = batch_tokens(cfg, batch, prompt, pad_to)
    P = tokens.shape[1]
    L = cfg.num_layers
    layers = tuple(sorted({1, L // 4, L // 2, 3 * L // 4, L} - {0}))
    call = jax.jit(lambda p, t, pos, c, at: forward(p, cfg, t, pos, c, capture=layers, lens_layers=lens_layers,
                                                    logits_at=at))
    cache = init_cache(cfg, batch, 2 * prompt + steps + 1, dtype)  # one buffer size for every batch
    positions = np.broadcast_to(np.arange(P, dtype=np.int32), tokens.shape)
    last = jnp.asarray(lengths - 1)
    out = call(params, tokens, positions, cache, last)  # logits at each row's last prompt token
    run = Run([], [("prefill", (jnp.asarray(tokens), jnp.asarray(positions), cache))], [])

    def record(phase, out, at):
        for i, l in enumerate(layers):
            run.outputs.append((phase, f"residual {l}", np.asarray(out.residuals[i, 0, at].astype(jnp.float32))))
        run.outputs.append((phase, "logits", np.asarray(out.logits[0, 0])))
        run.outputs.append((phase, "lens entropies", np.asarray(out.lens.entropy[:, 0, at])))

    record("prefill", out, slice(0, prompt))
    n = jnp.asarray(lengths)
    for k in range(steps):
        step_tokens = jnp.argmax(out.logits[:, 0], axis=-1).astype(jnp.int32)[:, None]
        run.tokens.append(int(step_tokens[0, 0]))
        args = (step_tokens, n[:, None], out.cache)
        run.calls.append((f"step {k + 1}", args))
        out = call(params, *args, None)
        record(f"step {k + 1}", out, 0)
        n = n + 1
    return run


def first_difference(alone: Run, other: Run):
    for (phase, name, a), (_, _, b) in zip(alone.outputs, other.outputs):
        if not np.array_equal(a, b):
            return {"phase": phase, "output": name, "max_abs_diff": float(np.max(np.abs(a - b)))}
    return None


# ----------------------------------------------------------------------------- op by op

def _row0(x, rows: int, other, other_rows: int):
    """Row 0's share of x (batch `rows`) and of `other` (batch `other_rows`), or None if
    the shapes do not say where the batch is: the one axis whose sizes differ holds the
    batch times a per-row size. Equal shapes are not compared (batch-independent values,
    or rows padded to a common tile count, whose other rows differ by construction)."""
    differ = [i for i in range(x.ndim) if x.ndim == other.ndim and x.shape[i] != other.shape[i]]
    if len(differ) != 1:
        return None
    axis = differ[0]
    if x.shape[axis] % rows or other.shape[axis] % other_rows or x.shape[axis] // rows != other.shape[axis] // other_rows:
        return None
    k = x.shape[axis] // rows
    take = lambda a: jax.lax.slice_in_dim(a, 0, k, axis=axis)
    return take(x), take(other)


# Cache writes: a row's padding slots hold other tokens in another batch (never visible).
CACHE_WRITES = ("scatter", "dynamic_update_slice")


def _inline(eqn):
    """The closed jaxpr of a nested jit / call equation, else None."""
    inner = eqn.params.get("jaxpr") if eqn.primitive.name in ("pjit", "jit", "closed_call", "core_call") else None
    return inner if inner is not None and hasattr(inner, "jaxpr") else None


def _walk(closed_a, args_a, rows_a, closed_b, args_b, rows_b):
    """Evaluate two jaxprs of the same program (batches rows_a, rows_b) equation by
    equation; return ("diff", info) at the first row-0 difference, else ("ok", outs)."""
    from jax.extend.core import Literal

    def reader(env):
        return lambda v: v.val if isinstance(v, Literal) else env[v]

    env_a = dict(zip(closed_a.jaxpr.constvars, closed_a.consts)) | dict(zip(closed_a.jaxpr.invars, args_a))
    env_b = dict(zip(closed_b.jaxpr.constvars, closed_b.consts)) | dict(zip(closed_b.jaxpr.invars, args_b))
    read_a, read_b = reader(env_a), reader(env_b)
    for ea, eb in zip(closed_a.jaxpr.eqns, closed_b.jaxpr.eqns):
        if ea.primitive is not eb.primitive:
            return "diff", {"primitive": ea.primitive.name, "note": "the two programs differ in structure here"}
        ins_a, ins_b = [read_a(v) for v in ea.invars], [read_b(v) for v in eb.invars]
        inner_a, inner_b = _inline(ea), _inline(eb)
        if inner_a is not None and inner_b is not None:
            status, value = _walk(inner_a, ins_a, rows_a, inner_b, ins_b, rows_b)
            if status == "diff":
                return status, value
            outs_a, outs_b = value
        else:
            outs_a, outs_b = ea.primitive.bind(*ins_a, **ea.params), eb.primitive.bind(*ins_b, **eb.params)
            if not ea.primitive.multiple_results:
                outs_a, outs_b = [outs_a], [outs_b]
            for xa, xb in zip(outs_a, outs_b):
                if (not hasattr(xa, "shape") or not jnp.issubdtype(xa.dtype, jnp.floating)
                        or ea.primitive.name in CACHE_WRITES):
                    continue  # integer ops compute indices (e.g. the batch's longest row)
                pair = _row0(xa, rows_a, xb, rows_b)
                if pair is None:
                    continue
                a, b = (np.asarray(p.astype(jnp.float32)) for p in pair)
                if not np.array_equal(a, b):
                    return "diff", {"primitive": ea.primitive.name,
                                    "scope": str(ea.source_info.name_stack),
                                    "shape_alone": list(xa.shape), "shape_batch": list(xb.shape),
                                    "max_abs_diff": float(np.max(np.abs(a - b)))}
        for v, x in zip(ea.outvars, outs_a):
            env_a[v] = x
        for v, x in zip(eb.outvars, outs_b):
            env_b[v] = x
    return "ok", ([read_a(v) for v in closed_a.jaxpr.outvars], [read_b(v) for v in closed_b.jaxpr.outvars])


def first_op(cfg, params, lens_layers, phase: str, prompt: int, steps: int, dtype, reference_batch: int,
             other: Run, batch: int):
    """Op-by-op replay of the forward call of `phase` for the reference batch and the
    batch, both padded to the batch's prompt length (so that row 0's padding slots hold
    the same tokens: the replay compares whole cache reads; padding effects are in
    `first_difference`). `params` in the list layout (layers unrolled, so that the replay
    sees each block's ops); without batch invariance the cache is read whole (kv_read
    "all": the "buckets" read would put the layer stack inside one `lax.switch` op)."""
    if not cfg.batch_invariant:
        cfg = dataclasses.replace(cfg, kv_read="all")
    padded = dict(other.calls)["prefill"][0].shape[1]
    alone = run_row0(cfg, params, reference_batch, prompt, steps, lens_layers, dtype, pad_to=padded)
    args_a = dict(alone.calls)[phase]
    args_b = dict(other.calls)[phase]
    fn = lambda p, t, pos, c: forward(p, cfg, t, pos, c, lens_layers=lens_layers)
    flat = lambda args: jax.tree.leaves((params,) + tuple(args))
    closed_a = jax.make_jaxpr(lambda *leaves: jax.tree.leaves(fn(*jax.tree.unflatten(
        jax.tree.structure((params,) + tuple(args_a)), leaves))))(*flat(args_a))
    closed_b = jax.make_jaxpr(lambda *leaves: jax.tree.leaves(fn(*jax.tree.unflatten(
        jax.tree.structure((params,) + tuple(args_b)), leaves))))(*flat(args_b))
    status, value = _walk(closed_a, flat(args_a), reference_batch, closed_b, flat(args_b), batch)
    return value if status == "diff" else None


# ----------------------------------------------------------------------------- decoders

def decoded_row0(cfg, params, batch: int, prompt: int, method: str, settings: dict) -> dict:
    """`decode` of the batch with one key per prompt (prompt 0's fixed); prompt 0's answer
    and candidates (tokens, log p, D, final entropy, acceptance, weight), as floats."""
    from degs_jax.decoders import decode
    from degs_jax.models import TransformerLM

    tokens, lengths = batch_tokens(cfg, batch, prompt)
    prompts = [list(map(int, row[:n])) for row, n in zip(tokens, lengths)]
    keys = jax.numpy.stack([jax.random.key(1234)] + [jax.random.key(10 + i) for i in range(batch - 1)])
    out = decode(TransformerLM(cfg), params, prompts, method, keys=keys, eos_ids=(), **settings).outputs[0]
    fields = ("tokens", "log_p", "depth", "final_entropy", "acceptance", "weight")
    return {"chosen": {f: getattr(out.chosen, f) for f in fields},
            "candidates": [{f: getattr(c, f) for f in fields} for c in out.candidates]}


def first_decoder_difference(alone: dict, other: dict):
    """The first candidate field of prompt 0 whose value (float bits) differs, or None."""
    for name, a, b in [("chosen", alone["chosen"], other["chosen"])] + [
            (f"candidate {i}", x, y) for i, (x, y) in enumerate(zip(alone["candidates"], other["candidates"]))]:
        for field in a:
            if np.asarray(a[field], np.float64).tobytes() != np.asarray(b[field], np.float64).tobytes():
                return f"{name}: {field}"
    return None


# ----------------------------------------------------------------------------- speed

def _median_ms(call, params, inputs: tuple, cache, repeats: int) -> float:
    """Median ms of `call(params, *inputs, cache)` after one warm-up (compilation) call; the
    call donates the cache and returns the new one first (alone or in a tuple)."""
    first = lambda out: out[0] if isinstance(out, tuple) else out
    cache = first(jax.block_until_ready(call(params, *inputs, cache)))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        cache = first(jax.block_until_ready(call(params, *inputs, cache)))
        times.append(time.perf_counter() - t)
    return 1000 * sorted(times)[repeats // 2]


def step_ms(cfg, params, batch: int, prompt: int, lens_layers, dtype, repeats: int = 10,
            cache_only: bool = False) -> float:
    """Median ms of one decode step (forward + DEGS probe, no capture) for `batch` rows at
    the default buffer (prompt + BUFFER_NEW slots), rows at prompt + 16 tokens: the call
    returns the cache, the logits and the lens entropies. cache_only: it returns the cache
    alone, so XLA drops the output head and the probe (what `step_ms` timed until
    2026-11-30: the cache-writing layers only)."""

    def one_step(p, t, pos, c):
        out = forward(p, cfg, t, pos, c, lens_layers=lens_layers)
        return out.cache if cache_only else (out.cache, out.logits, out.lens.entropy)

    call = jax.jit(one_step, donate_argnums=3)
    inputs = (jnp.zeros((batch, 1), jnp.int32), jnp.full((batch, 1), prompt + 16, jnp.int32))
    return _median_ms(call, params, inputs, init_cache(cfg, batch, prompt + BUFFER_NEW, dtype), repeats)


def prefill_ms(cfg, params, batch: int, prompt: int, dtype, repeats: int = 5) -> float:
    """Median ms of a prefill of `batch` rows of `prompt` tokens at the default buffer
    (prompt + BUFFER_NEW slots), no probe: the cache it writes (the call returns only the
    cache, so XLA drops the output head)."""
    call = jax.jit(lambda p, t, pos, at, c: forward(p, cfg, t, pos, c, logits_at=at).cache, donate_argnums=4)
    inputs = (jnp.zeros((batch, prompt), jnp.int32),
              jnp.broadcast_to(jnp.arange(prompt, dtype=jnp.int32), (batch, prompt)),
              jnp.full((batch,), prompt - 1, jnp.int32))
    return _median_ms(call, params, inputs, init_cache(cfg, batch, prompt + BUFFER_NEW, dtype), repeats)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen2.5-7b")
    ap.add_argument("--batches", default="1,16,64,128", help="comma-separated; the first is the reference")
    ap.add_argument("--prompt", type=int, default=64, help="row 0's prompt length")
    ap.add_argument("--steps", type=int, default=8, help="greedy decode steps after the prefill")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--row-tiles", default="auto",
                    help="row tiles to run with batch_invariant on, comma-separated ('auto': the ModelConfig default)")
    ap.add_argument("--kv-chunk", type=int, default=None, help="default: the ModelConfig default")
    ap.add_argument("--ops", action="store_true", help="locate the first differing op (op-by-op replay)")
    ap.add_argument("--decoder", default=None,
                    help="also decode row 0 with this method (e.g. degs_mcmc) alone and in each batch and "
                         "compare its answer and candidates bitwise (settings: --decoder-settings)")
    ap.add_argument("--decoder-settings", default='{"block_len": 16, "num_blocks": 2, "mh_steps": 2}',
                    help="JSON hyperparameters of --decoder")
    ap.add_argument("--timing-batches", default=None, help="batches to time (default: --batches; 'none': no timing)")
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    timing = ([] if args.timing_batches == "none" else batches if args.timing_batches is None
              else [int(b) for b in args.timing_batches.split(",")])
    dtype = jnp.dtype(args.dtype)
    env = environment()
    runtime = {} if args.kv_chunk is None else {"kv_chunk": args.kv_chunk}
    base = shape_config(args.shape, **runtime)
    layer_list = init_params(base, jax.random.key(0), dtype, scale=0.02 if args.shape != "tiny" else 0.3)
    params = stack_layers(layer_list)
    if not args.ops:
        del layer_list
    lens_layers = hyperparameters_for("degs_mcmc").lens_config(base.num_layers).lsub
    settings = [("off", base)] + [(f"on, row_tile {t}", dataclasses.replace(
        base, batch_invariant=True, row_tile=None if t == "auto" else int(t))) for t in args.row_tiles.split(",")]
    for label, cfg in settings:
        alone = None
        for batch in batches:
            t0 = time.perf_counter()
            run = run_row0(cfg, params, batch, args.prompt, args.steps, lens_layers, dtype)
            record = {"bench": "batch_invariance", "shape": args.shape, "dtype": args.dtype,
                      "batch_invariant": cfg.batch_invariant, "row_tile": cfg.row_tile if cfg.batch_invariant else None,
                      "kv_chunk": cfg.kv_chunk, "batch": batch, "reference_batch": batches[0],
                      "prompt": args.prompt, "steps": args.steps, "lens_layers": list(lens_layers)}
            if alone is None:
                alone = run
                record["first_difference"] = None
            else:
                diff = first_difference(alone, run)
                record["first_difference"] = diff
                record["tokens_equal"] = alone.tokens == run.tokens
                if args.ops and diff is not None and not cfg.batch_invariant:  # (its chunked calls are one scan op)
                    record["first_op"] = first_op(cfg, layer_list, lens_layers, diff["phase"], args.prompt, args.steps,
                                                  dtype, batches[0], run, batch)
            if args.decoder:
                decoded = decoded_row0(cfg, params, batch, args.prompt, args.decoder, json.loads(args.decoder_settings))
                record["decoder"] = args.decoder
                if batch == batches[0]:
                    decoded_alone = decoded
                else:
                    record["decoder_difference"] = first_decoder_difference(decoded_alone, decoded)
            run.calls = []  # their caches (the op replay has used them): free before timing
            record["check_seconds"] = round(time.perf_counter() - t0, 1)
            if batch in timing:
                record["step_ms"] = round(step_ms(cfg, params, batch, args.prompt, lens_layers, dtype), 3)
                record["cache_only_step_ms"] = round(
                    step_ms(cfg, params, batch, args.prompt, lens_layers, dtype, cache_only=True), 3)
                record["prefill_ms"] = round(prefill_ms(cfg, params, batch, args.prompt, dtype), 3)
                record["buffer"] = args.prompt + BUFFER_NEW
            emit({**record, **env, "setting": label}, OUT_NAME)


if __name__ == "__main__":
    main()
