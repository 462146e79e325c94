"""`python -m degs_jax.cli`: the `degs` command."""

from degs_jax.cli import entry_point

entry_point()
