"""Numeric hyperparameters are data of the compiled program (`degs_jax.traced_fields`), on a
tiny random fp32 model, CPU:

- a sweep over a method's numbers (alpha, beta, tau, a temperature, top-p / min-p /
  typical-p; every family) traces no
  program after its first value, while a shape-setting field does trace anew (so the
  count can fail);
- `jax.vmap` of `decode_tokens` over beta gives, per beta, the tokens, acceptances and
  depth-decided counts of `decode` at that beta (the host driver, another program), and
  its beta = 0 member is the power-MCMC chain of the same keys;
- a concrete zero stays static (beta = 0: no probing; temperature 0: greedy), and the
  checks of a traced field still refuse a bad concrete value, elementwise in an array.

Tolerance: log p sums of <= 6 fp32 terms in two programs, 1e-5 (as in test_traced.py);
tokens and counts exactly.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from degs_jax.decoders import decode, decode_tokens
from degs_jax.generation import Proposal, TopK, TopP, pad_prompts
from degs_jax.methods import DegsMCMC, DegsRerank, DegsSMC, PowerMCMC, ScalablePower, Temperature
from degs_jax.mcmc import MCMCConfig
from degs_jax.models import TransformerLM, init_params
from tiny_models import tiny_config

CFG = tiny_config("Qwen2ForCausalLM")  # vocab 97, 3 layers, EOS = 96
LM = TransformerLM(CFG)
EOS = CFG.eos_token_ids
TAU = 3.3  # in the bulk of this model's lens entropies: d_t varies (test_generation.py)
PROMPTS = [[3, 14, 15], [35, 89, 79, 32, 38, 46, 26]]
CHAIN = dict(block_len=3, num_blocks=2, mh_steps=2, n_chains=2, tau=TAU)
BETAS = (0.0, 2.0, 40.0)  # 40: large enough that beta·ΔD decides some MH decisions


@pytest.fixture(scope="module")
def params():
    params = init_params(CFG, jax.random.key(0), jnp.float32, scale=0.3)
    eos = EOS[0]  # EOS likely enough that some chains end early
    return dataclasses.replace(params, embed=params.embed.at[:, 0].add(3.0),
                               lm_head=params.lm_head.at[eos].set(0.0).at[eos, 0].set(2.0))


@pytest.fixture
def traces():
    """A list that gains an entry each time JAX traces a function for a new program, from
    empty caches (another test may have traced the same programs in this process)."""
    jax.clear_caches()
    seen = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/jaxpr_trace_duration":
            seen.append(event)
    jax.monitoring.register_event_duration_secs_listener(listener)
    yield seen
    jax.monitoring.unregister_event_duration_listener(listener)


def run(params, method, seed=0):
    return decode(LM, params, PROMPTS, method, keys=jax.random.split(jax.random.key(seed), len(PROMPTS)),
                  eos_ids=EOS)


SPS = dict(max_new_tokens=4, block_len=2, candidate_pool=3, candidates_kept=2, rollouts=2, rollout_horizon=2)


@pytest.mark.parametrize("sweep, reshaped", [
    ([DegsMCMC(beta=b, **{**CHAIN, "tau": t}) for b, t in ((1.0, TAU), (3.0, 2.0), (7.5, 5.0))],
     {"mh_steps": 3}),
    ([PowerMCMC(alpha=a, **CHAIN) for a in (2.0, 4.0, 6.0)], {"num_blocks": 3}),
    ([DegsSMC(beta=b, alpha=a, n_particles=3, max_new_tokens=6, resample_every=2, tau=TAU)
      for a, b in ((4.0, 1.0), (2.0, 5.0))], {"n_particles": 2}),
    ([Temperature(temperature=t, max_new_tokens=5, tau=TAU) for t in (0.7, 1.3)], {"max_new_tokens": 4}),
    ([DegsMCMC(top_p=p, min_p=m, typical_p=q, **CHAIN) for p, m, q in ((0.9, 0.05, 0.95), (0.7, 0.2, 0.8))],
     {"top_k": 5}),
    ([DegsRerank(alpha=a, beta=b, n=2, max_new_tokens=4, tau=TAU) for a, b in ((1.0, 1.0), (0.5, 8.0))], {"n": 3}),
    ([ScalablePower(alpha=a, candidate_temperature=t, **SPS) for a, t in ((4.0, 1.0), (2.0, 0.5))],
     {"rollouts": 3}),
], ids=["degs_mcmc beta tau", "power_mcmc alpha", "degs_smc alpha beta", "temperature",
        "degs_mcmc top-p min-p typical", "degs_rerank alpha beta", "scalable_power alpha temperature"])
def test_a_sweep_traces_its_programs_once(params, traces, sweep, reshaped):
    run(params, sweep[0])
    first = len(traces)
    assert first > 0, "the first value traced nothing: the count below would be vacuous"
    for method in sweep[1:]:
        run(params, method)
    assert len(traces) == first, f"{len(traces) - first} programs traced again for new values"
    # A shape-setting field is part of the program: it traces again.
    run(params, dataclasses.replace(sweep[0], **reshaped))
    assert len(traces) > first


def test_vmap_over_beta_equals_decode_at_each_beta(params):
    tokens, lengths = pad_prompts(PROMPTS)
    keys = jax.random.split(jax.random.key(3), len(PROMPTS))
    sweep = jax.jit(jax.vmap(lambda beta: decode_tokens(LM, params, jnp.asarray(tokens), jnp.asarray(lengths), keys,
                                                         DegsMCMC(beta=beta, **CHAIN), EOS)))
    swept = sweep(jnp.asarray(BETAS, jnp.float32))
    decided = 0
    for g, beta in enumerate(BETAS):
        method = DegsMCMC(beta=beta, **CHAIN) if beta else PowerMCMC(**CHAIN)
        want = decode(LM, params, PROMPTS, method, keys=keys, eos_ids=EOS)
        cands = [c for o in want.outputs for c in o.candidates]
        state = jax.tree.map(lambda a: a[g], swept.state)
        got_tokens, start, end = jax.device_get((state.tokens, state.prompt_len, state.length))
        assert [got_tokens[r, start[r]:end[r]].tolist() for r in range(len(cands))] == [c.tokens for c in cands], \
            f"beta {beta}: tokens differ"
        ran = np.asarray(swept.ran[g])
        per_block = lambda counts: [[int(c) for c, k in zip(row, ran_row) if k]
                                    for row, ran_row in zip(np.asarray(counts), ran)]
        accepted = per_block(swept.accepted[g])
        assert accepted == [[round(a * CHAIN["mh_steps"]) for a in c.acceptance] for c in cands], \
            f"beta {beta}: acceptance differs"
        flips = per_block(swept.depth_decided[g])
        if beta:
            assert flips == [c.depth_decisions for c in cands], f"beta {beta}: depth-decided counts differ"
            decided += sum(map(sum, flips))
        else:  # the power chain: the depth term never decides
            assert not any(map(any, flips))
        np.testing.assert_allclose(np.asarray(swept.log_p[g]), [c.log_p for c in cands], atol=1e-5, rtol=0)
    assert decided > 0, "beta·ΔD decided nothing: the sweep's chains would all be the power chain"


def test_a_concrete_zero_stays_static():
    leaves = lambda x: jax.tree_util.tree_leaves(x)
    assert leaves(PowerMCMC()) == [0.25, 4.0]  # tau, alpha: beta = 0 is the program without D(x)
    assert leaves(DegsMCMC(alpha=3, beta=2)) == [0.25, 3.0, 2.0]  # an int alpha is the float's program
    assert not DegsMCMC(beta=0.0).probed and DegsMCMC(beta=0.0).kernel_config(3, ()).lens is None
    assert Temperature(temperature=0.0).kernel_config(3, ()).proposal.greedy
    assert leaves(Proposal(0.0)) == [] and leaves(Proposal(0.5)) == [0.5]
    # a cut at its "off" value is no cut (static); any other value is data
    assert leaves(Temperature(top_p=1.0, min_p=0.0, typical_p=1.0)) == [0.25, 0.25]  # tau, temperature
    assert leaves(Temperature(top_p=0.9, typical_p=0.5)) == [0.25, 0.9, 0.5, 0.25]
    assert leaves(Proposal(1.0, (TopK(3), TopP(0.9)))) == [1.0, 0.9]  # top-k's count is part of the program
    config = MCMCConfig(alpha=4.0, beta=jnp.float32(1.0), block_len=2, num_blocks=1, mh_steps=1,
                        lens=DegsMCMC(tau=TAU).lens_config(3))
    rebuilt = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(config), leaves(config))
    assert rebuilt == config


@pytest.mark.parametrize("build, message", [
    (lambda: DegsMCMC(beta=np.array([1.0, -1.0])), "beta must be >= 0"),
    (lambda: DegsMCMC(alpha=np.array([0.5, 4.0])), "alpha must be >= 1"),
    (lambda: Temperature(temperature=-0.1), "temperature must be >= 0"),
    (lambda: PowerMCMC(beta=1.0), "power_mcmc is the beta = 0 chain"),
])
def test_a_bad_concrete_value_is_refused(build, message):
    with pytest.raises(ValueError, match=message):
        build().kernel_config(3, ())


def test_a_traced_value_is_not_checked_where_it_cannot_be():
    """Under jit a beta is traced: the method builds, probes, and refuses nothing."""
    probed = jax.jit(lambda beta: jnp.float32(DegsMCMC(beta=beta).probed))(jnp.float32(0.0))
    assert probed == 1.0
