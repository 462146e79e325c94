"""One pure-functional decoder-only transformer for Qwen2, Qwen3 (dense) and Llama
(DeepSeek-Math, DeepSeek-R1-Distill-Llama: Llama-3 RoPE scaling).

Free functions over registered dataclass pytrees; the config is static. Shapes use
B = batch rows, T = new tokens in this call, S = cache slots, L = layers,
D = hidden size, H / Hkv = query / key-value heads, g = H / Hkv, Dh = head size,
V = vocabulary, F = MLP size, K = number of captured or lensed layers, C = KV chunk.

Positions and cache slots are the same thing: the token at position p of a row
writes its keys and values to slot p of that row and attends to slots <= p. Rows
of different lengths therefore need no left padding: right-pad each row and give
padding entries positions after the row's real tokens (keep counting; a row's
positions in one call must be increasing and contiguous). A padded entry may write
garbage into a slot, but every later real token at that position overwrites it before
any query can read it, and queries never see slots beyond their own position. A row
whose positions are all >= S (an idle row of a batch) writes nothing and reads only
slot 0 (its output is garbage, but finite; in a decode step of at least
`LENS_LIVE_ROWS_MIN_BATCH` rows its lens is not computed and its lens statistics are NaN,
unless `cfg.lens_rows` is "all").

Attention cost follows the live length. The cache is allocated for the whole
generation, but a call reads only the slots below the batch's longest live length
(one past a row's last position), so a decode step costs what the rows hold, not what
was allocated. How the number of slots read is chosen is `cfg.kv_read`:

- "loop" (the CPU default): per layer, a `lax.while_loop` over C-slot chunks
  (C = `cfg.kv_chunk`) up to the longest live length; cost exactly proportional.
- "buckets" (the default for one-token calls, i.e. decode steps, where the kernel is
  not used: accelerators without Triton, a device mesh): one
  `lax.switch` per call, around the whole layer stack, over static windows of 0, C, 2C,
  4C, ... slots and S; cost at most twice the live length. On GPUs every iteration of a
  `while_loop` whose trip count is data-dependent waits for the host (it reads the loop
  condition back), so a loop per layer would stall the device L times per step; the
  switch does it once per call. It compiles the layer stack once per window: use stacked
  layers. Calls of several tokens (prefills) "loop" under "auto": a switch reserves the
  temporary memory of its largest branch, and the [B, T, S] scores of the whole-buffer
  window made a 1024-token prefill at batch 64 (7B shape, 3072 new-token slots) ask for
  48 GiB on an H100 and fail; a prefill's few loop trips cost little.
- "kernel" (the default on GPUs for one-token calls): each layer's keys and values are
  written, then one Pallas flash-decoding kernel reads each row's own live slots
  (`decode_kernel`): no bucket rounding, no other row's length, scores kept on chip.
  Measured on an H100 at the 7B shape, batch 64 (docs/benchmarks.md, run 28): 7.7 ms per
  step against 10.1 ms with "buckets", and a fifth of the compile time.
- "all": every slot of the buffer (the cost before live-length reads, for comparisons).

Numerics: scores and softmax statistics are fp32; the probabilities are cast to the
value dtype for the P·V product, accumulated in fp32, as in HF. A block of keys gives a
partial (m = max score, l = sum exp(s - m), o = sum exp(s - m)·v) and partials are
combined in a fixed order, rescaled to the running max; the output is o / l. In the
"loop" read every chunk is a block: a chunk past a row's live length has every score at
-inf and combines as an exact identity, so a row's result does not depend on how many
chunks the batch reads (the other rows' lengths). The static reads use one window per
call, so their rounding depends on the window (fp32 differences ~1e-7 relative).

In-place cache updates. With "loop" and "all", each layer writes this call's keys and
values into the cache and then reads it back (one scatter per layer, then the reads:
XLA orders them by data dependence and updates the cache in place). Inside the
"buckets" switch the cache is only read (a branch that writes makes XLA copy the
cache), the layers attend to this call's own keys separately, and all layers' keys and
values are written after the switch in one scatter.

Layers: `params.layers` is a list (the layers are unrolled into the program) or a
stacked LayerParams (one `lax.scan`, so a new shape compiles one layer, not L); see
`params.stack_layers`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional, Sequence

import jax
import jax.numpy as jnp

from . import decode_kernel
from .config import ModelConfig
from .params import LayerParams, Params, param_shapes
from .sharding import CACHE, FFN, HEADS, HIDDEN, constrain

Array = jax.Array
_F32 = jnp.float32


def _pytree_dataclass(cls):
    cls = dataclasses.dataclass(cls)
    fields = [f.name for f in dataclasses.fields(cls)]
    return jax.tree_util.register_dataclass(cls, data_fields=fields, meta_fields=[])


@_pytree_dataclass
class KVCache:
    """Keys and values of every layer, laid out as the attention products read them
    (slots next to head size for Q·K, slots minor for P·V). In the row-major order XLA
    keeps by default this is also the layout its GPU matmuls want, so no loop that
    carries the cache (or copies its rows) needs a transpose of it per step."""

    k: Array  # [L, B, Hkv, S, Dh]
    v: Array  # [L, B, Hkv, Dh, S]

    @property
    def max_len(self) -> int:
        return self.k.shape[3]


@_pytree_dataclass
class LensStats:
    """Logit-lens statistics of `softmax(W_U · RMSNorm_final(h_l))`, fp32."""

    entropy: Array  # [K, B, T] nats
    top1: Array  # [K, B, T] int32 argmax token
    top1_prob: Array  # [K, B, T]
    logsumexp: Array  # [K, B, T]: log of the softmax normaliser (log p(v) = z_v - logsumexp)


@_pytree_dataclass
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


@_pytree_dataclass
class ForwardOutput:
    logits: Array  # [B, T, V] fp32 (or [B, 1, V] with logits_at)
    cache: Optional[KVCache]
    residuals: Optional[Array]  # [K, B, T, D] pre-final-norm, in `capture` order
    lens: Optional[LensStats]  # stats for `lens_layers`, in that order


def init_params(cfg: ModelConfig, key: Array, dtype=jnp.bfloat16, scale: float = 0.02,
                shardings: Optional[Params] = None) -> Params:
    """Random parameters (normal(0, scale) weights, norms near 1) for tests and benchmarks,
    in the list layout (`params.stack_layers` converts).

    shardings: a Params of `jax.sharding.Sharding` (`sharding.param_shardings`): each
      tensor is drawn directly into its shards, so a model that only fits split (a 72B
      shape) never exists on one device. The values do not depend on the shardings.
    """
    shapes = param_shapes(cfg)
    leaves, treedef = jax.tree.flatten(shapes, is_leaf=lambda x: isinstance(x, tuple))
    placements = [None] * len(leaves) if shardings is None else treedef.flatten_up_to(shardings)
    keys = jax.random.split(key, len(leaves))
    out = []
    for k, shape, placement in zip(keys, leaves, placements):
        # Scaled eagerly (op by op, keeping the placement): fused into one jitted draw,
        # XLA would contract scale and 1 + into multiply-adds and change fp32 values.
        x = scale * _normal(shape, placement)(k)
        out.append((1.0 + x if len(shape) == 1 else x).astype(dtype))  # 1-D: norms, biases
    return jax.tree.unflatten(treedef, out)


@functools.cache
def _normal(shape: tuple[int, ...], sharding):
    """A jitted fp32 normal draw placed on `sharding` (None: the default device)."""
    return jax.jit(functools.partial(jax.random.normal, shape=shape, dtype=_F32),
                   out_shardings=sharding)


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.bfloat16) -> KVCache:
    """An empty cache (see KVCache; split by row and head under a mesh). Under
    `cfg.batch_invariant` the slots are rounded up to a multiple of `cfg.kv_chunk`, so that
    every chunk read starts at a multiple of it whatever the buffer asked for (the extra
    slots are never visible)."""
    L, H, Dh = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
    if cfg.batch_invariant:
        max_len = -(-max_len // cfg.kv_chunk) * cfg.kv_chunk
    return KVCache(k=constrain(jnp.zeros((L, batch, H, max_len, Dh), dtype), CACHE),
                   v=constrain(jnp.zeros((L, batch, H, Dh, max_len), dtype), CACHE))


def rms_norm(x: Array, weight: Array, eps: float) -> Array:
    """HF Qwen2/Llama RMSNorm: normalise in fp32, cast back, then multiply by the weight."""
    x32 = x.astype(_F32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * x32.astype(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> Array:
    """[Dh/2] fp32 inverse frequencies of the rotary embedding, with Llama-3 scaling when
    `cfg.rope_scaling` is set (the same fp32 arithmetic as HF `_compute_llama3_parameters`)."""
    dh = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (jnp.arange(0, dh, 2, dtype=_F32) / dh))
    scaling = cfg.rope_scaling
    if scaling is None:
        return inv_freq
    original = scaling.original_max_position_embeddings
    wavelen = 2 * jnp.pi / inv_freq
    low_freq_wavelen = original / scaling.low_freq_factor
    high_freq_wavelen = original / scaling.high_freq_factor
    scaled = jnp.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (original / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return jnp.where(medium, smoothed, scaled)


def _rope(x: Array, positions: Array, inv_freq: Array) -> Array:
    """Rotary embedding, HF `rotate_half` layout. x: [B, T, heads, Dh], positions: [B, T]
    (or any leading axes, the same for both),
    inv_freq: [Dh/2] (`rope_inv_freq`).

    Angles are computed in fp32 (bf16 positions lose integers above 256), then cos/sin
    are cast to x's dtype before the multiply, as HF does.
    """
    dh = x.shape[-1]
    angles = positions.astype(_F32)[..., None] * inv_freq  # [B, T, Dh/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[..., None, :]  # [B, T, 1, Dh]
    cos, sin = jnp.cos(angles).astype(x.dtype), jnp.sin(angles).astype(x.dtype)
    x1, x2 = x[..., : dh // 2], x[..., dh // 2:]
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return x * cos + rotated * sin


# ----------------------------------------------------------------------------- attention

@_pytree_dataclass
class SoftmaxState:
    """A partial softmax-weighted sum over some keys, per query (fp32).

    m: running max score (-inf: no visible key yet); l: sum of exp(score - m);
    o: sum of exp(score - m) · v. The attention output is o / l."""

    m: Array  # [B, Hkv, g, T]
    l: Array  # [B, Hkv, g, T]
    o: Array  # [B, Hkv, g, T, Dh]


def _partial_softmax(scores: Array, values: Array) -> SoftmaxState:
    """Partials over the last (key) axis. scores: [..., keys] fp32 with -inf at invisible
    keys: [B, Hkv, g, T, keys]; values: [B, Hkv, Dh, keys]. An all-invisible block gives
    m = -inf, l = 0, o = 0 (not NaN)."""
    m = jnp.max(scores, axis=-1)
    p = jnp.exp(scores - jnp.where(jnp.isfinite(m), m, 0.0)[..., None])
    o = jnp.einsum("bkgts,bkds->bkgtd", p.astype(values.dtype), values, preferred_element_type=_F32)
    return SoftmaxState(m=m, l=jnp.sum(p, axis=-1), o=o)


def _combine(a: SoftmaxState, b: SoftmaxState) -> SoftmaxState:
    """The partial over both key sets. Exact identity when b saw no visible key
    (b.m = -inf: a's terms are scaled by exp(0) = 1 and b's by exp(-inf) = 0)."""
    m = jnp.maximum(a.m, b.m)
    shift = jnp.where(jnp.isfinite(m), m, 0.0)
    scale_a, scale_b = jnp.exp(a.m - shift), jnp.exp(b.m - shift)
    return SoftmaxState(m=m, l=scale_a * a.l + scale_b * b.l,
                        o=scale_a[..., None] * a.o + scale_b[..., None] * b.o)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["cache", "live", "chunks"],
                   meta_fields=["window", "chunk", "deferred", "row_tile", "kernel"])
@dataclasses.dataclass(frozen=True)
class _CacheRead:
    """How one call reads the cache. `live` [B] int32: each row reads slots below it.
    Either `window` > 0 (static): the first `window` slots are read as one block; or
    `chunks` (a traced scalar): that many C-slot chunks (C = `chunk`) are read one by
    one in a `while_loop`; or `kernel`: one-token queries read each row's own live
    slots in the Pallas decode kernel (`decode_kernel`).

    Two orders of reading and writing, picked for XLA to keep the cache update in place
    (no copy of the cache per step): by default each layer writes this call's keys and
    values first and then reads (live = one past the row's last position); with
    `deferred` (the "buckets" read, whose layer stack sits inside a `lax.switch` that
    must not write), layers only read the slots below the row's first position, attend
    to this call's own keys separately, and all layers are written after the switch."""

    cache: KVCache
    live: Array
    window: int = 0
    chunks: Optional[Array] = None
    chunk: int = 0
    deferred: bool = False
    row_tile: int = 0  # > 0: chunks read for tiles of this many rows at a time (batch-invariant numerics)
    kernel: bool = False


def _masked_partial(qg: Array, keys: Array, values: Array, visible: Array, scale: float) -> SoftmaxState:
    """The partial softmax of queries qg [B, Hkv, g, T, Dh] over keys [B, Hkv, n, Dh] and
    values [B, Hkv, Dh, n], of which `visible` [B, T, n] are seen."""
    scores = jnp.einsum("bkgtd,bksd->bkgts", qg, keys.astype(qg.dtype), preferred_element_type=_F32) * scale
    return _partial_softmax(jnp.where(visible[:, None, None], scores, -jnp.inf), values.astype(qg.dtype))


def _visible(slots: Array, positions: Array, live: Array) -> Array:
    """[B, T, n]: slot s is visible to the query at position p of row b iff s <= p and
    s < live[b] (the second only matters for idle rows)."""
    return (slots[None, None] <= positions[:, :, None]) & (slots[None, None] < live[:, None, None])


def _cache_window(qg: Array, positions: Array, read: _CacheRead, layer, scale: float) -> SoftmaxState:
    """One partial over the first `read.window` slots of layer `layer` (static window)."""
    cache, W = read.cache, read.window
    L, B, Hkv, S, Dh = cache.k.shape
    k = jax.lax.dynamic_slice(cache.k, (layer, 0, 0, 0, 0), (1, B, Hkv, W, Dh))[0]
    v = jax.lax.dynamic_slice(cache.v, (layer, 0, 0, 0, 0), (1, B, Hkv, Dh, W))[0]
    return _masked_partial(qg, k, v, _visible(jnp.arange(W), positions, read.live), scale)


def _cache_chunks(qg: Array, positions: Array, read: _CacheRead, layer, scale: float
                  ) -> tuple[SoftmaxState, KVCache]:
    """Partials of chunks 0 .. read.chunks - 1 (traced count) of layer `layer`, combined in
    order in a `while_loop`. A chunk reaching past S has its start moved back to S - C and
    its already-covered slots masked. The cache travels through the loop's carry and is
    returned (unchanged), so that the next layer's in-place write follows the read (as a
    loop constant, XLA copies it for each loop)."""
    L, B, Hkv, S, Dh = read.cache.k.shape
    tile = read.row_tile
    if tile:  # the same program for every tile of rows, whatever B: a lax.map over tiles
        pad = -B % tile + (tile if B <= tile else 0)  # >= 2 trips: XLA inlines a 1-trip loop
        padded = lambda a, fill: jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1), constant_values=fill)
        tiles = lambda a: a.reshape((-1, tile) + a.shape[1:])
        rows = jnp.minimum(jnp.arange(B + pad), B - 1)  # padding rows re-read the last row; dropped

        def one_tile(args):
            return _cache_chunks_rows(*args, read, layer, scale)[0]

        state = jax.lax.map(one_tile, (tiles(padded(qg, 0)), tiles(padded(positions, 0)),
                                       tiles(padded(read.live, 1)), tiles(rows)))
        return jax.tree.map(lambda a: a.reshape((-1,) + a.shape[2:])[:B], state), read.cache
    return _cache_chunks_rows(qg, positions, read.live, None, read, layer, scale)


