"""KV-cached generation as one jitted `lax.while_loop` over a state dataclass.

Sequence layout. Each row's buffer holds prompt then completion: slot t holds token
x_t at position t (no left padding; prompts of different lengths are right-padded
and the padding is overwritten as the row generates). For every generated token the
state records, at the token's own slot:

- `logp[t]  = log p(x_t | x_<t)` from the raw logits (fp32, full vocabulary);
- `logq[t]` = the log density x_t was actually sampled from (`Proposal.log_density`:
  the temperature and the truncations, renormalised);
- `depth[t]` = collapse depth d_t and `final_entropy[t]` = H_L(t), both from the
  step that *consumes* x_t (docs/design.md §3), so they exist for every generated token
  except a final EOS (which is never scored).

One loop step, for an active row of length n: consume x_{n-1} (write its KV at slot
n-1, read the logits of x_n and the lens statistics of position n-1), then sample
x_n unless the row has reached its limit. A row stops after sampling EOS (EOS is
not consumed), after sampling a token that completes a stop string (`SamplerSpec.stop`,
`degs_jax.stops`: the same end, for every decoder) or after consuming the token at
`limit - 1`. Statistics of positions below `fresh_from` are never overwritten: a
continuation from a cached prefix keeps the prefix's stored values, bit for bit, and
only re-reads the last prefix token's logits (one step).

Randomness: token x_t of row b is drawn with `fold_in(keys[b], t)`, so a row's
samples depend only on its key and positions, not on the batch it runs in.

The model is a `degs_jax.model_api.CausalLM` (a static argument); its contract (slots
are positions, stale slots are never read, out-of-range positions write nothing) is
what makes truncation by `length` and parking inactive rows at slot S correct.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional, Protocol, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .lens import LensConfig, collapse_depth, sum_rows
from .model_api import CausalLM
from .rows import fold_in_rows, rows_at, work_counter
from .stops import START, STOPPED, StopAutomaton
from .tiling import row_tiled
from .traced_fields import concrete_values_satisfy, is_value, is_zero, register_traced_dataclass

Array = jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class GenState:
    """Per-row generation state; B rows, S slots. `prefill` builds one; `generate`,
    `decode_step` and the MCMC kernels return updated copies (never mutate). Every
    field but `cache_row_axis` is pytree data with B rows (on axis 0 unless its field
    says otherwise; `degs_jax.rows` takes, repeats, selects and copies them)."""

    tokens: Array  # [B, S] int32
    logp: Array  # [B, S] fp32
    logq: Array  # [B, S] fp32
    depth: Array  # [B, S] int32, -1 where not computed
    final_entropy: Array  # [B, S] fp32
    length: Array  # [B] int32: prompt + completion tokens in the buffer
    prompt_len: Array  # [B] int32
    ended: Array  # [B] bool: the last token is EOS or completes a stop string
    cache: Any = rows_at("cache_row_axis")  # the model's cache pytree (model_api contract)
    # Work counters, [B] int32 each (summed per run under the names given):
    n_generated: Array = work_counter("generated_tokens")  # tokens sampled
    n_forward: Array = work_counter("forward_tokens")  # token positions run (prefill included)
    n_probed: Array = work_counter("probed_token_layers")  # probed token-layers (K per lensed position)
    # decode or verification forwards the row took part in (a drafted step draws several
    # tokens in one: generated_tokens / decode_steps is the tokens per forward)
    n_steps: Array = work_counter("decode_steps")
    # [B, S] int32: the stop-string automaton's state after each completion token
    # (`degs_jax.stops`; STOPPED at a token that completes a stop string), or None when the
    # decoder has no stop strings (`prefill(stop_states=True)` makes it).
    stop_state: Optional[Array] = None
    # Static (part of the treedef): the batch-row axis of every cache leaf.
    cache_row_axis: int = dataclasses.field(default=0, metadata=dict(static=True))

    @property
    def max_len(self) -> int:
        return self.tokens.shape[1]

    def completion_mask(self, scored: bool = False) -> Array:
        """[B, S] bool: completion slots; `scored=True` also drops a final EOS (docs/design.md §3)."""
        pos = jnp.arange(self.max_len)[None]
        mask = (pos >= self.prompt_len[:, None]) & (pos < self.length[:, None])
        if scored:
            mask &= ~(self.ended[:, None] & (pos == self.length[:, None] - 1))
        return mask


# The "off" values of the methods' truncation hyperparameters (`Method.top_k`, ...).
NO_TOP_K = 0
NO_TOP_P = 1.0
NO_MIN_P = 0.0
NO_TYPICAL_P = 1.0


@dataclasses.dataclass(frozen=True)
class Truncation:
    """One cut of the proposal's support. `keep(z)` -> [B, V] bool, the tokens kept, from
    the tempered logits z ([B, V] fp32, -inf where an earlier cut removed a token); it
    must keep at least one token of every row (the cuts here keep the most likely one).

    A new per-token sampling rule is one frozen dataclass subclass: `Proposal` applies its
    cuts in order and renormalises, so `Proposal.log_density` is the truncated density
    that MH acceptance ratios and SMC weights use, for every method, with no change to a
    kernel. Every subclass is a pytree (`traced_fields`): its fields are part of the
    compiled program (hashable), except those marked `{"traced": True}` in their metadata,
    which are data of it (top-p's p: one program for every p)."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        register_traced_dataclass(cls)

    def keep(self, z: Array) -> Array:
        raise NotImplementedError


def _check_fraction(name: str, value: Any) -> None:
    """ValueError unless every concrete value is in (0, 1] (a traced one is not checked)."""
    if not concrete_values_satisfy(value, lambda v: (v > 0.0) & (v <= 1.0)):
        raise ValueError(f"{name} must be in (0, 1], got {value}")


TRACED_FIELD = {"traced": True}  # the metadata of a Truncation's field that is data of the program


@dataclasses.dataclass(frozen=True)
class TopK(Truncation):
    """The k most likely tokens (ties at the k-th value kept), as HF's TopKLogitsWarper."""

    k: int

    def __post_init__(self):
        if not isinstance(self.k, int) or isinstance(self.k, bool) or self.k < 1:
            raise ValueError(f"top_k must be a positive integer, got {self.k!r}")

    def keep(self, z: Array) -> Array:
        if self.k >= z.shape[-1]:
            return jnp.ones(z.shape, bool)
        return z >= kth_largest(z, self.k)


def _smallest_prefix(z: Array, order_key: Array, mass: float) -> Array:
    """[B, V] bool: the smallest prefix of the tokens sorted by `order_key` (ascending)
    whose probability under softmax(z) reaches `mass`; the token that crosses it is kept."""
    order = jnp.argsort(order_key, axis=-1)
    sorted_z = jnp.take_along_axis(z, order, -1)
    probs = jax.nn.softmax(sorted_z, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep_sorted = mass_before < mass
    return jnp.zeros_like(keep_sorted).at[jnp.arange(z.shape[0])[:, None], order].set(keep_sorted)


@dataclasses.dataclass(frozen=True)
class TopP(Truncation):
    """Nucleus: the most likely tokens whose mass reaches p (the token that crosses p
    kept), as HF's TopPLogitsWarper."""

    p: float = dataclasses.field(metadata=TRACED_FIELD)

    def __post_init__(self):
        _check_fraction("top_p", self.p)

    def keep(self, z: Array) -> Array:
        return _smallest_prefix(z, -z, self.p)


@dataclasses.dataclass(frozen=True)
class MinP(Truncation):
    """Min-p (Nguyen et al., 2024): the tokens whose probability is at least p times the
    most likely token's, as HF's MinPLogitsWarper (compared in log space)."""

    p: float = dataclasses.field(metadata=TRACED_FIELD)

    def __post_init__(self):
        _check_fraction("min_p", self.p)

    def keep(self, z: Array) -> Array:
        return z >= jnp.max(z, axis=-1, keepdims=True) + jnp.log(self.p)


@dataclasses.dataclass(frozen=True)
class Typical(Truncation):
    """Locally typical sampling (Meister et al., 2023): the tokens whose surprisal is
    closest to the distribution's entropy, in that order, until their mass reaches
    `mass` (the crossing token kept), as HF's TypicalLogitsWarper up to ties."""

    mass: float = dataclasses.field(metadata=TRACED_FIELD)

    def __post_init__(self):
        _check_fraction("typical_p", self.mass)

    def keep(self, z: Array) -> Array:
        log_probs = jax.nn.log_softmax(z, axis=-1)
        probs = jnp.exp(log_probs)
        entropy = -jnp.sum(jnp.where(probs > 0, probs * log_probs, 0.0), axis=-1, keepdims=True)
        distance = jnp.where(jnp.isfinite(z), jnp.abs(-log_probs - entropy), jnp.inf)
        return _smallest_prefix(z, distance, self.mass) & jnp.isfinite(z)


def truncations(top_k: int = NO_TOP_K, top_p: float = NO_TOP_P, min_p: float = NO_MIN_P,
                typical_p: float = NO_TYPICAL_P) -> tuple[Truncation, ...]:
    """The cuts the methods' hyperparameters name, in HF's order (top-k, top-p, min-p,
    typical), each only where it is not at its "off" value (a traced value is a cut).
    ValueError for a bad value."""
    if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 = off), got {top_k!r}")
    cuts = (TopK(top_k) if top_k != NO_TOP_K else None,
            TopP(top_p) if not is_value(top_p, NO_TOP_P) else None,
            MinP(min_p) if not is_value(min_p, NO_MIN_P) else None,
            Typical(typical_p) if not is_value(typical_p, NO_TYPICAL_P) else None)
    return tuple(cut for cut in cuts if cut is not None)


@functools.partial(register_traced_dataclass, traced=lambda cls: ("temperature", "truncations"))
@dataclasses.dataclass(frozen=True)
class Proposal:
    """q(x_t | x_<t), the per-token distribution a token is drawn from: softmax(logits /
    temperature), cut by `truncations` in order and renormalised (log q is the truncated
    density). Temperature 0 is greedy: the argmax, with log q = 0 (a point mass).
    `log_density` and `sample` are all that the kernels ask of it. A pytree: the
    temperature and the cuts' traced fields are data of the compiled program, except a
    temperature of concrete 0, which makes the greedy program (`traced_fields`)."""

    temperature: float
    truncations: tuple[Truncation, ...] = ()

    def __post_init__(self):
        if not concrete_values_satisfy(self.temperature, lambda t: t >= 0):
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        object.__setattr__(self, "truncations", tuple(self.truncations))
        for cut in self.truncations:
            if not isinstance(cut, Truncation):
                raise TypeError(f"a proposal's truncations are Truncation values, got {cut!r}")

    @property
    def greedy(self) -> bool:
        return is_zero(self.temperature)

    def log_density(self, logits: Array) -> Array:
        """log q over the vocabulary, [B, V] fp32, -inf outside the truncations (not greedy)."""
        z = logits / self.temperature
        for cut in self.truncations:
            z = jnp.where(cut.keep(z), z, -jnp.inf)
        return jax.nn.log_softmax(z, axis=-1)

    def sample(self, keys: Array, logits: Array, log_q: Optional[Array]) -> tuple[Array, Array]:
        """One token per row and its log q: ([B] int32, [B] fp32). keys: [B] PRNG keys (one
        per row and position, `rows.fold_in_rows`); log_q: `log_density(logits)`, None when
        greedy."""
        if self.greedy:
            return jnp.argmax(logits, axis=-1).astype(jnp.int32), jnp.zeros(logits.shape[:1], jnp.float32)
        tokens = jax.vmap(jax.random.categorical)(keys, log_q).astype(jnp.int32)
        return tokens, log_q[jnp.arange(tokens.shape[0]), tokens]


@functools.partial(register_traced_dataclass, traced=lambda cls: ("proposal", "lens"))
@dataclasses.dataclass(frozen=True)
class SamplerSpec:
    """How tokens are drawn: a pytree whose children are the proposal and the lens (their
    temperature and tau are data of the compiled program); everything else is static,
    part of the program.

    proposal: the per-token distribution (`Proposal`: temperature and truncations).
    lens: LensConfig to record collapse depth per token, or None (no probing).
    stop: the compiled stop strings (`stops.stop_automaton`; a row ends at the token that
      completes one, as at EOS), or None. Needs a state with `stop_state`.
    """

    proposal: Proposal
    eos_ids: tuple[int, ...] = ()
    lens: Optional[LensConfig] = None
    stop: Optional[StopAutomaton] = None

    def __post_init__(self):
        if not isinstance(self.proposal, Proposal):
            raise TypeError(f"SamplerSpec.proposal is a Proposal, got {self.proposal!r}")


# Bits of the fp32 sort key decided per pass of `kth_largest` (16 candidate thresholds
# per pass, 8 passes over the row).
_KTH_BITS_PER_PASS = 4


def kth_largest(z: Array, k: int) -> Array:
    """The k-th largest value of each row of z ([B, V] float32) -> [B, 1], bit for bit
    `lax.top_k(z, k)[0][:, -1:]` (ties counted with multiplicity), by a threshold
    search instead of a partial sort: each float maps to an order-preserving uint32
    key, and the largest key T with #{v : key(v) >= T} >= k is found 4 bits at a time
    (8 passes over the row, each counting 16 candidate thresholds). That T is the key of
    the k-th largest value. Cost: 8 fused compare-and-count passes over [B, V], close to
    the softmax the sampler does anyway, where a top-k of 50 over 152k logits is a
    partial sort per row. NaN-free input (logits)."""
    bits = jax.lax.bitcast_convert_type(z.astype(jnp.float32), jnp.uint32)
    negative = (bits >> 31) == 1
    key = jnp.where(negative, ~bits, bits | jnp.uint32(0x80000000))  # monotone in z
    B = z.shape[0]
    T = jnp.zeros((B, 1), jnp.uint32)
    per_pass = 1 << _KTH_BITS_PER_PASS
    for shift in range(32 - _KTH_BITS_PER_PASS, -1, -_KTH_BITS_PER_PASS):
        digits = jnp.arange(per_pass, dtype=jnp.uint32) << shift  # [D]
        candidates = T | digits[None, :]  # [B, D]
        counts = jnp.sum(key[:, :, None] >= candidates[:, None, :], axis=1)  # [B, D]
        # counts fall as the digit grows: the digit is the number of candidates reaching k, - 1
        best = jnp.sum(counts >= k, axis=1, keepdims=True).astype(jnp.uint32) - 1
        T = T | (best << shift)
    negative_t = (T >> 31) == 0
    value_bits = jnp.where(negative_t, ~T, T & jnp.uint32(0x7FFFFFFF))
    return jax.lax.bitcast_convert_type(value_bits, jnp.float32)


def _is_eos(tokens: Array, eos_ids: tuple[int, ...]) -> Array:
    if not eos_ids:
        return jnp.zeros(tokens.shape, bool)
    return jnp.isin(tokens, jnp.asarray(eos_ids, tokens.dtype))


def ends_at(state: GenState, n: Array, tok: Array, write: Array,
            sampler: SamplerSpec) -> tuple[Array, Optional[Array]]:
    """Rows that append token `tok` at slot `n` (where `write`): ([B] bool: the token ends
    the completion, EOS or a stop string; the new `stop_state`). Without stop strings this
    is the EOS test alone (the program of a decoder without them is unchanged)."""
    hit_end = write & _is_eos(tok, sampler.eos_ids)
    if sampler.stop is None:
        return hit_end, state.stop_state
    stop_state, hit_stop = advance_stop(state, n, tok, write, sampler.stop)
    return hit_end | hit_stop, stop_state


def advance_stop(state: GenState, n: Array, tok: Array, write: Array,
                 stop: StopAutomaton) -> tuple[Array, Array]:
    """Rows that append token `tok` at slot `n` (where `write`): (the new `stop_state`, [B]
    bool: the token completes a stop string). The automaton state before slot n is the
    one stored after slot n - 1, or START at the first completion token: only the
    completion is matched (`degs_jax.stops`), and a continuation from a cut reads the
    state its prefix left."""
    if state.stop_state is None:
        raise ValueError("this sampler has stop strings but the state has no stop_state: "
                         "prefill with stop_states=True")
    rows = jnp.arange(tok.shape[0])
    before = jnp.where(n > state.prompt_len,
                       state.stop_state[rows, jnp.clip(n - 1, 0, state.max_len - 1)], START)
    after = stop.next_state(before, tok)
    return _set(state.stop_state, n, after, write), write & (after == STOPPED)


def _set(buf: Array, idx: Array, value: Array, where: Array) -> Array:
    """buf[b, idx[b]] = value[b] for rows where `where[b]` (one slot per row of `_set_slots`)."""
    return _set_slots(buf, idx[:, None], value[:, None], where[:, None])


def _set_slots(buf: Array, idx: Array, value: Array, where: Array) -> Array:
    """buf[b, idx[b, j]] = value[b, j] where `where[b, j]`; buf: [B, S]; idx, value, where:
    [B, J], the written slots of a row distinct. The others go to slot S and are dropped."""
    rows = jnp.arange(buf.shape[0])[:, None]
    return buf.at[rows, jnp.where(where, idx, buf.shape[1])].set(value.astype(buf.dtype), mode="drop")


def _densities(logits: Array, sampler: SamplerSpec):
    """Per row of logits [n, V]: log p over the vocabulary, the final-layer entropy H_L
    and (when sampling) log q. Under batch invariance `decode_step` runs this on tiles of
    `lens.SUM_ROWS` rows (`row_tiled`): a softmax over [B, V] is reduced in an order XLA
    picks for B, so a row's log p would depend on its batch (issue 16)."""
    logp_all = jax.nn.log_softmax(logits, axis=-1)
    h_final = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
    logq_all = None if sampler.proposal.greedy else sampler.proposal.log_density(logits)
    return logp_all, h_final, logq_all


def decode_step(model: CausalLM, params: Any, state: GenState, active: Array, limit: Array,
                keys: Array, fresh_from: Array, sampler: SamplerSpec) -> tuple[GenState, Array]:
    """One step of every `active` row (see the module docstring); the body of `generate`'s
    loop, also driven directly by loops that restart rows mid-way (mcmc.mh_steps).

    active, limit, fresh_from: [B]; keys: [B] PRNG keys. Returns (state, active [B]: rows
    that still have work after this step: a token to draw, or a last token to consume).
    `drafted_decode_step` with no draft.
    """
    B = state.tokens.shape[0]
    return drafted_decode_step(model, params, state, active, limit, keys, fresh_from, sampler,
                               jnp.zeros((B, 0), jnp.int32), jnp.zeros((B,), jnp.int32))


class Draft(Protocol):
    """Where a running proposal's next tokens are guessed from, for verification in one
    forward (`drafted_decode_step`; the drafts themselves are in `degs_jax.drafts`): any
    guess keeps the proposal's law exact (each token is still drawn from q given its
    prefix); a good one draws several tokens per forward. Static: `tokens` sets the
    forward's width (K + 1 positions per row)."""

    tokens: int

    def propose(self, current: Optional[GenState], proposal: GenState) -> tuple[Array, Array]:
        """([B, tokens] int32 guesses for slots proposal.length ..., [B] int32 how many are
        proposed) for every row, from the chain x (`current`) and its running proposal; a
        sampling loop, which has no chain, passes None and its state."""
        ...


# Streams under a drafted slot's key fold_in(keys[b], t) (a slot without a draft draws its
# token with that key itself, as `decode_step` does).
DRAFT_ACCEPT_STREAM = 1  # the uniform of the draft token's accept test
DRAFT_RESIDUAL_STREAM = 2  # the draw from q with the draft token removed


def drafted_decode_step(model: CausalLM, params: Any, state: GenState, active: Array, limit: Array,
                        keys: Array, fresh_from: Array, sampler: SamplerSpec, draft: Array,
                        draft_len: Array) -> tuple[GenState, Array]:
    """One step of every `active` row that verifies a draft of the row's next tokens in the
    same forward (speculative sampling with a point-mass draft: Leviathan et al. 2023, Chen
    et al. 2023). draft: [B, K] int32 tokens proposed for slots n .. n + K - 1 of a row of
    length n; draft_len: [B] int32, how many of them are proposed (0 .. K).

    The forward runs x_{n-1} and the proposed tokens at their positions (K + 1 per row;
    positions past a row's draft or limit write nothing), giving q at slots n .. n + K.
    Then, slot by slot: a proposed token d is kept with probability q(d | prefix) (uniform
    from DRAFT_ACCEPT_STREAM under the slot's key); the first one not kept is replaced by a
    draw from q with d removed and renormalised (DRAFT_RESIDUAL_STREAM), and the step ends
    there; after the last kept one (or with no draft) one token is drawn from q as
    `decode_step` draws it. Each token is therefore drawn from q given its prefix exactly
    (P(d) = q(d); P(t != d) = (1 - q(d)) · q(t) / (1 - q(d))), whatever the draft: the
    chain or sampler that uses it keeps its law. With K = 0 this is `decode_step` (its
    program); with guesses of length 0 it draws the same tokens from a wider forward's
    logits (equal up to rounding). Stored log p and log q are the target's at each slot
    (never the draft's); the lens statistics of a kept token come from its own position in
    this forward. EOS, a stop string and `limit` end the step as they end a row. Under a
    greedy proposal (q a point mass at the argmax) a guess is kept when it is the argmax,
    and the first one that is not is replaced by the argmax: greedy's tokens, read from a
    wider forward (equal up to its rounding).

    Returns (state, [B] bool: rows that still have work after this step)."""
    B, S = state.tokens.shape
    K = draft.shape[1]
    lens_layers = sampler.lens.lsub if sampler.lens is not None else ()
    n = state.length
    consumed = jnp.take_along_axis(state.tokens, jnp.clip(n - 1, 0, S - 1)[:, None], 1)
    offsets = jnp.arange(K + 1)[None]
    at = n[:, None] + offsets  # [B, K + 1]: the slot whose q input j gives
    # Input j >= 1 is the proposed token of slot n + j - 1. Inactive rows, and positions
    # past a row's draft or limit, write their KV to slot S, which the model drops
    # (model_api contract 3).
    runs = active[:, None] & ((offsets == 0) | ((offsets <= draft_len[:, None]) & (at <= limit[:, None])))
    pos = jnp.where(runs, at - 1, S)
    with jax.named_scope("model_step"):
        out = model.step(params, jnp.concatenate([consumed, draft], axis=1), pos, state.cache, lens_layers)
    # Everything over the vocabulary runs once for all K + 1 slots ([B, K + 1, V]; under
    # batch invariance on the same row tiles as one slot's); only the walk along the slots
    # (which tokens are kept, where the step ends) is sequential, on [B] values.
    logp, h_final, logq = over_slots(lambda logits: row_tiled(functools.partial(_densities, sampler=sampler),
                                                              logits, sum_rows(model.batch_invariant)), out.logits)
    depth = (collapse_depth(out.layer_entropy, sampler.lens.lsub, model.num_layers, sampler.lens.tau)
             if sampler.lens is not None else None)
    slot_keys = jax.vmap(fold_in_rows, in_axes=(None, 1), out_axes=1)(keys, at)  # [B, K + 1]
    with jax.named_scope("sample"):
        tok = over_slots(sampler.proposal.sample, slot_keys, out.logits, logq)[0]
    has_draft = offsets[:, :K] < draft_len[:, None]  # slot n + j (j < K) has a proposed token
    if K and sampler.proposal.greedy:
        kept = has_draft & (draft == tok[:, :K])  # a wrong guess is replaced by the argmax, tok
    elif K:
        draft_keys = slot_keys[:, :K]
        log_u = jnp.log(over_slots(lambda k: jax.vmap(jax.random.uniform)(fold_in_rows(k, DRAFT_ACCEPT_STREAM)),
                                   draft_keys))
        kept = has_draft & (log_u < jnp.take_along_axis(logq[:, :K], draft[..., None], -1)[..., 0])
        without_draft = jnp.where(jnp.arange(logq.shape[-1]) == draft[..., None], -jnp.inf, logq[:, :K])
        residual = over_slots(
            lambda k, lq: jax.vmap(jax.random.categorical)(fold_in_rows(k, DRAFT_RESIDUAL_STREAM), lq),
            draft_keys, without_draft).astype(jnp.int32)
        tok = tok.at[:, :K].set(jnp.where(has_draft, jnp.where(kept, draft, residual), tok[:, :K]))
    else:
        kept = jnp.zeros((B, 0), bool)
    stop_state = state.stop_state
    consumes = active  # input j is a real token of the row (j = 0: x_{n-1}; then a kept draft)
    samples, writes_stats, hit = [], [], jnp.zeros_like(active)
    for j in range(K + 1):
        sample = consumes & (at[:, j] < limit)  # the row draws the token of slot n + j
        hit_end, stop_state = ends_at(dataclasses.replace(state, stop_state=stop_state), at[:, j],
                                      tok[:, j], sample, sampler)
        writes_stats.append(consumes & (at[:, j] - 1 >= fresh_from))
        samples.append(sample)
        hit |= hit_end
        consumes = sample & kept[:, j] & ~hit_end if j < K else None
    sample, write_stats = jnp.stack(samples, 1), jnp.stack(writes_stats, 1)  # [B, K + 1]
    logq_tok = (jnp.zeros(tok.shape, jnp.float32) if logq is None
                else jnp.take_along_axis(logq, tok[..., None], -1)[..., 0])
    positions = runs.sum(axis=1, dtype=jnp.int32)
    drawn = sample.sum(axis=1, dtype=jnp.int32)
    new = dataclasses.replace(
        state, cache=out.cache, stop_state=stop_state,
        tokens=_set_slots(state.tokens, at, tok, sample),
        logp=_set_slots(state.logp, at, jnp.take_along_axis(logp, tok[..., None], -1)[..., 0], sample),
        logq=_set_slots(state.logq, at, logq_tok, sample),
        final_entropy=_set_slots(state.final_entropy, at - 1, h_final, write_stats),
        depth=state.depth if depth is None else _set_slots(state.depth, at - 1, depth, write_stats),
        length=n + drawn,
        ended=state.ended | hit,
        n_generated=state.n_generated + drawn,
        n_forward=state.n_forward + positions,
        n_probed=state.n_probed + positions * len(lens_layers),
        n_steps=state.n_steps + active.astype(jnp.int32),
    )
    return new, sample.any(axis=1) & ~hit


def over_slots(fn, *arrays: Optional[Array]):
    """fn over per-row arrays ([N, ...] each, or None), applied to the B·J rows of [B, J, ...]
    arrays at once (a row per slot of a row); returns fn's outputs as [B, J, ...]."""
    B, J = arrays[0].shape[:2]
    flat = fn(*(None if a is None else a.reshape((B * J,) + a.shape[2:]) for a in arrays))
    return jax.tree.map(lambda o: o.reshape((B, J) + o.shape[1:]), flat)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class GenerationLoop:
    """The carry of the generation `lax.while_loop` (`generate`; the sampling methods' kernel)."""

    state: GenState
    active: Array  # [B] bool: rows with work left (decode_step's second output)
    steps: Array  # [B] int32: loop iterations run since the row's prompt started


def initial_active(state: GenState, limit: Array) -> Array:
    """[B] bool: the rows a fresh `generate` call works on (not ended, below `limit`)."""
    return ~state.ended & (state.length < limit)


@functools.partial(jax.jit, static_argnames=("model", "draft"))
def generate(model: CausalLM, params: Any, state: GenState, limit: Array, keys: Array,
             sampler: SamplerSpec, fresh_from: Optional[Array] = None, draft: Optional[Draft] = None) -> GenState:
    """Continue every row from its current length until EOS or `limit` tokens, in one
    jitted `lax.while_loop` (a pure function: call it under your own jit or vmap).

    model: the `CausalLM` (static). state: a GenState (from `prefill`, a previous
      `generate`, or a truncated copy of one: set `length` to the cut; the cache need
      not be cleared). Not donated: the caller may keep using it.
    limit: [B] int32 total-length cap per row (prompt included), <= S.
    keys: [B] PRNG keys. fresh_from: [B] int32 first slot whose statistics may be
      (re)written; defaults to the current lengths.
    draft: guesses verified in each step (`degs_jax.drafts`, e.g. `LookupDraft(4, 3)`:
      prompt-lookup decoding), static; None: one token per step. The law of the tokens
      is the same either way (`drafted_decode_step`), the keys' draws are not.
    Rows that are already ended or at their limit are left untouched.
    """
    fresh_from = state.length if fresh_from is None else fresh_from
    start = GenerationLoop(state, initial_active(state, limit), jnp.zeros(state.length.shape, jnp.int32))
    return jax.lax.while_loop(
        lambda loop: jnp.any(loop.active),
        lambda loop: loop_step(model, params, loop, limit, keys, fresh_from, sampler, draft), start).state


def loop_step(model: CausalLM, params: Any, loop: GenerationLoop, limit: Array, keys: Array,
              fresh_from: Array, sampler: SamplerSpec, draft: Optional[Draft] = None) -> GenerationLoop:
    """One `decode_step` of the loop's active rows (a `drafted_decode_step` verifying the
    `draft`'s guesses, given one), counted: the body of `generate`'s while_loop and of the
    sampling methods' `advance`."""
    with jax.named_scope("decode_step"):
        if draft is None:
            state, active = decode_step(model, params, loop.state, loop.active, limit, keys, fresh_from,
                                        sampler)
        else:
            guesses, proposed = draft.propose(None, loop.state)
            state, active = drafted_decode_step(model, params, loop.state, loop.active, limit, keys, fresh_from,
                                                sampler, guesses, proposed)
    return GenerationLoop(state=state, active=active, steps=loop.steps + 1)


def replay_cache(model: CausalLM, params: Any, state: GenState, start: Array,
                 lens_layers: tuple[int, ...] = ()) -> GenState:
    """`state` with every row's cache rewritten at slots start .. length - 1 by decode steps
    that consume the stored tokens one at a time, as the steps that generated them did
    (`decode_step`: the token at slot n is consumed at position n by the model's step of
    one token per row, with the same `lens_layers`), and nothing else changed: no token is
    drawn and no statistic or work counter is written. A row with start >= length is left
    as it is. A chain resumed from its stored tokens (`mcmc`) rebuilds its cache this way
    rather than by a prefill, whose multi-token kernels round differently: with a
    batch-invariant model the cache is then bitwise the one the chain had. start: [B] int32."""
    B, S = state.tokens.shape
    rows = jnp.arange(B)

    def body(loop):
        n, cache = loop
        active = n < state.length
        consumed = state.tokens[rows, jnp.clip(n, 0, S - 1)][:, None]
        # Inactive rows write their KV to slot S, which the model drops (model_api contract 3).
        out = model.step(params, consumed, jnp.where(active, n, S)[:, None], cache, lens_layers)
        return n + 1, out.cache

    _, cache = jax.lax.while_loop(lambda loop: jnp.any(loop[0] < state.length), body,
                                  (jnp.asarray(start, jnp.int32), state.cache))
    return dataclasses.replace(state, cache=cache)


@functools.partial(jax.jit, static_argnames=("model", "max_len", "cache_dtype", "stop_states"))
def prefill(model: CausalLM, params: Any, prompts: Array, prompt_len: Array,
            max_len: int, cache_dtype=jnp.bfloat16, stop_states: bool = False) -> GenState:
    """Run the prompts through the model and build a fresh GenState with S = max_len slots.

    prompts: [B, P] int32, right-padded; prompt_len: [B] int32 (>= 1). The prompt's
    logits are not kept (the first `generate` step re-reads the last prompt token), so
    XLA drops the unembedding of this call. stop_states: keep the stop-string automaton's
    per-token states (`GenState.stop_state`), which samplers with stop strings need.
    """
    B, P = prompts.shape
    cache = model.init_cache(B, max_len, cache_dtype)
    positions = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32)[None], (B, P))
    with jax.named_scope("prefill"):
        out = model.step(params, prompts, positions, cache, ())
    tokens = jnp.zeros((B, max_len), jnp.int32).at[:, :P].set(prompts)
    return GenState(
        tokens=tokens, logp=jnp.zeros((B, max_len), jnp.float32),
        logq=jnp.zeros((B, max_len), jnp.float32),
        depth=jnp.full((B, max_len), -1, jnp.int32),
        final_entropy=jnp.zeros((B, max_len), jnp.float32),
        length=prompt_len.astype(jnp.int32), prompt_len=prompt_len.astype(jnp.int32),
        ended=jnp.zeros((B,), bool), cache=out.cache,
        n_generated=jnp.zeros((B,), jnp.int32), n_forward=prompt_len.astype(jnp.int32),
        n_probed=jnp.zeros((B,), jnp.int32), n_steps=jnp.zeros((B,), jnp.int32),
        stop_state=jnp.full((B, max_len), START, jnp.int32) if stop_states else None,
        cache_row_axis=model.cache_row_axis,
    )


PROMPT_BUCKET = 16  # prompts are right-padded to a multiple of this (few compiled shapes)


def pad_prompts(prompts: Sequence[Sequence[int]],
                multiple: int = PROMPT_BUCKET) -> tuple[np.ndarray, np.ndarray]:
    """Right-pad token lists to a common length rounded up to `multiple` (bucketing keeps
    the number of compiled shapes small). Returns ([B, P] int32, [B] int32 lengths)."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt must have at least one token")
    P = max(len(p) for p in prompts)
    P = -(-P // multiple) * multiple
    out = np.zeros((len(prompts), P), np.int32)
    for i, p in enumerate(prompts):
        out[i, : len(p)] = p
    return out, np.array([len(p) for p in prompts], np.int32)


def completions(state: GenState) -> list[list[int]]:
    """Completion token ids per row (a final EOS or stop-completing token included)."""
    tokens, start, end = jax.device_get((state.tokens, state.prompt_len, state.length))
    return [tokens[b, start[b]:end[b]].tolist() for b in range(tokens.shape[0])]
