"""Checkpoint key mapping: Hugging Face tensor names <-> our Params pytree, with shape checks.

HF stores linear weights [out, in]; we store [in, out] so that the forward is x @ W.
Every expected tensor must be present with its expected shape and nothing unexpected
may be left over; each failure names the tensor.
"""

from __future__ import annotations

from typing import Callable, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np

from .config import ModelConfig
from .transformer import LayerParams, Params, param_shapes


class CheckpointError(ValueError):
    """A checkpoint does not match the architecture its config describes."""


# Tensors some exporters keep that carry no parameters (recomputed at run time).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

_LINEAR = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
           "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
           "down": "mlp.down_proj"}
_BIAS = {"q_bias": "self_attn.q_proj.bias", "k_bias": "self_attn.k_proj.bias",
         "v_bias": "self_attn.v_proj.bias"}
_NORM = {"attn_norm": "input_layernorm.weight", "mlp_norm": "post_attention_layernorm.weight"}
_QK_NORM = {"q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight"}


def hf_tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name a HF checkpoint of this config must hold, with its HF shape."""
    ours = param_shapes(cfg)
    layer: LayerParams = ours.layers[0]
    out = {"model.embed_tokens.weight": ours.embed, "model.norm.weight": ours.final_norm}
    if ours.lm_head is not None:
        out["lm_head.weight"] = ours.lm_head
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        for field, name in _LINEAR.items():
            out[p + name + ".weight"] = tuple(reversed(getattr(layer, field)))
        for field, name in _NORM.items():
            out[p + name] = getattr(layer, field)
        if cfg.qkv_bias:
            for field, name in _BIAS.items():
                out[p + name] = getattr(layer, field)
        if cfg.qk_norm:
            for field, name in _QK_NORM.items():
                out[p + name] = getattr(layer, field)
    return out


def params_from_hf(tensors: Mapping[str, object], cfg: ModelConfig, dtype=jnp.bfloat16,
                   to_numpy: Callable[[object], np.ndarray] = np.asarray,
                   shardings: Optional[Params] = None) -> Params:
    """Build Params from HF-named tensors (numpy arrays, safetensors slices, torch tensors
    via `to_numpy`). Raises CheckpointError naming every missing, unexpected or
    mis-shaped tensor.

    shardings: a Params of `jax.sharding.Sharding` (see `sharding.param_shardings`):
      each tensor goes straight from the host to its shards, so no single device ever
      holds a model that only fits split.
    """
    expected = hf_tensor_shapes(cfg)
    names = set(tensors)
    missing = sorted(set(expected) - names)
    unexpected = sorted(n for n in names - set(expected)
                        if not n.endswith(_IGNORED_SUFFIXES)
                        and not (n == "lm_head.weight" and cfg.tie_word_embeddings))
    problems = []
    if missing:
        problems.append(f"missing tensors: {', '.join(missing[:8])}" + (" ..." if len(missing) > 8 else ""))
    if unexpected:
        problems.append(f"unexpected tensors: {', '.join(unexpected[:8])}" + (" ..." if len(unexpected) > 8 else ""))
    arrays = {}
    for name, shape in expected.items():
        if name not in tensors:
            continue
        arr = to_numpy(tensors[name])
        if tuple(arr.shape) != tuple(shape):
            problems.append(f"tensor {name} has shape {tuple(arr.shape)}, expected {tuple(shape)}")
        arrays[name] = arr
    if problems:
        raise CheckpointError("checkpoint does not match config: " + "; ".join(problems))

    def get(name, owner, field, transpose=False):
        arr = arrays[name]
        arr = arr.T if transpose else arr
        if owner is None:
            return jnp.asarray(arr, dtype=dtype)
        return jax.device_put(np.asarray(arr).astype(dtype), getattr(owner, field))

    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        owner = shardings.layers[i] if shardings is not None else None
        kw = {f: get(p + n + ".weight", owner, f, transpose=True) for f, n in _LINEAR.items()}
        kw.update({f: get(p + n, owner, f) for f, n in _NORM.items()})
        kw.update({f: get(p + n, owner, f) if cfg.qkv_bias else None for f, n in _BIAS.items()})
        kw.update({f: get(p + n, owner, f) if cfg.qk_norm else None for f, n in _QK_NORM.items()})
        layers.append(LayerParams(**kw))
    return Params(
        embed=get("model.embed_tokens.weight", shardings, "embed"), layers=layers,
        final_norm=get("model.norm.weight", shardings, "final_norm"),
        lm_head=None if cfg.tie_word_embeddings else get("lm_head.weight", shardings, "lm_head"),
    )


def params_to_hf(params: Params, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """Inverse of `params_from_hf` (fp32 numpy), for building HF parity references."""
    f32 = lambda a: np.asarray(a, dtype=np.float32)
    out = {"model.embed_tokens.weight": f32(params.embed), "model.norm.weight": f32(params.final_norm)}
    if params.lm_head is not None:
        out["lm_head.weight"] = f32(params.lm_head)
    for i, layer in enumerate(params.layers):
        p = f"model.layers.{i}."
        for f, n in _LINEAR.items():
            out[p + n + ".weight"] = f32(getattr(layer, f)).T.copy()
        for f, n in _NORM.items():
            out[p + n] = f32(getattr(layer, f))
        if cfg.qkv_bias:
            for f, n in _BIAS.items():
                out[p + n] = f32(getattr(layer, f))
        if cfg.qk_norm:
            for f, n in _QK_NORM.items():
                out[p + n] = f32(getattr(layer, f))
    return out
