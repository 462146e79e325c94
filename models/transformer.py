"""One pure-functional decoder-only transformer for Qwen2 and Llama/DeepSeek-Math.

Free functions over registered dataclass pytrees; the config is static. Shapes use
B = batch rows, T = new tokens in this call, S = cache slots, L = layers,
D = hidden size, H / Hkv = query / key-value heads, Dh = head size, V = vocabulary,
F = MLP size, K = number of captured or lensed layers.

Positions and cache slots are the same thing: the token at position p of a row
writes its keys and values to slot p of that row and attends to slots <= p. Rows
of different lengths therefore need no left padding: right-pad each row and give
padding entries positions after the row's real tokens (e.g. keep counting). A
padded entry may write garbage into a slot, but every later real token at that
position overwrites it before any query can read it, and queries never see slots
beyond their own position.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp

from .config import ModelConfig
from .sharding import CACHE, FFN, HEADS, HIDDEN, constrain

Array = jax.Array


def _pytree_dataclass(cls):
    cls = dataclasses.dataclass(cls)
    fields = [f.name for f in dataclasses.fields(cls)]
    return jax.tree_util.register_dataclass(cls, data_fields=fields, meta_fields=[])


@_pytree_dataclass
class LayerParams:
    """One transformer block. Linear weights are stored [in, out] (x @ W)."""

    attn_norm: Array  # [D]
    q: Array  # [D, H*Dh]
    k: Array  # [D, Hkv*Dh]
    v: Array  # [D, Hkv*Dh]
    q_bias: Optional[Array]  # [H*Dh] (Qwen2) or None (Llama)
    k_bias: Optional[Array]  # [Hkv*Dh] or None
    v_bias: Optional[Array]  # [Hkv*Dh] or None
    o: Array  # [H*Dh, D]
    mlp_norm: Array  # [D]
    gate: Array  # [D, F]
    up: Array  # [D, F]
    down: Array  # [F, D]


@_pytree_dataclass
class Params:
    embed: Array  # [V, D]
    layers: list  # L x LayerParams
    final_norm: Array  # [D]
    lm_head: Optional[Array]  # [V, D]; None when the embeddings are tied

    def unembedding(self) -> Array:
        """W_U, [V, D]: the output projection, shared with the embedding when tied."""
        return self.embed if self.lm_head is None else self.lm_head


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


def param_shapes(cfg: ModelConfig) -> Params:
    """The expected shape of every tensor, as a Params of tuples (for checkpoint checks)."""
    D, F, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q_out, kv_out = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    bias = cfg.qkv_bias
    layer = LayerParams(
        attn_norm=(D,), q=(D, q_out), k=(D, kv_out), v=(D, kv_out),
        q_bias=(q_out,) if bias else None, k_bias=(kv_out,) if bias else None,
        v_bias=(kv_out,) if bias else None, o=(q_out, D), mlp_norm=(D,),
        gate=(D, F), up=(D, F), down=(F, D),
    )
    return Params(
        embed=(V, D), layers=[layer] * cfg.num_layers, final_norm=(D,),
        lm_head=None if cfg.tie_word_embeddings else (V, D),
    )


def init_params(cfg: ModelConfig, key: Array, dtype=jnp.bfloat16, scale: float = 0.02,
                shardings: Optional[Params] = None) -> Params:
    """Random parameters (normal(0, scale) weights, norms near 1) for tests and benchmarks.

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
    return jax.jit(functools.partial(jax.random.normal, shape=shape, dtype=jnp.float32),
                   out_shardings=sharding)


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.bfloat16) -> KVCache:
    """An empty cache (see KVCache; split by row and head under a mesh)."""
    L, H, Dh = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
    return KVCache(k=constrain(jnp.zeros((L, batch, H, max_len, Dh), dtype), CACHE),
                   v=constrain(jnp.zeros((L, batch, H, Dh, max_len), dtype), CACHE))


