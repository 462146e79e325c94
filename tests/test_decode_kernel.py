"""The Pallas decode kernel (`models/decode_kernel.py`) on its own, through Pallas'
interpreter (the GPU runs the same program compiled by Triton; its parity at real shapes
is bench/decode_breakdown.py's, docs/benchmarks.md runs 28a and 34): its pieces, merged
by `merge_pieces`, give the softmax-weighted values of every
row's live slots, for rows of any length (1 slot, a block's worth, the whole buffer
with the last block moved back), with the grouped queries padded to 16 rows."""

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


@pytest.mark.parametrize("dtype, atol", [
    (jnp.float32, 1e-5),  # other summation order only
    # bf16 cache: the probabilities are rounded to bf16 for P·V (relative 2^-9 each, at
    # each block's running max), values |v| <= ~4: differences ~1e-2 at most
    (jnp.bfloat16, 2e-2),
])
def test_pieces_merge_to_the_softmax_over_each_rows_live_slots(dtype, atol):
    L, B, Hkv, S, Dh, g = 2, 5, 2, 100, 16, 3  # S: not a multiple of the 64-slot block
    keys = jax.random.split(jax.random.key(0), 3)
    cache_k = jax.random.normal(keys[0], (L, B, Hkv, S, Dh), dtype)
    cache_v = jax.random.normal(keys[1], (L, B, Hkv, Dh, S), dtype)
    q = jax.random.normal(keys[2], (B, Hkv, g, Dh), dtype)
    live = jnp.array([1, 37, 64, 65, 100], jnp.int32)  # one slot .. the whole buffer
    scale = Dh ** -0.5
    o, m, l = decode_kernel.decode_partials(q, cache_k, cache_v, jnp.int32(1), live, scale, interpret=True)
    P = decode_kernel.pieces_for(B, Hkv)
    assert o.shape == (P, B, Hkv, g, Dh) and m.shape == l.shape == (P, B, Hkv, g)
    # every slot is counted exactly once: the pieces' l add up to the row's softmax sum
    want = _reference(q, cache_k, cache_v, 1, live, scale)
    np.testing.assert_allclose(np.asarray(_merged(o, m, l)), np.asarray(want), atol=atol, rtol=0)


def test_slots_past_the_live_length_and_other_layers_are_not_read():
    """NaN in every slot a row does not own (past its live length, and the other layer)
    leaves the result finite and unchanged."""
    L, B, Hkv, S, Dh, g = 2, 3, 1, 48, 16, 2
    keys = jax.random.split(jax.random.key(1), 3)
    cache_k = jax.random.normal(keys[0], (L, B, Hkv, S, Dh), jnp.float32)
    cache_v = jax.random.normal(keys[1], (L, B, Hkv, Dh, S), jnp.float32)
    q = jax.random.normal(keys[2], (B, Hkv, g, Dh), jnp.float32)
    live = jnp.array([5, 33, 48], jnp.int32)
    clean = _merged(*decode_kernel.decode_partials(q, cache_k, cache_v, 0, live, 0.25, interpret=True))
    unowned = jnp.arange(S)[None, :] >= live[:, None]  # [B, S]
    poison_k = cache_k.at[0].set(jnp.where(unowned[:, None, :, None], jnp.nan, cache_k[0])).at[1].set(jnp.nan)
    poison_v = cache_v.at[0].set(jnp.where(unowned[:, None, None, :], jnp.nan, cache_v[0])).at[1].set(jnp.nan)
    got = _merged(*decode_kernel.decode_partials(q, poison_k, poison_v, 0, live, 0.25, interpret=True))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(clean))


def test_supported_shapes():
    assert decode_kernel.supported(128, 3328) and decode_kernel.supported(64, 16)
    assert not decode_kernel.supported(8, 3328)  # Triton's dot needs >= 16
    assert not decode_kernel.supported(96, 3328)  # not a power of two
    assert not decode_kernel.supported(128, 15)
    with pytest.raises(ValueError, match="power-of-two head size"):
        decode_kernel.decode_partials(jnp.zeros((1, 1, 1, 8)), jnp.zeros((1, 1, 1, 32, 8)),
                                      jnp.zeros((1, 1, 1, 8, 32)), 0, jnp.ones((1,), jnp.int32), 1.0)
