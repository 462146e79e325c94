"""Real GGUF weights (the two built-in models) against transformers' own GGUF loader.

Both sides dequantise the same file to fp32, so the only differences left are the
q/k un-permutation (gross if wrong), the config mapping and fp32 kernel order.
"""

import gc
import shutil
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from transformers import AutoModelForCausalLM

import degs_jax.models.transformer as transformer_module
from degs_jax.models import forward, init_cache
from degs_jax.models import loading
from degs_jax.models.loading import BUILTIN_MODELS, load

pytestmark = pytest.mark.slow

EXPECTED = {"smollm2-135m": ("LlamaForCausalLM", 30), "qwen2.5-coder-0.5b": ("Qwen2ForCausalLM", 24)}
PROMPT_TOKENS = 520
NEW_TOKENS = 32


# A fresh cache for SmolLM2 (its converted float32 entry is 0.5 GB): the first load there
# assembles, verifies and converts the real GGUF. The 0.5B model's entry is 2.5 GB, and the
# run's shared cache ($DEGS_JAX_CACHE, conftest) holds one already or will
# (test_gguf_tokenizer loads it too): a second copy is what filled CI's disk once.
FRESH_CACHE = {"smollm2-135m": True, "qwen2.5-coder-0.5b": False}


@pytest.fixture(scope="module", params=list(EXPECTED))
def loads(request, tmp_path_factory):
    """(first load, second load, their cache) of one built-in model; the second load must
    not parse the GGUF file again."""
    fresh = FRESH_CACHE[request.param]
    cache = tmp_path_factory.mktemp("degs_cache") if fresh else loading.default_cache_dir()
    start = time.perf_counter()
    first = load(request.param, "float32", cache_dir=cache, progress=False)
    mid = time.perf_counter()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(loading, "open_gguf", lambda *a: pytest.fail("GGUF parsed again on a cached load"))
        second = load(request.param, "float32", cache_dir=cache, progress=False)
    end = time.perf_counter()
    print(f"\n{request.param}: first load {mid - start:.1f}s, cached load {end - mid:.1f}s")
    yield first, second, cache
    if fresh:
        shutil.rmtree(cache)


def test_builtin_resolves_verifies_and_caches(loads):
    first, second, cache = loads
    arch, layers = EXPECTED[first.name]
    assert (first.cfg.architecture, first.cfg.num_layers) == (arch, layers)
    # the converted entry, named by the pinned sha256 its GGUF was verified against
    assert Path(first.source) == cache / f"gguf-v{loading.GGUF_CACHE_VERSION}" / BUILTIN_MODELS[first.name].sha256
    assert second.cfg == first.cfg and second.source == first.source
    text = Path(transformer_module.__file__).read_text()  # cached tokenizer == GGUF tokenizer
    assert second.tokenizer(text)["input_ids"] == first.tokenizer(text)["input_ids"]
    assert second.tokenizer.chat_template == first.tokenizer.chat_template
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 first.params, second.params)


def _prompt_ids(tokenizer) -> np.ndarray:
    """The first PROMPT_TOKENS tokens of a fixed in-repo text (code and prose)."""
    ids = tokenizer(Path(transformer_module.__file__).read_text())["input_ids"]
    assert len(ids) >= PROMPT_TOKENS
    return np.asarray(ids[:PROMPT_TOKENS])