def rms_norm(x: Array, weight: Array, eps: float) -> Array:
    """HF Qwen2/Llama RMSNorm: normalise in fp32, cast back, then multiply by the weight."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * x32.astype(x.dtype)


def _rope(x: Array, positions: Array, theta: float) -> Array:
    """Rotary embedding, HF `rotate_half` layout. x: [B, T, heads, Dh], positions: [B, T].

    Angles are computed in fp32 (bf16 positions lose integers above 256), then cos/sin
    are cast to x's dtype before the multiply, as HF does.
    """
    dh = x.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, dh, 2, dtype=jnp.float32) / dh))  # [Dh/2]
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, Dh/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]  # [B, T, 1, Dh]
    cos, sin = jnp.cos(angles).astype(x.dtype), jnp.sin(angles).astype(x.dtype)
    x1, x2 = x[..., : dh // 2], x[..., dh // 2:]
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return x * cos + rotated * sin


def _attention(q: Array, k: Array, v: Array, q_pos: Array, k_pos: Array) -> Array:
    """Grouped-query causal attention by position.

    q: [B, T, H, Dh]; k: [B, Hkv, S, Dh]; v: [B, Hkv, Dh, S]; q_pos: [B, T]; k_pos: [B, S].
    Key j is visible to query t iff k_pos[j] <= q_pos[t]. Returns [B, T, H, Dh].
    Scores and softmax in fp32; probabilities cast to v's dtype for the PV product (as HF).
    """
    B, T, H, Dh = q.shape
    hkv = k.shape[1]
    qg = q.reshape(B, T, hkv, H // hkv, Dh)
    scores = jnp.einsum("btkgd,bksd->bkgts", qg, k, preferred_element_type=jnp.float32)
    scores = scores * (Dh ** -0.5)
    visible = k_pos[:, None, :] <= q_pos[:, :, None]  # [B, T, S]
    scores = jnp.where(visible[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bkds->btkgd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(B, T, H, Dh).astype(q.dtype)


def _block(layer: LayerParams, cfg: ModelConfig, x: Array, positions: Array,
           cache: Optional[KVCache], index: int):
    """Block `index` (0-based), pre-norm. x: [B, T, D]; cache holds all layers and is
    updated in place at layer `index` (one scatter, no copy of other layers)."""
    B, T, _ = x.shape
    h = rms_norm(x, layer.attn_norm, cfg.rms_norm_eps)
    q, k, v = h @ layer.q, h @ layer.k, h @ layer.v
    if cfg.qkv_bias:
        q, k, v = q + layer.q_bias, k + layer.k_bias, v + layer.v_bias
    q = constrain(_rope(q.reshape(B, T, cfg.num_heads, cfg.head_dim), positions, cfg.rope_theta), HEADS)
    k = constrain(_rope(k.reshape(B, T, cfg.num_kv_heads, cfg.head_dim), positions, cfg.rope_theta), HEADS)
    v = constrain(v.reshape(B, T, cfg.num_kv_heads, cfg.head_dim), HEADS)
    if cache is None:
        keys, values, k_pos = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 3, 1), positions
    else:
        rows = jnp.broadcast_to(jnp.arange(B)[:, None], positions.shape)
        # The indexed (row, slot) pairs come first in the updated slice: [B, T, Hkv, Dh]
        # for both layouts. mode="drop": a padding entry past the cache end writes nothing.
        cache = KVCache(
            k=constrain(cache.k.at[index, rows, :, positions].set(k.astype(cache.k.dtype), mode="drop"),
                        CACHE),
            v=constrain(cache.v.at[index, rows, :, :, positions].set(v.astype(cache.v.dtype), mode="drop"),
                        CACHE))
        keys, values = cache.k[index], cache.v[index]
        k_pos = jnp.broadcast_to(jnp.arange(cache.max_len)[None], (B, cache.max_len))
    attn = _attention(q, keys.astype(q.dtype), values.astype(q.dtype), positions, k_pos)
    x = constrain(x + attn.reshape(B, T, -1) @ layer.o, HIDDEN)
    h = rms_norm(x, layer.mlp_norm, cfg.rms_norm_eps)
    hidden = constrain(jax.nn.silu(h @ layer.gate) * (h @ layer.up), FFN)
    return constrain(x + hidden @ layer.down, HIDDEN), cache


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


def streamed_head(w_u: Array, h_out: Optional[Array], h_lens: Array, chunk: Optional[int] = None):
    """Unembed rows while streaming the vocabulary once.

    w_u: [V, D]; h_out: [N, D] final-normed rows whose full fp32 logits are returned
    (or None); h_lens: [M, D] final-normed rows for which only entropy and top-1 are
    kept. Per lens row we carry the running max m, s = sum exp(z - m) and
    t = sum exp(z - m)·(z - m), so H = log s - t / s and p_top1 = 1 / s at the end; no
    [M, V] array exists, only one [N + M, chunk] block at a time (chunk=None: one
    block when it fits SINGLE_BLOCK_MAX_BYTES, else DEFAULT_LENS_CHUNK). Carrying (z - m)
    rather than z keeps the fp32 error of H independent of the logits' magnitude
    (with sum exp·z, the rounding error of s is multiplied by |m|). Logits and all
    statistics are fp32 whatever the weight dtype. Returns (logits [N, V] | None,
    entropy [M], top1 [M], top1_prob [M], logsumexp [M]). The result does not depend on `chunk`
    beyond fp32 summation order.
    """
    n_out = 0 if h_out is None else h_out.shape[0]
    rows = h_lens if h_out is None else jnp.concatenate([h_out, h_lens.astype(h_out.dtype)], 0)
    M = h_lens.shape[0]
    m = jnp.full((M,), -jnp.inf, jnp.float32)
    s = jnp.zeros((M,), jnp.float32)
    t = jnp.zeros((M,), jnp.float32)
    top = jnp.zeros((M,), jnp.int32)

    def update(carry, z, start):
        m, s, t, top = carry
        zl = z[n_out:]
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

    V = w_u.shape[0]
    if chunk is None:
        chunk = V if rows.shape[0] * V * 4 <= SINGLE_BLOCK_MAX_BYTES else DEFAULT_LENS_CHUNK
    spans = _vocab_chunks(V, chunk)
    full = [sp for sp in spans if sp[1] == chunk]
    carry = (m, s, t, top)
    out_blocks = []
    if full:
        def body(carry, start):
            w = jax.lax.dynamic_slice_in_dim(w_u, start, chunk, axis=0)
            z = jnp.einsum("nd,vd->nv", rows, w.astype(rows.dtype), preferred_element_type=jnp.float32)
            return update(carry, z, start), (None if h_out is None else z[:n_out])

        starts = jnp.arange(len(full), dtype=jnp.int32) * chunk
        if len(full) == 1:  # one block: no slicing of W_U, no loop
            z = jnp.einsum("nd,vd->nv", rows, w_u.astype(rows.dtype), preferred_element_type=jnp.float32)
            carry, ys = update(carry, z, 0), z[None, :n_out]
        else:
            carry, ys = jax.lax.scan(body, carry, starts)  # ys: [n_full, N, chunk]
        if h_out is not None:
            out_blocks.append(jnp.transpose(ys, (1, 0, 2)).reshape(n_out, len(full) * chunk))
    if len(full) < len(spans):
        start, size = spans[-1]
        z = jnp.einsum("nd,vd->nv", rows, w_u[start:].astype(rows.dtype), preferred_element_type=jnp.float32)
        carry = update(carry, z, start)
        out_blocks.append(z[:n_out])
    m, s, t, top = carry
    entropy = jnp.log(s) - t / s
    logits = None if h_out is None else jnp.concatenate(out_blocks, axis=-1)
    return logits, entropy, top, 1.0 / s, m + jnp.log(s)


@functools.partial(jax.jit, static_argnames=("cfg", "capture", "lens_layers", "lens_chunk", "remat"))
def forward(params: Params, cfg: ModelConfig, tokens: Array, positions: Array,
            cache: Optional[KVCache] = None, capture: tuple[int, ...] = (),
            lens_layers: tuple[int, ...] = (), lens_chunk: Optional[int] = None,
            logits_at: Optional[Array] = None,
            lens_translators: Optional[LensTranslators] = None,
            remat: bool = False) -> ForwardOutput:
    """Run the transformer on `tokens`.

    tokens, positions: [B, T] int32 (see the module docstring for padding).
    cache: a KVCache with S slots, updated at `positions` and returned; None runs
      attention over the given tokens only (and returns cache=None).
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
    """
    L = cfg.num_layers
    for name, layers in (("capture", capture), ("lens_layers", lens_layers)):
        bad = [l for l in layers if not 0 <= l <= L]
        if bad:
            raise ValueError(f"{name} layers {bad} out of range 0..{L}")
    B, T = tokens.shape
    x = constrain(params.embed[tokens], HIDDEN)
    wanted = set(capture) | set(lens_layers)
    saved = {0: x} if 0 in wanted else {}
    block = jax.checkpoint(_block, static_argnums=(1, 5)) if remat else _block
    for l, layer in enumerate(params.layers):
        x, cache = block(layer, cfg, x, positions, cache, l)
        if l + 1 in wanted:
            saved[l + 1] = x

    h = x if logits_at is None else jnp.take_along_axis(x, logits_at[:, None, None], axis=1)
    h = rms_norm(h, params.final_norm, cfg.rms_norm_eps)
    w_u = params.unembedding()
    lens = None
    if lens_translators is not None and lens_translators.bias.shape[0] != len(lens_layers):
        raise ValueError(f"lens_translators has {lens_translators.bias.shape[0]} rows for "
                         f"{len(lens_layers)} lens_layers {lens_layers}")
    if lens_layers:
        rows = [saved[l] for l in lens_layers]
        if lens_translators is not None:
            rows = list(translate_residuals(jnp.stack(rows), lens_translators))
        lensed = jnp.stack([rms_norm(r, params.final_norm, cfg.rms_norm_eps) for r in rows])
        K = len(lens_layers)
        flat_logits, ent, top, ptop, lse = streamed_head(
            w_u, h.reshape(-1, h.shape[-1]), lensed.reshape(K * B * T, -1), lens_chunk)
        logits = flat_logits.reshape(*h.shape[:2], -1)
        lens = LensStats(entropy=ent.reshape(K, B, T), top1=top.reshape(K, B, T),
                         top1_prob=ptop.reshape(K, B, T), logsumexp=lse.reshape(K, B, T))
    else:
        logits = jnp.einsum("btd,vd->btv", h, w_u, preferred_element_type=jnp.float32)
    residuals = jnp.stack([saved[l] for l in capture]) if capture else None
    return ForwardOutput(logits=logits, cache=cache, residuals=residuals, lens=lens)
