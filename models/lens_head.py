"""The output head: logits and the fused, streamed logit lens of `transformer.forward`.

One pass over the unembedding W_U serves the output logits and the lens statistics of
every probed layer (entropy, top-1 and its probability, log-normaliser), streaming the
vocabulary in chunks so that no [rows, V] array exists for the lens rows (`streamed_head`);
large decode steps compute the lens of live rows only (`live_rows_head`). A tuned lens
maps the probed residuals through affine translators first (`translate_residuals`).
Shapes: K = lensed layers, B = batch rows, T = positions, D = hidden size, V = vocabulary.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp

from ..tiling import row_tiled, switch_on_size

Array = jax.Array
_F32 = jnp.float32


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LensStats:
    """Logit-lens statistics of `softmax(W_U · RMSNorm_final(h_l))`, fp32."""

    entropy: Array  # [K, B, T] nats
    top1: Array  # [K, B, T] int32 argmax token
    top1_prob: Array  # [K, B, T]
    logsumexp: Array  # [K, B, T]: log of the softmax normaliser (log p(v) = z_v - logsumexp)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LensTranslators:
    """Affine maps applied to lensed residuals before the final norm (a tuned lens,
    Belrose et al. 2023): row k maps the residual h of `lens_layers[k]` to
    `h + h·weight[k] + bias[k]` (all zeros: the logit lens). Computed in fp32 and cast
    back to the residual's dtype; the output logits are never translated."""

    weight: Array  # [K, D, D] fp32
    bias: Array  # [K, D] fp32


def translate_residuals(h: Array, translators: LensTranslators) -> Array:
    """`h + h·W_k + b_k` for every lensed row k. h: [K, ..., D]; returns h's dtype."""
    h32 = h.astype(jnp.float32)
    flat = h32.reshape(h.shape[0], -1, h.shape[-1])
    moved = jnp.einsum("knd,kde->kne", flat, translators.weight,
                       preferred_element_type=jnp.float32).reshape(h.shape)
    bias = translators.bias.reshape((h.shape[0],) + (1,) * (h.ndim - 2) + (h.shape[-1],))
    return (h32 + moved + bias).astype(h.dtype)



# With `chunk=None`, a lens whose whole [rows, V] fp32 block fits in this many bytes is
# computed as one block; larger ones stream in DEFAULT_LENS_CHUNK-token chunks. Slicing
# W_U into chunks makes XLA copy each slice before its matmul (measured on H200, 7B
# shape: +0.7 ms per decode step, i.e. the copy of W_U; +19% on a 64-chain MCMC run),
# while a decode step's block (K·B rows: 311 MB for K = 7, B = 64, V = 152k) stays far
# below its KV cache; prefills and teacher-forced scoring of many positions still
# stream, which bounds their memory to one chunk per row.
SINGLE_BLOCK_MAX_BYTES = 2**30
DEFAULT_LENS_CHUNK = 8192


def _vocab_chunks(vocab: int, chunk: int):
    """Static (start, size) pairs covering the vocabulary; the last may be shorter."""
    if chunk <= 0:
        raise ValueError(f"lens chunk size must be positive, got {chunk}")
    return [(s, min(chunk, vocab - s)) for s in range(0, vocab, chunk)]


