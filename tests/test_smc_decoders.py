"""power_smc, degs_smc and scalable_power as decoders (tiny random fp32 models, CPU):
per-token statistics after many resamplings equal a fresh teacher-forced pass, same key
gives the same output bit for bit, a prompt decodes the same alone and in a batch, and
bad hyperparameters are one clear error. Well-formedness and counters of the decoders'
outputs (scores re-derived by teacher-forced scoring) are in test_decoders.py; exactness
in test_smc_exactness.py and test_sps.py.

Tolerances: per-token log p / log q / H_L from the cached decode step and from the
teacher-forced pass differ by fp32 summation order only (a few ulps of values ~1-10),
hence 1e-4; d_t are integers and must agree exactly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from degs_jax import rows as rows_mod
from degs_jax.cli import build_parser
from degs_jax.cli.options import _hyperparameters
from degs_jax.decoders import decode
from degs_jax.generation import pad_prompts, prefill
from degs_jax.methods import DegsSMC, PowerSMC, ScalablePower, hyperparameters_for, resolve_hyperparameters
from degs_jax.models import TransformerLM
from degs_jax.models import forward
from degs_jax.rows import repeat_rows
from degs_jax.scoring import token_stats
from degs_jax.smc import SMCConfig, run_smc
from degs_jax.sps import SPSConfig
from test_decoders import HP, LENS, PROMPTS, PROMPTS6, eos_model, model  # noqa: F401

NEW_METHODS = ("power_smc", "degs_smc", "scalable_power")


def run(model, method, prompts=PROMPTS, **kw):
    cfg, params = model
    return decode(TransformerLM(cfg), params, prompts, method, eos_ids=cfg.eos_token_ids, **{**HP[method], **kw})


def summary(result):
    return [(c.tokens, c.log_p, c.depth, c.final_entropy, c.weight) for o in result.outputs for c in o.candidates] + [
        ([o.candidates.index(o.chosen)], o.diagnostics) for o in result.outputs]


# ------------------------------------------------------------------ stored statistics after resampling


def teacher_forced(model, tokens, length, alpha):
    """Per-slot log p, d_t and H_L of one sequence from the package's teacher-forced pass
    (`scoring.token_stats`), and log q (untruncated proposal at temperature 1/alpha) from an
    uncached forward; slot t holds the value of token t (log p, log q) or of the residual
    at t (d_t, H_L)."""
    cfg, params = model
    toks = jnp.asarray(tokens[None, :length])
    stats = jax.device_get(token_stats(TransformerLM(cfg), params, toks, LENS))
    lp_all = jax.nn.log_softmax(forward(params, cfg, toks, jnp.arange(length)[None]).logits[0], -1)
    lq_next = jnp.take_along_axis(jax.nn.log_softmax(alpha * lp_all[:-1], -1), toks[0, 1:, None], 1)[:, 0]
    logq = np.concatenate([[0.0], np.asarray(lq_next)])
    return stats.logp[0], logq, stats.depth[0], stats.final_entropy[0]


def _cache_not_copied(cache, source, copy, axis):
    return cache


@pytest.mark.parametrize("cache_copy", ["correct", "cache_not_copied"])
def test_resampled_particles_keep_the_models_statistics(model, monkeypatch, cache_copy):
    """DEGS-SMC with resampling at almost every token (ESS threshold 1): every particle's
    stored log p, log q, d_t and H_L equal a fresh teacher-forced pass of its final tokens.
    A copy that moves the statistics but not the KV cache rows must break this (the
    continuation would attend to another particle's keys)."""
    cfg, params = model
    lm = TransformerLM(cfg)
    if cache_copy == "cache_not_copied":
        monkeypatch.setattr(rows_mod, "copy_cache_rows", _cache_not_copied)
        jax.clear_caches()
    smc = SMCConfig(alpha=1.5, beta=5.0, n_particles=6, max_new_tokens=8, ramp_tokens=3, ess_threshold=1.0,
                    resample_every=1, lens=LENS, eos_ids=())
    try:
        toks, lens = pad_prompts(PROMPTS)
        gen = repeat_rows(prefill(lm, params, jnp.asarray(toks), jnp.asarray(lens), toks.shape[1] + 8,
                                  jnp.float32), smc.n_particles)
        state = run_smc(lm, params, gen, jax.random.split(jax.random.key(3), gen.length.shape[0]), smc)
    finally:
        if cache_copy == "cache_not_copied":
            jax.clear_caches()
    assert int(state.copied_rows.sum()) >= 4, "resampling must copy rows, or this test checks nothing"
    g = jax.device_get(state.gen)
    worst = 0.0
    for r in range(g.tokens.shape[0]):
        P, n = int(g.prompt_len[r]), int(g.length[r])
        assert n == P + 8
        logp, logq, depth, h_final = teacher_forced(model, g.tokens[r], n, smc.alpha)
        span = slice(P, n)
        worst = max(worst, np.abs(g.logp[r, span] - logp[span]).max(), np.abs(g.logq[r, span] - logq[span]).max(),
                    np.abs(g.final_entropy[r, span] - h_final[span]).max(),
                    float(np.any(g.depth[r, span] != depth[span])))
    if cache_copy == "correct":
        assert worst < 1e-4, worst
    else:
        assert worst > 1e-2, "stale cache rows went unnoticed"


# ------------------------------------------------------------------ keys and batching


@pytest.mark.parametrize("method", NEW_METHODS)
def test_same_key_bitwise_different_key_differs(eos_model, method):
    # PROMPTS6: the shapes of test_prompt_alone_equals_batch's batch (one compilation).
    first = run(eos_model, method, PROMPTS6, key=jax.random.key(0))
    again = run(eos_model, method, PROMPTS6, key=jax.random.key(0))
    other = run(eos_model, method, PROMPTS6, key=jax.random.key(1))
    assert summary(first) == summary(again), "same key, different output"
    assert first.counters == again.counters
    assert summary(first) != summary(other), "different keys, identical output"


@pytest.mark.parametrize("method", NEW_METHODS)
def test_prompt_alone_equals_batch(eos_model, method):
    """Per-prompt keys: six prompts of six lengths in one batch = each prompt alone."""
    keys = jax.random.split(jax.random.key(7), len(PROMPTS6))
    batch = run(eos_model, method, PROMPTS6, keys=keys)
    resampled = 0
    for i, p in enumerate(PROMPTS6):
        alone = run(eos_model, method, [p], keys=keys[i:i + 1])
        a, b = alone.outputs[0], batch.outputs[i]
        assert [c.tokens for c in a.candidates] == [c.tokens for c in b.candidates], i
        assert a.candidates.index(a.chosen) == b.candidates.index(b.chosen), i
        for ca, cb in zip(a.candidates, b.candidates):
            assert abs(ca.log_p - cb.log_p) < 1e-5
            assert (ca.weight is None) == (cb.weight is None)
            if ca.weight is not None:
                assert abs(ca.weight - cb.weight) < 1e-5
        if method != "scalable_power":
            assert abs(a.diagnostics["log_evidence"] - b.diagnostics["log_evidence"]) < 1e-4
            assert a.diagnostics["resamples"] == b.diagnostics["resamples"]
            resampled += a.diagnostics["resamples"]
        else:
            assert a.diagnostics == b.diagnostics
    assert method == "scalable_power" or resampled > 0, "no resampling: the comparison misses it"


# ------------------------------------------------------------------ errors


@pytest.mark.parametrize("kwargs,match", [
    (dict(n_particles=0), "n_particles must be a positive integer"),
    (dict(ess_threshold=1.5), "ess_threshold must be in"),
    (dict(ramp_tokens=-1), "ramp_tokens must be an integer >= 0"),
    (dict(resample_every=0), "resample_every must be a positive integer"),
    (dict(alpha=0.5), "alpha must be >= 1"),
    (dict(beta=1.0), "beta > 0 needs a LensConfig"),
])
def test_smc_config_validation(kwargs, match):
    base = dict(alpha=4.0, beta=0.0, n_particles=4, max_new_tokens=8, ramp_tokens=4, ess_threshold=0.5,
                resample_every=2)
    with pytest.raises(ValueError, match=match):
        SMCConfig(**{**base, **kwargs})


@pytest.mark.parametrize("kwargs,match", [
    (dict(candidates_kept=40), "candidates_kept .* cannot exceed candidate_pool"),
    (dict(rollouts=0), "rollouts must be a positive integer"),
    (dict(candidate_temperature=0.0), "candidate_temperature must be > 0"),
])
def test_sps_config_validation(kwargs, match):
    base = dict(alpha=4.0, max_new_tokens=64, block_len=16, candidate_pool=32, candidates_kept=8, rollouts=8,
                rollout_horizon=16, jackknife=True, candidate_temperature=1.0)
    with pytest.raises(ValueError, match=match):
        SPSConfig(**{**base, **kwargs})


@pytest.mark.parametrize("method,kwargs,match", [
    ("power_smc", dict(beta=1.0), "power_smc is the beta = 0 sampler"),
    ("scalable_power", dict(top_k=5), "scalable_power does not truncate"),
    ("degs_smc", dict(n=3), "degs_smc does not take n;"),
    ("degs_smc", dict(n_particles=0), "n_particles must be a positive integer"),
    ("degs_smc", dict(beta=-1.0), "beta must be >= 0"),
    ("scalable_power", dict(rollouts=0), "rollouts must be a positive integer"),
])
def test_decode_rejects_bad_hyperparameters(method, kwargs, match):
    with pytest.raises(ValueError, match=match):
        resolve_hyperparameters(method, kwargs)


def test_cli_passes_the_new_hyperparameters():
    args = build_parser().parse_args(
        ["sample", "hi", "--method", "degs_smc", "--n-particles", "8", "--ramp-tokens", "0", "--ess-threshold",
         "0.3", "--resample-every", "16"])
    hp = resolve_hyperparameters(args.method, _hyperparameters(args))
    assert (hp["n_particles"], hp["ramp_tokens"], hp["ess_threshold"], hp["resample_every"]) == (8, 0, 0.3, 16)
    args = build_parser().parse_args(
        ["sample", "hi", "--method", "scalable_power", "--block-len", "1", "--candidates-kept", "4", "--rollouts",
         "2", "--rollout-horizon", "32", "--no-jackknife", "--candidate-temperature", "0.5", "--candidate-pool", "9"])
    hp = resolve_hyperparameters(args.method, _hyperparameters(args))
    assert (hp["block_len"], hp["candidates_kept"], hp["rollouts"], hp["rollout_horizon"], hp["jackknife"],
            hp["candidate_temperature"], hp["candidate_pool"]) == (1, 4, 2, 32, False, 0.5, 9)
    # Both candidate temperatures of docs/design.md §4 (the default 1, the public ports' 1/alpha)
    # reach the kernel's candidate sampler.
    for flags, temperature in (([], 1.0), (["--candidate-temperature", "1"], 1.0),
                               (["--candidate-temperature", "0.25"], 0.25)):
        args = build_parser().parse_args(["sample", "hi", "--method", "scalable_power", *flags])
        config = hyperparameters_for("scalable_power", **_hyperparameters(args))
        assert config.kernel_config(0, ()).candidate_spec.proposal.temperature == temperature


def test_defaults_one_home():
    """The SMC / SPS defaults (sources in SMCConfig's and SPSConfig's docstrings) live in
    degs_jax.methods and reach the kernels unchanged."""
    for cls, beta in ((PowerSMC, 0.0), (DegsSMC, 5.0)):
        config = cls()
        assert (config.alpha, config.beta, config.n_particles, config.max_new_tokens, config.ramp_tokens,
                config.ess_threshold, config.resample_every) == (4.0, beta, 16, 3072, 400, 0.5, 64)
        kernel = config.kernel_config(24, (7,))
        assert (kernel.n_particles, kernel.ramp_tokens, kernel.resample_every, kernel.eos_ids) == (16, 400, 64, (7,))
        assert (kernel.lens is not None) == (beta > 0)
    sps = ScalablePower().kernel_config(0, ())
    assert (sps.alpha, sps.max_new_tokens, sps.block_len, sps.candidate_pool, sps.candidates_kept, sps.rollouts,
            sps.rollout_horizon, sps.jackknife, sps.candidate_temperature) == (4.0, 3072, 192, 32, 8, 8, 192, True,
                                                                               1.0)
