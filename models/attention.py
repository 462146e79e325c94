"""Attention over the KV cache of `transformer.forward`: the cache layout, the five ways a
call reads it and the softmax partials they combine.

Free functions over registered dataclass pytrees; the config is static. Shapes use
B = batch rows, T = new tokens in this call, S = cache slots, L = layers,
D = hidden size, H / Hkv = query / key-value heads, g = H / Hkv, Dh = head size,
V = vocabulary, F = MLP size, K = number of captured or lensed layers, C = KV chunk.

Attention cost follows the live length. The cache is allocated for the whole
generation, but a call reads only the slots below the batch's longest live length
(one past a row's last position), so a decode step costs what the rows hold, not what
was allocated. How the number of slots read is chosen is `cfg.kv_read`:

- "loop" (the CPU default): per layer, a `lax.while_loop` over C-slot chunks
  (C = `cfg.kv_chunk`) up to the longest live length; cost exactly proportional.
- "buckets" (the default for one-token calls, i.e. decode steps, where the kernel is
  not used: accelerators without Triton, a mesh whose axes do not split the batch
  and the KV heads evenly): one
  `lax.switch` per call, around the whole layer stack, over static windows of 0, C, 2C,
  4C, ... slots and S; cost at most twice the live length. On GPUs every iteration of a
  `while_loop` whose trip count is data-dependent waits for the host (it reads the loop
  condition back), so a loop per layer would stall the device L times per step; the
  switch does it once per call. It compiles the layer stack once per window: use stacked
  layers. Short calls of several tokens (up to SHORT_CALL_TOKENS per row: a drafted
  decode step's verification) use it too. Longer calls (prefills) "loop" under "auto": a switch reserves the
  temporary memory of its largest branch, and the [B, T, S] scores of the whole-buffer
  window made a 1024-token prefill at batch 64 (7B shape, 3072 new-token slots) ask for
  48 GiB on an H100 and fail; a prefill's few loop trips cost little.
- "kernel" (the default on GPUs for one-token calls): each layer's keys and values are
  written, then one Pallas flash-decoding kernel reads each row's own live slots
  (`decode_kernel`): no bucket rounding, no other row's length, scores kept on chip.
  Measured on an H100 at the 7B shape, batch 64 (docs/benchmarks.md, run 28): 7.7 ms per
  step against 10.1 ms with "buckets", and a fifth of the compile time. Under a
  ("data", "model") mesh it runs per device on that device's rows and KV heads
  (`jax.shard_map`; `_kernel_read`).
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
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from . import decode_kernel
from .config import ModelConfig
from .sharding import CACHE, DATA, MODEL, constrain

Array = jax.Array
_F32 = jnp.float32


@jax.tree_util.register_dataclass
@dataclasses.dataclass
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



@jax.tree_util.register_dataclass
@dataclasses.dataclass
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


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CacheRead:
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
    window: int = dataclasses.field(default=0, metadata=dict(static=True))
    chunks: Optional[Array] = None
    chunk: int = dataclasses.field(default=0, metadata=dict(static=True))
    deferred: bool = dataclasses.field(default=False, metadata=dict(static=True))
    # > 0: chunks read for tiles of this many rows at a time (batch-invariant numerics)
    row_tile: int = dataclasses.field(default=0, metadata=dict(static=True))
    kernel: bool = dataclasses.field(default=False, metadata=dict(static=True))


def _masked_partial(qg: Array, keys: Array, values: Array, visible: Array, scale: float) -> SoftmaxState:
    """The partial softmax of queries qg [B, Hkv, g, T, Dh] over keys [B, Hkv, n, Dh] and
    values [B, Hkv, Dh, n], of which `visible` [B, T, n] are seen."""
    scores = jnp.einsum("bkgtd,bksd->bkgts", qg, keys.astype(qg.dtype), preferred_element_type=_F32) * scale
    return _partial_softmax(jnp.where(visible[:, None, None], scores, -jnp.inf), values.astype(qg.dtype))


def _visible(slots: Array, positions: Array, live: Array) -> Array:
    """[B, T, n]: slot s is visible to the query at position p of row b iff s <= p and
    s < live[b] (the second only matters for idle rows)."""
    return (slots[None, None] <= positions[:, :, None]) & (slots[None, None] < live[:, None, None])


def _cache_window(qg: Array, positions: Array, read: CacheRead, layer, scale: float) -> SoftmaxState:
    """One partial over the first `read.window` slots of layer `layer` (static window)."""
    cache, W = read.cache, read.window
    L, B, Hkv, S, Dh = cache.k.shape
    k = jax.lax.dynamic_slice(cache.k, (layer, 0, 0, 0, 0), (1, B, Hkv, W, Dh))[0]
    v = jax.lax.dynamic_slice(cache.v, (layer, 0, 0, 0, 0), (1, B, Hkv, Dh, W))[0]
    return _masked_partial(qg, k, v, _visible(jnp.arange(W), positions, read.live), scale)


def _cache_chunks(qg: Array, positions: Array, read: CacheRead, layer, scale: float
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


def _cache_chunks_rows(qg, positions, live, rows: Optional[Array], read: CacheRead, layer, scale: float):
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


def _kernel_read(qg: Array, read: CacheRead, layer, scale: float) -> SoftmaxState:
    """The partial of one-token queries qg [B, Hkv, g, 1, Dh] over each row's live slots
    of layer `layer`, from the decode kernel's pieces (`decode_kernel.merge_pieces`).
    Off GPUs the kernel runs in Pallas' interpreter (tests).

    Under a ("data", "model") mesh the kernel runs once per device on its own shard
    (`jax.shard_map`): rows split over "data", KV heads over "model", the cache read
    where it lies (CACHE layout), nothing gathered. A row's pieces are then chosen from
    the per-device batch and heads (`decode_kernel.pieces_for`), so its rounding can
    differ from one device's by the order of fp32 sums (~1e-7 relative)."""
    interpret = jax.default_backend() != "gpu"

    def read_shard(q, cache_k, cache_v, layer, live):
        return decode_kernel.merge_pieces(*decode_kernel.decode_partials(
            q, cache_k, cache_v, layer, live, scale, interpret=interpret))

    args = (qg[:, :, :, 0], read.cache.k, read.cache.v, jnp.asarray(layer, jnp.int32), read.live)
    if mesh_split(qg.shape[0], qg.shape[1]) is not None:
        rows_heads = P(DATA, MODEL)
        read_shard = jax.shard_map(
            read_shard, in_specs=(rows_heads, CACHE, CACHE, P(), P(DATA)),
            out_specs=(rows_heads, rows_heads, rows_heads), check_vma=False)
    o, m, l = read_shard(*args)
    return SoftmaxState(m=m[..., None], l=l[..., None], o=o[:, :, :, None])