def _cache_chunks_rows(qg, positions, live, rows: Optional[Array], read: _CacheRead, layer, scale: float):
    """`_cache_chunks` for the cache rows `rows` ([n] int32, one per row of qg), or for
    every row (None)."""
    C = read.chunk
    L, B, Hkv, S, Dh = read.cache.k.shape
    n, G, T = qg.shape[0], qg.shape[2], qg.shape[3]

    def body(c, carry):
        state, cache = carry
        lo = c * C
        start = jnp.minimum(lo, S - C)
        if rows is None:
            k = jax.lax.dynamic_slice(cache.k, (layer, 0, 0, start, 0), (1, B, Hkv, C, Dh))[0]
            v = jax.lax.dynamic_slice(cache.v, (layer, 0, 0, 0, start), (1, B, Hkv, Dh, C))[0]
        else:  # one gather of each row's chunk, indexed over (layer, row) as one axis: a row
            # index into a 1-row cache would be folded to a constant, and XLA then compiled
            # the value product with another layout (1 ulp in float32, measured on CPU)
            flat_k, flat_v = cache.k.reshape(L * B, Hkv, S, Dh), cache.v.reshape(L * B, Hkv, Dh, S)
            k = jax.vmap(lambda r: jax.lax.dynamic_slice(flat_k, (layer * B + r, 0, start, 0), (1, Hkv, C, Dh))[0])(rows)
            v = jax.vmap(lambda r: jax.lax.dynamic_slice(flat_v, (layer * B + r, 0, 0, start), (1, Hkv, Dh, C))[0])(rows)
        slots = start + jnp.arange(C)
        visible = _visible(slots, positions, live) & (slots >= lo)[None, None]  # earlier chunks' slots
        return _combine(state, _masked_partial(qg, k, v, visible, scale)), cache

    empty = SoftmaxState(m=jnp.full((n, Hkv, G, T), -jnp.inf, _F32), l=jnp.zeros((n, Hkv, G, T), _F32),
                         o=jnp.zeros((n, Hkv, G, T, Dh), _F32))
    return jax.lax.fori_loop(0, read.chunks, body, (empty, read.cache))


