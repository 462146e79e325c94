"""Generation core (degs_jax.generation) on a tiny random fp32 model, CPU.

What is checked against an independent teacher-forced forward (one uncached pass over
the finished sequence, `forward(..., cache=None)`):
- the normaliser identity alpha·log p(v) − log q(v) = log Σ_w p(w)^alpha on the values
  *recorded* during generation (docs/design.md §4, exactness notes);
- greedy = argmax at every step; temperature with top_k = 1 = greedy; log q under
  top-k / top-p is the truncated density; log p is always the raw full-vocabulary one;
- token x_t of row b is the categorical draw with fold_in(key_b, t) (absolute position);
- recorded d_t / H_L(t) = scoring.token_stats of the same sequence.
And the bookkeeping: determinism (bitwise) and batch independence, continuation from a
cached prefix (`fresh_from`), EOS handling (inside the budget, immediately, never),
ended rows left untouched, counters.

Tolerances: both sides are fp32 on the same weights; the cached (one token at a time)
and the uncached forward differ only in summation order, i.e. by a few fp32 ulps of
logits of size ~10, and log-softmax / logsumexp add a few ulps of values of size
~alpha·|log p| <= ~40 (ulp 4e-6 at 32). 1e-5 is therefore a few-ulp bound; an actual
bug (a wrong temperature, a missing normaliser, a value from the wrong position) is
off by >= 1e-2.
"""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from degs_jax.generation import (GenState, MinP, Proposal, SamplerSpec, TopK, TopP, Typical, completions,
                                 generate, kth_largest, pad_prompts, prefill, truncations)
from degs_jax.methods import hyperparameters_for
from degs_jax.lens import LensConfig, sequence_depth
from degs_jax.models import TransformerLM
from degs_jax.models import forward, init_params
from degs_jax.scoring import token_stats
from tiny_models import tiny_config

LSUB = (1, 2, 3)  # default_lsub(3)
K = len(LSUB)
# Lens entropies of this model (scale 0.3) spread over ~2.8..3.7 nats with median ~3.33:
# tau there makes d_t take every value in {1, 2, 3} (the default 0.25 would give d_t = L
# everywhere and test nothing).
TAU = 3.3
LENS = LensConfig(lsub=LSUB, tau=TAU)
PROMPTS = [[3, 14, 15, 92, 65], [35, 89, 79, 32, 38, 46, 26, 43, 38], [7, 1, 4]]
P = np.array([len(p) for p in PROMPTS])
NEW = 8
S = 32  # slots: prompts are padded to 16 (pad_prompts' bucket) + room for new tokens
TOL = 1e-5


@pytest.fixture(scope="module")
def model():
    cfg = tiny_config("Qwen2ForCausalLM")  # vocab 97, 3 layers, context 512
    params = init_params(cfg, jax.random.key(0), jnp.float32, scale=0.3)
    return cfg, params


def start(cfg, params, prompts, max_len=S) -> GenState:
    toks, lens = pad_prompts(prompts)
    return prefill(TransformerLM(cfg), params, jnp.asarray(toks), jnp.asarray(lens), max_len, jnp.float32)


def teacher_forced_logits(cfg, params, seq) -> np.ndarray:
    """[S, V] fp32 logits of one uncached forward over `seq` (right-padded to S, which
    a causal model ignores): row t predicts x_{t+1}."""
    toks = np.zeros((1, S), np.int32)
    toks[0, : len(seq)] = seq
    out = forward(params, cfg, jnp.asarray(toks), jnp.arange(S, dtype=jnp.int32)[None])
    return np.asarray(out.logits[0])


def log_softmax(z):
    return np.asarray(jax.nn.log_softmax(jnp.asarray(z), axis=-1))


def row_seq(state, b):
    return np.asarray(state.tokens[b, : int(state.length[b])])


def keys_for(seed, n=len(PROMPTS)):
    return jax.random.split(jax.random.key(seed), n)


