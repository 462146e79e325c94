"""The Pallas decode kernel (`models/decode_kernel.py`) on its own, through Pallas'
interpreter (the GPU runs the same program compiled by Triton; its parity at real shapes
is bench/decode_breakdown.py's, docs/benchmarks.md runs 28a and 34): its pieces, merged
by `merge_pieces`, give the softmax-weighted values of every
row's live slots, for rows of any length (1 slot, a block's worth, the whole buffer
with the last block moved back), with the grouped queries padded to 16 rows.

The kernel runs inside one jitted function (`_pieces_and_merged`) whose program is compiled
once per shape and dtype: both tests use the same fp32 shapes. (Called eagerly,
`pallas_call` traces its kernel anew and compiles the interpreter's program again at every
call: it was most of this module's time.)"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from degs_jax.models import decode_kernel


def _reference(q, cache_k, cache_v, layer, live, scale):
    """softmax(q·K^T·scale over slots < live) · V, fp32 throughout."""
    k = cache_k[layer].astype(jnp.float32)
    v = cache_v[layer].astype(jnp.float32)
    scores = jnp.einsum("bkgd,bksd->bkgs", q.astype(jnp.float32), k) * scale
    seen = jnp.arange(k.shape[2])[None, None, None] < live[:, None, None, None]
    weights = jax.nn.softmax(jnp.where(seen, scores, -jnp.inf), axis=-1)
    return jnp.einsum("bkgs,bkds->bkgd", weights, v)


def _merged(o, m, l):
    """The attention output from the pieces, as `transformer._kernel_read` forms it."""
    o, _, l = decode_kernel.merge_pieces(o, m, l)
    return o / l[..., None]


@functools.partial(jax.jit, static_argnames=("scale",))
def _pieces_and_merged(q, cache_k, cache_v, layer, live, scale):
    """((o, m, l) of `decode_partials` through the interpreter, their merged output)."""
    pieces = decode_kernel.decode_partials(q, cache_k, cache_v, layer, live, scale, interpret=True)
    return pieces, _merged(*pieces)


# Both tests' fp32 shapes: layers, rows, KV heads, slots (not a multiple of the 64-slot
# block), head size, query heads per KV head
LAYERS, ROWS, KV_HEADS, SLOTS, HEAD_DIM, GROUP = 2, 5, 2, 100, 16, 3
SCALE = HEAD_DIM ** -0.5


@pytest.mark.parametrize("dtype, atol", [
    (jnp.float32, 1e-5),  # other summation order only
    # bf16 cache: the probabilities are rounded to bf16 for P·V (relative 2^-9 each, at
    # each block's running max), values |v| <= ~4: differences ~1e-2 at most
    (jnp.bfloat16, 2e-2),
])
def test_pieces_merge_to_the_softmax_over_each_rows_live_slots(dtype, atol):
    keys = jax.random.split(jax.random.key(0), 3)
    cache_k = jax.random.normal(keys[0], (LAYERS, ROWS, KV_HEADS, SLOTS, HEAD_DIM), dtype)
    cache_v = jax.random.normal(keys[1], (LAYERS, ROWS, KV_HEADS, HEAD_DIM, SLOTS), dtype)
    q = jax.random.normal(keys[2], (ROWS, KV_HEADS, GROUP, HEAD_DIM), dtype)
    live = jnp.array([1, 37, 64, 65, 100], jnp.int32)  # one slot .. the whole buffer
    (o, m, l), merged = _pieces_and_merged(q, cache_k, cache_v, jnp.int32(1), live, SCALE)
    P = decode_kernel.pieces_for(ROWS, KV_HEADS)
    assert o.shape == (P, ROWS, KV_HEADS, GROUP, HEAD_DIM) and m.shape == l.shape == (P, ROWS, KV_HEADS, GROUP)
    # every slot is counted exactly once: the pieces' l add up to the row's softmax sum
    want = _reference(q, cache_k, cache_v, 1, live, SCALE)
    np.testing.assert_allclose(np.asarray(merged), np.asarray(want), atol=atol, rtol=0)


def test_slots_past_the_live_length_and_other_layers_are_not_read():
    """NaN in every slot a row does not own (past its live length, and the other layer)
    leaves the result finite and unchanged."""
    keys = jax.random.split(jax.random.key(1), 3)
    cache_k = jax.random.normal(keys[0], (LAYERS, ROWS, KV_HEADS, SLOTS, HEAD_DIM), jnp.float32)
    cache_v = jax.random.normal(keys[1], (LAYERS, ROWS, KV_HEADS, HEAD_DIM, SLOTS), jnp.float32)
    q = jax.random.normal(keys[2], (ROWS, KV_HEADS, GROUP, HEAD_DIM), jnp.float32)
    live = jnp.array([5, 33, 48, 70, 100], jnp.int32)  # .. the whole buffer
    _, clean = _pieces_and_merged(q, cache_k, cache_v, jnp.int32(0), live, SCALE)
    unowned = jnp.arange(SLOTS)[None, :] >= live[:, None]  # [rows, slots]
    poison_k = cache_k.at[0].set(jnp.where(unowned[:, None, :, None], jnp.nan, cache_k[0])).at[1].set(jnp.nan)
    poison_v = cache_v.at[0].set(jnp.where(unowned[:, None, None, :], jnp.nan, cache_v[0])).at[1].set(jnp.nan)
    _, got = _pieces_and_merged(q, poison_k, poison_v, jnp.int32(0), live, SCALE)
    assert np.isfinite(np.asarray(clean)).all()
    np.testing.assert_array_equal(np.asarray(got), np.asarray(clean))


def test_supported_shapes():
    assert decode_kernel.supported(128, 3328) and decode_kernel.supported(64, 16)
    assert not decode_kernel.supported(8, 3328)  # Triton's dot needs >= 16
    assert not decode_kernel.supported(96, 3328)  # not a power of two
    assert not decode_kernel.supported(128, 15)
    with pytest.raises(ValueError, match="power-of-two head size"):
        decode_kernel.decode_partials(jnp.zeros((1, 1, 1, 8)), jnp.zeros((1, 1, 1, 32, 8)),
                                      jnp.zeros((1, 1, 1, 8, 32)), 0, jnp.ones((1,), jnp.int32), 1.0)
