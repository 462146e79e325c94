"""Decoders (degs_jax.decoders.decode) and the MCMC bookkeeping on tiny random fp32
models, CPU. The statistical exactness of the chain is tested in test_mcmc_exactness.py;
here: well-formed outputs of every method (scores re-derived by an independent
teacher-forced scoring), the reranking rules, key derivation / batch independence /
bitwise determinism, EOS handling inside blocks and across proposals, counters, the
acceptance ratio by hand, and hyperparameter validation.

Tolerances: scores are sums of <= 6 per-token fp32 values that agree with the
teacher-forced ones to a few ulps (see test_generation.py), hence 1e-4 on sums; D(x)
is a mean of integers d_t / L, which agree exactly, hence 1e-6.
"""

from __future__ import annotations

import dataclasses
import json

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from degs_jax.decoders import decode
from degs_jax.eval.results import read_run_file
from degs_jax.methods import (METHODS, MCMC_METHODS, RERANK_METHODS, SMC_METHODS, DegsMCMC, DegsSMC,
                              PowerMCMC, ScalablePower, hyperparameters_for, method_from_record,
                              resolve_hyperparameters)
from degs_jax.generation import GenState, Proposal, SamplerSpec, completions, generate, pad_prompts, prefill
from degs_jax.lens import LensConfig, sequence_depth
from degs_jax.mcmc import (ACCEPT_STREAM, CUT_STREAM, EXACT_KERNEL, FIRST_MH_STREAM, REFERENCE_KERNEL, REGENERATE_STREAM,
                           MCMCConfig,
                           log_acceptance_ratio, mcmc_block, mh_steps)
from degs_jax.models import TransformerLM
from degs_jax.models import KVCache, init_params
from degs_jax.rows import fold_in_rows
from degs_jax.scoring import score_sequences, token_stats
from tiny_models import tiny_config

LSUB = (1, 2, 3)  # default_lsub(3)
K = len(LSUB)
TAU = 3.3  # in the bulk of this model's lens entropies: d_t varies (see test_generation.py)
LENS = LensConfig(lsub=LSUB, tau=TAU)
PROMPTS = [[3, 14, 15], [35, 89, 79, 32, 38, 46, 26]]
# Six prompts of six different lengths, for batch-vs-one-by-one (6 rows like the
# 2 prompts x 3 chains of HP, so the compiled MCMC block is shared).
PROMPTS6 = [[5, 9], [35, 89, 79, 32, 38, 46, 26], [3, 14, 15, 92, 65], [60, 2, 71, 8, 44, 19, 7, 23, 11, 52, 1],
            [17], [88, 12, 40, 6, 29, 33, 70, 81, 64, 58, 21, 90, 13, 27]]
MAX_NEW = 6
HP = {
    "greedy": dict(max_new_tokens=MAX_NEW, tau=TAU),
    "temperature": dict(max_new_tokens=MAX_NEW, tau=TAU),
    **{m: dict(max_new_tokens=MAX_NEW, n=4, tau=TAU) for m in RERANK_METHODS},
    "power_mcmc": dict(block_len=3, num_blocks=2, mh_steps=2, n_chains=3, tau=TAU),
    "degs_mcmc": dict(block_len=3, num_blocks=2, mh_steps=2, n_chains=3, tau=TAU),
    # Resampling at every token with a high threshold: copies happen (test_smc_decoders.py).
    **{m: dict(max_new_tokens=MAX_NEW, n_particles=4, resample_every=1, ess_threshold=0.9, ramp_tokens=4,
               tau=TAU) for m in SMC_METHODS},
    "scalable_power": dict(max_new_tokens=MAX_NEW, block_len=2, candidate_pool=4, candidates_kept=2, rollouts=2,
                           rollout_horizon=2, tau=TAU),
}
EOS_STRENGTH = 2.0  # EOS probability ~0.02-0.2 under p: chains end in block 0, block 1 or never


@pytest.fixture(scope="module")
def model():
    cfg = tiny_config("Qwen2ForCausalLM")  # vocab 97, 3 layers, context 512, EOS = 96
    params = init_params(cfg, jax.random.key(0), jnp.float32, scale=0.3)
    return cfg, params


def eos_biased(params, eos: int, strength: float):
    """Every embedding shifted along hidden unit 0 (so the normalised final residual has a
    large positive unit 0) and the EOS row of the untied lm_head reading that unit:
    logit(EOS) ≈ strength · const at every position."""
    embed = params.embed.at[:, 0].add(3.0)
    head = params.lm_head.at[eos].set(0.0).at[eos, 0].set(strength)
    return dataclasses.replace(params, embed=embed, lm_head=head)


@pytest.fixture(scope="module")
def eos_model(model):
    cfg, params = model
    return cfg, eos_biased(params, cfg.eos_token_ids[0], EOS_STRENGTH)


def run(model, method, prompts=PROMPTS, seed=0, **overrides):
    cfg, params = model
    hp = {**HP[method], **overrides}
    return decode(TransformerLM(cfg), params, prompts, method, jax.random.key(seed), eos_ids=cfg.eos_token_ids, **hp)


@pytest.fixture(scope="module")
def results(eos_model):
    return {m: run(eos_model, m) for m in METHODS}


def teacher_scores(model, prompts, cands):
    cfg, params = model
    return score_sequences(TransformerLM(cfg), params, prompts, [c.tokens for c in cands], LENS,
                           eos_ids=cfg.eos_token_ids, bucket=32)


# ------------------------------------------------------------------ every method


