"""Helpers that build Hugging Face (PyTorch) reference models from our configs/params."""

from __future__ import annotations

import numpy as np
import torch
import transformers

from degs_jax.models import ModelConfig
from degs_jax.models.config import RopeScaling
from degs_jax.models.checkpoint import params_to_hf


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


def hf_model(cfg: ModelConfig, params) -> "transformers.PreTrainedModel":
    """An fp32 eager HF model holding exactly `params`."""
    hf_cfg = transformers.AutoConfig.for_model(**cfg.to_hf())
    hf_cfg._attn_implementation = "eager"
    with torch.device("cpu"):
        model = transformers.AutoModelForCausalLM.from_config(hf_cfg, torch_dtype=torch.float32)
    state = {k: torch.from_numpy(np.array(v)) for k, v in params_to_hf(params, cfg).items()}
    if cfg.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    assert all("rotary" in m for m in missing), missing
    return model.eval()
