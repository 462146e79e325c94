"""Attention that reads only the live part of the KV cache (`cfg.kv_read`, issue 17):
every read mode gives the forward of the full-buffer read, chunks past the batch's live
length are never read, a row's result does not depend on the other rows' lengths in the
"loop" read, idle rows stay finite, and the decode loop updates the cache in place in
every mode and layout (no cache-sized copy per step)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from degs_jax.generation import Proposal, SamplerSpec, generate, prefill
from degs_jax.lens import LensConfig
from degs_jax.models import TransformerLM
from degs_jax.models import KVCache, forward, init_cache, init_params, stack_layers
from degs_jax.models.compilation import large_copies
from tiny_models import tiny_config

CFG = tiny_config("Qwen2ForCausalLM")  # 3 layers, 2 KV heads of 8
S = 40  # not a multiple of the chunks below: the last chunk is moved back and masked
READS = ("loop", "buckets", "kernel", "all")  # "kernel" on CPU: Pallas' interpreter


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, jax.random.key(0), jnp.float32, scale=0.2)


def _decode_logits(params, cfg, lengths=(20, 26), steps=19):
    """Prefill two rows, then decode `steps` tokens; row 1 idles (position S) once it
    reaches lengths[1]. Returns ([2, 20 + steps, V] logits, final cache)."""
    tokens = jax.random.randint(jax.random.key(1), (2, 20), 0, cfg.vocab_size)
    out = forward(params, cfg, tokens, jnp.broadcast_to(jnp.arange(20), (2, 20)), init_cache(cfg, 2, S, jnp.float32))
    logits, cache = [out.logits], out.cache
    for t in range(20, 20 + steps):
        pos = jnp.array([[t], [t if t < lengths[1] else S]])
        out = forward(params, cfg, tokens[:, t - 20:t - 19], pos, cache)
        logits.append(out.logits)
        cache = out.cache
    return np.asarray(jnp.concatenate(logits, 1)), cache


@pytest.mark.parametrize("stacked", [False, True], ids=["list", "stacked"])
def test_every_read_gives_the_full_buffer_forward(params, stacked):
    p = stack_layers(params) if stacked else params
    want, want_cache = _decode_logits(params, dataclasses.replace(CFG, kv_read="all"))
    for read in READS:
        for chunk in (8, 16):
            got, cache = _decode_logits(p, dataclasses.replace(CFG, kv_read=read, kv_chunk=chunk))
            # fp32, different blocking of the same sums: |logits| ~ 1, errors ~1e-6. Row 1's
            # logits once idle (from entry 26 on) are garbage by contract (finite, compared below).
            for row, end in ((0, None), (1, 26)):
                np.testing.assert_allclose(got[row, :end], want[row, :end], atol=1e-5, rtol=0,
                                           err_msg=f"{read}, chunk {chunk}, row {row}")
            jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5, rtol=0), cache, want_cache)
            assert np.isfinite(got).all()


def _poisoned(cache: KVCache, from_slot: int) -> KVCache:
    """The cache with NaN in every slot >= from_slot: any read of those slots poisons the
    output (a masked NaN value still gives 0 * NaN = NaN in the P·V product)."""
    return KVCache(k=cache.k.at[:, :, :, from_slot:].set(jnp.nan), v=cache.v.at[..., from_slot:].set(jnp.nan))


@pytest.mark.parametrize("read, unread_from", [("loop", 16), ("buckets", 16), ("kernel", 14), ("all", None)])
def test_slots_past_the_live_chunks_are_never_read(params, read, unread_from):
    """A step of rows at positions 13 and 9 with 8-slot chunks: the loop reads chunks 0 and
    1 (slots < 16, covering position 13), the buckets read the 16-slot window (windows 0,
    8, 16, 32, 40), the kernel each row's own slots (< 14 and < 10; the rest of its 32-slot
    block is loaded but masked, values included); with NaN in every later slot the
    result is still exact. Reading the
    whole buffer ("all") is poisoned: the test notices any read past the live chunks."""
    cfg = dataclasses.replace(CFG, kv_read=read, kv_chunk=8)
    tokens = jax.random.randint(jax.random.key(2), (2, 14), 0, cfg.vocab_size)
    positions = jnp.broadcast_to(jnp.arange(14), (2, 14))
    clean = forward(params, cfg, tokens, positions, init_cache(cfg, 2, S, jnp.float32)).cache
    step_tokens, step_pos = jnp.array([[3], [4]]), jnp.array([[13], [9]])
    want = forward(params, cfg, step_tokens, step_pos, clean).logits
    got = forward(params, cfg, step_tokens, step_pos, _poisoned(clean, unread_from or 16)).logits
    if unread_from is None:
        assert np.isnan(np.asarray(got)).all()
    else:
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_loop_read_row_result_does_not_depend_on_the_other_rows_lengths(params):
    """Row 0 decodes the same tokens next to a short and a long row: the long row makes the
    loop read more chunks, which combine as exact identities for row 0 (bitwise equal)."""
    cfg = dataclasses.replace(CFG, kv_read="loop", kv_chunk=8)
    rows = []
    for other in (5, 37):
        tokens = jax.random.randint(jax.random.key(3), (2, 38), 0, cfg.vocab_size)
        cache = init_cache(cfg, 2, S, jnp.float32)
        prompt = jnp.broadcast_to(jnp.arange(38), (2, 38))
        cache = forward(params, cfg, tokens, prompt, cache).cache
        step = forward(params, cfg, jnp.array([[7], [7]]), jnp.array([[10], [other]]), cache)
        rows.append(np.asarray(step.logits[0]))
    np.testing.assert_array_equal(rows[0], rows[1])


@pytest.mark.parametrize("read", [r for r in READS if r != "kernel"])  # interpreted here: not
# the program a GPU runs (bench/decode_breakdown.py checks the kernel's HLO on the GPU)
@pytest.mark.parametrize("stacked", [False, True], ids=["list", "stacked"])
def test_decode_loop_updates_the_cache_in_place(read, stacked):
    """The compiled `generate` holds exactly two cache-sized copies, k and v, made once on
    entry (its state argument is not donated); none inside the step loop. (A layer that
    reads the cache where XLA cannot order the read before the write gets its own copy:
    that was 2 more per step with the reads and writes in the wrong order.)"""
    cfg = dataclasses.replace(tiny_config("Qwen2ForCausalLM", hidden=64, head_dim=16, layers=2),
                              kv_read=read, kv_chunk=32)
    p = init_params(cfg, jax.random.key(0), jnp.float32)
    p = stack_layers(p) if stacked else p
    B, max_len = 4, 256
    model = TransformerLM(cfg)
    state = prefill(model, p, jnp.ones((B, 8), jnp.int32), jnp.full((B,), 5, jnp.int32), max_len, jnp.float32)
    spec = SamplerSpec(Proposal(1.0), eos_ids=(95,), lens=LensConfig(lsub=(1, 2)))
    hlo = generate.lower(model, p, state, jnp.full((B,), 200, jnp.int32), jax.random.split(jax.random.key(0), B),
                         spec).compile().as_text()
    copies = large_copies(hlo, cfg.num_layers * B * cfg.num_kv_heads * max_len * cfg.head_dim // 2)
    assert sorted(copies) == ["copy[2,4,2,16,256]", "copy[2,4,2,256,16]"], copies


def test_read_settings_are_checked():
    from degs_jax.models import ConfigError

    with pytest.raises(ConfigError, match="kv_read must be one of auto, kernel, loop, buckets, all"):
        dataclasses.replace(CFG, kv_read="paged")
    with pytest.raises(ConfigError, match="kv_chunk must be a positive integer"):
        dataclasses.replace(CFG, kv_chunk=0)
    with pytest.raises(ConfigError, match="lens_rows must be one of live, all, got 'idle'"):
        dataclasses.replace(CFG, lens_rows="idle")


@pytest.mark.parametrize("backend, tokens, expected", [
    ("cpu", 1, "loop"), ("cpu", 64, "loop"),
    ("gpu", 1, "kernel"),  # decode steps: the Pallas kernel reads each row's own slots
    ("tpu", 1, "buckets"),  # no Triton: one switch per call instead of a loop per layer
    ("gpu", 5, "buckets"),  # a drafted step's verification: one switch, not a host wait per layer
    ("tpu", 5, "buckets"), ("cpu", 5, "loop"),
    ("gpu", 64, "loop"),  # prefills: a switch reserves its largest (whole-buffer) window's memory
])
def test_auto_read_by_backend_and_call_length(monkeypatch, backend, tokens, expected):
    """`kv_read="auto"`: the GPU decode step uses the kernel, other accelerators the
    buckets, a short multi-token call (a drafted step) the buckets on accelerators, a
    long one the loop (a 1024-token prefill at batch 64 ran out of
    memory on an H100 with buckets); an explicit setting and batch invariance are kept
    whatever the call (an explicit "kernel" loops for several tokens)."""
    from degs_jax.models import attention

    monkeypatch.setattr(attention.jax, "default_backend", lambda: backend)
    cfg = dataclasses.replace(CFG, head_dim=16)  # a head size the kernel takes
    assert attention.read_mode(cfg, tokens, S, 4) == expected
    assert attention.read_mode(dataclasses.replace(cfg, kv_read="buckets"), tokens, S, 4) == "buckets"
    assert attention.read_mode(dataclasses.replace(cfg, kv_read="kernel"), tokens, S, 4) == (
        "kernel" if tokens == 1 else "loop")
    assert attention.read_mode(dataclasses.replace(cfg, batch_invariant=True), tokens, S, 4) == "loop"


def test_auto_read_keeps_the_kernel_off_where_it_cannot_run(monkeypatch):
    """On a GPU, "auto" decodes with "buckets" when the kernel cannot take the shape (a
    head size that is not a power of two >= 16, a cache of < 16 slots), and under a device
    mesh whose axes do not split the rows and KV heads evenly (the kernel runs per shard;
    one custom call over the whole cache would make XLA gather it onto every device)."""
    from degs_jax.models import attention
    from degs_jax.models.sharding import make_mesh

    monkeypatch.setattr(attention.jax, "default_backend", lambda: "gpu")
    wide = dataclasses.replace(CFG, head_dim=16)
    assert attention.read_mode(wide, 1, S, 3) == "kernel"
    assert attention.read_mode(CFG, 1, S, 3) == "buckets"  # head size 8
    assert attention.read_mode(dataclasses.replace(CFG, head_dim=24), 1, S, 3) == "buckets"
    assert attention.read_mode(wide, 1, 8, 3) == "buckets"
    assert wide.num_kv_heads % 2 == 0
    with jax.set_mesh(make_mesh(data=2, model=2)):
        assert attention.read_mode(wide, 1, S, 4) == "kernel"
        assert attention.read_mode(wide, 1, S, 3) == "buckets"  # 3 rows over 2 devices
    with jax.set_mesh(make_mesh(data=1, model=4)):
        assert attention.read_mode(dataclasses.replace(wide, num_kv_heads=2, num_heads=4), 1, S, 4) == "buckets"


def test_large_prefill_runs_in_chunks_with_the_same_result(params, monkeypatch):
    """A multi-token call of more than CHUNKED_PREFILL_TOKENS rows x tokens runs in
    kv_chunk-token chunks (bounded temporaries: the 7B prefill of 128 x 1024 tokens did
    not fit an H100 in one call) and gives the one-call logits and cache (fp32, other
    blocking of the same sums: ~1e-6)."""
    from degs_jax.models import transformer

    cfg = dataclasses.replace(CFG, kv_chunk=8)
    tokens = jax.random.randint(jax.random.key(5), (2, 21), 0, cfg.vocab_size)
    positions = jnp.broadcast_to(jnp.arange(21), (2, 21))
    run = lambda: forward(params, cfg, tokens, positions, init_cache(cfg, 2, S, jnp.float32))
    whole = run()
    calls = []
    chunked = transformer._forward_in_chunks
    monkeypatch.setattr(transformer, "_forward_in_chunks", lambda *a: calls.append(1) or chunked(*a))
    monkeypatch.setattr(transformer, "CHUNKED_PREFILL_TOKENS", 2 * 21 - 1)
    jax.clear_caches()  # `forward` reads the threshold when traced
    got = run()
    assert calls == [1]
    np.testing.assert_allclose(np.asarray(got.logits), np.asarray(whole.logits), atol=1e-5, rtol=0)
    # the prompt's slots (the last chunk's padding writes slots 21..23, read by no query)
    np.testing.assert_allclose(got.cache.k[:, :, :, :21], whole.cache.k[:, :, :, :21], atol=1e-5, rtol=0)
    np.testing.assert_allclose(got.cache.v[..., :21], whole.cache.v[..., :21], atol=1e-5, rtol=0)


@pytest.mark.parametrize("stacked", [False, True], ids=["list", "stacked"])
def test_a_short_multi_token_call_reads_like_the_full_buffer(params, stacked):
    """A drafted decode step's call (`generation.drafted_decode_step`): 5 tokens per row
    after cached contexts of 20 and 27 tokens, row 1's last two positions past its draft
    (position S: written nowhere, seen by no query), row 2 idle. Every read gives the
    full-buffer read's logits at the real positions and its cache: "buckets" (what
    accelerators use for such calls) attends to the cache below each row's first position
    and then, causally, to the call's own keys."""
    p = stack_layers(params) if stacked else params
    tokens = jax.random.randint(jax.random.key(4), (3, 27), 0, CFG.vocab_size)
    context = jnp.broadcast_to(jnp.arange(27), (3, 27))
    step_tokens = jax.random.randint(jax.random.key(5), (3, 5), 0, CFG.vocab_size)
    step_pos = jnp.array([[20, 21, 22, 23, 24], [27, 28, 29, S, S], [S] * 5])
    real = np.asarray(step_pos < S)
    results = {}
    for read in READS:
        cfg = dataclasses.replace(CFG, kv_read=read, kv_chunk=8)
        cache = forward(p, cfg, tokens, context, init_cache(cfg, 3, S, jnp.float32)).cache
        out = forward(p, cfg, step_tokens, step_pos, cache)
        results[read] = (np.asarray(out.logits), out.cache)
    want, want_cache = results["all"]
    for read, (got, cache) in results.items():
        # fp32, different blocking of the same sums (as above): errors ~1e-6.
        np.testing.assert_allclose(got[real], want[real], atol=1e-5, rtol=0, err_msg=read)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5, rtol=0), cache, want_cache)
