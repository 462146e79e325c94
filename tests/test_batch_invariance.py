"""Batch invariance (issue 16): with `ModelConfig.batch_invariant`, a prompt run alone and
as row 0 of a batch of 6 (other prompts of other lengths, so other padded prompt lengths
and other buffer sizes) gives bitwise-identical results, in float32 and bfloat16:
the model's residuals, logits and lens entropies (prefill and cached decode steps), and
every decoder's tokens, log p, log q, d_t, candidates, acceptance and SMC/SPS statistics.
Differences these tests caught on XLA CPU: a 1-row cache's read compiled with another
layout (the read now indexes (layer, row) as one axis), the RMSNorm's mean reduced in
another order from 128 rows on (every row-wise op now runs on row tiles), D(x) as a
float mean of d_t / L summed in another order inside DEGS-SMC (now an integer sum), and
on a Qwen2-shaped model (bench/batch_invariance.py --decoder) the samplers' softmax over
[B, V], sums over the token buffer and SMC's per-prompt reductions (now on fixed tiles).

Until issue 38 these tests ran batches of 3 and 8; each batch shape compiles every
program again (a decoder's whole advance loop: ~15-50 s on a 2-core CPU), so CI now runs
the decoders on one batch of 6: with one row per prompt and tiles of 4 rows, one full
tile and part of a second (as 3 and 8 had one or the other), and a decoder prefill of
6 x 32 = 192 >= 128 rows (as 8 x 32 had). The model-level row test keeps 3 and 8 (cheap;
6 missed a mutation there). DEGS_JAX_FULL_INVARIANCE=1 runs every batch of 3, 6 and 8."""

import dataclasses
import functools
import os
import struct

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from degs_jax import decoders
from degs_jax.decoders import decode, decode_tokens
from degs_jax.generation import pad_prompts
from degs_jax.methods import METHODS, SMC_METHODS, field_names, hyperparameters_for, method_classes
from degs_jax.models import TransformerLM
from degs_jax.models import forward, init_cache, init_params
from tiny_models import tiny_config

PROMPT = 7  # row 0's prompt length
BATCH = 6  # prompt 0 and 5 others (one row per prompt: rows 0-3 one tile of 4, rows 4-5 part of a second)
FULL_MATRIX = os.environ.get("DEGS_JAX_FULL_INVARIANCE") == "1"
BATCHES = (BATCH, 3, 8) if FULL_MATRIX else (BATCH,)
# The model-level test below keeps its batches of 3 and 8 (it compiles forward only, a few
# seconds a batch): with the attention norm and projections run untiled, row 0 alone and
# in a batch of 6 had equal bits, and in a batch of 3 or 8 not (mutation check, issue 38).
ROW_BATCHES = (3, 8, BATCH) if FULL_MATRIX else (3, 8)


def _row0(cfg, params, dtype, batch, steps, longest=12):
    """Row 0's prefill residuals and logits, then `steps` decode steps' residuals, logits
    and lens entropies; other rows have prompts of 3..longest tokens and keep decoding."""
    rng = np.random.default_rng(batch)
    lengths = np.array([PROMPT] + list(rng.integers(3, longest + 1, batch - 1)))
    P = int(lengths.max())
    tokens = rng.integers(0, cfg.vocab_size, (batch, P))
    tokens[0, :PROMPT] = np.arange(PROMPT) * 5 % cfg.vocab_size
    positions = np.arange(P)[None].repeat(batch, 0)
    out = forward(params, cfg, jnp.asarray(tokens), jnp.asarray(positions), init_cache(cfg, batch, P + 24, dtype),
                  capture=(1, 2, 3))
    got = [out.residuals[:, 0, :PROMPT], out.logits[0, :PROMPT]]
    cache, n = out.cache, lengths.copy()
    for t in range(steps):
        step_tokens = jnp.asarray((np.arange(batch) * 7 + t) % cfg.vocab_size)[:, None]
        out = forward(params, cfg, step_tokens, jnp.asarray(n)[:, None], cache, capture=(1, 2, 3), lens_layers=(1, 2))
        got += [out.residuals[:, 0], out.logits[0], out.lens.entropy[:, 0]]
        cache, n = out.cache, n + 1
    return [np.asarray(a.astype(jnp.float32)) for a in got]


