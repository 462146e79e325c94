"""Self-drafted MH proposals are exact (issue 55): the chain's suffix as a speculative draft.

`generation.drafted_decode_step` verifies guessed tokens in one forward: a guess d is
kept with probability q(d | prefix), the first one not kept is replaced by a draw from q
with d removed; so every token is drawn from q given its prefix, whatever the guess, and
the MH kernel (`mcmc.SuffixDraft`: guesses x_t while the proposal still equals x) keeps
its target. Checked on the enumerable tiny model of test_mcmc_exactness (40 completions):

- the proposal law: from a fixed state and cut, the law of the regenerated suffix with
  drafting, at several k, against the exact q(x'_{m:} | x_<m) by enumeration (TV below the
  99.9th percentile of a multinomial sample's TV, as there), and the stored log q of each
  drawn suffix equals the exact one (the target's density, never the draft's);
- stationarity: chains started at i.i.d. draws from pi stay at pi with drafted proposals
  (the suite's stationarity test, at k = 1, 2, 3; the multi-block answer law through
  both drivers is in test_mcmc_multiblock);
- guesses of length 0 draw `decode_step`'s tokens (its own program is this step with no
  guess array, K = 0).

Mutation checks (made by hand on drafted_decode_step, 2026-12-02): keeping a guessed token
with probability 1 fails the proposal law at every k (TV 0.90-1.00 against thresholds of
0.014-0.015; the stationarity test passes it: proposals that always equal x are null
moves, and chains at pi stay there); drawing the replacement from q without removing d
fails the proposal law (TV 0.086-0.097) and stationarity (TV 0.104 against 0.025);
storing log q = 0 (the point-mass draft's density) for kept tokens fails the stored-log-q
check (off by 2.27 nats) while stationarity at this size does not see it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from degs_jax.generation import decode_step, drafted_decode_step
from degs_jax.lens import LensConfig
from degs_jax.mcmc import EXACT_KERNEL, MCMCConfig, SuffixDraft, mh_steps
from degs_jax.models import TransformerLM
from test_mcmc_exactness import (BLOCK, EOS, LSUB, N_CHAINS, PROMPT, WARM_STEPS, _completions, depth_setup,  # noqa: F401
                                 model, run_from_target, states_at, target, tv_and_threshold)

ALPHA = 4.0
# A 3-token completion without EOS, and the cut (completion position) the proposals start
# from: the suffix guessed is its last two tokens.
CHAIN = (0, 2, 1)
CUT = 1


def _mc(tau, beta, steps, draft_tokens=0):
    kernel = dataclasses.replace(EXACT_KERNEL, draft=SuffixDraft(draft_tokens)) if draft_tokens else EXACT_KERNEL
    return MCMCConfig(alpha=ALPHA, beta=beta, block_len=BLOCK, num_blocks=1, mh_steps=steps,
                      lens=LensConfig(lsub=LSUB, tau=tau), eos_ids=(EOS,), kernel=kernel)


def regenerate(cfg, params, mc, n_rows, draft_tokens, seed):
    """n_rows proposals regenerated from CUT of the chain at CHAIN to EOS or the block's end,
    with drafted steps (`draft_tokens` guesses of the chain's suffix; 0: none) until every
    row is done. Returns (the proposals' states, decode steps run)."""
    lm = TransformerLM(cfg)
    current = states_at(cfg, params, [CHAIN] * n_rows, mc)
    cut = jnp.full((n_rows,), len(PROMPT) + CUT, jnp.int32)
    proposal = dataclasses.replace(current, length=cut, ended=jnp.zeros_like(current.ended))
    limit = jnp.full((n_rows,), len(PROMPT) + BLOCK, jnp.int32)
    keys = jax.random.split(jax.random.key(seed), n_rows)
    draft = SuffixDraft(draft_tokens) if draft_tokens else None

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


@pytest.mark.parametrize("draft_tokens", [1, 2, 3])
def test_drafted_regeneration_has_the_proposal_law(model, depth_setup, draft_tokens):
    cfg, params = model
    tau = depth_setup[0]
    mc = _mc(tau, 0.0, 1)
    law, exact_logq = exact_suffix_law(cfg, params, mc)
    proposal, steps = regenerate(cfg, params, mc, N_CHAINS, draft_tokens, seed=5 + draft_tokens)
    P = len(PROMPT)
    suffixes = [x[CUT:] for x in _completions(proposal)]
    names = sorted(law)
    tv, threshold = tv_and_threshold(names, np.array([law[s] for s in names]), suffixes, seed=draft_tokens)
    assert tv < threshold, f"k = {draft_tokens}: TV {tv:.4f} >= {threshold:.4f}"
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
    plain, _ = regenerate(cfg, params, mc, 64, 0, seed=3)
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


@pytest.mark.parametrize(("beta", "draft_tokens"), [(0.0, 1), (3.0, 2), (3.0, 3)])
def test_self_drafted_chains_stay_at_the_target(model, depth_setup, beta, draft_tokens):
    cfg, params = model
    tau, seqs, logp, depth = depth_setup
    pi = target(logp, depth, ALPHA, beta)
    samples, accepted = run_from_target(cfg, params, _mc(tau, beta, WARM_STEPS, draft_tokens), seqs, pi)
    tv, threshold = tv_and_threshold(seqs, pi, samples)
    assert accepted.mean() / WARM_STEPS > 0.3, "the chains should move"
    assert tv < threshold, f"TV {tv:.4f} >= {threshold:.4f}"
