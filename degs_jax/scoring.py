"""Teacher-forced scoring of given sequences: per-token log p, collapse depth d_t and
final-layer entropy from one uncached forward pass, with the fused streamed lens (no
[positions, vocab] logits are built).

Used to score completions that were not generated with probing (`degs probe`, D(x)
of power-sampling or greedy outputs). Values agree with the ones recorded during
generation up to floating-point summation order.
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .lens import LensConfig, collapse_depth, mean_final_entropy, sequence_depth
from .models import LensTranslators, ModelConfig, Params, forward, rms_norm

Array = jax.Array


def probe_layers(lens: LensConfig, num_layers: int) -> tuple[int, ...]:
    """The lens rows `token_stats` computes: L_sub, then L if L_sub lacks it."""
    return tuple(lens.lsub) + (() if num_layers in lens.lsub else (num_layers,))


@functools.partial(jax.jit, static_argnames=("cfg", "lens"))
def token_stats(params: Params, cfg: ModelConfig, tokens: Array, lens: LensConfig,
                translators: Optional[LensTranslators] = None):
    """Per-position statistics of right-padded sequences.

    tokens: [B, T] int32. Returns (logp [B, T]: log p(x_t | x_<t) at t >= 1 (0 at t = 0),
    depth [B, T] int32: d_t from the residuals at position t, final_entropy [B, T]).
    translators: tuned-lens rows for `probe_layers(lens, L)` (None: the logit lens). log p
    and the final entropy come from row L, which a tuned lens leaves untranslated unless
    it has a translator for L.
    """
    B, T = tokens.shape
    L = cfg.num_layers
    layers = probe_layers(lens, L)
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None], (B, T))
    out = forward(params, cfg, tokens, positions, capture=(L,), lens_layers=layers,
                  lens_chunk=lens.chunk, logits_at=jnp.zeros((B,), jnp.int32),
                  lens_translators=translators)
    final = layers.index(L)
    h = rms_norm(out.residuals[0], params.final_norm, cfg.rms_norm_eps)  # [B, T, D]
    w_next = params.unembedding()[tokens[:, 1:]]  # [B, T-1, D]
    # The chosen token's logit in fp32, minus the streamed fp32 normaliser.
    z_next = jnp.einsum("btd,btd->bt", h[:, :-1].astype(jnp.float32), w_next.astype(jnp.float32))
    logp = jnp.concatenate([jnp.zeros((B, 1)), z_next - out.lens.logsumexp[final, :, :-1]], axis=1)
    depth = collapse_depth(out.lens.entropy[: len(lens.lsub)], lens.lsub, L, lens.tau)
    return logp, depth, out.lens.entropy[final]


def score_sequences(params: Params, cfg: ModelConfig, prompts: Sequence[Sequence[int]],
                    completions: Sequence[Sequence[int]], lens: LensConfig,
                    eos_ids: Sequence[int] = (), batch_size: int = 8, bucket: int = 64,
                    tuned_lens=None):
    """log p(x), D(x) and mean final-layer entropy of each completion given its prompt.

    tuned_lens: a `train.tuned_lens.TunedLens` for d_t (None: the logit lens).

    Returns a list of dicts (one per completion) with `log_p`, `depth`, `final_entropy`,
    `n_tokens`, `ended` and the per-token `token_depth` list (scored tokens only).
    """
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
    eos = set(eos_ids)
    translators = (None if tuned_lens is None
                   else tuned_lens.translators_for(probe_layers(lens, cfg.num_layers)))
    results = []
    for start in range(0, len(prompts), batch_size):
        chunk = list(range(start, min(start + batch_size, len(prompts))))
        seqs = [list(prompts[i]) + list(completions[i]) for i in chunk]
        longest = max(len(s) for s in seqs)
        if longest > cfg.max_position_embeddings:
            raise ValueError(f"sequence of {longest} tokens exceeds the model context "
                             f"({cfg.max_position_embeddings})")
        # Bucketed length bounds recompiles; padding never needs to exceed the context.
        T = min(-(-longest // bucket) * bucket, cfg.max_position_embeddings)
        tokens = np.zeros((len(chunk), T), np.int32)
        for r, s in enumerate(seqs):
            tokens[r, : len(s)] = s
        logp, depth, ent = jax.device_get(token_stats(params, cfg, jnp.asarray(tokens), lens,
                                                          translators))
        for r, i in enumerate(chunk):
            P, n = len(prompts[i]), len(completions[i])
            ended = n > 0 and completions[i][-1] in eos
            scored = np.zeros(T, bool)
            scored[P: P + n - int(ended)] = True
            results.append({
                "log_p": float(logp[r, P: P + n].sum()),
                "depth": float(sequence_depth(depth[r], scored, cfg.num_layers)),
                "final_entropy": float(mean_final_entropy(ent[r], scored)),
                "n_tokens": n, "ended": bool(ended),
                "token_depth": depth[r, scored].tolist(),
            })
    return results
