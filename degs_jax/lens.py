"""Logit lens and collapse depth (docs/design.md §3).

Layer entropy `H_l(t)` is the entropy, in nats, of `softmax(W_U · RMSNorm_final(h_l(t)))`
where `h_l(t)` is the residual after block `l` at the position of token `x_t` (layer
numbering as HF `hidden_states`: 0 = embeddings, l = after block l, L = last block).
The model's step computes it (`degs_jax.model_api`: our transformer fuses it with the
output head, streaming the vocabulary in chunks); this module picks the layers, turns
entropies into collapse depths and averages them over sequences. Everything here is a
pure function of arrays (no model): teacher-forced passes live in `degs_jax.scoring`.

Shapes: K = probed layers, B = batch rows, T / N = positions, L = number of blocks.
Everything here is fp32: entropies are differences of quantities of size ~log V and a
threshold test `H <= tau` at tau = 0.25 nats must not flip from bf16 rounding.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .tiling import row_tiled
from .traced_fields import concrete, register_traced_dataclass

Array = jax.Array

DEFAULT_TAU = 0.25  # nats: the collapse threshold of docs/design.md §3 (the one home of this default)

# The paper's probe sets for its 28-layer (Qwen2.5-7B) and 30-layer (DeepSeek-Math-7B)
# models; they are not exactly round(j·L/7) (e.g. 13 vs 14 for L = 30).
_PAPER_LSUB = {28: (4, 8, 12, 16, 20, 24, 28), 30: (4, 9, 14, 18, 22, 26, 30)}


def default_lsub(num_layers: int) -> tuple[int, ...]:
    """The default probed layers L_sub for a model with `num_layers` blocks.

    {4,8,...,28} for 28 layers, {4,9,14,18,22,26,30} for 30 layers, otherwise
    round(j·L/7) for j = 1..7 (j·L/7 is never exactly a half, so Python's round is
    unambiguous). For L >= 7 these are 7 distinct layers ending at L. For L < 7 the
    rounded values collide or hit 0; they are then clamped to >= 1 and deduplicated,
    so fewer than 7 layers are probed (e.g. (1, 2, 3) for L = 3).
    """
    if not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"num_layers must be a positive integer, got {num_layers!r}")
    if num_layers in _PAPER_LSUB:
        return _PAPER_LSUB[num_layers]
    return tuple(sorted({max(1, round(j * num_layers / 7)) for j in range(1, 8)}))


def validate_lsub(lsub: Sequence[int], num_layers: Optional[int] = None) -> tuple[int, ...]:
    """Check a probe set and return it as a tuple of Python ints.

    L_sub must be non-empty, strictly increasing, without duplicates, and every layer
    must lie in 1..num_layers (the upper bound is skipped when num_layers is None).
    Raises ValueError with the offending layers.
    """
    try:
        layers = tuple(lsub)
    except TypeError:
        raise ValueError(f"L_sub must be a sequence of layer indices, got {lsub!r}") from None
    if not layers:
        raise ValueError("L_sub is empty: probe at least one layer")
    for l in layers:
        if isinstance(l, (bool, np.bool_)) or not isinstance(l, (int, np.integer)):
            raise ValueError(f"L_sub entries must be integers, got {l!r} in {layers}")
    layers = tuple(int(l) for l in layers)
    top = "L" if num_layers is None else str(num_layers)
    bad = [l for l in layers if l < 1 or (num_layers is not None and l > num_layers)]
    if bad:
        raise ValueError(f"L_sub layers {bad} out of range 1..{top} (got {layers})")
    dup = sorted({l for l in layers if layers.count(l) > 1})
    if dup:
        raise ValueError(f"L_sub has duplicated layers {dup} (got {layers})")
    if list(layers) != sorted(layers):
        raise ValueError(f"L_sub must be sorted in increasing order, got {layers}")
    return layers


def validate_tau(tau: Any) -> Any:
    """Check a collapse threshold (nats): finite and > 0, every value of an array (a
    sweep); a traced one is not checked (`traced_fields.concrete`). Returns a single
    concrete value as a float, anything else as it is."""
    values = concrete(tau)
    if values is None:
        return tau
    try:
        values = np.asarray(values, np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"tau must be a positive number of nats, got {tau!r}") from None
    if not (np.all(np.isfinite(values)) and np.all(values > 0)):
        raise ValueError(f"tau must be a positive finite number of nats, got {tau!r}")
    return float(values) if values.ndim == 0 else tau


@functools.partial(register_traced_dataclass, traced=lambda cls: ("tau",))
@dataclasses.dataclass(frozen=True)
class LensConfig:
    """Lens settings: probed layers L_sub and collapse threshold tau (nats).

    A pytree whose leaf is tau, data of the compiled program (one program for every
    threshold; `traced_fields`); L_sub is static, part of it. The constructor checks what
    it can without a model (L_sub shape, tau); use `validate_for(num_layers)` or
    `LensConfig.default(num_layers)` to also check the range. (How the model streams the
    vocabulary is the model's business: `models.TransformerLM.lens_chunk`.)
    """

    lsub: tuple[int, ...]
    tau: float = DEFAULT_TAU

    def __post_init__(self):
        object.__setattr__(self, "lsub", validate_lsub(self.lsub))
        object.__setattr__(self, "tau", validate_tau(self.tau))

    @classmethod
    def default(cls, num_layers: int, tau: float = DEFAULT_TAU,
                lsub: Optional[Sequence[int]] = None) -> "LensConfig":
        """The LensConfig of a model with `num_layers` blocks: `lsub` (None: the default
        grid `default_lsub(num_layers)`) checked against the model, and `tau`."""
        lsub = default_lsub(num_layers) if lsub is None else lsub
        return cls(lsub=lsub, tau=tau).validate_for(num_layers)

    def validate_for(self, num_layers: int) -> "LensConfig":
        """Raise ValueError unless every probed layer is in 1..num_layers; returns self."""
        validate_lsub(self.lsub, num_layers)
        return self


def collapse_depth(entropy: Array, lsub: Sequence[int], num_layers: int, tau) -> Array:
    """Per-token collapse depth d_t = min{l in L_sub : H_l(t) <= tau}, else L.

    entropy: [K, ...] fp32, row k holding H at layer lsub[k] (K = len(lsub)).
    lsub, num_layers: static Python values. tau: a Python float (checked) or a traced
    scalar (not checked: jit/vmap over tau is allowed). A NaN entropy never counts as
    collapsed. Returns int32 [...].
    """
    lsub = validate_lsub(lsub, num_layers)
    if isinstance(tau, (int, float)):
        validate_tau(tau)
    entropy = jnp.asarray(entropy)
    if entropy.ndim < 1 or entropy.shape[0] != len(lsub):
        raise ValueError(f"entropy has shape {entropy.shape}; expected [{len(lsub)}, ...] "
                         f"for L_sub {lsub}")
    depth = jnp.asarray(lsub, jnp.int32).reshape((-1,) + (1,) * (entropy.ndim - 1))
    candidates = jnp.where(entropy <= tau, depth, jnp.int32(num_layers))
    return jnp.min(candidates, axis=0)


# `masked_sum` under batch invariance: positions per block (fixed shapes: see there).
SUM_BLOCK = 128
# Rows per tile of the samplers' per-row reductions under batch invariance (`masked_sum`,
# the vocabulary densities of `generation.decode_step`, the per-prompt weights of SMC):
# each is then compiled for this many rows whatever the batch
# (`tiling.row_tiled`), so a row's result does not depend on the others
# (issue 16). None (no tiles) otherwise.
SUM_ROWS = 8


def sum_rows(batch_invariant: bool):
    """Rows per tile of the samplers' own reductions: SUM_ROWS under batch invariance
    (`CausalLM.batch_invariant`), else None (one reduction over the whole batch)."""
    return SUM_ROWS if batch_invariant else None


def masked_sum(values: Array, mask: Array, batch_invariant: bool = False) -> Array:
    """Sum of `values` over the last axis where `mask` is True, in fp32.
    values: [..., N]; mask: [..., N] bool. Returns fp32 [...].

    batch_invariant: sum in an order fixed by the positions alone: blocks of SUM_BLOCK
    positions are reduced for tiles of SUM_ROWS rows (one compiled [SUM_ROWS, SUM_BLOCK]
    reduction) and added one block after another (at least two trips: XLA inlines a loop
    of one). A row's sum is then bit for bit the same whatever the other rows, their
    number and the buffer length (zeros past the end add exactly nothing). A plain sum
    over [B, N] is not: XLA picks the reduction order for the compiled shape (measured on
    CPU: a DEGS-MCMC answer's mean final entropy changed by an ulp between a prompt alone
    and in a batch of 8). Off, one `jnp.sum` (faster on CPU)."""
    values = jnp.where(jnp.asarray(mask, bool), jnp.asarray(values, jnp.float32), 0.0)
    if not batch_invariant:
        return jnp.sum(values, axis=-1)
    N = values.shape[-1]
    blocks = max(2, -(-N // SUM_BLOCK))
    values = jnp.pad(values, [(0, 0)] * (values.ndim - 1) + [(0, blocks * SUM_BLOCK - N)])

    def tile_sum(tile):  # [SUM_ROWS, blocks·SUM_BLOCK] -> [SUM_ROWS]
        by_block = tile.reshape(SUM_ROWS, blocks, SUM_BLOCK).transpose(1, 0, 2)  # contiguous blocks
        return jax.lax.fori_loop(0, blocks, lambda i, acc: acc + jnp.sum(by_block[i], axis=-1),
                                 jnp.zeros((SUM_ROWS,), jnp.float32))

    return row_tiled(tile_sum, values, SUM_ROWS)


def span_sum(values: Array, start: Array, end: Array, batch_invariant: bool = False) -> Array:
    """sum_b values[b, start[b]:end[b]] of [B, S] values (a `masked_sum`)."""
    pos = jnp.arange(values.shape[1])[None]
    return masked_sum(values, (pos >= start[:, None]) & (pos < end[:, None]), batch_invariant)


def masked_mean(values: Array, mask: Array, batch_invariant: bool = False) -> Array:
    """Mean of `values` over the last axis where `mask` is True, 0 where nothing is.

    values: [..., N] (any real dtype, averaged in fp32); mask: [..., N] bool.
    batch_invariant: as in `masked_sum`. Returns fp32 [...].
    """
    mask = jnp.asarray(mask, bool)
    total = masked_sum(values, mask, batch_invariant)
    count = jnp.sum(mask, axis=-1)
    return jnp.where(count > 0, total / jnp.maximum(count, 1), 0.0)


def sequence_depth(depth: Array, mask: Array, num_layers: int) -> Array:
    """Sequence collapse depth D(x) = mean of d_t / L over scored tokens (0 if none).

    depth: [..., N] int d_t; mask: [..., N] bool, True exactly for the generated tokens
    that are scored (prompt, EOS and padding False). Returns fp32 [...] in [0, 1].

    Computed as (integer sum of d_t) / (count · L), one correctly rounded division:
    the integer sum is exact in any order, so D(x) is bit for bit the same whatever the
    batch, the buffer length or the reduction order XLA picks for the compiled shape (a
    float mean of d_t / L is not: summing thirds in another order changed D(x) by an ulp,
    and DEGS-SMC's weights with it, between a prompt decoded alone and in a batch).
    """
    mask = jnp.asarray(mask, bool)
    total = jnp.sum(jnp.where(mask, jnp.asarray(depth, jnp.int32), 0), axis=-1)
    count = jnp.sum(mask, axis=-1, dtype=jnp.int32)
    return jnp.where(count > 0, total.astype(jnp.float32)
                     / (jnp.maximum(count, 1) * num_layers).astype(jnp.float32), 0.0)


def mean_final_entropy(entropy: Array, mask: Array, batch_invariant: bool = False) -> Array:
    """Final-layer entropy H_L averaged like D(x) (Best-of-N-Entropy's score).

    entropy: [..., N] fp32 H_L(t); mask: [..., N] bool as in `sequence_depth`;
    batch_invariant: as in `masked_sum`. Returns fp32 [...], 0 for an empty completion.
    """
    return masked_mean(entropy, mask, batch_invariant)
