"""A decoding method is a value: one frozen dataclass per method that holds the method's
typed hyperparameters (documented per field; `degs ... --help` is generated from them)
and everything method-specific that the drivers, the batch sizer and the study ask of
it. It is a pytree whose leaves are its numeric hyperparameters (`method_field(
traced=True)`: alpha, beta, tau, the temperatures, top-p / min-p / typical-p), data of
the compiled programs it runs, so that a sweep over them compiles once and `jax.vmap`
over them works; every other field is static, part of the program
(`degs_jax.traced_fields`). This module holds what every method shares: the base class
`Method`, the field helper, the defaults shared by several methods and the checks of the
hyperparameters several families take (each lives here once).
The methods themselves live beside their kernels, one file per family:

    sampling and reranking   degs_jax.sampling   Greedy, Temperature, BestOfN,
                                                 BestOfNEntropy, DegsRerank
    MCMC                     degs_jax.mcmc       PowerMCMC, DegsMCMC
    SMC                      degs_jax.smc        PowerSMC, DegsSMC
    SPS                      degs_jax.sps        ScalablePower

A class with a method name of its own (`method = "name"`) registers itself when it is
defined (`Method.__init_subclass__`; `registered_methods()` lists them): adding a method
is one class, in this package or in a user's own (`degs_jax.methods` finds the
methods of installed packages through their entry points; docs/extending.md). The class
is checked then, so that a mistake fails where it is written rather than in a run: every
hook the kernel needs (those marked `abc.abstractmethod` below, a family's own such as
`SamplingMethod.temperature_of`, and the budget `max_new_tokens`, a field or a property)
must be defined, and `checkpoint` and `resume` where `checkpoint_versions` is; a missing
one is one TypeError naming each. A family (no name) may leave hooks to its methods. A
name that an installed package's entry point declares belongs to that package: another
class under it is the same TypeError whether the package was loaded before or after
(the entry points' names are read without importing anything).

What a method answers (the drivers never switch on a method's class or name):

- `plan(model, eos_ids, token_bytes)`: its kernel's settings against a model of
  `model.num_layers` blocks (L_sub defaulted and checked against the depth once, here,
  even where unused; stop strings compiled against the vocabulary's bytes);
- `pool_size`: rows per prompt (candidates, chains or particles; prompt i's row j is
  row i·n + j); `max_new_tokens`: its token budget; `probed`: whether it records d_t;
- `sequences_per_prompt`: KV-cache sequences one prompt holds at once (the batch
  sizer's memory estimate, `degs_jax.batching`);
- `worst_case_cost()`: (generated tokens per prompt, sequential decode steps) when
  nothing ends early, or None where no formula is known (the study's time budget);
- `choose(rows)`: each prompt's answer among its rows, from what `PoolRows` holds of
  each (log p(x), D(x), mean final-layer entropy, the completion's token ids and length,
  whether it ended);
- its kernel, over the method's own named state (a registered dataclass pytree, the
  carry of the drivers' loop): `init(model, params, state, keys, settings)` from the
  prefilled rows (`pool_size` consecutive rows per prompt) and their row keys,
  `advance(...)` one unit of work (a decode step of every row: the sampling methods and
  MCMC, whose rows are each at their own block and MH step; an SMC ESS interval, an SPS
  block), `prompt_done(carry, settings)` ([prompts] bool; `done` is all of it) and `answer(...)`: the final rows and what the method chose (`Answer`).
  `settings` is what `plan` returned (a pytree: its numbers are data of the program).
  Every leaf of the carry has a row axis (or, marked
  `rows.per_prompt`, a prompt axis), so the host driver can read one prompt's slot out
  and overwrite it with a freshly `init`-ed prompt (`rows.take_slots` / `put_slots`).
  `decoders.decode_tokens` runs `advance` in a `lax.while_loop` until `done`;
- for the host driver (`decoders.decode`, which calls `advance` in jitted chunks):
  `progress(carry)` (traced: units done), `progress_total(settings)` and `progress_unit`
  (the progress bar), and `run_details(...)` (on the host, from the final carry: per-row
  `Candidate` fields, per-prompt diagnostics and extra counters; `RunDetails`);
- for `degs reproduce` (class attributes, each class's own): `study`, its row of the
  study (`StudyRow`: the paper's label, its Table 1 place, the method whose kept
  candidates it is selected from and by which rule, its comparisons and beta pair, what
  the report says of it), and `study_variants`, rows that are the method with
  hyperparameters fixed (depth-only: DEGS reranking at alpha = 0). The study branches on
  no method name (docs/extending.md).
"""

