"""The traceable entry points on a tiny random fp32 model, CPU:

- `decode_tokens` (prefill, every step or MCMC block, the answer's choice in one jitted
  program) gives `decode`'s tokens, acceptances and choices for the same per-prompt keys,
  called under `jax.jit` and under `jax.vmap` over a leading axis of key sets;
- `score_candidate` (one sequence) under `jax.vmap` over a pool equals the batched
  teacher-forced path (`score_sequences`) and the values recorded while decoding;
- `decode`'s host loop (`advance_on_host`, chunks of `advance` calls that donate their
  carry) gives the carry of `run_kernel`'s one loop bit for bit across chunk boundaries.

Tolerances: log p sums of <= 8 fp32 terms computed in different programs (a few ulps of
values ~10: 1e-5; against the teacher-forced pass 1e-4 as in test_decoders.py); D(x) is
a mean of integers and must agree to 1e-6; tokens, acceptance counts and choices exactly.
"""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from degs_jax import decoders
from degs_jax.decoders import decode, decode_tokens
from degs_jax.generation import pad_prompts, prefill
from degs_jax.methods import BestOfN, DegsMCMC, Temperature
from degs_jax.lens import LensConfig
from degs_jax.models import TransformerLM
from degs_jax.models import init_params
from degs_jax.scoring import score_candidate, score_sequences
from tiny_models import tiny_config

CFG = tiny_config("Qwen2ForCausalLM")  # vocab 97, 3 layers, EOS = 96
LM = TransformerLM(CFG)
EOS = CFG.eos_token_ids
TAU = 3.3  # in the bulk of this model's lens entropies: d_t varies (test_generation.py)
PROMPTS = [[3, 14, 15], [35, 89, 79, 32, 38, 46, 26], [5]]
CONFIGS = {
    "degs_mcmc": DegsMCMC(block_len=3, num_blocks=2, mh_steps=2, n_chains=2, tau=TAU),
    "best_of_n": BestOfN(n=3, max_new_tokens=5, tau=TAU),
}


@pytest.fixture(scope="module")
def params():
    params = init_params(CFG, jax.random.key(0), jnp.float32, scale=0.3)
    # EOS likely enough that some chains end in block 0, some later, some never.
    eos = EOS[0]
    return dataclasses.replace(params, embed=params.embed.at[:, 0].add(3.0),
                               lm_head=params.lm_head.at[eos].set(0.0).at[eos, 0].set(2.0))


def as_decode_output(decoded, g=None):
    """(tokens per candidate, acceptance counts per candidate, chosen, log p, depth-decided
    MH decisions per candidate) of a Decoded (instance g of a vmapped one)."""
    pick = (lambda a: a) if g is None else (lambda a: a[g])
    state = jax.tree.map(pick, decoded.state)
    tokens, start, end = jax.device_get((state.tokens, state.prompt_len, state.length))
    accepted, ran, decided = jax.device_get((pick(decoded.accepted), pick(decoded.ran), pick(decoded.depth_decided)))
    comps = [tokens[r, start[r]:end[r]].tolist() for r in range(tokens.shape[0])]
    acc = [[int(a) for a, k in zip(accepted[r], ran[r]) if k] for r in range(tokens.shape[0])]
    flips = [[int(d) for d, k in zip(decided[r], ran[r]) if k] for r in range(tokens.shape[0])]
    return comps, acc, jax.device_get(pick(decoded.chosen)).tolist(), np.asarray(pick(decoded.log_p)), flips


def reference(params, method, keys):
    res = decode(LM, params, PROMPTS, CONFIGS[method], keys=keys, eos_ids=EOS)
    cands = [c for o in res.outputs for c in o.candidates]
    mh_steps = getattr(CONFIGS[method], "mh_steps", 1)
    acc = [[round(a * mh_steps) for a in c.acceptance] if c.acceptance is not None else []
           for c in cands]
    chosen = [next(j for j, c in enumerate(o.candidates) if c is o.chosen) for o in res.outputs]
    flips = [c.depth_decisions or [] for c in cands]
    return [c.tokens for c in cands], acc, chosen, np.array([c.log_p for c in cands]), flips


