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

Layers: `params.layers` is a list (the layers are unrolled into the program) or a
stacked LayerParams (one `lax.scan`, so a new shape compiles one layer, not L); see
`params.stack_layers`.

The pieces live beside this file, one concern each: `attention` (the KV cache and how a
call reads it: the five read modes, the softmax partials), `lens_head` (the output head
and the fused, streamed lens) and `degs_jax.tiling` (fixed row tiles and static-size
switches, shared with the samplers).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp

from ..tiling import row_tiled, switch_on_size
from .attention import (CacheRead, KVCache, attend, init_cache, live_lengths, read_mode, under_mesh,
                        window_buckets, write_kv)
from .config import ModelConfig
from .lens_head import (LENS_LIVE_ROWS_MIN_BATCH, LensStats, LensTranslators, live_rows_head, streamed_head,
                        translate_residuals)
from .params import LayerParams, Params, param_shapes
from .sharding import FFN, HEADS, HIDDEN, constrain

Array = jax.Array
_F32 = jnp.float32

__all__ = ["ForwardOutput", "KVCache", "LensStats", "LensTranslators", "forward", "init_cache", "init_params",
           "rms_norm", "rope_inv_freq", "streamed_head", "translate_residuals"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
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



# ----------------------------------------------------------------------------- layers

def _tile(cfg: ModelConfig) -> Optional[int]:
    """Rows per tile under `cfg.batch_invariant` (its `row_tile`, None: by backend), else None."""
    if not cfg.batch_invariant:
        return None
    if cfg.row_tile is not None:
        return cfg.row_tile
    return 8 if jax.default_backend() == "cpu" else 64


def _token_tile(cfg: ModelConfig, tokens: int, cached: bool) -> Optional[int]:
    """Token rows per tile of a block's per-token work (norms, projections, RoPE, MLP) in a
    call of `tokens` tokens per row (`cached`: with a KV cache) under `cfg.batch_invariant`,
    else None. A chunk of a prefill (`_prefill_chunk`) runs on tiles of half a row's chunk
    (the whole chunk if kv_chunk is odd): a fixed shape, so the same kernels whatever the
    batch, and each tile reads the weights once for kv_chunk / 2 tokens instead of once per
    `row_tile` tokens (docs/benchmarks.md, "A batch-invariant prefill"). Other calls
    (decode steps, uncached forwards) tile by `_tile`."""
    if _prefill_chunk(cfg, tokens, cached):
        return tokens // 2 if tokens % 2 == 0 else tokens
    return _tile(cfg)


def _attention_tile(cfg: ModelConfig, tokens: int) -> Optional[int]:
    """Rows per tile of the attention's cache reads in a call of `tokens` tokens per row
    under `cfg.batch_invariant`, else None: `_tile`, except that with `row_tile` unset a
    prefill chunk on the CPU reads one row per tile (each row brings kv_chunk queries; 2
    rows padded to 2 tiles of 8 did 8x the attention's work)."""
    if _prefill_chunk(cfg, tokens, True) and cfg.row_tile is None and jax.default_backend() == "cpu":
        return 1
    return _tile(cfg)


def _prefill_chunk(cfg: ModelConfig, tokens: int, cached: bool) -> bool:
    """Whether a call is a chunk of a batch-invariant prefill: under `cfg.batch_invariant`
    every multi-token call with a cache runs in `_forward_in_chunks`' chunks of kv_chunk
    tokens per row."""
    return cfg.batch_invariant and cached and tokens > 1


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
           read: Optional[CacheRead], index, inv_freq: Array):
    """Block `index` (0-based; static, or traced inside a scan), pre-norm. x: [B, T, D].
    With a cache, this call's keys and values are written at layer `index` first (one
    scatter, in place), then read back with the rest (unless `read.deferred`). Under
    `cfg.batch_invariant` everything runs on fixed tiles of rows: norms, projections,
    RoPE and MLP through `row_tiled`, the attention's cache reads in `_cache_chunks`.
    Returns (x, read, (k, v) [B, T, Hkv, Dh])."""
    B, T, _ = x.shape
    tile = _token_tile(cfg, T, read is not None)
    with jax.named_scope("attention"):
        q, k, v = row_tiled(lambda xs: _attention_inputs(layer, cfg, *xs, inv_freq), (x, positions), tile)
        q, k, v = constrain(q, HEADS), constrain(k, HEADS), constrain(v, HEADS)
        if read is not None and not read.deferred:
            read = dataclasses.replace(read, cache=write_kv(read.cache, index, positions, k, v))
        attn, read = attend(q, k, v, positions, read, index)
    with jax.named_scope("mlp"):
        attn = attn.reshape(B, T, -1)
        if tile is None:
            x = _block_output(layer, cfg, x, attn)
        else:
            x = constrain(row_tiled(lambda xs: _block_output(layer, cfg, *xs, shard=False), (x, attn), tile), HIDDEN)
    return x, read, (k, v)


def _layer_stack(layers, cfg: ModelConfig, x: Array, positions: Array, read: Optional[CacheRead],
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



def _run_layers(layers, cfg: ModelConfig, x: Array, positions: Array, cache: Optional[KVCache],
                keep: tuple[int, ...], remat: bool = False):
    """The layer stack with the cache read as `cfg.kv_read` says (module docstring).
    Returns (x, kept, cache). remat (training, no cache): see `_layer_stack`."""
    if cache is None:
        return _layer_stack(layers, cfg, x, positions, None, keep, remat)[:3]
    if remat:
        raise ValueError("remat recomputes blocks for a backward pass; run it without a KV cache")
    S = cache.max_len
    mode = read_mode(cfg, x.shape[1], S, x.shape[0])
    live = live_lengths(positions, S, deferred=mode == "buckets")
    if mode == "all":
        return _layer_stack(layers, cfg, x, positions, CacheRead(cache, live, window=S), keep)[:3]
    if mode == "kernel":
        return _layer_stack(layers, cfg, x, positions, CacheRead(cache, live, kernel=True), keep)[:3]
    C = cfg.kv_chunk if cfg.batch_invariant and S % cfg.kv_chunk == 0 else min(cfg.kv_chunk, S)
    if mode == "loop":
        chunks = (jnp.max(live) + C - 1) // C
        read = CacheRead(cache, live, chunks=chunks, chunk=C, row_tile=_attention_tile(cfg, x.shape[1]) or 0)
        return _layer_stack(layers, cfg, x, positions, read, keep)[:3]
    windows = window_buckets(S, C)

    def branch(window):
        def run(layers, x, positions, cache, live):
            read = CacheRead(cache, live, window=window, deferred=True)
            x, kept, _, (ks, vs) = _layer_stack(layers, cfg, x, positions, read, keep)
            return x, kept, ks, vs
        return run

    x, kept, ks, vs = switch_on_size(windows, jnp.max(live), branch, layers, x, positions, cache, live)
    # Every layer's keys and values at once, after every read (the switch's outputs).
    return x, kept, write_kv(cache, slice(None), positions, ks.transpose(1, 2, 0, 3, 4), vs.transpose(1, 2, 0, 3, 4))


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
                        and others and not under_mesh()):
                    flat_logits, *stats = live_rows_head(
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
