"""Batch invariance of the model (issue 16): with `ModelConfig.batch_invariant`, a prompt
run alone and as row 0 of batches of 3 and 8 (other prompts of other lengths, so other
padded prompt lengths and other buffer sizes) gives bitwise-identical residuals, logits
and lens entropies, in the prefill and in cached decode steps, in float32 and bfloat16.
The float32 multi-step case caught the last batch-1 difference: XLA turned the per-row
cache read of a 1-row cache into a constant-index slice and compiled the attention's
value product with another layout (1 ulp); the read now indexes (layer, row) as one
axis (models/transformer.py, `_cache_chunks_rows`)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from degs_jax.models import forward, init_cache, init_params
from hf_reference import tiny_config

PROMPT = 7  # row 0's prompt length


def _row0(cfg, params, dtype, batch, steps):
    """Row 0's prefill residuals and logits, then `steps` decode steps' residuals, logits
    and lens entropies; other rows have prompts of 3..12 tokens and keep decoding."""
    rng = np.random.default_rng(batch)
    lengths = np.array([PROMPT] + list(rng.integers(3, 13, batch - 1)))
    P = int(lengths.max())
    tokens = rng.integers(0, cfg.vocab_size, (batch, P))
    tokens[0, :PROMPT] = np.arange(PROMPT) * 5 % cfg.vocab_size
    positions = np.arange(P)[None].repeat(batch, 0)
    out = forward(params, cfg, jnp.asarray(tokens), jnp.asarray(positions), init_cache(cfg, batch, P + 24, dtype),
                  capture=(1, 2, 3))
    got = [out.residuals[:, 0, :PROMPT], out.logits[0, :PROMPT]]
    cache, n = out.cache, lengths.copy()
    for t in range(steps):
        step_tokens = jnp.asarray((np.arange(batch) * 7 + t) % cfg.vocab_size)[:, None]
        out = forward(params, cfg, step_tokens, jnp.asarray(n)[:, None], cache, capture=(1, 2, 3), lens_layers=(1, 2))
        got += [out.residuals[:, 0], out.logits[0], out.lens.entropy[:, 0]]
        cache, n = out.cache, n + 1
    return [np.asarray(a.astype(jnp.float32)) for a in got]


@pytest.mark.parametrize("dtype, steps", [(jnp.float32, 1), (jnp.bfloat16, 1), (jnp.bfloat16, 5), (jnp.float32, 5)],
                         ids=["float32-prefill+1", "bfloat16-prefill+1", "bfloat16-prefill+5", "float32-prefill+5"])
def test_a_row_does_not_depend_on_its_batch(dtype, steps):
    cfg = dataclasses.replace(tiny_config("LlamaForCausalLM", vocab=97), batch_invariant=True, row_tile=4, kv_chunk=8)
    params = init_params(cfg, jax.random.key(0), dtype, scale=0.3)
    alone = _row0(cfg, params, dtype, 1, steps)
    for batch in (3, 8):
        for i, (a, b) in enumerate(zip(_row0(cfg, params, dtype, batch, steps), alone)):
            np.testing.assert_array_equal(a, b, err_msg=f"output {i}, batch {batch}")


def test_without_the_option_the_cpu_is_not_batch_invariant():
    """The control: the same check without `batch_invariant` differs on XLA CPU in float32
    (a one-row matmul is a gemv); if this starts passing, the test above proves nothing."""
    cfg = dataclasses.replace(tiny_config("LlamaForCausalLM", vocab=97), kv_chunk=8)
    params = init_params(cfg, jax.random.key(0), jnp.float32, scale=0.3)
    alone, batched = _row0(cfg, params, jnp.float32, 1, 1), _row0(cfg, params, jnp.float32, 3, 1)
    assert any((a != b).any() for a, b in zip(alone, batched))
