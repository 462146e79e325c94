"""Deprecated name of `degs_jax.methods`, the method registry (renamed: README.md and
docs/sweeps.md showed `from degs_jax.hyperparameters import DegsMCMC`). Importing it warns
and gives that same module, so code written against the old name keeps working."""

import sys
import warnings

from degs_jax import methods

warnings.warn("degs_jax.hyperparameters is now degs_jax.methods; import from there",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = methods
