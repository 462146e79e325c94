"""Tensor and data parallelism over a 2-D device mesh with axes ("data", "model").

Weights are split Megatron-style over "model": the query/key/value projections and the
MLP's gate/up by output columns (whole heads, whole FFN slices), the attention output
and MLP down projections by input rows (XLA inserts one all-reduce after each), the
embedding and unembedding by vocabulary rows; norms are replicated. These are rules per
logical axis (:func:`axis_rules`) applied to the tensor table of `params`. Activations,
the KV cache and every per-row sampler array are split over "data" by batch row.

Usage (the sampler code is unchanged; `forward` places its activations through
:func:`constrain`, which is a no-op without an ambient mesh)::

    mesh = make_mesh(data=1, model=4)
    params = shard_params(params, cfg, mesh)   # or load(..., mesh=mesh)
    with jax.set_mesh(mesh):
        result = decode(TransformerLM(cfg), params, prompts, "degs_mcmc", key)  # models.causal_lm

The mesh axes are `Auto` (GSPMD propagation), so the same jitted functions serve one
device and many; a function traced under a mesh is retraced, not reused, without it.
A batch that does not divide the "data" axis is padded by XLA inside the computation.
"""

from __future__ import annotations

from typing import Optional, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from .config import ModelConfig
from .params import Params, is_stacked, param_tree

DATA, MODEL = "data", "model"

# Activation layouts used by `forward` (B = batch rows first).
HIDDEN = P(DATA, None, None)  # [B, T, D]: replicated over "model" between blocks
HEADS = P(DATA, None, MODEL, None)  # [B, T, heads, Dh]
FFN = P(DATA, None, MODEL)  # [B, T, F]
CACHE = P(None, DATA, MODEL, None, None)  # [L, B, Hkv, S, Dh] and [L, B, Hkv, Dh, S]


def make_mesh(data: int = 1, model: int = 1, devices: Optional[Sequence[jax.Device]] = None) -> Mesh:
    """A ("data", "model") mesh over `devices` (default: this process's local devices, so
    that each `jax.distributed` process decodes its own problems on its own devices).

    The first data · model of `devices` are used; the `model` devices of one data group
    are adjacent in that order (on one host they share the fastest links).
    """
    if data < 1 or model < 1:
        raise ValueError(f"mesh sizes must be positive, got data={data}, model={model}")
    devices = list(jax.local_devices() if devices is None else devices)
    if data * model > len(devices):
        raise ValueError(f"a {data}x{model} (data x model) mesh needs {data * model} devices; "
                         f"{len(devices)} are available ({devices[0].platform})")
    grid = np.asarray(devices[:data * model], dtype=object).reshape(data, model)
    return Mesh(grid, (DATA, MODEL), axis_types=(AxisType.Auto, AxisType.Auto))


def parse_mesh(text: str) -> tuple[int, int]:
    """"DxM" (e.g. "1x4": tensor parallel over 4 devices; "8x1": 8 data-parallel replicas)."""
    try:
        data, model = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"mesh must look like DATAxMODEL (e.g. 1x4 or 2x2), got {text!r}") from None
    if data < 1 or model < 1:
        raise ValueError(f"mesh sizes must be positive, got {text!r}")
    return data, model


def check_model_parallel(cfg: ModelConfig, model: int) -> None:
    """Tensor parallelism splits whole heads and whole FFN slices: refuse sizes that don't."""
    sizes = {"attention heads": cfg.num_heads, "key/value heads": cfg.num_kv_heads,
             "MLP size": cfg.intermediate_size}
    bad = [f"{name} ({n})" for name, n in sizes.items() if n % model]
    if bad:
        raise ValueError(f"cannot split the model over {model} devices: {', '.join(bad)} "
                         f"not divisible by {model}; use a smaller 'model' mesh axis")


def axis_rules(cfg: ModelConfig, model: int) -> dict[str, Optional[str]]:
    """The mesh axis each logical tensor axis (`params.axis_sizes`) is split over; axes
    not named here are replicated. The vocabulary is split only when it divides evenly
    (placing an array needs even shards); otherwise the (un)embedding is replicated."""
    return {"vocab": MODEL if cfg.vocab_size % model == 0 else None,
            "q_heads": MODEL, "kv_heads": MODEL, "mlp": MODEL}


def param_specs(cfg: ModelConfig, model: int, stacked: bool = False) -> Params:
    """The PartitionSpec of every parameter (a Params of specs, in the list layout or
    the stacked one) for a "model" axis of `model`, from the tensor table and
    :func:`axis_rules`; a fully replicated tensor gets P()."""
    check_model_parallel(cfg, model)
    rules = axis_rules(cfg, model)

    def spec(tensor, axes):
        mesh_axes = [rules.get(a) for a in axes]
        return P(*mesh_axes) if any(mesh_axes) else P()

    return param_tree(cfg, spec, stacked)


def param_shardings(cfg: ModelConfig, mesh: Mesh, stacked: bool = False) -> Params:
    """:func:`param_specs` as NamedShardings on `mesh` (replicated over "data")."""
    specs = param_specs(cfg, mesh.shape[MODEL], stacked)
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs,
                        is_leaf=lambda x: isinstance(x, P))


def shard_params(params: Params, cfg: ModelConfig, mesh: Mesh) -> Params:
    """Place `params` (either layout) on `mesh` (each device receives only its shard)."""
    return jax.device_put(params, param_shardings(cfg, mesh, is_stacked(params)))


def constrain(x: jax.Array, spec: P) -> jax.Array:
    """Pin `x`'s layout to `spec` when tracing under a ("data", "model") mesh
    (`jax.set_mesh`); unchanged otherwise, so single-device code pays nothing."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not {DATA, MODEL} <= set(mesh.axis_names):
        return x
    return jax.lax.with_sharding_constraint(x, spec)
