"""Scalable Power Sampling (`scalable_power`; Ji et al. 2026, arXiv 2601.21590).

The power distribution factorises exactly into a next-step distribution times a future
factor (the paper's Theorem 3.1): for a prefix x_{<t} and a next block b,

    pi_alpha(b | x_{<t})  ∝  p(b | x_{<t})^alpha · zeta(b),
    zeta(b) = Σ_f p(f | x_{<t}, b)^alpha = E_{f ~ p(· | x_{<t}, b)} [ p(f | x_{<t}, b)^(alpha-1) ],

the sum running over every completion f of the prefix x_{<t} b (zeta = 1 when b ends in
EOS or a stop string, `degs_jax.stops`, or exhausts the budget). SPS samples a
completion block by block from this factorisation with two approximations: the next
block is chosen among a small candidate set C, and zeta is a Monte Carlo average over M
rollouts of at most H tokens from p,

    zeta_hat(b) = (1/M) · Σ_m p(f_m)^(alpha-1),    f_m ~ p(· | x_{<t}, b) cut at H tokens,

so p_hat(b) = p(b)^alpha · zeta_hat(b) / Σ_{b' in C} p(b')^alpha · zeta_hat(b'). A ratio of
Monte Carlo means is biased at O(1/M); the jackknife over the M rollouts

    p_jk(b) = M · p_hat(b) - ((M-1)/M) · Σ_s p_hat_{-s}(b)

(p_hat_{-s}: the same ratio with rollout s left out of every zeta_hat) removes the O(1/M)
term, leaving O(1/M²); negative entries are clipped to 0 and the rest renormalised (if
nothing is left, p_hat is used). The block is drawn from p_jk.

Block form (the default): per block, L candidate blocks of `block_len` tokens (or to EOS /
the budget) are sampled at `candidate_temperature` (default 1: from p), duplicates are
removed (a block drawn twice would otherwise count twice), the K most likely distinct
blocks under p are kept, and M rollouts of horizon H run from each kept block that is not
complete. A candidate that completes the sequence has zeta = 1 exactly, so the last block
is drawn by p^alpha alone. Token form (`block_len` = 1, the paper's Algorithm 1): the
candidate set is the K most likely next tokens under p (deterministic, no candidate
sampling).

What is exact, and what is not. SPS approximates p^alpha by design; nothing it returns
is exact at finite settings. Exact: the factorisation above, and each block is drawn
from p^alpha · zeta restricted to its candidate set C (with zeta estimated). The errors:
(1) C misses blocks (finite L, the top-K cut), which then have probability 0; (2) zeta_hat
is cut at H tokens (biased unless H covers the rest of the budget); (3) the ratio bias,
O(1/M²) after the jackknife. With C every possible block and H covering the rest of the
budget, E[zeta_hat] = zeta and p_jk → the exact block marginal of pi_alpha as M grows
(tests/test_sps.py checks this on an enumerable model). How far the returned answer is at
default-shaped settings, and which settings bring it close, was measured on that model
(bench/finite_n_bias.py, table in docs/design.md §4; blocks of 2 tokens of a 3-token
budget): TV to p^alpha 0.0077 at L 32, K 8, M 8 with candidates from p, 0.056 with
candidates at 1/alpha (the base model: 0.57).

Differences from the public ports (sums of log-probabilities, not per-token means;
duplicate candidates removed before the top-K; candidates from p): docs/design.md §4.

All prompts' candidates run as one batch (P·L rows, or P·K in the token form), then all
rollouts as one batch (P·K·M rows), each row carrying its own copy of the prefix's KV
cache (copied, never re-prefilled). Counters: every token forward of candidates and
rollouts is charged to the prompt (`n_forward`), and `rollouts` counts the rollout rows
that ran.

Randomness: with k the prompt's key and b the block, candidate row j draws token n from
fold_in(fold_in(fold_in(fold_in(k, b), CANDIDATE_STREAM), j), n), rollout (c, m) from
fold_in(fold_in(fold_in(fold_in(k, b), ROLLOUT_STREAM), c·M + m), n), and the block choice
uses fold_in(fold_in(k, b), CHOICE_STREAM): a prompt's result does not depend on its batch.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, ClassVar, Mapping, Optional

import jax
import jax.numpy as jnp

from .generation import GenState, Proposal, SamplerSpec, _set, decode_step, ends_at, generate
from .lens import span_sum
from .method import (DEFAULT_ALPHA, DEFAULT_MAX_NEW_TOKENS, SMALLEST_RUN_TOKENS, Answer, Method, RunDetails, StudyRow,
                     method_field, positive_int, validate_alpha)
from .model_api import CausalLM
from .rows import fold_in_rows, repeat_rows, stacked_work, take_rows, with_stacked_work
from .stops import StopAutomaton
from .traced_fields import concrete_values_satisfy, register_traced_dataclass

Array = jax.Array

# PRNG streams under the block key fold_in(prompt key, block).
CANDIDATE_STREAM = 0  # candidate j: fold_in(., j), then per position (decode_step)
ROLLOUT_STREAM = 1  # rollout m of kept candidate c: fold_in(., c·M + m), then per position
CHOICE_STREAM = 2  # the draw of the block


@functools.partial(register_traced_dataclass, traced=lambda cls: ("alpha", "candidate_temperature"))
@dataclasses.dataclass(frozen=True)
class SPSConfig:
    """Hyperparameters of Scalable Power Sampling: a pytree whose leaves are alpha and the
    candidate temperature, data of the compiled program (`traced_fields`); every other
    field is static, part of the program.

    The method's defaults (`ScalablePower` below): alpha 4 (the paper's T = 1/alpha = 0.25,
    the DEGS paper's Table 1), T = 3072, B = 192, L = 32, K = 8, M = 8, H = 192, jackknife
    on: the issue's values "as the SPS paper", equal to the defaults of the public port
    jeffhernandez1995/reasoning-with-sampling (`power_samp_math_approx.py`: top_k 8,
    candidate_pool_size 32, rollouts_per_candidate 8, lookahead_tokens 192, block_size 192,
    use_jackknife); felix-cfzhou/Reasoning-with-Sampling (`tmc.py`, "Alg. 2") uses the same
    K, M, H and B with 64 candidates. The paper's own text was not reachable from here.

    alpha: power of p.
    max_new_tokens: the token budget T.
    block_len: B, tokens per block; 1 is the token form (the K most likely next tokens).
    candidate_pool: L candidate blocks sampled per block (block form).
    candidates_kept: K distinct candidates kept (the most likely under p).
    rollouts: M rollouts per kept candidate.
    rollout_horizon: H, the rollouts' length cap (they also stop at EOS and the budget).
    jackknife: use the jackknife-corrected probabilities (else the plain ratio p_hat).
    candidate_temperature: temperature of the candidate blocks (block form). Default 1:
      from p, as docs/design.md §4 specifies; both public ports draw them at 1/alpha,
      which was measured farther from the target per forward (docs/design.md §4).
    eos_ids: tokens that end a completion.
    stop: compiled stop strings that end a completion like EOS (`stops.stop_automaton`), or None.

    The method checks its values when it is built; this, the kernel's own API (tests and
    benchmarks build it directly), runs the same checks (`check_sps_hyperparameters`).
    """

    alpha: float
    max_new_tokens: int
    block_len: int
    candidate_pool: int
    candidates_kept: int
    rollouts: int
    rollout_horizon: int
    jackknife: bool
    candidate_temperature: float
    eos_ids: tuple[int, ...] = ()
    stop: Optional[StopAutomaton] = None

    def __post_init__(self):
        check_sps_hyperparameters(self)

    @property
    def num_blocks(self) -> int:
        return -(-self.max_new_tokens // self.block_len)

    @property
    def candidate_spec(self) -> SamplerSpec:
        return SamplerSpec(Proposal(self.candidate_temperature), eos_ids=self.eos_ids, stop=self.stop)

    @property
    def rollout_spec(self) -> SamplerSpec:
        return SamplerSpec(Proposal(1.0), eos_ids=self.eos_ids, stop=self.stop)


def check_sps_hyperparameters(sampler: Any) -> None:
    """ValueError naming the first bad value among the block sampler's hyperparameters,
    read by name from `sampler`: a `ScalablePower` or an `SPSConfig` (the one list of
    checks of both)."""
    validate_alpha(sampler.alpha)
    for name in ("max_new_tokens", "block_len", "candidate_pool", "candidates_kept", "rollouts",
                 "rollout_horizon"):
        positive_int(name, getattr(sampler, name))
    if sampler.block_len > 1 and sampler.candidates_kept > sampler.candidate_pool:
        raise ValueError(f"candidates_kept ({sampler.candidates_kept}) cannot exceed candidate_pool "
                         f"({sampler.candidate_pool})")
    if not concrete_values_satisfy(sampler.candidate_temperature, lambda t: t > 0):
        raise ValueError(f"candidate_temperature must be > 0, got {sampler.candidate_temperature}")


@dataclasses.dataclass(frozen=True)
class ScalablePower(Method):
    """Scalable Power Sampling, block form: the method's hyperparameters (the source of
    each default is given in `SPSConfig`'s docstring). No truncation, no probing."""

    method: ClassVar[str] = "scalable_power"
    study: ClassVar[StudyRow] = StudyRow(label="Scalable Power Sampling", position=5)

    alpha: float = method_field(DEFAULT_ALPHA, "power of the target p(x)^alpha (>= 1)", traced=True)
    max_new_tokens: int = method_field(DEFAULT_MAX_NEW_TOKENS, "token budget of the sampling methods")
    block_len: int = method_field(192, "tokens per block, B (1 = the token form)")
    candidate_pool: int = method_field(32, "candidate blocks sampled per block, L")
    candidates_kept: int = method_field(8, "most likely candidates kept, K")
    rollouts: int = method_field(8, "rollouts per kept candidate, M")
    rollout_horizon: int = method_field(192, "rollout length cap, H")
    jackknife: bool = method_field(True, "jackknife-corrected block probabilities "
                                   "(--no-jackknife: the plain ratio estimate)")
    candidate_temperature: float = method_field(
        1.0, "temperature of the candidate blocks: 1 draws them from p (docs/design.md §4); "
        "the public SPS ports use 1/alpha (0.25 at alpha 4)", traced=True)

    smallest_run: ClassVar[Mapping[str, Any]] = dict(max_new_tokens=SMALLEST_RUN_TOKENS, block_len=2, candidate_pool=3,
                                                     candidates_kept=2, rollouts=2, rollout_horizon=2)

    def __post_init__(self):
        super().__post_init__()
        if self.truncations():
            raise ValueError("scalable_power does not truncate; its candidates are drawn at "
                             "candidate_temperature")
        check_sps_hyperparameters(self)

    @property
    def probed(self) -> bool:
        return False

    @property
    def sequences_per_prompt(self) -> int:
        """KV-cache rows one prompt may hold at once inside a block (the batch size's
        memory estimate): the prompt's row, its L candidates, the K kept and their K·M
        rollouts (one compiled block; counted together, an upper bound)."""
        return 1 + self.candidate_pool + self.candidates_kept * (1 + self.rollouts)

    def sequential_steps(self, n_tokens: int) -> float:
        """Per block of B tokens, the candidates' B steps and the rollouts' H."""
        return max(1, -(-n_tokens // self.block_len)) * (self.block_len + self.rollout_horizon)

    # Kernel: the carry is `SPSRun`, `advance` one block of every prompt (`sps_block`).

    def init(self, model, params, state: GenState, keys: Array, settings: "SPSConfig") -> "SPSRun":
        return SPSRun(main=state, block=jnp.zeros(state.length.shape, jnp.int32),
                      rollouts=jnp.zeros(state.length.shape, jnp.int32))

    def advance(self, model, params, carry: "SPSRun", keys: Array, settings: "SPSConfig") -> "SPSRun":
        main, info = sps_block_traced(model, params, carry.main, keys, carry.block, settings)
        return SPSRun(main=main, block=jnp.minimum(carry.block + 1, settings.num_blocks),
                      rollouts=carry.rollouts + info.rollouts)

    def prompt_done(self, carry: "SPSRun", settings: "SPSConfig") -> Array:
        return (carry.block >= settings.num_blocks) | complete(carry.main, settings)

    def answer(self, model, params, carry: "SPSRun", keys: Array, settings: "SPSConfig") -> Answer:
        main = carry.main
        if settings.block_len == 1:
            # The token form appends tokens without consuming them; consume a budget-ended
            # row's last token so that its H_L is recorded like every other decoder's.
            main = _consume_last_donating(model, params, main, keys, settings)
        return Answer(state=main)

    progress_unit: ClassVar[str] = "block"

    def progress_total(self, settings: "SPSConfig") -> int:
        return settings.num_blocks

    def progress(self, carry: "SPSRun") -> Array:
        return jnp.max(carry.block)

    def run_details(self, model, carry: "SPSRun", keys: Array, settings: "SPSConfig") -> RunDetails:
        """Per prompt the rollout rows run; their sum as the counter `rollouts`."""
        rollouts = jax.device_get(carry.rollouts)
        return RunDetails(diagnostics=[dict(rollouts=int(r)) for r in rollouts],
                          counters=dict(rollouts=int(rollouts.sum())))

    def kernel_config(self, num_layers: int, eos_ids: tuple[int, ...],
                      stop: Optional[StopAutomaton] = None) -> SPSConfig:
        """The block sampler's settings (it probes nothing: `num_layers` is unused)."""
        return SPSConfig(alpha=self.alpha, max_new_tokens=self.max_new_tokens,
                         block_len=self.block_len, candidate_pool=self.candidate_pool,
                         candidates_kept=self.candidates_kept, rollouts=self.rollouts,
                         rollout_horizon=self.rollout_horizon, jackknife=bool(self.jackknife),
                         candidate_temperature=self.candidate_temperature, eos_ids=tuple(eos_ids),
                         stop=stop)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class BlockChoice:
    """What one block did, per prompt (K kept candidates)."""

    tokens: Array  # [P, K, S] int32 the candidates' rows (prefix + block)
    length: Array  # [P, K] int32
    valid: Array  # [P, K] bool: a distinct candidate (fewer than K distinct ones leave gaps)
    log_zeta: Array  # [P, K] fp32 log zeta_hat (0 for a candidate that completes the sequence)
    probs: Array  # [P, K] fp32 the distribution the block was drawn from (p_jk or p_hat)
    ratio_probs: Array  # [P, K] fp32 the plain ratio estimate p_hat
    chosen: Array  # [P] int32 index of the drawn candidate
    rollouts: Array  # [P] int32 rollout rows run


def _sub_keys(keys: Array, n: int) -> Array:
    """[P] keys -> [P·n] keys fold_in(key, j), prompt-major."""
    return jax.vmap(lambda k: jax.vmap(lambda j: jax.random.fold_in(k, j))(jnp.arange(n)))(keys).reshape(-1)


def complete(state: GenState, sps: SPSConfig) -> Array:
    """[rows] bool: the completion ended (EOS or a stop string) or used the whole budget."""
    return state.ended | (state.length >= state.prompt_len + sps.max_new_tokens)


def _sampled_candidates(model: CausalLM, params: Any, main: GenState, keys: Array, block: Array,
                        sps: SPSConfig):
    """Block form: L sampled blocks per prompt, deduplicated, the K most likely kept.
    Returns (store [P·K rows], log p of each kept block [P, K], valid [P, K], work [C, P]: the C work counters)."""
    P, S = main.tokens.shape
    L, K = sps.candidate_pool, sps.candidates_kept
    budget_end = main.prompt_len + sps.max_new_tokens
    end = jnp.where(complete(main, sps), main.length, jnp.minimum(main.length + sps.block_len, budget_end))
    cands = repeat_rows(main, L)
    cands = generate(model, params, cands, jnp.repeat(end, L),
                     _sub_keys(fold_in_rows(keys, block, CANDIDATE_STREAM), L), sps.candidate_spec)
    start = jnp.repeat(main.length, L)
    score = span_sum(cands.logp, start, cands.length, model.batch_invariant).reshape(P, L)
    # Block tokens, -1 past the candidate's end; equal rows are the same block.
    window = start[:, None] + jnp.arange(sps.block_len)[None]
    block_tokens = jnp.where(window < cands.length[:, None],
                             jnp.take_along_axis(cands.tokens, jnp.minimum(window, S - 1), 1), -1)
    block_tokens = block_tokens.reshape(P, L, sps.block_len)
    same = jnp.all(block_tokens[:, :, None] == block_tokens[:, None], axis=-1)  # [P, L, L]
    earlier = jnp.tril(jnp.ones((L, L), bool), k=-1)
    duplicate = jnp.any(same & earlier[None], axis=-1)
    score, kept = jax.lax.top_k(jnp.where(duplicate, -jnp.inf, score), K)
    valid = score > -jnp.inf
    store = take_rows(cands, (jnp.arange(P)[:, None] * L + kept).reshape(-1))
    work = jnp.sum((stacked_work(cands) - jnp.repeat(stacked_work(main), L, axis=1)).reshape(-1, P, L), axis=-1)
    return store, score, valid, work


def _top_token_candidates(model: CausalLM, params: Any, main: GenState, sps: SPSConfig):
    """Token form: consume each prompt's last token (one forward of its P rows) and branch
    on the K most likely next tokens (deterministic; log q = 0 as for greedy)."""
    P, S = main.tokens.shape
    K = sps.candidates_kept
    n = main.length
    active = ~complete(main, sps)
    consumed = jnp.take_along_axis(main.tokens, jnp.clip(n - 1, 0, S - 1)[:, None], 1)
    out = model.step(params, consumed, jnp.where(active, n - 1, S)[:, None], main.cache, ())
    logp_all = jax.nn.log_softmax(out.logits[:, 0], axis=-1)
    h_final = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
    logp_top, top = jax.lax.top_k(logp_all, K)  # [P, K]
    # H_L of the consumed token: the previous block's token (a prompt token is never scored).
    final_entropy = _set(main.final_entropy, n - 1, h_final, active & (n > main.prompt_len))
    store = repeat_rows(dataclasses.replace(main, cache=out.cache, final_entropy=final_entropy), K)
    act, m = jnp.repeat(active, K), jnp.repeat(n, K)
    tok, logp_tok = top.reshape(-1).astype(jnp.int32), logp_top.reshape(-1)
    tokens, logp = _set(store.tokens, m, tok, act), _set(store.logp, m, logp_tok, act)
    logq, length = _set(store.logq, m, jnp.zeros_like(logp_tok), act), m + act
    hit_end, stop_state = ends_at(store, m, tok, act, sps.rollout_spec)
    store = dataclasses.replace(store, tokens=tokens, logp=logp, logq=logq, length=length,
                                ended=store.ended | hit_end, stop_state=stop_state)
    # A complete prompt keeps its one (unchanged) candidate.
    valid = active[:, None] | (jnp.arange(K)[None] == 0)
    score = jnp.where(active[:, None], logp_top, 0.0)
    ran = active.astype(jnp.int32)
    work = jnp.stack([K * ran, ran, jnp.zeros_like(ran), ran])  # (`work_counter_names` order)
    return store, score, valid, work


def log_rollout_weight(rollout_logp: Array, alpha: float) -> Array:
    """log of one rollout's term p(f)^(alpha-1) of zeta_hat."""
    return (alpha - 1.0) * rollout_logp


def rollout_log_weights(model: CausalLM, params: Any, store: GenState, valid: Array, keys: Array,
                        block: Array, sps: SPSConfig):
    """M rollouts from p of every valid candidate row that is not complete.
    store: P·K candidate rows (prompt-major); valid: [P, K]. Returns (log p(f)^(alpha-1) [P, K, M],
    needs_rollouts [P, K], work [C, P], rollout rows run [P])."""
    K, M = sps.candidates_kept, sps.rollouts
    P = store.length.shape[0] // K
    needs = valid.reshape(-1) & ~complete(store, sps)
    budget_end = store.prompt_len + sps.max_new_tokens
    limit = jnp.where(needs, jnp.minimum(store.length + sps.rollout_horizon, budget_end), store.length)
    rolls = repeat_rows(store, M)
    rolls = generate(model, params, rolls, jnp.repeat(limit, M),
                     _sub_keys(fold_in_rows(keys, block, ROLLOUT_STREAM), K * M), sps.rollout_spec)
    logp = span_sum(rolls.logp, jnp.repeat(store.length, M), rolls.length, model.batch_invariant).reshape(P, K, M)
    work = jnp.sum((stacked_work(rolls) - jnp.repeat(stacked_work(store), M, axis=1)).reshape(-1, P, K * M), axis=-1)
    needs = needs.reshape(P, K)
    return log_rollout_weight(logp, sps.alpha), needs, work, M * jnp.sum(needs, axis=1)


def block_probabilities(score: Array, log_rollout: Array, needs: Array, valid: Array, alpha: float,
                        jackknife: bool) -> tuple[Array, Array, Array]:
    """The SPS distribution over K candidates per prompt.

    score: [P, K] log p of each candidate block; log_rollout: [P, K, M] log p(f_m)^(alpha-1);
    needs: [P, K] candidates with a future (else zeta = 1); valid: [P, K].
    Returns (probs [P, K]: p_jk if jackknife (and M > 1) else p_hat, p_hat [P, K],
    log zeta_hat [P, K])."""
    M = log_rollout.shape[-1]
    log_zeta = jnp.where(needs, jax.nn.logsumexp(log_rollout, axis=-1) - jnp.log(M), 0.0)
    base = jnp.where(valid, alpha * score, -jnp.inf)
    p_hat = jax.nn.softmax(base + log_zeta, axis=-1)
    if not jackknife or M == 1:
        return p_hat, p_hat, log_zeta
    # Leave-one-out zeta_hat_{-s}, in the scale of each candidate's largest term.
    top = jnp.max(log_rollout, axis=-1, keepdims=True)
    terms = jnp.exp(log_rollout - top)
    rest = jnp.maximum(jnp.sum(terms, axis=-1, keepdims=True) - terms, jnp.finfo(jnp.float32).tiny)
    log_zeta_loo = jnp.where(needs[..., None], top + jnp.log(rest / (M - 1)), 0.0)  # [P, K, M]
    p_loo = jax.nn.softmax(base[..., None] + log_zeta_loo, axis=1)  # normalised over candidates
    p_jk = jnp.maximum(M * p_hat - (M - 1) / M * jnp.sum(p_loo, axis=-1), 0.0)
    total = jnp.sum(p_jk, axis=-1, keepdims=True)
    probs = jnp.where(total > 0, p_jk / jnp.where(total > 0, total, 1.0), p_hat)
    return probs, p_hat, log_zeta


def sps_block_traced(model: CausalLM, params: Any, main: GenState, keys: Array, block: Array,
                     sps: SPSConfig) -> tuple[GenState, BlockChoice]:
    """One SPS block for every prompt (one row each; complete rows are left as they are).
    keys: [P] prompt keys. Returns (the extended rows, what the block did). Traceable;
    `sps_block` is its jitted form with `main` donated, for host loops (`run_sps`)."""
    P, S = main.tokens.shape
    K = sps.candidates_kept
    if sps.block_len == 1:
        store, score, valid, work = _top_token_candidates(model, params, main, sps)
    else:
        store, score, valid, work = _sampled_candidates(model, params, main, keys, block, sps)
    log_rollout, needs, roll_work, rollouts = rollout_log_weights(model, params, store, valid, keys, block,
                                                                  sps)
    probs, p_hat, log_zeta = block_probabilities(score, log_rollout, needs, valid, sps.alpha, sps.jackknife)
    chosen = jax.vmap(jax.random.categorical)(fold_in_rows(keys, block, CHOICE_STREAM),
                                              jnp.log(probs)).astype(jnp.int32)
    new = take_rows(store, jnp.arange(P) * K + chosen)
    total = stacked_work(main) + work + roll_work
    new = with_stacked_work(new, total)
    info = BlockChoice(tokens=store.tokens.reshape(P, K, S), length=store.length.reshape(P, K), valid=valid,
                       log_zeta=log_zeta, probs=probs, ratio_probs=p_hat, chosen=chosen, rollouts=rollouts)
    return new, info


sps_block = jax.jit(sps_block_traced, static_argnames=("model",), donate_argnames=("main",))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SPSRun:
    """The carry of a loop over blocks (`ScalablePower`'s kernel)."""

    main: GenState  # one row per prompt
    block: Array  # [P] int32: blocks the prompt ran (its phase: the blocks' keys)
    rollouts: Array  # [P] int32 rollout rows run


def run_sps(model: CausalLM, params: Any, main: GenState, keys: Array, sps: SPSConfig,
            progress=None) -> tuple[GenState, Array]:
    """Blocks until every prompt is complete. main: one prefilled row per prompt (donated);
    keys: [P] prompt keys. progress: optional callable(blocks done). Returns (final rows,
    rollout rows run per prompt [P])."""
    rollouts = jnp.zeros(main.length.shape, jnp.int32)
    for block in range(sps.num_blocks):
        main, info = sps_block(model, params, main, keys, jnp.int32(block), sps)
        rollouts = rollouts + info.rollouts
        if progress is not None:
            progress(block + 1)
        if bool(jnp.all(complete(main, sps))):
            break
    if sps.block_len == 1:
        # The token form appends tokens without consuming them; consume a budget-ended
        # row's last token so that its H_L is recorded like every other decoder's.
        main = _consume_last_donating(model, params, main, keys, sps)
    return main, rollouts


def consume_last(model: CausalLM, params: Any, main: GenState, keys: Array, sps: SPSConfig) -> GenState:
    """One forward of every row that did not end in EOS, recording its last token's H_L."""
    return decode_step(model, params, main, ~main.ended, main.length, keys, main.length - 1,
                       sps.rollout_spec)[0]


_consume_last_donating = jax.jit(consume_last, static_argnames=("model",), donate_argnames=("main",))
