"""Scalable Power Sampling on the enumerable tiny model of test_mcmc_exactness (prompt
[0, 1], 4-token vocabulary, 3-token budget, alpha 4).

The first SPS block (2 tokens, or the token form's 1) is drawn from p_jk, an estimate of
the exact block marginal of pi ∝ p^alpha, pi_1(b) = Σ_{x starts with b} pi(x). With a
full candidate set (every possible block) and rollouts that cover the rest of the budget,
E[zeta_hat] = zeta exactly, and p_jk's remaining bias is O(1/M²) (~1e-6 at M = 256, far
below the noise). The test averages p_jk over R independent runs (R prompts in one batch)
and bounds TV(mean, pi_1) by the 99.9th percentile of the TV that resampling the runs
(bootstrap) gives around their mean. Deliberately wrong future factors (none: zeta = 1,
the low-temperature distribution restricted to the candidates; rollouts weighted with
p^alpha instead of p^(alpha-1)) must fail the same bound.

The jackknife test feeds `block_probabilities` rollouts drawn with numpy from the model's
exact next-token distributions (200k independent runs at M = 4; cheap, and the same
estimator code as decoding): the plain ratio p_hat is biased at O(1/M), the jackknife at
O(1/M²); measured TVs of the mean to pi_1 are 0.0105 and 0.0022 against a noise of
~3e-4.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from degs_jax import sps as sps_mod
from degs_jax.generation import pad_prompts, prefill
from degs_jax.models import TransformerLM
from degs_jax.models import forward
from degs_jax.rows import repeat_rows
from degs_jax.sps import SPSConfig, block_probabilities, sps_block
from test_mcmc_exactness import EOS, PROMPT, exact_stats, model, target  # noqa: F401

BUDGET = 3
ALPHA = 4.0
RUNS = 32


def first_block(x, block_len):
    return x[: x.index(EOS) + 1] if EOS in x[:block_len] else x[:block_len]


@pytest.fixture(scope="module")
def power_target(model):
    cfg, params = model
    seqs, logp, depth, _ = exact_stats(cfg, params, None)
    return seqs, target(logp, depth, ALPHA, 0.0)


def block_marginal(power_target, block_len):
    seqs, pi = power_target
    marginal = {}
    for x, p in zip(seqs, pi):
        b = first_block(x, block_len)
        marginal[b] = marginal.get(b, 0.0) + p
    return marginal


def first_block_probabilities(model, sps, runs, seed=0):
    """R runs of the first block: ([R, n_blocks] p_jk per possible block, block order)."""
    cfg, params = model
    lm = TransformerLM(cfg)
    toks, lens = pad_prompts([PROMPT], multiple=1)
    gen = repeat_rows(prefill(lm, params, jnp.asarray(toks), jnp.asarray(lens), len(PROMPT) + BUDGET,
                              jnp.float32), runs)
    keys = jax.random.split(jax.random.key(seed), runs)
    _, info = sps_block(lm, params, gen, keys, jnp.int32(0), sps)
    tokens, length, valid, probs = jax.device_get((info.tokens, info.length, info.valid, info.probs))
    P = len(PROMPT)
    rows = []
    for r in range(runs):
        row = {}
        for k in np.flatnonzero(valid[r]):
            b = tuple(tokens[r, k, P:length[r, k]].tolist())
            assert b not in row, "duplicate candidate kept"
            row[b] = probs[r, k]
        rows.append(row)
    return rows


def bootstrap_threshold(samples, seed=0, q=0.999):
    """q-quantile of TV(mean of R runs resampled with replacement, mean of the R runs)."""
    rng = np.random.default_rng(seed)
    mean = samples.mean(0)
    boot = samples[rng.integers(0, len(samples), size=(4000, len(samples)))].mean(1)
    return float(np.quantile(0.5 * np.abs(boot - mean).sum(1), q))


def sps_config(block_len, **kw):
    # Token form: K = 4 = the whole vocabulary. Block form: 128 candidates at temperature 3
    # cover all 13 two-token blocks (checked), K = 16 keeps them all.
    kept = 4 if block_len == 1 else 16
    return SPSConfig(alpha=ALPHA, max_new_tokens=BUDGET, block_len=block_len, candidate_pool=128,
                     candidates_kept=kept, rollouts=256, rollout_horizon=BUDGET, jackknife=True,
                     candidate_temperature=3.0, eos_ids=(EOS,), **kw)


def tv_to_marginal(model, power_target, sps):
    marginal = block_marginal(power_target, sps.block_len)
    rows = first_block_probabilities(model, sps, RUNS)
    for row in rows:
        assert set(row) == set(marginal), "the candidate set must hold every possible block"
    blocks = sorted(marginal)
    samples = np.array([[row[b] for b in blocks] for row in rows], np.float64)
    exact = np.array([marginal[b] for b in blocks])
    return 0.5 * np.abs(samples.mean(0) - exact).sum(), bootstrap_threshold(samples)


@pytest.mark.parametrize("block_len", [2, 1], ids=["block", "token"])
def test_first_block_follows_the_exact_block_marginal(model, power_target, block_len):
    tv, threshold = tv_to_marginal(model, power_target, sps_config(block_len))
    assert tv < threshold, f"TV {tv:.5f} >= {threshold:.5f}"


CORRECT_ROLLOUT_WEIGHT = sps_mod.log_rollout_weight
WRONG_FUTURE = {
    "no_future_factor": lambda logp, alpha: 0.0 * logp,
    "rollouts_weighted_with_alpha": lambda logp, alpha: CORRECT_ROLLOUT_WEIGHT(logp, alpha + 1.0),
}


@pytest.mark.parametrize("wrong", sorted(WRONG_FUTURE))
def test_wrong_future_factor_fails(model, power_target, monkeypatch, wrong):
    monkeypatch.setattr(sps_mod, "log_rollout_weight", WRONG_FUTURE[wrong])
    jax.clear_caches()
    try:
        tv, threshold = tv_to_marginal(model, power_target, sps_config(2))
    finally:
        jax.clear_caches()
    assert tv > threshold, f"a wrong future factor ({wrong}) passed: TV {tv:.5f} < {threshold:.5f}"


def test_jackknife_bias_smaller_than_ratio(model, power_target):
    """Mean of p_jk and of p_hat over many independent sets of M = 4 rollouts per block,
    vs the exact block marginal; rollouts drawn from the exact next-token distribution."""
    cfg, params = model
    marginal = block_marginal(power_target, 2)
    blocks = sorted(marginal)
    P = len(PROMPT)
    log_p_block, next_logp = [], []
    for b in blocks:
        toks = jnp.asarray([PROMPT + list(b)], jnp.int32)
        lp = jax.nn.log_softmax(forward(params, cfg, toks, jnp.arange(toks.shape[1])[None]).logits[0], -1)
        log_p_block.append(sum(float(lp[P - 1 + i, t]) for i, t in enumerate(b)))
        next_logp.append(np.asarray(lp[-1], np.float64))
    runs, M, K = 200_000, 4, len(blocks)
    needs = np.array([b[-1] != EOS for b in blocks])  # every 2-token block leaves 1 token of budget
    rng = np.random.default_rng(0)
    log_rollout = np.zeros((runs, K, M), np.float32)
    for k in np.flatnonzero(needs):
        nxt = rng.choice(len(next_logp[k]), size=(runs, M), p=np.exp(next_logp[k]) / np.exp(next_logp[k]).sum())
        log_rollout[:, k] = (ALPHA - 1.0) * next_logp[k][nxt]
    probs, ratio, _ = block_probabilities(
        jnp.broadcast_to(jnp.asarray(log_p_block, jnp.float32), (runs, K)), jnp.asarray(log_rollout),
        jnp.broadcast_to(jnp.asarray(needs), (runs, K)), jnp.ones((runs, K), bool), ALPHA, jackknife=True)
    exact = np.array([marginal[b] for b in blocks])
    tv = lambda p: 0.5 * np.abs(np.asarray(p, np.float64).mean(0) - exact).sum()
    noise = 0.5 * (np.asarray(ratio, np.float64).std(0) / np.sqrt(runs)).sum()
    assert tv(ratio) > 10 * noise, "the plain ratio's bias must be measurable for the comparison to mean anything"
    assert tv(probs) < 0.35 * tv(ratio), (tv(probs), tv(ratio))
