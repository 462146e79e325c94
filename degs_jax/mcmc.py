"""Metropolis-Hastings power sampling (beta = 0) and DEGS-MCMC (beta > 0), DESIGN §4.

Target pi(x) ∝ p(x)^alpha · exp(beta · D(x)) over completions, built block by block.
For block k a chain first extends its completion with the proposal
q = softmax(alpha · log p) (optionally truncated) to EOS or the block boundary, then
runs `mh_steps` Metropolis-Hastings steps: cut m ~ Uniform{0..n_x-1}, keep x_<m,
regenerate from m to EOS or the boundary, accept with probability min(1, r),

  log r = alpha·[log p(x'_{m:}) - log p(x_{m:})] + [log q(x_{m:}) - log q(x'_{m:})]
        + beta·[D(x') - D(x)] + log n_x - log n_x',

with whole-suffix sums of the per-token values stored when each token was generated.
All rows (problems x chains) run in one batch; the MH steps of a block are one jitted
`lax.while_loop` of decode steps in which every row runs its own steps (`mh_steps`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp

from .generation import GenState, SamplerSpec, decode_step, generate, select_rows
from .lens import LensConfig, sequence_depth
from .models import KVCache, LensTranslators, ModelConfig, Params

Array = jax.Array

# Reference-code behaviour reproduced by `reference_quirks=True`.
QUIRKS_TOP_K = 50


@dataclasses.dataclass(frozen=True)
class MCMCConfig:
    """Hyperparameters of the chain (static: part of the compiled program).

    alpha: power (proposal temperature 1/alpha); beta: weight of D(x) (0 = power
    sampling, no probing); block_len, num_blocks: the block schedule (max new tokens =
    block_len · num_blocks); mh_steps: MH steps per block; lens: layers and tau for
    D(x) (required when beta > 0); top_k / top_p: optional proposal truncation (log q
    is then the truncated density); reference_quirks: reproduce the public reference
    implementation (top-k 50, proposals capped at the current length, no cut-index
    ratio, current suffix truncated to the proposal's length) for side-by-side runs.
    """

    alpha: float = 4.0
    beta: float = 5.0
    block_len: int = 192
    num_blocks: int = 16
    mh_steps: int = 10
    lens: Optional[LensConfig] = None
    eos_ids: tuple[int, ...] = ()
    top_k: int = 0
    top_p: float = 1.0
    reference_quirks: bool = False

    def __post_init__(self):
        if not self.alpha >= 1.0:
            raise ValueError(f"alpha must be >= 1 (the proposal temperature is 1/alpha), got {self.alpha}")
        if not self.beta >= 0.0:
            raise ValueError(f"beta must be >= 0, got {self.beta}")
        for name in ("block_len", "num_blocks", "mh_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.beta > 0 and self.lens is None:
            raise ValueError("beta > 0 needs a LensConfig (layers and tau) to compute D(x)")

    @property
    def max_new_tokens(self) -> int:
        return self.block_len * self.num_blocks

    @property
    def proposal(self) -> SamplerSpec:
        return SamplerSpec(
            temperature=1.0 / self.alpha,
            top_k=QUIRKS_TOP_K if self.reference_quirks and not self.top_k else self.top_k,
            top_p=self.top_p, eos_ids=self.eos_ids,
            lens=self.lens if self.beta > 0 else None)


def _suffix_sum(values: Array, start: Array, end: Array) -> Array:
    """sum_b values[b, start[b]:end[b]] for [B, S] values."""
    pos = jnp.arange(values.shape[1])[None]
    mask = (pos >= start[:, None]) & (pos < end[:, None])
    return jnp.sum(jnp.where(mask, values, 0.0), axis=1)


def _depth_score(state: GenState, cfg: ModelConfig) -> Array:
    return sequence_depth(state.depth, state.completion_mask(scored=True), cfg.num_layers)


def log_acceptance_ratio(current: GenState, proposal: GenState, cut: Array, cfg: ModelConfig,
                         mc: MCMCConfig) -> Array:
    """log r of DESIGN §4 for every row, [B] fp32, from stored per-token values only."""
    x_end = current.length
    if mc.reference_quirks:
        x_end = jnp.minimum(current.length, proposal.length)
    log_r = (mc.alpha * (_suffix_sum(proposal.logp, cut, proposal.length)
                         - _suffix_sum(current.logp, cut, x_end))
             + _suffix_sum(current.logq, cut, x_end)
             - _suffix_sum(proposal.logq, cut, proposal.length))
    if mc.beta > 0:
        log_r += mc.beta * (_depth_score(proposal, cfg) - _depth_score(current, cfg))
    if not mc.reference_quirks:
        n_x = (current.length - current.prompt_len).astype(jnp.float32)
        n_y = (proposal.length - proposal.prompt_len).astype(jnp.float32)
        log_r += jnp.log(n_x) - jnp.log(n_y)
    return log_r


def _row_keys(keys: Array, *tags: int | Array) -> Array:
    for tag in tags:
        keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, tag)
    return keys


_COUNTERS = ("n_generated", "n_forward", "n_probed")


# Rows copied per gather/scatter in `_copy_cache_rows`.
_ROWS_PER_COPY = 8


def _copy_cache_rows(current: KVCache, proposal: KVCache, rows: Array, take_proposal: Array):
    """For every row r with rows[r]: both caches' row r := proposal's if take_proposal[r]
    else current's. Rows go _ROWS_PER_COPY at a time through one gather and in-place
    scatters (a full-cache select would move the whole cache on every step that ends a
    proposal); with the batch split over a mesh, XLA partitions the gather and scatters
    per device (a dynamic slice of the split batch axis would all-gather the cache)."""
    B = rows.shape[0]
    R = min(B, _ROWS_PER_COPY)
    order = jnp.nonzero(rows, size=B + R, fill_value=B)[0]  # B: out of range, dropped

    def copy_chunk(i, caches):
        cur, prop = caches
        idx = jax.lax.dynamic_slice_in_dim(order, i * R, R)
        take = take_proposal[jnp.minimum(idx, B - 1)][None, :, None, None, None]
        rows_of = lambda a: jnp.take(a, idx, axis=1, mode="clip")  # [L, R, ...]
        put = lambda a, v: a.at[:, idx].set(v, mode="drop")
        k = jnp.where(take, rows_of(prop.k), rows_of(cur.k))
        v = jnp.where(take, rows_of(prop.v), rows_of(cur.v))
        return KVCache(put(cur.k, k), put(cur.v, v)), KVCache(put(prop.k, k), put(prop.v, v))

    chunks = (jnp.sum(rows) + R - 1) // R
    return jax.lax.fori_loop(0, chunks, copy_chunk, (current, proposal))


@functools.partial(jax.jit, static_argnames=("cfg", "mc"))
def mh_steps(params: Params, cfg: ModelConfig, state: GenState, keys: Array, block: Array,
             limit: Array, active: Array, mc: MCMCConfig,
             translators: Optional[LensTranslators] = None) -> tuple[GenState, Array]:
    """`mc.mh_steps` MH steps on every active row, in one jitted `lax.while_loop`.

    limit: [B] the block boundary (total length) proposals regenerate up to;
    active: [B] rows that move (others are left untouched). keys: [B] chain keys; step
    s of block k draws from fold_in(key, k, s + 1). translators: tuned-lens rows for
    `mc.lens.lsub` (None: the logit lens). Returns (state, accepted [B] int32).

    Rows advance independently: every loop iteration is one decode step of every row's
    proposal; a row whose proposal ends (EOS or the boundary) is accepted or rejected
    there and starts its next step at once, so no row idles until the batch's longest
    regeneration of the same step is done. The proposal lives in a second state whose
    rows equal the current chain's except past the cut of a running proposal; after a
    decision both rows are made equal again (row copies of the cache). A row's draws
    depend only on its key, the block and its step, so the chain is the one of running
    the steps in lock-step (or the row alone).
    """
    spec = mc.proposal
    block_keys = _row_keys(keys, block)

    def begin(current, proposal, step, starting, cut, p_limit, gen_keys):
        """Start step `step` of the rows in `starting`: draw the cut, truncate the proposal."""
        step_keys = jax.vmap(jax.random.fold_in)(block_keys, step + 1)
        k_cut, k_gen = _row_keys(step_keys, 0), _row_keys(step_keys, 1)
        n_x = current.length - current.prompt_len
        m = jax.vmap(lambda k, n: jax.random.randint(k, (), 0, jnp.maximum(n, 1)))(k_cut, n_x)
        # cut < current.length <= the proposal's limit: every proposal draws >= 1 token.
        new_cut = current.prompt_len + m
        new_limit = current.length if mc.reference_quirks else limit
        proposal = dataclasses.replace(
            proposal, length=jnp.where(starting, new_cut, proposal.length),
            ended=proposal.ended & ~starting)
        return (proposal, jnp.where(starting, new_cut, cut), jnp.where(starting, new_limit, p_limit),
                jnp.where(starting, k_gen, gen_keys))

    def body(carry):
        current, proposal, generating, step, cut, p_limit, gen_keys, accepted = carry
        proposal, still = decode_step(params, cfg, proposal, generating, p_limit, gen_keys, cut, spec,
                                      translators)
        done = generating & ~still
        step_keys = jax.vmap(jax.random.fold_in)(block_keys, step + 1)
        log_u = jnp.log(jax.vmap(jax.random.uniform)(_row_keys(step_keys, 2)))
        accept = done & (log_u < log_acceptance_ratio(current, proposal, cut, cfg, mc))
        # Both states take the decided row (caches row by row above; select_rows' own
        # cache select is replaced, so XLA drops it); the proposal keeps the work counters
        # (work on rejected proposals counts in the compute accounting).
        counters = {name: getattr(proposal, name) for name in _COUNTERS}
        k_cache, p_cache = _copy_cache_rows(current.cache, proposal.cache, done, accept)
        current = dataclasses.replace(select_rows(accept, proposal, current), cache=k_cache)
        proposal = dataclasses.replace(select_rows(done, current, proposal), cache=p_cache, **counters)
        step = step + done
        starting = done & (step < mc.mh_steps)
        proposal, cut, p_limit, gen_keys = begin(current, proposal, step, starting, cut, p_limit, gen_keys)
        return (current, proposal, (generating & still) | starting, step, cut, p_limit, gen_keys,
                accepted + accept)

    zeros = jnp.zeros(active.shape, jnp.int32)
    proposal, cut, p_limit, gen_keys = begin(state, state, zeros, active, state.length, state.length,
                                             keys)
    carry = (state, proposal, active, zeros, cut, p_limit, gen_keys, zeros)
    current, proposal, *_, accepted = jax.lax.while_loop(lambda c: jnp.any(c[2]), body, carry)
    return dataclasses.replace(current, **{name: getattr(proposal, name) for name in _COUNTERS}), accepted


@functools.partial(jax.jit, static_argnames=("cfg", "mc"))
def mcmc_block(params: Params, cfg: ModelConfig, state: GenState, keys: Array, block: Array,
               mc: MCMCConfig, translators: Optional[LensTranslators] = None
               ) -> tuple[GenState, Array, Array]:
    """Block `block` for every row: extend with the proposal to EOS or the boundary
    (block + 1)·block_len, then `mc.mh_steps` MH steps.

    state: GenState of B chains; keys: [B] chain keys (a row's randomness depends only
    on its key, the block and the step). translators: tuned-lens rows for `mc.lens.lsub`
    (None: the logit lens). Returns (state, accepted [B] int32 count,
    active [B] bool: rows that ran this block, i.e. had not ended before it).
    """
    active = ~state.ended
    boundary = jnp.minimum(state.prompt_len + (block + 1) * mc.block_len, state.max_len)
    limit = jnp.where(active, boundary, state.length)
    state = generate(params, cfg, state, limit, _row_keys(keys, block, 0), mc.proposal,
                     translators=translators)
    state, accepted = mh_steps(params, cfg, state, keys, block, limit, active, mc, translators)
    return state, accepted, active