from __future__ import annotations

import abc
import dataclasses
import importlib.metadata
import re
from typing import Any, Callable, ClassVar, Mapping, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .generation import NO_MIN_P, NO_TOP_K, NO_TOP_P, NO_TYPICAL_P, Truncation, truncations
from .lens import DEFAULT_TAU, LensConfig, validate_lsub, validate_tau
from .stops import StopAutomaton, TokenBytes, stop_automaton, validate_stop
from .traced_fields import FLOAT32_MAX, concrete_values_satisfy, is_zero, register_traced_dataclass

Array = jax.Array

# Shared by several methods (each lives here once).
DEFAULT_MAX_NEW_TOKENS = 3072
DEFAULT_ALPHA = 4.0
DEFAULT_BETA = 5.0
DEFAULT_POOL_SIZE = 16
# The budget of every library method's `Method.smallest_run`: one buffer size for all of
# them, so that the tests' prefills (prompt + budget slots) compile once.
SMALLEST_RUN_TOKENS = 6


def method_field(default: Any, help: str, *, cli: bool = True, recorded_at_default: bool = True,
                 traced: bool = False, static_at: tuple[float, ...] = ()) -> Any:
    """A dataclass field with its documentation (shown by `degs ... --help`); cli=False
    keeps it out of the command line (Python API only); recorded_at_default=False leaves
    it out of `Method.to_dict` (the run record) while it holds its default, so that a field
    added later does not change the record of a run that does not use it (runs recorded
    before it existed resume and read back unchanged); traced=True makes it data of the
    compiled program rather than part of it (`degs_jax.traced_fields`: one program for
    every value, `jax.vmap` over it; a concrete 0, and the values in `static_at` (its "off"
    value), stay static)."""
    return dataclasses.field(default=default, metadata={"help": help, "cli": cli, "traced": traced,
                                                        "static_at": static_at,
                                                        "recorded_at_default": recorded_at_default})


# Checks of the hyperparameters, one function per quantity (each message is written once).
# A method calls them when it is built, so `DegsMCMC(alpha=0.5)` fails there and not at
# plan time; the kernels' settings (`MCMCConfig`, `SMCConfig`, `SPSConfig`), which tests
# and benchmarks also build directly, call the same functions through their family's
# check (`check_chain_hyperparameters`, `check_smc_hyperparameters`,
# `check_sps_hyperparameters`), which reads the method and its settings alike.


