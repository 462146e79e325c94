"""A complete example of the model protocol (`degs_jax.model_api.CausalLM`) that is not
this package's transformer: a tiny Flax NNX causal LM with learned positions and a KV
cache, wrapped through `nnx.split` / `nnx.merge` (`NNXCausalLM`); `byte_tokenizer.py`
gives it text. Everything the samplers and the evaluation harness
do runs on it unchanged: the tests run the MCMC decoders through it, and
notebooks/your_own_model.ipynb evaluates it on a benchmark through `LanguageModel`.
Random weights: the text it writes is noise; it is here to show the machinery.

The contract the step honours is in `degs_jax.model_api`: slots are positions (a token at
position p writes slot p and attends to slots <= p of its own row), a position past the
cache writes nothing (`mode="drop"`), logits are float32, the lens entropies are
[K, B, T] float32 at the asked layers.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from ..model_api import CausalLM, StepOutput


class Block(nnx.Module):
    def __init__(self, dim: int, heads: int, rngs: nnx.Rngs):
        self.heads = heads
        self.norm1 = nnx.RMSNorm(dim, rngs=rngs)
        self.qkv = nnx.Linear(dim, 3 * dim, use_bias=False, rngs=rngs)
        self.out = nnx.Linear(dim, dim, use_bias=False, rngs=rngs)
        self.norm2 = nnx.RMSNorm(dim, rngs=rngs)
        self.up = nnx.Linear(dim, 4 * dim, rngs=rngs)
        self.down = nnx.Linear(4 * dim, dim, rngs=rngs)

    def __call__(self, x, positions, cache):
        B, T, D = x.shape
        H = self.heads
        q, k, v = (a.reshape(B, T, H, D // H) for a in jnp.split(self.qkv(self.norm1(x)), 3, -1))
        rows = jnp.arange(B)[:, None]
        # Slot = position; a position past the cache writes nothing (mode="drop").
        k_all = cache["k"].at[rows, positions].set(k.astype(cache["k"].dtype), mode="drop")
        v_all = cache["v"].at[rows, positions].set(v.astype(cache["v"].dtype), mode="drop")
        scores = jnp.einsum("bthd,bshd->bhts", q, k_all.astype(q.dtype)) / jnp.sqrt(D // H)
        visible = jnp.arange(k_all.shape[1])[None, None, :] <= positions[:, :, None]  # [B, T, S]
        scores = jnp.where(visible[:, None], scores, -1e30)
        attn = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(scores, -1), v_all.astype(q.dtype))
        x = x + self.out(attn.reshape(B, T, D))
        x = x + self.down(nnx.gelu(self.up(self.norm2(x))))
        return x, {"k": k_all, "v": v_all}


class TinyLM(nnx.Module):
    """tokens [B, T], positions [B, T], cache (list of {"k", "v"} [B, S, H, Dh] per layer)
    -> (logits [B, T, V] fp32, cache, lens entropies [K, B, T] or None)."""

    def __init__(self, vocab: int, dim: int, layers: int, heads: int, max_context: int,
                 rngs: nnx.Rngs):
        self.max_context = max_context
        self.embed = nnx.Embed(vocab, dim, rngs=rngs)
        self.pos = nnx.Embed(max_context, dim, rngs=rngs)
        self.blocks = nnx.List([Block(dim, heads, rngs) for _ in range(layers)])
        self.norm = nnx.RMSNorm(dim, rngs=rngs)
        self.head = nnx.Linear(dim, vocab, use_bias=False, rngs=rngs)

    def __call__(self, tokens, positions, cache, lens_layers=()):
        x = self.embed(tokens) + self.pos(jnp.minimum(positions, self.max_context - 1))
        hidden, new_cache = [x], []
        for block, layer_cache in zip(self.blocks, cache):
            x, layer_cache = block(x, positions, layer_cache)
            hidden.append(x)
            new_cache.append(layer_cache)
        logits = self.head(self.norm(x)).astype(jnp.float32)
        entropy = None
        if lens_layers:  # logit lens: the final norm and head on intermediate residuals
            logp = jax.nn.log_softmax(
                self.head(self.norm(jnp.stack([hidden[l] for l in lens_layers]))).astype(jnp.float32), -1)
            entropy = -jnp.sum(jnp.exp(logp) * logp, -1)
        return logits, new_cache, entropy


@dataclasses.dataclass(frozen=True)
class NNXCausalLM(CausalLM):
    """A TinyLM as a `CausalLM`: the graph definition is static, the nnx.State is `params`."""

    graphdef: Any
    num_layers: int
    vocab_size: int
    max_context: int
    heads: int
    head_dim: int

    def step(self, params, tokens, positions, cache, lens_layers=()):
        logits, cache, entropy = nnx.merge(self.graphdef, params)(tokens, positions, cache, lens_layers)
        return StepOutput(logits=logits, cache=cache, layer_entropy=entropy)

    def init_cache(self, batch, max_len, dtype):
        shape = (batch, max_len, self.heads, self.head_dim)
        return [{"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}
                for _ in range(self.num_layers)]


def tiny_nnx_model(vocab=12, dim=16, layers=3, heads=2, max_context=64, seed=0):
    """(NNXCausalLM, params: nnx.State) of a random TinyLM."""
    graphdef, params = nnx.split(TinyLM(vocab, dim, layers, heads, max_context, nnx.Rngs(seed)))
    return NNXCausalLM(graphdef, num_layers=layers, vocab_size=vocab, max_context=max_context,
                       heads=heads, head_dim=dim // heads), params

