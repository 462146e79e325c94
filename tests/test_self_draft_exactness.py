"""Self-drafted MH proposals are exact (issue 55): the chain's suffix as a speculative draft.

`generation.drafted_decode_step` verifies guessed tokens in one forward: a guess d is
kept with probability q(d | prefix), the first one not kept is replaced by a draw from q
with d removed; so every token is drawn from q given its prefix, whatever the guess, and
the MH kernel (`drafts.SuffixDraft`: guesses x_t while the proposal still equals x) keeps
its target. Checked on the enumerable tiny model of test_mcmc_exactness (40 completions):

- the proposal law: from a fixed state and cut, the law of the regenerated suffix with
  drafting, at several k, against the exact q(x'_{m:} | x_<m) by enumeration (TV below the
  99.9th percentile of a multinomial sample's TV, as there), and the stored log q of each
  drawn suffix equals the exact one (the target's density, never the draft's);
- stationarity: chains started at i.i.d. draws from pi stay at pi with drafted proposals
  (the suite's stationarity test, at k = 1, 2, 3; the multi-block answer law through
  both drivers is in test_mcmc_multiblock);
- guesses of length 0 draw `decode_step`'s tokens (its own program is this step with no
  guess array, K = 0);
- prompt lookups (`drafts.LookupDraft`): which occurrence they take, and that they
  re-align after a proposal leaves x; plain sampling with them keeps the sampling law,
  and greedy with them draws greedy's tokens in fewer forwards.

Mutation checks (made by hand on drafted_decode_step, 2026-12-02): keeping a guessed token
with probability 1 fails the proposal law at every k (TV 0.90-1.00 against thresholds of
0.014-0.015; the stationarity test passes it: proposals that always equal x are null
moves, and chains at pi stay there); drawing the replacement from q without removing d
fails the proposal law (TV 0.086-0.097) and stationarity (TV 0.104 against 0.025);
storing log q = 0 (the point-mass draft's density) for kept tokens fails the stored-log-q
check (off by 2.27 nats) while stationarity at this size does not see it. On the lookups
(2026-12-03): taking the farthest occurrence, counting one whose next token is past the
text's end, or searching only the proposal's own text each fail a lookup test; keeping
every greedy guess fails the greedy test, and a sampling loop that drops its draft fails
the sampling test.
"""

from __future__ import annotations

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from degs_jax.decoders import decode
from degs_jax.drafts import LookupDraft, SuffixDraft, lookup_ngram
from degs_jax.generation import decode_step, drafted_decode_step
from degs_jax.lens import LensConfig
from degs_jax.mcmc import EXACT_KERNEL, MCMCConfig, mh_steps
from degs_jax.models import TransformerLM, init_params
from degs_jax.sampling import Greedy, Temperature
from tiny_models import tiny_config
from test_mcmc_exactness import (BLOCK, EOS, LSUB, N_CHAINS, PROMPT, WARM_STEPS, _completions, depth_setup,  # noqa: F401
                                 model, run_from_target, states_at, target, tv_and_threshold)

ALPHA = 4.0
# A 3-token completion without EOS, and the cut (completion position) the proposals start
# from: the suffix guessed is its last two tokens.
CHAIN = (0, 2, 1)
CUT = 1


def _mc(tau, beta, steps, draft=None):
    kernel = dataclasses.replace(EXACT_KERNEL, draft=draft)
    return MCMCConfig(alpha=ALPHA, beta=beta, block_len=BLOCK, num_blocks=1, mh_steps=steps,
                      lens=LensConfig(lsub=LSUB, tau=tau), eos_ids=(EOS,), kernel=kernel)


