"""The MH chain targets exactly pi(x) ∝ p(x)^alpha · exp(beta · D(x)).

A tiny random model with a 4-token vocabulary (3 ordinary tokens + EOS) and one
3-token block has 40 possible completions. We enumerate them and compute pi exactly
from full (uncached) forward passes.

Exactness is tested by stationarity, which does not depend on how fast the chain
mixes: thousands of independent chains start at i.i.d. draws from pi itself and run
several MH steps. An exact kernel leaves them i.i.d. pi, so their total-variation
distance to pi is distributed exactly like that of a fresh i.i.d. sample of the same
size; the pass threshold is that null distribution's 99.9th percentile (simulated),
so a correct chain fails with probability ~1e-3 (the seeds are fixed: deterministic).
A deliberately wrong ratio drifts away from pi and must fail the same bound.
Convergence from the prompt (the chain as used) is checked separately: TV to pi falls
with more MH steps.
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from degs_jax import mcmc as mcmc_mod
from degs_jax.generation import MinP, Proposal, Typical, pad_prompts, prefill
from degs_jax.lens import LensConfig, collapse_depth, span_sum
from degs_jax.mcmc import EXACT_KERNEL, REFERENCE_KERNEL, MCMCConfig, mcmc_block, mh_steps
from degs_jax.models import TransformerLM
from degs_jax.models import forward, init_params
from degs_jax.rows import repeat_rows
from tiny_models import tiny_config

EOS = 3
PROMPT = [0, 1]
BLOCK = 3
N_CHAINS = 6000
LSUB = (1, 2, 3)
MODEL_SEED, MODEL_SCALE = 70, 0.3
WARM_STEPS = 8


def enumerable_model():
    """(config, fp32 params) of the tiny model whose completions are enumerated here (also
    used by test_smc_exactness, test_sps and bench/finite_n_bias.py)."""
    cfg = tiny_config("LlamaForCausalLM", vocab=4, layers=3, hidden=16, head_dim=4,
                      num_heads=4, num_kv_heads=2, intermediate=24)
    # Seed and scale chosen (by enumerating pi) so that pi (beta = 0) spreads over
    # completions of different lengths (about 0.001, 0.30 and 0.70 on lengths 1, 2, 3;
    # no completion above 0.37): with a concentrated pi a wrong ratio could go unnoticed.
    params = init_params(cfg, jax.random.key(MODEL_SEED), jnp.float32, scale=MODEL_SCALE)
    return cfg, params


@pytest.fixture(scope="module")
def model():
    return enumerable_model()


def ends_at_eos(completion) -> bool:
    """Whether the completion's last token ends it (EOS): the default end rule."""
    return completion[-1] == EOS


def first_end(completion, ends=ends_at_eos):
    """Index of the first token that ends `completion` under the end rule `ends` (a
    predicate on the completion up to that token), or None."""
    return next((i for i in range(len(completion)) if ends(completion[:i + 1])), None)


def support(ends=ends_at_eos):
    """Every completion of at most BLOCK tokens: ended (`ends`: EOS by default) at its last
    token only, or BLOCK tokens without an end. By length, then lexicographic."""
    out = []
    for n in range(1, BLOCK + 1):
        out += [x for x in itertools.product(range(EOS + 1), repeat=n) if first_end(x, ends) == n - 1]
    out += [x for x in itertools.product(range(EOS + 1), repeat=BLOCK) if first_end(x, ends) is None]
    return out


def completion_index(tokens, lengths):
    """Index into `support()` of each row's completion ([B] int; len(support()) for a
    completion outside it). tokens: [B, S] prompt + completion; lengths: [B]."""
    tokens, lengths = np.asarray(tokens), np.asarray(lengths)
    P = len(PROMPT)
    slots = np.arange(BLOCK)[None]
    body = np.where(slots < (lengths - P)[:, None], tokens[:, P:P + BLOCK], EOS + 1)
    codes = body @ (EOS + 2) ** np.arange(BLOCK)  # base EOS + 2; EOS + 1 marks an empty slot
    seqs = support()
    known = np.array([list(x) + [EOS + 1] * (BLOCK - len(x)) for x in seqs]) @ (EOS + 2) ** np.arange(BLOCK)
    order = np.argsort(known)
    at = np.minimum(np.searchsorted(known[order], codes), len(seqs) - 1)
    return np.where(known[order][at] == codes, order[at], len(seqs))