@pytest.mark.parametrize("method", METHODS)
def test_every_method_well_formed(eos_model, results, method):
    cfg, _ = eos_model
    eos = cfg.eos_token_ids[0]
    res = results[method]
    hp = HP[method]
    n = hp.get("n", hp.get("n_chains", hp.get("n_particles", 1)))
    mcmc = method in MCMC_METHODS
    max_new = hp["block_len"] * hp["num_blocks"] if mcmc else hp["max_new_tokens"]
    probed = method not in ("power_mcmc", "power_smc", "scalable_power")
    assert res.method == method
    assert {k: res.hyperparameters[k] for k in hp} == hp
    assert set(res.hyperparameters) == set(resolve_hyperparameters(method, {}))
    assert len(res.outputs) == len(PROMPTS)
    for i, out in enumerate(res.outputs):
        assert len(out.candidates) == n
        assert any(out.chosen is c for c in out.candidates)
        scores = teacher_scores(eos_model, [PROMPTS[i]] * n, out.candidates)
        for c, ref in zip(out.candidates, scores):
            assert 1 <= len(c.tokens) <= max_new
            assert all(0 <= t < cfg.vocab_size for t in c.tokens)
            assert eos not in c.tokens[:-1], "EOS only as the last token"
            assert c.ended == (c.tokens[-1] == eos)
            if not c.ended:
                assert len(c.tokens) == max_new, "a completion without EOS must have used the budget"
            assert abs(c.log_p - ref["log_p"]) < 1e-4
            assert abs(c.final_entropy - ref["final_entropy"]) < 1e-4
            if probed:
                assert c.depth is not None and abs(c.depth - ref["depth"]) < 1e-6
                assert 0.0 <= c.depth <= 1.0
            else:
                assert c.depth is None
            if mcmc:
                assert 1 <= len(c.acceptance) <= hp["num_blocks"]
                assert len(c.acceptance) == hp["num_blocks"] or c.ended, "a chain stops only at EOS"
                assert all(a * hp["mh_steps"] in range(hp["mh_steps"] + 1) for a in c.acceptance)
                assert len(c.depth_decisions) == len(c.acceptance)
                assert all(d in range(hp["mh_steps"] + 1) for d in c.depth_decisions)
                if method == "power_mcmc":  # beta = 0: no depth term to decide anything
                    assert c.depth_decisions == [0] * len(c.acceptance)
            else:
                assert c.acceptance is None and c.depth_decisions is None
    # Counters (sum over rows). Prefill runs every prompt token once per row.
    cands = [c for out in res.outputs for c in out.candidates]
    prompt_tokens = n * sum(len(p) for p in PROMPTS)
    gen, fwd, probes = (res.counters[k] for k in ("generated_tokens", "forward_tokens", "probed_token_layers"))
    if mcmc:
        # Rejected proposals count: more generated than kept; every generate call adds at
        # most one forward beyond its samples (the re-read of the last prefix token).
        calls = len(cands) * hp["num_blocks"] * (1 + hp["mh_steps"])
        assert gen >= sum(len(c.tokens) for c in cands)
        assert 0 <= fwd - prompt_tokens - gen <= calls
    elif method in SMC_METHODS:
        # Lock-step particles: one forward per live row and step, a token at all but a
        # budget-ended row's last step (copies move tokens, so no per-candidate identity).
        assert 0 <= fwd - prompt_tokens - gen <= len(cands) and gen <= len(cands) * max_new
    elif method == "scalable_power":
        # Candidates and rollouts: each generate call re-reads its prefix's last token and
        # consumes a budget-ended last token; discarded candidates and rollouts count.
        calls = len(PROMPTS) * -(-max_new // hp["block_len"]) * (hp["candidate_pool"]
                                                                + hp["candidates_kept"] * hp["rollouts"])
        assert gen > sum(len(c.tokens) for c in cands) and res.counters["rollouts"] > 0
        assert 0 <= fwd - prompt_tokens - gen <= 2 * calls
    else:
        # One forward per sampled token, plus the first step (re-reads the prompt's last
        # token), minus nothing: an EOS is never consumed, a budget-ended last token is.
        assert gen == sum(len(c.tokens) for c in cands)
        assert fwd == prompt_tokens + sum(len(c.tokens) + (0 if c.ended else 1) for c in cands)
    assert probes == (K * (fwd - prompt_tokens) if probed else 0)
    assert res.forward_equivalents(cfg.num_layers) == pytest.approx(fwd + probes / cfg.num_layers)
    assert set(res.seconds) == {"prefill", "decode", "total"}


def test_pools_exercise_both_endings(results):
    """The shared EOS-biased setting produces ended and budget-ended candidates (otherwise
    the EOS checks above would be vacuous)."""
    cands = [c for m in ("best_of_n", "degs_mcmc", "power_mcmc") for o in results[m].outputs
             for c in o.candidates]
    assert any(c.ended for c in cands) and any(not c.ended for c in cands)
    assert any(c.ended and len(c.tokens) > 1 for c in cands), "EOS inside the budget"
    chains = [c for m in MCMC_METHODS for o in results[m].outputs for c in o.candidates]
    assert any(c.ended and len(c.acceptance) == 1 for c in chains), "a chain ending in block 0"
    assert any(c.ended and len(c.acceptance) == 2 for c in chains), "a chain ending in block 1"
    assert any(not c.ended for c in chains), "a chain using the whole budget"


# ------------------------------------------------------------------ reranking rules


