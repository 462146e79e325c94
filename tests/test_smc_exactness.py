"""Power-SMC / DEGS-SMC are exact: Ẑ is unbiased for Z = Σ_x p(x)^alpha · exp(beta · D(x))
and the weighted particle distribution converges to pi = gamma / Z.

The enumerable tiny model of test_mcmc_exactness (4-token vocabulary, prompt [0, 1],
a 3-token budget: 40 completions, pi and Z computed exactly from uncached forwards).
R independent SMC runs of the same prompt are one batch (R prompts × N particles).

(a) Unbiasedness: mean(Ẑ) over R runs is within 4 standard errors of Z (SE = sample
    std / sqrt(R); the runs are i.i.d., so by the CLT a correct sampler fails with
    probability ~1e-4; the seeds are fixed, so the test is deterministic).
(b) Consistency: the particle drawn by weight from each run is a draw from
    E[weighted empirical distribution]. At N = 128 its TV to pi must be below the 99.9th
    percentile of the TV of R i.i.d. draws from pi (simulated). The self-normalisation
    bias of SMC is O(chi²/N): for beta = 3 the mass of (0, EOS) (pi 0.75, q 0.058,
    chi² + 1 = 9.8) is underestimated by about 0.75 · (12.9 - 9.8) / N, 0.018 at N = 128,
    against a noise threshold of ~0.06 at R = 600. The weighted distribution's TV (averaged
    over runs) must also fall from N = 4 to N = 128.
(c) Wrong incremental weights (monkeypatched, then recompiled) must fail (a) or (b):
    q's sign flipped, no jump to the final exponent when a particle completes before the
    ramp is done, weights not reset after resampling (a bug of one public port), and
    for DEGS-SMC the depth increment dropped. Measured when written: every one fails
    (b) (TV 0.20-0.48 against thresholds of 0.066-0.073), and all but the missing jump
    also fail (a) by thousands of standard errors (the missing jump: 3.9).

The cases exercise the hard parts: power uses a ramp of 4 tokens > the 3-token budget
(every particle completes mid-ramp, so the exponent jump at completion carries the whole
correction) and resamples at every token with a high ESS threshold; degs uses a ramp of 2
(it completes mid-run for the longest particles) and checks every 2 tokens (the second
check falls on the budget's consume-only step, which adds the last d_t).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from degs_jax import smc as smc_mod
from degs_jax.generation import pad_prompts, prefill, repeat_rows
from degs_jax.lens import LensConfig
from degs_jax.models import TransformerLM
from degs_jax.smc import SMCConfig, final_weights, run_smc
from test_mcmc_exactness import EOS, LSUB, PROMPT, exact_stats, model, pick_tau, target  # noqa: F401

BUDGET = 3
ALPHA = 4.0
LARGE_N, SMALL_N, RUNS = 128, 4, 600
CASES = {
    "power": dict(beta=0.0, ramp_tokens=4, resample_every=1, ess_threshold=0.8),
    "degs": dict(beta=3.0, ramp_tokens=2, resample_every=2, ess_threshold=0.5),
}


@pytest.fixture(scope="module")
def exact(model):
    cfg, params = model
    tau = pick_tau(exact_stats(cfg, params, None)[3])
    seqs, logp, depth, _ = exact_stats(cfg, params, tau)
    return tau, seqs, logp, depth


def smc_config(tau, case, n):
    return SMCConfig(alpha=ALPHA, n_particles=n, max_new_tokens=BUDGET, lens=LensConfig(lsub=LSUB, tau=tau),
                     eos_ids=(EOS,), **CASES[case])


def run_many(model, smc, runs, seed):
    """R = runs independent SMC runs of PROMPT. Returns (completions [R][N], normalised
    weights [R, N], log Ẑ [R], chosen [R], resamples [R])."""
    cfg, params = model
    lm = TransformerLM(cfg)
    toks, lens = pad_prompts([PROMPT], multiple=1)
    gen = prefill(lm, params, jnp.asarray(toks), jnp.asarray(lens), len(PROMPT) + BUDGET, jnp.float32)
    n = smc.n_particles
    gen = repeat_rows(gen, runs * n)
    keys = jax.random.split(jax.random.key(seed), runs * n)
    state = run_smc(lm, params, gen, keys, smc)
    weights, log_z, chosen = jax.device_get(final_weights(state, keys, n))
    tokens, length = jax.device_get((state.gen.tokens, state.gen.length))
    P = len(PROMPT)
    comps = [[tuple(tokens[r * n + j, P:length[r * n + j]].tolist()) for j in range(n)] for r in range(runs)]
    return comps, weights, log_z, chosen, np.asarray(state.resamples)


def weighted_distribution(seqs, comps, weights):
    """Mean over runs of Σ_i w_i δ(x_i), with an extra last bin for completions outside
    the support (there must be none)."""
    index = {s: i for i, s in enumerate(seqs)}
    mu = np.zeros(len(seqs) + 1)
    for run, w in zip(comps, weights):
        for x, wi in zip(run, w):
            mu[index.get(x, len(seqs))] += wi
    return mu / len(comps)


def tv(mu, pi):
    return 0.5 * np.abs(mu - np.append(pi, 0.0)).sum()


def null_threshold(pi, draws, seed=0):
    """99.9th percentile of TV(empirical distribution of `draws` i.i.d. samples, pi)."""
    rng = np.random.default_rng(seed)
    sims = 0.5 * np.abs(rng.multinomial(draws, pi, size=4000) / draws - pi).sum(1)
    return float(np.quantile(sims, 0.999))


def checks(exact, case, result):
    """(z_error in standard errors, TV of the chosen particles, its threshold, weighted TV)."""
    _, seqs, logp, depth = exact
    beta = CASES[case]["beta"]
    pi = target(logp, depth, ALPHA, beta)
    z = float(np.sum(np.exp(ALPHA * logp + beta * depth)))
    comps, weights, log_z, chosen, _ = result
    z_hat = np.exp(log_z.astype(np.float64))
    z_err = abs(z_hat.mean() - z) / (z_hat.std(ddof=1) / np.sqrt(len(z_hat)))
    index = {s: i for i, s in enumerate(seqs)}
    drawn = [index.get(run[c], len(seqs)) for run, c in zip(comps, chosen)]
    counts = np.bincount(drawn, minlength=len(seqs) + 1)
    tv_chosen = tv(counts / counts.sum(), pi)
    return z_err, tv_chosen, null_threshold(pi, len(drawn)), tv(weighted_distribution(seqs, comps, weights), pi)


@pytest.mark.parametrize("case", sorted(CASES))
def test_evidence_unbiased_and_particles_converge(model, exact, case):
    tau = exact[0]
    large = run_many(model, smc_config(tau, case, LARGE_N), RUNS, seed=1)
    small = run_many(model, smc_config(tau, case, SMALL_N), RUNS, seed=2)
    z_err, tv_chosen, threshold, tv_large = checks(exact, case, large)
    assert (large[4] > 0).mean() > 0.3, "resampling must happen in many runs, or it goes untested"
    assert z_err < 4.0, f"mean Ẑ is {z_err:.1f} standard errors from Z"
    assert tv_chosen < threshold, f"TV {tv_chosen:.4f} >= {threshold:.4f} at N = {LARGE_N}"
    tv_small = checks(exact, case, small)[3]
    assert tv_large < 0.5 * tv_small, f"weighted TV does not fall with N: {tv_small:.4f} -> {tv_large:.4f}"


# ------------------------------------------------------------------ mutations

CORRECT_INCREMENT = smc_mod.log_weight_increment
CORRECT_TARGET = smc_mod.log_target
CORRECT_RESAMPLE = smc_mod.resample


def _q_sign_flipped(old, new, log_q):
    return CORRECT_INCREMENT(old, new, -log_q)


def _no_final_exponent_jump(gen, live, smc, num_layers, *invariance):
    """A completed particle keeps the ramp's exponent instead of jumping to alpha (the power
    case: beta = 0, so only the exponent differs)."""
    return CORRECT_TARGET(gen, jnp.ones_like(live), smc, num_layers, *invariance)


def _depth_increment_dropped(gen, live, smc, num_layers, *invariance):
    return CORRECT_TARGET(gen, live, dataclasses.replace(smc, beta=0.0), num_layers, *invariance)


def _weights_not_reset(state, need, ancestors, n):
    """Copies keep their ancestor's weight instead of restarting at 1."""
    out = CORRECT_RESAMPLE(state, need, ancestors, n)
    rows = jnp.arange(state.log_weight.shape[0])
    inherited = state.log_weight[rows // n * n + ancestors.reshape(-1)]
    return dataclasses.replace(out, log_weight=jnp.where(jnp.repeat(need, n), inherited, state.log_weight))


MUTATIONS = {
    ("power", "q_sign_flipped"): ("log_weight_increment", _q_sign_flipped),
    ("power", "no_final_exponent_jump"): ("log_target", _no_final_exponent_jump),
    ("power", "weights_not_reset"): ("resample", _weights_not_reset),
    ("degs", "depth_increment_dropped"): ("log_target", _depth_increment_dropped),
}


@pytest.mark.parametrize("case,wrong", sorted(MUTATIONS))
def test_wrong_weights_fail(model, exact, monkeypatch, case, wrong):
    name, fn = MUTATIONS[case, wrong]
    monkeypatch.setattr(smc_mod, name, fn)
    jax.clear_caches()  # the jitted steps must be retraced with the patched function
    try:
        result = run_many(model, smc_config(exact[0], case, LARGE_N), RUNS, seed=1)
    finally:
        jax.clear_caches()
    z_err, tv_chosen, threshold, _ = checks(exact, case, result)
    assert z_err > 4.0 or tv_chosen > threshold, (
        f"a wrong weight ({wrong}) passed: Ẑ off by {z_err:.1f} SE, TV {tv_chosen:.4f} vs {threshold:.4f}")
