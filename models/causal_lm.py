"""This package's Qwen2/Qwen3/Llama port as a `degs_jax.model_api.CausalLM`: the adapter the
samplers run (`TransformerLM`), and the same model probed through a tuned lens
(`TunedTransformerLM`, parameters `TunedLensParams`; `with_tuned_lens` builds both).

The adapter only implements the protocol's `step` and `init_cache` on top of
`transformer.forward` and `attention.init_cache`; transformer-only knobs (the lens's
vocabulary chunk) are its fields. Nothing here knows about sampling.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax

from ..model_api import CausalLM, StepOutput
from .config import ModelConfig
from .params import Params
from .transformer import forward, init_cache

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class TransformerLM(CausalLM):
    """This package's Qwen2/Llama/DeepSeek-Math port (`degs_jax.models`) as a `CausalLM`.

    cfg: the model's `ModelConfig` (the parameters are a `degs_jax.models.Params`).
    lens_chunk: vocabulary chunk of the streamed lens head; None lets the model pick
      (one block for decode-sized probes, 8192-entry chunks for large ones; see
      `degs_jax.models.lens_head.streamed_head`). Results do not depend on it beyond
      fp32 summation order.
    """

    cfg: ModelConfig
    lens_chunk: Optional[int] = None

    cache_row_axis = 1  # KVCache leaves are [L, B, ...]

    def __post_init__(self):
        chunk = self.lens_chunk
        if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
            raise ValueError(f"lens_chunk must be a positive integer or None, got {chunk!r}")

    @property
    def num_layers(self) -> int:
        return self.cfg.num_layers

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    @property
    def max_context(self) -> int:
        return self.cfg.max_position_embeddings

    @property
    def batch_invariant(self) -> bool:
        return self.cfg.batch_invariant

    def step(self, params: Params, tokens: Array, positions: Array, cache: Any,
             lens_layers: tuple[int, ...] = ()) -> StepOutput:
        return self._forward(params, tokens, positions, cache, tuple(lens_layers), None)

    def _forward(self, params: Params, tokens: Array, positions: Array, cache: Any,
                 lens_layers: tuple[int, ...], translators) -> StepOutput:
        out = forward(params, self.cfg, tokens, positions, cache, lens_layers=lens_layers,
                      lens_chunk=self.lens_chunk, lens_translators=translators)
        return StepOutput(logits=out.logits, cache=out.cache,
                          layer_entropy=None if out.lens is None else out.lens.entropy)

    def init_cache(self, batch: int, max_len: int, dtype: Any) -> Any:
        return init_cache(self.cfg, batch, max_len, dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TunedLensParams:
    """The parameters of a `TunedTransformerLM`: the model's, and a tuned lens (any
    pytree with `translators_for(lens_layers)` returning `LensTranslators`, e.g.
    `degs_jax.train.tuned_lens.TunedLens`)."""

    model: Params
    lens: Any


@dataclasses.dataclass(frozen=True)
class TunedTransformerLM(TransformerLM):
    """`TransformerLM` whose lens reads the residuals through a tuned lens (Belrose et
    al. 2023): the step translates the residual of every probed layer l to
    h + h·W_l + b_l before the final norm and unembedding (layers without a translator,
    layer L by default, stay the logit lens). The output logits are never translated,
    so sampling, log p and log q are the plain model's; only d_t (and D(x)) change.
    Parameters: `TunedLensParams`; build both with `with_tuned_lens`."""

    def step(self, params: TunedLensParams, tokens: Array, positions: Array, cache: Any,
             lens_layers: tuple[int, ...] = ()) -> StepOutput:
        lens_layers = tuple(lens_layers)
        translators = params.lens.translators_for(lens_layers) if lens_layers else None
        return self._forward(params.model, tokens, positions, cache, lens_layers, translators)


def with_tuned_lens(model: TransformerLM, params: Params,
                    tuned_lens: Optional[Any]) -> tuple[TransformerLM, Any]:
    """(model, params) that probe through `tuned_lens`; unchanged when it is None.
    ValueError for a model that is not this package's transformer (a tuned lens
    translates its residuals)."""
    if tuned_lens is None:
        return model, params
    if not isinstance(model, TransformerLM):
        raise ValueError(f"a tuned lens reads this package's transformer; {type(model).__name__} "
                         "has no residuals for it (use the logit lens)")
    return (TunedTransformerLM(cfg=model.cfg, lens_chunk=model.lens_chunk),
            TunedLensParams(model=params, lens=tuned_lens))
