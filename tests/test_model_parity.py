"""The JAX port against Hugging Face transformers (PyTorch) on tiny random configs, fp32
(the comparisons skip without torch; the port's own checks run anyway).

Tolerance 1e-4 max abs error (Levanter's convention for fp32 ports): both sides compute
in fp32 with different reduction orders; measured errors are ~3e-6 for these sizes, so
the bound leaves room without hiding a real mismatch (a wrong RoPE or norm is O(1)).
"""

from __future__ import annotations

import subprocess
import sys
import zipfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers

from degs_jax.models import ConfigError, ModelConfig, forward, init_cache, init_params, rms_norm
from degs_jax.models.checkpoint import params_to_hf
from tiny_models import TINY_LLAMA3_ROPE, tiny_config

TOL = 1e-4
CASES = {
    "qwen2-gqa-untied": dict(architecture="Qwen2ForCausalLM", num_heads=4, num_kv_heads=2, tie=False),
    "qwen2-gqa-tied": dict(architecture="Qwen2ForCausalLM", num_heads=4, num_kv_heads=1, tie=True),
    "llama-mha-untied": dict(architecture="LlamaForCausalLM", num_heads=4, num_kv_heads=4, tie=False),
    "llama-gqa-tied": dict(architecture="LlamaForCausalLM", num_heads=4, num_kv_heads=2, tie=True),
    # Qwen3: head_dim (16) is not hidden / heads (8), as in the real Qwen3 checkpoints.
    "qwen3-gqa-untied": dict(architecture="Qwen3ForCausalLM", num_heads=4, num_kv_heads=2, tie=False,
                             head_dim=16),
    "qwen3-mha-tied": dict(architecture="Qwen3ForCausalLM", num_heads=4, num_kv_heads=4, tie=True),
    "llama3-rope-scaling": dict(architecture="LlamaForCausalLM", num_heads=4, num_kv_heads=2, tie=False,
                                rope_scaling=TINY_LLAMA3_ROPE),
}


def _model(case):
    from hf_reference import hf_model  # torch: after the caller's importorskip

    cfg = tiny_config(**CASES[case])
    # scale 0.2: activations of order 1 so that errors are measured on realistic magnitudes.
    params = init_params(cfg, jax.random.key(hash(case) % 2**31), jnp.float32, scale=0.2)
    return cfg, params, hf_model(cfg, params)


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_and_residuals_match_hf_on_a_ragged_batch(case):
    torch = pytest.importorskip("torch")
    cfg, params, ref = _model(case)
    L = cfg.num_layers
    lengths = [13, 7]
    rng = np.random.default_rng(0)
    rows = [rng.integers(0, cfg.vocab_size, n) for n in lengths]
    T = max(lengths)
    tokens = np.zeros((2, T), np.int32)
    for b, r in enumerate(rows):
        tokens[b, : len(r)] = r
    positions = np.broadcast_to(np.arange(T, dtype=np.int32), (2, T))  # padding counts on
    out = forward(params, cfg, jnp.asarray(tokens), jnp.asarray(positions), capture=tuple(range(L + 1)))
    for b, r in enumerate(rows):
        with torch.no_grad():
            hf = ref(torch.tensor(r[None]), output_hidden_states=True)
        n = len(r)
        np.testing.assert_allclose(np.asarray(out.logits[b, :n]), hf.logits[0].numpy(), atol=TOL, rtol=0)
        for l in range(L):
            np.testing.assert_allclose(np.asarray(out.residuals[l, b, :n]),
                                       hf.hidden_states[l][0].numpy(), atol=TOL, rtol=0)
        # HF's last hidden_states row is post final norm; ours is pre-norm by design.
        normed = rms_norm(out.residuals[L, b, :n], params.final_norm, cfg.rms_norm_eps)
        np.testing.assert_allclose(np.asarray(normed), hf.hidden_states[L][0].numpy(), atol=TOL, rtol=0)


@pytest.mark.parametrize("case", ["qwen2-gqa-untied", "llama-mha-untied", "qwen3-gqa-untied",
                                  "llama3-rope-scaling"])
def test_cached_decode_equals_full_forward(case):
    cfg = tiny_config(**CASES[case])
    params = init_params(cfg, jax.random.key(1), jnp.float32, scale=0.2)
    T, prefix = 12, 5
    tokens = jax.random.randint(jax.random.key(2), (2, T), 0, cfg.vocab_size)
    positions = jnp.broadcast_to(jnp.arange(T), (2, T))
    full = forward(params, cfg, tokens, positions).logits
    cache = init_cache(cfg, 2, 16, jnp.float32)
    out = forward(params, cfg, tokens[:, :prefix], positions[:, :prefix], cache)
    steps = [out.logits]
    cache = out.cache
    for t in range(prefix, T):
        out = forward(params, cfg, tokens[:, t:t + 1], positions[:, t:t + 1], cache)
        cache = out.cache
        steps.append(out.logits)
    np.testing.assert_allclose(np.asarray(jnp.concatenate(steps, 1)), np.asarray(full), atol=TOL, rtol=0)


