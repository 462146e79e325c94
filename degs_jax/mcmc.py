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
The kernel is built from named parts (`ChainKernel`: the cut rule with its ratio term, the
regeneration's extent with the suffix the ratio sums, the accept rule), so the exact chain
and the public reference code's (`REFERENCE_KERNEL`) are two values of one program.

Rows at their own pace: all rows (problems x chains) run in one batch, and every row is at
its own block and MH step (`ChainRows`, the carry). One loop iteration (`chain_step`) is one
decode step of every row's running proposal (the block's extension, or an MH step's
regeneration); a row whose proposal ends is decided there and starts its next step, its
next block or, when its chain is finished, nothing, at once. No row waits for another:
the batch's work is its rows' work, and a prompt slot whose chains are finished takes the
next prompt (`decoders.decode_stream`) while the other rows go on. The model is a
`degs_jax.model_api.CausalLM`.

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
from typing import Any, ClassVar, Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .drafts import LookupDraft, SuffixDraft, validate_draft_fields
from .generation import (Draft, GenState, Proposal, SamplerSpec, TopK, Truncation, decode_step, drafted_decode_step,
                         replay_cache)
from .lens import LensConfig, sequence_depth, span_sum
from .method import (DEFAULT_ALPHA, DEFAULT_BETA, SMALLEST_RUN_TOKENS, Answer, Comparison, Method, RunDetails, StudyRow,
                     method_field, positive_int, require_lens, validate_alpha, validate_beta)
from .model_api import CausalLM
from .rows import fold_in_rows, select_rows, settle_rows, work_counters
from .stops import StopAutomaton
from .traced_fields import is_zero, register_traced_dataclass

Array = jax.Array

# PRNG stream tags (module docstring). Changing any of them changes every chain's draws.
EXTENSION_STREAM = 0  # under the block key: the extension to the block boundary
FIRST_MH_STREAM = 1  # under the block key: MH step s uses FIRST_MH_STREAM + s
CUT_STREAM = 0  # under the step key: the cut index m
REGENERATE_STREAM = 1  # under the step key: the proposal's tokens
ACCEPT_STREAM = 2  # under the step key: the uniform of the accept test


# ---------------------------------------------------------------- the kernel's parts
#
# An MH kernel variant is a value (`ChainKernel`) made of named parts, each a frozen
# dataclass (static: part of the compiled program): the cut rule paired with its term in
# log r, the regeneration's extent paired with the suffix of x that log r sums, and the
# accept rule. The exact chain of docs/design.md §4 is `EXACT_KERNEL`; the public reference
# code's deviations are `REFERENCE_KERNEL` (`reference_quirks=True`), a value like any other.


@dataclasses.dataclass(frozen=True)
class UniformCut:
    """The cut rule: m ~ Uniform{0..n_x - 1} over the current completion's positions (EOS
    included; the prompt is frozen), paired with its term in log r: the reverse move draws
    m from the n_x' positions of x', so the ratio of the cut-index probabilities is
    log n_x - log n_x'. with_ratio=False leaves that term out (the reference code; not exact)."""

    with_ratio: bool = True

    def draw(self, keys: Array, n_x: Array) -> Array:
        """[B] int32 cuts in completion positions from [B] keys and lengths n_x (>= 1 drawn from 1)."""
        return jax.vmap(lambda k, n: jax.random.randint(k, (), 0, jnp.maximum(n, 1)))(keys, n_x)

    def log_ratio(self, n_x: Array, n_y: Array) -> Array:
        """[B] fp32: the cut rule's term in log r for completions of n_x (x) and n_y (x') tokens."""
        if not self.with_ratio:
            return jnp.zeros(n_x.shape, jnp.float32)
        return jnp.log(n_x.astype(jnp.float32)) - jnp.log(n_y.astype(jnp.float32))


@dataclasses.dataclass(frozen=True)
class ToBlockBoundary:
    """The regeneration's extent: a proposal regenerates from the cut to EOS or the block
    boundary (not capped at the current length), and log r sums the whole suffixes of both
    states. capped_at_current=True is the reference code: proposals capped at x's length,
    and x's suffix truncated to the proposal's length in log r (not exact)."""

    capped_at_current: bool = False

    def limit(self, current: GenState, boundary: Array) -> Array:
        """[B] int32: the length a proposal from `current` may reach in a block ending at `boundary`."""
        return current.length if self.capped_at_current else boundary

    def current_end(self, current: GenState, proposal: GenState) -> Array:
        """[B] int32: the end of x's suffix that log r sums."""
        if self.capped_at_current:
            return jnp.minimum(current.length, proposal.length)
        return current.length


@dataclasses.dataclass(frozen=True)
class MetropolisAccept:
    """The accept rule: accept x' when log u < log r (probability min(1, r)), u uniform
    from the step's ACCEPT_STREAM key."""

    def log_u(self, keys: Array) -> Array:
        """[B] fp32 log u from [B] accept keys."""
        return jnp.log(jax.vmap(jax.random.uniform)(keys))

    def accepts(self, log_u: Array, log_r: Array) -> Array:
        return log_u < log_r


