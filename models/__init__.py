"""Pure-functional model ports (Qwen2, Llama/DeepSeek-Math) and checkpoint loading.

Installed as `degs_jax.models`; knows nothing about sampling.
"""

from .checkpoint import CheckpointError
from .config import ConfigError, ModelConfig, SUPPORTED_ARCHITECTURES
from .gguf_io import GGUFError
from .loading import (BUILTIN_MODELS, DEFAULT_MODEL, ChecksumError, LoadedModel,
                      default_cache_dir, file_sha256, load)
from .transformer import (
    ForwardOutput, KVCache, LayerParams, LensStats, LensTranslators, Params, forward,
    init_cache, init_params, param_shapes, rms_norm, streamed_head, translate_residuals,
)

__all__ = [
    "BUILTIN_MODELS", "CheckpointError", "ChecksumError", "DEFAULT_MODEL", "GGUFError",
    "LoadedModel", "default_cache_dir", "file_sha256", "load",
    "ConfigError", "ModelConfig", "SUPPORTED_ARCHITECTURES", "ForwardOutput", "KVCache",
    "LayerParams", "LensStats", "LensTranslators", "Params", "forward", "init_cache",
    "init_params", "param_shapes", "rms_norm", "streamed_head", "translate_residuals",
]