def _log_softmax64(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def _kl_per_position(p_logits: np.ndarray, q_logits: np.ndarray, rows: int = 32) -> np.ndarray:
    """KL(softmax(p) || softmax(q)) per position, in float64, `rows` positions at a time:
    the whole [520, 151936] float64 log-softmax of the 0.5B model is 632 MB per array, and
    several at once pushed a CI worker out of memory (24 GiB shared by two workers)."""
    kl = []
    for start in range(0, len(p_logits), rows):
        lp, lq = _log_softmax64(p_logits[start:start + rows]), _log_softmax64(q_logits[start:start + rows])
        kl.append((np.exp(lp) * (lp - lq)).sum(-1))
    return np.concatenate(kl)


def _greedy(params, cfg, ids: np.ndarray, n: int):
    """Prefill `ids` into a KV cache, then decode `n` argmax tokens one at a time (the jitted
    `forward` compiles once for the [1, 1] step). Returns (prompt logits [T, V], tokens [n])."""
    T = len(ids)
    cache = init_cache(cfg, 1, T + n, jnp.float32)
    out = forward(params, cfg, jnp.asarray(ids, jnp.int32)[None], jnp.arange(T, dtype=jnp.int32)[None], cache)
    prompt_logits = np.asarray(out.logits[0])
    tokens = [int(np.argmax(prompt_logits[-1]))]
    for pos in range(T, T + n - 1):
        out = forward(params, cfg, jnp.full((1, 1), tokens[-1], jnp.int32), jnp.full((1, 1), pos, jnp.int32),
                      out.cache)
        tokens.append(int(jnp.argmax(out.logits[0, -1])))
    return prompt_logits, tokens


def _hf_greedy(hf, ids: np.ndarray, n: int):
    """`_greedy` with transformers' model and its own KV cache: the prompt's logits [T, V]
    from one forward, then `n` argmax tokens one step at a time (no EOS, no length
    constraints: what `generate` does greedily, without running the prompt a second time)."""
    import torch
    from transformers import DynamicCache

    # The cache goes in by position (its keyword was renamed in transformers 5) and is
    # filled in place.
    cache = DynamicCache()
    with torch.no_grad():
        out = hf(torch.from_numpy(ids)[None], None, None, cache, use_cache=True)
        prompt_logits = out.logits[0].numpy().copy()  # our own array: the model can go after
        tokens = [int(out.logits[0, -1].argmax())]
        for _ in range(n - 1):
            out = hf(torch.tensor([[tokens[-1]]]), None, None, cache, use_cache=True)
            tokens.append(int(out.logits[0, -1].argmax()))
    return prompt_logits, tokens


def test_logits_and_greedy_match_transformers(loads):
    torch = pytest.importorskip("torch")
    _, ours, cache = loads
    path = loading.builtin_gguf(ours.name, cache)
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    ids = _prompt_ids(ours.tokenizer)
    want, hf_tokens = _hf_greedy(hf, ids, NEW_TOKENS)
    del hf
    gc.collect()
    got, our_tokens = _greedy(ours.params, ours.cfg, ids, NEW_TOKENS)

    kl = _kl_per_position(want, got)  # [T]: KL(HF || ours) per position
    assert kl.shape == (len(ids),)
    print(f"\n{ours.name}: max KL {kl.max():.3e}, max |logit diff| {np.abs(want - got).max():.3e}, "
          f"greedy {our_tokens}")
    assert kl.max() <= 1e-3
    assert len(hf_tokens) == NEW_TOKENS
    assert our_tokens == hf_tokens


def test_recorded_collapse_depth_equals_the_exact_computation(loads):
    """d_t recorded while sampling (cached decode steps, fused streamed fp32 lens, the last
    layer's statistics shared with the output rows; 16 rows that stop at different
    lengths, so the lens runs on the live rows only) equals d_t computed independently:
    residuals captured at every probed layer, final-normed, unembedded and softmaxed in
    float64. Tokens whose float64 entropy at a probed layer lies within 1e-3 nats of tau
    are excluded (fp32 rounding may legitimately decide those either way; the fp32
    entropies differ from float64 by < 1e-4, asserted below), and must be rare."""
    _, model, _ = loads
    if model.name != "smollm2-135m":
        pytest.skip("checked on SmolLM2 (the float64 vocabulary products of the 0.5B model are large)")
    from degs_jax.text import encode_prompt
    from degs_jax.generation import Proposal, SamplerSpec, generate, prefill
    from degs_jax.lens import LensConfig
    from degs_jax.models import TransformerLM
    from degs_jax.scoring import layer_entropies
    from degs_jax.models.lens_head import LENS_LIVE_ROWS_MIN_BATCH

    cfg, params = model.cfg, model.params
    lm = TransformerLM(cfg)
    assert cfg.lens_rows == "live"
    lens = LensConfig.default(cfg.num_layers)
    prompts = ["What is 12 * 13? Put the answer in \\boxed{}.", "Name three colours of the rainbow."] * 8
    assert len(prompts) >= LENS_LIVE_ROWS_MIN_BATCH
    ids = [encode_prompt(model.tokenizer, p) for p in prompts]
    P = max(len(i) for i in ids)
    tokens = np.zeros((len(ids), P), np.int32)
    for r, i in enumerate(ids):
        tokens[r, :len(i)] = i
    lengths = jnp.asarray([len(i) for i in ids], jnp.int32)
    state = prefill(lm, params, jnp.asarray(tokens), lengths, P + 64, jnp.float32)
    spec = SamplerSpec(Proposal(0.7), eos_ids=model.eos_ids, lens=lens)
    new_tokens = 48 - 5 * (jnp.arange(len(ids)) % 8)  # rows go idle after 13..48 tokens (or EOS)
    state = generate(lm, params, state, lengths + new_tokens, jax.random.split(jax.random.key(0), len(ids)), spec)
    depth, length = np.asarray(state.depth), np.asarray(state.length)

    checked = near = 0
    w_u = np.asarray(params.unembedding(), np.float64)
    checked_rows = (0, 3, 6, 9, 12, 15)  # both prompts, early and late stops (float64 is slow)
    # The checked rows in one uncached forward and one lens pass (one compilation each, not
    # one per length): right padding does not change earlier positions under causal attention.
    seqs = np.asarray(state.tokens)[list(checked_rows), :int(length[list(checked_rows)].max())]
    pos = np.broadcast_to(np.arange(seqs.shape[1]), seqs.shape)
    residuals = np.asarray(forward(params, cfg, jnp.asarray(seqs), jnp.asarray(pos), capture=lens.lsub).residuals)
    fp32_entropies = np.asarray(layer_entropies(lm, params, seqs, lens.lsub))  # [K, rows, S]
    for i, r in enumerate(checked_rows):
        x = np.asarray(residuals[:, i, :length[r]], np.float64)  # [K, N, D]
        h = x / np.sqrt((x * x).mean(-1, keepdims=True) + cfg.rms_norm_eps) * np.asarray(params.final_norm, np.float64)
        z = h @ w_u.T
        z -= z.max(-1, keepdims=True)
        logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
        exact_h = -(np.exp(logp) * logp).sum(-1)  # [K, N]
        fp32_h = fp32_entropies[:, i, :length[r]]
        assert np.abs(fp32_h - exact_h).max() < 1e-4
        lsub = np.asarray(lens.lsub)[:, None]
        exact_d = np.where(exact_h <= lens.tau, lsub, cfg.num_layers).min(0)
        for t in range(len(ids[r]), length[r]):
            if depth[r, t] < 0:  # a final EOS is never consumed, so it has no d_t
                continue
            if (np.abs(exact_h[:, t] - lens.tau) < 1e-3).any():
                near += 1
                continue
            assert depth[r, t] == exact_d[t], (r, t, depth[r, t], exact_d[t], exact_h[:, t])
            checked += 1
    print(f"\nd_t checked at {checked} tokens ({near} within 1e-3 nats of tau)")
    assert checked >= 60 and near <= checked // 20


def test_decision_records_equal_a_direct_recomputation(loads):
    """The MH decision records of DEGS-MCMC on SmolLM2 (one step of 16 chains over two
    prompts at beta = 500, where the depth term decides some decisions) against a direct
    recomputation that shares nothing with the kernel's bookkeeping: the proposal redrawn
    by hand from the module docstring's streams, then both states scored by a full,
    uncached float64 forward (log p and the proposal's log q = log softmax(alpha·logits)
    per token, the collapse depth of every token from the probed residuals), and log r_0
    formed as docs/design.md §4 writes it. Tolerances: log r_0 within 1e-2 nats (fp32
    cached decode against a float64 uncached forward: about 1e-4 per token, as the logits'
    parity above, over at most 2 × 24 tokens, the target's terms times alpha = 4); ΔD to
    1e-6 (a mean of integers: exact up to fp32 rounding), except on rows with a token whose float64
    entropy lies within 1e-3 nats of tau (fp32 may decide those either way; must be rare)."""
    _, model, _ = loads
    if model.name != "smollm2-135m":
        pytest.skip("checked on SmolLM2 (the float64 vocabulary products of the 0.5B model are large)")
    import dataclasses
    from degs_jax.text import encode_prompt
    from degs_jax.generation import completions, generate, prefill
    from degs_jax.lens import LensConfig
    from degs_jax.mcmc import (ACCEPT_STREAM, CUT_STREAM, FIRST_MH_STREAM, REGENERATE_STREAM, MCMCConfig,
                               mh_steps)
    from degs_jax.models import TransformerLM
    from degs_jax.rows import fold_in_rows

    cfg, params = model.cfg, model.params
    lm = TransformerLM(cfg)
    lens = LensConfig.default(cfg.num_layers)
    alpha, B = 4.0, 16
    chain = MCMCConfig(alpha=alpha, beta=500.0, block_len=24, num_blocks=1, mh_steps=1, lens=lens,
                       eos_ids=model.eos_ids)
    ids = [encode_prompt(model.tokenizer, p) for p in ["What is 12 * 13?", "Name a colour of the rainbow."]]
    ids = [ids[r % 2] for r in range(B)]
    P = max(len(i) for i in ids)
    tokens = np.zeros((B, P), np.int32)
    for r, i in enumerate(ids):
        tokens[r, :len(i)] = i
    state = prefill(lm, params, jnp.asarray(tokens), jnp.asarray([len(i) for i in ids], jnp.int32),
                    P + chain.block_len, jnp.float32)
    limit = state.prompt_len + chain.block_len
    keys = jax.random.split(jax.random.key(11), B)
    state = generate(lm, params, state, limit, keys, chain.proposal)
    _, decisions = mh_steps(lm, params, state, keys, jnp.int32(0), jnp.ones((B,), bool), chain)
    record = jax.device_get(jax.tree.map(lambda field: field[:, 0], decisions))

    step_keys = fold_in_rows(keys, 0, FIRST_MH_STREAM)  # block 0, step 0: the hand's proposal
    n_x = state.length - state.prompt_len
    cut = state.prompt_len + jax.vmap(lambda k, n: jax.random.randint(k, (), 0, jnp.maximum(n, 1)))(
        fold_in_rows(step_keys, CUT_STREAM), n_x)
    restart = dataclasses.replace(state, length=cut, ended=jnp.zeros_like(state.ended))
    proposal = generate(lm, params, restart, limit, fold_in_rows(step_keys, REGENERATE_STREAM), chain.proposal,
                        fresh_from=cut)
    log_u = np.asarray(jnp.log(jax.vmap(jax.random.uniform)(fold_in_rows(step_keys, ACCEPT_STREAM))))

    w_u = np.asarray(params.unembedding(), np.float64)
    norm = np.asarray(params.final_norm, np.float64)
    eos = set(model.eos_ids)
    # x and x' of every row in one uncached forward (one compilation): right padding does
    # not change earlier positions under causal attention.
    # The probed layers end at the last (SmolLM2's L_sub): its residuals give log p too.
    assert lens.lsub[-1] == cfg.num_layers
    both = np.concatenate([np.asarray(state.tokens), np.asarray(proposal.tokens)])
    residuals = forward(params, cfg, jnp.asarray(both), jnp.broadcast_to(jnp.arange(both.shape[1]), both.shape),
                        capture=lens.lsub).residuals  # [K, 2B, S, D]

    def scored(row: int, length: int, prompt_len: int):
        """Per completion token t of `both[row]`: log p and log q (float64), d_t (None for
        a final EOS, which is not scored) and whether an entropy lies within 1e-3 of tau."""
        res = np.asarray(residuals[:, row, prompt_len - 1:length], np.float64)  # positions m-1 .. end-1
        h = res / np.sqrt((res * res).mean(-1, keepdims=True) + cfg.rms_norm_eps) * norm
        z = h @ w_u.T
        z -= z.max(-1, keepdims=True)
        logp_all = z - np.log(np.exp(z).sum(-1, keepdims=True))  # [K, N + 1, V]
        entropy = -(np.exp(logp_all) * logp_all).sum(-1)  # [K, N + 1] at the probed layers
        sharp = alpha * z[-1]  # the proposal: temperature 1 / alpha, no truncation
        sharp -= sharp.max(-1, keepdims=True)
        logq_all = sharp - np.log(np.exp(sharp).sum(-1, keepdims=True))
        rows = []
        for i, t in enumerate(range(prompt_len, length)):
            tok = both[row, t]
            final_eos = t == length - 1 and int(tok) in eos
            ent = entropy[:, i + 1]  # d_t: the residuals at position t (a final EOS is never consumed)
            depth = None if final_eos else int(np.where(ent <= lens.tau, np.asarray(lens.lsub), cfg.num_layers).min())
            rows.append((logp_all[-1, i, tok], logq_all[i, tok], depth, bool((np.abs(ent - lens.tau) < 1e-3).any())))
        return rows

    lengths, cuts = np.asarray(state.length), np.asarray(cut)
    prompt_len = np.asarray(state.prompt_len)
    xs = completions(state)
    checked_depth = near = 0
    worst = 0.0
    for r in range(B):
        full_y = np.asarray(proposal.tokens[r, :int(proposal.length[r])])
        sx, sy = scored(r, lengths[r], prompt_len[r]), scored(B + r, len(full_y), prompt_len[r])
        m = cuts[r] - prompt_len[r]
        log_r0 = (alpha * (sum(v[0] for v in sy[m:]) - sum(v[0] for v in sx[m:]))
                  + sum(v[1] for v in sx[m:]) - sum(v[1] for v in sy[m:]) + np.log(len(sx)) - np.log(len(sy)))
        worst = max(worst, abs(record.log_ratio_power[r] - log_r0))
        assert abs(record.log_ratio_power[r] - log_r0) < 1e-2, (r, record.log_ratio_power[r], log_r0)
        assert record.cut[r] == m and record.current_suffix[r] == len(sx) - m
        assert record.proposal_suffix[r] == len(sy) - m
        assert record.null_move[r] == (list(xs[r]) == list(full_y[prompt_len[r]:]))
        assert record.log_u[r] == log_u[r]
        if any(v[3] for v in sx + sy):
            near += 1
            continue
        depth_of = lambda s: np.mean([v[2] for v in s if v[2] is not None]) / cfg.num_layers
        np.testing.assert_allclose(record.depth_delta[r], depth_of(sy) - depth_of(sx), rtol=0, atol=1e-6)
        checked_depth += 1
    print(f"\ndecisions recomputed: 16 log r_0 (largest difference {worst:.2e} nats), {checked_depth} ΔD ({near} rows near tau); "
          f"{int(record.depth_decided.sum())} decided by beta·ΔD, {int(record.null_move.sum())} null moves")
    assert checked_depth >= 12
    assert not record.null_move.all() and record.depth_delta.any()