# Sampling with the proposal of alpha = 4 (temperature 1/4), probing on, no EOS.
ALPHA = 4.0
SPEC = SamplerSpec(Proposal(1.0 / ALPHA), lens=LENS)


@pytest.fixture(scope="module")
def sampled(model):
    cfg, params = model
    state = start(cfg, params, PROMPTS)
    keys = keys_for(42)
    out = generate(TransformerLM(cfg), params, state, state.prompt_len + NEW, keys, SPEC)
    return out, keys


# Greedy with probing, no EOS, 10 tokens.
GREEDY = SamplerSpec(Proposal(0.0), lens=LENS)
GREEDY_NEW = 10


@pytest.fixture(scope="module")
def greedy_run(model):
    cfg, params = model
    state = start(cfg, params, PROMPTS)
    return generate(TransformerLM(cfg), params, state, state.prompt_len + GREEDY_NEW, keys_for(0), GREEDY)


# ------------------------------------------------------------------ exactness identity


@pytest.mark.parametrize("alpha", [ALPHA, 1.5])
def test_normaliser_identity_on_recorded_values(model, sampled, alpha):
    """alpha·log p(v) − log q(v) = log Σ_w p(w)^alpha for every recorded token.

    alpha = 1.5 has an inexact temperature 1/alpha (the proposal divides by it)."""
    cfg, params = model
    if alpha == ALPHA:
        state, _ = sampled
    else:
        state = start(cfg, params, PROMPTS)
        state = generate(TransformerLM(cfg), params, state, state.prompt_len + NEW, keys_for(3),
                         SamplerSpec(Proposal(1.0 / alpha)))
    logp, logq = np.asarray(state.logp), np.asarray(state.logq)
    worst = 0.0
    for b in range(len(PROMPTS)):
        seq = row_seq(state, b)
        assert len(seq) == P[b] + NEW
        lp = log_softmax(teacher_forced_logits(cfg, params, seq))
        t = np.arange(P[b], len(seq))
        a = alpha * lp[t - 1].astype(np.float64)
        rhs = a.max(-1) + np.log(np.exp(a - a.max(-1, keepdims=True)).sum(-1))
        lhs = alpha * logp[b, t] - logq[b, t]
        worst = max(worst, float(np.abs(lhs - rhs).max()))
    print(f"alpha={alpha}: max |alpha·log p − log q − log Σ p^alpha| = {worst:.2e}")
    assert worst < TOL, worst


def test_token_drawn_with_fold_in_of_absolute_position(model, sampled):
    """x_t of row b is categorical(fold_in(key_b, t), log q_t): independent of batch,
    of the step count and of where the current call started."""
    cfg, params = model
    state, keys = sampled
    for b in range(len(PROMPTS)):
        seq = row_seq(state, b)
        z = teacher_forced_logits(cfg, params, seq)
        for t in range(P[b], len(seq)):
            lq = SPEC.proposal.log_density(jnp.asarray(z[t - 1 : t]))[0]
            tok = int(jax.random.categorical(jax.random.fold_in(keys[b], t), lq))
            assert tok == seq[t], (b, t)


def test_recorded_log_p_log_q_match_teacher_forced(model, sampled):
    cfg, params = model
    state, _ = sampled
    for b in range(len(PROMPTS)):
        seq = row_seq(state, b)
        z = teacher_forced_logits(cfg, params, seq)
        lp, lq = log_softmax(z), log_softmax(z * ALPHA)
        t = np.arange(P[b], len(seq))
        np.testing.assert_allclose(state.logp[b, t], lp[t - 1, seq[t]], atol=TOL, rtol=0)
        np.testing.assert_allclose(state.logq[b, t], lq[t - 1, seq[t]], atol=TOL, rtol=0)
        # Prompt slots and slots past the end are never written.
        assert np.all(np.asarray(state.logp[b, : P[b]]) == 0)
        assert np.all(np.asarray(state.logp[b, len(seq):]) == 0)


# ------------------------------------------------------------------ determinism, batching