@pytest.mark.parametrize("dtype, steps", [(jnp.float32, 1), (jnp.bfloat16, 1), (jnp.bfloat16, 5), (jnp.float32, 5)],
                         ids=["float32-prefill+1", "bfloat16-prefill+1", "bfloat16-prefill+5", "float32-prefill+5"])
def test_a_row_does_not_depend_on_its_batch(dtype, steps):
    cfg = dataclasses.replace(tiny_config("LlamaForCausalLM", vocab=97), batch_invariant=True, row_tile=4, kv_chunk=8)
    params = init_params(cfg, jax.random.key(0), dtype, scale=0.3)
    alone = _row0(cfg, params, dtype, 1, steps)
    for batch in ROW_BATCHES:
        for i, (a, b) in enumerate(zip(_row0(cfg, params, dtype, batch, steps), alone)):
            np.testing.assert_array_equal(a, b, err_msg=f"output {i}, batch {batch}")


def test_a_long_prefill_does_not_depend_on_its_batch():
    """As above in a batch of 8 with prompts up to 32 tokens (a prefill of >= 128 rows):
    XLA CPU reduced the RMSNorm's mean in another order from 128 rows on (1 ulp in
    float32 at row 0's layer-1 residuals) until the norms ran on row tiles too."""
    cfg = dataclasses.replace(tiny_config("LlamaForCausalLM", vocab=97), batch_invariant=True, row_tile=4, kv_chunk=8)
    params = init_params(cfg, jax.random.key(0), jnp.float32, scale=0.3)
    alone = _row0(cfg, params, jnp.float32, 1, 1)
    for i, (a, b) in enumerate(zip(_row0(cfg, params, jnp.float32, 8, 1, longest=32), alone)):
        np.testing.assert_array_equal(a, b, err_msg=f"output {i}, batch 8")


@pytest.mark.parametrize("row_tile", [4, None], ids=["row_tile 4", "row_tile unset"])
def test_a_prefill_in_chunks_does_not_depend_on_its_batch(row_tile):
    """A prefill runs in chunks of kv_chunk tokens per row, whose per-token work runs on
    tiles of half a row's chunk (`transformer._token_tile`), whatever `row_tile` says: with
    kv_chunk 32 a batch of 8 puts 256 token rows through each chunk, where an untiled RMSNorm
    is reduced in another order (mutation check: chunks run untiled fail here). With
    `row_tile` unset (the default) the chunk's attention reads one row per tile on the CPU
    (`transformer._attention_tile`): a batch of 1 pads to two one-row tiles, 3 and 8 run
    without padding."""
    cfg = dataclasses.replace(tiny_config("LlamaForCausalLM", vocab=97), batch_invariant=True, row_tile=row_tile,
                              kv_chunk=32)
    params = init_params(cfg, jax.random.key(0), jnp.float32, scale=0.3)
    alone = _row0(cfg, params, jnp.float32, 1, 1)
    for batch in (3, 8) if row_tile is None else (8,):
        for i, (a, b) in enumerate(zip(_row0(cfg, params, jnp.float32, batch, 1, longest=40), alone)):
            np.testing.assert_array_equal(a, b, err_msg=f"output {i}, batch {batch}")


def test_without_the_option_the_cpu_is_not_batch_invariant():
    """The control: the same check without `batch_invariant` differs on XLA CPU in float32
    (a one-row matmul is a gemv); if this starts passing, the test above proves nothing."""
    cfg = dataclasses.replace(tiny_config("LlamaForCausalLM", vocab=97), kv_chunk=8)
    params = init_params(cfg, jax.random.key(0), jnp.float32, scale=0.3)
    alone, batched = _row0(cfg, params, jnp.float32, 1, 1), _row0(cfg, params, jnp.float32, BATCH, 1)
    assert any((a != b).any() for a, b in zip(alone, batched))