def _kernel_read(qg: Array, read: _CacheRead, layer, scale: float) -> SoftmaxState:
    """The partial of one-token queries qg [B, Hkv, g, 1, Dh] over each row's live slots
    of layer `layer`, from the decode kernel's pieces (`decode_kernel.merge_pieces`).
    Off GPUs the kernel runs in Pallas' interpreter (tests)."""
    o, m, l = decode_kernel.merge_pieces(*decode_kernel.decode_partials(
        qg[:, :, :, 0], read.cache.k, read.cache.v, layer, read.live, scale,
        interpret=jax.default_backend() != "gpu"))
    return SoftmaxState(m=m[..., None], l=l[..., None], o=o[:, :, :, None])


def _attention(q: Array, k: Array, v: Array, positions: Array, read: Optional[_CacheRead],
               layer) -> tuple[Array, Optional[_CacheRead]]:
    """Grouped-query causal attention by position.

    q: [B, T, H, Dh]; k, v: [B, T, Hkv, Dh] this call's keys and values; positions:
    [B, T]. Without a cache the keys are this call's; with one, the cache slots below each
    row's live length (which already hold k, v unless `read.deferred`; then this call's
    keys are attended to separately, after the cache). Returns ([B, T, H, Dh], read with
    the cache as it came out of the chunk loop).
    """
    B, T, H, Dh = q.shape
    hkv = k.shape[2]
    scale = Dh ** -0.5
    qg = q.reshape(B, T, hkv, H // hkv, Dh).transpose(0, 2, 3, 1, 4)  # [B, Hkv, g, T, Dh]
    if read is None or read.deferred:
        visible = positions[:, None, :] <= positions[:, :, None]  # [B, T(query), T(key)]
        state = _masked_partial(qg, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 3, 1), visible, scale)
        if read is not None and read.window:  # cache slots below the first position, then own keys
            state = _combine(_cache_window(qg, positions, read, layer, scale), state)
    elif read.kernel:
        state = _kernel_read(qg, read, layer, scale)
    elif read.chunks is not None:
        state, cache = _cache_chunks(qg, positions, read, layer, scale)
        read = dataclasses.replace(read, cache=cache)
    else:
        state = _cache_window(qg, positions, read, layer, scale)
    out = state.o / state.l[..., None]  # [B, Hkv, g, T, Dh]
    return out.transpose(0, 3, 1, 2, 4).reshape(B, T, H, Dh).astype(q.dtype), read