def test_same_key_bitwise_different_key_differs(model, sampled):
    cfg, params = model
    state, keys = sampled
    fresh = start(cfg, params, PROMPTS)
    again = generate(TransformerLM(cfg), params, fresh, fresh.prompt_len + NEW, keys, SPEC)
    for name in ("tokens", "logp", "logq", "depth", "final_entropy", "length"):
        np.testing.assert_array_equal(getattr(again, name), getattr(state, name), err_msg=name)
    other = generate(TransformerLM(cfg), params, fresh, fresh.prompt_len + NEW, keys_for(43), SPEC)
    differ = [completions(other)[b] != completions(state)[b] for b in range(len(PROMPTS))]
    assert any(differ), "different keys gave the same samples in every row"
    # Rows of one batch have distinct keys: the same prompt twice gives different samples.
    twice = start(cfg, params, [PROMPTS[0]] * 3)
    twice = generate(TransformerLM(cfg), params, twice, twice.prompt_len + NEW, keys_for(42), SPEC)
    assert len({tuple(c) for c in completions(twice)}) > 1


def test_batch_equals_rows_one_by_one(model, sampled):
    """Rows with different prompt lengths and limits in one batch = each row alone with
    its own key (and the same buffer size)."""
    cfg, params = model
    state, keys = sampled
    limits = jnp.asarray(P + np.array([6, 8, 5]), jnp.int32)
    batch = generate(TransformerLM(cfg), params, start(cfg, params, PROMPTS), limits, keys, SPEC)
    for b in range(len(PROMPTS)):
        alone = generate(TransformerLM(cfg), params, start(cfg, params, [PROMPTS[b]]), limits[b:b + 1],
                         keys[b:b + 1], SPEC)
        n = int(limits[b])
        assert int(batch.length[b]) == int(alone.length[0]) == n
        np.testing.assert_array_equal(batch.tokens[b], alone.tokens[0])
        np.testing.assert_array_equal(batch.depth[b], alone.depth[0])
        for name in ("logp", "logq", "final_entropy"):
            np.testing.assert_allclose(getattr(batch, name)[b], getattr(alone, name)[0],
                                       atol=TOL, rtol=0, err_msg=name)
        for name in ("n_generated", "n_forward", "n_probed"):
            assert int(getattr(batch, name)[b]) == int(getattr(alone, name)[0]), name
    # A shorter limit only truncates: the first tokens agree with the longer run.
    for b in range(len(PROMPTS)):
        n = int(limits[b])
        np.testing.assert_array_equal(batch.tokens[b, :n], state.tokens[b, :n])


# ------------------------------------------------------------------ cached-prefix continuation


@pytest.mark.parametrize("cut", [(0, 5, 7), (3, 0, 1)])
def test_continuation_from_cached_prefix_matches_regeneration(model, sampled, cut):
    """Cut the finished state at P + m (stale KV beyond the cut stays in the cache) and
    continue with fresh_from = P + m, versus a fresh prefill of prompt + first m tokens
    continued with the same row keys: same tokens, same per-token statistics."""
    cfg, params = model
    state, keys = sampled
    m = np.asarray(cut)
    cutpos = jnp.asarray(P + m, jnp.int32)
    limit = state.prompt_len + NEW
    truncated = dataclasses.replace(state, length=cutpos, ended=jnp.zeros_like(state.ended))
    cont = generate(TransformerLM(cfg), params, truncated, limit, keys, SPEC, fresh_from=cutpos)

    prefixes = [list(row_seq(state, b)[: P[b] + m[b]]) for b in range(len(PROMPTS))]
    ref = generate(TransformerLM(cfg), params, start(cfg, params, prefixes), limit, keys, SPEC)

    for b in range(len(PROMPTS)):
        n, c = P[b] + NEW, P[b] + m[b]
        assert int(cont.length[b]) == int(ref.length[b]) == n
        np.testing.assert_array_equal(cont.tokens[b, :n], ref.tokens[b, :n])
        # Same keys, same prefix: the continuation reproduces the original row.
        np.testing.assert_array_equal(cont.tokens[b, :n], state.tokens[b, :n])
        new = slice(c, n)
        np.testing.assert_array_equal(cont.depth[b, new], ref.depth[b, new])
        for name in ("logp", "logq", "final_entropy"):
            np.testing.assert_allclose(getattr(cont, name)[b, new], getattr(ref, name)[b, new],
                                       atol=TOL, rtol=0, err_msg=name)
        # Below the cut the continued state keeps the stored values, bit for bit.
        for name in ("logp", "logq", "depth", "final_entropy"):
            np.testing.assert_array_equal(getattr(cont, name)[b, :c], getattr(state, name)[b, :c],
                                          err_msg=name)
        # Counters: NEW - m samples, one forward per consumed position (the last prefix
        # token is re-read once; the last new token is consumed since no EOS ended it).
        assert int(cont.n_generated[b] - state.n_generated[b]) == NEW - m[b]
        assert int(cont.n_forward[b] - state.n_forward[b]) == NEW - m[b] + 1
        assert int(cont.n_probed[b] - state.n_probed[b]) == K * (NEW - m[b] + 1)
        assert int(ref.n_forward[b]) == c + NEW - m[b] + 1