def test_rerank_rules(model):
    """Same key, same pool for every reranker; each picks the argmax of its own criterion,
    computed here from the teacher-forced scores (not from the candidates' fields).
    On the plain model (EOS is rare, so the candidates have equal lengths and the criteria
    disagree; with the EOS-biased one a short ended candidate tends to win them all)."""
    res = {m: run(model, m) for m in RERANK_METHODS}
    res["depth_only"] = run(model, "degs_rerank", alpha=0.0)
    res["depth_heavy"] = run(model, "degs_rerank", alpha=1.0, beta=50.0)
    criteria = {
        "best_of_n": lambda s: s["log_p"],
        "best_of_n_entropy": lambda s: -s["final_entropy"],
        "degs_rerank": lambda s: 4.0 * s["log_p"] + 5.0 * s["depth"],
        "depth_only": lambda s: s["depth"],
        "depth_heavy": lambda s: 1.0 * s["log_p"] + 50.0 * s["depth"],
    }
    choices = {}
    for i in range(len(PROMPTS)):
        pool = [c.tokens for c in res["best_of_n"].outputs[i].candidates]
        scores = teacher_scores(model, [PROMPTS[i]] * len(pool), res["best_of_n"].outputs[i].candidates)
        for name, r in res.items():
            out = r.outputs[i]
            assert [c.tokens for c in out.candidates] == pool, name
            crit = [criteria[name](s) for s in scores]
            j = next(j for j, c in enumerate(out.candidates) if c is out.chosen)
            assert crit[j] >= max(crit) - 1e-4, (name, i, crit, j)
            choices[name, i] = j
    # The criteria disagree on this pool (else the test could not tell them apart).
    differ = lambda a, b: any(choices[a, i] != choices[b, i] for i in range(len(PROMPTS)))
    assert differ("best_of_n", "best_of_n_entropy") and differ("best_of_n", "depth_only"), choices


def test_depth_excludes_final_eos(eos_model, results):
    """D(x) of an ended candidate is the mean of d_t / L over its tokens before the EOS,
    from a teacher-forced token_stats pass."""
    cfg, params = eos_model
    eos = cfg.eos_token_ids[0]
    checked = 0
    for i, out in enumerate(results["best_of_n"].outputs):
        for c in out.candidates:
            seq = PROMPTS[i] + c.tokens
            toks = np.zeros((1, 32), np.int32)
            toks[0, : len(seq)] = seq
            depth = jax.device_get(token_stats(TransformerLM(cfg), params, jnp.asarray(toks), LENS).depth)
            P = len(PROMPTS[i])
            n_scored = len(c.tokens) - int(c.ended)
            want = depth[0, P:P + n_scored].mean() / cfg.num_layers if n_scored else 0.0
            assert abs(c.depth - want) < 1e-6
            checked += c.ended and c.tokens[-1] == eos
    assert checked


# ------------------------------------------------------------------ keys, determinism, batching


def test_decode_row_keys_and_batch_independence(eos_model, results):
    """Row r = i·n + j uses split(key, rows)[r]; each row equals that row generated alone
    (its own prompt, different prompt lengths in the batch) with that key. On the module's
    best_of_n decode (key 0), whose rows end at EOS and at the budget."""
    cfg, params = eos_model
    res, n = results["best_of_n"], HP["best_of_n"]["n"]
    keys = jax.random.split(jax.random.key(0), n * len(PROMPTS))
    spec = SamplerSpec(Proposal(1.0), eos_ids=cfg.eos_token_ids, lens=LENS)
    for i, p in enumerate(PROMPTS):
        toks, lens = pad_prompts([p])
        state = prefill(TransformerLM(cfg), params, jnp.asarray(toks), jnp.asarray(lens), 16 + MAX_NEW, jnp.float32)
        for j in range(n):
            r = i * n + j
            alone = generate(TransformerLM(cfg), params, state, state.prompt_len + MAX_NEW, keys[r:r + 1], spec)
            cand = res.outputs[i].candidates[j]
            assert cand.tokens == completions(alone)[0]
            P = len(p)
            assert abs(cand.log_p - float(alone.logp[0, P:int(alone.length[0])].sum())) < 1e-5


def mcmc_by_hand(params, cfg, prompts, keys, mc):
    """The decode loop of MCMC_METHODS: blocks until every chain ended or the schedule ran out.
    Returns (completions, acceptance per row per active block, log p)."""
    toks, lens = pad_prompts(prompts)
    state = prefill(TransformerLM(cfg), params, jnp.asarray(toks), jnp.asarray(lens), toks.shape[1] + mc.max_new_tokens,
                    jnp.float32)
    acc = [[] for _ in prompts]
    for block in range(mc.num_blocks):
        before = state
        state, decisions, active = mcmc_block(TransformerLM(cfg), params, state, keys, jnp.int32(block), mc)
        accepted = decisions.accepted_steps()
        active = np.asarray(active)
        np.testing.assert_array_equal(active, ~np.asarray(before.ended))
        for r in np.flatnonzero(active):
            acc[r].append(int(accepted[r]))
        # A chain that ended in an earlier block is left exactly as it was.
        idle = lambda s: jax.tree.map(lambda a: np.asarray(a)[~active], dataclasses.replace(s, cache=None))
        chex.assert_trees_all_equal(idle(state), idle(before))
        if bool(np.asarray(state.ended).all()):
            break
    logp = [float(state.logp[b, int(state.prompt_len[b]):int(state.length[b])].sum()) for b in range(len(prompts))]
    return completions(state), acc, logp