# ----------------------------------------------------------------------------- decoders
# Every decoder on the batch-invariant model: prompt 0 decoded alone and as row 0 of a
# batch of 6 (other prompts of 3..20 tokens: the batch pads prompts to 32 slots, alone to
# 16, so the buffers differ too, and its prefill runs 192 rows), with one key per prompt,
# gives bit-identical per-token tokens / log p / log q / d_t / H_L and counters (read
# from the final state) and bit-identical answers, candidates, acceptance, SMC weights /
# evidence / ESS and SPS rollout counts. Every method runs 16 new tokens so that the
# prefills (one per batch shape and dtype) are shared; alpha = 2 keeps the chains and
# particles diverse, and the EOS id is a token the pools and particles sample now and then.

DECODER_EOS = (89,)
TARGET = [5, 10, 15, 20, 25, 30, 35]  # prompt 0
OTHERS = [list(np.random.default_rng(0).integers(0, 89, n)) for n in (3, 20, 11, 5, 14, 9, 17)]
# Each method's smallest run (`Method.smallest_run`), made longer: every field of this
# table that the method has takes its value here (16 new tokens: 2 MCMC blocks of 8, 2 SPS
# blocks of 8 with rollouts of 6, 4 SMC checks). A new method needs no entry.
LONGER = dict(max_new_tokens=16, block_len=8, mh_steps=3, n_particles=4, resample_every=4, ramp_tokens=8,
              candidate_pool=4, rollout_horizon=6, alpha=2.0, temperature=1.0)
DECODER_SETTINGS = {m: {**method_classes()[m].smallest_run,
                        **{name: value for name, value in LONGER.items() if name in field_names(m)}}
                    for m in METHODS}
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
GEN_FIELDS = ("tokens", "logp", "logq", "depth", "final_entropy")
COUNTERS = ("length", "prompt_len", "ended", "n_generated", "n_forward", "n_probed")


@functools.lru_cache(maxsize=None)
def _model(dtype_name: str, batch_invariant: bool = True):
    cfg = dataclasses.replace(tiny_config("LlamaForCausalLM", vocab=97), batch_invariant=batch_invariant,
                              row_tile=4, kv_chunk=8)
    return TransformerLM(cfg), init_params(cfg, jax.random.key(0), DTYPES[dtype_name], scale=1.0)


def _batch(size: int):
    """Prompt 0 and size - 1 others, with prompt 0's key fixed and the others' varying."""
    keys = jnp.stack([jax.random.key(1234)] + [jax.random.key(10 + i) for i in range(size - 1)])
    return [TARGET] + OTHERS[:size - 1], keys


