"""Pure-functional model ports (Qwen2, Llama/DeepSeek-Math) and checkpoint loading.

Installed as `degs_jax.models`; knows nothing about sampling.
"""

from .config import ConfigError, ModelConfig, SUPPORTED_ARCHITECTURES
from .transformer import (
    ForwardOutput, KVCache, LayerParams, LensStats, Params, forward, init_cache,
    init_params, param_shapes, rms_norm, streamed_head,
)

__all__ = [
    "ConfigError", "ModelConfig", "SUPPORTED_ARCHITECTURES", "ForwardOutput", "KVCache",
    "LayerParams", "LensStats", "Params", "forward", "init_cache", "init_params",
    "param_shapes", "rms_norm", "streamed_head",
]