def test_mcmc_batch_equals_chains_one_by_one(eos_model):
    """degs_mcmc on 6 prompts of different lengths (decode, one key) = each chain run
    alone through mcmc_block with its row key split(key, 6)[r]."""
    cfg, params = eos_model
    key = jax.random.key(11)
    hp = {**HP["degs_mcmc"], "n_chains": 1}
    res = decode(TransformerLM(cfg), params, PROMPTS6, "degs_mcmc", key, eos_ids=cfg.eos_token_ids, **hp)
    mc = MCMCConfig(alpha=4.0, beta=5.0, block_len=hp["block_len"], num_blocks=hp["num_blocks"],
                    mh_steps=hp["mh_steps"], lens=LENS, eos_ids=cfg.eos_token_ids)
    keys = jax.random.split(key, len(PROMPTS6))
    batch = mcmc_by_hand(params, cfg, PROMPTS6, keys, mc)
    moved = False
    for r, p in enumerate(PROMPTS6):
        cand = res.outputs[r].chosen
        alone = mcmc_by_hand(params, cfg, [p], keys[r:r + 1], mc)
        assert cand.tokens == batch[0][r] == alone[0][0], r
        assert [a * mc.mh_steps for a in cand.acceptance] == batch[1][r] == alone[1][0], r
        assert abs(cand.log_p - alone[2][0]) < 1e-5
        moved |= any(batch[1][r])
    assert moved, "no MH step was accepted: the comparison would not cover the MH part"


def test_one_chain_per_prompt_keeps_the_prefill_cache(model, monkeypatch):
    """With one chain per prompt `decode` runs on the prefill's own state: no copy of the
    cache (a copy left a hole that the MCMC block's temporary did not fit into at 128 rows
    of the 7B shape on an H100, docs/benchmarks.md run 39); with more chains it repeats rows.
    (The one-chain run is test_mcmc_batch_equals_chains_one_by_one's: its programs are compiled.)"""
    import degs_jax.decoders as decoders

    calls = []
    repeat = decoders.repeat_rows
    monkeypatch.setattr(decoders, "repeat_rows", lambda state, n: calls.append(n) or repeat(state, n))
    hp = {**HP["degs_mcmc"], "n_chains": 1}
    cfg, params = model
    one = decode(TransformerLM(cfg), params, PROMPTS6, "degs_mcmc", jax.random.key(0), eos_ids=cfg.eos_token_ids, **hp)
    assert calls == [] and len(one.outputs) == len(PROMPTS6)
    decode(TransformerLM(cfg), params, PROMPTS, "degs_mcmc", jax.random.key(0), eos_ids=cfg.eos_token_ids,
           **HP["degs_mcmc"])
    assert calls == [HP["degs_mcmc"]["n_chains"]]


def test_mcmc_chains_keep_the_models_statistics(model):
    """Many MH steps with both decisions, rows finishing proposals at different times:
    every chain's stored log p, final entropy and D(x) equal a fresh teacher-forced pass.
    After each decision the proposal's cache row must be reset to the chain's; a stale
    row (the rejected proposal's keys past its cut) would change later proposals' values."""
    cfg, params = model
    res = decode(TransformerLM(cfg), params, PROMPTS, "degs_mcmc", jax.random.key(5), eos_ids=(), block_len=12,
                 num_blocks=2, mh_steps=6, n_chains=4, lsub=LSUB, tau=TAU, alpha=1.5)
    acceptance = [a for o in res.outputs for c in o.candidates for a in c.acceptance]
    assert 0.2 < np.mean(acceptance) < 0.9, acceptance  # both accepted and rejected steps
    for i, out in enumerate(res.outputs):
        for c, ref in zip(out.candidates, teacher_scores(model, [PROMPTS[i]] * 4, out.candidates)):
            assert len(c.tokens) == 24
            assert abs(c.log_p - ref["log_p"]) < 1e-4
            assert abs(c.final_entropy - ref["final_entropy"]) < 1e-4
            assert abs(c.depth - ref["depth"]) < 1e-6


@pytest.mark.parametrize("method", ["temperature", "degs_mcmc"])
def test_same_key_bitwise_different_key_differs(eos_model, results, method):
    first = results[method]
    again = run(eos_model, method)
    other = run(eos_model, method, seed=1)
    same = lambda a, b: [(c.tokens, c.log_p, c.depth, c.final_entropy, c.acceptance) for o in a.outputs
                         for c in o.candidates] == [(c.tokens, c.log_p, c.depth, c.final_entropy, c.acceptance)
                                                    for o in b.outputs for c in o.candidates]
    assert same(first, again), "same key, different output"
    assert first.counters == again.counters
    assert not same(first, other), "different keys, identical output"


# ------------------------------------------------------------------ EOS in the chain


def test_eos_dominant_model_decodes_immediate_eos(model):
    """A model whose EOS dominates everywhere: greedy and degs_mcmc return [EOS] for every
    prompt/chain, flagged ended, with D = 0 (nothing scored), and the chain stops after
    block 0 (one acceptance entry)."""
    cfg, params = model
    eos = cfg.eos_token_ids[0]
    forced = (cfg, eos_biased(params, eos, 30.0))
    for method in ("greedy", "degs_mcmc"):
        res = run(forced, method)
        for out in res.outputs:
            for c in out.candidates:
                assert c.tokens == [eos] and c.ended
                assert c.depth == 0.0 and c.final_entropy == 0.0
                assert -1e-3 < c.log_p <= 0.0
                if method == "degs_mcmc":
                    assert c.acceptance == [1.0]  # proposals equal the state: log r = 0
    # greedy: one forward per row beyond the prefill (the step that samples EOS).
    res = run(forced, "greedy")
    assert res.counters["forward_tokens"] == sum(len(p) + 1 for p in PROMPTS)


