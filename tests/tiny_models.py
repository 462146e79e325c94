"""Tiny model configs for tests (JAX only: no torch, so the JAX tests run without it)."""

from __future__ import annotations

from degs_jax.models import ModelConfig
from degs_jax.models.config import RopeScaling

# Llama-3 RoPE scaling for tiny models: with head_dim 8 and theta 1e4 the four rotary
# wavelengths are 6.3, 63, 628 and 6283 positions; an original context of 64 with
# low/high frequency factors 1/4 puts the first in the kept band (< 16), the second in
# the interpolated band (16..64) and the last two in the band divided by `factor`.
TINY_LLAMA3_ROPE = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                               original_max_position_embeddings=64)


def tiny_config(architecture="Qwen2ForCausalLM", *, num_heads=4, num_kv_heads=2, tie=False,
                vocab=97, layers=3, hidden=32, head_dim=8, intermediate=48,
                rope_scaling=None) -> ModelConfig:
    return ModelConfig(
        architecture=architecture, vocab_size=vocab, hidden_size=hidden,
        intermediate_size=intermediate, num_layers=layers, num_heads=num_heads,
        num_kv_heads=num_kv_heads, head_dim=head_dim, rope_theta=10000.0,
        rms_norm_eps=1e-6, max_position_embeddings=512,
        qkv_bias=architecture == "Qwen2ForCausalLM", tie_word_embeddings=tie,
        eos_token_ids=(vocab - 1,), qk_norm=architecture == "Qwen3ForCausalLM",
        rope_scaling=rope_scaling,
    )