def _write(cache: KVCache, layer, positions: Array, k: Array, v: Array) -> KVCache:
    """Write new keys and values at their positions, in place: one layer's ([B, T, Hkv, Dh])
    or, with layer = slice(None), every layer's ([B, T, L, Hkv, Dh]). Positions past the
    cache (idle rows) write nothing."""
    rows = jnp.broadcast_to(jnp.arange(positions.shape[0])[:, None], positions.shape)
    # The indexed (row, slot) pairs come first in the updated slice, for both layouts.
    return KVCache(
        k=constrain(cache.k.at[layer, rows, :, positions].set(k.astype(cache.k.dtype), mode="drop"), CACHE),
        v=constrain(cache.v.at[layer, rows, :, :, positions].set(v.astype(cache.v.dtype), mode="drop"), CACHE))


# ----------------------------------------------------------------------------- layers

def row_tiled(fn, x, tile: Optional[int]):
    """fn over the rows of x, `tile` rows at a time (None: fn(x) at once). x: an array
    whose rows are all its axes but the last, or a tuple of arrays that share those
    leading axes (the first array's all-but-last, e.g. (residuals [B, T, D], positions
    [B, T])); fn maps tiles ([n, ...] each; a tuple for a tuple) to a pytree of [n, ...],
    row by row. Rows are padded with zeros to a multiple of `tile` and the tiles run in a
    `lax.map`, so fn is compiled for `tile` rows only: the same kernels, hence the same
    reduction orders, whatever the number of rows. At least two tiles run: a loop of one
    trip is inlined by XLA and fused with its neighbours (other numerics at one row,
    measured on CPU)."""
    if tile is None:
        return fn(x)
    arrays = x if isinstance(x, tuple) else (x,)
    lead = arrays[0].shape[:-1]
    n = math.prod(lead)
    pad = -n % tile + (tile if n <= tile else 0)  # >= 2 tiles: XLA inlines a 1-trip loop
    tiles = tuple(jnp.pad(a.reshape((n,) + a.shape[len(lead):]), [(0, pad)] + [(0, 0)] * (a.ndim - len(lead)))
                  .reshape((-1, tile) + a.shape[len(lead):]) for a in arrays)
    out = jax.lax.map(lambda t: fn(t if isinstance(x, tuple) else t[0]), tiles)
    return jax.tree.map(lambda o: o.reshape((-1,) + o.shape[2:])[:n].reshape(lead + o.shape[2:]), out)


