"""Power-SMC (`power_smc`, beta = 0) and DEGS-SMC (`degs_smc`, beta > 0): sequential
Monte Carlo for

    pi(x)  ∝  gamma(x) = p(x)^alpha · exp(beta · D(x))

over completions x of at most T = `max_new_tokens` tokens (ending in EOS, or exactly T
tokens without EOS), with D(x) the mean collapse depth of docs/design.md §3. Power-SMC is Azizi
et al. 2026 (arXiv 2602.10273); the depth term is new (the DEGS paper's "integration with
efficient samplers such as Power-SMC").

Particles. Each prompt runs N particles in lock-step: one loop step is one decode step
of every live particle (`generation.decode_step`), which consumes the particle's last
token (writing its d_t, docs/design.md §3) and samples the next one from the proposal
q = softmax(alpha · log p) (optionally top-k/top-p truncated; log q is then the
truncated density). A particle is *complete* once it has sampled EOS (or a token that
completes a stop string, `degs_jax.stops`: everything said of EOS here holds for it), or
once it has consumed its T-th token (the extra step that makes d_T known); a complete
particle is never moved again. All live particles of a prompt therefore hold the same number of
tokens t at loop step t.

Intermediate targets. Let r_t = min(t, R) / R be the ramp fraction (R = `ramp_tokens`,
the exponent-bridging schedule of Power-SMC; R = 0 means no ramp), a_t = 1 + (alpha-1)·r_t
and b_t = beta·r_t. For a live prefix x_{1:t} (t completion tokens, no EOS) only
d_1 … d_{t-1} are known (d_t comes from the step that consumes x_t), so the target is
defined on those tokens:

    gamma_t(x_{1:t}) = p(x_{1:t})^{a_t} · exp(b_t · D_{t-1}),   D_{t-1} = mean_{j<t} d_j / L

(D_0 = 0), a function of the prefix alone (d_j depends on x_{<=j} only). A complete
particle x carries the *final* target gamma(x) = p(x)^alpha · exp(beta · D(x)) with D(x)
over its scored tokens (all of them for a budget-ended x; all but the EOS for an ended
one, whose d's are all known at the step that samples the EOS). In words: the exponents
ramp with the token count while a particle is live and jump to (alpha, beta) the moment
it completes, whatever the ramp's state. Every particle, short or long, early or late,
ends with weight for the final target; there is no end-of-run catch-up to apply, and a
completed particle's later increments are exactly zero ("an ended particle keeps its
weight", the identity move of a Feynman-Kac model whose complete states are absorbing).

Incremental weights. Each row stores log gamma of its current state (`log_target`,
computed from the stored per-token log p and d_t, never rescored). A loop step that
moves a row from state s to s' (sampling token v with density q(v), or only consuming
the last token at the budget, q-factor 1) multiplies its weight by

    w = gamma(s') / (gamma(s) · q(v)),

which written out is, for a live row that samples a non-EOS token x_t,

    log w = (a_t - a_{t-1})·log p(x_{<t}) + a_t·log p(x_t | x_{<t}) - log q(x_t)
            + b_t·D_{t-1} - b_{t-1}·D_{t-2},

for the step that samples EOS, (alpha - a_{t-1})·log p(x_{<t}) + alpha·log p(EOS | ·)
- log q(EOS) + beta·D_{t-1} - b_{t-1}·D_{t-2}, and for the consume-only step at the
budget, (alpha - a_T)·log p(x) + beta·D_T - b_T·D_{T-1}. Without resampling the
product over a particle's steps telescopes to gamma(x) / q(x) (gamma of the empty
prefix is 1). With beta = 0, no ramp and no truncation every live increment is
log Σ_w p(w)^alpha, the per-position normaliser (docs/design.md §4's cross-check).

Resampling. Every `resample_every` loop steps each prompt with a live particle computes
ESS = (Σ w)² / Σ w² of its weights since the last resampling; if ESS < `ess_threshold`·N
it adds log((1/N)·Σ w) to its log Ẑ, draws N ancestors by systematic resampling (one
uniform per prompt), and resets the weights to 1. Ancestors are assigned stably: a
particle drawn at least once stays in its row, and the extra copies overwrite the rows of
particles drawn zero times, so a copy only reads surviving rows and only writes dead ones
(row copies of the KV cache in place, no re-prefill; the stored log p / log q / d_t / H_L
rows travel with it; the work counters stay with the row). Particles are exchangeable,
so this relabelling changes nothing in distribution. At the end log Ẑ gains
log((1/N)·Σ w) of the last epoch, and the returned particle is drawn with probability
proportional to its final weight.

What is exact, and what is not (tests/test_smc_exactness.py; measured by
bench/finite_n_bias.py, table in docs/design.md §4):
- At every N the particles are properly weighted: with W̄_i the normalised final
  weights, E[Ẑ · Σ_i W̄_i f(x_i)] = Σ_x gamma(x)·f(x) for every f. Summed over x: Ẑ is an
  unbiased estimate of Z = Σ_x p(x)^alpha · exp(beta · D(x)). This needs the increments
  above and an unbiased resampler (E[copies of particle i | weights] = N·W̄_i, which
  systematic resampling with a uniform u is; a fixed u is not), and holds whatever rule
  decides from the current weights when to resample (the ESS rule, or its inverse).
- Consistency: Σ_i W̄_i δ(x_i) → pi = gamma / Z as N → ∞.
- Not exact: the returned particle. Its distribution is mu_N = E[Σ_i W̄_i δ(x_i)] (a final
  multinomial resampling, or returning the weighted set and drawing from it, gives the same
  law), and mu_N ≠ pi at finite N: the ratio Σ w_i f(x_i) / Σ w_i is biased, O(1/N) once N
  is large. Because of the identity above, mu_N(A) − pi(A) = −E[(Ẑ/Z − 1)·(Σ_i W̄_i [x_i in A]
  − ½)], so TV(mu_N, pi) <= ½·E|Ẑ/Z − 1| at every N. The bias is large when the proposal
  is far from the target (on the enumerable test model at the default N = 16: TV 0.056
  for power_smc, 0.34 for degs_smc at beta 5, where the base model itself is at 0.79).

Differences from the public Power-SMC code (completed particles jump to the final
exponent; the ESS check schedule; no truncation by default), each keeping the target:
docs/design.md §4.

Randomness (counter-based, a prompt's result does not depend on its batch): row key k_r
(particle j of prompt i: the decoders' split of the prompt's key), tokens of row r at
position n from fold_in(fold_in(k_r, TOKEN_STREAM), n) (decode_step), the systematic
uniform of check c from fold_in(fold_in(k_{i,0}, RESAMPLE_STREAM), c) and the final draw
from fold_in(k_{i,0}, CHOICE_STREAM), k_{i,0} being the prompt's first particle key.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, ClassVar, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np

from .generation import GenState, Proposal, SamplerSpec, Truncation, decode_step
from .lens import LensConfig, masked_sum, sequence_depth, sum_rows
from .method import (DEFAULT_ALPHA, DEFAULT_BETA, DEFAULT_MAX_NEW_TOKENS, SMALLEST_RUN_TOKENS, Answer, Comparison, Method,
                     RunDetails, StudyRow, method_field, positive_int, require_lens, validate_alpha, validate_beta)
from .model_api import CausalLM
from .rows import copy_rows, fold_in_rows, per_prompt
from .stops import StopAutomaton
from .tiling import row_tiled
from .traced_fields import is_zero, register_traced_dataclass

Array = jax.Array

# PRNG streams under a row key (tokens) or under the prompt's first row key (the rest).
TOKEN_STREAM = 0  # row key: the particle's tokens, then per position (decode_step)
RESAMPLE_STREAM = 1  # first row key: check c's systematic uniform, fold_in(., c)
CHOICE_STREAM = 2  # first row key: the final draw of the returned particle


@functools.partial(register_traced_dataclass, traced=lambda cls: ("alpha", "beta", "lens", "truncations"))
@dataclasses.dataclass(frozen=True)
class SMCConfig:
    """Hyperparameters of Power-SMC / DEGS-SMC: a pytree whose leaves are alpha, beta, the
    lens's tau and the truncations' fractions, data of the compiled program (a beta of
    concrete 0 is static: the program without the depth term; `traced_fields`); every
    other field is static, part of the program.
    The methods' defaults (`SMCMethod` below) and their sources are given per
    field; the Power-SMC paper's text was not reachable from here, so its public code
    (ArminAzizi98/Power-SMC: `SMCSamplingConfig`, the MATH500 script `power_samp_math.py`,
    the README) and the DEGS paper stand in for it.

    alpha: power of p (proposal temperature 1/alpha). Default 4: the DEGS paper's setting
      for every power-sampling baseline; Power-SMC's MATH500 script sets alpha = 1/0.25
      (its config default is 2).
    beta: weight of D(x); 0 is Power-SMC (no probing), > 0 DEGS-SMC (needs `lens`).
      Default 5 for degs_smc (DEGS-MCMC's beta, docs/design.md §4).
    n_particles: N per prompt. Default 16: the DEGS paper's Power-SMC budget (its Table 1
      "N=16") and the issue's matched budget (the Power-SMC code uses 32 / 64).
    max_new_tokens: the budget T. Default 3072: Power-SMC's config and MATH500 script,
      and the MCMC schedule's 16 × 192.
    ramp_tokens: R of the exponent ramp r_t = min(t, R)/R (0: no ramp). Default 400:
      Power-SMC's `alpha_ramp_tokens` (config default, not overridden by its scripts).
    ess_threshold: resample when ESS < ess_threshold · N. Default 0.5 (Power-SMC's
      config, README and scripts; the issue).
    resample_every: check the ESS every this many tokens. Default 64: Power-SMC's
      `block_size` in its MATH500 script and README example (config default 128).
    lens: LensConfig for D(x) (required when beta > 0).
    eos_ids: tokens that end a completion.
    stop: compiled stop strings that end a completion like EOS (`stops.stop_automaton`), or
      None: the step that completes one is a complete particle's last step, as an EOS's.
    truncations: optional cuts of q (`generation.Truncation`: top-k, top-p, min-p,
      typical, or a user's own; log q is then the truncated density, so the weights stay
      exact for p^alpha restricted to q's support). Default none; the Power-SMC code
      truncates at top_p = 0.9 by default, its MATH500 script too.

    The method checks its values when it is built; this, the kernel's own API (tests and
    benchmarks build it directly), runs the same checks (`check_smc_hyperparameters`) and
    asks for a lens when beta > 0.
    """

    alpha: float
    beta: float
    n_particles: int
    max_new_tokens: int
    ramp_tokens: int
    ess_threshold: float
    resample_every: int
    lens: Optional[LensConfig] = None
    eos_ids: tuple[int, ...] = ()
    truncations: tuple[Truncation, ...] = ()
    stop: Optional[StopAutomaton] = None

    def __post_init__(self):
        check_smc_hyperparameters(self)
        require_lens(self.beta, self.lens)

    @property
    def probed(self) -> bool:
        """The target has the depth term (and the proposal records d_t): beta is not a
        concrete 0 (a traced beta may be any value)."""
        return not is_zero(self.beta)

    @property
    def proposal(self) -> SamplerSpec:
        return SamplerSpec(Proposal(1.0 / self.alpha, self.truncations), eos_ids=self.eos_ids,
                           lens=self.lens if self.probed else None, stop=self.stop)

    @property
    def num_checks(self) -> int:
        """ESS checks in a full run (T sampling steps + the budget's consume step)."""
        return (self.max_new_tokens + 1) // self.resample_every


def check_smc_hyperparameters(sampler: Any) -> None:
    """ValueError naming the first bad value among the particle sampler's hyperparameters,
    read by name from `sampler`: an `SMCMethod` or an `SMCConfig` (the one list of checks
    of both)."""
    validate_alpha(sampler.alpha)
    validate_beta(sampler.beta)
    for name in ("n_particles", "max_new_tokens", "resample_every"):
        positive_int(name, getattr(sampler, name))
    ramp = sampler.ramp_tokens
    if isinstance(ramp, bool) or not isinstance(ramp, int) or ramp < 0:
        raise ValueError(f"ramp_tokens must be an integer >= 0 (0 = no ramp), got {ramp!r}")
    if not 0.0 <= sampler.ess_threshold <= 1.0:
        raise ValueError(f"ess_threshold must be in [0, 1] (a fraction of N), got {sampler.ess_threshold}")


@dataclasses.dataclass(frozen=True)
class SMCMethod(Method):
    """Power-SMC / DEGS-SMC particles: the methods' hyperparameters (the source of each
    default is given in `SMCConfig`'s docstring). Cost when nothing ends early: N
    particles of max_new_tokens each, side by side (resampling copies rows, no tokens)."""

    alpha: float = method_field(DEFAULT_ALPHA, "power of the target p(x)^alpha; the proposal "
                                "samples at temperature 1/alpha (>= 1)", traced=True)
    beta: float = method_field(DEFAULT_BETA, "weight of D(x) in the target p(x)^alpha·exp(beta·D(x))",
                               traced=True)
    n_particles: int = method_field(16, "SMC particles per prompt, N (the answer is one drawn by "
                                    "weight)")
    max_new_tokens: int = method_field(DEFAULT_MAX_NEW_TOKENS, "token budget of the sampling methods")
    ramp_tokens: int = method_field(400, "SMC exponent ramp: the intermediate targets' exponents "
                                    "rise linearly to (alpha, beta) over this many tokens (0 = no ramp)")
    ess_threshold: float = method_field(0.5, "SMC resamples a prompt's particles when ESS < "
                                        "ess_threshold · N")
    resample_every: int = method_field(64, "SMC checks the ESS every this many tokens")

    smallest_run: ClassVar[Mapping[str, Any]] = dict(max_new_tokens=SMALLEST_RUN_TOKENS, n_particles=3,
                                                     resample_every=2, ramp_tokens=3)

    def __post_init__(self):
        super().__post_init__()
        check_smc_hyperparameters(self)

    @property
    def probed(self) -> bool:
        return not is_zero(self.beta)

    @property
    def pool_size(self) -> int:
        return self.n_particles

    def kernel_config(self, num_layers: int, eos_ids: tuple[int, ...],
                      stop: Optional[StopAutomaton] = None) -> SMCConfig:
        """The particle kernel's settings for a model with `num_layers` blocks."""
        return SMCConfig(alpha=self.alpha, beta=self.beta, n_particles=self.n_particles,
                         max_new_tokens=self.max_new_tokens, ramp_tokens=self.ramp_tokens,
                         ess_threshold=float(self.ess_threshold), resample_every=self.resample_every,
                         lens=self.lens_config(num_layers) if self.probed else None,
                         eos_ids=tuple(eos_ids), truncations=self.truncations(), stop=stop)

    def worst_case_cost(self) -> Optional[tuple[int, int]]:
        return int(self.n_particles * self.max_new_tokens), int(self.max_new_tokens)

    # Kernel: the carry is `SMCState`, `advance` one ESS interval (`smc_steps`: decode steps
    # to the next check, the check and any resampling). Every particle is complete after
    # T + 1 steps, within num_checks + 1 intervals (`run_smc`).

    def init(self, model, params, state: GenState, keys: Array, settings: SMCConfig) -> "SMCState":
        return init_state(state, settings, model.num_layers, model.batch_invariant)

    def advance(self, model, params, carry: "SMCState", keys: Array, settings: SMCConfig) -> "SMCState":
        return smc_interval(model, params, carry, keys, settings)

    def prompt_done(self, carry: "SMCState", settings: SMCConfig) -> Array:
        return ~jnp.any(carry.live.reshape(-1, self.n_particles), axis=1)

    def answer(self, model, params, carry: "SMCState", keys: Array, settings: SMCConfig) -> Answer:
        _, _, chosen = final_weights(carry, keys, settings.n_particles, model.batch_invariant)
        return Answer(state=carry.gen, chosen=chosen.astype(jnp.int32))

    def progress_total(self, settings: SMCConfig) -> int:
        return self.max_new_tokens + 1  # T sampling steps and the budget's consume step

    def progress(self, carry: "SMCState") -> Array:
        return jnp.max(carry.step)

    def run_details(self, model, carry: "SMCState", keys: Array, settings: SMCConfig) -> RunDetails:
        """Per row its normalised final weight; per prompt log Ẑ, the ESS of every check
        made, the resamplings and the rows they overwrote; copied_rows summed."""
        weights, log_z, _ = final_weights(carry, keys, self.n_particles, model.batch_invariant)
        weights, log_z, ess, resamples, copied = jax.device_get(
            (weights, log_z, carry.ess, carry.resamples, carry.copied_rows))
        return RunDetails(
            candidate_fields=[dict(weight=float(w)) for w in weights.reshape(-1)],
            diagnostics=[dict(log_evidence=float(log_z[i]), ess=[float(e) for e in ess[i] if np.isfinite(e)],
                              resamples=int(resamples[i]), copied_rows=int(copied[i]))
                         for i in range(log_z.shape[0])],
            counters=dict(copied_rows=int(copied.sum())))


@dataclasses.dataclass(frozen=True)
class PowerSMC(SMCMethod):
    """Power-SMC: particles for p^alpha (beta = 0: no probing)."""

    method: ClassVar[str] = "power_smc"
    study: ClassVar[StudyRow] = StudyRow(label="Power-SMC", position=6)

    beta: float = method_field(0.0, "must stay 0 (use degs_smc for beta > 0)")

    def __post_init__(self):
        super().__post_init__()
        if not is_zero(self.beta):
            raise ValueError("power_smc is the beta = 0 sampler; use degs_smc for beta > 0")


@dataclasses.dataclass(frozen=True)
class DegsSMC(SMCMethod):
    """DEGS-SMC: particles for p^alpha·exp(beta·D)."""

    method: ClassVar[str] = "degs_smc"
    study: ClassVar[StudyRow] = StudyRow(
        label="DEGS-SMC", position=11,
        comparisons=(Comparison("power_smc", "depth term in SMC (beta = 5 vs beta = 0)", 2),),
        depth_baseline="power_smc", common_random_numbers=(
            "Common random numbers (SMC): the two runs of a beta pair draw problem i with the same "
            "key, fold_in(key(seed), i), and the same counter-based streams for each particle's "
            "tokens (per particle and position), the systematic uniform of each resampling check "
            "and the final draw of the returned particle (degs_jax/smc.py); they differ only by "
            "the beta·D terms of the particles' incremental weights. Until those terms change "
            "whether a check resamples or which ancestors it copies, the two runs hold the same "
            "particles; the final draw reads the final weights, which the depth term also "
            "changes, so a problem can return another particle of the same set. A discordant "
            "problem is therefore one the depth term changed through the weights, not one where "
            "the keys differed."))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SMCState:
    """The particle system of P prompts × N particles (B = P·N rows, prompt-major)."""

    gen: GenState  # tokens, per-token log p / log q / d_t / H_L, caches, work counters
    log_weight: Array  # [B] fp32 log weight accumulated since the prompt's last resampling
    log_target: Array  # [B] fp32 log gamma of the row's current state
    live: Array  # [B] bool: not complete (still has a token to sample or to consume)
    step: Array  # [B] int32 loop steps the row's prompt has taken (the same for its N rows)
    log_evidence: Array = per_prompt()  # [P] fp32 log Ẑ of the finished resampling epochs
    ess: Array = per_prompt()  # [P, num_checks] fp32 ESS at each check (NaN: no check, all complete)
    resamples: Array = per_prompt()  # [P] int32 resampling events
    copied_rows: Array = per_prompt()  # [P] int32 particle rows overwritten by copies of others


def ramp_fraction(n_tokens: Array, ramp_tokens: int) -> Array:
    """r_t = min(t, R) / R as fp32 (1 when R = 0)."""
    if ramp_tokens == 0:
        return jnp.ones(n_tokens.shape, jnp.float32)
    return jnp.minimum(n_tokens, ramp_tokens).astype(jnp.float32) / ramp_tokens


def log_target(gen: GenState, live: Array, smc: SMCConfig, num_layers: int,
               batch_invariant: bool = False) -> Array:
    """log gamma of every row's current state, [B] fp32, from the stored per-token values:
    a_t·log p(x_{1:t}) + b_t·D_{t-1} for a live row, alpha·log p(x) + beta·D(x) for a
    complete one (see the module docstring). batch_invariant: `lens.masked_sum`'s, and
    the per-row arithmetic on fixed tiles of rows (`_row_tiles`): XLA compiles the [B]
    multiply-add below for B and fused it differently for 4 rows and for 32 (1 ulp in a
    DEGS-SMC weight between a prompt alone and in a batch of 8, CPU; tiles fixed it)."""
    logp = masked_sum(gen.logp, gen.completion_mask(), batch_invariant)
    r = jnp.where(live, ramp_fraction(gen.length - gen.prompt_len, smc.ramp_tokens), 1.0)
    depth = jnp.zeros_like(logp)
    if smc.probed:
        # Known d_t: the scored tokens, less the last one of a live row (not consumed yet).
        last = jnp.arange(gen.max_len)[None] == gen.length[:, None] - 1
        known = gen.completion_mask(scored=True) & ~(live[:, None] & last)
        depth = sequence_depth(gen.depth, known, num_layers)

    def combine(terms):  # [n, 3] (log p, r, D) -> [n]
        logp, r, depth = terms[:, 0], terms[:, 1], terms[:, 2]
        out = (1.0 + (smc.alpha - 1.0) * r) * logp
        return out + smc.beta * r * depth if smc.probed else out

    return _row_tiles(combine, jnp.stack([logp, r, depth], axis=1), batch_invariant)


def log_weight_increment(old_log_target: Array, new_log_target: Array, log_q: Array) -> Array:
    """log[gamma(s') / (gamma(s) · q(v))] per row (log_q = 0 where nothing was sampled)."""
    return new_log_target - old_log_target - log_q


def _row_tiles(fn, array: Array, batch_invariant: bool):
    """fn over the rows of a [P, ...] array (prompts, or particles' rows); under batch
    invariance on tiles of `lens.SUM_ROWS` rows: a reduction over [P, N] particles is
    compiled for P, so a prompt's weights would depend on how many prompts share the
    batch (issue 16)."""
    return row_tiled(fn, array, sum_rows(batch_invariant))


def _prompt_logsumexp(log_weight: Array, n: int, batch_invariant: bool) -> Array:
    return _row_tiles(lambda lw: jax.nn.logsumexp(lw, axis=1), log_weight.reshape(-1, n), batch_invariant)


def effective_sample_size(log_weight: Array, n: int, batch_invariant: bool = False) -> Array:
    """(Σ w)² / Σ w² per prompt, [P] fp32, from [P·N] log weights."""
    return _row_tiles(lambda lw: jnp.exp(2.0 * jax.nn.logsumexp(lw, axis=1) - jax.nn.logsumexp(2.0 * lw, axis=1)),
                       log_weight.reshape(-1, n), batch_invariant)


def systematic_ancestors(log_weight: Array, uniform: Array, batch_invariant: bool = False) -> Array:
    """Systematic resampling with stable placement, per prompt.

    log_weight: [P, N]; uniform: [P] in [0, 1). Particle j is drawn c_j times, c_j the
    number of points (u + m)/N, m = 0..N-1, in its slice of the weights' CDF. Returns
    ancestors [P, N] (indices into the prompt's particles): a particle with c_j >= 1 keeps
    row j, its c_j - 1 extra copies fill, in order, the rows of particles with c_j = 0.
    batch_invariant: the CDF on fixed tiles of prompts (`_row_tiles`).
    """
    P, N = log_weight.shape
    cdf = _row_tiles(lambda lw: jnp.cumsum(jax.nn.softmax(lw, axis=1), axis=1), log_weight, batch_invariant)
    cdf = cdf.at[:, -1].set(1.0)  # rounding must not leave a point past the end
    points = (uniform[:, None] + jnp.arange(N)[None]) / N
    drawn = jax.vmap(lambda c, u: jnp.searchsorted(c, u, side="right"))(cdf, points)
    counts = jax.vmap(lambda d: jnp.bincount(jnp.minimum(d, N - 1), length=N))(drawn)
    extra_end = jnp.cumsum(jnp.maximum(counts - 1, 0), axis=1)  # copies owed up to particle j
    dead = counts == 0
    dead_rank = jnp.cumsum(dead, axis=1) - 1  # the k-th empty row takes the k-th extra copy
    source = jax.vmap(lambda e, k: jnp.searchsorted(e, k, side="right"))(extra_end, dead_rank)
    return jnp.where(dead, source, jnp.arange(N)[None])


def resample(state: SMCState, need: Array, ancestors: Array, n: int) -> SMCState:
    """Replace particles by their ancestors in the prompts where `need` ([P]); the
    weights of those prompts restart at 1 (their epoch's evidence is added by the caller)."""
    B = state.log_weight.shape[0]
    source = (jnp.arange(B) // n) * n + ancestors.reshape(-1)
    source = jnp.where(jnp.repeat(need, n), source, jnp.arange(B))
    copy = source != jnp.arange(B)
    take = lambda a: a[source]
    gen = copy_rows(state.gen, source, copy)
    return dataclasses.replace(
        state, gen=gen, log_target=take(state.log_target), live=take(state.live),
        log_weight=jnp.where(jnp.repeat(need, n), 0.0, state.log_weight),
        resamples=state.resamples + need,
        copied_rows=state.copied_rows + jnp.sum(copy.reshape(-1, n), axis=1))


def init_state(gen: GenState, smc: SMCConfig, num_layers: int, batch_invariant: bool = False) -> SMCState:
    """SMC state of freshly prefilled rows (P prompts × N particles, prompt-major).
    batch_invariant: the model's (`CausalLM.batch_invariant`)."""
    B = gen.length.shape[0]
    if B % smc.n_particles:
        raise ValueError(f"{B} rows are not a whole number of prompts × {smc.n_particles} particles")
    P = B // smc.n_particles
    live = ~gen.ended
    return SMCState(
        gen=gen, log_weight=jnp.zeros((B,), jnp.float32), log_target=log_target(gen, live, smc, num_layers, batch_invariant),
        live=live, step=jnp.zeros((B,), jnp.int32), log_evidence=jnp.zeros((P,), jnp.float32),
        ess=jnp.full((P, smc.num_checks), jnp.nan, jnp.float32),
        resamples=jnp.zeros((P,), jnp.int32), copied_rows=jnp.zeros((P,), jnp.int32))


def smc_interval(model: CausalLM, params: Any, state: SMCState, keys: Array, smc: SMCConfig) -> SMCState:
    """Run each prompt's loop steps until its next ESS check (then check and maybe
    resample) or until its every particle is complete. Each prompt keeps its own step
    count (prompts refilled mid-run are at other phases); a prompt that reached its check
    waits for the others. keys: [B] row keys. Traceable; `smc_steps` is its jitted,
    donating form for host loops (`run_smc`)."""
    n = smc.n_particles
    proposal_sampler = smc.proposal
    gen0 = state.gen
    limit = gen0.prompt_len + smc.max_new_tokens
    token_keys = fold_in_rows(keys, TOKEN_STREAM)
    rows = jnp.arange(keys.shape[0])
    stop = (state.step // smc.resample_every + 1) * smc.resample_every

    def moving(s: SMCState) -> Array:  # [B]: the row's prompt has a live particle and steps left
        return jnp.repeat(jnp.any(s.live.reshape(-1, n), axis=1), n) & (s.step < stop)

    def body(s: SMCState) -> SMCState:
        move = moving(s)
        gen, live = decode_step(model, params, s.gen, s.live & move, limit, token_keys, gen0.prompt_len,
                                proposal_sampler)
        live = jnp.where(move, live, s.live)
        sampled = gen.length > s.gen.length
        log_q = jnp.where(sampled, gen.logq[rows, jnp.minimum(s.gen.length, gen.max_len - 1)], 0.0)
        target = jnp.where(move, log_target(gen, live, smc, model.num_layers, model.batch_invariant), s.log_target)
        inc = jnp.where(s.live & move, log_weight_increment(s.log_target, target, log_q), 0.0)
        return dataclasses.replace(s, gen=gen, live=live, log_target=target,
                                   log_weight=s.log_weight + inc, step=s.step + move)

    state = jax.lax.while_loop(lambda s: jnp.any(moving(s)), body, state)

    # The ESS check, as masked arithmetic rather than a lax.cond: a conditional whose
    # branches return the whole state could make XLA copy the KV cache; here nothing is
    # copied unless rows are resampled (the copy loop then runs over those rows only).
    step = state.step.reshape(-1, n)[:, 0]  # [P]
    at_check = (step == stop.reshape(-1, n)[:, 0]) & (step // smc.resample_every <= smc.num_checks)
    ess = effective_sample_size(state.log_weight, n, model.batch_invariant)
    any_live = jnp.any(state.live.reshape(-1, n), axis=1)
    c = jnp.clip(step // smc.resample_every - 1, 0, max(smc.num_checks - 1, 0))
    record = jnp.where(any_live, ess, jnp.nan)
    if smc.num_checks:
        prompts = jnp.arange(step.shape[0])
        state = dataclasses.replace(state, ess=state.ess.at[prompts, c].set(
            jnp.where(at_check, record, state.ess[prompts, c])))
    need = at_check & any_live & (ess < smc.ess_threshold * n)
    first_keys = keys.reshape(-1, n)[:, 0]
    uniform = jax.vmap(jax.random.uniform)(fold_in_rows(first_keys, RESAMPLE_STREAM, c))
    ancestors = systematic_ancestors(state.log_weight.reshape(-1, n), uniform, model.batch_invariant)
    mean_w = _prompt_logsumexp(state.log_weight, n, model.batch_invariant) - jnp.log(n)
    state = dataclasses.replace(state, log_evidence=state.log_evidence + jnp.where(need, mean_w, 0.0))
    return resample(state, need, ancestors, n)


smc_steps = jax.jit(smc_interval, static_argnames=("model",), donate_argnames=("state",))


def run_smc(model: CausalLM, params: Any, gen: GenState, keys: Array, smc: SMCConfig,
            progress=None) -> SMCState:
    """The whole particle system from freshly prefilled rows (`repeat_rows` of a prefill,
    N consecutive rows per prompt) to every particle complete. keys: [B] row keys.
    `gen` is donated. progress: optional callable(loop steps done) after each interval."""
    state = init_state(gen, smc, model.num_layers, model.batch_invariant)
    for _ in range(smc.num_checks + 1):
        state = smc_steps(model, params, state, keys, smc)
        if progress is not None:
            progress(int(jnp.max(state.step)))
        if not bool(jnp.any(state.live)):
            break
    return state


def final_weights(state: SMCState, keys: Array, n: int,
                  batch_invariant: bool = False) -> tuple[Array, Array, Array]:
    """(normalised weights [P, N], log Ẑ [P], chosen particle [P]) of a finished run; the
    chosen particle is drawn with probability proportional to its weight. Only the
    weights and the evidence enter the compiled program, never the state's KV cache
    (a 7B-shape state at 64 prompts x 16 particles is ~41 GB). batch_invariant: the
    model's (`CausalLM.batch_invariant`)."""
    return _final_weights(state.log_weight, state.log_evidence, keys, n, batch_invariant)


@functools.partial(jax.jit, static_argnames=("n", "batch_invariant"))
def _final_weights(log_weight: Array, log_evidence: Array, keys: Array,
                   n: int, batch_invariant: bool) -> tuple[Array, Array, Array]:
    lw = log_weight.reshape(-1, n)
    log_z = log_evidence + _prompt_logsumexp(log_weight, n, batch_invariant) - jnp.log(n)
    choice_keys = fold_in_rows(keys.reshape(-1, n)[:, 0], CHOICE_STREAM)
    chosen = jax.vmap(jax.random.categorical)(choice_keys, lw)
    return _row_tiles(lambda w: jax.nn.softmax(w, axis=1), lw, batch_invariant), log_z, chosen