def exact_stats(cfg, params, tau, seqs=None, ends=ends_at_eos):
    """log p(x), D(x) for every completion in `seqs` (default `support()`), from one uncached
    forward over all of them (right-padded with EOS: under causal attention the padding
    does not change earlier positions); a last token that ends the completion (`ends`) is
    not scored (it is never consumed: no d_t)."""
    seqs = support() if seqs is None else seqs
    P = len(PROMPT)
    toks = np.full((len(seqs), P + max(len(comp) for comp in seqs)), EOS, np.int32)
    toks[:, :P] = PROMPT
    for row, comp in enumerate(seqs):
        toks[row, P:P + len(comp)] = comp
    pos = np.broadcast_to(np.arange(toks.shape[1], dtype=np.int32), toks.shape)
    out = forward(params, cfg, jnp.asarray(toks), jnp.asarray(pos), lens_layers=LSUB)
    lp = np.asarray(jax.nn.log_softmax(out.logits, -1))  # [S, T, V]
    ent = np.asarray(out.lens.entropy)  # [K, S, T]
    d = None if tau is None else np.asarray(collapse_depth(ent, LSUB, cfg.num_layers, tau))  # [S, T]
    logp, depth_score, entropies = [], [], []
    for row, comp in enumerate(seqs):
        logp.append(sum(float(lp[row, P - 1 + i, t]) for i, t in enumerate(comp)))
        scored = [P + i for i in range(len(comp) - ends(comp))]
        entropies.append(ent[:, row, scored].ravel())
        if tau is None:
            depth_score.append(0.0)
        else:
            depth_score.append(float(np.mean(d[row, scored]) / cfg.num_layers) if scored else 0.0)
    return seqs, np.array(logp), np.array(depth_score), np.concatenate(entropies)


def pick_tau(entropies):
    """A tau in the middle of the widest gap between lens entropies near their median,
    so d_t varies across completions and no entropy sits within numerical noise of tau."""
    e = np.sort(entropies)
    lo, hi = len(e) // 4, 3 * len(e) // 4
    gaps = np.diff(e[lo:hi])
    i = lo + int(np.argmax(gaps))
    return float((e[i] + e[i + 1]) / 2)


def run_chains(cfg, params, mc, steps_seed=0):
    """Cold start: N_CHAINS chains from the prompt, one block. Returns final completions."""
    toks, lens = pad_prompts([PROMPT], multiple=1)
    state = prefill(TransformerLM(cfg), params, jnp.asarray(toks), jnp.asarray(lens), len(PROMPT) + BLOCK, jnp.float32)
    state = repeat_rows(state, N_CHAINS)
    keys = jax.random.split(jax.random.key(steps_seed), N_CHAINS)
    state, decisions, _ = mcmc_block(TransformerLM(cfg), params, state, keys, jnp.int32(0), mc)
    return _completions(state), np.asarray(decisions.accepted_steps())


def _completions(state):
    tokens, length = np.asarray(state.tokens), np.asarray(state.length)
    P = len(PROMPT)
    return [tuple(tokens[b, P:length[b]].tolist()) for b in range(tokens.shape[0])]


def states_at(cfg, params, completions, mc, ends=ends_at_eos):
    """GenState of chains sitting at the given completions, with their per-token log p,
    log q (the chain's proposal: temperature 1/alpha and its truncations) and d_t from one teacher-forced forward, and
    a KV cache holding every token; `ended` by the end rule `ends`, and with stop strings
    (`mc.stop`) the automaton's state after every completion token."""
    P, S = len(PROMPT), len(PROMPT) + BLOCK
    toks = np.zeros((len(completions), S), np.int32)
    lengths = np.array([P + len(c) for c in completions], np.int32)
    for b, c in enumerate(completions):
        toks[b, : P + len(c)] = PROMPT + list(c)
    state = prefill(TransformerLM(cfg), params, jnp.asarray(toks), jnp.asarray(lengths), S, jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32)[None], toks.shape)
    out = forward(params, cfg, jnp.asarray(toks), pos, lens_layers=LSUB)
    lp_all = jax.nn.log_softmax(out.logits, -1)  # [B, S, V]: predicts position t + 1
    lq_all = mc.proposal.proposal.log_density(out.logits.reshape(-1, out.logits.shape[-1])).reshape(lp_all.shape)
    nxt = jnp.asarray(toks[:, 1:])[..., None]
    shift = lambda a: jnp.concatenate([jnp.zeros((a.shape[0], 1)), a], 1)
    logp = shift(jnp.take_along_axis(lp_all[:, :-1], nxt, -1)[..., 0])
    logq = shift(jnp.take_along_axis(lq_all[:, :-1], nxt, -1)[..., 0])
    depth = collapse_depth(out.lens.entropy, LSUB, cfg.num_layers, mc.lens.tau)
    ended = jnp.asarray([ends(c) for c in completions])
    stop_state = None
    if mc.stop is not None:
        stop_state = np.zeros((len(completions), S), np.int32)
        for b, c in enumerate(completions):
            for i in range(len(c)):
                stop_state[b, P + i] = mc.stop.run(c[:i + 1])
        stop_state = jnp.asarray(stop_state)
    return dataclasses.replace(state, prompt_len=jnp.full_like(state.prompt_len, P), logp=logp,
                               logq=logq, depth=depth, ended=ended, stop_state=stop_state)


