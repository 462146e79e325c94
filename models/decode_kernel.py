"""Decode-step attention as one Pallas (Triton) kernel per layer: flash decoding over
each row's own live cache slots.

Why. A decode step's attention is a read of the KV cache: for each row and KV head, one
query group (g = H / Hkv query heads) against the row's live slots. Written as XLA
einsums it is several kernels per layer (scores, mask and softmax statistics, P·V) with
[B, H, slots] fp32 scores written and read back between them, over a window rounded up
to a power-of-two bucket of the batch's longest row ("buckets" read). Measured on an
H100 at the 7B shape, batch 64, that came to ~3.8 ms of a 10.1 ms step whose weights
alone take 6.2 ms (docs/benchmarks.md, run 27). This kernel reads each row's slots
once, below that row's own live length (no bucket, no other row's length), and keeps
scores in registers: the same step takes 7.7 ms (run 28).

What it computes. Grid (B, Hkv, P). Program (b, h, j) takes the j-th of P equal pieces
(rounded up to whole blocks) of row b's live slots [0, live[b]) and walks them in blocks
of `block` slots with the online softmax: per block, scores s = (q·K^T)·scale in fp32
(bf16 products accumulated in fp32, as the einsum path), running max m,
l = sum exp(s - m), and o = sum exp(s - m)·V with the probabilities cast to the value
dtype and accumulated in fp32 (as in the einsum path and HF). It returns the
unnormalised partials (o, m, l) of every piece; `merge_pieces` rescales them to their
common max and sums them, and the caller divides o by l. A piece with no slot
returns m = -inf, l = 0, o = 0, which adds nothing. Splitting a row over several
programs keeps the GPU busy at small batch (flash decoding); P is static, chosen from
B·Hkv (`pieces_for`), so a row's rounding depends on the batch size only through P.

Layout. The cache stays as the model allocates it: K [L, B, Hkv, S, Dh], V
[L, B, Hkv, Dh, S] (V transposed; its block is loaded as [Dh, block] and used
transposed in the P·V product). The layer index is a kernel input, so a layer inside
a `lax.scan` over stacked layers is read where it lies: slicing `cache[layer]` outside
the kernel would make XLA copy the whole layer's buffer every step. A block that would
reach past S starts at S - block instead, with its already-read slots masked, so no
load leaves the buffer.

Requirements on GPUs (`supported`): Dh a power of two >= 16 (Triton's dot), S >= 16.
Elsewhere `interpret=True` runs the same program through Pallas' interpreter, for any
shape (slow; for tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pallas_triton

Array = jax.Array
_F32 = jnp.float32

# Slots per block: [block, Dh] bf16 tiles of K and V (16 KiB each at Dh = 128).
MAX_BLOCK = 64
# Pieces per row are chosen so that about this many programs run (B · Hkv · pieces):
# a few per SM of an H100 (132 SMs), so that rows of unequal length still fill the card.
TARGET_PROGRAMS = 512
MAX_PIECES = 32


def supported(head_dim: int, slots: int) -> bool:
    """Whether the kernel handles this head size and cache length."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0 and slots >= 16


def _block_size(slots: int) -> int:
    """The largest power of two <= min(MAX_BLOCK, slots): every block lies in the buffer."""
    return min(MAX_BLOCK, 1 << (slots.bit_length() - 1))


