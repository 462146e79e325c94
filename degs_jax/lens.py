"""Logit lens and collapse depth (DESIGN.md section 3).

Layer entropy `H_l(t)` is the entropy, in nats, of `softmax(W_U · RMSNorm_final(h_l(t)))`
where `h_l(t)` is the residual after block `l` at the position of token `x_t` (layer
numbering as HF `hidden_states`: 0 = embeddings, l = after block l, L = last block).
The model's forward pass computes it fused with the output head, streaming the
vocabulary in chunks (`degs_jax.models.transformer.streamed_head`); this module picks
the layers, turns entropies into collapse depths and averages them over sequences.

Shapes: K = probed layers, B = batch rows, T / N = positions, L = number of blocks.
Everything here is fp32: entropies are differences of quantities of size ~log V and a
threshold test `H <= tau` at tau = 0.25 nats must not flip from bf16 rounding.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .models import ModelConfig, Params, forward

Array = jax.Array

DEFAULT_TAU = 0.25  # nats
# Vocabulary chunk of the streamed lens; None lets the model pick (one block for
# decode-sized probes, 8192-entry chunks for large ones: models.transformer.streamed_head).
DEFAULT_CHUNK = None

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


def validate_tau(tau: float) -> float:
    """Check a concrete collapse threshold (nats): finite and > 0. Returns it as float."""
    try:
        value = float(tau)
    except (TypeError, ValueError):
        raise ValueError(f"tau must be a positive number of nats, got {tau!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"tau must be a positive finite number of nats, got {tau!r}")
    return value


@dataclasses.dataclass(frozen=True)
class LensConfig:
    """Static lens settings: probed layers, collapse threshold and vocabulary chunk.

    Frozen and hashable, so it can be a static argument of jitted samplers. The
    constructor checks what it can without a model (L_sub shape, tau, chunk); use
    `validate_for(num_layers)` or `LensConfig.default(cfg)` to also check the range.
    """

    lsub: tuple[int, ...]
    tau: float = DEFAULT_TAU
    chunk: Optional[int] = DEFAULT_CHUNK

    def __post_init__(self):
        object.__setattr__(self, "lsub", validate_lsub(self.lsub))
        object.__setattr__(self, "tau", validate_tau(self.tau))
        if self.chunk is not None:
            if isinstance(self.chunk, bool) or not isinstance(self.chunk, (int, np.integer)) or self.chunk < 1:
                raise ValueError(f"lens chunk must be a positive integer or None, got {self.chunk!r}")
            object.__setattr__(self, "chunk", int(self.chunk))

    @classmethod
    def default(cls, cfg: ModelConfig, tau: float = DEFAULT_TAU, chunk: Optional[int] = DEFAULT_CHUNK) -> "LensConfig":
        """The default L_sub of `cfg.num_layers` with the given tau and chunk."""
        return cls(lsub=default_lsub(cfg.num_layers), tau=tau, chunk=chunk)

    def validate_for(self, num_layers: int) -> "LensConfig":
        """Raise ValueError unless every probed layer is in 1..num_layers; returns self."""
        validate_lsub(self.lsub, num_layers)
        return self


def layer_entropies(params: Params, cfg: ModelConfig, tokens: Array, positions: Array,
                    layers: Sequence[int], chunk: Optional[int] = DEFAULT_CHUNK,
                    tuned_lens=None) -> Array:
    """Logit-lens entropies H_l at every position, fp32 nats, shape [K, B, T].

    tokens, positions: [B, T] int32 (padding as in `forward`); layers: static indices
    in 0..L (K = len(layers)), in the order of the output rows. Runs one full forward
    without a cache; the output logits are only requested at entry 0 of each row so
    that no [B, T, V] array is built. tuned_lens: a `train.tuned_lens.TunedLens` to
    read the residuals through its translators (None: the logit lens).
    """
    tokens = jnp.asarray(tokens, jnp.int32)
    layers = tuple(int(l) for l in layers)
    out = forward(params, cfg, tokens, jnp.asarray(positions, jnp.int32),
                  lens_layers=layers,
                  lens_chunk=None if chunk is None else int(chunk),
                  logits_at=jnp.zeros(tokens.shape[:1], jnp.int32),
                  lens_translators=None if tuned_lens is None else tuned_lens.translators_for(layers))
    return out.lens.entropy


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


def masked_mean(values: Array, mask: Array) -> Array:
    """Mean of `values` over the last axis where `mask` is True, 0 where nothing is.

    values: [..., N] (any real dtype, averaged in fp32); mask: [..., N] bool.
    Returns fp32 [...].
    """
    mask = jnp.asarray(mask, bool)
    values = jnp.asarray(values, jnp.float32)
    total = jnp.sum(jnp.where(mask, values, 0.0), axis=-1)
    count = jnp.sum(mask, axis=-1)
    return jnp.where(count > 0, total / jnp.maximum(count, 1), 0.0)


def sequence_depth(depth: Array, mask: Array, num_layers: int) -> Array:
    """Sequence collapse depth D(x) = mean of d_t / L over scored tokens (0 if none).

    depth: [..., N] int d_t; mask: [..., N] bool, True exactly for the generated tokens
    that are scored (prompt, EOS and padding False). Returns fp32 [...] in [0, 1].
    """
    return masked_mean(jnp.asarray(depth, jnp.float32) / num_layers, mask)


def mean_final_entropy(entropy: Array, mask: Array) -> Array:
    """Final-layer entropy H_L averaged like D(x) (Best-of-N-Entropy's score).

    entropy: [..., N] fp32 H_L(t); mask: [..., N] bool as in `sequence_depth`.
    Returns fp32 [...], 0 for an empty completion.
    """
    return masked_mean(entropy, mask)


class EntropyTrajectory(NamedTuple):
    """Mean logit-lens entropy per layer over a set of sequences (numpy, float64).

    layers: [K] the probed layer indices. mean: [K] average over all scored tokens
    pooled together. per_sequence: [S, K] each sequence's own mean (NaN if it has no
    scored token). num_tokens: [S] scored tokens per sequence.
    """

    layers: np.ndarray
    mean: np.ndarray
    per_sequence: np.ndarray
    num_tokens: np.ndarray


def entropy_trajectory(params: Params, cfg: ModelConfig,
                       sequences: Sequence[tuple[Sequence[int], Sequence[bool]]],
                       layers: Optional[Sequence[int]] = None, batch_size: int = 8,
                       bucket: int = 64, chunk: Optional[int] = DEFAULT_CHUNK,
                       pad_id: int = 0, tuned_lens=None) -> EntropyTrajectory:
    """Layer-entropy trajectory (the paper's Figure 1) over a set of completions.

    sequences: S pairs (tokens [N_i] ints, mask [N_i] bools) holding prompt +
    completion; mask is True at the completion tokens to score (EOS excluded), whose
    H_l(t) is read at their own positions. layers: indices in 0..L, default all of
    0..L. Rows are right-padded to a multiple of `bucket` (bounding recompiles) and run
    `batch_size` at a time; padding is masked out and does not change the result.
    tuned_lens: read the residuals through a tuned lens (None: the logit lens).
    """
    L = cfg.num_layers
    layers = tuple(range(L + 1)) if layers is None else tuple(int(l) for l in layers)
    bad = [l for l in layers if not 0 <= l <= L]
    if not layers or bad:
        raise ValueError(f"trajectory layers must be a non-empty subset of 0..{L}, got {layers}")
    if batch_size < 1 or bucket < 1:
        raise ValueError("batch_size and bucket must be positive")
    rows = []
    for i, (toks, mask) in enumerate(sequences):
        toks, mask = np.asarray(toks, np.int32), np.asarray(mask, bool)
        if toks.ndim != 1 or toks.shape != mask.shape or toks.size == 0:
            raise ValueError(f"sequence {i}: tokens {toks.shape} and mask {mask.shape} "
                             "must be equal non-empty 1-D shapes")
        rows.append((toks, mask))
    if not rows:
        raise ValueError("entropy_trajectory needs at least one sequence")

    batch_size = min(batch_size, len(rows))
    sums = np.zeros((len(rows), len(layers)))
    counts = np.zeros(len(rows), np.int64)
    for start in range(0, len(rows), batch_size):
        group = rows[start:start + batch_size]
        width = -(-max(t.size for t, _ in group) // bucket) * bucket
        tokens = np.full((batch_size, width), pad_id, np.int32)  # fixed batch: one compile
        mask = np.zeros((batch_size, width), bool)
        for r, (t, m) in enumerate(group):
            tokens[r, :t.size], mask[r, :m.size] = t, m
        # Padding keeps counting positions, so it never precedes a real token's slot.
        positions = np.broadcast_to(np.arange(width, dtype=np.int32), tokens.shape)
        ent = np.asarray(layer_entropies(params, cfg, tokens, positions, layers, chunk, tuned_lens),
                         np.float64)
        n = len(group)
        sums[start:start + n] = np.where(mask[:n], ent[:, :n], 0.0).sum(-1).T
        counts[start:start + n] = mask[:n].sum(-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        per_sequence = sums / counts[:, None]
    total = max(int(counts.sum()), 1)
    return EntropyTrajectory(layers=np.asarray(layers), mean=sums.sum(0) / total,
                             per_sequence=per_sequence, num_tokens=counts)
