"""The decoding methods' hyperparameters: one typed, frozen dataclass per method,
documented per field. This module is the one home of every default: `decode`, the
CLI (its --help is generated from these fields), `degs eval`'s run configuration and
the analyses all read them here (docs/design.md §4 for the values).

    greedy             Greedy
    temperature        Temperature
    best_of_n          BestOfN
    best_of_n_entropy  BestOfNEntropy
    degs_rerank        DegsRerank
    power_mcmc         PowerMCMC
    degs_mcmc          DegsMCMC
    power_smc          PowerSMC
    degs_smc           DegsSMC
    scalable_power     ScalablePower

`hyperparameters_for(method, **overrides)` builds one from a method name (unknown names
are an error); `to_dict()` is the flat record `degs eval` stores in run.json.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, ClassVar, Optional

from .generation import NO_TOP_K, NO_TOP_P, SamplerSpec
from .lens import DEFAULT_TAU, LensConfig, validate_lsub, validate_tau
from .mcmc import MCMCConfig
from .smc import SMCConfig
from .sps import SPSConfig

# Shared by several methods (each lives here once).
DEFAULT_MAX_NEW_TOKENS = 3072
DEFAULT_ALPHA = 4.0
DEFAULT_BETA = 5.0
DEFAULT_POOL_SIZE = 16


def _field(default: Any, help: str, *, cli: bool = True) -> Any:
    """A dataclass field with its documentation (shown by `degs ... --help`); cli=False
    keeps it out of the command line (Python API only)."""
    return dataclasses.field(default=default, metadata={"help": help, "cli": cli})


def _positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclasses.dataclass(frozen=True)
class Hyperparameters:
    """Settings every method takes. Frozen and hashable: usable as a static argument."""

    method: ClassVar[str] = ""  # the method's name in `decode`, the CLI and run.json

    tau: float = _field(DEFAULT_TAU, "collapse threshold in nats: d_t is the first probed layer "
                        "whose logit-lens entropy is <= tau")
    lsub: Optional[tuple[int, ...]] = _field(
        None, "probed layers L_sub, comma-separated (default: the grid of docs/design.md §3 for the "
        "model's depth)")
    top_k: int = _field(NO_TOP_K, "truncate the sampling / proposal distribution to its top_k "
                        "most likely tokens (0 = off; log q is the truncated density)")
    top_p: float = _field(NO_TOP_P, "nucleus truncation of the sampling / proposal distribution "
                          "(1.0 = off)")
    lens_chunk: Optional[int] = _field(
        None, "vocabulary chunk of TransformerLM's streamed lens (None: its automatic choice)",
        cli=False)
    cache_dtype: Optional[Any] = _field(None, "KV cache dtype (None: the parameters' dtype)",
                                        cli=False)

    def __post_init__(self):
        validate_tau(self.tau)
        if self.lsub is not None:
            object.__setattr__(self, "lsub", validate_lsub(self.lsub))

    def lens_config(self, num_layers: int) -> LensConfig:
        """The LensConfig of a model with `num_layers` blocks (L_sub defaulted, checked)."""
        return LensConfig.default(num_layers, tau=self.tau, lsub=self.lsub)

    def to_dict(self) -> dict[str, Any]:
        """Every field by name (the record of `DecodeResult` and `degs eval`'s run.json)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


@dataclasses.dataclass(frozen=True)
class SamplingHyperparameters(Hyperparameters):
    """Methods that sample whole completions (no MCMC)."""

    max_new_tokens: int = _field(DEFAULT_MAX_NEW_TOKENS, "token budget of the sampling methods")
    probe: bool = _field(True, "record collapse depths d_t while sampling (K/L of a forward "
                         "per token)", cli=False)

    def __post_init__(self):
        super().__post_init__()
        _positive_int("max_new_tokens", self.max_new_tokens)

    @property
    def probed(self) -> bool:
        """Whether decoding records collapse depths d_t (and so D(x))."""
        return self.probe

    @property
    def pool_size(self) -> int:
        """Candidates drawn per prompt."""
        return 1

    def temperature_of(self) -> float:
        """The sampling temperature (0 = greedy)."""
        raise NotImplementedError

    def sampler_spec(self, num_layers: int, eos_ids: tuple[int, ...]) -> SamplerSpec:
        """The generation kernel's settings for a model with `num_layers` blocks."""
        return SamplerSpec(temperature=self.temperature_of(), top_k=self.top_k, top_p=self.top_p,
                           eos_ids=tuple(eos_ids),
                           lens=self.lens_config(num_layers) if self.probe else None)


@dataclasses.dataclass(frozen=True)
class Greedy(SamplingHyperparameters):
    """Argmax decoding."""

    method: ClassVar[str] = "greedy"

    def temperature_of(self) -> float:
        return 0.0


@dataclasses.dataclass(frozen=True)
class Temperature(SamplingHyperparameters):
    """Ancestral sampling at a temperature."""

    method: ClassVar[str] = "temperature"

    temperature: float = _field(0.25, "sampling temperature (0 = greedy)")

    def temperature_of(self) -> float:
        return float(self.temperature)


@dataclasses.dataclass(frozen=True)
class BestOfN(SamplingHyperparameters):
    """N samples from p; the one with the largest log p(x)."""

    method: ClassVar[str] = "best_of_n"

    n: int = _field(DEFAULT_POOL_SIZE, "candidates sampled per prompt (the Best-of-N pool)")
    temperature: float = _field(1.0, "sampling temperature of the pool")

    def __post_init__(self):
        super().__post_init__()
        _positive_int("n", self.n)

    @property
    def pool_size(self) -> int:
        return self.n

    def temperature_of(self) -> float:
        return float(self.temperature)


@dataclasses.dataclass(frozen=True)
class BestOfNEntropy(BestOfN):
    """The Best-of-N pool; the candidate with the lowest mean final-layer entropy."""

    method: ClassVar[str] = "best_of_n_entropy"


@dataclasses.dataclass(frozen=True)
class DegsRerank(BestOfN):
    """The Best-of-N pool; argmax alpha·log p(x) + beta·D(x) (alpha = 0: depth only)."""

    method: ClassVar[str] = "degs_rerank"

    alpha: float = _field(DEFAULT_ALPHA, "likelihood weight of the rerank score "
                          "alpha·log p(x) + beta·D(x)")
    beta: float = _field(DEFAULT_BETA, "collapse-depth weight of the rerank score")

    def __post_init__(self):
        super().__post_init__()
        if not (self.alpha >= 0 and self.beta >= 0):
            raise ValueError("degs_rerank needs alpha >= 0 and beta >= 0")
        if not self.probe:
            raise ValueError("degs_rerank needs probe=True (it ranks by D(x))")


@dataclasses.dataclass(frozen=True)
class MCMCHyperparameters(Hyperparameters):
    """The Metropolis-Hastings chain (docs/design.md §4)."""

    alpha: float = _field(DEFAULT_ALPHA, "power of the target p(x)^alpha; the proposal samples "
                          "at temperature 1/alpha (>= 1)")
    beta: float = _field(DEFAULT_BETA, "weight of D(x) in the target p(x)^alpha·exp(beta·D(x))")
    block_len: int = _field(192, "tokens per MCMC block")
    num_blocks: int = _field(16, "MCMC blocks (max new tokens = block_len · num_blocks)")
    mh_steps: int = _field(10, "Metropolis-Hastings steps per block")
    n_chains: int = _field(1, "independent chains per prompt")
    reference_quirks: bool = _field(False, "reproduce the public power-sampling code's "
                                    "deviations (top-k 50, no cut-index ratio, ...; not exact)")

    def __post_init__(self):
        super().__post_init__()
        _positive_int("n_chains", self.n_chains)

    @property
    def probed(self) -> bool:
        return self.beta > 0

    @property
    def pool_size(self) -> int:
        return self.n_chains

    @property
    def max_new_tokens(self) -> int:
        return self.block_len * self.num_blocks

    def mcmc_config(self, num_layers: int, eos_ids: tuple[int, ...]) -> MCMCConfig:
        """The chain kernel's settings for a model with `num_layers` blocks."""
        return MCMCConfig(alpha=float(self.alpha), beta=float(self.beta), block_len=self.block_len,
                          num_blocks=self.num_blocks, mh_steps=self.mh_steps,
                          lens=self.lens_config(num_layers) if self.beta > 0 else None,
                          eos_ids=tuple(eos_ids), top_k=self.top_k, top_p=self.top_p,
                          reference_quirks=bool(self.reference_quirks))


@dataclasses.dataclass(frozen=True)
class PowerMCMC(MCMCHyperparameters):
    """MH chain for p^alpha (beta = 0: no probing)."""

    method: ClassVar[str] = "power_mcmc"

    beta: float = _field(0.0, "must stay 0 (use degs_mcmc for beta > 0)")

    def __post_init__(self):
        super().__post_init__()
        if self.beta != 0:
            raise ValueError("power_mcmc is the beta = 0 chain; use degs_mcmc for beta > 0")


@dataclasses.dataclass(frozen=True)
class DegsMCMC(MCMCHyperparameters):
    """MH chain for p^alpha·exp(beta·D)."""

    method: ClassVar[str] = "degs_mcmc"


@dataclasses.dataclass(frozen=True)
class SMCHyperparameters(Hyperparameters):
    """Power-SMC / DEGS-SMC particles (degs_jax.smc; the source of each default is given
    in `SMCConfig`'s docstring)."""

    alpha: float = _field(DEFAULT_ALPHA, "power of the target p(x)^alpha; the proposal samples "
                          "at temperature 1/alpha (>= 1)")
    beta: float = _field(DEFAULT_BETA, "weight of D(x) in the target p(x)^alpha·exp(beta·D(x))")
    n_particles: int = _field(16, "SMC particles per prompt, N (the answer is one drawn by weight)")
    max_new_tokens: int = _field(DEFAULT_MAX_NEW_TOKENS, "token budget of the sampling methods")
    ramp_tokens: int = _field(400, "SMC exponent ramp: the intermediate targets' exponents rise "
                              "linearly to (alpha, beta) over this many tokens (0 = no ramp)")
    ess_threshold: float = _field(0.5, "SMC resamples a prompt's particles when ESS < "
                                  "ess_threshold · N")
    resample_every: int = _field(64, "SMC checks the ESS every this many tokens")

    def __post_init__(self):
        super().__post_init__()
        if not self.beta >= 0.0:
            raise ValueError(f"beta must be >= 0, got {self.beta}")
        self._kernel(beta=0.0, lens=None, eos_ids=())  # the kernel's checks of the other fields

    @property
    def probed(self) -> bool:
        return self.beta > 0

    @property
    def pool_size(self) -> int:
        return self.n_particles

    def _kernel(self, beta: float, lens: Optional[LensConfig], eos_ids: tuple[int, ...]) -> SMCConfig:
        return SMCConfig(alpha=float(self.alpha), beta=float(beta), n_particles=self.n_particles,
                         max_new_tokens=self.max_new_tokens, ramp_tokens=self.ramp_tokens,
                         ess_threshold=float(self.ess_threshold), resample_every=self.resample_every,
                         lens=lens, eos_ids=tuple(eos_ids), top_k=self.top_k, top_p=self.top_p)

    def smc_config(self, num_layers: int, eos_ids: tuple[int, ...]) -> SMCConfig:
        """The particle kernel's settings for a model with `num_layers` blocks."""
        return self._kernel(self.beta, self.lens_config(num_layers) if self.beta > 0 else None, eos_ids)


@dataclasses.dataclass(frozen=True)
class PowerSMC(SMCHyperparameters):
    """Power-SMC: particles for p^alpha (beta = 0: no probing)."""

    method: ClassVar[str] = "power_smc"

    beta: float = _field(0.0, "must stay 0 (use degs_smc for beta > 0)")

    def __post_init__(self):
        super().__post_init__()
        if self.beta != 0:
            raise ValueError("power_smc is the beta = 0 sampler; use degs_smc for beta > 0")


@dataclasses.dataclass(frozen=True)
class DegsSMC(SMCHyperparameters):
    """DEGS-SMC: particles for p^alpha·exp(beta·D)."""

    method: ClassVar[str] = "degs_smc"


@dataclasses.dataclass(frozen=True)
class ScalablePower(Hyperparameters):
    """Scalable Power Sampling, block form (degs_jax.sps; the source of each default is
    given in `SPSConfig`'s docstring). No truncation, no probing."""

    method: ClassVar[str] = "scalable_power"

    alpha: float = _field(DEFAULT_ALPHA, "power of the target p(x)^alpha (>= 1)")
    max_new_tokens: int = _field(DEFAULT_MAX_NEW_TOKENS, "token budget of the sampling methods")
    block_len: int = _field(192, "tokens per block, B (1 = the token form)")
    candidate_pool: int = _field(32, "candidate blocks sampled per block, L")
    candidates_kept: int = _field(8, "most likely candidates kept, K")
    rollouts: int = _field(8, "rollouts per kept candidate, M")
    rollout_horizon: int = _field(192, "rollout length cap, H")
    jackknife: bool = _field(True, "jackknife-corrected block probabilities "
                             "(--no-jackknife: the plain ratio estimate)")
    candidate_temperature: float = _field(
        1.0, "temperature of the candidate blocks: 1 draws them from p (docs/design.md §4); "
        "the public SPS ports use 1/alpha (0.25 at alpha 4)")

    def __post_init__(self):
        super().__post_init__()
        if (self.top_k, self.top_p) != (NO_TOP_K, NO_TOP_P):
            raise ValueError("scalable_power does not truncate; its candidates are drawn at "
                             "candidate_temperature")
        self.sps_config(())  # the kernel's checks

    @property
    def probed(self) -> bool:
        return False

    @property
    def pool_size(self) -> int:
        return 1

    @property
    def sequences_per_prompt(self) -> int:
        """KV-cache rows one prompt may hold at once inside a block (the batch size's
        memory estimate): the prompt's row, its L candidates, the K kept and their K·M
        rollouts (one compiled block; counted together, an upper bound)."""
        return 1 + self.candidate_pool + self.candidates_kept * (1 + self.rollouts)

    def sps_config(self, eos_ids: tuple[int, ...]) -> SPSConfig:
        """The block sampler's settings."""
        return SPSConfig(alpha=float(self.alpha), max_new_tokens=self.max_new_tokens,
                         block_len=self.block_len, candidate_pool=self.candidate_pool,
                         candidates_kept=self.candidates_kept, rollouts=self.rollouts,
                         rollout_horizon=self.rollout_horizon, jackknife=bool(self.jackknife),
                         candidate_temperature=float(self.candidate_temperature), eos_ids=tuple(eos_ids))


METHOD_HYPERPARAMETERS: dict[str, type[Hyperparameters]] = {
    cls.method: cls for cls in (Greedy, Temperature, BestOfN, BestOfNEntropy, DegsRerank,
                                PowerMCMC, DegsMCMC, PowerSMC, DegsSMC, ScalablePower)}
METHODS = tuple(METHOD_HYPERPARAMETERS)
RERANK_METHODS = ("best_of_n", "best_of_n_entropy", "degs_rerank")
MCMC_METHODS = ("power_mcmc", "degs_mcmc")
SMC_METHODS = ("power_smc", "degs_smc")


def field_names(method: str) -> tuple[str, ...]:
    """The hyperparameters `method` takes."""
    return tuple(f.name for f in dataclasses.fields(METHOD_HYPERPARAMETERS[method]))


def hyperparameters_for(method: str, **overrides: Any) -> Hyperparameters:
    """The method's hyperparameters with its defaults updated by `overrides`.

    ValueError for an unknown method, a name the method does not take, or a bad value.
    """
    if method not in METHOD_HYPERPARAMETERS:
        raise ValueError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    names = field_names(method)
    unknown = sorted(set(overrides) - set(names))
    if unknown:
        raise ValueError(f"{method} does not take {', '.join(unknown)}; "
                         f"it takes {', '.join(sorted(names))}")
    return METHOD_HYPERPARAMETERS[method](**overrides)


def resolve_hyperparameters(method: str, overrides: dict[str, Any]) -> dict[str, Any]:
    """`hyperparameters_for(method, **overrides).to_dict()`: every hyperparameter by name."""
    return hyperparameters_for(method, **overrides).to_dict()


def field_types(cls: type[Hyperparameters]) -> dict[str, Any]:
    """The resolved type annotation of every field of `cls` (for the CLI's parsers)."""
    return typing.get_type_hints(cls)