@dataclasses.dataclass(frozen=True)
class ChainKernel:
    """An MH kernel variant: its cut rule (with its ratio term), the regeneration's extent
    (with the suffix the ratio sums), the accept rule, the top-k applied to the proposal
    when no top-k is given (0: none), and the draft its proposals are verified against
    (`Draft`; None: one token per forward). Static: one compiled program per variant. The
    draft changes how each token is drawn, not its law: a drafted chain is another chain of
    the same kernel (other tokens for the same seed, the same target)."""

    cut: UniformCut = UniformCut()
    extent: ToBlockBoundary = ToBlockBoundary()
    accept: MetropolisAccept = MetropolisAccept()
    default_top_k: int = 0
    draft: Optional[Draft] = None


# The chain of docs/design.md §4, and the public reference implementation of power sampling
# (top-k 50, proposals capped at the current length, no cut-index ratio, the current suffix
# truncated to the proposal's length), for side-by-side runs.
EXACT_KERNEL = ChainKernel()
REFERENCE_KERNEL = ChainKernel(cut=UniformCut(with_ratio=False), extent=ToBlockBoundary(capped_at_current=True),
                               default_top_k=50)


@functools.partial(register_traced_dataclass, traced=lambda cls: ("alpha", "beta", "lens", "truncations"))
@dataclasses.dataclass(frozen=True)
class MCMCConfig:
    """The chain's settings: a pytree whose leaves are alpha, beta, the lens's tau and the
    truncations' fractions (top-p, min-p, typical), data of the compiled program (one
    program for every value, `jax.vmap` over them; a beta of concrete 0 is static, the
    program without the depth term: `traced_fields`); every other field is static, part of
    the program. The methods build it from the `degs_mcmc` / `power_mcmc` hyperparameters
    (`MCMCMethod` below), where the paper's defaults live. The method checks its values when
    it is built; this, the kernel's own API (tests and benchmarks build it directly), runs the
    same checks (`check_chain_hyperparameters`) and asks for a lens when beta > 0.

    alpha: power (proposal temperature 1/alpha), >= 1.
    beta: weight of D(x); 0 = power sampling (no probing): `probed`.
    block_len, num_blocks: the block schedule (max new tokens = block_len · num_blocks).
    mh_steps: MH steps per block.
    lens: layers and tau for D(x) (required when beta > 0).
    eos_ids: token ids that end a completion.
    stop: compiled stop strings that end a completion like EOS (`stops.stop_automaton`), or None.
    truncations: optional cuts of the proposal (`generation.Truncation`: top-k, top-p,
      min-p, typical, or a user's own; log q is then the truncated density); () = none.
    kernel: the MH kernel variant (`ChainKernel`): `EXACT_KERNEL`, or `REFERENCE_KERNEL`
      to reproduce the public reference implementation side by side (not exact).
    """

    alpha: float
    beta: float
    block_len: int
    num_blocks: int
    mh_steps: int
    lens: Optional[LensConfig] = None
    eos_ids: tuple[int, ...] = ()
    truncations: tuple[Truncation, ...] = ()
    kernel: ChainKernel = EXACT_KERNEL
    stop: Optional[StopAutomaton] = None

    def __post_init__(self):
        check_chain_hyperparameters(self)
        require_lens(self.beta, self.lens)
        if not isinstance(self.kernel, ChainKernel):
            raise TypeError(f"MCMCConfig.kernel is a ChainKernel (EXACT_KERNEL, REFERENCE_KERNEL), got {self.kernel!r}")

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
        """The proposal q: temperature 1/alpha, the truncations (the kernel's default top-k
        first where no top-k is given: the reference's 50), the lens when beta > 0."""
        cuts = self.truncations
        if self.kernel.default_top_k and not any(isinstance(cut, TopK) for cut in cuts):
            cuts = (TopK(self.kernel.default_top_k),) + cuts
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
    draft_tokens: int = method_field(0, "verify up to this many tokens of the chain's own suffix per "
                                     "forward in each MH regeneration (exact speculative sampling; "
                                     "0: one token per forward)")
    draft_lookup: int = method_field(0, "where the chain's suffix guesses nothing (after the proposal "
                                     "leaves x, and in the block's extension), guess from the occurrence of "
                                     "the proposal's last N tokens in the prompt and the chain's text "
                                     "(prompt-lookup; needs draft_tokens; 0: off)")

    smallest_run: ClassVar[Mapping[str, Any]] = dict(block_len=SMALLEST_RUN_TOKENS // 2, num_blocks=2, mh_steps=2,
                                                     n_chains=2)

    def __post_init__(self):
        super().__post_init__()
        check_chain_hyperparameters(self)
        positive_int("n_chains", self.n_chains)
        validate_draft_fields(self.draft_tokens, self.draft_lookup)
        if self.draft_lookup and not self.draft_tokens:
            raise ValueError(f"draft_lookup={self.draft_lookup} guesses tokens for a drafted step: "
                             "set draft_tokens > 0 too")

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
                          kernel=self.chain_kernel(), stop=stop)

    def chain_kernel(self) -> ChainKernel:
        """The kernel variant: exact or the reference code's, drafted from the chain's suffix
        when draft_tokens > 0 (and from n-gram lookups when draft_lookup > 0)."""
        kernel = REFERENCE_KERNEL if self.reference_quirks else EXACT_KERNEL
        if not self.draft_tokens:
            return kernel
        draft = (LookupDraft(self.draft_tokens, self.draft_lookup) if self.draft_lookup
                 else SuffixDraft(self.draft_tokens))
        return dataclasses.replace(kernel, draft=draft)

    def worst_case_cost(self) -> Optional[tuple[int, int]]:
        steps = self.worst_case_advances()
        return self.n_chains * steps, steps

    def worst_case_advances(self, snapshot: Optional[Mapping[str, np.ndarray]] = None) -> int:
        """A chain's decode steps when nothing ends early (an `advance` is one decode step
        of every row's proposal, `chain_step`): the chain is the prompt's critical path.
        Block k (of l tokens) is extended by l steps and regenerated T times from a cut
        uniform over its k·l tokens (k·l/2 steps each, in expectation); a snapshot's chains
        have done `block` blocks (its least advanced chain is the critical path):
        sum over k = done+1 .. b of (l + T·k·l/2)."""
        b, l, t = self.num_blocks, self.block_len, self.mh_steps
        done = 0 if snapshot is None else int(np.min(snapshot["block"]))
        return int((b - done) * l + t * l * (b * (b + 1) - done * (done + 1)) / 4)

    def sequential_steps(self, n_tokens: int) -> float:
        """Blocks k = 1..ceil(n / l) of l tokens, each extended and then regenerated T times
        from a cut uniform over its k·l tokens: sum_k (l + T·k·l/2)."""
        blocks = max(1, -(-n_tokens // self.block_len))
        return sum(self.block_len + self.mh_steps * k * self.block_len / 2 for k in range(1, blocks + 1))

    # Kernel: the carry is `ChainRows` (every row at its own block and MH step), `advance`
    # one decode step of every row's running proposal (`chain_step`).

    def init(self, model, params, state: GenState, keys: Array, settings: MCMCConfig) -> "ChainRows":
        return start_chains(state, keys, settings)

    def advance(self, model, params, carry: "ChainRows", keys: Array, settings: MCMCConfig) -> "ChainRows":
        return chain_step(model, params, carry, keys, settings)

    def prompt_done(self, carry: "ChainRows", settings: MCMCConfig) -> Array:
        return jnp.all(chain_finished(carry, settings).reshape(-1, self.pool_size), axis=1)

    def answer(self, model, params, carry: "ChainRows", keys: Array, settings: MCMCConfig) -> Answer:
        return Answer(state=carry.chains(), accepted=carry.decisions.accepted_steps(),
                      depth_decided=carry.decisions.depth_decided_steps(), ran=carry.ran,
                      decisions=carry.decisions)

    # Checkpoints: a row's snapshot is renewed each time one of its blocks ends.

    def checkpoint_versions(self, carry: "ChainRows") -> Array:
        return carry.saved.block

    def checkpoint(self, carry: "ChainRows", rows: slice) -> dict[str, np.ndarray]:
        """Rows `rows`' snapshots (`ChainSnapshot`) with their decision records of the blocks
        they had completed, as named host arrays; [rows, S] fields cut after the longest."""
        arrays = _snapshot_arrays(carry, rows)
        end = int(arrays["length"].max())
        return {name: value[:, :end] if name in _TOKEN_AXIS_FIELDS else value for name, value in arrays.items()}

    def resume(self, model, params, carry: "ChainRows", keys: Array, settings: MCMCConfig,
               saved: Sequence[Optional[Mapping[str, np.ndarray]]]) -> "ChainRows":
        """The chains of the prompts with a snapshot (`saved[i]` for prompt i of the carry,
        from `checkpoint`) restored (`restore_chains`): each goes on with the block after the
        last one it completed, its cache rebuilt from its tokens."""
        n = self.pool_size
        arrays = _snapshot_arrays(carry, slice(None))
        S = arrays["tokens"].shape[1]
        mask = np.zeros(len(arrays["length"]), bool)
        prompt_lens = np.asarray(jax.device_get(carry.current.prompt_len))
        for prompt, snapshot in enumerate(saved):
            if snapshot is None:
                continue
            if "n_steps" not in snapshot and not self.draft_tokens:
                # Written before the decode-step counter: an undrafted chain runs one
                # position per decode step, so its steps are its forwards past the prefill.
                prompt_len = prompt_lens[prompt * n:(prompt + 1) * n]
                steps = snapshot["n_forward"] - prompt_len.astype(snapshot["n_forward"].dtype)
                snapshot = {**snapshot, "n_steps": steps}
            if set(snapshot) != set(arrays):
                raise ValueError(f"a stored chain snapshot has the fields {sorted(snapshot)}, this run's chains "
                                 f"{sorted(arrays)}: it was written by another version or configuration")
            rows = slice(prompt * n, (prompt + 1) * n)
            for name, value in snapshot.items():
                target = arrays[name][rows]
                width = value.shape[1] if name in _TOKEN_AXIS_FIELDS else None
                if value.shape[:1] != target.shape[:1] or (width is None and value.shape != target.shape) \
                        or (width is not None and width > S):
                    raise ValueError(f"a stored chain snapshot's {name} has shape {value.shape}; this run's chains "
                                     f"hold {target.shape}")
                if width is None:
                    target[...] = value
                else:
                    target[:, :width] = value
            mask[rows] = True
        if not mask.any():
            return carry
        return restore_chains(model, params, carry, keys, settings, arrays, jnp.asarray(mask))

    progress_unit: ClassVar[str] = "block"

    def progress_total(self, settings: MCMCConfig) -> int:
        return self.num_blocks

    def progress(self, carry: "ChainRows") -> Array:
        """Blocks completed by the row furthest behind (a row's block is the number it has
        completed; a finished chain's is num_blocks)."""
        return jnp.min(carry.block)

    def run_details(self, model, carry: "ChainRows", keys: Array, settings: MCMCConfig) -> RunDetails:
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
    study: ClassVar[StudyRow] = StudyRow(label="MCMC Power Sampling", position=4,
                                         comparisons=(Comparison("greedy", "power sampling vs greedy", 7),))

    beta: float = method_field(0.0, "must stay 0 (use degs_mcmc for beta > 0)")

    def __post_init__(self):
        super().__post_init__()
        if not is_zero(self.beta):
            raise ValueError("power_mcmc is the beta = 0 chain; use degs_mcmc for beta > 0")


@dataclasses.dataclass(frozen=True)
class DegsMCMC(MCMCMethod):
    """MH chain for p^alpha·exp(beta·D)."""

    method: ClassVar[str] = "degs_mcmc"
    study: ClassVar[StudyRow] = StudyRow(
        label="DEGS-MCMC", position=10, paper_claims=True,
        comparisons=(Comparison("power_mcmc", "depth term in MCMC (beta = 5 vs beta = 0)", 1),
                     Comparison("degs_rerank", "compounding over the chain vs one selection", 6),
                     Comparison("greedy", "DEGS-MCMC vs greedy", 8)),
        depth_baseline="power_mcmc", common_random_numbers=(
            "Common random numbers (MCMC): the two chains of a beta pair draw problem i with the "
            "same key, fold_in(key(seed), i), and within a chain the same counter-based streams "
            "for the extensions, cut indices, regenerations and accept uniforms (docs/design.md "
            "§4); they differ only by the beta·ΔD term of the acceptance ratio. Until that term "
            "flips an accept decision the two chains hold the same tokens (up to floating-point "
            "differences between the two compiled programs); after it, they sample different "
            "continuations. The paired difference therefore has a smaller variance than with "
            "independent keys, and a discordant problem is one the depth term changed (with the "
            "sampling that followed), not one where the keys differed."))


def _rows_first(mask: Array, ndim: int) -> Array:
    """[B] bool reshaped to broadcast against [B, ...] of `ndim` dimensions."""
    return mask.reshape(mask.shape + (1,) * (ndim - 1))


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
    2. The cut rule's term (`UniformCut.log_ratio`: log n_x - log n_x') is the ratio of the
       cut-index probabilities: m is uniform over the n_x completion positions of x for
       the forward move and over the n_x' positions of x' for the reverse one.
    3. Per-token values depend only on earlier tokens: log p(x_t | x_<t), log q and the
       collapse depth d_t (from the residuals at position t under causal attention) of
       the shared prefix x_<m are the same in x and x', so whole-suffix sums are the
       differences of the full sums, and D(x') from stored values is exactly D(x').
    `REFERENCE_KERNEL` breaks 1 and 2 on purpose (see `ChainKernel`).
    """
    kernel = mcmc.kernel
    x_end = kernel.extent.current_end(current, proposal)
    suffix = functools.partial(span_sum, batch_invariant=batch_invariant)
    log_r = (mcmc.alpha * (suffix(proposal.logp, cut, proposal.length) - suffix(current.logp, cut, x_end))
             + suffix(current.logq, cut, x_end) - suffix(proposal.logq, cut, proposal.length))
    if mcmc.probed:
        log_r += mcmc.beta * (_depth_score(proposal, num_layers) - _depth_score(current, num_layers))
    return log_r + kernel.cut.log_ratio(current.length - current.prompt_len, proposal.length - proposal.prompt_len)


def _depth_score(state: GenState, num_layers: int) -> Array:
    """The target statistic D(x) of every row, from the stored d_t."""
    return sequence_depth(state.depth, state.completion_mask(scored=True), num_layers)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class MHDecisions:
    """Every MH decision (module docstring, "Decision records"): one entry per row, block
    and MH step, [B, num_blocks, mh_steps] per field over a chain ([B, mh_steps] for one
    block: `mcmc_block`, `mh_steps`); a step a row did not run (it had ended before the
    block) holds zeros."""

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

    def record(self, block: Array, step: Array, decided: Array, **values: Array) -> "MHDecisions":
        """These [B, num_blocks, mh_steps] records with entry (block[b], step[b]) of each row
        b in `decided` set to `values` ([B] per field, every field given)."""
        rows = jnp.arange(block.shape[0])
        at = (rows, jnp.where(decided, block, self.accepted.shape[1]), step)  # (out of range: dropped)
        return MHDecisions(**{name: old.at[at].set(values[name].astype(old.dtype), mode="drop")
                              for name, old in vars(self).items()})

    def at_block(self, block: Array, ran: Array) -> "MHDecisions":
        """[B, mh_steps] records of block block[b] of each row b, zeros where not ran[b]."""
        rows = jnp.arange(block.shape[0])
        index = jnp.minimum(block, self.accepted.shape[1] - 1)
        return jax.tree.map(lambda every: jnp.where(_rows_first(ran, every.ndim - 1), every[rows, index], 0), self)

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


# ---------------------------------------------------------------- the per-row loop

# A row's `ChainRows.step` while its proposal extends the block to its boundary; the MH
# steps that follow are 0 .. mh_steps - 1 (EXTENDING + 1 is the first).
EXTENDING = -1


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ChainSnapshot:
    """Every row's chain as it was when its last block ended: what a killed run resumes
    from (`MCMCMethod.checkpoint` / `resume`). The token-level fields of the chain x and
    its work counters, no cache (a resumed chain rebuilds it: `generation.replay_cache`);
    its decision records are those of `ChainRows.decisions` for the blocks before `block`,
    which no later step changes. The keys need no state: every draw is keyed by the
    chain's key, block, step and position (module docstring)."""

    tokens: Array  # [B, S] int32
    logp: Array  # [B, S] fp32
    logq: Array  # [B, S] fp32
    depth: Array  # [B, S] int32
    final_entropy: Array  # [B, S] fp32
    stop_state: Optional[Array]  # [B, S] int32, or None without stop strings
    length: Array  # [B] int32
    ended: Array  # [B] bool
    n_generated: Array  # [B] int32 (the work counters, as `GenState`'s)
    n_forward: Array
    n_probed: Array
    n_steps: Array
    block: Array  # [B] int32: blocks the chain had completed (num_blocks: finished); 0: none yet

    # The fields taken from the chain's GenState (the rest: `block`).
    STATE_FIELDS: ClassVar[tuple[str, ...]] = ("tokens", "logp", "logq", "depth", "final_entropy", "stop_state",
                                               "length", "ended", "n_generated", "n_forward", "n_probed",
                                               "n_steps")

    @classmethod
    def of(cls, chains: GenState, block: Array) -> "ChainSnapshot":
        return cls(**{name: getattr(chains, name) for name in cls.STATE_FIELDS}, block=block)

    def renewed(self, chains: GenState, block: Array, where: Array) -> "ChainSnapshot":
        """This snapshot with the rows in `where` taken from `chains` at `block` blocks done."""
        return jax.tree.map(lambda new, old: jnp.where(_rows_first(where, old.ndim), new, old),
                            ChainSnapshot.of(chains, block), self)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ChainRows:
    """The MCMC kernel's carry: every row's chain x, its running proposal x', and where the
    row is in its own schedule. Rows are independent: each is at its own block and MH step,
    and one loop iteration (`chain_step`) is one decode step of every row's proposal.

    A row always has a proposal running until its chain is finished: the block's extension
    (from x's end to the boundary, always taken) or an MH step's regeneration (from the
    cut, accepted or rejected). The proposal lives in a second state whose row equals x
    except past the cut of the running proposal; when a proposal ends both rows are made
    equal again (`rows.settle_rows`: row copies of the cache)."""

    current: GenState  # the chain x
    proposal: GenState  # x': equal to x except past the cut of the running proposal
    block: Array  # [B] int32: the row's block; num_blocks once its chain is finished
    step: Array  # [B] int32: EXTENDING, or the MH step whose proposal runs
    cut: Array  # [B] int32: the slot the running proposal started from (prompt_len + m; x's length for the extension)
    limit: Array  # [B] int32: the length the running proposal may reach
    proposal_keys: Array  # [B] PRNG keys of the running proposal's tokens
    decisions: MHDecisions  # [B, num_blocks, mh_steps]: every MH decision
    ran: Array  # [B, num_blocks] bool: the row ran the block (it had not ended before it)
    saved: ChainSnapshot  # every row as its last completed block left it (a killed run resumes there)

    def chains(self) -> GenState:
        """The chains x with every row's work counters (the proposal state's: the decode
        steps of every proposal, accepted or not, and of the extensions)."""
        return dataclasses.replace(self.current, **work_counters(self.proposal))


def chain_finished(rows: ChainRows, mcmc: MCMCConfig) -> Array:
    """[B] bool: the row's chain is finished (it ended, or ran its last block)."""
    return rows.block >= mcmc.num_blocks


def block_boundary(state: GenState, block: Array, mcmc: MCMCConfig) -> Array:
    """[B] int32: the total length at which block `block` of each row ends."""
    return jnp.minimum(state.prompt_len + (block + 1) * mcmc.block_len, state.max_len)


def _begin_proposals(rows: ChainRows, starting: Array, cut: Array, limit: Array, keys: Array) -> ChainRows:
    """The rows in `starting` start a proposal from slot `cut` that may reach `limit`,
    drawing its tokens with `keys` (per position: `generation.decode_step`)."""
    proposal = dataclasses.replace(rows.proposal, length=jnp.where(starting, cut, rows.proposal.length),
                                   ended=rows.proposal.ended & ~starting)
    pick = lambda new, old: jnp.where(starting, new, old)
    return dataclasses.replace(rows, proposal=proposal, cut=pick(cut, rows.cut), limit=pick(limit, rows.limit),
                               proposal_keys=pick(keys, rows.proposal_keys))


def _mark_ran(rows: ChainRows, starting: Array, mcmc: MCMCConfig) -> ChainRows:
    """`ran` set for the block `rows.block` of the rows in `starting`."""
    at = (jnp.arange(rows.block.shape[0]), jnp.where(starting, rows.block, mcmc.num_blocks))  # (out of range: dropped)
    return dataclasses.replace(rows, ran=rows.ran.at[at].set(True, mode="drop"))


def begin_extension(rows: ChainRows, starting: Array, keys: Array, mcmc: MCMCConfig) -> ChainRows:
    """The rows in `starting` begin their block `rows.block`: the proposal extends x from its
    end to the block boundary with the block's EXTENSION_STREAM keys. keys: [B] chain keys."""
    rows = _mark_ran(dataclasses.replace(rows, step=jnp.where(starting, EXTENDING, rows.step)), starting, mcmc)
    return _begin_proposals(rows, starting, rows.current.length, block_boundary(rows.current, rows.block, mcmc),
                            fold_in_rows(keys, rows.block, EXTENSION_STREAM))


def _step_keys(keys: Array, rows: ChainRows) -> Array:
    """[B] keys of each row's MH step `rows.step` in its block `rows.block`."""
    return fold_in_rows(keys, rows.block, FIRST_MH_STREAM + rows.step)


def begin_mh_step(rows: ChainRows, starting: Array, keys: Array, mcmc: MCMCConfig) -> ChainRows:
    """The rows in `starting` begin MH step `rows.step` of block `rows.block`: draw the cut
    (the kernel's cut rule, CUT_STREAM), then regenerate from it (REGENERATE_STREAM) up to
    the kernel's extent. keys: [B] chain keys."""
    step_keys = _step_keys(keys, rows)
    current = rows.current
    cut = current.prompt_len + mcmc.kernel.cut.draw(fold_in_rows(step_keys, CUT_STREAM),
                                                    current.length - current.prompt_len)
    # cut < current.length <= the proposal's limit: every proposal draws >= 1 token.
    limit = mcmc.kernel.extent.limit(current, block_boundary(current, rows.block, mcmc))
    return _begin_proposals(rows, starting, cut, limit, fold_in_rows(step_keys, REGENERATE_STREAM))


def _decide(rows: ChainRows, proposal: GenState, decided: Array, keys: Array, mcmc: MCMCConfig,
            model: CausalLM) -> tuple[Array, MHDecisions]:
    """The MH decision of the rows in `decided` (their proposal has just ended): ([B] bool
    accept, the decision records with theirs written at (block, step))."""
    kernel = mcmc.kernel
    log_u = kernel.accept.log_u(fold_in_rows(_step_keys(keys, rows), ACCEPT_STREAM))
    ratio = lambda config: log_acceptance_ratio(rows.current, proposal, rows.cut, config, model.num_layers,
                                                model.batch_invariant)
    log_r = ratio(mcmc)
    accepts = kernel.accept.accepts(log_u, log_r)
    log_r_power, depth_delta = log_r, jnp.zeros_like(log_r)
    if mcmc.probed:  # the power-MCMC decision from the same u
        log_r_power = ratio(dataclasses.replace(mcmc, beta=0.0))
        depth_delta = _depth_score(proposal, model.num_layers) - _depth_score(rows.current, model.num_layers)
    current = rows.current
    decisions = rows.decisions.record(
        rows.block, rows.step, decided, accepted=decided & accepts,
        depth_decided=accepts != kernel.accept.accepts(log_u, log_r_power),
        log_ratio_power=log_r_power, depth_delta=depth_delta, log_u=log_u,
        null_move=null_move(current, proposal, rows.cut), cut=rows.cut - current.prompt_len,
        current_suffix=current.length - rows.cut, proposal_suffix=proposal.length - rows.cut)
    return decided & accepts, decisions


def chain_step(model: CausalLM, params: Any, rows: ChainRows, keys: Array, mcmc: MCMCConfig,
               until: Optional[Array] = None) -> ChainRows:
    """One decode step of every running row's proposal, then, for each row whose proposal
    ended (EOS, a stop string or its limit), the row's next phase at once:

    - an extension ended: it is the chain (always taken); MH step 0 begins;
    - an MH step's regeneration ended: accept or reject (the kernel's accept rule on log r
      from stored per-token values, `log_acceptance_ratio`), recorded in `decisions`; the
      next MH step begins, or after the last one the block ends: the chain is finished if
      it ended (EOS or a stop string) or ran its last block, otherwise the next block's
      extension begins.

    So no row waits for another: a row's draws depend only on its key, its block, its step
    and the position (module docstring), never on where the other rows are, and the chain
    is the one of running its blocks one after another alone. until: [B] int32 or a
    scalar: rows past this block pause (`mcmc_block`, `mh_steps`: one block); None: none.
    keys: [B] chain keys. Traceable (the MCMC methods' `advance`)."""
    running = ~chain_finished(rows, mcmc)
    if until is not None:
        running &= rows.block <= until
    with jax.named_scope("propose"):
        draft = mcmc.kernel.draft
        if draft is None:
            proposal, still = decode_step(model, params, rows.proposal, running, rows.limit, rows.proposal_keys,
                                          rows.cut, mcmc.proposal)
        else:
            guesses, proposed = draft.propose(rows.current, rows.proposal)
            proposal, still = drafted_decode_step(model, params, rows.proposal, running, rows.limit,
                                                  rows.proposal_keys, rows.cut, mcmc.proposal, guesses, proposed)
    ended = running & ~still
    extended = ended & (rows.step == EXTENDING)
    with jax.named_scope("accept_reject"):
        accept, decisions = _decide(rows, proposal, ended & ~extended, keys, mcmc, model)
        # Both states take the ended row (the proposal's if extended or accepted); the
        # proposal keeps the work counters (work on rejected proposals counts).
        current, proposal = settle_rows(rows.current, proposal, ended, extended | accept)
    step = jnp.where(ended, rows.step + 1, rows.step)
    block_over = ended & (step == mcmc.mh_steps)
    finished = block_over & (current.ended | (rows.block + 1 >= mcmc.num_blocks))
    block = jnp.where(block_over, jnp.where(finished, mcmc.num_blocks, rows.block + 1), rows.block)
    saved = rows.saved.renewed(dataclasses.replace(current, **work_counters(proposal)), block, block_over)
    rows = dataclasses.replace(rows, current=current, proposal=proposal, decisions=decisions, block=block,
                               step=step, saved=saved)
    rows = begin_mh_step(rows, ended & ~block_over, keys, mcmc)
    return begin_extension(rows, block_over & ~finished, keys, mcmc)


def _rows_at(state: GenState, keys: Array, mcmc: MCMCConfig, block: Array | int, active: Array) -> ChainRows:
    """The carry of chains at `state` whose `active` rows are at block `block` (a scalar or
    one per row), nothing begun yet; the other rows are finished and never move."""
    B = state.length.shape[0]
    block = jnp.broadcast_to(jnp.asarray(block, jnp.int32), (B,))
    return ChainRows(current=state, proposal=jax.tree.map(jnp.copy, state),
                     block=jnp.where(active, block, mcmc.num_blocks), step=jnp.full((B,), EXTENDING, jnp.int32),
                     cut=state.length, limit=state.length, proposal_keys=keys,
                     decisions=MHDecisions.zeros((B, mcmc.num_blocks, mcmc.mh_steps)),
                     ran=jnp.zeros((B, mcmc.num_blocks), bool),
                     # (copies: the carry is donated whole, and no buffer may be in it twice)
                     saved=jax.tree.map(jnp.copy, ChainSnapshot.of(state, jnp.where(active, block, mcmc.num_blocks))))


def start_chains(state: GenState, keys: Array, mcmc: MCMCConfig, block: Array | int = 0,
                 active: Optional[Array] = None) -> ChainRows:
    """The carry of chains at `state` (freshly prefilled rows, or chains after earlier
    blocks) that begin block `block` (a scalar or one per row) with its extension; rows
    not `active` (default: every row that has not ended) are finished and never move.
    keys: [B] chain keys."""
    active = ~state.ended if active is None else active
    return begin_extension(_rows_at(state, keys, mcmc, block, active), active, keys, mcmc)


def _run_rows(model: CausalLM, params: Any, rows: ChainRows, keys: Array, mcmc: MCMCConfig,
              until: Optional[Array] = None) -> ChainRows:
    """`chain_step` in one `lax.while_loop` until no row is running (none past `until`)."""
    def running(rows):
        on = ~chain_finished(rows, mcmc)
        return jnp.any(on if until is None else on & (rows.block <= until))

    return jax.lax.while_loop(running, lambda rows: chain_step(model, params, rows, keys, mcmc, until), rows)


@functools.partial(jax.jit, static_argnames=("model",))
def run_chains(model: CausalLM, params: Any, state: GenState, keys: Array, mcmc: MCMCConfig) -> ChainRows:
    """Every block of every chain in one jitted `lax.while_loop` of decode steps (each row
    at its own pace: `chain_step`), from freshly prefilled rows. Jit- and vmap-able (under
    vmap the loop runs until every instance is done; finished ones are left unchanged).
    `state` is not donated; the chains with their counters are `.chains()`."""
    return _run_rows(model, params, start_chains(state, keys, mcmc), keys, mcmc)


@functools.partial(jax.jit, static_argnames=("model",))
def mcmc_block(model: CausalLM, params: Any, state: GenState, keys: Array, block: Array,
               mcmc: MCMCConfig) -> tuple[GenState, MHDecisions, Array]:
    """Block `block` alone for every row (a scalar or one per row): extend with the proposal
    to EOS or the boundary (block + 1)·block_len, then `mcmc.mh_steps` MH steps, each row at
    its own pace (`chain_step`; rows past the block pause). A composable piece: chaining
    it over blocks gives `run_chains`' chains. Rows that have ended, or are at num_blocks,
    do not move. Returns (state with its work counters, decisions [B, mh_steps], active
    [B] bool: the rows that ran the block). `state` is not donated (`mcmc_block_donating`)."""
    block = jnp.broadcast_to(jnp.asarray(block, jnp.int32), state.length.shape)
    active = ~state.ended & (block < mcmc.num_blocks)
    rows = _run_rows(model, params, start_chains(state, keys, mcmc, block, active), keys, mcmc, until=block)
    return rows.chains(), rows.decisions.at_block(block, active), active


# `mcmc_block` with `state` donated, for host loops that replace their state every block
# (its cache is then updated in place rather than copied; the caller must not touch the
# state it passed, nor pass arrays that belong to it as other arguments).
mcmc_block_donating = jax.jit(mcmc_block.__wrapped__, static_argnames=("model",),
                              donate_argnames=("state",))


@functools.partial(jax.jit, static_argnames=("model",))
def mh_steps(model: CausalLM, params: Any, state: GenState, keys: Array, block: Array, active: Array,
             mcmc: MCMCConfig) -> tuple[GenState, MHDecisions]:
    """`mcmc.mh_steps` MH steps of block `block` on every active row, from chains already
    extended to the block (a warm start at given states: the exactness tests), each row at
    its own pace in one jitted `lax.while_loop` (`chain_step`). Proposals regenerate up to
    the block's boundary (`block_boundary`). Returns (state with its work counters,
    decisions [B, mh_steps]); inactive rows are left untouched. `state` is not donated."""
    block = jnp.broadcast_to(jnp.asarray(block, jnp.int32), state.length.shape)
    rows = _rows_at(state, keys, mcmc, block, active)
    rows = _mark_ran(dataclasses.replace(rows, step=jnp.zeros_like(rows.step)), active, mcmc)
    rows = _run_rows(model, params, begin_mh_step(rows, active, keys, mcmc), keys, mcmc, until=block)
    return rows.chains(), rows.decisions.at_block(block, active)


def _snapshot_arrays(rows: ChainRows, select: slice) -> dict[str, np.ndarray]:
    """The snapshots of rows `select` as named host arrays (writable copies): the
    `ChainSnapshot` fields, `ran` and `decisions.<field>` of the blocks completed."""
    saved, decisions, ran = jax.device_get(jax.tree.map(lambda a: a[select], (rows.saved, rows.decisions, rows.ran)))
    done = np.arange(ran.shape[1])[None] < saved.block[:, None]  # [rows, num_blocks]
    arrays = {name: np.array(value) for name, value in vars(saved).items() if value is not None}
    arrays["ran"] = ran & done
    for name, value in vars(decisions).items():
        arrays[f"decisions.{name}"] = np.where(done[..., None], value, np.zeros_like(value))
    return arrays


# `ChainSnapshot` fields whose last axis is the buffer's slots (a stored snapshot keeps the
# slots up to its longest chain; a resumed run's buffers may be longer).
_TOKEN_AXIS_FIELDS = frozenset({"tokens", "logp", "logq", "depth", "final_entropy", "stop_state"})


@functools.partial(jax.jit, static_argnames=("model",), donate_argnames=("rows",))
def restore_chains(model: CausalLM, params: Any, rows: ChainRows, keys: Array, mcmc: MCMCConfig,
                   saved: Mapping[str, Array], mask: Array) -> ChainRows:
    """`rows` (freshly started chains) with the rows in `mask` restored from `saved` (the
    named arrays of `MCMCMethod.checkpoint`, [B, ...] with the buffer's S slots): the
    chain's tokens, per-token statistics, stop states, length and work counters, its
    decision records and blocks done; its cache rebuilt from its tokens by decode steps
    (`generation.replay_cache`, not counted as work: the records are those of a run that
    was never stopped); then, unless finished, the next block's extension begins as it did
    when the snapshot was taken. `rows` is donated."""
    current = rows.current
    fields = {name: jnp.where(_rows_first(mask, saved[name].ndim), saved[name], getattr(current, name))
              for name in ChainSnapshot.STATE_FIELDS if getattr(current, name) is not None}
    current = dataclasses.replace(current, **fields)
    block = jnp.where(mask, saved["block"], rows.block)
    finished = block >= mcmc.num_blocks
    lens_layers = mcmc.proposal.lens.lsub if mcmc.probed else ()
    # From the last prompt token: the first decode step of the chain consumed it (and wrote
    # its slot again), as every later step consumed the token it had drawn.
    current = replay_cache(model, params, current, jnp.where(mask & ~finished, current.prompt_len - 1,
                                                             current.length), lens_layers)
    decisions = MHDecisions(**{name: jnp.where(_rows_first(mask, old.ndim), saved[f"decisions.{name}"], old)
                               for name, old in vars(rows.decisions).items()})
    rows = dataclasses.replace(rows, current=current, proposal=select_rows(mask, current, rows.proposal),
                               block=block, decisions=decisions,
                               ran=jnp.where(_rows_first(mask, 2), saved["ran"], rows.ran),
                               saved=rows.saved.renewed(current, block, mask))
    return begin_extension(rows, mask & ~finished, keys, mcmc)
