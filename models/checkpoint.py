"""Checkpoint key mapping: Hugging Face tensor names <-> our Params pytree, with shape checks.

Derived from the tensor table of `params` (HF name, logical axes, transposition and
presence of every tensor). HF stores linear weights [out, in]; we store [in, out] so that
the forward is x @ W. Every expected tensor must be present with its expected shape and
nothing unexpected may be left over; each failure names the tensor.
"""

from __future__ import annotations

from typing import Callable, Iterator, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np

from .config import ModelConfig
from .params import (GLOBAL_TENSORS, LAYER_TENSORS, LayerParams, Params, TensorSpec, axis_sizes,
                     unstack_layers)


class CheckpointError(ValueError):
    """A checkpoint does not match the architecture its config describes."""


# Tensors some exporters keep that carry no parameters (recomputed at run time).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _layer_name(index: int, tensor: TensorSpec) -> str:
    return f"model.layers.{index}.{tensor.hf_name}"


def _tensors(cfg: ModelConfig) -> Iterator[tuple[str, TensorSpec]]:
    """(HF name, table row) of every tensor `cfg` has."""
    for t in GLOBAL_TENSORS:
        if t.present(cfg):
            yield t.hf_name, t
    for i in range(cfg.num_layers):
        for t in LAYER_TENSORS:
            if t.present(cfg):
                yield _layer_name(i, t), t


def hf_tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name a HF checkpoint of this config must hold, with its HF shape."""
    sizes = axis_sizes(cfg)
    out = {}
    for name, t in _tensors(cfg):
        shape = tuple(sizes[a] for a in t.axes)
        out[name] = shape[::-1] if t.transposed else shape
    return out


def params_from_hf(tensors: Mapping[str, object], cfg: ModelConfig, dtype=jnp.bfloat16,
                   to_numpy: Callable[[object], np.ndarray] = np.asarray,
                   shardings: Optional[Params] = None, stacked: bool = False) -> Params:
    """Build Params from HF-named tensors (numpy arrays, safetensors slices, torch tensors
    via `to_numpy`). Raises CheckpointError naming every missing, unexpected or
    mis-shaped tensor.

    shardings: a Params of `jax.sharding.Sharding` (see `sharding.param_shardings`, same
      layout as `stacked`): each tensor goes straight from the host to its shards, so no
      single device ever holds a model that only fits split.
    stacked: return the stacked layer layout (`params.stack_layers`); each layer tensor is
      stacked on the host, one tensor at a time, before it is placed.
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

    def host(name: str, tensor: TensorSpec):
        return arrays[name].T if tensor.transposed else arrays[name]

    def place(arr, owner, field):
        if owner is None:
            return jnp.asarray(arr, dtype=dtype)
        return jax.device_put(np.asarray(arr).astype(dtype), getattr(owner, field))

    def layer_owner(i):
        if shardings is None:
            return None
        return shardings.layers if stacked else shardings.layers[i]

    top = {t.field: place(host(t.hf_name, t), shardings, t.field) if t.present(cfg) else None
           for t in GLOBAL_TENSORS}
    if stacked:
        layers = LayerParams(**{
            t.field: place(np.stack([host(_layer_name(i, t), t) for i in range(cfg.num_layers)]),
                           layer_owner(0), t.field) if t.present(cfg) else None
            for t in LAYER_TENSORS})
    else:
        layers = [LayerParams(**{t.field: place(host(_layer_name(i, t), t), layer_owner(i), t.field)
                                 if t.present(cfg) else None for t in LAYER_TENSORS})
                  for i in range(cfg.num_layers)]
    return Params(layers=layers, **top)


def params_to_hf(params: Params, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """Inverse of `params_from_hf` (fp32 numpy, either layout), for building HF parity
    references and test checkpoints."""
    params = unstack_layers(params)

    def f32(arr, tensor):
        arr = np.asarray(arr, dtype=np.float32)
        return arr.T.copy() if tensor.transposed else arr

    out = {t.hf_name: f32(getattr(params, t.field), t) for t in GLOBAL_TENSORS if t.present(cfg)}
    for i, layer in enumerate(params.layers):
        out.update({_layer_name(i, t): f32(getattr(layer, t.field), t) for t in LAYER_TENSORS if t.present(cfg)})
    return out