def test_stats_below_fresh_from_are_never_rewritten(model, sampled):
    """Poison every stored statistic below the cut: a continuation must keep it (it may
    only write slots >= fresh_from), and the new slots must not depend on it."""
    cfg, params = model
    state, keys = sampled
    cutpos = jnp.asarray(P + np.array([2, 4, 6]), jnp.int32)
    below = jnp.arange(S)[None] < cutpos[:, None]
    poison = dict(logp=jnp.where(below, 1234.5, state.logp), logq=jnp.where(below, -77.0, state.logq),
                  depth=jnp.where(below, 55, state.depth),
                  final_entropy=jnp.where(below, 99.0, state.final_entropy))
    base = dataclasses.replace(state, length=cutpos, ended=jnp.zeros_like(state.ended))
    clean = generate(TransformerLM(cfg), params, base, state.prompt_len + NEW, keys, SPEC, fresh_from=cutpos)
    dirty = generate(TransformerLM(cfg), params, dataclasses.replace(base, **poison), state.prompt_len + NEW,
                     keys, SPEC, fresh_from=cutpos)
    for name, value in poison.items():
        got = np.asarray(getattr(dirty, name))
        np.testing.assert_array_equal(got[np.asarray(below)], np.asarray(value)[np.asarray(below)],
                                      err_msg=f"{name} below fresh_from was rewritten")
        np.testing.assert_array_equal(got[~np.asarray(below)],
                                      np.asarray(getattr(clean, name))[~np.asarray(below)], err_msg=name)


# ------------------------------------------------------------------ greedy and truncation


def test_greedy_is_teacher_forced_argmax(model, greedy_run):
    cfg, params = model
    state = greedy_run
    for b in range(len(PROMPTS)):
        seq = row_seq(state, b)
        assert len(seq) == P[b] + GREEDY_NEW
        z = teacher_forced_logits(cfg, params, seq)
        t = np.arange(P[b], len(seq))
        np.testing.assert_array_equal(seq[t], z[t - 1].argmax(-1))
        np.testing.assert_allclose(state.logp[b, t], log_softmax(z)[t - 1, seq[t]], atol=TOL, rtol=0)
        assert np.all(np.asarray(state.logq[b, t]) == 0.0)  # greedy: log q = log 1
    # Counters: GREEDY_NEW samples; forwards = prefill P + one step per sampled token + the
    # step that consumes the last token (no EOS ended the row); K probes per step.
    np.testing.assert_array_equal(state.n_generated, GREEDY_NEW)
    np.testing.assert_array_equal(state.n_forward, P + GREEDY_NEW + 1)
    np.testing.assert_array_equal(state.n_probed, K * (GREEDY_NEW + 1))
    assert not np.any(np.asarray(state.ended))


