"""Drafts: guesses of a running sequence's next tokens, verified in one forward of the
target (`generation.drafted_decode_step`, speculative sampling with a point-mass draft).

Any guess keeps the law of what is drawn: a guessed token d is kept with probability
q(d | prefix), and the first one not kept is replaced by a draw from q with d removed, so
every token is drawn from q given its prefix whatever the draft (under a greedy q, a
guess is kept when it is the argmax). A draft decides only how many tokens a forward
draws. The drafts here guess from text that exists already, so they cost no model:

    SuffixDraft   an MH regeneration from the cut guesses that it rewrites the chain x
    LookupDraft   the same, and where it has nothing, the proposal's last n tokens looked
                  up in x's text and in its own (prompt-lookup decoding); for plain
                  sampling (no chain), the lookup in the sequence's own prompt and text

A draft (the `generation.Draft` protocol) is static (its `tokens` set the forward's
width, K + 1 positions per row); the MH kernel holds one (`mcmc.ChainKernel.draft`), and
so does a sampling method's generation loop (`generation.loop_step`), which has no chain
and passes None for it.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp

from .generation import GenState
from .method import positive_int

Array = jax.Array

# The n-gram length of the sampling methods' prompt lookups (`LookupDraft`), the one of
# prompt-lookup decoding's common settings.
DEFAULT_LOOKUP_NGRAM = 3


def validate_draft_fields(draft_tokens, draft_lookup) -> None:
    """ValueError unless the methods' draft_tokens and draft_lookup are ints >= 0."""
    for name, value in (("draft_tokens", draft_tokens), ("draft_lookup", draft_lookup)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")


@dataclasses.dataclass(frozen=True)
class SuffixDraft:
    """The chain's own suffix as the draft: a regeneration from the cut guesses that it
    rewrites x, so slot t is guessed as x_t, up to `tokens` at a time and up to x's end,
    while the proposal still equals x past the cut; after its first difference the
    proposal is drawn without a draft (position-aligned guesses would be wrong). The
    block's extension runs past x's end: no guess. At the paper's temperature 1/α = 0.25
    a third of all regenerations rewrite x exactly (docs/benchmarks.md, issue 55)."""

    tokens: int

    def __post_init__(self):
        positive_int("draft tokens", self.tokens)

    def propose(self, current: GenState, proposal: GenState) -> tuple[Array, Array]:
        n = proposal.length
        pos = jnp.arange(current.max_len)[None]
        # The proposal's slots from the cut up equal x's wherever x's and the proposal's
        # tokens agree below n: rows equal below the cut by construction, so any difference
        # below n is past the cut.
        diverged = jnp.any((current.tokens != proposal.tokens) & (pos < n[:, None]), axis=1)
        slots = jnp.clip(n[:, None] + jnp.arange(self.tokens)[None], 0, current.max_len - 1)
        guesses = jnp.take_along_axis(current.tokens, slots, axis=1)
        return guesses, jnp.where(diverged, 0, jnp.clip(current.length - n, 0, self.tokens)).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class LookupDraft:
    """The chain's suffix as the draft (`SuffixDraft`) while the proposal still equals x;
    where that guesses nothing (after the proposal's first difference from x, and in the
    block's extension, past x's end) the proposal's last `ngram` tokens are looked up in
    x's text (prompt, prefix and suffix) and then in the proposal's own earlier text, and
    the tokens that followed the occurrence nearest the proposal's end are the guess
    (prompt-lookup decoding, Saxena 2023; vLLM's n-gram proposer). So a regeneration that
    inserted or dropped a few tokens re-aligns with x where x's text resumes, and an
    extension that repeats an expression of the prompt or the prefix guesses its rest.
    In plain sampling (no chain: `current` is None) it is prompt-lookup decoding of the
    sequence's own prompt and completion, one lookup per step.
    Any guess keeps the proposal's law (`generation.drafted_decode_step`); a lookup costs
    [B, S, ngram] comparisons per step, nothing next to a forward."""

    tokens: int
    ngram: int

    def __post_init__(self):
        positive_int("draft tokens", self.tokens)
        positive_int("lookup n-gram", self.ngram)

    def propose(self, current: Optional[GenState], proposal: GenState) -> tuple[Array, Array]:
        B = proposal.length.shape[0]
        if current is None:
            guesses, proposed, texts = jnp.zeros((B, self.tokens), jnp.int32), jnp.zeros((B,), jnp.int32), (proposal,)
        else:  # x's suffix; then x's text; then the proposal's own, below its end
            (guesses, proposed), texts = SuffixDraft(self.tokens).propose(current, proposal), (current, proposal)
        n = proposal.length
        for text in texts:
            found, found_len = lookup_ngram(text.tokens, text.length, proposal.tokens, n, self.ngram, self.tokens)
            take = (proposed == 0) & (found_len > 0)
            guesses = jnp.where(take[:, None], found, guesses)
            proposed = jnp.where(take, found_len, proposed)
        return guesses, proposed


def lookup_ngram(text: Array, text_len: Array, query: Array, n: Array, ngram: int,
                 tokens: int) -> tuple[Array, Array]:
    """The n-gram lookup of `LookupDraft`: ([B, tokens] int32 the tokens that follow, in
    `text`, the occurrence of query[n - ngram : n] that starts nearest n - ngram (the
    earlier one on a tie), [B] int32 how many of them lie below text_len (0: no
    occurrence with a token after it, or n < ngram)). text, query: [B, S] int32; text_len,
    n: [B] int32. An occurrence is whole below text_len, and in `query`'s own text it
    ends below n - 1 (a token must follow it)."""
    B, S = text.shape
    starts = jnp.arange(S - ngram + 1)
    key = jnp.take_along_axis(query, jnp.clip(n[:, None] - ngram + jnp.arange(ngram)[None], 0, S - 1), axis=1)
    match = jnp.ones((B, S - ngram + 1), bool)
    for i in range(ngram):
        match &= text[:, i:S - ngram + 1 + i] == key[:, i:i + 1]
    follow = starts[None] + ngram  # the first guessed slot of an occurrence at p
    match &= (follow < text_len[:, None]) & (n[:, None] >= ngram)
    distance = jnp.where(match, jnp.abs(starts[None] - (n[:, None] - ngram)), S)
    best = jnp.argmin(distance, axis=1)
    found = jnp.any(match, axis=1)
    first = best + ngram
    guesses = jnp.take_along_axis(text, jnp.clip(first[:, None] + jnp.arange(tokens)[None], 0, S - 1), axis=1)
    return guesses, jnp.where(found, jnp.clip(text_len - first, 0, tokens), 0).astype(jnp.int32)


