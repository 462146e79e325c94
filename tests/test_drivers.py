"""The two drivers give the same tokens for every method (issue 26): `decode` (the host
loop: generation chunks, MCMC blocks, SMC ESS intervals, SPS blocks, each a separately
compiled, donating step) and `decode_tokens` (the method's `advance` in one
`lax.while_loop`, traceable), for the same per-prompt keys, on the transformer and on the
Flax NNX model (degs_jax/examples/nnx_lm.py), `decode_tokens` under
`jax.jit(jax.vmap(...))` over a leading axis of two key sets (one compiled program per
case: compiling dominates the cost; test_traced.py also runs it under `jax.jit` alone).

Compared: every row's completion tokens and each prompt's chosen row, exactly (the same
draws in both programs); log p(x) and the mean final-layer entropy of every row to 1e-5
(sums or means of <= 8 fp32 terms computed in different programs: a few ulps of values
~10, as in test_traced.py).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from degs_jax.decoders import decode, decode_tokens
from degs_jax.examples.nnx_lm import tiny_nnx_model
from degs_jax.generation import pad_prompts
from degs_jax.methods import METHODS, hyperparameters_for, method_classes
from degs_jax.method import SMALLEST_RUN_TOKENS
from degs_jax.models import TransformerLM, init_params
from tiny_models import tiny_config

# Each method at its own smallest run (`Method.smallest_run`: a new method needs no entry here).
SIZES = {m: dict(method_classes()[m].smallest_run) for m in METHODS}
CASES = {**{m: (m, SIZES[m]) for m in METHODS},
         "scalable_power token form": ("scalable_power", dict(SIZES["scalable_power"], block_len=1))}
PROMPTS = [[3, 1, 4, 1, 5], [9, 2]]


def transformer():
    cfg = tiny_config("Qwen2ForCausalLM")  # vocab 97, 3 layers, EOS = 96
    params = init_params(cfg, jax.random.key(0), jnp.float32, scale=0.3)
    eos = cfg.eos_token_ids[0]  # EOS likely enough that some rows end early
    params = dataclasses.replace(params, embed=params.embed.at[:, 0].add(3.0),
                                 lm_head=params.lm_head.at[eos].set(0.0).at[eos, 0].set(2.0))
    return TransformerLM(cfg), params, tuple(cfg.eos_token_ids)


def nnx_model():
    model, params = tiny_nnx_model()
    return model, params, (model.vocab_size - 1,)


MODELS = {"transformer": transformer, "nnx": nnx_model}
# One method of each kernel family on the NNX model (the DEGS variant, which runs every
# code path of its power sibling plus the depth term; degs_rerank, whose answer rule reads
# log p and D of the pool) and the SPS token form; on the transformer the SMC and SPS cases,
# which only this test runs through both drivers there. The siblings left out differ from
# these only by beta = 0 or by the pool's answer rule: test_traced.py runs a pool and an
# MCMC method under jit and vmap, and the golden file pins both drivers' numbers of greedy,
# best_of_n and degs_mcmc. Compiling dominates: on a loaded 2-core CPU a case took 10-93 s,
# all 15 cases of the full matrix 747 s, over the suite's budget.
FAMILIES = ("temperature", "degs_rerank", "degs_mcmc", "degs_smc", "scalable_power",
            "scalable_power token form")
PAIRS = [("nnx", case) for case in FAMILIES] + [
    ("transformer", case) for case in ("degs_smc", "scalable_power")]


@functools.cache
def model_named(name):
    return MODELS[name]()


def through_decode(model, params, eos, config, keys):
    """(tokens of every row, chosen row of every prompt, log p and mean final-layer entropy
    of every row) of `decode`."""
    res = decode(model, params, PROMPTS, config, keys=keys, eos_ids=eos)
    rows = [c for o in res.outputs for c in o.candidates]
    chosen = [next(j for j, c in enumerate(o.candidates) if c is o.chosen) for o in res.outputs]
    return [c.tokens for c in rows], chosen, np.array([[c.log_p, c.final_entropy] for c in rows])


def of_decoded(decoded, g=None):
    """The same of a `Decoded` (instance g of a vmapped one)."""
    pick = (lambda a: a) if g is None else (lambda a: a[g])
    tokens, start, end, chosen, log_p, entropy = jax.device_get(
        (pick(decoded.state.tokens), pick(decoded.state.prompt_len), pick(decoded.state.length),
         pick(decoded.chosen), pick(decoded.log_p), pick(decoded.final_entropy)))
    return ([tokens[r, start[r]:end[r]].tolist() for r in range(tokens.shape[0])], chosen.tolist(),
            np.stack([log_p, entropy], axis=1))


def test_every_method_has_a_smallest_run_of_the_shared_budget():
    """The tables of test shapes come from the methods: each library method names its
    smallest run, of SMALLEST_RUN_TOKENS new tokens (one prefill buffer for all of them)."""
    for method in METHODS:
        cls = method_classes()[method]
        assert cls.smallest_run, f"{method} has no smallest_run: the tests would run it at its defaults"
        assert cls(**cls.smallest_run).max_new_tokens == SMALLEST_RUN_TOKENS, method


@pytest.mark.parametrize("model_name, case", PAIRS)
def test_both_drivers_give_the_same_tokens(model_name, case):
    lm, params, eos = model_named(model_name)
    method, sizes = CASES[case]
    config = hyperparameters_for(method, **sizes)
    tokens, lengths = pad_prompts(PROMPTS)
    key_sets = jax.random.split(jax.random.key(7), (2, len(PROMPTS)))
    run = lambda k: decode_tokens(lm, params, jnp.asarray(tokens), jnp.asarray(lengths), k, config, eos)
    mapped = jax.jit(jax.vmap(run))(key_sets)
    wants = [through_decode(lm, params, eos, config, k) for k in key_sets]
    for g, want in enumerate(wants):
        got = of_decoded(mapped, g)
        assert got[0] == want[0], "tokens differ"
        assert got[1] == want[1], "chosen rows differ"
        np.testing.assert_allclose(got[2], want[2], atol=1e-5, rtol=0)
    if method != "greedy":
        assert wants[0][0] != wants[1][0], "both key sets gave the same tokens: the comparison is weak"


def test_decode_reports_the_smc_carry():
    """What `decode` reports of an SMC run (each candidate's weight; per prompt the
    resamplings and copied rows; the copied-rows counter) is read off the final carry of
    the kernel, row for row and prompt for prompt: recomputed here from `run_kernel`'s
    carry (weights = softmax of each prompt's log weights, in numpy)."""
    from degs_jax.decoders import row_keys, run_kernel
    from degs_jax.generation import prefill
    from degs_jax.rows import repeat_rows

    lm, params, eos = model_named("transformer")
    config = hyperparameters_for("degs_smc", **dict(SIZES["degs_smc"], max_new_tokens=12, ess_threshold=0.9))
    n = config.pool_size
    keys = jax.random.split(jax.random.key(5), len(PROMPTS))  # both prompts resample
    tokens, lengths = pad_prompts(PROMPTS)
    state = repeat_rows(prefill(lm, params, jnp.asarray(tokens), jnp.asarray(lengths),
                                tokens.shape[1] + config.max_new_tokens, jnp.float32), n)
    carry = jax.device_get(run_kernel(lm, params, state, row_keys(keys, n), config, config.plan(lm, eos)))
    log_w = np.asarray(carry.log_weight, np.float64).reshape(-1, n)
    weights = np.exp(log_w - log_w.max(axis=1, keepdims=True))
    weights /= weights.sum(axis=1, keepdims=True)
    copied = np.asarray(carry.copied_rows)
    assert np.ptp(weights, axis=1).max() > 0.1, "equal weights in every prompt: the check is weak"
    assert (copied > 0).all() and len(set(copied.tolist())) > 1, "each prompt must copy rows, unequally"

    res = decode(lm, params, PROMPTS, config, keys=keys, eos_ids=eos)
    got = np.array([[c.weight for c in o.candidates] for o in res.outputs])
    np.testing.assert_allclose(got, weights, atol=1e-6, rtol=0)  # fp32 softmax of the same values
    assert [o.diagnostics["copied_rows"] for o in res.outputs] == copied.tolist()
    assert [o.diagnostics["resamples"] for o in res.outputs] == np.asarray(carry.resamples).tolist()
    assert res.counters["copied_rows"] == int(copied.sum())