def test_top_k_1_equals_greedy(model, greedy_run):
    cfg, params = model
    state = start(cfg, params, PROMPTS)
    topk1 = generate(TransformerLM(cfg), params, state, state.prompt_len + GREEDY_NEW, keys_for(5),
                     SamplerSpec(Proposal(0.7, (TopK(1),)), lens=LENS))
    np.testing.assert_array_equal(topk1.tokens, greedy_run.tokens)
    np.testing.assert_array_equal(topk1.depth, greedy_run.depth)
    np.testing.assert_allclose(topk1.logp, greedy_run.logp, atol=1e-6, rtol=0)
    assert np.all(np.asarray(topk1.logq) == 0.0)  # the truncated density is one-hot


def truncated_log_density(z: np.ndarray, temperature: float, top_k: int, top_p: float,
                          min_p: float = 0.0, typical_p: float = 1.0) -> np.ndarray:
    """Reference in float64, HF's warpers in HF's order on z/T: top-k; the smallest sorted
    prefix of the renormalised distribution whose mass reaches top_p (the crossing token
    kept); min-p (tokens at least min_p times as likely as the most likely); typical (by
    |surprisal - entropy|, the smallest prefix whose mass reaches typical_p)."""
    z = np.asarray(z, np.float64) / temperature
    keep = np.ones(z.shape, bool)

    def probs():
        p = np.where(keep, np.exp(z - z.max()), 0.0)
        return p / p.sum()

    def smallest_prefix(p, order, mass):
        before = np.cumsum(p[order]) - p[order]
        kept = np.zeros_like(keep)
        kept[order[before < mass]] = True
        return kept

    if top_k:
        keep &= z >= np.sort(z)[-top_k]
    if top_p < 1.0:
        p = probs()
        keep &= smallest_prefix(p, np.argsort(-p, kind="stable"), top_p)
    if min_p > 0.0:
        p = probs()
        keep &= p >= min_p * p.max()
    if typical_p < 1.0:
        p = probs()
        with np.errstate(divide="ignore"):
            surprisal = -np.log(p)
        entropy = np.sum(p[keep] * surprisal[keep])
        distance = np.where(keep, np.abs(surprisal - entropy), np.inf)
        keep &= smallest_prefix(p, np.argsort(distance, kind="stable"), typical_p)
    out = np.full(z.shape, -np.inf)
    out[keep] = z[keep] - np.log(np.exp(z[keep] - z.max()).sum()) - z.max()
    return out


@pytest.mark.parametrize("top_k, top_p, min_p, typical_p", [
    (5, 1.0, 0.0, 1.0), (0, 0.6, 0.0, 1.0), (8, 0.7, 0.0, 1.0), (0, 1.0, 0.0, 1.0),
    (0, 1.0, 0.1, 1.0), (0, 1.0, 0.0, 0.5), (0, 1.0, 0.0, 0.9), (20, 0.95, 0.05, 0.8)])
def test_proposal_log_density_truncation(top_k, top_p, min_p, typical_p):
    z = 2.0 * jax.random.normal(jax.random.key(11), (4, 97))
    lq = np.asarray(Proposal(0.8, truncations(top_k, top_p, min_p, typical_p)).log_density(z))
    for b in range(4):
        ref = truncated_log_density(np.asarray(z[b]), 0.8, top_k, top_p, min_p, typical_p)
        kept = np.isfinite(ref)
        np.testing.assert_array_equal(np.isfinite(lq[b]), kept)
        assert np.all(lq[b][~kept] == -np.inf)
        np.testing.assert_allclose(lq[b][kept], ref[kept], atol=1e-5, rtol=0)
        assert abs(np.exp(lq[b][kept].astype(np.float64)).sum() - 1.0) < 1e-5  # a density on the kept set
        if top_k:
            assert kept.sum() <= top_k
            assert set(np.flatnonzero(kept)) <= set(np.argsort(-np.asarray(z[b]))[:top_k])
        if (top_p, min_p, typical_p) != (1.0, 0.0, 1.0):
            assert 1 <= kept.sum() < 97