def regenerate(cfg, params, mc, n_rows, seed):
    """n_rows proposals regenerated from CUT of the chain at CHAIN to EOS or the block's end,
    with drafted steps (the guesses of `mc`'s kernel draft; None: none) until every row is
    done. Returns (the proposals' states, decode steps run)."""
    lm = TransformerLM(cfg)
    current = states_at(cfg, params, [CHAIN] * n_rows, mc)
    cut = jnp.full((n_rows,), len(PROMPT) + CUT, jnp.int32)
    proposal = dataclasses.replace(current, length=cut, ended=jnp.zeros_like(current.ended))
    limit = jnp.full((n_rows,), len(PROMPT) + BLOCK, jnp.int32)
    keys = jax.random.split(jax.random.key(seed), n_rows)
    draft = mc.kernel.draft

    @jax.jit
    def step(proposal, active):
        if draft is None:
            return decode_step(lm, params, proposal, active, limit, keys, cut, mc.proposal)
        guesses, proposed = draft.propose(current, proposal)
        return drafted_decode_step(lm, params, proposal, active, limit, keys, cut, mc.proposal, guesses, proposed)

    active, steps = jnp.ones((n_rows,), bool), 0
    while bool(jnp.any(active)):
        proposal, active = step(proposal, active)
        steps += 1
    return proposal, steps


def exact_suffix_law(cfg, params, mc):
    """{suffix: q(suffix | prefix)} of every regeneration from CUT, by enumeration, and the
    exact log q of each (from one teacher-forced forward of each completion)."""
    from test_mcmc_exactness import support
    prefix = CHAIN[:CUT]
    reach = [x for x in support() if x[:CUT] == prefix]
    states = states_at(cfg, params, reach, mc)
    P = len(PROMPT)
    logq = np.asarray(states.logq)
    law = {x[CUT:]: float(np.exp(logq[i, P + CUT:P + len(x)].sum())) for i, x in enumerate(reach)}
    assert abs(sum(law.values()) - 1) < 1e-5, "the regenerations from a cut must be a distribution"
    return law, {x[CUT:]: logq[i, P + CUT:P + len(x)] for i, x in enumerate(reach)}


DRAFTS = [SuffixDraft(1), SuffixDraft(2), SuffixDraft(3), LookupDraft(2, 1), LookupDraft(3, 2)]


@pytest.mark.parametrize("draft", DRAFTS, ids=repr)
def test_drafted_regeneration_has_the_proposal_law(model, depth_setup, draft):
    cfg, params = model
    tau = depth_setup[0]
    mc = _mc(tau, 0.0, 1, draft)
    law, exact_logq = exact_suffix_law(cfg, params, mc)
    seed = DRAFTS.index(draft)
    proposal, steps = regenerate(cfg, params, mc, N_CHAINS, seed=5 + seed)
    P = len(PROMPT)
    suffixes = [x[CUT:] for x in _completions(proposal)]
    names = sorted(law)
    tv, threshold = tv_and_threshold(names, np.array([law[s] for s in names]), suffixes, seed=seed)
    assert tv < threshold, f"{draft}: TV {tv:.4f} >= {threshold:.4f}"
    # Stored log q is the target's density of each drawn token (1e-4: fp32 forwards of
    # different widths and cached against uncached attention differ by ~1e-5; a draft's
    # density, 0, or another prefix's is off by nats).
    logq, length = np.asarray(proposal.logq), np.asarray(proposal.length)
    for r in range(0, N_CHAINS, 97):
        np.testing.assert_allclose(logq[r, P + CUT:length[r]], exact_logq[suffixes[r]], atol=1e-4)
    # The guess is good (the chain's own suffix at temperature 1/4): fewer steps than tokens.
    assert np.mean(length - P - CUT) > 1.0 and steps <= BLOCK - CUT + 1


def test_an_empty_draft_is_decode_step(model, depth_setup):
    cfg, params = model
    mc = _mc(depth_setup[0], 0.0, 1)
    plain, _ = regenerate(cfg, params, mc, 64, seed=3)
    lm = TransformerLM(cfg)
    current = states_at(cfg, params, [CHAIN] * 64, mc)
    cut = jnp.full((64,), len(PROMPT) + CUT, jnp.int32)
    proposal = dataclasses.replace(current, length=cut, ended=jnp.zeros_like(current.ended))
    limit = jnp.full((64,), len(PROMPT) + BLOCK, jnp.int32)
    keys = jax.random.split(jax.random.key(3), 64)
    guesses = jnp.zeros((64, 2), jnp.int32)
    active = jnp.ones((64,), bool)
    while bool(jnp.any(active)):
        proposal, active = drafted_decode_step(lm, params, proposal, active, limit, keys, cut, mc.proposal,
                                               guesses, jnp.zeros((64,), jnp.int32))
    # The same draws: the keys are the slots' own, and the logits those of a forward three
    # positions wide (two of them dropped) instead of one, equal up to fp32 rounding (1e-6).
    for name in ("tokens", "length", "ended"):
        np.testing.assert_array_equal(np.asarray(getattr(proposal, name)), np.asarray(getattr(plain, name)), name)
    for name in ("logp", "logq"):
        np.testing.assert_allclose(np.asarray(getattr(proposal, name)), np.asarray(getattr(plain, name)), atol=1e-6)


