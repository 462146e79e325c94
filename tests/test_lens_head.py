"""The fused lens head shares the last layer's rows with the output rows (their inputs are
the same final-normed residuals): the statistics must equal an independent computation
of every lensed layer, in any order of `lens_layers`, and the output logits must not
change."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from degs_jax.models import forward, init_params, rms_norm, streamed_head
from tiny_models import tiny_config


@pytest.mark.parametrize("lens_layers", [(1, 3), (3, 1, 2), (3,), (0, 2)])
def test_lens_statistics_equal_an_unshared_computation(lens_layers):
    cfg = tiny_config("Qwen2ForCausalLM", vocab=97)  # 3 layers: 3 = L
    params = init_params(cfg, jax.random.key(0), jnp.float32, scale=0.3)
    tokens = jax.random.randint(jax.random.key(1), (2, 6), 0, cfg.vocab_size)
    positions = jnp.broadcast_to(jnp.arange(6), (2, 6))
    out = forward(params, cfg, tokens, positions, lens_layers=lens_layers)
    plain = forward(params, cfg, tokens, positions, capture=lens_layers)
    np.testing.assert_array_equal(np.asarray(out.logits), np.asarray(plain.logits))
    normed = rms_norm(plain.residuals, params.final_norm, cfg.rms_norm_eps).reshape(-1, cfg.hidden_size)
    _, ent, top, ptop, lse = streamed_head(params.unembedding(), None, normed)
    shape = (len(lens_layers), 2, 6)
    # Same fp32 arithmetic in blocks of other sizes: ~1e-7 on entropies of ~4 nats.
    np.testing.assert_allclose(np.asarray(out.lens.entropy), np.asarray(ent).reshape(shape), atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(out.lens.logsumexp), np.asarray(lse).reshape(shape), atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(out.lens.top1_prob), np.asarray(ptop).reshape(shape), atol=1e-6, rtol=0)
    np.testing.assert_array_equal(np.asarray(out.lens.top1), np.asarray(top).reshape(shape))