def run_from_target(cfg, params, mc, seqs, pi, seed=0, ends=ends_at_eos):
    """Warm start: chains at i.i.d. draws from pi, then mc.mh_steps MH steps (a
    completion ends where `ends` says; EOS by default)."""
    rng = np.random.default_rng(seed)
    start = [seqs[i] for i in rng.choice(len(seqs), size=N_CHAINS, p=pi)]
    state = states_at(cfg, params, start, mc, ends)
    keys = jax.random.split(jax.random.key(seed + 1), N_CHAINS)
    limit = jnp.full((N_CHAINS,), len(PROMPT) + BLOCK, jnp.int32)
    active = jnp.ones((N_CHAINS,), bool)
    state, decisions = mh_steps(TransformerLM(cfg), params, state, keys, jnp.int32(0), active, mc)
    return _completions(state), np.asarray(decisions.accepted_steps())


def tv_and_threshold(seqs, target, samples, seed=0):
    # Completions outside the support (e.g. reference_quirks' proposals capped at the
    # current length, which stop early without EOS) land in an extra bin where pi = 0.
    index = {s: i for i, s in enumerate(seqs)}
    counts = np.bincount([index.get(s, len(seqs)) for s in samples], minlength=len(seqs) + 1)
    tv = 0.5 * np.abs(counts / counts.sum() - np.append(target, 0.0)).sum()
    rng = np.random.default_rng(seed)
    null = 0.5 * np.abs(rng.multinomial(len(samples), target, size=4000) / len(samples) - target).sum(1)
    return tv, float(np.quantile(null, 0.999))


def target(logp, depth, alpha, beta):
    logits = alpha * logp + beta * depth
    w = np.exp(logits - logits.max())
    return w / w.sum()


@pytest.fixture(scope="module")
def depth_setup(model):
    cfg, params = model
    _, _, _, ent = exact_stats(cfg, params, None)
    tau = pick_tau(ent)
    seqs, logp, depth, _ = exact_stats(cfg, params, tau)
    assert len(set(np.round(depth, 6))) > 3, "tau should make D(x) vary across completions"
    return tau, seqs, logp, depth


CASES = {
    "power": dict(beta=0.0),
    "degs": dict(beta=3.0),
}


def _mc(tau, beta, steps, quirks=False, stop=None):
    return MCMCConfig(alpha=4.0, beta=beta, block_len=BLOCK, num_blocks=1, mh_steps=steps,
                      lens=LensConfig(lsub=LSUB, tau=tau), eos_ids=(EOS,),
                      kernel=REFERENCE_KERNEL if quirks else EXACT_KERNEL, stop=stop)


@pytest.mark.parametrize("case", sorted(CASES))
def test_exact_target_is_stationary(model, depth_setup, case):
    cfg, params = model
    tau, seqs, logp, depth = depth_setup
    beta = CASES[case]["beta"]
    pi = target(logp, depth, 4.0, beta)
    samples, accepted = run_from_target(cfg, params, _mc(tau, beta, WARM_STEPS), seqs, pi)
    tv, threshold = tv_and_threshold(seqs, pi, samples)
    assert accepted.mean() / WARM_STEPS > 0.3, "the chains should move"
    assert tv < threshold, f"TV {tv:.4f} >= {threshold:.4f}"


@pytest.mark.parametrize("case", sorted(CASES))
def test_tv_falls_with_more_steps(model, depth_setup, case):
    cfg, params = model
    tau, seqs, logp, depth = depth_setup
    pi = target(logp, depth, 4.0, CASES[case]["beta"])
    tvs = [tv_and_threshold(seqs, pi, run_chains(cfg, params, _mc(tau, CASES[case]["beta"], steps))[0])[0]
           for steps in (1, 24)]
    assert tvs[1] < 0.6 * tvs[0], tvs


def _no_cut_ratio(current, proposal, cut, mc, num_layers, *invariance):
    n_x = (current.length - current.prompt_len).astype(jnp.float32)
    n_y = (proposal.length - proposal.prompt_len).astype(jnp.float32)
    return CORRECT_RATIO(current, proposal, cut, mc, num_layers, *invariance) - (jnp.log(n_x) - jnp.log(n_y))


