"""degs-jax: Depth-Entropy Guided Sampling and power sampling for LLM reasoning, in JAX.

The package root imports nothing: `decode`, `sample`, `DecodeResult` and `METHODS` load
their modules when first used, so that `import degs_jax.model_api` (the protocol a user's
model implements) or `degs_jax.tiling` costs no samplers, models or loaders."""

import importlib

__version__ = "0.1.0"

_HOMES = {"DecodeResult": "decoders", "decode": "decoders", "METHODS": "methods",
          "sample": "text"}

__all__ = ["METHODS", "DecodeResult", "decode", "sample", "__version__"]


def __getattr__(name):
    if name in _HOMES:
        return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
