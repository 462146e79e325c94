"""degs-jax: Depth-Entropy Guided Sampling and power sampling for LLM reasoning, in JAX."""

__version__ = "0.1.0"

from .decoders import DecodeResult, decode  # noqa: E402
from .hyperparameters import METHODS  # noqa: E402
from .text import sample  # noqa: E402

__all__ = ["METHODS", "DecodeResult", "decode", "sample", "__version__"]