@pytest.mark.parametrize("kwargs, match", [
    (dict(top_k=-1), r"top_k must be >= 0 \(0 = off\)"), (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(min_p=-0.1), r"min_p must be in \(0, 1\]"), (dict(typical_p=0.0), r"typical_p must be in \(0, 1\]")])
def test_truncation_values_are_checked(kwargs, match):
    with pytest.raises(ValueError, match=match):
        truncations(**kwargs)
    with pytest.raises(ValueError, match=match):  # a method checks them when it is built
        hyperparameters_for("temperature", **kwargs)


def test_truncations_in_hf_order_and_only_when_on():
    assert truncations() == ()
    assert truncations(top_k=3, top_p=0.9, min_p=0.1, typical_p=0.8) == (TopK(3), TopP(0.9), MinP(0.1), Typical(0.8))
    assert truncations(typical_p=0.8, top_k=3) == (TopK(3), Typical(0.8))
    with pytest.raises(TypeError, match="Truncation values"):
        Proposal(1.0, (0.9,))


def test_recorded_log_q_is_the_truncated_density(model):
    """Under top-k + top-p the recorded log q is the truncated (renormalised) density of
    the sampled token, which lies in the kept set; log p stays the raw full-vocabulary one."""
    cfg, params = model
    spec = SamplerSpec(Proposal(0.8, (TopK(7), TopP(0.9))), lens=LENS)
    state = start(cfg, params, PROMPTS)
    state = generate(TransformerLM(cfg), params, state, state.prompt_len + NEW, keys_for(8), spec)
    truncated_somewhere = False
    for b in range(len(PROMPTS)):
        seq = row_seq(state, b)
        z = teacher_forced_logits(cfg, params, seq)
        lp = log_softmax(z)
        for t in range(P[b], len(seq)):
            ref = truncated_log_density(z[t - 1], 0.8, 7, 0.9)
            assert np.isfinite(ref[seq[t]]), (b, t, "sampled outside the kept set")
            assert abs(float(state.logq[b, t]) - ref[seq[t]]) < TOL
            assert abs(float(state.logp[b, t]) - lp[t - 1, seq[t]]) < TOL
            truncated_somewhere |= abs(ref[seq[t]] - log_softmax(z[t - 1] / 0.8)[seq[t]]) > 1e-3
    assert truncated_somewhere, "truncation never changed q: the test would not see a bug"


# ------------------------------------------------------------------ lens statistics


def test_recorded_depth_and_entropy_match_token_stats(model, sampled):
    """d_t (exactly) and H_L(t) (within 1e-5) recorded during generation, from the step
    that consumed x_t, equal the teacher-forced scoring of the finished sequence."""
    cfg, params = model
    state, _ = sampled
    stats = jax.device_get(token_stats(TransformerLM(cfg), params, state.tokens, LENS))
    depth, ent = stats.depth, stats.final_entropy
    seen = set()
    for b in range(len(PROMPTS)):
        t = np.arange(P[b], int(state.length[b]))  # every completion token was consumed
        np.testing.assert_array_equal(state.depth[b, t], depth[b, t])
        np.testing.assert_allclose(state.final_entropy[b, t], ent[b, t], atol=TOL, rtol=0)
        seen |= set(depth[b, t].tolist())
        assert np.all(np.asarray(state.depth[b, : P[b]]) == -1)  # the prompt is never scored
    assert len(seen) > 1, f"tau={TAU} gives a constant d_t {seen}: the test would be vacuous"
    mask = state.completion_mask(scored=True)
    D = np.asarray(sequence_depth(state.depth, mask, cfg.num_layers))
    for b in range(len(PROMPTS)):
        t = np.arange(P[b], int(state.length[b]))
        assert abs(D[b] - depth[b, t].mean() / cfg.num_layers) < 1e-6


# ------------------------------------------------------------------ EOS