def streamed_head(w_u: Array, h_out: Optional[Array], h_lens: Array, chunk: Optional[int] = None,
                  out_stats: bool = False, row_tile: Optional[int] = None):
    """Unembed rows while streaming the vocabulary once.

    w_u: [V, D]; h_out: [N, D] final-normed rows whose full fp32 logits are returned
    (or None); h_lens: [M, D] final-normed rows for which only entropy and top-1 are
    kept. out_stats: also return the statistics of the h_out rows (first, then h_lens's:
    N + M of each), e.g. when a lensed layer is the last one, whose rows are h_out.
    row_tile: run the whole head (matmuls and statistics) on tiles of this many rows and
    stream a fixed DEFAULT_LENS_CHUNK (batch-invariant numerics,
    `ModelConfig.batch_invariant`). Per lens row we carry the running max m, s = sum exp(z - m) and
    t = sum exp(z - m)·(z - m), so H = log s - t / s and p_top1 = 1 / s at the end; no
    [M, V] array exists, only one [N + M, chunk] block at a time (chunk=None: one
    block when it fits SINGLE_BLOCK_MAX_BYTES, else DEFAULT_LENS_CHUNK). Carrying (z - m)
    rather than z keeps the fp32 error of H independent of the logits' magnitude
    (with sum exp·z, the rounding error of s is multiplied by |m|). Logits and all
    statistics are fp32 whatever the weight dtype. Returns (logits [N, V] | None,
    entropy [M], top1 [M], top1_prob [M], logsumexp [M]). The result does not depend on `chunk`
    beyond fp32 summation order.
    """
    V = w_u.shape[0]
    if row_tile is not None:  # each tile of rows on its own, through the one-program head below
        chunk = chunk or min(V, DEFAULT_LENS_CHUNK)
        logits, kept = None, []
        if h_out is not None:  # (logits, and their rows' statistics with out_stats)
            out = row_tiled(lambda r: streamed_head(w_u, r, r[:0], chunk, out_stats)[:5 if out_stats else 1],
                            h_out, row_tile)
            logits, kept = out[0], [out[1:]] if out_stats else []
        if h_lens.shape[0]:
            kept.append(row_tiled(lambda r: streamed_head(w_u, None, r, chunk)[1:], h_lens, row_tile))
        if not kept:  # no statistics asked for
            return (logits, jnp.zeros((0,), _F32), jnp.zeros((0,), jnp.int32), jnp.zeros((0,), _F32),
                    jnp.zeros((0,), _F32))
        return (logits,) + tuple(jnp.concatenate(stat) for stat in zip(*kept))
    n_out = 0 if h_out is None else h_out.shape[0]
    rows = h_lens if h_out is None else jnp.concatenate([h_out, h_lens.astype(h_out.dtype)], 0)
    first = 0 if out_stats else n_out  # rows whose statistics are kept
    M = rows.shape[0] - first
    m = jnp.full((M,), -jnp.inf, jnp.float32)
    s = jnp.zeros((M,), jnp.float32)
    t = jnp.zeros((M,), jnp.float32)
    top = jnp.zeros((M,), jnp.int32)

    def update(carry, z, start):
        m, s, t, top = carry
        zl = z[first:]
        cmax = jnp.max(zl, axis=-1)
        carg = jnp.argmax(zl, axis=-1).astype(jnp.int32) + start
        new_m = jnp.maximum(m, cmax)
        old_scale = jnp.exp(m - new_m)  # exp(-inf) = 0 on the first chunk
        shift = jnp.where(jnp.isfinite(m), m - new_m, 0.0)  # re-centre old terms on new_m
        centred = zl - new_m[:, None]
        e = jnp.exp(centred)
        t = old_scale * (t + s * shift) + jnp.sum(e * centred, -1)
        s = s * old_scale + jnp.sum(e, -1)
        top = jnp.where(cmax > m, carg, top)  # strict: first maximum wins, as argmax
        return (new_m, s, t, top)

    if chunk is None:
        chunk = V if rows.shape[0] * V * 4 <= SINGLE_BLOCK_MAX_BYTES else DEFAULT_LENS_CHUNK

    def unembed(w):
        return jnp.einsum("nd,vd->nv", rows, w.astype(rows.dtype), preferred_element_type=jnp.float32)
    spans = _vocab_chunks(V, chunk)
    full = [sp for sp in spans if sp[1] == chunk]
    carry = (m, s, t, top)
    out_blocks = []
    if full:
        def body(carry, start):
            w = jax.lax.dynamic_slice_in_dim(w_u, start, chunk, axis=0)
            z = unembed(w)
            return update(carry, z, start), (None if h_out is None else z[:n_out])

        starts = jnp.arange(len(full), dtype=jnp.int32) * chunk
        if len(full) == 1:  # one block: no slicing of W_U, no loop
            z = unembed(w_u)
            carry, ys = update(carry, z, 0), z[None, :n_out]
        else:
            carry, ys = jax.lax.scan(body, carry, starts)  # ys: [n_full, N, chunk]
        if h_out is not None:
            out_blocks.append(jnp.transpose(ys, (1, 0, 2)).reshape(n_out, len(full) * chunk))
    if len(full) < len(spans):
        start, size = spans[-1]
        z = unembed(w_u[start:])
        carry = update(carry, z, start)
        out_blocks.append(z[:n_out])
    m, s, t, top = carry
    entropy = jnp.log(s) - t / s
    logits = None if h_out is None else jnp.concatenate(out_blocks, axis=-1)
    return logits, entropy, top, 1.0 / s, m + jnp.log(s)


