"""Metropolis-Hastings power sampling (beta = 0) and DEGS-MCMC (beta > 0), docs/design.md §4.

Target pi(x) ∝ p(x)^alpha · exp(beta · D(x)) over completions, built block by block.
For block k a chain first extends its completion with the proposal
q = softmax(alpha · log p) (optionally truncated) to EOS or the block boundary, then
runs `mh_steps` Metropolis-Hastings steps: cut m ~ Uniform{0..n_x-1}, keep x_<m,
regenerate from m to EOS or the boundary, accept with probability min(1, r) (EOS here
and below: or the first stop string, `degs_jax.stops`, an end of the same kind),

  log r = alpha·[log p(x'_{m:}) - log p(x_{m:})] + [log q(x_{m:}) - log q(x'_{m:})]
        + beta·[D(x') - D(x)] + log n_x - log n_x',

with whole-suffix sums of the per-token values stored when each token was generated
(see `log_acceptance_ratio` for why these stored values make the ratio exact).
All rows (problems x chains) run in one batch; the MH steps of a block are one jitted
`lax.while_loop` of decode steps in which every row runs its own steps (`mh_steps`),
carrying an `MHState`. The model is a `degs_jax.model_api.CausalLM`.

Randomness: every draw of chain r derives from its key k_r by `fold_in` (counter-based,
so a chain's draws do not depend on the batch it runs in):

  block b's extension        fold_in(fold_in(k_r, b), EXTENSION_STREAM), then per position
  MH step s of block b       step key  = fold_in(fold_in(k_r, b), FIRST_MH_STREAM + s)
    cut index                fold_in(step key, CUT_STREAM)
    regeneration             fold_in(step key, REGENERATE_STREAM), then per position
    accept / reject          fold_in(step key, ACCEPT_STREAM)

Depth-decided decisions: next to its accepted steps, every block counts the MH decisions
that the depth term decided, i.e. where accepting with beta·[D(x') - D(x)] in log r and
accepting without it (power-MCMC's log r of the same x, x' and cut) differ for the same
uniform u. With beta = 0 the count is 0. Under common random numbers a DEGS-MCMC chain and
a power-MCMC chain draw the same cuts, proposals and u until their decisions first differ,
so while this count is 0 the two chains are identical, token for token: a GPU study found
them identical on all 64 problems it ran, and this count shows why (beta·ΔD never flipped a
decision there). It adds no model work: the second ratio is made of the same stored
per-token sums, compared with the same u (a few [B] operations per decision).

Decision records: every MH decision is also recorded whole (`MHDecisions`, per row, block
and step): the log ratio without the depth term (log r_0: the first four terms of log r
above, cut-index ratio included), the depth difference D(x') - D(x) (so beta·ΔD at the
run's beta, or any other), log u, whether the proposal equals the current state (a null
move: same suffix, accepted since ΔD = 0 and log r_0 is 0 up to the rounding of its
re-stored per-token values), the cut m and both
suffix lengths. They are the same stored per-token sums the decision used (no model
work), so the anatomy of a run's decisions, and the decisions another beta would flip at
the states this chain visited, are read off its records (`degs_jax.decisions`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, ClassVar, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np

from .generation import GenState, Proposal, SamplerSpec, TopK, Truncation, decode_step, generate
from .lens import LensConfig, sequence_depth, span_sum
from .method import (DEFAULT_ALPHA, DEFAULT_BETA, SMALLEST_RUN_TOKENS, Answer, Method, RunDetails, method_field,
                     positive_int, require_lens, validate_alpha, validate_beta)
from .model_api import CausalLM
from .rows import fold_in_rows, settle_rows, work_counters
from .stops import StopAutomaton
from .traced_fields import is_zero, register_traced_dataclass

Array = jax.Array

# Reference-code behaviour reproduced by `reference_quirks=True`.
QUIRKS_TOP_K = 50

# PRNG stream tags (module docstring). Changing any of them changes every chain's draws.
EXTENSION_STREAM = 0  # under the block key: the extension to the block boundary
FIRST_MH_STREAM = 1  # under the block key: MH step s uses FIRST_MH_STREAM + s
CUT_STREAM = 0  # under the step key: the cut index m
REGENERATE_STREAM = 1  # under the step key: the proposal's tokens
ACCEPT_STREAM = 2  # under the step key: the uniform of the accept test


@functools.partial(register_traced_dataclass, traced=lambda cls: ("alpha", "beta", "lens", "truncations"))
@dataclasses.dataclass(frozen=True)
class MCMCConfig:
    """The chain's settings: a pytree whose leaves are alpha, beta, the lens's tau and the
    truncations' fractions (top-p, min-p, typical), data of the compiled program (one
    program for every value, `jax.vmap` over them; a beta of concrete 0 is static, the
    program without the depth term: `traced_fields`); every other field is static, part of
    the program. The methods build it from the `degs_mcmc` / `power_mcmc` hyperparameters
    (`MCMCMethod` below), where the paper's defaults live. The method checks its values when it is built; this, the
    kernel's own API (tests and benchmarks build it directly), runs the same checks
    (`check_chain_hyperparameters`) and asks for a lens when beta > 0.

    alpha: power (proposal temperature 1/alpha), >= 1.
    beta: weight of D(x); 0 = power sampling (no probing): `probed`.
    block_len, num_blocks: the block schedule (max new tokens = block_len · num_blocks).
    mh_steps: MH steps per block.
    lens: layers and tau for D(x) (required when beta > 0).
    eos_ids: token ids that end a completion.
    stop: compiled stop strings that end a completion like EOS (`stops.stop_automaton`), or None.
    truncations: optional cuts of the proposal (`generation.Truncation`: top-k, top-p,
      min-p, typical, or a user's own; log q is then the truncated density); () = none.
    reference_quirks: reproduce the public reference implementation (top-k 50,
      proposals capped at the current length, no cut-index ratio, current suffix
      truncated to the proposal's length) for side-by-side runs. Not exact.
    """

    alpha: float
    beta: float
    block_len: int
    num_blocks: int
    mh_steps: int
    lens: Optional[LensConfig] = None
    eos_ids: tuple[int, ...] = ()
    truncations: tuple[Truncation, ...] = ()
    reference_quirks: bool = False
    stop: Optional[StopAutomaton] = None

    def __post_init__(self):
        check_chain_hyperparameters(self)
        require_lens(self.beta, self.lens)

    @property
    def max_new_tokens(self) -> int:
        return self.block_len * self.num_blocks

    @property
    def probed(self) -> bool:
        """The target has the depth term (and the proposal records d_t): beta is not a
        concrete 0 (a traced beta may be any value)."""
        return not is_zero(self.beta)

    @property
    def proposal(self) -> SamplerSpec:
        """The proposal q: temperature 1/alpha, the truncations (the reference's top-k 50
        first under `reference_quirks` where no top-k is given), the lens when beta > 0."""
        cuts = self.truncations
        if self.reference_quirks and not any(isinstance(cut, TopK) for cut in cuts):
            cuts = (TopK(QUIRKS_TOP_K),) + cuts
        return SamplerSpec(Proposal(1.0 / self.alpha, cuts), eos_ids=self.eos_ids,
                           lens=self.lens if self.probed else None, stop=self.stop)


def check_chain_hyperparameters(chain: Any) -> None:
    """ValueError naming the first bad value among the chain's hyperparameters, read by
    name from `chain`: an `MCMCMethod` or an `MCMCConfig` (the one list of checks of both)."""
    validate_alpha(chain.alpha)
    validate_beta(chain.beta)
    for name in ("block_len", "num_blocks", "mh_steps"):
        positive_int(name, getattr(chain, name))


@dataclasses.dataclass(frozen=True)
class MCMCMethod(Method):
    """The Metropolis-Hastings chain (docs/design.md §4): the methods' hyperparameters.

    Cost when nothing ends early: a chain of B blocks of l tokens with T MH steps per
    block generates B·l tokens for the blocks plus, per block k = 1..B, T regenerations
    of on average half of its k·l tokens, i.e. B·l + T·l·B(B+1)/4, in as many sequential
    steps (a chain's proposals are sequential; chains decode side by side).
    """

    alpha: float = method_field(DEFAULT_ALPHA, "power of the target p(x)^alpha; the proposal "
                                "samples at temperature 1/alpha (>= 1)", traced=True)
    beta: float = method_field(DEFAULT_BETA, "weight of D(x) in the target p(x)^alpha·exp(beta·D(x))",
                               traced=True)
    block_len: int = method_field(192, "tokens per MCMC block")
    num_blocks: int = method_field(16, "MCMC blocks (max new tokens = block_len · num_blocks)")
    mh_steps: int = method_field(10, "Metropolis-Hastings steps per block")
    n_chains: int = method_field(1, "independent chains per prompt")
    reference_quirks: bool = method_field(False, "reproduce the public power-sampling code's "
                                          "deviations (top-k 50, no cut-index ratio, ...; not exact)")

    smallest_run: ClassVar[Mapping[str, Any]] = dict(block_len=SMALLEST_RUN_TOKENS // 2, num_blocks=2, mh_steps=2,
                                                     n_chains=2)

    def __post_init__(self):
        super().__post_init__()
        check_chain_hyperparameters(self)
        positive_int("n_chains", self.n_chains)

    @property
    def probed(self) -> bool:
        return not is_zero(self.beta)

    @property
    def pool_size(self) -> int:
        return self.n_chains

    @property
    def sequences_per_prompt(self) -> int:
        """Two sequences per chain: the chain x and its running proposal x'."""
        return 2 * self.n_chains

    @property
    def max_new_tokens(self) -> int:
        return self.block_len * self.num_blocks

    def kernel_config(self, num_layers: int, eos_ids: tuple[int, ...],
                      stop: Optional[StopAutomaton] = None) -> MCMCConfig:
        """The chain kernel's settings for a model with `num_layers` blocks."""
        return MCMCConfig(alpha=self.alpha, beta=self.beta, block_len=self.block_len,
                          num_blocks=self.num_blocks, mh_steps=self.mh_steps,
                          lens=self.lens_config(num_layers) if self.probed else None,
                          eos_ids=tuple(eos_ids), truncations=self.truncations(),
                          reference_quirks=bool(self.reference_quirks), stop=stop)

    def worst_case_cost(self) -> Optional[tuple[int, int]]:
        b, l, t = self.num_blocks, self.block_len, self.mh_steps
        steps = int(b * l + t * l * b * (b + 1) / 4)
        return self.n_chains * steps, steps

    def sequential_steps(self, n_tokens: int) -> float:
        """Blocks k = 1..ceil(n / l) of l tokens, each extended and then regenerated T times
        from a cut uniform over its k·l tokens: sum_k (l + T·k·l/2)."""
        blocks = max(1, -(-n_tokens // self.block_len))
        return sum(self.block_len + self.mh_steps * k * self.block_len / 2 for k in range(1, blocks + 1))

    # Kernel: the carry is `ChainRun`, `advance` one block (`mcmc_block`) of every chain.

    def init(self, model, params, state: GenState, keys: Array, settings: MCMCConfig) -> "ChainRun":
        return start_chains(state, settings)

    def advance(self, model, params, carry: "ChainRun", keys: Array, settings: MCMCConfig) -> "ChainRun":
        return chains_block(model, params, carry, keys, settings)

    def prompt_done(self, carry: "ChainRun", settings: MCMCConfig) -> Array:
        return jnp.all(~chain_running(carry, settings).reshape(-1, self.pool_size), axis=1)

    def answer(self, model, params, carry: "ChainRun", keys: Array, settings: MCMCConfig) -> Answer:
        return Answer(state=carry.state, accepted=carry.decisions.accepted_steps(),
                      depth_decided=carry.decisions.depth_decided_steps(), ran=carry.ran,
                      decisions=carry.decisions)

    progress_unit: ClassVar[str] = "block"

    def progress_total(self, settings: MCMCConfig) -> int:
        return self.num_blocks

    def progress(self, carry: "ChainRun") -> Array:
        return jnp.max(carry.block)

    def run_details(self, model, carry: "ChainRun", keys: Array, settings: MCMCConfig) -> RunDetails:
        """Per row, over every block it ran: the acceptance rate, the depth-decided decisions
        and the decision records (`decision_lists`)."""
        decisions, ran = jax.device_get((carry.decisions, carry.ran))
        accepted, depth_decided = decisions.accepted.sum(-1), decisions.depth_decided.sum(-1)
        return RunDetails(candidate_fields=[
            dict(acceptance=[float(accepted[r, b]) / self.mh_steps for b in np.flatnonzero(ran[r])],
                 depth_decisions=[int(depth_decided[r, b]) for b in np.flatnonzero(ran[r])],
                 mh_decisions=decision_lists(decisions, r, ran[r], self.probed))
            for r in range(ran.shape[0])])


def decision_lists(decisions: MHDecisions, row: int, ran: np.ndarray, probed: bool) -> dict[str, list]:
    """Row `row`'s decision records (host arrays [rows, num_blocks, mh_steps]) as lists
    per block it ran (`ran`: [num_blocks] bool) and per step, for JSON records: floats as
    the shortest decimal that reads back as the same float32; `depth_delta` None when the
    chain did not probe (power MCMC: nothing measured)."""
    blocks = np.flatnonzero(ran)

    def lists(values: np.ndarray) -> list:
        if values.dtype == np.float32:
            return [[float(str(v)) for v in values[row, b]] for b in blocks]
        return values[row][blocks].tolist()

    fields = {name: lists(values) for name, values in vars(decisions).items()}
    if not probed:
        fields["depth_delta"] = None
    return fields


@dataclasses.dataclass(frozen=True)
class PowerMCMC(MCMCMethod):
    """MH chain for p^alpha (beta = 0: no probing)."""

    method: ClassVar[str] = "power_mcmc"

    beta: float = method_field(0.0, "must stay 0 (use degs_mcmc for beta > 0)")

    def __post_init__(self):
        super().__post_init__()
        if not is_zero(self.beta):
            raise ValueError("power_mcmc is the beta = 0 chain; use degs_mcmc for beta > 0")


@dataclasses.dataclass(frozen=True)
class DegsMCMC(MCMCMethod):
    """MH chain for p^alpha·exp(beta·D)."""

    method: ClassVar[str] = "degs_mcmc"


def _depth_score(state: GenState, num_layers: int) -> Array:
    return sequence_depth(state.depth, state.completion_mask(scored=True), num_layers)


def log_acceptance_ratio(current: GenState, proposal: GenState, cut: Array, mcmc: MCMCConfig,
                         num_layers: int, batch_invariant: bool = False) -> Array:
    """log r of docs/design.md §4 for every row, [B] fp32, from stored per-token values only.

    current / proposal: the chain x and the proposal x', equal below `cut` ([B] slot of
    the cut m). num_layers: L of the model (D(x) = mean d_t / L). batch_invariant: sum
    the suffixes in a fixed order (`lens.masked_sum`; the model's `batch_invariant`).

    Why the stored values give the exact ratio of the target to the proposal kernel:
    1. The stored suffix log q of x is the reverse proposal's density. A regeneration
       stops exactly at EOS, at the first stop string or at the block boundary, and the
       chain's state always ends at one of these (it was extended there, and only such
       proposals are accepted), so producing x_{m:} from x'_{<m} = x_{<m} has probability
       prod_t q(x_t | x_<t), with no extra stopping factor; every stored log q was
       computed under this same proposal (temperature, truncation) from the same prefix.
       A stop string is matched from the completion's start, and a regeneration resumes
       the automaton from the state stored after x_{m-1} (`generation.advance_stop`), so
       whether a token ends the sequence depends on its prefix alone, as for EOS.
    2. log n_x - log n_x' is the ratio of the cut-index probabilities: m is uniform
       over the n_x completion positions of x for the forward move and over the n_x'
       positions of x' for the reverse one.
    3. Per-token values depend only on earlier tokens: log p(x_t | x_<t), log q and the
       collapse depth d_t (from the residuals at position t under causal attention) of
       the shared prefix x_<m are the same in x and x', so whole-suffix sums are the
       differences of the full sums, and D(x') from stored values is exactly D(x').
    `reference_quirks` breaks 1 and 2 on purpose (see MCMCConfig).
    """
    x_end = current.length
    if mcmc.reference_quirks:
        x_end = jnp.minimum(current.length, proposal.length)
    suffix = functools.partial(span_sum, batch_invariant=batch_invariant)
    log_r = (mcmc.alpha * (suffix(proposal.logp, cut, proposal.length) - suffix(current.logp, cut, x_end))
             + suffix(current.logq, cut, x_end) - suffix(proposal.logq, cut, proposal.length))
    if mcmc.probed:
        log_r += mcmc.beta * (_depth_score(proposal, num_layers) - _depth_score(current, num_layers))
    if not mcmc.reference_quirks:
        n_x = (current.length - current.prompt_len).astype(jnp.float32)
        n_y = (proposal.length - proposal.prompt_len).astype(jnp.float32)
        log_r += jnp.log(n_x) - jnp.log(n_y)
    return log_r


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class MHDecisions:
    """Every MH decision (module docstring, "Decision records"): one entry per row and
    MH step, [B, mh_steps] per field in a block ([B, num_blocks, mh_steps] over a chain);
    a step a row did not run (it had ended before the block) holds zeros."""

    accepted: Array  # bool: the proposal was accepted (log u < log r)
    depth_decided: Array  # bool: accepting with and without beta·ΔD differ for this u
    log_ratio_power: Array  # fp32: log r_0, the log ratio with beta = 0
    depth_delta: Array  # fp32: D(x') - D(x) (0 when the chain does not probe, beta = 0)
    log_u: Array  # fp32: log of the uniform of the accept test
    null_move: Array  # bool: x' equals x (same length, same tokens past the cut)
    cut: Array  # int32: the cut m, in completion positions
    current_suffix: Array  # int32: tokens of x past the cut (n_x - m)
    proposal_suffix: Array  # int32: tokens of x' past the cut (n_x' - m)

    @classmethod
    def zeros(cls, shape: tuple[int, ...]) -> "MHDecisions":
        kinds = dict(accepted=bool, depth_decided=bool, null_move=bool, cut=jnp.int32,
                     current_suffix=jnp.int32, proposal_suffix=jnp.int32)
        return cls(**{f.name: jnp.zeros(shape, kinds.get(f.name, jnp.float32))
                      for f in dataclasses.fields(cls)})

    def record(self, step: Array, decided: Array, **values: Array) -> "MHDecisions":
        """These [B, mh_steps] records with step `step[b]` of each row b in `decided` set
        to `values` ([B] per field, every field given)."""
        at = decided[:, None] & (jnp.arange(self.accepted.shape[-1])[None] == step[:, None])
        return MHDecisions(**{name: jnp.where(at, values[name][:, None].astype(old.dtype), old)
                              for name, old in vars(self).items()})

    def accepted_steps(self) -> Array:
        """int32 [...]: accepted steps, summed over the last (step) axis."""
        return self.accepted.sum(-1, dtype=jnp.int32)

    def depth_decided_steps(self) -> Array:
        """int32 [...]: decisions beta·ΔD decided, summed over the last (step) axis."""
        return self.depth_decided.sum(-1, dtype=jnp.int32)


def null_move(current: GenState, proposal: GenState, cut: Array) -> Array:
    """[B] bool: the proposal x' is the current state x (equal past the cut, and so whole)."""
    pos = jnp.arange(current.max_len)[None]
    differs = (current.tokens != proposal.tokens) & (pos >= cut[:, None]) & (pos < current.length[:, None])
    return (current.length == proposal.length) & ~jnp.any(differs, axis=1)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class MHState:
    """The carry of `mh_steps`' loop: a chain and its running proposal, per row."""

    current: GenState  # the chain x
    proposal: GenState  # x': equal to x except past the cut of a running proposal
    generating: Array  # [B] bool: the row's proposal is still drawing tokens
    step: Array  # [B] int32: MH steps finished in this block
    cut: Array  # [B] int32: slot of the running proposal's cut m (prompt_len + m)
    proposal_limit: Array  # [B] int32: length the running proposal may reach
    proposal_keys: Array  # [B] PRNG keys of the running proposal's tokens
    decisions: MHDecisions  # [B, mh_steps]: this block's decisions so far


@functools.partial(jax.jit, static_argnames=("model",))
def mh_steps(model: CausalLM, params: Any, state: GenState, keys: Array, block: Array,
             limit: Array, active: Array, mcmc: MCMCConfig) -> tuple[GenState, MHDecisions]:
    """`mcmc.mh_steps` MH steps on every active row, in one jitted `lax.while_loop`.

    limit: [B] the block boundary (total length) proposals regenerate up to;
    active: [B] rows that move (others are left untouched). keys: [B] chain keys;
    streams as in the module docstring. Returns (state, decisions: `MHDecisions`
    [B, mh_steps], among them whether each step was accepted and whether the depth term
    beta·ΔD decided it, i.e. accepting with and without it differ for the same u; never
    when beta = 0; module docstring). `state` is not donated.

    Rows advance independently: every loop iteration is one decode step of every row's
    proposal; a row whose proposal ends (EOS or the boundary) is accepted or rejected
    there and starts its next step at once, so no row idles until the batch's longest
    regeneration of the same step is done. The proposal lives in a second state whose
    rows equal the current chain's except past the cut of a running proposal; after a
    decision both rows are made equal again (row copies of the cache). A row's draws
    depend only on its key, the block and its step, so the chain is the one of running
    the steps in lock-step (or the row alone).
    """
    proposal_sampler = mcmc.proposal
    block_keys = fold_in_rows(keys, block)

    def step_keys(step: Array) -> Array:
        return fold_in_rows(block_keys, FIRST_MH_STREAM + step)

    def begin(chain: MHState, starting: Array) -> MHState:
        """Start step `chain.step` of the rows in `starting`: draw the cut, truncate the proposal."""
        keys_now = step_keys(chain.step)
        n_x = chain.current.length - chain.current.prompt_len
        m = jax.vmap(lambda k, n: jax.random.randint(k, (), 0, jnp.maximum(n, 1)))(
            fold_in_rows(keys_now, CUT_STREAM), n_x)
        # cut < current.length <= the proposal's limit: every proposal draws >= 1 token.
        new_cut = chain.current.prompt_len + m
        new_limit = chain.current.length if mcmc.reference_quirks else limit
        proposal = dataclasses.replace(
            chain.proposal, length=jnp.where(starting, new_cut, chain.proposal.length),
            ended=chain.proposal.ended & ~starting)
        return dataclasses.replace(
            chain, proposal=proposal, cut=jnp.where(starting, new_cut, chain.cut),
            proposal_limit=jnp.where(starting, new_limit, chain.proposal_limit),
            proposal_keys=jnp.where(starting, fold_in_rows(keys_now, REGENERATE_STREAM),
                                    chain.proposal_keys),
            generating=chain.generating | starting)

    def body(chain: MHState) -> MHState:
        with jax.named_scope("propose"):
            proposal, still = decode_step(model, params, chain.proposal, chain.generating,
                                          chain.proposal_limit, chain.proposal_keys, chain.cut, proposal_sampler)
        done = chain.generating & ~still
        with jax.named_scope("accept_reject"):
            accept_keys = fold_in_rows(step_keys(chain.step), ACCEPT_STREAM)
            log_u = jnp.log(jax.vmap(jax.random.uniform)(accept_keys))
            ratio = lambda config: log_acceptance_ratio(chain.current, proposal, chain.cut, config,
                                                        model.num_layers, model.batch_invariant)
            log_r = ratio(mcmc)
            accepts = log_u < log_r
            accept = done & accepts
            log_r_power, depth_delta = log_r, jnp.zeros_like(log_r)
            if mcmc.probed:  # the power-MCMC decision from the same u
                log_r_power = ratio(dataclasses.replace(mcmc, beta=0.0))
                depth_delta = (_depth_score(proposal, model.num_layers)
                               - _depth_score(chain.current, model.num_layers))
            decisions = chain.decisions.record(
                chain.step, done, accepted=accept, depth_decided=accepts != (log_u < log_r_power),
                log_ratio_power=log_r_power, depth_delta=depth_delta, log_u=log_u,
                null_move=null_move(chain.current, proposal, chain.cut),
                cut=chain.cut - chain.current.prompt_len, current_suffix=chain.current.length - chain.cut,
                proposal_suffix=proposal.length - chain.cut)
            # Both states take the decided row; the proposal keeps the work counters (work
            # on rejected proposals counts in the compute accounting).
            current, proposal = settle_rows(chain.current, proposal, done, accept)
        step = chain.step + done
        chain = MHState(current=current, proposal=proposal, generating=chain.generating & still,
                        step=step, cut=chain.cut, proposal_limit=chain.proposal_limit,
                        proposal_keys=chain.proposal_keys, decisions=decisions)
        return begin(chain, done & (step < mcmc.mh_steps))

    chain = MHState(current=state, proposal=state, generating=jnp.zeros_like(active),
                    step=jnp.zeros(active.shape, jnp.int32), cut=state.length, proposal_limit=state.length,
                    proposal_keys=keys, decisions=MHDecisions.zeros((active.shape[0], mcmc.mh_steps)))
    chain = jax.lax.while_loop(lambda c: jnp.any(c.generating), body, begin(chain, active))
    final = dataclasses.replace(chain.current, **work_counters(chain.proposal))
    return final, chain.decisions


@functools.partial(jax.jit, static_argnames=("model",))
def mcmc_block(model: CausalLM, params: Any, state: GenState, keys: Array, block: Array,
               mcmc: MCMCConfig) -> tuple[GenState, MHDecisions, Array]:
    """Block `block` for every row: extend with the proposal to EOS or the boundary
    (block + 1)·block_len, then `mcmc.mh_steps` MH steps.

    state: GenState of B chains (not donated: the caller may keep using it; see
    `mcmc_block_donating`); keys: [B] chain keys (a row's randomness depends only on its
    key, the block and the step); block: int32, a scalar or one per row (rows of refilled
    prompts are at different blocks; a row at num_blocks does not move). Returns (state,
    decisions [B, mh_steps] (`mh_steps`), active [B] bool: rows that ran this block, i.e.
    had not ended before it).
    """
    active = ~state.ended & (block < mcmc.num_blocks)
    boundary = jnp.minimum(state.prompt_len + (block + 1) * mcmc.block_len, state.max_len)
    limit = jnp.where(active, boundary, state.length)
    with jax.named_scope("extend"):
        state = generate(model, params, state, limit, fold_in_rows(keys, block, EXTENSION_STREAM),
                         mcmc.proposal)
    with jax.named_scope("mh_steps"):
        state, decisions = mh_steps(model, params, state, keys, block, limit, active, mcmc)
    return state, decisions, active


# `mcmc_block` with `state` donated, for host loops that replace their state every block
# (its cache is then updated in place rather than copied; the caller must not touch the
# state it passed, nor pass arrays that belong to it as other arguments).
mcmc_block_donating = jax.jit(mcmc_block.__wrapped__, static_argnames=("model",),
                              donate_argnames=("state",))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ChainRun:
    """The carry of `run_chains`' loop over blocks, and its result."""

    state: GenState
    block: Array  # [B] int32: blocks the row has run (its phase: the blocks' keys and boundaries)
    decisions: MHDecisions  # [B, num_blocks, mh_steps]: every MH decision (`mh_steps`)
    ran: Array  # [B, num_blocks] bool: the row ran the block (it had not ended before it)


@functools.partial(jax.jit, static_argnames=("model",))
def run_chains(model: CausalLM, params: Any, state: GenState, keys: Array,
               mcmc: MCMCConfig) -> ChainRun:
    """Every block of the chain in one jitted `lax.while_loop` over blocks (stopping when
    every row has ended): the traceable counterpart of a host loop over `mcmc_block`,
    with the same draws. Jit- and vmap-able (under vmap the loop runs until every
    instance is done; finished ones are left unchanged). `state` is not donated."""
    return jax.lax.while_loop(lambda run: chains_continue(run, mcmc),
                              lambda run: chains_block(model, params, run, keys, mcmc), start_chains(state, mcmc))


def start_chains(state: GenState, mcmc: MCMCConfig) -> ChainRun:
    """`run_chains`' carry before its first block."""
    B = state.length.shape[0]
    return ChainRun(state=state, block=jnp.zeros((B,), jnp.int32),
                    decisions=MHDecisions.zeros((B, mcmc.num_blocks, mcmc.mh_steps)),
                    ran=jnp.zeros((B, mcmc.num_blocks), bool))


def chain_running(run: ChainRun, mcmc: MCMCConfig) -> Array:
    """[B] bool: the row has a block left and has not ended."""
    return (run.block < mcmc.num_blocks) & ~run.state.ended


def chains_continue(run: ChainRun, mcmc: MCMCConfig) -> Array:
    """bool scalar: some row has a block left and has not ended."""
    return jnp.any(chain_running(run, mcmc))


def chains_block(model: CausalLM, params: Any, run: ChainRun, keys: Array, mcmc: MCMCConfig) -> ChainRun:
    """The next block of every chain (`mcmc_block`, each row at its own block), recorded
    in the carry (a row past its last block records nothing)."""
    with jax.named_scope("block"):
        state, decisions, active = mcmc_block(model, params, run.state, keys, run.block, mcmc)
    rows = jnp.arange(run.block.shape[0])
    return ChainRun(state=state, block=jnp.minimum(run.block + 1, mcmc.num_blocks),
                    decisions=jax.tree.map(lambda every, block: every.at[rows, run.block].set(block, mode="drop"),
                                           run.decisions, decisions),
                    ran=run.ran.at[rows, run.block].set(active, mode="drop"))