@pytest.fixture(scope="module")
def eos_run(model, greedy_run):
    """Greedy with an EOS id chosen from the greedy paths so that row 0 meets it inside the
    budget, row 1 emits it immediately, and row 2 never does (hits the token budget)."""
    cfg, params = model
    paths = completions(greedy_run)
    eos = paths[1][0]
    assert eos in paths[0][1:] and eos not in paths[2], ("greedy paths changed: pick another EOS", paths)
    spec = SamplerSpec(Proposal(0.0), eos_ids=(eos,), lens=LENS)
    state = start(cfg, params, PROMPTS)
    limit = state.prompt_len + GREEDY_NEW
    return generate(TransformerLM(cfg), params, state, limit, keys_for(0), spec), spec, eos, paths


def test_eos_inside_immediately_and_never(model, greedy_run, eos_run):
    cfg, params = model
    state, _, eos, paths = eos_run
    comps = completions(state)
    j = paths[0].index(eos)
    assert comps[0] == paths[0][: j + 1] and 0 < j < GREEDY_NEW - 1  # EOS inside the budget
    assert comps[1] == [eos]  # immediate EOS
    assert comps[2] == paths[2]  # budget reached without EOS
    np.testing.assert_array_equal(state.ended, [True, True, False])
    k = np.array([j + 1, 1, GREEDY_NEW])
    np.testing.assert_array_equal(state.length, P + k)
    np.testing.assert_array_equal(state.n_generated, k)
    # An EOS is not consumed; the budget-ended row consumes its last token.
    consumed = k - np.array([1, 1, 0])
    np.testing.assert_array_equal(state.n_forward, P + consumed + 1)
    np.testing.assert_array_equal(state.n_probed, K * (consumed + 1))
    for b in range(3):
        n = int(state.length[b])
        # Nothing is written past the end; the final EOS has no d_t / H_L.
        assert np.all(np.asarray(state.tokens[b, n:]) == 0)
        assert np.all(np.asarray(state.logp[b, n:]) == 0)
        if comps[b][-1] == eos:
            assert int(state.depth[b, n - 1]) == -1 and float(state.final_entropy[b, n - 1]) == 0.0
        # Before the EOS the row is the greedy run, statistics included.
        scored = slice(P[b], n - int(bool(state.ended[b])))
        np.testing.assert_array_equal(state.depth[b, scored], greedy_run.depth[b, scored])
        np.testing.assert_allclose(state.logp[b, P[b]:n], greedy_run.logp[b, P[b]:n], atol=1e-6)
    # D(x) excludes the final EOS; the immediate-EOS completion has no scored token: D = 0.
    mask = np.asarray(state.completion_mask(scored=True))
    np.testing.assert_array_equal(mask.sum(1), [j, 0, GREEDY_NEW])
    D = np.asarray(sequence_depth(state.depth, mask, cfg.num_layers))
    assert D[1] == 0.0
    ref0 = np.asarray(greedy_run.depth[0, P[0]:P[0] + j]).mean() / cfg.num_layers
    assert abs(D[0] - ref0) < 1e-6