def test_mh_proposals_cross_the_current_eos(eos_model):
    """Chains that ended early inside a block propose up to the block boundary, not up to
    their current length: some accepted proposals run past the old EOS. Inactive rows are
    untouched; rejected proposals still count in the counters."""
    cfg, params = eos_model
    B = 12
    # alpha = 1: under p^4 this model's immediate EOS is so dominant that no chain leaves it.
    mc = MCMCConfig(alpha=1.0, beta=5.0, block_len=6, num_blocks=1, mh_steps=4, lens=LENS,
                    eos_ids=cfg.eos_token_ids)
    toks, lens = pad_prompts([PROMPTS[0]] * B)
    state = prefill(TransformerLM(cfg), params, jnp.asarray(toks), jnp.asarray(lens), 16 + mc.block_len, jnp.float32)
    limit = state.prompt_len + mc.block_len
    keys = jax.random.split(jax.random.key(2), B)
    state = generate(TransformerLM(cfg), params, state, limit, keys, mc.proposal)
    active = jnp.arange(B) < B - 2  # the last two rows sit out
    after, decisions = mh_steps(TransformerLM(cfg), params, state, keys, jnp.int32(0), active, mc)
    accepted = decisions.accepted_steps()
    eos = cfg.eos_token_ids[0]
    for b in range(B):
        comp = completions(after)[b]
        assert eos not in comp[:-1] and bool(after.ended[b]) == (comp[-1] == eos)
        assert bool(after.ended[b]) or int(after.length[b]) == int(limit[b])
    sat_out = lambda s: jax.tree.map(lambda a: np.asarray(a)[B - 2:], dataclasses.replace(s, cache=None))
    chex.assert_trees_all_equal(sat_out(after), sat_out(state))
    start_len, end_len = np.asarray(state.length), np.asarray(after.length)
    started_early = np.asarray(state.ended) & (start_len < np.asarray(limit)) & np.asarray(active)
    assert started_early.any(), "no chain ended early: pick another seed"
    assert np.any(end_len[started_early] > start_len[started_early]), \
        "no chain moved past its old EOS: proposals capped at the current length?"
    grew = np.asarray(after.n_generated - state.n_generated)
    assert np.all(grew[: B - 2] >= mc.mh_steps)  # every proposal samples >= 1 token
    assert np.all(np.asarray(after.n_forward - state.n_forward) >= grew)
    np.testing.assert_array_equal(after.n_probed - state.n_probed, K * (after.n_forward - state.n_forward))
    assert np.all(np.asarray(accepted)[B - 2:] == 0)


def test_decision_records_are_the_step_redone_by_hand(model):
    """One MH step of 16 chains at beta = 50, redone by hand from the module docstring's
    streams: cut, proposal (`generate` from the cut), u, and log r from the stored per-token
    values with and without beta·ΔD. The kernel accepts exactly where log u < log r and
    counts as depth-decided exactly the chains where the two decisions differ; at this
    beta some do (beta = 0 counts none: test_every_method_well_formed, power_mcmc). Its
    decision records (`MHDecisions`) are the hand's values: log r_0, D(x') - D(x), log u
    bit for bit, the cut, both suffix lengths and the null moves (x' = x) exactly."""
    cfg, params = model
    B = 16
    lm = TransformerLM(cfg)
    mc = MCMCConfig(alpha=4.0, beta=50.0, block_len=4, num_blocks=1, mh_steps=1, lens=LENS,
                    eos_ids=cfg.eos_token_ids)
    toks, lens = pad_prompts([PROMPTS[1]] * B)
    state = prefill(lm, params, jnp.asarray(toks), jnp.asarray(lens), toks.shape[1] + mc.block_len, jnp.float32)
    limit = state.prompt_len + mc.block_len
    keys = jax.random.split(jax.random.key(4), B)
    state = generate(lm, params, state, limit, keys, mc.proposal)
    _, decisions = mh_steps(lm, params, state, keys, jnp.int32(0), jnp.ones((B,), bool), mc)
    accepted, depth_decided = decisions.accepted_steps(), decisions.depth_decided_steps()

    step_keys = fold_in_rows(keys, 0, FIRST_MH_STREAM)  # block 0, step 0
    n_x = state.length - state.prompt_len
    cut = state.prompt_len + jax.vmap(lambda k, n: jax.random.randint(k, (), 0, jnp.maximum(n, 1)))(
        fold_in_rows(step_keys, CUT_STREAM), n_x)
    restart = dataclasses.replace(state, length=cut, ended=jnp.zeros_like(state.ended))
    proposal = generate(lm, params, restart, limit, fold_in_rows(step_keys, REGENERATE_STREAM), mc.proposal,
                        fresh_from=cut)
    log_u = jnp.log(jax.vmap(jax.random.uniform)(fold_in_rows(step_keys, ACCEPT_STREAM)))
    with_depth = np.asarray(log_u < log_acceptance_ratio(state, proposal, cut, mc, cfg.num_layers))
    power = np.asarray(log_u < log_acceptance_ratio(state, proposal, cut, dataclasses.replace(mc, beta=0.0),
                                                    cfg.num_layers))
    np.testing.assert_array_equal(np.asarray(accepted), with_depth)
    np.testing.assert_array_equal(np.asarray(depth_decided), with_depth != power)
    assert 0 < int(np.sum(depth_decided)), "beta = 50 flipped no decision: the comparison is vacuous"

    record = jax.device_get(jax.tree.map(lambda field: field[:, 0], decisions))  # the one step
    completion = lambda s: s.completion_mask(scored=True)
    delta = (sequence_depth(proposal.depth, completion(proposal), cfg.num_layers)
             - sequence_depth(state.depth, completion(state), cfg.num_layers))
    np.testing.assert_array_equal(record.log_ratio_power, np.asarray(log_acceptance_ratio(
        state, proposal, cut, dataclasses.replace(mc, beta=0.0), cfg.num_layers)))
    np.testing.assert_array_equal(record.depth_delta, np.asarray(delta))
    np.testing.assert_array_equal(record.log_u, np.asarray(log_u))
    np.testing.assert_array_equal(record.cut, np.asarray(cut - state.prompt_len))
    np.testing.assert_array_equal(record.current_suffix, np.asarray(state.length - cut))
    np.testing.assert_array_equal(record.proposal_suffix, np.asarray(proposal.length - cut))
    tokens_x, tokens_y = completions(state), completions(proposal)
    same = np.array([x == y for x, y in zip(tokens_x, tokens_y)])
    np.testing.assert_array_equal(record.null_move, same)
    assert same.any() and not same.all(), "no null move, or only null moves: the check is vacuous"
    # a null move's log r_0 is 0 up to the rounding of its re-stored per-token values
    assert np.all(record.accepted[same]) and np.all(np.abs(record.log_ratio_power[same]) < 1e-4)