def _q_sign_flipped(current, proposal, cut, mc, num_layers, *invariance):
    dq = (span_sum(current.logq, cut, current.length)
          - span_sum(proposal.logq, cut, proposal.length))
    return CORRECT_RATIO(current, proposal, cut, mc, num_layers, *invariance) - 2 * dq


CORRECT_RATIO = mcmc_mod.log_acceptance_ratio


@pytest.mark.parametrize("wrong", ["no_cut_index_ratio", "q_sign_flipped", "reference_quirks"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_wrong_ratio_fails_the_bound(model, depth_setup, monkeypatch, wrong, case):
    cfg, params = model
    tau, seqs, logp, depth = depth_setup
    beta = CASES[case]["beta"]
    if wrong == "no_cut_index_ratio":
        monkeypatch.setattr(mcmc_mod, "log_acceptance_ratio", _no_cut_ratio)
    elif wrong == "q_sign_flipped":
        monkeypatch.setattr(mcmc_mod, "log_acceptance_ratio", _q_sign_flipped)
    pi = target(logp, depth, 4.0, beta)
    jax.clear_caches()  # the jitted steps must be retraced with the patched ratio
    try:
        mc = _mc(tau, beta, WARM_STEPS, quirks=wrong == "reference_quirks")
        samples, _ = run_from_target(cfg, params, mc, seqs, pi)
    finally:
        jax.clear_caches()
    tv, threshold = tv_and_threshold(seqs, pi, samples)
    assert tv > threshold, f"a wrong ratio ({wrong}) passed: TV {tv:.4f} < {threshold:.4f}"


# Truncated proposals (min-p, typical): the chain can only reach completions whose every
# token its proposal keeps (the support S), and on S its target is pi restricted and
# renormalised, provided log q is the truncated, renormalised density. At alpha = 1 (q is p,
# cut) the cuts below leave 20 (min-p 0.2) and 16 (typical 0.8) of the 40 completions and
# remove 12-22% of pi's mass (at alpha = 4 such cuts remove about 1%: too little for a wrong
# log q to show). Each case compiles its chain.
TRUNCATED_ALPHA = 1.0
TRUNCATED = {"min_p, degs": (MinP(0.2), 3.0, "renormalised"),
             "typical, power": (Typical(0.8), 0.0, "renormalised"),
             "min_p, degs, log q not renormalised": (MinP(0.2), 3.0, "not_renormalised")}


def _unnormalised_log_density(proposal, logits):
    """The mutation: log softmax(logits / T) on the kept tokens, not renormalised after the
    cuts (the same draws, a wrong log q)."""
    z = logits / proposal.temperature
    keep = jnp.ones(z.shape, bool)
    for cut in proposal.truncations:
        keep &= cut.keep(jnp.where(keep, z, -jnp.inf))
    return jnp.where(keep, jax.nn.log_softmax(z, axis=-1), -jnp.inf)


@pytest.mark.parametrize("case", list(TRUNCATED))
def test_truncated_proposal_is_exact_on_its_support(model, depth_setup, monkeypatch, case):
    cfg, params = model
    tau, seqs, logp, depth = depth_setup
    cut, beta, log_q = TRUNCATED[case]
    if log_q == "not_renormalised":
        monkeypatch.setattr(Proposal, "log_density", _unnormalised_log_density)
    jax.clear_caches()  # the jitted steps must be retraced with (or without) the patch
    try:
        mc = dataclasses.replace(_mc(tau, beta, WARM_STEPS), alpha=TRUNCATED_ALPHA, truncations=(cut,))
        logq = np.asarray(states_at(cfg, params, seqs, mc).logq)
        P = len(PROMPT)
        kept = np.array([np.isfinite(logq[b, P:P + len(c)]).all() for b, c in enumerate(seqs)])
        assert 10 <= kept.sum() < len(seqs), "the cut should remove completions and leave a spread"
        pi = target(logp, depth, TRUNCATED_ALPHA, beta) * kept
        pi /= pi.sum()
        samples, accepted = run_from_target(cfg, params, mc, seqs, pi)
    finally:
        jax.clear_caches()
    tv, threshold = tv_and_threshold(seqs, pi, samples)
    if log_q == "renormalised":
        assert accepted.mean() / WARM_STEPS > 0.3, "the chains should move"
        assert tv < threshold, f"TV {tv:.4f} >= {threshold:.4f}"
        assert set(samples) <= {s for s, k in zip(seqs, kept) if k}, "a chain left the proposal's support"
    else:
        assert tv > threshold, f"a wrong log q passed: TV {tv:.4f} < {threshold:.4f}"
