"""Hugging Face (PyTorch) reference models built from our configs/params. Needs torch:
import it inside the HF-comparison tests, after `pytest.importorskip("torch")`, so that
the other tests of a file run without torch (tiny configs: `tiny_models`)."""

from __future__ import annotations

import numpy as np
import torch
import transformers

from degs_jax.models import ModelConfig
from degs_jax.models.checkpoint import params_to_hf


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