def hand_state(logp, logq, depth, length, prompt_len, ended, S):
    B = len(length)
    pad = lambda rows, fill, dt: np.array([list(r) + [fill] * (S - len(r)) for r in rows], dt)
    return GenState(
        tokens=jnp.zeros((B, S), jnp.int32), logp=jnp.asarray(pad(logp, 0.0, np.float32)),
        logq=jnp.asarray(pad(logq, 0.0, np.float32)), depth=jnp.asarray(pad(depth, -1, np.int32)),
        final_entropy=jnp.zeros((B, S), jnp.float32), length=jnp.asarray(length, jnp.int32),
        prompt_len=jnp.asarray(prompt_len, jnp.int32), ended=jnp.asarray(ended),
        cache=KVCache(k=jnp.zeros((1, B, S, 1, 2)), v=jnp.zeros((1, B, S, 1, 2))),
        n_generated=jnp.zeros(B, jnp.int32), n_forward=jnp.zeros(B, jnp.int32),
        n_probed=jnp.zeros(B, jnp.int32), n_steps=jnp.zeros(B, jnp.int32))


@pytest.mark.parametrize("quirks", [False, True])
def test_log_acceptance_ratio_by_hand(model, quirks):
    """log r on hand-made states against the formula of docs/design.md §4: whole suffixes of both
    states, D with the final EOS excluded, the cut-index ratio log n_x − log n_x'.
    Row 0: current ended with EOS (n_x = 5), the proposal crosses the old EOS position and
    runs to the boundary (n_x' = 8). Row 1: current at the boundary, the proposal ends early
    with EOS. With reference_quirks the current suffix is truncated to the proposal's
    length and the cut-index ratio is dropped."""
    cfg, _ = model
    L, S, Pl = cfg.num_layers, 12, 2
    rng = np.random.default_rng(0)
    lengths_x, lengths_y, ended_x, ended_y, cut = [7, 10], [10, 6], [True, False], [False, True], [4, 3]

    def rows(lengths, ended):
        lp = [np.r_[np.zeros(Pl), -rng.uniform(0.1, 3, n - Pl)] for n in lengths]
        lq = [np.r_[np.zeros(Pl), -rng.uniform(0.1, 3, n - Pl)] for n in lengths]
        d = [np.r_[-np.ones(Pl), rng.integers(1, L + 1, n - Pl)] for n in lengths]
        for r, e in enumerate(ended):
            if e:
                d[r][-1] = -1  # a final EOS has no depth
        return lp, lq, d

    lp_x, lq_x, d_x = rows(lengths_x, ended_x)
    lp_y, lq_y, d_y = rows(lengths_y, ended_y)
    for r in range(2):  # the proposal shares the prefix below the cut
        for a, b in ((lp_y, lp_x), (lq_y, lq_x), (d_y, d_x)):
            a[r][: cut[r]] = b[r][: cut[r]]
    x = hand_state(lp_x, lq_x, d_x, lengths_x, [Pl] * 2, ended_x, S)
    y = hand_state(lp_y, lq_y, d_y, lengths_y, [Pl] * 2, ended_y, S)
    alpha, beta = 3.0, 2.0
    mc = MCMCConfig(alpha=alpha, beta=beta, block_len=S, num_blocks=1, mh_steps=1, lens=LENS,
                    kernel=REFERENCE_KERNEL if quirks else EXACT_KERNEL)
    got = np.asarray(log_acceptance_ratio(x, y, jnp.asarray(cut, jnp.int32), mc, cfg.num_layers))

    def D(d, n, ended):
        scored = d[Pl:n - int(ended)]
        return scored.mean() / L if len(scored) else 0.0

    for r in range(2):
        c, nx, ny = cut[r], lengths_x[r], lengths_y[r]
        x_end = min(nx, ny) if quirks else nx
        want = (alpha * (lp_y[r][c:ny].sum() - lp_x[r][c:x_end].sum())
                + lq_x[r][c:x_end].sum() - lq_y[r][c:ny].sum()
                + beta * (D(d_y[r], ny, ended_y[r]) - D(d_x[r], nx, ended_x[r])))
        if not quirks:
            want += np.log(nx - Pl) - np.log(ny - Pl)
        assert abs(got[r] - want) < 1e-4, (r, got[r], want)


# ------------------------------------------------------------------ validation


