"""The model protocol (`degs_jax.model_api`) with a second implementation: a tiny Flax
NNX model (degs_jax/examples/nnx_lm.py) wrapped through nnx.split / nnx.merge runs power_mcmc
and degs_mcmc through `decode` unchanged, and the values the chains store equal a
direct full forward of the NNX module. Also: the NNX adapter honours the protocol's
contract (the samplers' bookkeeping relies on it), and the text-level tools (`degs eval`'s
`run_eval`, the L_sub sweep, the study's layer statistics) take it as a `LanguageModel`.

Tolerances: fp32 throughout; the cached one-token steps and a full forward differ by
summation order, i.e. a few ulps of logits of size ~1 (1e-5); log p(x) sums <= 8 such
values (1e-4); D(x) is a mean of integers d_t / L that must agree exactly (1e-6).
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from degs_jax.analysis import lsub_sweep
from degs_jax.decoders import decode
from degs_jax.eval import load_benchmark
from degs_jax.eval.results import read_records, read_run_file
from degs_jax.eval.prompts import problem_prompt_ids
from degs_jax.eval.runner import problem_key, run_eval
from degs_jax.examples.byte_tokenizer import byte_tokenizer
from degs_jax.lens import collapse_depth, default_lsub
from degs_jax.model_api import LanguageModel
from degs_jax.models import with_tuned_lens
from degs_jax.reproduce.study import sequence_layer_statistics
from degs_jax.examples.nnx_lm import tiny_nnx_model

LM, PARAMS = tiny_nnx_model()
EOS = LM.vocab_size - 1
LSUB = (1, 2, 3)
PROMPTS = [[3, 1, 4, 1, 5], [9, 2]]


def direct(seq, lens_layers=()):
    """log-softmax [T, V] and lens entropies [K, T] of one full forward of the NNX module."""
    module = nnx.merge(LM.graphdef, PARAMS)
    T = len(seq)
    logits, _, entropy = module(jnp.asarray([seq], jnp.int32), jnp.arange(T, dtype=jnp.int32)[None],
                                LM.init_cache(1, T, jnp.float32), lens_layers)
    return (np.asarray(jax.nn.log_softmax(logits[0], -1)),
            None if entropy is None else np.asarray(entropy[:, 0]))


def pick_tau():
    """The median lens entropy of a random sequence: d_t then takes several values."""
    seq = np.random.default_rng(0).integers(0, EOS, 40).tolist()
    return float(np.median(direct(seq, LSUB)[1]))


TAU = pick_tau()


def test_nnx_step_honours_the_contract():
    seq = np.random.default_rng(1).integers(0, LM.vocab_size, 10)
    S = 16
    tokens = jnp.asarray(seq[None], jnp.int32)
    full = LM.step(PARAMS, tokens, jnp.arange(10, dtype=jnp.int32)[None], LM.init_cache(1, S, jnp.float32))
    # One token at a time through the cache: the same logits (slots are positions).
    cache = LM.init_cache(1, S, jnp.float32)
    for t in range(10):
        out = LM.step(PARAMS, tokens[:, t:t + 1], jnp.full((1, 1), t, jnp.int32), cache)
        cache = out.cache
        np.testing.assert_allclose(out.logits[0, 0], full.logits[0, t], atol=1e-5, rtol=0)
    # Stale slots are never read: regenerate slots 5.. over another suffix.
    other = jnp.asarray(np.r_[seq[:5], (seq[5:] + 1) % LM.vocab_size][None], jnp.int32)
    stale = LM.step(PARAMS, other, jnp.arange(10, dtype=jnp.int32)[None], LM.init_cache(1, S, jnp.float32))
    again = LM.step(PARAMS, tokens[:, 5:], jnp.arange(5, 10, dtype=jnp.int32)[None], stale.cache)
    np.testing.assert_allclose(again.logits[0], full.logits[0, 5:], atol=1e-5, rtol=0)
    # A position past the cache writes nothing.
    parked = LM.step(PARAMS, tokens[:, :1], jnp.full((1, 1), S, jnp.int32), full.cache)
    chex.assert_trees_all_equal(parked.cache, full.cache)
    # Lens entropies: [K, B, T], the last layer's equals the output distribution's.
    lensed = LM.step(PARAMS, tokens, jnp.arange(10, dtype=jnp.int32)[None],
                     LM.init_cache(1, S, jnp.float32), (1, LM.num_layers))
    chex.assert_shape(lensed.layer_entropy, (2, 1, 10))
    logp = jax.nn.log_softmax(lensed.logits, -1)
    np.testing.assert_allclose(lensed.layer_entropy[1], -jnp.sum(jnp.exp(logp) * logp, -1), atol=1e-5)


@pytest.mark.parametrize("method", ["power_mcmc", "degs_mcmc"])
def test_mcmc_methods_run_on_an_nnx_model(method):
    res = decode(LM, PARAMS, PROMPTS, method, jax.random.key(3), eos_ids=(EOS,), block_len=4,
                 num_blocks=2, mh_steps=3, n_chains=3, lsub=LSUB, tau=TAU)
    again = decode(LM, PARAMS, PROMPTS, method, jax.random.key(3), eos_ids=(EOS,), block_len=4,
                   num_blocks=2, mh_steps=3, n_chains=3, lsub=LSUB, tau=TAU)
    assert [c.tokens for o in res.outputs for c in o.candidates] == \
        [c.tokens for o in again.outputs for c in o.candidates]
    L = LM.num_layers
    depths, accepted = set(), 0
    for prompt, out in zip(PROMPTS, res.outputs):
        for c in out.candidates:
            assert 1 <= len(c.tokens) <= 8 and EOS not in c.tokens[:-1]
            assert c.ended == (c.tokens[-1] == EOS) and (c.ended or len(c.tokens) == 8)
            seq = prompt + c.tokens
            logp, entropy = direct(seq, LSUB)
            P, n = len(prompt), len(c.tokens)
            t = np.arange(P, P + n)
            assert abs(c.log_p - logp[t - 1, np.asarray(seq)[t]].sum()) < 1e-4
            scored = np.arange(P, P + n - int(c.ended))
            h_final = -(np.exp(logp) * logp).sum(-1)
            want_fe = h_final[scored].mean() if len(scored) else 0.0
            assert abs(c.final_entropy - want_fe) < 1e-4
            if method == "degs_mcmc":
                d = np.asarray(collapse_depth(entropy[:, scored], LSUB, L, TAU))
                assert abs(c.depth - (d.mean() / L if len(scored) else 0.0)) < 1e-6
                depths |= set(d.tolist())
            else:
                assert c.depth is None
            accepted += sum(a > 0 for a in c.acceptance)
    assert accepted, "no MH step accepted: the chains did not move"
    if method == "degs_mcmc":
        assert len(depths) > 1, f"tau {TAU} gives a constant d_t: the D(x) check would be vacuous"


def test_the_text_tools_take_any_causal_lm(tmp_path):
    """`run_eval` (the Python side of `degs eval`) decodes with the NNX model exactly what
    `decode` gives for the problems' keys and records it as that model's run; the L_sub
    sweep's and the study's teacher-forced D(x) equal the recorded ones (exact: means of
    integers). A tuned lens, which translates this package's transformer's residuals, is
    refused for it."""
    tokenizer = byte_tokenizer()
    lm, params = tiny_nnx_model(vocab=len(tokenizer), dim=16, layers=3, heads=2, max_context=256)
    model = LanguageModel(lm=lm, params=params, tokenizer=tokenizer, name="tiny-nnx",
                          eos_ids=(tokenizer.eos_token_id,), source="tests")
    # tau at the median lens entropy of a byte string: d_t takes several values
    module = nnx.merge(lm.graphdef, params)
    seq = jnp.asarray([list(b"What is 7 times 8? The answer is 56.")], jnp.int32)
    _, _, entropy = module(seq, jnp.arange(seq.shape[1])[None], lm.init_cache(1, seq.shape[1], jnp.float32), LSUB)
    tau = float(np.median(entropy))
    hp = dict(n=2, max_new_tokens=6, tau=tau)
    run = tmp_path / "run"
    run_eval(model, run, benchmark="deepmind500", method="best_of_n", hyperparameters=hp, limit=2,
             batch_size=2, keep_candidates=True, progress=False, print_table=False)
    config = read_run_file(run / "run.json")["config"]["model"]
    assert config == {"name": "tiny-nnx", "architecture": "NNXCausalLM", "num_layers": 3, "dtype": "float32"}
    records = read_records(run / "results.jsonl")
    problems = load_benchmark("deepmind500")[:2]
    prompts = [problem_prompt_ids(p, tokenizer, chat=True) for p in problems]
    direct = decode(lm, params, prompts, "best_of_n", keys=jnp.stack([problem_key(0, i) for i in range(2)]),
                    eos_ids=(tokenizer.eos_token_id,), **hp)
    for record, out in zip(records, direct.outputs):
        assert [c["tokens"] for c in record["candidates"]] == [c.tokens for c in out.candidates]
        assert [c["log_p"] for c in record["candidates"]] == [c.log_p for c in out.candidates]
    recorded_d = [c["D"] for r in records for c in r["candidates"]]
    assert len(set(recorded_d)) > 1, "constant D(x): the comparisons below would be vacuous"

    sweep = lsub_sweep(model, run, [default_lsub(3)], batch_size=4, quiet=True)
    assert abs(sweep["rows"][0]["mean_D"] - np.mean(recorded_d)) < 1e-6
    sequences = [(prompt, c["tokens"], c["ended"]) for prompt, r in zip(prompts, records) for c in r["candidates"]]
    stats = sequence_layer_statistics(lm, params, sequences, lsub_sets=[default_lsub(3)], tau=tau)
    assert [s["D"][0] for s in stats] == pytest.approx(recorded_d, abs=1e-6)
    assert all(len(s["entropy"]) == 4 for s in stats if s["n_scored"])

    with pytest.raises(ValueError, match="tuned lens reads this package's transformer"):
        with_tuned_lens(lm, params, object())
