"""Pure-functional model ports (Qwen2, Qwen3 dense, Llama/DeepSeek-Math/DeepSeek-R1-Distill-Llama)
and checkpoint loading.

Installed as `degs_jax.models`; knows nothing about sampling. `TransformerLM`
(causal_lm.py) is the port as a `degs_jax.model_api.CausalLM`, the protocol the samplers
run; besides that protocol (and `degs_jax.tiling`'s fixed row tiles) nothing here
imports the rest of degs_jax.
"""

from .attention import KVCache, init_cache
from .causal_lm import TransformerLM, TunedLensParams, TunedTransformerLM, with_tuned_lens
from .checkpoint import CheckpointError
from .compilation import enable_compilation_cache, enable_default_compilation_cache
from .config import ConfigError, ModelConfig, SUPPORTED_ARCHITECTURES
from .gguf_io import GGUFError
from .loading import (BUILTIN_MODELS, DEFAULT_MODEL, KNOWN_END_TOKENS, ChecksumError, LoadedModel, auto_dtype,
                      default_cache_dir, end_token_ids, file_sha256, load, resolve_dtype)
from .lens_head import LensStats, LensTranslators, streamed_head, translate_residuals
from .params import LayerParams, Params, is_stacked, param_shapes, stack_layers, unstack_layers
from .transformer import ForwardOutput, forward, init_params, rms_norm

# A library user's process (one that loads or builds a model: it imports this package)
# keeps its compiled programs: JAX's persistent cache on by default, unless the user has a
# setting of their own (models/compilation.py). Not in the samplers, which know no model.
enable_default_compilation_cache()

__all__ = [
    "BUILTIN_MODELS", "CheckpointError", "ChecksumError", "DEFAULT_MODEL", "GGUFError",
    "KNOWN_END_TOKENS", "LoadedModel", "auto_dtype", "default_cache_dir", "enable_compilation_cache",
    "end_token_ids", "file_sha256", "load",
    "ConfigError", "ModelConfig", "SUPPORTED_ARCHITECTURES", "ForwardOutput", "KVCache",
    "LayerParams", "LensStats", "LensTranslators", "Params", "forward", "init_cache", "init_params",
    "is_stacked", "param_shapes", "resolve_dtype", "rms_norm", "stack_layers", "streamed_head", "translate_residuals",
    "unstack_layers", "TransformerLM", "TunedLensParams", "TunedTransformerLM", "with_tuned_lens",
]