@pytest.mark.parametrize("kwargs, match", [
    (dict(alpha=0.5), "alpha must be >= 1"),
    (dict(alpha=float("nan")), "alpha must be >= 1"),
    (dict(beta=-0.1), "beta must be >= 0"),
    (dict(block_len=0), "block_len must be a positive integer"),
    (dict(num_blocks=-1), "num_blocks must be a positive integer"),
    (dict(mh_steps=0), "mh_steps must be a positive integer"),
    (dict(mh_steps=2.0), "mh_steps must be a positive integer"),
    (dict(beta=1.0, lens=None), "beta > 0 needs a LensConfig"),
])
def test_mcmc_config_validation(kwargs, match):
    base = dict(alpha=4.0, beta=0.0, block_len=4, num_blocks=2, mh_steps=3, lens=LENS)
    with pytest.raises(ValueError, match=match):
        MCMCConfig(**{**base, **kwargs})


@pytest.mark.parametrize("method_class, bad, match", [
    (DegsMCMC, dict(alpha=0.5), "alpha must be >= 1"),
    (DegsMCMC, dict(beta=-0.1), "beta must be >= 0"),
    (PowerMCMC, dict(mh_steps=0), "mh_steps must be a positive integer"),
    (DegsSMC, dict(ess_threshold=1.5), "ess_threshold must be in"),
    (DegsSMC, dict(ramp_tokens=-1), "ramp_tokens must be an integer >= 0"),
    (ScalablePower, dict(alpha=0.9), "alpha must be >= 1"),
    (ScalablePower, dict(candidates_kept=40), "candidates_kept .* cannot exceed candidate_pool"),
    (ScalablePower, dict(candidate_temperature=0.0), "candidate_temperature must be > 0"),
])
def test_a_bad_hyperparameter_fails_when_the_method_is_built(method_class, bad, match):
    """A method value checks its hyperparameters when it is built (not when planned), and
    its kernel's settings, built directly, fail with the very same message (one check)."""
    with pytest.raises(ValueError, match=match) as built:
        method_class(**bad)
    settings = method_class().kernel_config(4, (0,))
    with pytest.raises(ValueError, match=match) as direct:
        dataclasses.replace(settings, **bad)
    assert str(built.value) == str(direct.value)