@pytest.mark.parametrize(("beta", "draft"), [(0.0, SuffixDraft(1)), (3.0, SuffixDraft(2)), (3.0, SuffixDraft(3)),
                                           (3.0, LookupDraft(2, 1))], ids=repr)
def test_self_drafted_chains_stay_at_the_target(model, depth_setup, beta, draft):
    cfg, params = model
    tau, seqs, logp, depth = depth_setup
    pi = target(logp, depth, ALPHA, beta)
    samples, accepted = run_from_target(cfg, params, _mc(tau, beta, WARM_STEPS, draft), seqs, pi)
    tv, threshold = tv_and_threshold(seqs, pi, samples)
    assert accepted.mean() / WARM_STEPS > 0.3, "the chains should move"
    assert tv < threshold, f"TV {tv:.4f} >= {threshold:.4f}"


def _texts(rows):
    """Stand-ins for GenState in `Draft.propose`: (tokens, length) per row, right-padded."""
    S = max(len(r) for r, _ in rows)
    tokens = jnp.asarray([list(r) + [0] * (S - len(r)) for r, _ in rows], jnp.int32)
    return types.SimpleNamespace(tokens=tokens, length=jnp.asarray([n for _, n in rows], jnp.int32), max_len=S)


def test_the_lookup_takes_the_occurrence_nearest_the_end():
    own = _texts([
        ((1, 2, 7, 1, 2, 8, 1, 2), 8),  # "1 2" at 0 and 3 (at 6 it is the query): the one at 3
        ((3, 4, 3, 4, 0, 0, 0, 0), 4),  # at 0: two tokens follow it before the query
        ((3, 4, 5, 6, 7, 0, 0, 0), 5),  # "6 7" does not occur before: nothing
    ])
    guesses, proposed = lookup_ngram(own.tokens, own.length, own.tokens, own.length, 2, 3)
    np.testing.assert_array_equal(np.asarray(proposed), [3, 2, 0])
    np.testing.assert_array_equal(np.asarray(guesses)[0], [8, 1, 2])
    np.testing.assert_array_equal(np.asarray(guesses)[1, :2], [3, 4])
    # In another text, occurrences 2 slots before and 2 after the query's place: the earlier.
    text, query = jnp.asarray([[1, 2, 7, 9, 1, 2, 8, 0]]), jnp.asarray([[9, 9, 1, 2, 0, 0, 0, 0]])
    guesses, proposed = lookup_ngram(text, jnp.asarray([7]), query, jnp.asarray([4]), 2, 3)
    np.testing.assert_array_equal(np.asarray(guesses), [[7, 9, 1]])
    assert int(proposed[0]) == 3
    # Nothing after an occurrence below the text's end, or a query shorter than the n-gram.
    assert int(lookup_ngram(text, jnp.asarray([2]), query, jnp.asarray([4]), 2, 3)[1][0]) == 0
    assert int(lookup_ngram(text, jnp.asarray([7]), query, jnp.asarray([1]), 2, 3)[1][0]) == 0


