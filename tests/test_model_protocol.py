"""The model protocol (`degs_jax.model_api`) with a second implementation: a tiny Flax
NNX model (tests/nnx_model.py) wrapped through nnx.split / nnx.merge runs power_mcmc
and degs_mcmc through `decode` unchanged, and the values the chains store equal a
direct full forward of the NNX module. Also: the NNX adapter honours the protocol's
contract (the samplers' bookkeeping relies on it).

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

from degs_jax.decoders import decode
from degs_jax.lens import collapse_depth
from nnx_model import tiny_nnx_model

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