@pytest.mark.parametrize("method, kwargs, match", [
    ("degs_mcmc", dict(alpha=0.9), "alpha must be >= 1"),
    ("degs_mcmc", dict(beta=-1.0), "beta must be >= 0"),
    ("power_mcmc", dict(beta=1.0), "power_mcmc is the beta = 0 chain"),
    ("degs_mcmc", dict(tau=0.0), "tau must be a positive"),
    ("greedy", dict(tau=-0.25), "tau must be a positive"),
    ("degs_rerank", dict(tau=float("inf")), "tau must be a positive"),
    ("degs_mcmc", dict(block_len=0), "block_len must be a positive integer"),
    ("power_mcmc", dict(mh_steps=0), "mh_steps must be a positive integer"),
    ("degs_mcmc", dict(num_blocks=0), "num_blocks must be a positive integer"),
    ("degs_mcmc", dict(n_chains=0), "positive integer"),
    ("best_of_n", dict(n=0), "n must be a positive integer"),
    ("greedy", dict(max_new_tokens=0), "max_new_tokens must be a positive integer"),
    ("degs_rerank", dict(alpha=-1.0), "degs_rerank needs alpha and beta >= 0"),
    # inf, and values that are inf as the programs' float32 (issue 58)
    ("degs_rerank", dict(beta=float("inf")), "degs_rerank needs alpha and beta >= 0 and at most"),
    ("degs_mcmc", dict(alpha=float("inf")), r"alpha must be >= 1 .* at most 3.402823e\+38"),
    ("degs_mcmc", dict(alpha=4e38), r"alpha must be >= 1 .* at most 3.402823e\+38"),
    ("degs_smc", dict(beta=float("inf")), "beta must be >= 0 and at most"),
    ("scalable_power", dict(alpha=1e308), "alpha must be >= 1"),
    ("temperature", dict(temperature=float("inf")), "temperature must be >= 0 and at most"),
    ("best_of_n", dict(temperature=1e39), "temperature must be >= 0 and at most"),
    ("degs_rerank", dict(probe=False), "degs_rerank needs probe=True"),
    ("greedy", dict(lsub=(1, 4)), r"L_sub layers \[4\] out of range"),
    ("temperature", dict(temperature=-1.0), "temperature must be >= 0"),
    ("temperature", dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    ("sampling", {}, "unknown method 'sampling'; choose one of greedy, temperature"),
    ("greedy", dict(temperature=0.5), "greedy does not take temperature"),
    ("best_of_n", dict(nn=3), "best_of_n does not take nn"),
    ("degs_mcmc", dict(block_length=8), "degs_mcmc does not take block_length"),
])
def test_decode_rejects_bad_hyperparameters(model, method, kwargs, match):
    cfg, params = model
    hp = {**HP.get(method, {}), **kwargs}
    with pytest.raises(ValueError, match=match):
        decode(TransformerLM(cfg), params, PROMPTS, method, jax.random.key(0), eos_ids=cfg.eos_token_ids, **hp)


@pytest.mark.parametrize("method, budget", [("greedy", dict(max_new_tokens=13)),
                                            ("degs_mcmc", dict(block_len=4, num_blocks=4))])
def test_prompt_plus_budget_longer_than_context(model, method, budget):
    cfg, params = model
    assert cfg.max_position_embeddings == 512
    prompt = [1] * 500  # 500 + 13 > 512; 500 + 16 > 512
    with pytest.raises(ValueError, match="500 tokens .* exceeds the model's context of 512"):
        decode(TransformerLM(cfg), params, [PROMPTS[0], prompt], method, jax.random.key(0),
               eos_ids=cfg.eos_token_ids, **{**HP[method], **budget})
    big = [1] * 513
    with pytest.raises(ValueError, match="exceeds the model's context"):
        decode(TransformerLM(cfg), params, [big], method, jax.random.key(0), eos_ids=cfg.eos_token_ids,
               **{**HP[method], **budget})


def test_prompt_plus_budget_exactly_at_context(model):
    """500 + 12 = 512 fits (the bucketed buffer is longer, 512 + 12 slots, but no token sits
    past position 511) and scores like a teacher-forced pass."""
    cfg, params = model
    prompt = [1] * 500
    res = decode(TransformerLM(cfg), params, [prompt, PROMPTS[0]], "greedy", jax.random.key(0), eos_ids=(),
                 max_new_tokens=12, tau=TAU)
    cand = res.outputs[0].chosen
    assert len(cand.tokens) == 12 and not cand.ended
    ref = score_sequences(TransformerLM(cfg), params, [prompt], [cand.tokens], LENS)[0]
    assert abs(cand.log_p - ref["log_p"]) < 1e-4 and abs(cand.depth - ref["depth"]) < 1e-6


@pytest.mark.parametrize("prompts", [[[]], [[1, 2], []], []])
def test_empty_prompt_rejected(model, prompts):
    cfg, params = model
    with pytest.raises(ValueError, match="at least one token"):
        decode(TransformerLM(cfg), params, prompts, "greedy", jax.random.key(0), eos_ids=cfg.eos_token_ids, **HP["greedy"])


def test_defaults_match_design():
    """docs/design.md §4 defaults: MCMC alpha 4, beta 5, 16 blocks of 192, 10 MH steps; power_mcmc
    beta 0; temperature 0.25; best-of-N at temperature 1.0 (top-p 1.0); tau 0.25."""
    for m in MCMC_METHODS:
        hp = resolve_hyperparameters(m, {})
        assert (hp["alpha"], hp["block_len"], hp["num_blocks"], hp["mh_steps"]) == (4.0, 192, 16, 10)
        assert hp["reference_quirks"] is False and hp["tau"] == 0.25 and hp["top_k"] == 0
    assert DegsMCMC().beta == 5.0 and PowerMCMC().beta == 0.0
    assert resolve_hyperparameters("temperature", {})["temperature"] == 0.25
    for m in RERANK_METHODS:
        hp = resolve_hyperparameters(m, {})
        assert hp["temperature"] == 1.0 and hp["top_p"] == 1.0


def test_per_prompt_keys_make_samples_independent_of_batching():
    cfg = tiny_config()
    params = init_params(cfg, jax.random.key(11), jnp.float32, scale=0.3)
    prompts = [[1, 2, 3], [4, 5], [6]]
    keys = jax.random.split(jax.random.key(5), 3)
    batched = decode(TransformerLM(cfg), params, prompts, "best_of_n", keys=keys, eos_ids=(), n=2, max_new_tokens=4)
    for i, p in enumerate(prompts):
        alone = decode(TransformerLM(cfg), params, [p], "best_of_n", keys=keys[i:i + 1], eos_ids=(), n=2, max_new_tokens=4)
        single_key = decode(TransformerLM(cfg), params, [p], "best_of_n", keys[i], eos_ids=(), n=2, max_new_tokens=4)
        for a, b, c in zip(batched.outputs[i].candidates, alone.outputs[0].candidates,
                           single_key.outputs[0].candidates):
            assert a.tokens == b.tokens == c.tokens
    with pytest.raises(ValueError, match="exactly one of key"):
        decode(TransformerLM(cfg), params, prompts, "greedy", jax.random.key(0), keys=keys, eos_ids=(), max_new_tokens=4)
    with pytest.raises(ValueError, match="one key per prompt"):
        decode(TransformerLM(cfg), params, prompts, "greedy", keys=keys[:2], eos_ids=(), max_new_tokens=4)


def test_resolved_hyperparameters_match_runs_recorded_before_the_dataclasses(tmp_path):
    """`degs eval` stores the resolved hyperparameters in run.json and refuses to resume a
    directory whose configuration differs: the records of the default configurations
    must stay what the string-keyed defaults produced (names and values), so that runs
    started before the typed hyperparameters resume."""
    common = dict(tau=0.25, lsub=None, lens_chunk=None, top_k=0, top_p=1.0, cache_dtype=None)
    sampling = dict(max_new_tokens=3072, probe=True)
    pool = dict(sampling, n=16, temperature=1.0)
    chain = dict(alpha=4.0, block_len=192, num_blocks=16, mh_steps=10, n_chains=1,
                 reference_quirks=False)
    recorded = {
        "greedy": sampling, "temperature": dict(sampling, temperature=0.25),
        "best_of_n": pool, "best_of_n_entropy": pool, "degs_rerank": dict(pool, alpha=4.0, beta=5.0),
        "power_mcmc": dict(chain, beta=0.0), "degs_mcmc": dict(chain, beta=5.0),
    }
    for method, values in recorded.items():
        # lens_chunk moved onto the transformer adapter; reading run.json's method drops it
        (tmp_path / "run.json").write_text(json.dumps({"config": {"method": method,
                                                                  "hyperparameters": {**common, **values}},
                                                       "invocations": []}))
        old = method_from_record(read_run_file(tmp_path / "run.json")["config"])
        assert hyperparameters_for(method) == old, method
        # Fields added later (draft_tokens, draft_lookup: issue 55) are new in the resolved record, at the
        # default an old run read back gets (the line above): its directory still resumes.
        added = {"draft_tokens": 0, "draft_lookup": 0} if "mh_steps" in values else {}
        assert resolve_hyperparameters(method, {}) == {**{k: v for k, v in {**common, **values}.items()
                                                          if k != "lens_chunk"}, **added}, method
