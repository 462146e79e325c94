"""Sampling and reranking methods (docs/design.md §4): whole completions sampled from
the model by the generation kernel (`degs_jax.generation`'s `decode_step`), and for the
pool methods one answer chosen among n of them per prompt.

    greedy             Greedy          argmax decoding
    temperature        Temperature     ancestral sampling at `temperature`
    best_of_n          BestOfN         n samples; the largest log p(x)
    best_of_n_entropy  BestOfNEntropy  the same pool; the lowest mean final-layer entropy
    degs_rerank        DegsRerank      the same pool; argmax alpha·log p(x) + beta·D(x)

Cost when nothing ends early: a pool of n decodes its candidates side by side, n ·
max_new_tokens tokens in max_new_tokens sequential steps (one sample: n = 1).

Kernel: the carry is the generation loop's (`GenerationLoop`) and `advance` is one decode
step of every active row, so `decode_tokens`' loop is `generate`'s, step for step.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, ClassVar, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np

from .drafts import DEFAULT_LOOKUP_NGRAM, LookupDraft, validate_draft_fields
from .generation import GenerationLoop, Proposal, SamplerSpec, initial_active, loop_step
from .method import (DEFAULT_ALPHA, Answer, Comparison, DEFAULT_BETA, DEFAULT_MAX_NEW_TOKENS, DEFAULT_POOL_SIZE,
                     SMALLEST_RUN_TOKENS, Method, PoolRows, StudyRow, method_field, positive_int,
                     validate_temperature)
from .stops import StopAutomaton
from .traced_fields import FLOAT32_MAX, concrete_values_satisfy

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class SamplingMethod(Method):
    """Methods that sample whole completions (no MCMC)."""

    smallest_run: ClassVar[Mapping[str, Any]] = dict(max_new_tokens=SMALLEST_RUN_TOKENS)

    max_new_tokens: int = method_field(DEFAULT_MAX_NEW_TOKENS, "token budget of the sampling methods")
    probe: bool = method_field(True, "record collapse depths d_t while sampling (K/L of a forward "
                               "per token)", cli=False)
    draft_tokens: int = method_field(0, "verify up to this many prompt-lookup guesses per forward "
                                     "(exact: the tokens' law is unchanged; greedy keeps a guess that is "
                                     "the argmax; 0: one token per forward)", recorded_at_default=False)
    draft_lookup: int = method_field(DEFAULT_LOOKUP_NGRAM, "n-gram length of the prompt lookup: the "
                                     "last N tokens are looked up in the prompt and the completion, and "
                                     "what followed them is the guess (with draft_tokens > 0)",
                                     recorded_at_default=False)

    def __post_init__(self):
        super().__post_init__()
        positive_int("max_new_tokens", self.max_new_tokens)
        validate_draft_fields(self.draft_tokens, self.draft_lookup)
        if self.draft_tokens and not self.draft_lookup:
            raise ValueError("draft_tokens > 0 guesses by prompt lookup: draft_lookup must be >= 1")

    def draft(self) -> Optional[LookupDraft]:
        """The generation loop's draft: prompt lookups of draft_lookup tokens, draft_tokens
        guesses per forward; None when draft_tokens is 0."""
        return LookupDraft(self.draft_tokens, self.draft_lookup) if self.draft_tokens else None

    @property
    def probed(self) -> bool:
        return self.probe

    @abc.abstractmethod
    def temperature_of(self) -> float:
        """The sampling temperature (0 = greedy)."""

    def kernel_config(self, num_layers: int, eos_ids: tuple[int, ...],
                      stop: Optional[StopAutomaton] = None) -> SamplerSpec:
        """The generation kernel's settings for a model with `num_layers` blocks."""
        return SamplerSpec(Proposal(self.temperature_of(), self.truncations()), eos_ids=tuple(eos_ids),
                           lens=self.lens_config(num_layers) if self.probe else None, stop=stop)

    def worst_case_cost(self) -> Optional[tuple[int, int]]:
        return int(self.pool_size * self.max_new_tokens), int(self.max_new_tokens)

    def init(self, model, params, state, keys: Array, settings: SamplerSpec) -> GenerationLoop:
        return GenerationLoop(state=state, active=initial_active(state, state.prompt_len + self.max_new_tokens),
                              steps=jnp.zeros(state.length.shape, jnp.int32))

    def advance(self, model, params, carry: GenerationLoop, keys: Array, settings: SamplerSpec) -> GenerationLoop:
        return loop_step(model, params, carry, carry.state.prompt_len + self.max_new_tokens, keys,
                         carry.state.prompt_len, settings, self.draft())

    def prompt_done(self, carry: GenerationLoop, settings: SamplerSpec) -> Array:
        return ~jnp.any(carry.active.reshape(-1, self.pool_size), axis=1)

    def answer(self, model, params, carry: GenerationLoop, keys: Array, settings: SamplerSpec) -> Answer:
        return Answer(state=carry.state)

    def progress_total(self, settings: SamplerSpec) -> int:
        return self.max_new_tokens + 1  # a step per token, and the last token's consumption

    def progress(self, carry: GenerationLoop) -> Array:
        return jnp.max(carry.steps)


# The pool rules on stored candidates (`StudyRow.select`): `degs reproduce` selects the
# reranking rows from the Best-of-N run's kept candidates with them, as `choose` does on
# the device (first candidate on ties; tests/test_reproduce.py checks that they agree).