def _tile(cfg: ModelConfig) -> Optional[int]:
    """Rows per tile under `cfg.batch_invariant` (its `row_tile`, None: by backend), else None."""
    if not cfg.batch_invariant:
        return None
    if cfg.row_tile is not None:
        return cfg.row_tile
    return 8 if jax.default_backend() == "cpu" else 64


def _attention_inputs(layer: LayerParams, cfg: ModelConfig, x: Array, positions: Array, inv_freq: Array):
    """Per token (any leading axes, those of `positions`): the attention norm of the
    residual x [..., D], its projections (with biases), Qwen3's q/k norms and RoPE.
    Returns q [..., H, Dh], k and v [..., Hkv, Dh]."""
    lead = x.shape[:-1]
    h = rms_norm(x, layer.attn_norm, cfg.rms_norm_eps)
    q, k, v = h @ layer.q, h @ layer.k, h @ layer.v
    if cfg.qkv_bias:
        q, k, v = q + layer.q_bias, k + layer.k_bias, v + layer.v_bias
    q = q.reshape(lead + (cfg.num_heads, cfg.head_dim))
    k = k.reshape(lead + (cfg.num_kv_heads, cfg.head_dim))
    v = v.reshape(lead + (cfg.num_kv_heads, cfg.head_dim))
    if cfg.qk_norm:  # Qwen3: RMSNorm over each head's Dh entries, before RoPE
        q, k = rms_norm(q, layer.q_norm, cfg.rms_norm_eps), rms_norm(k, layer.k_norm, cfg.rms_norm_eps)
    return _rope(q, positions, inv_freq), _rope(k, positions, inv_freq), v


def _block_output(layer: LayerParams, cfg: ModelConfig, x: Array, attn: Array, shard: bool = True) -> Array:
    """Per token: x + attn·W_o, then the MLP and its residual. x [..., D], attn [..., H·Dh].
    shard: pin the [B, T, ...] layouts under a mesh (off for row tiles)."""
    pin = constrain if shard else (lambda a, spec: a)
    x = pin(x + attn @ layer.o, HIDDEN)
    h = rms_norm(x, layer.mlp_norm, cfg.rms_norm_eps)
    hidden = pin(jax.nn.silu(h @ layer.gate) * (h @ layer.up), FFN)
    return pin(x + hidden @ layer.down, HIDDEN)


def _block(layer: LayerParams, cfg: ModelConfig, x: Array, positions: Array,
           read: Optional[_CacheRead], index, inv_freq: Array):
    """Block `index` (0-based; static, or traced inside a scan), pre-norm. x: [B, T, D].
    With a cache, this call's keys and values are written at layer `index` first (one
    scatter, in place), then read back with the rest (unless `read.deferred`). Under
    `cfg.batch_invariant` everything runs on fixed tiles of rows: norms, projections,
    RoPE and MLP through `row_tiled`, the attention's cache reads in `_cache_chunks`.
    Returns (x, read, (k, v) [B, T, Hkv, Dh])."""
    B, T, _ = x.shape
    tile = _tile(cfg)
    with jax.named_scope("attention"):
        q, k, v = row_tiled(lambda xs: _attention_inputs(layer, cfg, *xs, inv_freq), (x, positions), tile)
        q, k, v = constrain(q, HEADS), constrain(k, HEADS), constrain(v, HEADS)
        if read is not None and not read.deferred:
            read = dataclasses.replace(read, cache=_write(read.cache, index, positions, k, v))
        attn, read = _attention(q, k, v, positions, read, index)
    with jax.named_scope("mlp"):
        attn = attn.reshape(B, T, -1)
        if tile is None:
            x = _block_output(layer, cfg, x, attn)
        else:
            x = constrain(row_tiled(lambda xs: _block_output(layer, cfg, *xs, shard=False), (x, attn), tile), HIDDEN)
    return x, read, (k, v)