def positive_int(name: str, value: Any) -> None:
    """ValueError unless `value` is an int >= 1 (bool excluded)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def validate_alpha(alpha: Any) -> None:
    """ValueError unless 1 <= alpha <= FLOAT32_MAX (NaN and inf fail): the power of the
    target p(x)^alpha (the MCMC and SMC proposals sample at temperature 1/alpha <= 1); a
    larger value is inf as the program's float32. Every value of an array (a sweep) is
    checked; a traced value is not (`traced_fields.concrete_values_satisfy`)."""
    if not concrete_values_satisfy(alpha, lambda a: (a >= 1.0) & (a <= FLOAT32_MAX)):
        raise ValueError(f"alpha must be >= 1 (the target is p(x)^alpha) and at most "
                         f"{FLOAT32_MAX:.7g} (float32), got {alpha}")


def validate_beta(beta: Any) -> None:
    """ValueError unless 0 <= beta <= FLOAT32_MAX (NaN and inf fail): the weight of D(x);
    0 is no probing. Checked as alpha is (`validate_alpha`)."""
    if not concrete_values_satisfy(beta, lambda b: (b >= 0.0) & (b <= FLOAT32_MAX)):
        raise ValueError(f"beta must be >= 0 and at most {FLOAT32_MAX:.7g} (float32), got {beta}")


def validate_temperature(temperature: Any) -> None:
    """ValueError unless 0 <= temperature <= FLOAT32_MAX (NaN and inf fail; 0 is greedy):
    a sampling method's temperature, checked when the method is built (as alpha is,
    `validate_alpha`), before a run writes anything."""
    if not concrete_values_satisfy(temperature, lambda t: (t >= 0.0) & (t <= FLOAT32_MAX)):
        raise ValueError(f"temperature must be >= 0 and at most {FLOAT32_MAX:.7g} (float32), "
                         f"got {temperature}")


def require_lens(beta: Any, lens: Optional[LensConfig]) -> None:
    """ValueError when beta is not a concrete 0 (so the target has the depth term; a traced
    beta may be any value) and no LensConfig says which layers and tau give D(x)."""
    if not is_zero(beta) and lens is None:
        raise ValueError("beta > 0 needs a LensConfig (layers and tau) to compute D(x)")


# Every class with a method name of its own, by that name, in the order they were defined.
_REGISTERED: dict[str, type["Method"]] = {}
# A method's name is a command-line value and a directory name (`degs reproduce`'s runs).
_METHOD_NAME = re.compile(r"[a-z][a-z0-9_]*")
ENTRY_POINT_GROUP = "degs_jax.methods"  # where an installed package names its method classes
# The token budget: a hook every method answers, as a field or a property (a dataclass
# field cannot be an abstract property: the property would shadow the field's value).
BUDGET_HOOK = "max_new_tokens"


def _missing_hooks(cls: type["Method"]) -> list[str]:
    """The hooks `cls` leaves undefined (module docstring), in alphabetical order: those
    that resolve to an `abc.abstractmethod`, the budget, and `checkpoint` / `resume` when
    `checkpoint_versions` is overridden. Read from the class before the dataclass
    decorator runs (a field is then an annotation, with or without a default)."""
    def resolved(name: str) -> Any:
        return next((vars(k)[name] for k in cls.__mro__ if name in vars(k)), None)

    names = {name for k in cls.__mro__ for name in vars(k)}
    missing = {name for name in names if getattr(resolved(name), "__isabstractmethod__", False)}
    if not any(BUDGET_HOOK in vars(k) or BUDGET_HOOK in vars(k).get("__annotations__", {}) for k in cls.__mro__):
        missing.add(f"{BUDGET_HOOK} (a field or a property)")
    if resolved("checkpoint_versions") is not vars(Method)["checkpoint_versions"]:
        missing |= {name for name in ("checkpoint", "resume") if resolved(name) is vars(Method)[name]}
    return sorted(missing)


def _installed_owner(cls: type["Method"], name: str) -> Optional[str]:
    """The installed package whose entry point declares the method `name`, as "the
    installed package 'package' (module:Class)", where `cls` is not that package's: its
    module is outside the entry point's top-level package (a package may name a class it
    re-exports, `package:Rule` of `package.rules.Rule`). None where no entry point does."""
    for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP, name=name):
        if entry.module.partition(".")[0] != cls.__module__.partition(".")[0]:
            package = entry.dist.name if entry.dist is not None else "?"
            return f"the installed package {package!r} ({entry.value})"
    return None


def _register(cls: type["Method"]) -> None:
    """Register `cls` under its own `method` name, after checking it (module docstring).
    TypeError for a name that is not lower case letters, digits and underscores, one that
    an installed package declares for another class, one another class has, a subclass of
    a registered method that keeps its parent's name (a run of it would record, and resume,
    the parent), or a method that leaves a hook undefined."""
    where = f"{cls.__module__}.{cls.__qualname__}"
    name = cls.__dict__.get("method")
    if name is None:
        if cls.method:
            raise TypeError(f"{where} subclasses the method {cls.method!r}: give it a name of its "
                            f"own (method: ClassVar[str] = \"...\")")
        return
    if not name:  # a family of methods (no name): nothing to register
        return
    if not isinstance(name, str) or not _METHOD_NAME.fullmatch(name):
        raise TypeError(f"{where}: the method name {name!r} must be lower-case letters, digits and "
                        "underscores, starting with a letter")
    taken = _REGISTERED.get(name)
    if taken is not None and (taken.__module__, taken.__qualname__) == (cls.__module__, cls.__qualname__):
        taken = None  # the same class defined again (e.g. its module reloaded): the new one
    # (the library's own names are its own: no package can take them)
    owner = _installed_owner(cls, name) if not cls.__module__.startswith("degs_jax.") else None
    if owner is None and taken is not None:
        owner = f"{taken.__module__}.{taken.__qualname__}"
    if owner is not None:
        raise TypeError(f"{where}: the method name {name!r} is taken by {owner}; choose another")
    missing = _missing_hooks(cls)
    if missing:
        raise TypeError(f"{where} (the method {name!r}) does not define {', '.join(missing)}: every method "
                        "defines the hooks its family leaves open (degs_jax/method.py says what each answers)")
    _REGISTERED[name] = cls


def registered_methods() -> dict[str, type["Method"]]:
    """Every method class defined so far, by name, in the order they were defined
    (`degs_jax.methods.method_classes` adds the installed packages' and orders them)."""
    return dict(_REGISTERED)


class Comparison(NamedTuple):
    """A paired comparison of `degs reproduce`'s report, with the row that states it
    (`StudyRow.comparisons`) as the treatment."""

    baseline: str  # the row it is compared with (a method's name or a study row's)
    question: str  # what the difference answers (the report's text)
    rank: float = float("inf")  # its place in the paired table (the library's: 1-8); ties: as stated


# A pool selection's rule on stored candidates: (the kept candidates' records, each with
# `log_p`, `D` and `final_entropy`; the row's recorded weights) -> the chosen index.
StoredSelection = Callable[[Sequence[Mapping[str, Any]], Mapping[str, float]], int]


@dataclasses.dataclass(frozen=True)
class StudyRow:
    """What `degs reproduce` reads of one row of its study (docs/extending.md): a method's
    own (`Method.study`) or a variant of the method with hyperparameters fixed
    (`Method.study_variants`). Every field has a default: a method that states nothing is a
    row of its own run, labelled by its name, after the paper's rows, in no comparison."""

    # its name in the report's tables (the library's rows: the paper's); "": the row's name
    label: str = ""
    # its place among Table 1's rows (the order of every table of the report); None: after
    # them, by name. The library's rows that have one are the default study (the paper's).
    position: Optional[float] = None
    # the method whose kept candidates the row is selected from, by `select` on the stored
    # candidates with the weights the study records (its hyperparameters named in
    # `weights`): no run of its own; "": a run of its own
    selected_from: str = ""
    select: Optional[StoredSelection] = None
    weights: tuple[str, ...] = ()
    # a variant's hyperparameters that it fixes, (name, value) pairs (depth-only: alpha = 0);
    # `--hp ROW.NAME` of one of them is refused
    fixed: tuple[tuple[str, Any], ...] = ()
    # the paper's settings of this row on one benchmark, (benchmark, name, value) triples,
    # beside the study's own rule (HumanEval: alpha 2 for every method that has one)
    benchmark_settings: tuple[tuple[str, str, Any], ...] = ()
    # the paired comparisons with this row as the treatment
    comparisons: tuple[Comparison, ...] = ()
    # the method that is this one at beta = 0 drawing with the same keys (its beta pair: the
    # report's sign test over benchmarks, common random numbers and probe overhead), and
    # what the common random numbers of that pair imply (the report's text); "": none
    depth_baseline: str = ""
    common_random_numbers: str = ""
    # the paper's checkable claims (beta = 5 over beta = 0 in every cell, MH acceptance
    # 57-78%, the probe overhead) are about this row and its depth baseline
    paper_claims: bool = False
    # the compute table's "× greedy" column is each row's forward-equivalents over this row's
    compute_unit: bool = False

    def __post_init__(self):
        if self.selected_from and self.select is None:
            raise TypeError(f"a study row selected from {self.selected_from!r} needs its rule "
                            "on the stored candidates (select=...)")


@dataclasses.dataclass(frozen=True)
class Method(abc.ABC):
    """Settings every method takes. Frozen and hashable. A pytree
    (`traced_fields.register_traced_dataclass`): the fields made with
    `method_field(traced=True)` (alpha, beta, ...) are its leaves, data of the compiled
    program; every other field is static, part of it (as a static argument's value).

    A subclass that sets `method` to a name registers itself under it when it is defined,
    once it defines every hook (module docstring; the hooks marked `abc.abstractmethod`
    and the budget `max_new_tokens`); a family of methods, which leaves the name empty, may
    leave hooks open (it cannot be built then, as any abstract class)."""

    method: ClassVar[str] = ""  # the method's name in `decode`, the CLI and run.json
    # The hyperparameters of the smallest run that still goes through every code path of
    # the method: a budget of SMALLEST_RUN_TOKENS new tokens, a few rows per prompt. The
    # library's tests run each registered method at these (tests/test_drivers.py, the batch
    # invariance and refill tests; the golden writer records a new method at them), so a
    # new method needs no entry in a test's table. A subclass inherits its parent's.
    smallest_run: ClassVar[Mapping[str, Any]] = {}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        _register(cls)
        register_traced_dataclass(cls)  # a pytree: its traced fields are data of the program

    tau: float = method_field(DEFAULT_TAU, "collapse threshold in nats: d_t is the first probed "
                              "layer whose logit-lens entropy is <= tau", traced=True)
    lsub: Optional[tuple[int, ...]] = method_field(
        None, "probed layers L_sub, comma-separated (default: the grid of docs/design.md §3 for the "
        "model's depth)")
    top_k: int = method_field(NO_TOP_K, "truncate the sampling / proposal distribution to its top_k "
                              "most likely tokens (0 = off; log q is the truncated density)")
    top_p: float = method_field(NO_TOP_P, "nucleus truncation of the sampling / proposal "
                                "distribution (1.0 = off)", traced=True, static_at=(NO_TOP_P,))
    min_p: float = method_field(NO_MIN_P, "min-p truncation of the sampling / proposal distribution: "
                                "keep the tokens at least min_p times as likely as the most likely "
                                "one (0 = off)", recorded_at_default=False, traced=True)
    typical_p: float = method_field(NO_TYPICAL_P, "locally typical truncation of the sampling / "
                                    "proposal distribution: keep the tokens whose surprisal is closest "
                                    "to the entropy, up to this mass (1.0 = off)",
                                    recorded_at_default=False, traced=True, static_at=(NO_TYPICAL_P,))
    cache_dtype: Optional[Any] = method_field(None, "KV cache dtype (None: the parameters' dtype)",
                                              cli=False)
    stop: Optional[tuple[str, ...]] = method_field(
        None, "stop strings: a completion ends at the first one, as at EOS, for the target, the "
        "proposal and the weights alike (degs_jax.stops); None: none, except HumanEval in the "
        "completion format under degs eval / reproduce, which uses the Codex stop sequences",
        recorded_at_default=False)

    def __post_init__(self):
        validate_tau(self.tau)
        if self.lsub is not None:
            object.__setattr__(self, "lsub", validate_lsub(self.lsub))
        object.__setattr__(self, "stop", validate_stop(self.stop))
        self.truncations()  # (a bad top_k, top_p, min_p or typical_p fails here)

    def lens_config(self, num_layers: int) -> LensConfig:
        """The LensConfig of a model with `num_layers` blocks (L_sub defaulted, checked)."""
        return LensConfig.default(num_layers, tau=self.tau, lsub=self.lsub)

    def truncations(self) -> tuple[Truncation, ...]:
        """The cuts of the sampling / proposal distribution that top_k, top_p, min_p and
        typical_p name (`generation.truncations`: HF's order, the "off" values left out)."""
        return truncations(self.top_k, self.top_p, self.min_p, self.typical_p)

    def to_dict(self) -> dict[str, Any]:
        """Every field by name (the record of `DecodeResult` and `degs eval`'s run.json), but
        those added after runs were recorded (`method_field(recorded_at_default=False)`: stop
        strings, min-p, typical) while at their default: such a run records what runs
        recorded before those existed, so those resume and read back unchanged."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.metadata.get("recorded_at_default", True) or getattr(self, f.name) != f.default}

    # What each family defines (and `max_new_tokens`, a field or a property: the budget).

    @property
    @abc.abstractmethod
    def probed(self) -> bool:
        """Whether decoding records collapse depths d_t (and so D(x))."""

    @property
    def pool_size(self) -> int:
        """Rows per prompt: candidates, chains or particles."""
        return 1

    @property
    def sequences_per_prompt(self) -> int:
        """KV-cache sequences one prompt holds at once (the batch size's memory estimate)."""
        return self.pool_size

    @abc.abstractmethod
    def kernel_config(self, num_layers: int, eos_ids: tuple[int, ...],
                      stop: Optional[StopAutomaton] = None) -> Any:
        """The kernel's settings for a model with `num_layers` blocks; `stop`: the compiled
        stop strings (`stops.stop_automaton`) or None. A pytree (the drivers pass it to
        their jitted loops as an argument): a frozen dataclass registered with
        `traced_fields.register_traced_dataclass`, whose traced fields are data of the
        program and the rest static (`mcmc.MCMCConfig`)."""

    def plan(self, model: Any, eos_ids: Sequence[int], token_bytes: Optional[TokenBytes] = None) -> Any:
        """The kernel's settings against `model` (a `CausalLM`): L_sub is defaulted and
        checked against its depth here, also for methods that do not probe; the stop
        strings are compiled against the vocabulary's `token_bytes` (`stops.token_bytes`
        of the tokenizer; needed only when the method has stop strings)."""
        self.lens_config(model.num_layers)
        stop = None
        if self.stop:
            if token_bytes is None:
                raise ValueError("stop strings need the vocabulary's bytes: pass token_bytes "
                                 "(degs_jax.stops.token_bytes(tokenizer))")
            stop = stop_automaton(self.stop, token_bytes, model.vocab_size)
        settings = self.kernel_config(model.num_layers, tuple(int(e) for e in eos_ids), stop)
        for leaf in jax.tree_util.tree_leaves(settings):
            if not isinstance(leaf, (jax.Array, np.ndarray, np.generic, int, float)):
                raise TypeError(f"{type(self).__name__}.kernel_config returned a {type(leaf).__name__} that is "
                                "not a pytree of numbers, so the drivers' jitted loops cannot take it: register "
                                "its class with degs_jax.traced_fields.register_traced_dataclass")
        return settings

    def worst_case_cost(self) -> Optional[tuple[int, int]]:
        """(generated tokens per prompt, sequential decode steps per batch) when nothing
        ends early (no EOS): the cost ceiling; None where no formula is known."""
        return None

    def worst_case_advances(self, snapshot: Optional[Mapping[str, np.ndarray]] = None) -> Optional[int]:
        """`advance` calls one prompt needs when nothing ends early: the length of its
        critical path in the units `decode_stream` times (`Output.advance_seconds`), so that
        `degs reproduce --plan` can price a refilled job's slowest prompt alone; from
        `snapshot` (a stored checkpoint of the prompt, the named arrays of `checkpoint`):
        the advances it still needs. None where no formula is known (the default: the plan
        then prices the work only)."""
        return None

    def sequential_steps(self, n_tokens: int) -> float:
        """Sequential decode steps of a prompt whose answer has `n_tokens` completion tokens:
        the time its rows hold a slot, up to a constant (`degs reproduce --plan`'s estimate of
        the refill's schedule from stored records). Default: a step per token and the last
        token's consumption (the rows of a prompt decode side by side; the answer's length
        stands for its pool's)."""
        return n_tokens + 1

    def choose(self, rows: "PoolRows") -> Array:
        """[prompts] int32: each prompt's answer among its n = pool_size rows (rows
        i·n .. i·n + n - 1), first on ties, from what `rows` holds of each (traced: under
        `decode_tokens` it runs inside the program); 0 for methods without a pool choice."""
        return jnp.zeros(rows.log_p.shape[0] // self.pool_size, jnp.int32)

    # The kernel (module docstring): pure functions of arrays, traceable (jit, vmap).

    @abc.abstractmethod
    def init(self, model: Any, params: Any, state: Any, keys: Array, settings: Any) -> Any:
        """The loop's carry from freshly prefilled rows `state` (a GenState) and row keys."""

    @abc.abstractmethod
    def advance(self, model: Any, params: Any, carry: Any, keys: Array, settings: Any) -> Any:
        """One unit of the method's work on every row that has some left."""

    @abc.abstractmethod
    def prompt_done(self, carry: Any, settings: Any) -> Array:
        """[prompts] bool: nothing is left to do for the prompt (its `pool_size` rows).
        Every counter of a row's phase (MCMC block and MH step, SMC step, SPS block) is per row, so the
        prompts of one carry may be at different phases (the host driver's refill)."""

    def done(self, carry: Any, settings: Any) -> Array:
        """bool scalar: nothing is left to do for any prompt."""
        return jnp.all(self.prompt_done(carry, settings))

    @abc.abstractmethod
    def answer(self, model: Any, params: Any, carry: Any, keys: Array, settings: Any) -> "Answer":
        """The final rows and what the method decided (`Answer`). Called outside `jit` by
        `decode`, where it may donate the carry to its own jitted work (SPS's token form)."""

    # Checkpoints (`decoders.decode_stream`'s `on_checkpoint` / `resume`; `degs eval` stores
    # them in its run directory): a method whose rows reach points it can resume from says
    # so here; by default a killed run's unfinished prompts start again.

    def checkpoint_versions(self, carry: Any) -> Optional[Array]:
        """[rows] int32 (traced): how far each row's resumable snapshot is (it grows each
        time the snapshot is renewed; 0: nothing to resume from yet), or None: the method's
        prompts cannot resume mid-way."""
        return None

    def checkpoint(self, carry: Any, rows: slice) -> dict[str, np.ndarray]:
        """On the host: the snapshot of rows `rows` (one prompt's) as named arrays, what
        `resume` takes back (a run directory stores it)."""
        raise NotImplementedError(f"{type(self).__name__} has checkpoint_versions but no checkpoint")

    def resume(self, model: Any, params: Any, carry: Any, keys: Array, settings: Any,
               saved: Sequence[Optional[Mapping[str, np.ndarray]]]) -> Any:
        """On the host: a freshly `init`-ed carry of some prompts with prompt i restored from
        `saved[i]` (a `checkpoint`, or None: it starts afresh), so its run goes on from
        there: with a batch-invariant model, as if it had never stopped."""
        raise NotImplementedError(f"{type(self).__name__} has checkpoint_versions but no resume")

    # What the host driver shows and reports (`decoders.decode`).

    progress_unit: ClassVar[str] = "step"  # what `progress` counts (the progress bar's unit)

    @abc.abstractmethod
    def progress_total(self, settings: Any) -> int:
        """Units of `progress` in a run where nothing ends early (the progress bar's total)."""

    @abc.abstractmethod
    def progress(self, carry: Any) -> Array:
        """int32 scalar: units of work done, never decreasing, `progress_total` at the end of
        a run where nothing ends early (traced; the host reads it once per call)."""

    def run_details(self, model: Any, carry: Any, keys: Array, settings: Any) -> "RunDetails":
        """On the host, from the final carry (before `answer`, which may consume it): what
        `decode` reports beyond the rows and their scores. None by default."""
        return RunDetails()

    # What `degs reproduce` reads of the method (its row of the study): a class's own, not
    # inherited (a subclass is another row); read through `study_row` / `study_variants_of`.
    study: ClassVar[StudyRow] = StudyRow()
    study_variants: ClassVar[Mapping[str, StudyRow]] = {}  # row name -> a variant (its `fixed`)


def study_row(cls: type[Method]) -> StudyRow:
    """The study row `cls` states itself (`Method.study`), or the default row: not inherited."""
    return cls.__dict__.get("study", StudyRow())


def study_variants_of(cls: type[Method]) -> Mapping[str, StudyRow]:
    """The variant rows `cls` states itself (`Method.study_variants`): not inherited."""
    return cls.__dict__.get("study_variants", {})


register_traced_dataclass(Method)


# `PoolRows.tokens` past a completion's end (no token id is negative).
NO_TOKEN = -1


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PoolRows:
    """What a pool rule sees of every row (`Method.choose`; `sampling.BestOfN.pool_score`):
    its scores and its tokens, [rows] each but `tokens`; prompt i's rows are i·n .. i·n + n - 1
    (n = pool_size). `decoders.pool_rows` builds it from the final rows, for both drivers
    (under `decode_tokens`, inside the program: a rule must be traceable). A rule on
    lengths, e.g. a length-penalised rerank, reads `length`; one on the text reads `tokens`
    (`tokens != NO_TOKEN` is the completion's mask)."""

    log_p: Array  # [rows] fp32 log p(x) (a final end token included)
    depth: Array  # [rows] fp32 D(x), the mean d_t / L of the scored tokens (0 where not probed)
    final_entropy: Array  # [rows] fp32 mean final-layer entropy of the scored tokens
    # [rows, max_new_tokens] int32: the completion's token ids from its first, NO_TOKEN past
    # its end (as `decoders.Candidate.tokens`, padded)
    tokens: Array
    length: Array  # [rows] int32 completion tokens (a final end token or stop-completing token included)
    ended: Array  # [rows] bool: ended at an end token or a stop string (False: the budget)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Answer:
    """What a method's kernel returns at the end: the final rows, and the method's own
    choice of each prompt's answer where it is drawn rather than a rule on the rows'
    scores (SMC; None: `Method.choose`), and per-block MCMC statistics (None otherwise)."""

    state: Any  # GenState of every row
    chosen: Optional[Array] = None  # [prompts] int32
    accepted: Optional[Array] = None  # [rows, num_blocks] int32 accepted MH steps
    depth_decided: Optional[Array] = None  # [rows, num_blocks] int32 decisions beta·ΔD decided
    ran: Optional[Array] = None  # [rows, num_blocks] bool: the row ran the block
    decisions: Any = None  # MCMC: `mcmc.MHDecisions` [rows, num_blocks, mh_steps]; None otherwise


@dataclasses.dataclass
class RunDetails:
    """What a method reports of a finished run, on the host (`Method.run_details`)."""

    # per row: `decoders.Candidate` fields (MCMC acceptance, depth decisions and decision
    # records, SMC weight) and the method's own statistics under names of its own (JSON
    # values: they become the candidate's `extras`, stored in the records); None: none
    candidate_fields: Optional[list[dict[str, Any]]] = None
    diagnostics: Optional[list[dict[str, Any]]] = None  # per prompt (`decoders.Output.diagnostics`)
    counters: dict[str, int] = dataclasses.field(default_factory=dict)  # added to the work totals