@pytest.mark.parametrize("method", list(CONFIGS))
def test_decode_tokens_equals_decode_under_jit_and_vmap(params, method):
    config = CONFIGS[method]
    tokens, lengths = pad_prompts(PROMPTS)
    key_sets = jax.random.split(jax.random.key(5), (2, len(PROMPTS)))

    run = lambda p, k: decode_tokens(LM, p, jnp.asarray(tokens), jnp.asarray(lengths), k, config, EOS)
    jitted = jax.jit(run)(params, key_sets[0])
    mapped = jax.jit(jax.vmap(run, in_axes=(None, 0)))(params, key_sets)
    for g, got in ((0, as_decode_output(jitted)), (0, as_decode_output(mapped, 0)),
                   (1, as_decode_output(mapped, 1))):
        want = reference(params, method, key_sets[g])
        assert got[0] == want[0], "tokens differ"
        assert got[1] == want[1], "acceptance counts differ"
        assert got[2] == want[2], "chosen candidates differ"
        np.testing.assert_allclose(got[3], want[3], atol=1e-5, rtol=0)
        assert got[4] == want[4], "depth-decided decision counts differ"
    comps = as_decode_output(jitted)[0]
    assert any(c[-1] == EOS[0] for c in comps) and any(c[-1] != EOS[0] for c in comps)
    if method == "degs_mcmc":
        acc = as_decode_output(jitted)[1]
        assert any(len(a) == 1 for a in acc) and any(len(a) == 2 for a in acc), \
            "chains should stop early (EOS in block 0) and run both blocks"
        assert sum(map(sum, acc)) > 0, "no MH step accepted"
    else:
        assert any(j != 0 for j in as_decode_output(jitted)[2]), \
            "every prompt chose candidate 0: the choice comparison would be vacuous"


def test_score_candidate_under_vmap_equals_the_batched_path(params):
    lens = LensConfig(lsub=(1, 2, 3), tau=TAU)
    res = decode(LM, params, PROMPTS, "best_of_n", jax.random.key(2), eos_ids=EOS, n=3,
                 max_new_tokens=5, tau=TAU)
    prompts = [p for p, o in zip(PROMPTS, res.outputs) for _ in o.candidates]
    cands = [c for o in res.outputs for c in o.candidates]
    T = 16
    tokens = np.zeros((len(cands), T), np.int32)
    for r, (p, c) in enumerate(zip(prompts, cands)):
        tokens[r, :len(p) + len(c.tokens)] = p + c.tokens
    prompt_len = np.array([len(p) for p in prompts], np.int32)
    length = prompt_len + np.array([len(c.tokens) for c in cands], np.int32)
    ended = np.array([c.ended for c in cands])
    assert ended.any() and not ended.all()

    one = lambda t, p, n, e: score_candidate(LM, params, t, p, n, e, lens)
    pooled = jax.jit(jax.vmap(one))(tokens, prompt_len, length, ended)
    chex.assert_shape(pooled.token_depth, (len(cands), T))
    batched = score_sequences(LM, params, prompts, [c.tokens for c in cands], lens, eos_ids=EOS)
    for r, (c, b) in enumerate(zip(cands, batched)):
        assert abs(float(pooled.log_p[r]) - b["log_p"]) < 1e-5
        assert abs(float(pooled.depth[r]) - b["depth"]) < 1e-6
        assert abs(float(pooled.final_entropy[r]) - b["final_entropy"]) < 1e-5
        assert np.asarray(pooled.token_depth[r])[np.asarray(pooled.scored[r])].tolist() == b["token_depth"]
        # ... and the values recorded while decoding.
        assert abs(float(pooled.log_p[r]) - c.log_p) < 1e-4
        assert abs(float(pooled.depth[r]) - c.depth) < 1e-6
        assert abs(float(pooled.final_entropy[r]) - c.final_entropy) < 1e-4


def test_host_chunks_equal_one_loop(params, monkeypatch):
    """`decode`'s host loop (`advance_on_host`: chunks of 1, 2, 4 advances, doubling as
    every call counts as fast) gives the carry of `run_kernel`'s one `lax.while_loop`, bit
    for bit. A budget of 3 tokens is 4 decode steps: the rows draw their last token at the
    end of the second chunk and must still consume it in the third, which stops early at
    `done`; some rows end at EOS before that."""
    monkeypatch.setattr(decoders, "CHUNK_SECONDS", float("inf"))
    method = Temperature(max_new_tokens=3, temperature=1.0, lsub=(1, 2, 3), tau=TAU)
    settings = method.plan(LM, EOS)
    toks, lens = pad_prompts(PROMPTS * 3)
    keys = jax.random.split(jax.random.key(9), 9)
    start = lambda: prefill(LM, params, jnp.asarray(toks), jnp.asarray(lens), 16 + 3, jnp.float32)
    whole = decoders.run_kernel(LM, params, start(), keys, method, settings)
    progress = []
    first = method.init(LM, params, start(), keys, settings)
    chunked = decoders.advance_on_host(LM, params, first, keys, method, settings, progress.append)
    assert progress == [1, 3, 4], progress
    chex.assert_trees_all_equal(chunked, whole)
    ended, length = np.asarray(whole.state.ended), np.asarray(whole.state.length)
    assert ended.any() and not ended.all()
    assert np.any((length == lens + 3) & ~ended), "no row used its budget: the chunk boundary case is not exercised"
    # The donated input carry is gone (the pitfall advance_chunk's docstring names).
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves(first))