def test_rows_at_different_positions_decode_independently():
    """One decode step with rows at different positions equals each row alone."""
    cfg = tiny_config()
    params = init_params(cfg, jax.random.key(4), jnp.float32, scale=0.2)
    seqs = [jax.random.randint(jax.random.key(s), (n,), 0, cfg.vocab_size) for s, n in ((5, 9), (6, 4))]
    cache = init_cache(cfg, 2, 16, jnp.float32)
    tokens = jnp.zeros((2, 8), jnp.int32).at[0].set(seqs[0][:8]).at[1, :3].set(seqs[1][:3])
    out = forward(params, cfg, tokens, jnp.broadcast_to(jnp.arange(8), (2, 8)), cache)
    step_tokens = jnp.array([[seqs[0][8]], [seqs[1][3]]])
    step = forward(params, cfg, step_tokens, jnp.array([[8], [3]]), out.cache)
    for b, s in enumerate(seqs):
        alone = forward(params, cfg, s[None], jnp.arange(len(s))[None]).logits[0, -1]
        np.testing.assert_allclose(np.asarray(step.logits[b, 0]), np.asarray(alone), atol=TOL, rtol=0)


def test_capture_order_and_logits_at():
    cfg = tiny_config()
    params = init_params(cfg, jax.random.key(7), jnp.float32, scale=0.2)
    tokens = jax.random.randint(jax.random.key(8), (2, 6), 0, cfg.vocab_size)
    pos = jnp.broadcast_to(jnp.arange(6), (2, 6))
    full = forward(params, cfg, tokens, pos, capture=(3, 0))
    last = forward(params, cfg, tokens, pos, logits_at=jnp.array([5, 2]))
    assert full.residuals.shape == (2, 2, 6, cfg.hidden_size)
    np.testing.assert_array_equal(np.asarray(full.residuals[1]), np.asarray(params.embed[tokens]))
    np.testing.assert_allclose(np.asarray(last.logits[:, 0]), np.asarray(full.logits[[0, 1], [5, 2]]), atol=1e-6)
    with pytest.raises(ValueError, match="out of range"):
        forward(params, cfg, tokens, pos, capture=(cfg.num_layers + 1,))


@pytest.mark.parametrize("hf, message", [
    ({"architectures": ["MistralForCausalLM"]}, "unknown architecture 'MistralForCausalLM'"),
    ({"num_attention_heads": 5}, "inconsistent head sizes"),
    ({"num_key_value_heads": 3}, "inconsistent head sizes"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, "only 'llama3'"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "lacks low_freq_factor, high_freq_factor"),
    ({"architectures": ["Qwen3ForCausalLM"], "attention_bias": True}, "attention_bias=True"),
    ({"architectures": ["Qwen3ForCausalLM"], "use_sliding_window": True}, "sliding-window"),
    ({"layer_types": ["full_attention", "sliding_attention", "full_attention"]}, "per-layer attention"),
])
def test_config_errors_name_the_problem(hf, message):
    base = tiny_config("Qwen2ForCausalLM").to_hf()
    base.pop("head_dim")
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf({**base, **hf})


def test_config_round_trips_through_hf_dict():
    for case in CASES.values():
        cfg = tiny_config(**case)
        assert ModelConfig.from_hf(cfg.to_hf()) == cfg
        hash(cfg)  # static argument of jitted functions