def lowest_final_entropy(candidates, weights) -> int:
    """BestOfNEntropy's rule: the lowest mean final-layer entropy."""
    return int(np.argmin([c["final_entropy"] for c in candidates]))


def largest_weighted_score(candidates, weights) -> int:
    """DegsRerank's rule: the largest alpha·log p(x) + beta·D(x), with the recorded weights."""
    if any(c.get("D") is None for c in candidates):
        raise ValueError("it needs D(x) of every candidate; the Best-of-N pool was not probed")
    return int(np.argmax([weights["alpha"] * c["log_p"] + weights["beta"] * c["D"] for c in candidates]))


@dataclasses.dataclass(frozen=True)
class Greedy(SamplingMethod):
    """Argmax decoding."""

    method: ClassVar[str] = "greedy"
    study: ClassVar[StudyRow] = StudyRow(label="Base (greedy)", position=1, compute_unit=True)

    def temperature_of(self) -> float:
        return 0.0


@dataclasses.dataclass(frozen=True)
class Temperature(SamplingMethod):
    """Ancestral sampling at a temperature."""

    method: ClassVar[str] = "temperature"
    # the paper decodes HumanEval at T = 0.5 (its alpha = 1/T = 2)
    study: ClassVar[StudyRow] = StudyRow(label="Low-temperature", position=2,
                                         benchmark_settings=(("humaneval", "temperature", 0.5),))

    temperature: float = method_field(0.25, "sampling temperature (0 = greedy)", traced=True)

    smallest_run: ClassVar[Mapping[str, Any]] = dict(max_new_tokens=SMALLEST_RUN_TOKENS, temperature=1.0)

    def __post_init__(self):
        super().__post_init__()
        validate_temperature(self.temperature)

    def temperature_of(self) -> float:
        return self.temperature


@dataclasses.dataclass(frozen=True)
class BestOfN(SamplingMethod):
    """N samples from p; the one with the largest log p(x)."""

    method: ClassVar[str] = "best_of_n"
    study: ClassVar[StudyRow] = StudyRow(label="Best-of-N", position=3)

    n: int = method_field(DEFAULT_POOL_SIZE, "candidates sampled per prompt (the Best-of-N pool)")
    temperature: float = method_field(1.0, "sampling temperature of the pool", traced=True)

    smallest_run: ClassVar[Mapping[str, Any]] = dict(max_new_tokens=SMALLEST_RUN_TOKENS, n=3)

    def __post_init__(self):
        super().__post_init__()
        positive_int("n", self.n)
        validate_temperature(self.temperature)

    @property
    def pool_size(self) -> int:
        return self.n

    def temperature_of(self) -> float:
        return self.temperature

    def pool_score(self, rows: PoolRows) -> Array:
        """[rows] the score the answer maximises (first on ties), from what `rows` holds
        of each candidate (traced)."""
        return rows.log_p

    def choose(self, rows: PoolRows) -> Array:
        score = self.pool_score(rows).reshape(-1, self.pool_size)
        return jnp.argmax(score, axis=1).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class BestOfNEntropy(BestOfN):
    """The Best-of-N pool; the candidate with the lowest mean final-layer entropy."""

    method: ClassVar[str] = "best_of_n_entropy"
    study: ClassVar[StudyRow] = StudyRow(
        label="Best-of-N-Entropy", position=7, selected_from="best_of_n", select=lowest_final_entropy,
        comparisons=(Comparison("best_of_n", "final-layer entropy vs likelihood reranking", 4),))

    def choose(self, rows: PoolRows) -> Array:
        return jnp.argmin(rows.final_entropy.reshape(-1, self.pool_size), axis=1).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class DegsRerank(BestOfN):
    """The Best-of-N pool; argmax alpha·log p(x) + beta·D(x) (alpha = 0: depth only)."""

    method: ClassVar[str] = "degs_rerank"
    study: ClassVar[StudyRow] = StudyRow(
        label="DEGS reranking", position=8, selected_from="best_of_n", select=largest_weighted_score,
        weights=("alpha", "beta"),
        comparisons=(Comparison("best_of_n", "depth term in reranking", 3),
                     Comparison("depth_only", "likelihood term in reranking", 5)))
    study_variants: ClassVar[Mapping[str, StudyRow]] = {"depth_only": StudyRow(
        label="Depth-only (alpha = 0)", position=9, selected_from="best_of_n", select=largest_weighted_score,
        weights=("alpha", "beta"), fixed=(("alpha", 0.0),))}

    alpha: float = method_field(DEFAULT_ALPHA, "likelihood weight of the rerank score "
                                "alpha·log p(x) + beta·D(x)", traced=True)
    beta: float = method_field(DEFAULT_BETA, "collapse-depth weight of the rerank score", traced=True)

    def __post_init__(self):
        super().__post_init__()
        if not all(concrete_values_satisfy(weight, lambda w: (w >= 0) & (w <= FLOAT32_MAX))
                   for weight in (self.alpha, self.beta)):
            raise ValueError(f"degs_rerank needs alpha and beta >= 0 and at most {FLOAT32_MAX:.7g} "
                             f"(float32), got alpha={self.alpha}, beta={self.beta}")
        if not self.probe:
            raise ValueError("degs_rerank needs probe=True (it ranks by D(x))")

    def pool_score(self, rows: PoolRows) -> Array:
        return self.alpha * rows.log_p + self.beta * rows.depth
