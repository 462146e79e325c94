"""The parameter pytrees and the one table that describes every tensor in them.

Each :class:`TensorSpec` row says, for one field of :class:`Params` or :class:`LayerParams`:
its logical axes (sizes from the config, see :func:`axis_sizes`), its Hugging Face name,
whether HF stores it transposed (linear weights: HF [out, in], ours [in, out] so that the
forward is `x @ W`) and when it exists (biases for Qwen2, q/k norms for Qwen3, an
`lm_head` only when untied). Everything else is derived from the table:

- shapes (:func:`param_shapes`, used by `init_params` and the checkpoint checks),
- tensor-parallel layouts (`sharding.param_specs`: a rule per logical axis),
- the checkpoint mapping (`checkpoint.hf_tensor_shapes`, `params_from_hf`, `params_to_hf`).

Two layouts of the layers exist, both served by `transformer.forward`:

- a list of L `LayerParams` (one array per tensor per layer; the forward unrolls the layers);
- *stacked*: one `LayerParams` whose arrays carry a leading "layers" axis of size L (the
  forward runs one `lax.scan` over them, so the compiled program holds one layer, not L).
  :func:`stack_layers` / :func:`unstack_layers` convert between them.

This module imports only the config: every other module of the package may import it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

from .config import ModelConfig

Array = jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerParams:
    """One transformer block (shapes per layer; stacked layouts add a leading [L])."""

    attn_norm: Array  # [D]
    q: Array  # [D, H*Dh]
    k: Array  # [D, Hkv*Dh]
    v: Array  # [D, Hkv*Dh]
    q_bias: Optional[Array]  # [H*Dh] (Qwen2) or None
    k_bias: Optional[Array]  # [Hkv*Dh] or None
    v_bias: Optional[Array]  # [Hkv*Dh] or None
    q_norm: Optional[Array]  # [Dh] per-head RMSNorm weight of queries (Qwen3) or None
    k_norm: Optional[Array]  # [Dh] per-head RMSNorm weight of keys (Qwen3) or None
    o: Array  # [H*Dh, D]
    mlp_norm: Array  # [D]
    gate: Array  # [D, F]
    up: Array  # [D, F]
    down: Array  # [F, D]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Params:
    embed: Array  # [V, D]
    layers: Any  # list of L LayerParams, or one stacked LayerParams ([L, ...] arrays)
    final_norm: Array  # [D]
    lm_head: Optional[Array]  # [V, D]; None when the embeddings are tied

    def unembedding(self) -> Array:
        """W_U, [V, D]: the output projection, shared with the embedding when tied."""
        return self.embed if self.lm_head is None else self.lm_head


def _always(cfg: ModelConfig) -> bool:
    return True


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One tensor: `field` of Params (global) or LayerParams (per layer); `axes`: logical
    axis names in our storage order; `hf_name`: full name (global) or the part after
    `model.layers.{i}.` (per layer); `transposed`: HF stores the reversed axes;
    `present`: whether a config has it (absent tensors are None in the pytree)."""

    field: str
    axes: tuple[str, ...]
    hf_name: str
    transposed: bool = False
    present: Callable[[ModelConfig], bool] = _always


_qkv_bias = lambda cfg: cfg.qkv_bias
_qk_norm = lambda cfg: cfg.qk_norm