def _layer_stack(layers, cfg: ModelConfig, x: Array, positions: Array, read: Optional[_CacheRead],
                 keep: tuple[int, ...], remat: bool = False):
    """Every block in order. keep: sorted static layer indices in 1..L whose outputs are
    returned ([len(keep), B, T, D]); remat: recompute each block in the backward pass
    (`jax.checkpoint`). Returns (x, kept | None, cache | None, and with a deferred read the
    keys and values of every layer, [L, B, T, Hkv, Dh] each, else None)."""
    inv_freq = rope_inv_freq(cfg)
    deferred = read is not None and read.deferred
    if not isinstance(layers, LayerParams):  # list layout: unrolled
        block = jax.checkpoint(_block, static_argnums=(1, 5)) if remat else _block
        kept, kvs = [], []
        for l, layer in enumerate(layers):
            with jax.named_scope(f"block_{l}"):
                x, read, kv = block(layer, cfg, x, positions, read, l, inv_freq)
            if deferred:
                kvs.append(kv)
            if l + 1 in keep:
                kept.append(x)
        kvs = tuple(jnp.stack(a) for a in zip(*kvs)) if deferred else None
        return x, (jnp.stack(kept) if keep else None), None if read is None else read.cache, kvs

    # Stacked layout: one scan carrying the cache; kept outputs go to their slot of a
    # carried buffer (slot len(keep) collects the others and is dropped).
    slot_of = [len(keep)] * (cfg.num_layers + 1)
    for i, l in enumerate(keep):
        slot_of[l] = i
    slots = jnp.asarray(slot_of[1:], jnp.int32)
    kept = jnp.zeros((len(keep) + 1,) + x.shape, x.dtype) if keep else None
    block = jax.checkpoint(_block, static_argnums=(1,)) if remat else _block

    def body(carry, layer_index):
        x, kept, cache = carry
        layer, l = layer_index
        with jax.named_scope("block"):
            x, r, kv = block(layer, cfg, x, positions,
                              None if read is None else dataclasses.replace(read, cache=cache), l, inv_freq)
        if kept is not None:
            kept = jax.lax.dynamic_update_index_in_dim(kept, x, slots[l], 0)
        return (x, kept, None if r is None else r.cache), kv if deferred else None

    cache = None if read is None else read.cache
    (x, kept, cache), kvs = jax.lax.scan(body, (x, kept, cache), (layers, jnp.arange(cfg.num_layers)))
    return x, (kept[:-1] if keep else None), cache, kvs


def _live_lengths(positions: Array, max_len: int, deferred: bool) -> Array:
    """[B] slots each row reads from the cache: one past its last position in the call,
    capped at the buffer (below its first position if `deferred`), or 1 for a row whose
    positions are all past the cache (an idle row: it writes nothing, and slot 0 keeps
    its softmax finite)."""
    first, last = jnp.min(positions, axis=1), jnp.max(positions, axis=1)
    live = first if deferred else jnp.minimum(last + 1, max_len)
    return jnp.where(first < max_len, live, 1).astype(jnp.int32)


def _window_buckets(max_len: int, chunk: int) -> tuple[int, ...]:
    """Static windows of the "buckets" read: 0, C·2^i slots, up to the whole cache."""
    windows, n = [0], chunk
    while n < max_len:
        windows.append(n)
        n *= 2
    return tuple(windows) + (max_len,)


def _read_mode(cfg: ModelConfig, tokens: int, slots: int) -> str:
    """The cache read of a call of `tokens` tokens per row into a `slots`-slot cache
    (module docstring)."""
    if cfg.batch_invariant:  # fixed chunks in a fixed order, whatever the other rows
        return "loop"
    if cfg.kv_read == "kernel":
        return "kernel" if tokens == 1 else "loop"
    if cfg.kv_read != "auto":
        return cfg.kv_read
    backend = jax.default_backend()
    if tokens != 1 or backend == "cpu":
        return "loop"
    if backend == "gpu" and decode_kernel.supported(cfg.head_dim, slots) and not _under_mesh():
        return "kernel"
    return "buckets"


def _under_mesh() -> bool:
    """Tracing under a device mesh: the kernel is one custom call, which XLA cannot split
    over devices (it would gather the cache), so "auto" reads with "buckets" there."""
    return not jax.sharding.get_abstract_mesh().empty


def _run_layers(layers, cfg: ModelConfig, x: Array, positions: Array, cache: Optional[KVCache],
                keep: tuple[int, ...], remat: bool = False):
    """The layer stack with the cache read as `cfg.kv_read` says (module docstring).
    Returns (x, kept, cache). remat (training, no cache): see `_layer_stack`."""
    if cache is None:
        return _layer_stack(layers, cfg, x, positions, None, keep, remat)[:3]
    if remat:
        raise ValueError("remat recomputes blocks for a backward pass; run it without a KV cache")
    S = cache.max_len
    mode = _read_mode(cfg, x.shape[1], S)
    live = _live_lengths(positions, S, deferred=mode == "buckets")
    if mode == "all":
        return _layer_stack(layers, cfg, x, positions, _CacheRead(cache, live, window=S), keep)[:3]
    if mode == "kernel":
        return _layer_stack(layers, cfg, x, positions, _CacheRead(cache, live, kernel=True), keep)[:3]
    C = cfg.kv_chunk if cfg.batch_invariant and S % cfg.kv_chunk == 0 else min(cfg.kv_chunk, S)
    if mode == "loop":
        chunks = (jnp.max(live) + C - 1) // C
        read = _CacheRead(cache, live, chunks=chunks, chunk=C, row_tile=_tile(cfg) or 0)
        return _layer_stack(layers, cfg, x, positions, read, keep)[:3]
    windows = _window_buckets(S, C)

    def branch(window):
        def run(layers, x, positions, cache, live):
            read = _CacheRead(cache, live, window=window, deferred=True)
            x, kept, _, (ks, vs) = _layer_stack(layers, cfg, x, positions, read, keep)
            return x, kept, ks, vs
        return run

    x, kept, ks, vs = _switch_on_size(windows, jnp.max(live), branch, layers, x, positions, cache, live)
    # Every layer's keys and values at once, after every read (the switch's outputs).
    return x, kept, _write(cache, slice(None), positions, ks.transpose(1, 2, 0, 3, 4), vs.transpose(1, 2, 0, 3, 4))