def pieces_for(batch: int, kv_heads: int) -> int:
    """Static number of pieces each row's live slots are split into."""
    return max(1, min(MAX_PIECES, -(-TARGET_PROGRAMS // (batch * kv_heads))))


def _dot_t(a: Array, b: Array) -> Array:
    """a [m, n] · b[k, n]^T in fp32 (products of the inputs' dtype, fp32 accumulation)."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=_F32)


def _kernel(layer_ref, live_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, *,
            scale: float, block: int, pieces: int, slots: int):
    b, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    layer = layer_ref[0]
    live = live_ref[b]
    piece = pl.cdiv(pl.cdiv(live, pieces), block) * block  # slots per piece, whole blocks
    lo = j * piece
    hi = jnp.minimum(lo + piece, live)
    n_blocks = pl.cdiv(jnp.maximum(hi - lo, 0), block)
    q = q_ref[...]  # [G, Dh], G = query heads of this KV head, padded to >= 16
    offsets = jnp.arange(block)

    def body(i, carry):
        o, m, l = carry
        first = lo + i * block  # first slot this block is responsible for
        start = jnp.minimum(first, slots - block)  # where it is loaded from (stays in S)
        slot = start + offsets
        seen = (slot >= first) & (slot < hi)
        k = k_ref[layer, b, h, pl.ds(start, block), :]  # [block, Dh]
        scores = _dot_t(q, k) * scale  # [G, block] fp32
        scores = jnp.where(seen[None, :], scores, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(scores, axis=1))  # finite: every block sees a slot
        rescale = jnp.exp(m - m_new)
        p = jnp.exp(scores - m_new[:, None])
        # [Dh, block]; unseen slots zeroed: whatever they hold (a padded entry's garbage,
        # even NaN), 0 · it must not reach o
        v = jnp.where(seen[None, :], v_ref[layer, b, h, :, pl.ds(start, block)], 0)
        o = rescale[:, None] * o + _dot_t(p.astype(v.dtype), v)
        return o, m_new, rescale * l + jnp.sum(p, axis=1)

    G, Dh = q.shape
    init = (jnp.zeros((G, Dh), _F32), jnp.full((G,), -jnp.inf, _F32), jnp.zeros((G,), _F32))
    o, m, l = jax.lax.fori_loop(0, n_blocks, body, init)
    o_ref[...] = o
    m_ref[...] = m
    l_ref[...] = l


def decode_partials(q: Array, cache_k: Array, cache_v: Array, layer, live: Array, scale: float,
                    interpret: bool = False):
    """Partials of one-token queries over each row's live cache slots.

    q: [B, Hkv, g, Dh] (this step's queries, grouped by KV head); cache_k [L, B, Hkv, S,
    Dh], cache_v [L, B, Hkv, Dh, S]; layer: int (or traced int32 scalar) index into L;
    live: [B] int32, row b reads slots [0, live[b]). Returns (o [P, B, Hkv, g, Dh],
    m [P, B, Hkv, g], l [P, B, Hkv, g]) fp32 for the P = `pieces_for(B, Hkv)` pieces."""
    L, B, Hkv, S, Dh = cache_k.shape
    g = q.shape[2]
    if not interpret and not supported(Dh, S):
        raise ValueError(f"the decode kernel needs a power-of-two head size >= 16 and >= 16 "
                         f"cache slots; got head size {Dh}, {S} slots")
    G = max(16, 1 << (g - 1).bit_length())  # Triton's dot wants >= 16 rows, a power of two
    q = jnp.pad(q.astype(cache_k.dtype), ((0, 0), (0, 0), (0, G - g), (0, 0)))
    P = pieces_for(B, Hkv)
    kernel = functools.partial(_kernel, scale=scale, block=_block_size(S), pieces=P, slots=S)
    whole = pl.BlockSpec()  # the whole array: indexed in the kernel by (layer, row, head)
    o, m, l = pl.pallas_call(
        kernel,
        grid=(B, Hkv, P),
        in_specs=[whole, whole,
                  pl.BlockSpec((None, None, G, Dh), lambda b, h, j: (b, h, 0, 0)),
                  whole, whole],
        out_specs=[pl.BlockSpec((None, None, None, G, Dh), lambda b, h, j: (j, b, h, 0, 0)),
                   pl.BlockSpec((None, None, None, G), lambda b, h, j: (j, b, h, 0)),
                   pl.BlockSpec((None, None, None, G), lambda b, h, j: (j, b, h, 0))],
        out_shape=[jax.ShapeDtypeStruct((P, B, Hkv, G, Dh), _F32),
                   jax.ShapeDtypeStruct((P, B, Hkv, G), _F32),
                   jax.ShapeDtypeStruct((P, B, Hkv, G), _F32)],
        compiler_params=None if interpret else pallas_triton.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="decode_attention",
    )(jnp.reshape(jnp.asarray(layer, jnp.int32), (1,)), live.astype(jnp.int32), q, cache_k, cache_v)
    return o[:, :, :, :g], m[..., :g], l[..., :g]


def merge_pieces(o: Array, m: Array, l: Array) -> tuple[Array, Array, Array]:
    """The pieces' partials ([P, ...] each, from `decode_partials`) as one: each piece's
    terms rescaled to the largest piece max and summed (a piece with no slot has
    m = -inf and weight 0; with no slot at all the max is -inf and l = 0). Returns
    (o [...], m [...], l [...])."""
    top = jnp.max(m, axis=0)
    weight = jnp.exp(m - jnp.where(jnp.isfinite(top), top, 0.0))
    return jnp.sum(weight[..., None] * o, axis=0), top, jnp.sum(weight * l, axis=0)