def attend(q: Array, k: Array, v: Array, positions: Array, read: Optional[CacheRead],
               layer) -> tuple[Array, Optional[CacheRead]]:
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


def write_kv(cache: KVCache, layer, positions: Array, k: Array, v: Array) -> KVCache:
    """Write new keys and values at their positions, in place: one layer's ([B, T, Hkv, Dh])
    or, with layer = slice(None), every layer's ([B, T, L, Hkv, Dh]). Positions past the
    cache (idle rows) write nothing."""
    rows = jnp.broadcast_to(jnp.arange(positions.shape[0])[:, None], positions.shape)
    # The indexed (row, slot) pairs come first in the updated slice, for both layouts.
    return KVCache(
        k=constrain(cache.k.at[layer, rows, :, positions].set(k.astype(cache.k.dtype), mode="drop"), CACHE),
        v=constrain(cache.v.at[layer, rows, :, :, positions].set(v.astype(cache.v.dtype), mode="drop"), CACHE))



def live_lengths(positions: Array, max_len: int, deferred: bool) -> Array:
    """[B] slots each row reads from the cache: one past its last position in the call,
    capped at the buffer (below its first position if `deferred`), or 1 for a row whose
    positions are all past the cache (an idle row: it writes nothing, and slot 0 keeps
    its softmax finite)."""
    first, last = jnp.min(positions, axis=1), jnp.max(positions, axis=1)
    live = first if deferred else jnp.minimum(last + 1, max_len)
    return jnp.where(first < max_len, live, 1).astype(jnp.int32)


def window_buckets(max_len: int, chunk: int) -> tuple[int, ...]:
    """Static windows of the "buckets" read: 0, C·2^i slots, up to the whole cache."""
    windows, n = [0], chunk
    while n < max_len:
        windows.append(n)
        n *= 2
    return tuple(windows) + (max_len,)


# Calls of 2 .. this many tokens per row (the verification forwards of drafted decode
# steps, `generation.drafted_decode_step`) read the cache with "buckets" on accelerators,
# as decode steps do where the kernel cannot run: a per-layer loop waits for the host at
# every trip, and measured on an H200 at the 1.5B shape, batch 1, a step of 5 tokens per row
# cost 3.1x a one-token step with it (docs/benchmarks.md). Their [B, T, S] scores are
# small (T <= 32); longer calls (prefills) loop.
SHORT_CALL_TOKENS = 32


def read_mode(cfg: ModelConfig, tokens: int, slots: int, batch: int) -> str:
    """The cache read of a call of `tokens` tokens per row for `batch` rows into a
    `slots`-slot cache (module docstring)."""
    if cfg.batch_invariant:  # fixed chunks in a fixed order, whatever the other rows
        return "loop"
    if cfg.kv_read == "kernel":
        return "kernel" if tokens == 1 else "loop"
    if cfg.kv_read != "auto":
        return cfg.kv_read
    backend = jax.default_backend()
    if backend == "cpu" or tokens > SHORT_CALL_TOKENS:
        return "loop"
    if tokens > 1:
        return "buckets"
    if (backend == "gpu" and decode_kernel.supported(cfg.head_dim, slots)
            and (not under_mesh() or mesh_split(batch, cfg.num_kv_heads) is not None)):
        return "kernel"
    return "buckets"


def under_mesh() -> bool:
    """Tracing under a device mesh."""
    return not jax.sharding.get_abstract_mesh().empty


def mesh_split(batch: int, kv_heads: int) -> Optional[tuple[int, int]]:
    """(data, model) sizes of the ambient ("data", "model") mesh when `batch` rows and
    `kv_heads` heads split evenly over them, so that the decode kernel can run per shard
    (`jax.shard_map` needs whole shards); None without such a mesh or when they do not
    (then "auto" reads with "buckets": one custom call over the whole cache would make
    XLA gather it onto every device)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not {DATA, MODEL} <= set(mesh.axis_names):
        return None
    data, model = mesh.shape[DATA], mesh.shape[MODEL]
    return (data, model) if batch % data == 0 and kv_heads % model == 0 else None