# ----------------------------------------------------------------------------- output head

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
# lens of live rows only (`_live_rows_head`; `cfg.lens_rows`): a row whose position is
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
    """The static row counts of `_live_rows_head` for a batch of `batch` rows."""
    step = -(-batch // LENS_ROW_GROUPS)
    step = -(-step // 8) * 8
    return tuple(range(step, batch, step)) + (batch,)


def _live_rows_head(w_u: Array, h_out: Array, lensed: Array, live: Array, chunk: Optional[int],
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

    return _switch_on_size(counts, jnp.sum(live, dtype=jnp.int32), branch, w_u, h_out, lensed, order, live)


def _switch_on_size(sizes: Sequence[int], needed: Array, branch, *operands):
    """`branch(size)(*operands)` for the smallest of the increasing static `sizes` that is
    at least the traced `needed` (at most sizes[-1]), in one `lax.switch`."""
    index = jnp.searchsorted(jnp.asarray(sizes, jnp.int32), needed, side="left")
    return jax.lax.switch(index, [branch(size) for size in sizes], *operands)


# A multi-token call with a cache of more than this many tokens (rows x tokens per row)
# runs in `kv_chunk`-token chunks (`_forward_in_chunks`), which bounds a prefill's
# temporaries: at the 7B shape one call of 128 rows x 1024 tokens asked for a 61.8 GiB
# temporary and did not fit an 80 GB H100 (docs/benchmarks.md), 64 x 1024 did.
CHUNKED_PREFILL_TOKENS = 65536


def _forward_in_chunks(params: Params, cfg: ModelConfig, tokens: Array, positions: Array, cache: KVCache,
                       capture, lens_layers, lens_chunk, logits_at, lens_translators) -> ForwardOutput:
    """`forward` of a multi-token call under `cfg.batch_invariant` or of more than
    CHUNKED_PREFILL_TOKENS tokens: the tokens run in chunks of `cfg.kv_chunk` (a
    `lax.scan` carrying the cache), so that every program sees [B, kv_chunk] tokens
    whatever the batch's longest prompt, and holds one chunk's temporaries. Under batch
    invariance that is the point: one call of T tokens would compile its attention
    products for that T, and a row's numerics would depend on the longest prompt it is
    padded to (measured on CPU: 4e-5 in float32). The last
    chunk is padded with positions past each row's last one: their keys land in slots
    no query of this call sees (the slots beyond a right-padded prompt already hold
    padding), or past the buffer, where writes are dropped."""
    B, T = tokens.shape
    C = cfg.kv_chunk
    n = max(2, -(-T // C))  # >= 2 trips: XLA inlines a loop of one trip, with other numerics
    pad = n * C - T
    step = jnp.arange(1, pad + 1, dtype=positions.dtype)[None]
    tokens = jnp.concatenate([tokens, jnp.zeros((B, pad), tokens.dtype)], axis=1)
    positions = jnp.concatenate([positions, positions[:, -1:] + step], axis=1)
    split = lambda a: a.reshape(B, n, C).swapaxes(0, 1)

    def chunk(cache, inputs):
        tokens_c, positions_c, c = inputs
        at = None if logits_at is None else jnp.clip(logits_at - c * C, 0, C - 1)
        out = _forward_call(params, cfg, tokens_c, positions_c, cache, capture, lens_layers, lens_chunk, at,
                            lens_translators, False)
        return out.cache, dataclasses.replace(out, cache=None)

    cache, outs = jax.lax.scan(chunk, cache, (split(tokens), split(positions), jnp.arange(n)))
    joined = lambda a, axis: jnp.moveaxis(a, 0, axis).reshape(a.shape[1:axis + 1] + (n * C,) + a.shape[axis + 2:])[
        (slice(None),) * axis + (slice(0, T),)]  # [n, ..., C, ...] -> [..., T, ...] (T at `axis`)
    if logits_at is None:
        logits = joined(outs.logits, 1)
    else:  # [n, B, 1, V]: each chunk's logits at its clipped index; keep the chunk holding logits_at
        logits = jnp.take_along_axis(outs.logits, (logits_at // C)[None, :, None, None], axis=0)[0]
    lens = None if outs.lens is None else jax.tree.map(lambda a: joined(a, 2), outs.lens)
    residuals = None if outs.residuals is None else joined(outs.residuals, 2)
    return ForwardOutput(logits=logits, cache=cache, residuals=residuals, lens=lens)


@functools.partial(jax.jit, static_argnames=("cfg", "capture", "lens_layers", "lens_chunk", "remat"))
def forward(params: Params, cfg: ModelConfig, tokens: Array, positions: Array,
            cache: Optional[KVCache] = None, capture: tuple[int, ...] = (),
            lens_layers: tuple[int, ...] = (), lens_chunk: Optional[int] = None,
            logits_at: Optional[Array] = None,
            lens_translators: Optional[LensTranslators] = None,
            remat: bool = False) -> ForwardOutput:
    """Run the transformer on `tokens`.

    tokens, positions: [B, T] int32 (see the module docstring for padding).
    cache: a KVCache with S slots, read below each row's first position and updated at
      `positions` (returned); None runs attention over the given tokens only (and
      returns cache=None).
    capture: static layer indices (HF `hidden_states` numbering: 0 = embeddings,
      l = after block l) whose residuals, pre final norm, are returned [K, B, T, D].
    lens_layers: static layer indices whose logit-lens entropy / top-1 are returned
      [K, B, T] (fused: one pass over W_U serves these and the output logits).
    lens_chunk: vocabulary chunk of the streamed lens; None picks one block for small
      (decode-sized) probes and 8192-token chunks otherwise (see streamed_head).
    logits_at: optional [B] int32 index into T; returns logits [B, 1, V] at those
      entries only (e.g. the last real prompt token of each row).
    lens_translators: optional LensTranslators with one row per `lens_layers` entry,
      applied to those residuals before the final norm (a tuned lens); None is the
      logit lens. Captured residuals and the output logits are never translated.
    remat: recompute each block in the backward pass (`jax.checkpoint`) instead of
      keeping its activations: training memory grows with the number of blocks, not
      with everything inside them.
    params.layers may be a list or stacked (`params.stack_layers`); the result is the
    same up to fp32 rounding.
    """
    L = cfg.num_layers
    for name, layers in (("capture", capture), ("lens_layers", lens_layers)):
        bad = [l for l in layers if not 0 <= l <= L]
        if bad:
            raise ValueError(f"{name} layers {bad} out of range 0..{L}")
    B, T = tokens.shape
    if cache is not None and T > 1 and not remat and (cfg.batch_invariant or B * T > CHUNKED_PREFILL_TOKENS):
        return _forward_in_chunks(params, cfg, tokens, positions, cache, capture, lens_layers, lens_chunk,
                                  logits_at, lens_translators)
    return _forward_call(params, cfg, tokens, positions, cache, capture, lens_layers, lens_chunk, logits_at,
                         lens_translators, remat)


def _forward_call(params: Params, cfg: ModelConfig, tokens: Array, positions: Array, cache: Optional[KVCache],
                  capture, lens_layers, lens_chunk, logits_at, lens_translators, remat) -> ForwardOutput:
    """`forward` as one program over the call's tokens (arguments checked there)."""
    L = cfg.num_layers
    B, T = tokens.shape
    x = constrain(params.embed[tokens], HIDDEN)
    wanted = set(capture) | set(lens_layers)
    keep = tuple(sorted(wanted - {0}))
    embeddings = x
    x, kept, cache = _run_layers(params.layers, cfg, x, positions, cache, keep, remat)
    saved = {l: kept[i] for i, l in enumerate(keep)}
    if 0 in wanted:
        saved[0] = embeddings

    with jax.named_scope("head"):
        h = x if logits_at is None else jnp.take_along_axis(x, logits_at[:, None, None], axis=1)
        final_norm = functools.partial(row_tiled, lambda r: rms_norm(r, params.final_norm, cfg.rms_norm_eps),
                                       tile=_tile(cfg))
        h = final_norm(h)
        w_u = params.unembedding()
        lens = None
        if lens_translators is not None and lens_translators.bias.shape[0] != len(lens_layers):
            raise ValueError(f"lens_translators has {lens_translators.bias.shape[0]} rows for "
                             f"{len(lens_layers)} lens_layers {lens_layers}")
        if lens_layers:
            with jax.named_scope("lens"):
                # The last layer's lens rows are the output rows (h = final norm of x at every
                # position) unless translated: computed once, their statistics taken from the
                # output rows.
                shared = L in lens_layers and logits_at is None and lens_translators is None
                others = [l for l in lens_layers if not (shared and l == L)]
                rows = [saved[l] for l in others]
                if lens_translators is not None:  # then others == lens_layers, in order
                    rows = list(translate_residuals(jnp.stack(rows), lens_translators))
                lensed = jnp.stack([final_norm(r) for r in rows]
                                   ) if others else jnp.zeros((0, B, T, h.shape[-1]), h.dtype)
                if (cfg.lens_rows == "live" and cache is not None and T == 1 and B >= LENS_LIVE_ROWS_MIN_BATCH
                        and others and not _under_mesh()):
                    flat_logits, *stats = _live_rows_head(
                        w_u, h[:, 0], lensed[:, :, 0], positions[:, 0] < cache.max_len, lens_chunk, shared,
                        _tile(cfg))
                else:
                    flat_logits, *stats = streamed_head(
                        w_u, h.reshape(-1, h.shape[-1]), lensed.reshape(len(others) * B * T, h.shape[-1]),
                        lens_chunk, out_stats=shared, row_tile=_tile(cfg))
                stats = [x.reshape(-1, B, T) for x in stats]  # [K, B, T] each, rows as listed
                order = ([L] if shared else []) + others
                index = jnp.asarray([order.index(l) for l in lens_layers])
                ent, top, ptop, lse = (x[index] for x in stats)
            logits = flat_logits.reshape(*h.shape[:2], -1)
            lens = LensStats(entropy=ent, top1=top, top1_prob=ptop, logsumexp=lse)
        else:
            logits = row_tiled(lambda r: jnp.einsum("...d,vd->...v", r, w_u, preferred_element_type=_F32), h,
                               _tile(cfg))
    residuals = jnp.stack([saved[l] for l in capture]) if capture else None
    return ForwardOutput(logits=logits, cache=cache, residuals=residuals, lens=lens)
