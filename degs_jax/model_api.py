"""The model protocol: everything the samplers know about a language model.

Generation, MCMC, the decoders, scoring and the lens helpers never call a model
definition directly; they take a `CausalLM` value and call its pure step function

    step(params, tokens, positions, cache, lens_layers) -> StepOutput(logits, cache, layer_entropy)

plus `init_cache(batch, max_len, dtype)` and a few facts (`num_layers`, `vocab_size`,
`max_context`, `cache_row_axis`). The value is frozen and hashable: samplers take it as
a static argument of their jitted functions, and the parameters travel separately as a
pytree. `degs_jax.models.TransformerLM` adapts this package's Qwen2/Llama port
(models/causal_lm.py, beside the transformer, which knows nothing about sampling); any
other JAX model (a Flax NNX module through `nnx.split` / `nnx.merge`, a Linen `apply`, a
plain function) joins by subclassing `CausalLM`, see README "Your own model".

Above the samplers, the text-level tools (`degs_jax.text.sample`, `degs eval`'s
`run_eval`, the probe, the analyses' L_sub sweep, the study) take a `LanguageModel`: a
`CausalLM` with its parameters, a tokenizer, a name and its EOS ids
(`degs_jax.models.load` returns a `LoadedModel`, which has the same attributes).

This module imports JAX and nothing else of the package: implementing the protocol
costs no model code, loaders or samplers.

The contract `step` must honour (the samplers' bookkeeping relies on each point):

1. Positions are cache slots. The token at position p of row b writes its keys/values
   (whatever state the model caches) to slot p of row b and attends to slots <= p of
   row b only. Rows never see each other: a row's outputs depend only on its own
   tokens, positions and cache row.
2. Stale slots are harmless: a query at position p never reads a slot > p, so a
   sampler truncates a row by lowering its length without clearing the cache (the MH
   chain regenerates from a cut this way; the next tokens overwrite the slots).
3. A position >= the cache's slot count writes nothing. Samplers park rows that sit a
   step out at position `max_len`; the outputs of such entries are ignored (a model
   may skip their work: `models.TransformerLM` leaves their lens entropies NaN in large decode
   steps rather than compute them).
4. `logits` are [B, T, V] float32 at every given position (log p is computed from them
   in fp32). Calls inside a jitted sampler whose logits nobody reads (the prefill) cost
   no unembedding: XLA removes unused outputs.
5. `layer_entropy` is [K, B, T] float32: the entropy in nats of the logit lens
   softmax(W_U · final_norm(h_l)) at every layer l of `lens_layers` (a static tuple of
   ints in 0..num_layers, 0 = the embeddings, num_layers = the last block), in that
   order; None when `lens_layers` is empty. A model without a lens may raise on a
   non-empty `lens_layers`: then only the methods that do not probe work with it
   (power_mcmc, and the sampling methods with probe=False).
6. `step` is pure and traceable: samplers call it inside `jit`, `lax.while_loop`,
   `lax.scan` and `vmap`.
7. The cache is a pytree whose every leaf has the batch-row axis at `cache_row_axis`
   (samplers repeat, select and copy cache rows along it).
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp

Array = jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StepOutput:
    """What one model step returns (see the module docstring for the contract)."""

    logits: Array  # [B, T, V] float32
    cache: Any  # the updated cache pytree
    layer_entropy: Optional[Array]  # [K, B, T] float32 nats at `lens_layers`, None if none asked


class CausalLM(abc.ABC):
    """A causal language model as the samplers see it (module docstring: the contract).

    Subclass it as a frozen dataclass (hashable: it is a static argument of jitted
    samplers) providing `step` and `init_cache` and these attributes:

    num_layers: blocks L (the lens and collapse depth count layers 0..L).
    vocab_size: V, the size of the logits' last axis.
    max_context: longest sequence (prompt + completion) the model supports.
    cache_row_axis: the batch-row axis of every cache leaf (0 unless overridden).
    batch_invariant: True when `step` gives each row results that do not depend on the
      other rows of its batch (False unless overridden); the samplers' own per-row
      reductions (sums over the token buffer, the vocabulary densities, SMC's per-prompt
      weights) then run on fixed tiles too (`lens.masked_sum`, issue 16).
    """

    num_layers: int
    vocab_size: int
    max_context: int
    cache_row_axis: int = 0
    batch_invariant: bool = False

    @abc.abstractmethod
    def step(self, params: Any, tokens: Array, positions: Array, cache: Any,
             lens_layers: tuple[int, ...] = ()) -> StepOutput:
        """Run `tokens` ([B, T] int32) at `positions` ([B, T] int32) through the model,
        updating `cache`; return logits, the new cache and the lens entropies."""

    @abc.abstractmethod
    def init_cache(self, batch: int, max_len: int, dtype: Any) -> Any:
        """An empty cache of `batch` rows and `max_len` slots, stored in `dtype`."""


@dataclasses.dataclass(frozen=True, eq=False)
class LanguageModel:
    """A `CausalLM` with what the text-level tools need (module docstring): wrap your own
    model in one to sample text from it, evaluate it on a benchmark, probe it, sweep its
    probe sets or run the paper's study on it.

    lm: the model. params: its parameters (a pytree; the dtype of its first
      floating-point leaf is recorded as the run's and is the KV cache's default).
    tokenizer: Hugging Face-style: `encode(text)`, `decode(ids, skip_special_tokens=True)`
      and, when prompts should go through a chat template, `chat_template` with
      `apply_chat_template`.
    name: a label for run records, tables and plots.
    eos_ids: every token id that ends a completion.
    source: where the weights came from, recorded with runs (None: nothing recorded).
    """

    lm: CausalLM
    params: Any
    tokenizer: Any
    name: str
    eos_ids: tuple[int, ...]
    source: Optional[str] = None

    @property
    def architecture(self) -> str:
        """What run records name as the model's architecture: the class of `lm`."""
        return type(self.lm).__name__


def params_dtype(params: Any):
    """The dtype of a model's parameters: that of its first floating-point leaf (the
    default dtype of caches built for it)."""
    for leaf in jax.tree.leaves(params):
        if jnp.issubdtype(jnp.result_type(leaf), jnp.floating):
            return jnp.result_type(leaf)
    raise ValueError("the parameters have no floating-point array")