# Decode steps (one token per row, with a cache) of at least this many rows compute the
# lens of live rows only (`live_rows_head`; `cfg.lens_rows`): a row whose position is
# past the cache (an idle row) has no use for its entropies. The lens GEMM is the one
# compute-bound part of a large-batch decode step (K·B rows x D x V: 0.84 TFLOP per step
# at the 7B shape, B = 128, six probed layers besides the last), and MCMC batches carry
# many idle rows (chains that finished their MH steps or their completion wait for the
# batch's longest; docs/benchmarks.md, runs 35-36).
LENS_LIVE_ROWS_MIN_BATCH = 16
# The live rows' lens runs on the smallest of this many static row counts (B/8, 2B/8,
# ..., B, each a multiple of 8) that holds them: one `lax.switch` branch per count.
LENS_ROW_GROUPS = 8


def _lens_row_counts(batch: int) -> tuple[int, ...]:
    """The static row counts of `live_rows_head` for a batch of `batch` rows."""
    step = -(-batch // LENS_ROW_GROUPS)
    step = -(-step // 8) * 8
    return tuple(range(step, batch, step)) + (batch,)


def live_rows_head(w_u: Array, h_out: Array, lensed: Array, live: Array, chunk: Optional[int],
                    out_stats: bool, row_tile: Optional[int]):
    """`streamed_head(w_u, h_out, lensed rows, ...)` with the lens rows of live rows only.

    h_out: [B, D] output rows (all rows: their logits and, with out_stats, statistics);
    lensed: [K, B, D] final-normed lens rows; live: [B] bool. The live rows' lens rows are
    gathered to the front (stable order) and the head runs on the smallest static row
    count of `_lens_row_counts(B)` that holds them, in a `lax.switch`; their statistics
    are scattered back. Returns what `streamed_head` returns for all rows, except that an
    idle row's lens statistics are NaN (top-1: -1). A live row's values are the ones of
    the full head up to the GEMM's rounding, which may depend on its row count (as it
    depends on the batch); under `row_tile` (batch-invariant numerics) they are equal bit
    for bit.
    """
    K, B, D = lensed.shape
    counts = _lens_row_counts(B)
    order = jnp.argsort(~live, stable=True).astype(jnp.int32)  # live rows first
    n_out = B if out_stats else 0
    fills = (jnp.nan, -1, jnp.nan, jnp.nan)  # entropy, top1, top1_prob, logsumexp

    def branch(count):
        def run(w_u, h_out, lensed, order, live):
            rows = order[:count]
            logits, *stats = streamed_head(w_u, h_out, lensed[:, rows].reshape(K * count, D), chunk,
                                           out_stats, row_tile)
            placed = []
            for stat, fill in zip(stats, fills):  # idle rows in the count are filled too
                lens_stat = jnp.where(live[rows], stat[n_out:].reshape(K, count), fill)
                full = jnp.full((K, B), fill, stat.dtype).at[:, rows].set(lens_stat)
                placed.append(jnp.concatenate([stat[:n_out], full.reshape(-1)]))
            return (logits, *placed)
        return run

    return switch_on_size(counts, jnp.sum(live, dtype=jnp.int32), branch, w_u, h_out, lensed, order, live)