def test_ended_rows_untouched_by_later_generate(model, eos_run):
    cfg, params = model
    state, spec, eos, paths = eos_run
    # Same limit: nothing to do, nothing changes (counters included).
    same = generate(TransformerLM(cfg), params, state, state.prompt_len + GREEDY_NEW, keys_for(9), spec)
    chex.assert_trees_all_equal(same, state)
    # Larger limit: ended rows 0 and 1 stay bit for bit (cache rows too); row 2 continues.
    more = generate(TransformerLM(cfg), params, state, state.prompt_len + GREEDY_NEW + 4, keys_for(9), spec)
    for f in dataclasses.fields(GenState):
        if f.name == "cache_row_axis" or getattr(state, f.name) is None:  # static; no stop strings
            continue
        if f.name == "cache":
            for a, b in ((more.cache.k, state.cache.k), (more.cache.v, state.cache.v)):
                np.testing.assert_array_equal(a[:, :2], b[:, :2])
        else:
            np.testing.assert_array_equal(getattr(more, f.name)[:2], getattr(state, f.name)[:2],
                                          err_msg=f.name)
    # Row 2 continued in two calls = one call to the larger limit.
    direct = start(cfg, params, PROMPTS)
    direct = generate(TransformerLM(cfg), params, direct, direct.prompt_len + GREEDY_NEW + 4, keys_for(0), spec)
    assert completions(more)[2] == completions(direct)[2]
    assert len(completions(more)[2]) > GREEDY_NEW
    np.testing.assert_array_equal(more.depth[2], direct.depth[2])
    np.testing.assert_allclose(more.logp[2], direct.logp[2], atol=1e-6)
    # The second call re-reads the last token once (its statistics already exist).
    added = int(more.n_generated[2] - state.n_generated[2])
    extra = 0 if bool(more.ended[2]) else 1
    assert int(more.n_forward[2] - state.n_forward[2]) == added + extra


def test_eos_dominant_model_ends_immediately(model):
    """A model whose EOS logit dominates everywhere: every sampled completion is [EOS],
    flagged ended, with no scored token (D = 0) and one forward (no consumption)."""
    cfg, params = model
    eos = cfg.eos_token_ids[0]
    params = eos_biased(params, eos, 30.0)
    state = start(cfg, params, PROMPTS)
    spec = SamplerSpec(Proposal(1.0), eos_ids=(eos,), lens=LENS)
    state = generate(TransformerLM(cfg), params, state, state.prompt_len + NEW, keys_for(1), spec)
    assert completions(state) == [[eos]] * 3
    assert np.all(np.asarray(state.ended))
    np.testing.assert_array_equal(state.n_forward, P + 1)
    D = sequence_depth(state.depth, state.completion_mask(scored=True), cfg.num_layers)
    np.testing.assert_array_equal(D, 0.0)


def eos_biased(params, eos: int, strength: float):
    """Shift every embedding along hidden unit 0 so the (normalised) final residual has a
    large positive unit 0, and make the EOS row of the untied lm_head read that unit:
    logit(EOS) ≈ strength · const at every position."""
    embed = params.embed.at[:, 0].add(3.0)
    head = params.lm_head.at[eos].set(0.0).at[eos, 0].set(strength)
    return dataclasses.replace(params, embed=embed, lm_head=head)


@pytest.mark.parametrize("k", [1, 7, 50, 96, 97])
def test_kth_largest_is_lax_top_k_bit_for_bit(k):
    """The threshold search of top-k truncation (no partial sort) finds exactly the k-th
    largest value, ties counted with multiplicity: rows with ties, -inf (masked) entries,
    signed zeros, tiny and huge spreads."""
    rng = np.random.default_rng(k)
    V = 97
    rows = [rng.normal(0, 1, V), rng.normal(0, 1e-3, V), rng.normal(0, 1e3, V),
            np.round(rng.normal(0, 1, V), 1),  # many ties
            np.where(np.arange(V) < 40, -np.inf, rng.normal(0, 3, V)),
            np.where(np.arange(V) % 2 == 0, 0.0, -0.0), np.full(V, -5.5),
            -np.abs(rng.normal(0, 2, V))]
    z = jnp.asarray(np.stack(rows).astype(np.float32))
    got = np.asarray(jax.jit(kth_largest, static_argnums=1)(z, k))
    want = np.asarray(jax.lax.top_k(z, k)[0][:, -1:])
    np.testing.assert_array_equal(got, want)
    # The truncated density is the one of a top-k by partial sort (what it replaced).
    spec = SamplerSpec(Proposal(0.7, (TopK(k),)))
    old = jax.nn.log_softmax(jnp.where(z / 0.7 >= jax.lax.top_k(z / 0.7, k)[0][:, -1:], z / 0.7, -jnp.inf), -1)
    np.testing.assert_array_equal(np.asarray(spec.proposal.log_density(z)), np.asarray(old))