GLOBAL_TENSORS = (
    TensorSpec("embed", ("vocab", "embed"), "model.embed_tokens.weight"),
    TensorSpec("final_norm", ("embed",), "model.norm.weight"),
    TensorSpec("lm_head", ("vocab", "embed"), "lm_head.weight",
               present=lambda cfg: not cfg.tie_word_embeddings),
)
LAYER_TENSORS = (
    TensorSpec("attn_norm", ("embed",), "input_layernorm.weight"),
    TensorSpec("q", ("embed", "q_heads"), "self_attn.q_proj.weight", transposed=True),
    TensorSpec("k", ("embed", "kv_heads"), "self_attn.k_proj.weight", transposed=True),
    TensorSpec("v", ("embed", "kv_heads"), "self_attn.v_proj.weight", transposed=True),
    TensorSpec("q_bias", ("q_heads",), "self_attn.q_proj.bias", present=_qkv_bias),
    TensorSpec("k_bias", ("kv_heads",), "self_attn.k_proj.bias", present=_qkv_bias),
    TensorSpec("v_bias", ("kv_heads",), "self_attn.v_proj.bias", present=_qkv_bias),
    TensorSpec("q_norm", ("head_dim",), "self_attn.q_norm.weight", present=_qk_norm),
    TensorSpec("k_norm", ("head_dim",), "self_attn.k_norm.weight", present=_qk_norm),
    TensorSpec("o", ("q_heads", "embed"), "self_attn.o_proj.weight", transposed=True),
    TensorSpec("mlp_norm", ("embed",), "post_attention_layernorm.weight"),
    TensorSpec("gate", ("embed", "mlp"), "mlp.gate_proj.weight", transposed=True),
    TensorSpec("up", ("embed", "mlp"), "mlp.up_proj.weight", transposed=True),
    TensorSpec("down", ("mlp", "embed"), "mlp.down_proj.weight", transposed=True),
)
LAYERS_AXIS = "layers"  # the leading axis of stacked layer tensors


def axis_sizes(cfg: ModelConfig) -> dict[str, int]:
    """The size of every logical axis of `cfg`."""
    return {"vocab": cfg.vocab_size, "embed": cfg.hidden_size, "q_heads": cfg.num_heads * cfg.head_dim,
            "kv_heads": cfg.num_kv_heads * cfg.head_dim, "head_dim": cfg.head_dim,
            "mlp": cfg.intermediate_size, LAYERS_AXIS: cfg.num_layers}


def param_tree(cfg: ModelConfig, leaf: Callable[[TensorSpec, tuple[str, ...]], Any],
               stacked: bool = False) -> Params:
    """A Params whose leaves are `leaf(spec, axes)` for every tensor `cfg` has (None for
    absent ones); `axes` starts with LAYERS_AXIS for the layers of a stacked layout.
    The list layout repeats one LayerParams object L times."""
    def build(cls, specs, prefix):
        return cls(**{t.field: leaf(t, prefix + t.axes) if t.present(cfg) else None for t in specs})

    layer = build(LayerParams, LAYER_TENSORS, (LAYERS_AXIS,) if stacked else ())
    top = build(Params, GLOBAL_TENSORS + (TensorSpec("layers", (), ""),), ())
    return dataclasses.replace(top, layers=layer if stacked else [layer] * cfg.num_layers)


def param_shapes(cfg: ModelConfig, stacked: bool = False) -> Params:
    """The shape of every tensor, as a Params of tuples (None where absent)."""
    sizes = axis_sizes(cfg)
    return param_tree(cfg, lambda spec, axes: tuple(sizes[a] for a in axes), stacked)


def is_stacked(params: Params) -> bool:
    """Whether `params.layers` is one stacked LayerParams (else a list of them)."""
    return isinstance(params.layers, LayerParams)


def stack_layers(params: Params) -> Params:
    """The stacked layout of `params` (arrays [L, ...] per layer tensor). Allocates the
    stacked copy before the caller drops the list (peak: the layers twice)."""
    if is_stacked(params):
        return params
    layers = jax.tree.map(lambda *xs: jnp.stack(xs), *params.layers)
    return dataclasses.replace(params, layers=layers)


def unstack_layers(params: Params) -> Params:
    """The list layout of `params` (one LayerParams per layer)."""
    if not is_stacked(params):
        return params
    L = jax.tree.leaves(params.layers)[0].shape[0]
    return dataclasses.replace(params, layers=[jax.tree.map(lambda x: x[l], params.layers) for l in range(L)])
