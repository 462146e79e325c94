"""Teacher-forced scoring of given sequences: per-token log p, collapse depth d_t,
final-layer entropy and logit-lens entropies at any layers, from one pass through the
model's step function (`degs_jax.model_api.CausalLM`).

The teacher-forced path of the package: `degs probe`, the L_sub sweep of the
analyses, entropy trajectories (the paper's Figure 1) and `score_candidate` (the pure,
vmappable statistics of one sequence) all run `token_stats`. The study's layer pass,
which needs lens entropies at every layer but only at the completions' tokens, runs
`completion_layer_entropies`: the prompts without the lens, then the completions on
their cache with it.

Numerics. The sequence runs through the model `positions_per_call` positions at a time
with a KV cache (a `lax.scan` over position chunks), so the [B, T, V] logits never
exist at once: each call's [B, C, V] fp32 block is reduced right away to
log p(x_{t+1} | x_<=t) = log_softmax(z_t)[x_{t+1}] and H_L(t) = -sum p log p, the same
fp32 formulas generation records (`generation.decode_step`). Values therefore agree
with the ones recorded during generation up to floating-point summation order (the
cached single-token step and this chunked pass tile their matmuls differently).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .lens import LensConfig, collapse_depth, mean_final_entropy, sequence_depth
from .model_api import CausalLM, params_dtype

Array = jax.Array

# Bytes of the fp32 logits block of one call: positions per call = this / (B · V · 4).
LOGITS_BLOCK_BYTES = 2**28


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TokenStats:
    """Per-position statistics of a batch of sequences, [B, T] (fp32 unless noted)."""

    logp: Array  # log p(x_t | x_<t) at t >= 1; 0 at t = 0
    depth: Optional[Array]  # int32 d_t from the residuals at position t; None without a lens
    final_entropy: Array  # H_L(t): entropy of the next-token distribution at position t
    layer_entropy: Optional[Array]  # [K, B, T] lens entropies at the requested `layers`


def positions_per_call(batch: int, length: int, vocab_size: int) -> int:
    """Positions per model call of `token_stats`: as many as keep the fp32 logits block
    within LOGITS_BLOCK_BYTES (at least 1, at most the sequence length)."""
    return int(max(1, min(length, LOGITS_BLOCK_BYTES // (4 * batch * vocab_size))))


def token_stats(model: CausalLM, params: Any, tokens: Array, lens: Optional[LensConfig] = None,
                layers: tuple[int, ...] = (), chunk: Optional[int] = None) -> TokenStats:
    """Teacher-forced statistics of right-padded sequences (padding is ignored: a causal
    model never lets it influence earlier positions).

    tokens: [B, T] int32. lens: the probe set and tau of d_t (None: no depth).
    layers: extra layers (0..L) whose lens entropies to return as `layer_entropy`,
    in this order (one pass serves both). chunk: positions per model call (default
    `positions_per_call`). The cache is stored in the parameters' dtype, like the
    activations of an uncached forward. Traceable (jit, vmap).
    """
    B, T = tokens.shape
    C = chunk or positions_per_call(B, T, model.vocab_size)
    n_calls = -(-T // C)
    # Positions and the empty cache enter the jitted pass as arguments: built inside it,
    # either one is a compile-time constant that XLA folds into the first layers, which
    # then round differently from generation and from a plain forward (measured: lens
    # entropies off by 1.4e-6 nats on a tiny fp32 model; as arguments, bit-identical).
    positions = jnp.broadcast_to(jnp.arange(n_calls * C, dtype=jnp.int32), (B, n_calls * C))
    cache = model.init_cache(B, n_calls * C, params_dtype(params))
    return _token_stats(model, params, jnp.asarray(tokens, jnp.int32), positions, cache, lens,
                        tuple(layers), C)


@functools.partial(jax.jit, static_argnames=("model", "layers", "C"))
def _token_stats(model: CausalLM, params: Any, tokens: Array, positions: Array, cache: Any,
                 lens: Optional[LensConfig], layers: tuple[int, ...], C: int) -> TokenStats:
    B, T = tokens.shape
    n_calls = positions.shape[1] // C
    padded = jnp.zeros((B, n_calls * C), jnp.int32).at[:, :T].set(tokens)
    following = jnp.concatenate([padded[:, 1:], jnp.zeros((B, 1), jnp.int32)], axis=1)
    lsub = () if lens is None else tuple(lens.lsub)
    probed = tuple(sorted(set(lsub) | set(layers)))

    def one_call(cache, start):
        tok = jax.lax.dynamic_slice_in_dim(padded, start, C, axis=1)
        pos = jax.lax.dynamic_slice_in_dim(positions, start, C, axis=1)
        with jax.named_scope("model_step"):
            out = model.step(params, tok, pos, cache, probed)
        logp_all = jax.nn.log_softmax(out.logits, axis=-1)  # [B, C, V]
        nxt = jax.lax.dynamic_slice_in_dim(following, start, C, axis=1)
        logp_next = jnp.take_along_axis(logp_all, nxt[..., None], axis=-1)[..., 0]
        h_final = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
        return out.cache, (logp_next, h_final, out.layer_entropy)

    if n_calls == 1:  # no loop: XLA compiles the plain forward (same numbers as an uncached one)
        _, outputs = one_call(cache, 0)
        logp_next, h_final, entropy = jax.tree.map(lambda a: a[None], outputs)
    else:
        starts = jnp.arange(n_calls, dtype=jnp.int32) * C
        _, (logp_next, h_final, entropy) = jax.lax.scan(one_call, cache, starts)
    by_position = lambda a: jnp.moveaxis(a, 0, -2).reshape(*a.shape[1:-1], n_calls * C)[..., :T]
    logp_next, h_final = by_position(logp_next), by_position(h_final)  # [B, T]
    logp = jnp.concatenate([jnp.zeros((B, 1), jnp.float32), logp_next[:, :-1]], axis=1)
    entropy = None if entropy is None else by_position(entropy)  # [K, B, T]
    at = lambda wanted: _rows(entropy, [probed.index(l) for l in wanted])
    depth = None if lens is None else collapse_depth(at(lsub), lsub, model.num_layers, lens.tau)
    layer_entropy = at(layers) if layers else None
    return TokenStats(logp=logp, depth=depth, final_entropy=h_final, layer_entropy=layer_entropy)


def _rows(a: Array, rows: list[int]) -> Array:
    """a[rows] by static slices (no gather when the rows are all of a, in order)."""
    return a if rows == list(range(a.shape[0])) else jnp.stack([a[r] for r in rows])


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class CandidateScores:
    """The statistics of one completion (or, batched, of a pool)."""

    log_p: Array  # log p(x) of the completion (its EOS included)
    depth: Array  # D(x) = mean d_t / L over the scored tokens (0 if none)
    final_entropy: Array  # mean H_L(t) over the scored tokens (Best-of-N-Entropy's score)
    token_depth: Array  # [T] int32 d_t at every position (meaningful where `scored`)
    scored: Array  # [T] bool: completion tokens before a final EOS


def score_candidate(model: CausalLM, params: Any, tokens: Array, prompt_len: Array,
                    length: Array, ended: Array, lens: LensConfig) -> CandidateScores:
    """Teacher-forced log p(x), D(x) and mean final-layer entropy of ONE sequence.

    tokens: [T] int32 prompt + completion, right-padded; prompt_len, length: int32
    scalars (completion = slots prompt_len..length-1); ended: bool scalar, the last
    token is EOS (not scored: docs/design.md §3). Pure and traceable: `jax.vmap` it over a pool
    ([N, T] tokens, [N] lengths) inside your own jitted code; it equals the batched
    `token_stats` path.
    """
    stats = token_stats(model, params, tokens[None], lens)
    pos = jnp.arange(tokens.shape[0])
    completion = (pos >= prompt_len) & (pos < length)
    scored = completion & ~(ended & (pos == length - 1))
    return CandidateScores(
        log_p=jnp.sum(jnp.where(completion, stats.logp[0], 0.0)),
        depth=sequence_depth(stats.depth[0], scored, model.num_layers),
        final_entropy=mean_final_entropy(stats.final_entropy[0], scored),
        token_depth=stats.depth[0], scored=scored)


def _batches(sequences: Sequence[np.ndarray], batch_size: int, bucket: int, max_context: int):
    """Yield (first index, [batch_size, W] int32 right-padded tokens) over `sequences`,
    W a multiple of `bucket` capped at the context (a fixed batch: one compile per W)."""
    for start in range(0, len(sequences), batch_size):
        group = sequences[start:start + batch_size]
        longest = max(len(s) for s in group)
        if longest > max_context:
            raise ValueError(f"sequence of {longest} tokens exceeds the model context ({max_context})")
        width = min(-(-longest // bucket) * bucket, max_context)
        tokens = np.zeros((min(batch_size, len(sequences)), width), np.int32)
        for r, s in enumerate(group):
            tokens[r, : len(s)] = s
        yield start, tokens


def score_sequences(model: CausalLM, params: Any, prompts: Sequence[Sequence[int]],
                    completions: Sequence[Sequence[int]], lens: LensConfig,
                    eos_ids: Sequence[int] = (), batch_size: int = 8, bucket: int = 64,
                    layers: tuple[int, ...] = ()) -> list[dict]:
    """log p(x), D(x) and mean final-layer entropy of each completion given its prompt.

    Returns a list of dicts (one per completion) with `log_p`, `depth`, `final_entropy`,
    `n_tokens`, `ended`, the per-token `token_depth` list (scored tokens only) and, for
    the requested `layers`, `layer_entropy_sum` ([K] sums of H_l over the scored tokens)
    and `n_scored`. Sequences run `batch_size` at a time, right-padded to a multiple of
    `bucket` tokens (bounding recompiles).
    """
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
    eos = set(eos_ids)
    seqs = [np.asarray(list(p) + list(c), np.int32) for p, c in zip(prompts, completions)]
    results = []
    for start, tokens in _batches(seqs, batch_size, bucket, model.max_context):
        stats = jax.device_get(token_stats(model, params, jnp.asarray(tokens), lens, tuple(layers)))
        for r in range(min(batch_size, len(seqs) - start)):
            i = start + r
            P, n = len(prompts[i]), len(completions[i])
            ended = n > 0 and completions[i][-1] in eos
            scored = np.zeros(tokens.shape[1], bool)
            scored[P: P + n - int(ended)] = True
            record = {
                "log_p": float(stats.logp[r, P: P + n].sum()),
                "depth": float(sequence_depth(stats.depth[r], scored, model.num_layers)),
                "final_entropy": float(mean_final_entropy(stats.final_entropy[r], scored)),
                "n_tokens": n, "ended": bool(ended),
                "token_depth": stats.depth[r, scored].tolist(),
            }
            if layers:
                record["layer_entropy_sum"] = stats.layer_entropy[:, r, scored].astype(np.float64).sum(-1)
                record["n_scored"] = int(scored.sum())
            results.append(record)
    return results


def layer_entropies(model: CausalLM, params: Any, tokens: Array, layers: Sequence[int]) -> Array:
    """Logit-lens entropies H_l at every position, fp32 nats, shape [K, B, T].

    tokens: [B, T] int32 (right-padded); layers: indices in 0..L (K = len(layers)), in
    the order of the output rows.
    """
    return token_stats(model, params, jnp.asarray(tokens, jnp.int32), None,
                       tuple(int(l) for l in layers)).layer_entropy


def completion_layer_entropies(model: CausalLM, params: Any, prompts: Array, prompt_lengths: Array,
                               completions: Array, completion_lengths: Array, layers: Sequence[int]) -> Array:
    """Logit-lens entropies H_l at each completion token's own position, fp32 nats,
    shape [K, B, N]: entry [k, b, j] is `layer_entropies`' value at position
    prompt_lengths[b] + j of the sequence prompt + completion of row b.

    prompts: [B, P] int32, right-padded, with `prompt_lengths` [B]; completions: [B, N]
    int32, right-padded, with `completion_lengths` [B]; layers: indices in 0..L (K =
    len(layers)), in the order of the output rows. The prompts run through the model
    without the lens (their logits are never read, so no unembedding either), then the
    completions in one call on that cache with it: the lens's vocabulary products run
    at the N completion positions only, where `layer_entropies` over the whole sequences
    runs them at every prompt position too (P + N positions, K + 1 products each).
    Padding runs at a parked position (one past the cache's slots: the model protocol's
    point 3, it writes nothing); its entries mean nothing. The values equal
    `layer_entropies`' up to floating-point summation order (cached attention over the
    prompt, as in generation)."""
    B, P = prompts.shape
    N = completions.shape[1]
    prompt_lengths = jnp.asarray(prompt_lengths, jnp.int32)[:, None]
    completion_lengths = jnp.asarray(completion_lengths, jnp.int32)[:, None]
    parked = P + N
    # Positions and the empty cache enter the jitted pass as arguments (see `token_stats`).
    slot = jnp.arange(P, dtype=jnp.int32)[None]
    prompt_positions = jnp.where(slot < prompt_lengths, slot, parked)
    offset = jnp.arange(N, dtype=jnp.int32)[None]
    completion_positions = jnp.where(offset < completion_lengths, prompt_lengths + offset, parked)
    cache = model.init_cache(B, P + N, params_dtype(params))
    return _completion_layer_entropies(model, params, jnp.asarray(prompts, jnp.int32), prompt_positions,
                                       jnp.asarray(completions, jnp.int32), completion_positions, cache,
                                       tuple(int(l) for l in layers))


@functools.partial(jax.jit, static_argnames=("model", "layers"))
def _completion_layer_entropies(model: CausalLM, params: Any, prompts: Array, prompt_positions: Array,
                                completions: Array, completion_positions: Array, cache: Any,
                                layers: tuple[int, ...]) -> Array:
    with jax.named_scope("prompt_step"):
        cache = model.step(params, prompts, prompt_positions, cache).cache
    with jax.named_scope("completion_step"):
        return model.step(params, completions, completion_positions, cache, layers).layer_entropy


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

    @classmethod
    def from_sums(cls, layers: Sequence[int], sums: np.ndarray, counts: np.ndarray) -> "EntropyTrajectory":
        """From per-sequence sums of H_l over scored tokens ([S, K]) and counts ([S])."""
        sums, counts = np.asarray(sums, np.float64), np.asarray(counts, np.int64)
        with np.errstate(invalid="ignore", divide="ignore"):
            per_sequence = sums / counts[:, None]
        total = max(int(counts.sum()), 1)
        return cls(layers=np.asarray(layers), mean=sums.sum(0) / total, per_sequence=per_sequence,
                   num_tokens=counts)


def _trajectory_layers(layers: Optional[Sequence[int]], num_layers: int) -> tuple[int, ...]:
    """The layers of an entropy trajectory: default all of 0..L; ValueError if out of range."""
    layers = tuple(range(num_layers + 1)) if layers is None else tuple(int(l) for l in layers)
    bad = [l for l in layers if not 0 <= l <= num_layers]
    if not layers or bad:
        raise ValueError(f"trajectory layers must be a non-empty subset of 0..{num_layers}, got {layers}")
    return layers


def entropy_trajectory(model: CausalLM, params: Any,
                       sequences: Sequence[tuple[Sequence[int], Sequence[bool]]],
                       layers: Optional[Sequence[int]] = None, batch_size: int = 8,
                       bucket: int = 64) -> EntropyTrajectory:
    """Layer-entropy trajectory (the paper's Figure 1) over a set of completions.

    sequences: S pairs (tokens [N_i] ints, mask [N_i] bools) holding prompt +
    completion; mask is True at the completion tokens to score (EOS excluded), whose
    H_l(t) is read at their own positions. layers: indices in 0..L, default all of
    0..L. Rows are right-padded to a multiple of `bucket` (bounding recompiles) and run
    `batch_size` at a time; padding is masked out and does not change the result.
    """
    layers = _trajectory_layers(layers, model.num_layers)
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
    sums = np.zeros((len(rows), len(layers)))
    counts = np.zeros(len(rows), np.int64)
    for start, tokens in _batches([t for t, _ in rows], batch_size, bucket, model.max_context):
        ent = np.asarray(layer_entropies(model, params, tokens, layers), np.float64)
        for r, (_, m) in enumerate(rows[start:start + batch_size]):
            sums[start + r] = ent[:, r, :m.size][:, m].sum(-1)
            counts[start + r] = m.sum()
    return EntropyTrajectory.from_sums(layers, sums, counts)
