"""degs-jax: Depth-Entropy Guided Sampling and power sampling for LLM reasoning, in JAX."""

__version__ = "0.1.0"