def test_the_lookup_draft_realigns_where_the_suffix_draft_stops():
    x = (9, 8, 1, 2, 3, 4, 5, 6, 0, 0)  # prompt 9 8, completion 1 2 3 4 5 6 (length 8)
    repeating = (4, 5, 6, 1, 4, 5, 0, 0, 0, 0)  # a chain x whose end repeats its prompt's start
    current = _texts([(x, 8)] * 4 + [(repeating, 6)])
    proposal = _texts([
        (x, 4),  # still x: both drafts guess x's next tokens
        ((9, 8, 1, 7, 2, 3, 0, 0, 0, 0), 6),  # 7 inserted, then x again: "2 3" realigns at x's slot 3
        (x, 8),  # at x's end (an extension): "5 6" occurs only as the query
        ((9, 8, 1, 7, 5, 7, 5, 0, 0, 0), 7),  # not in x; in its own text at slot 3
        (repeating, 6),  # an extension: "4 5" at the prompt's start
    ])
    suffix = SuffixDraft(3).propose(current, proposal)
    lookup = LookupDraft(3, 2).propose(current, proposal)
    np.testing.assert_array_equal(np.asarray(suffix[1]), [3, 0, 0, 0, 0])
    np.testing.assert_array_equal(np.asarray(lookup[1]), [3, 3, 0, 2, 3])
    guesses = np.asarray(lookup[0])
    np.testing.assert_array_equal(guesses[[0, 1, 4]], [[3, 4, 5], [4, 5, 6], [6, 1, 4]])
    np.testing.assert_array_equal(guesses[3, :2], [7, 5])
    np.testing.assert_array_equal(guesses[0], np.asarray(suffix[0])[0])


def test_sampling_with_prompt_lookups_has_the_sampling_law(model, depth_setup):
    """Plain sampling (the `temperature` method at 1/alpha) with 1-gram prompt lookups, 2
    guesses per forward: the law of whole completions is q's, by enumeration."""
    from test_mcmc_exactness import support
    cfg, params = model
    mc = _mc(depth_setup[0], 0.0, 1)
    completions = support()
    logq = np.asarray(states_at(cfg, params, completions, mc).logq)
    P = len(PROMPT)
    law = np.array([np.exp(logq[i, P:P + len(x)].sum()) for i, x in enumerate(completions)])
    assert abs(law.sum() - 1) < 1e-5
    method = Temperature(temperature=1 / ALPHA, max_new_tokens=BLOCK, probe=False, draft_tokens=2, draft_lookup=1)
    keys = jax.random.split(jax.random.key(17), N_CHAINS)
    result = decode(TransformerLM(cfg), params, [PROMPT] * N_CHAINS, method, keys=keys, eos_ids=(EOS,))
    samples = [tuple(output.chosen.tokens) for output in result.outputs]
    tv, threshold = tv_and_threshold(completions, law, samples, seed=17)
    assert tv < threshold, f"TV {tv:.4f} >= {threshold:.4f}"
    # Guesses were verified (positions beyond one per step; this model's completions rarely
    # repeat, so they save few steps here: the greedy test below measures that).
    plain = decode(TransformerLM(cfg), params, [PROMPT] * N_CHAINS, dataclasses.replace(method, draft_tokens=0),
                   keys=keys, eos_ids=(EOS,))
    assert result.counters["forward_tokens"] > 1.1 * plain.counters["forward_tokens"]


def test_greedy_with_prompt_lookups_is_greedy():
    """Greedy decoding with prompt lookups (3 guesses of 2-gram lookups per forward) draws
    greedy's tokens, in fewer forwards: a random fp32 model whose greedy completions fall
    into a cycle (no EOS; 40 tokens each: 149 steps against 328 when written)."""
    cfg = tiny_config("LlamaForCausalLM", vocab=12, layers=2, hidden=16, head_dim=4, intermediate=24)
    params = init_params(cfg, jax.random.key(3), jnp.float32)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 11, size=int(n)).tolist() for n in rng.integers(3, 9, size=8)]
    lm = TransformerLM(cfg)
    key = jax.random.key(0)
    plain = decode(lm, params, prompts, Greedy(max_new_tokens=40, probe=False), key=key, eos_ids=())
    drafted = decode(lm, params, prompts, Greedy(max_new_tokens=40, probe=False, draft_tokens=3, draft_lookup=2),
                     key=key, eos_ids=())
    for a, b in zip(plain.outputs, drafted.outputs):
        assert a.chosen.tokens == b.chosen.tokens
    assert drafted.counters["decode_steps"] < 0.6 * plain.counters["decode_steps"], (
        drafted.counters, plain.counters)