def test_hub_style_configs_map_to_the_right_flags():
    """The config.json layouts the hub checkpoints ship (pre-transformers-5 rope keys)."""
    distill_llama = {  # DeepSeek-R1-Distill-Llama-8B
        "architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
        "num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 32,
        "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "attention_bias": False, "mlp_bias": False,
        "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "tie_word_embeddings": False, "eos_token_id": 128001}
    cfg = ModelConfig.from_hf(distill_llama)
    assert (cfg.family, cfg.head_dim, cfg.qkv_bias, cfg.qk_norm, cfg.rope_theta) == ("llama", 128, False, False, 5e5)
    assert cfg.rope_scaling.factor == 8.0 and cfg.rope_scaling.original_max_position_embeddings == 8192
    qwen3 = {  # Qwen3-0.6B: head_dim 128 although hidden / heads = 64
        "architectures": ["Qwen3ForCausalLM"], "hidden_size": 1024, "intermediate_size": 3072,
        "num_attention_heads": 16, "num_key_value_heads": 8, "num_hidden_layers": 28, "head_dim": 128,
        "vocab_size": 151936, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000, "rope_scaling": None, "attention_bias": False,
        "use_sliding_window": False, "sliding_window": None, "tie_word_embeddings": True}
    cfg = ModelConfig.from_hf(qwen3)
    assert (cfg.family, cfg.head_dim, cfg.qkv_bias, cfg.qk_norm, cfg.rope_scaling) == ("qwen3", 128, False, True, None)


def test_built_wheel_ships_models_inside_degs_jax(tmp_path):
    root = __import__("pathlib").Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-w", str(tmp_path), str(root)], check=True, capture_output=True)
    wheel = next(tmp_path.glob("degs_jax-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "degs_jax/models/transformer.py" in names
    assert not any(n.startswith("models/") for n in names), "models/ must not be top-level"
    extracted = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(extracted)
    code = "import degs_jax.models as m, sys; print(m.__file__); assert 'models' not in sys.modules"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                         env={"PYTHONPATH": str(extracted), "PATH": "/usr/bin:/bin"}, check=True)
    assert out.stdout.strip().startswith(str(extracted))
    # The benchmark files ship inside the package and load from the installed copy.
    for name in ("math500.jsonl", "gsm8k_train.jsonl", "gpqa_dataset.zip", "README.md",
                 "LICENSES/CC-BY-4.0-gpqa.txt"):
        assert f"degs_jax/data/{name}" in names, name
    code = ("from degs_jax.eval.benchmarks import load_benchmark, default_data_dir; "
            "print(default_data_dir()); print(len(load_benchmark('gsm8k')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                         env={"PYTHONPATH": str(extracted), "PATH": "/usr/bin:/bin"}, check=True)
    assert out.stdout.split() == [str(extracted / "degs_jax" / "data"), "1319"]


def test_qwen3_gguf_loads_and_matches_the_transformers_gguf_loader(tmp_path):
    """A Qwen3 GGUF file (q/k norms, head_dim from `attention.key_length`) loads into the
    same config and weights, and its logits equal transformers' own GGUF loader's.
    head_dim 128 (not hidden / heads = 8): transformers' GGUF loader ignores key_length
    and takes Qwen3Config's default of 128 (as in the real Qwen3 checkpoints)."""
    torch = pytest.importorskip("torch")
    import gguf

    from degs_jax.models import load
    from degs_jax.models.gguf_io import hf_name
    from test_loading import TOKENS, VOCAB

    cfg = tiny_config("Qwen3ForCausalLM", vocab=VOCAB, head_dim=128, tie=False)
    params = init_params(cfg, jax.random.key(3), jnp.float32, scale=0.2)
    w = gguf.GGUFWriter(str(tmp_path / "q3.gguf"), "qwen3")
    for add, value in ((w.add_block_count, cfg.num_layers), (w.add_context_length, cfg.max_position_embeddings),
                       (w.add_embedding_length, cfg.hidden_size), (w.add_feed_forward_length, cfg.intermediate_size),
                       (w.add_head_count, cfg.num_heads), (w.add_head_count_kv, cfg.num_kv_heads),
                       (w.add_key_length, cfg.head_dim), (w.add_value_length, cfg.head_dim),
                       (w.add_rope_freq_base, cfg.rope_theta), (w.add_layer_norm_rms_eps, cfg.rms_norm_eps),
                       (w.add_tokenizer_model, "gpt2"), (w.add_token_list, TOKENS),
                       (w.add_token_types, [1] * (VOCAB - 1) + [3]), (w.add_token_merges, ["h e"]),
                       (w.add_eos_token_id, VOCAB - 1)):
        add(value)
    names = ["token_embd.weight", "output_norm.weight", "output.weight"] + [
        f"blk.{i}.{n}" for i in range(cfg.num_layers) for n in (
            "attn_norm.weight", "ffn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight",
            "attn_q_norm.weight", "attn_k_norm.weight", "attn_output.weight", "ffn_gate.weight",
            "ffn_up.weight", "ffn_down.weight")]
    to_gguf = {hf_name(n): n for n in names}
    for name, arr in params_to_hf(params, cfg).items():  # qwen3 files carry no q/k permutation
        w.add_tensor(to_gguf[name], np.ascontiguousarray(arr, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    ours = load(tmp_path / "q3.gguf", "float32", cache_dir=tmp_path / "cache", progress=False)
    assert (ours.cfg.family, ours.cfg.head_dim, ours.cfg.qk_norm, ours.cfg.qkv_bias) == ("qwen3", 128, True, False)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), ours.params, params)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="q3.gguf",
                                                           dtype=torch.float32).eval()
    tokens = np.random.default_rng(0).integers(0, VOCAB, (1, 24))
    with torch.no_grad():
        want = hf(torch.from_numpy(tokens)).logits.numpy()
    got = forward(ours.params, ours.cfg, jnp.asarray(tokens, jnp.int32), jnp.arange(24)[None]).logits
    np.testing.assert_allclose(np.asarray(got), want, atol=TOL, rtol=0)