def _bits(value):
    """A nested structure with every float replaced by its IEEE bits (== is then bitwise:
    -0.0 != 0.0, NaN == NaN), numpy arrays by (dtype, shape, raw bytes)."""
    if isinstance(value, dict):
        return {k: _bits(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_bits(v) for v in value]
    if isinstance(value, float):
        return struct.pack("<d", value).hex()
    if isinstance(value, np.ndarray):
        return (str(value.dtype), value.shape, value.tobytes())
    return value


def _rows(state, rows: int) -> dict:
    """Prompt 0's rows (its first `rows`) of a final GenState: the per-token buffers up
    to each row's length, and the lengths, flags and work counters."""
    host = jax.device_get({f: getattr(state, f) for f in GEN_FIELDS + COUNTERS})
    out = {f: np.asarray(host[f][:rows]) for f in COUNTERS}
    for f in GEN_FIELDS:
        out[f] = [np.asarray(host[f][r, :host["length"][r]]) for r in range(rows)]
    return out


@functools.lru_cache(maxsize=None)
def _decoded(method: str, dtype_name: str, size: int, batch_invariant: bool = True):
    """`decode` of `_batch(size)`: (prompt 0's Output as a dict, its rows of the final
    state, caught on its way to `candidate_scores`)."""
    model, params = _model(dtype_name, batch_invariant)
    prompts, keys = _batch(size)
    states = []
    scores = decoders.candidate_scores
    decoders.candidate_scores = lambda state, *args: states.append(state) or scores(state, *args)
    try:
        result = decode(model, params, prompts, method, keys=keys, eos_ids=DECODER_EOS,
                        **DECODER_SETTINGS[method])
    finally:
        decoders.candidate_scores = scores
    (state,) = states
    return dataclasses.asdict(result.outputs[0]), _rows(state, result.config.pool_size)


def _assert_bitwise_equal(alone, batched, what):
    for name in alone:
        assert _bits(batched[name]) == _bits(alone[name]), f"{what}: {name} differs from prompt 0 alone"


# Each case compiles the decoder for every batch shape (~15-50 s each on a 2-core CPU), so
# CI runs a subset: every method in float32 (the strict case: bfloat16 rounding hides
# 1-ulp differences), one method per family also in bfloat16. DEGS_JAX_FULL_INVARIANCE=1
# runs every method in both dtypes against batches of 6, 3 and 8, and `decode_tokens` for
# every method it runs (the whole file then ran 43 tests with batches of 3 and 8, 7.5 min
# with -n 2 on an idle 2-core machine; all passed on 2026-11-26 after the DEGS-SMC fix).
BF16_IN_CI = ("greedy", "best_of_n", "degs_mcmc", "degs_smc", "scalable_power")
DECODE_CASES = [(m, d) for m in METHODS for d in ("float32", "bfloat16")
                if FULL_MATRIX or d == "float32" or m in BF16_IN_CI]
# decode_tokens in CI: greedy and DEGS-MCMC in both dtypes, one SMC method and SPS in
# float32 (their traced kernels: resampling and the block selection run inside the one program).
DECODE_TOKENS_BOTH_DTYPES = ("greedy", "degs_mcmc")
DECODE_TOKENS_IN_CI = DECODE_TOKENS_BOTH_DTYPES + ("degs_smc", "scalable_power")
DECODE_TOKENS_CASES = [(m, d) for m in METHODS for d in ("float32", "bfloat16")
                       if FULL_MATRIX or m in DECODE_TOKENS_BOTH_DTYPES
                       or (m in DECODE_TOKENS_IN_CI and d == "float32")]


@pytest.mark.parametrize("method, dtype_name", DECODE_CASES)
def test_a_prompts_decoding_does_not_depend_on_its_batch(method, dtype_name):
    output, rows = _decoded(method, dtype_name, 1)
    for size in BATCHES:
        batched_output, batched_rows = _decoded(method, dtype_name, size)
        _assert_bitwise_equal(rows, batched_rows, f"batch of {size}, final state")
        _assert_bitwise_equal(output, batched_output, f"batch of {size}, output")


@pytest.mark.parametrize("method, dtype_name", DECODE_TOKENS_CASES)
def test_decode_tokens_in_a_batch_equals_decode_alone(method, dtype_name):
    """`decode_tokens` (one jitted program) on the batch of 6 gives prompt 0 the final
    state rows, scores, acceptance and answer of `decode` on prompt 0 alone, bit for bit
    (other batches are left to `decode`'s test above: each batch shape compiles the whole
    program again)."""
    output, rows = _decoded(method, dtype_name, 1)
    model, params = _model(dtype_name)
    prompts, keys = _batch(BATCH)
    tokens, lengths = pad_prompts(prompts)
    config = hyperparameters_for(method, **DECODER_SETTINGS[method])
    result = jax.device_get(decode_tokens(model, params, jnp.asarray(tokens), jnp.asarray(lengths), keys,
                                          config, DECODER_EOS))
    n = config.pool_size
    _assert_bitwise_equal(rows, _rows(result.state, n), f"decode_tokens, batch of {BATCH}, final state")
    for j, candidate in enumerate(output["candidates"]):
        got = dict(log_p=float(result.log_p[j]), final_entropy=float(result.final_entropy[j]),
                   depth=float(result.depth[j]) if config.probed else None,
                   acceptance=None if candidate["acceptance"] is None else
                   [int(a) / config.mh_steps for a, ran in zip(result.accepted[j], result.ran[j]) if ran])
        _assert_bitwise_equal({k: candidate[k] for k in got}, got, f"decode_tokens, candidate {j}")
    # the answer: the same candidate (SMC draws it from its final weights)
    _assert_bitwise_equal({"chosen": output["chosen"]},
                          {"chosen": output["candidates"][int(result.chosen[0])]}, "decode_tokens, answer")
    assert int(result.chosen[0]) == [c["tokens"] for c in output["candidates"]].index(output["chosen"]["tokens"])


def test_without_the_option_decoding_depends_on_the_batch():
    """The control at decoder level: greedy decoding without `batch_invariant` gives
    prompt 0 other float32 log p / H_L / d_t bits in the batch of 6 than alone (if this
    starts passing, the decoder tests above prove nothing on this machine)."""
    _, alone = _decoded("greedy", "float32", 1, False)
    _, batched = _decoded("greedy", "float32", BATCH, False)
    assert any(_bits(alone[f]) != _bits(batched[f]) for f in GEN_FIELDS)


def test_sequence_depth_is_exact_in_any_layout():
    """D(x) = sum d_t / (n·L) correctly rounded, whatever the batch and buffer around the
    row: the integer sum cannot depend on the reduction order. (A float mean of d_t / L
    gave 0.75000006 for row 1 and, inside DEGS-SMC's compiled step, other bits for the
    same particle alone and in a batch of 3.) Depths of a DEGS-SMC run of this file."""
    from degs_jax.lens import sequence_depth

    rows = [[1, 2, 3, 1, 3, 3, 1, 3, 1, 3, 1, 1, 3, 1, 1, 3], [1, 3, 1, 3, 3, 1, 1, 3, 3, 3, 3, 3, 1, 3, 2, 2],
            [1, 2, 3, 1, 3, 1, 3, 3], [1, 3, 1, 3, 3, 3, 3, 3, 3, 3, 3, 1, 3, 3, 3, 3]]
    expected = np.array([sum(r) / (len(r) * 3) for r in rows], np.float32)  # float64, rounded once
    for batch, slots in ((4, 32), (12, 48)):
        depth = np.full((batch, slots), -1, np.int32)
        depth[4:, 7:23] = np.random.default_rng(1).integers(1, 4, (batch - 4, 16))
        for b, r in enumerate(rows):
            depth[b, 7:7 + len(r)] = r
        mask = depth >= 0
        got = np.asarray(jax.jit(sequence_depth, static_argnums=2)(depth, mask, 3))[:4]
        np.testing.assert_array_equal(got.view(np.uint32), expected.view(np.uint32), err_msg=f"[{batch}, {slots}]")


def test_samplers_row_reductions_do_not_depend_on_batch_or_buffer():
    """The samplers' float reductions under batch invariance: a row's `masked_sum` (log p / log q / H_L sums)
    and its vocabulary densities (`generation._densities` on row tiles) alone equal, bit
    for bit, the same row inside a batch of 8 with a longer buffer / other rows. (Plain
    `jnp.sum` and an untiled softmax differ here on XLA CPU: the control below.)"""
    from degs_jax.generation import Proposal, SamplerSpec, _densities
    from degs_jax.lens import SUM_ROWS, masked_sum
    from degs_jax.tiling import row_tiled

    rng = np.random.default_rng(3)
    values = rng.standard_normal((8, 700)).astype(np.float32) * 7
    mask = rng.random((8, 700)) < 0.8
    alone = np.asarray(masked_sum(values[:1, :300], mask[:1, :300], batch_invariant=True))
    together = np.asarray(masked_sum(values * (np.arange(700) < 300)[None], mask, batch_invariant=True))
    assert alone.view(np.uint32)[0] == together.view(np.uint32)[0]

    logits = rng.standard_normal((8, 512)).astype(np.float32) * 4
    spec = SamplerSpec(Proposal(0.7))
    tiled = lambda z: row_tiled(functools.partial(_densities, sampler=spec), jnp.asarray(z), SUM_ROWS)
    for a, b in zip(tiled(logits[:1]), tiled(logits)):
        np.testing.assert_array_equal(np.asarray(a)[0], np.asarray(b)[0])
    untiled = [jax.jit(lambda z: jax.nn.log_softmax(z, -1))(z) for z in (logits[:1], logits)]
    plain = [jax.jit(lambda v: jnp.sum(jnp.where(mask[: len(v)], v, 0.0), -1))(v)
             for v in (values[:1], values * (np.arange(700) < 300)[None])]
    assert (np.asarray(untiled[0])[0] != np.asarray(untiled[1])[0]).any() or \
        np.asarray(plain[0])[0] != np.asarray(plain[1])[0], "control: nothing to guard against"
