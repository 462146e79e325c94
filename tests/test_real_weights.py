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
from transformers import AutoModelForCausalLM, GenerationConfig

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


def test_logits_and_greedy_match_transformers(loads):
    torch = pytest.importorskip("torch")
    _, ours, cache = loads
    path = loading.builtin_gguf(ours.name, cache)
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    ids = _prompt_ids(ours.tokenizer)
    with torch.no_grad():
        want = hf(torch.from_numpy(ids)[None]).logits[0].numpy()
        # No EOS and no length constraints: exactly NEW_TOKENS argmax steps, like ours.
        gen = GenerationConfig(do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=None,
                               pad_token_id=ours.cfg.pad_token_id or 0)
        hf_tokens = hf.generate(torch.from_numpy(ids)[None], attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                generation_config=gen)[0, len(ids):].tolist()
    want = want.copy()  # our own array: the model and its last output can go now
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
    from degs_jax.generation import SamplerSpec, generate, prefill
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
    spec = SamplerSpec(temperature=0.7, eos_ids=model.eos_ids, lens=lens)
    new_tokens = 48 - 5 * (jnp.arange(len(ids)) % 8)  # rows go idle after 13..48 tokens (or EOS)
    state = generate(lm, params, state, lengths + new_tokens, jax.random.split(jax.random.key(0), len(ids)), spec)
    depth, length = np.asarray(state.depth), np.asarray(state.length)

    checked = near = 0
    w_u = np.asarray(params.unembedding(), np.float64)
    for r in (0, 3, 6, 9, 12, 15):  # both prompts, early and late stops (float64 is slow)
        seq = np.asarray(state.tokens[r, :length[r]])[None]
        pos = np.arange(seq.shape[1])[None]
        out = forward(params, cfg, jnp.asarray(seq), jnp.asarray(pos), capture=lens.lsub)
        x = np.asarray(out.residuals[:, 0], np.float64)  # [K, N, D]
        h = x / np.sqrt((x * x).mean(-1, keepdims=True) + cfg.rms_norm_eps) * np.asarray(params.final_norm, np.float64)
        z = h @ w_u.T
        z -= z.max(-1, keepdims=True)
        logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
        exact_h = -(np.exp(logp) * logp).sum(-1)  # [K, N]
        fp32_h = np.asarray(layer_entropies(lm, params, seq, lens.lsub))[:, 0]
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
