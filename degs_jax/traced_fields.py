"""Hyperparameters as data: frozen dataclasses whose numeric fields a compiled program takes
as arguments, so that one program serves every value (a sweep over beta compiles once, and
`jax.vmap` over beta works).

A method value (`degs_jax.method.Method`), a kernel's settings (`mcmc.MCMCConfig`,
`smc.SMCConfig`, `sps.SPSConfig`, `generation.SamplerSpec`), the per-token distribution
(`generation.Proposal`) and the lens (`lens.LensConfig`) pass through `jax.jit` as pytrees
(`register_traced_dataclass`): their *traced* fields are leaves (traced inside the program),
every other field is static (part of the program's cache key, as a static argument's
value is). Traced: alpha, beta, the collapse threshold tau, the temperatures and the
truncations' fractions (top-p, min-p, typical; `generation.Truncation`). Static: what sets
a shape or a loop (block length, blocks, MH steps, chains, particles, the probed layers),
top-k (an integer count), the switches (SPS's jackknife, the reference quirks) and SMC's
ramp and ESS threshold (the threshold times N is computed in double precision before
anything is traced; traced, float32 would round it differently, and a resampling decision
at that boundary could change).

A traced field holding a concrete zero stays static: zero is a choice of program, not a
value in it (beta = 0 is power sampling, which probes no layer; temperature 0 is greedy
decoding, an argmax). So does a field at another value that switches something off, where
its field says so (`{"static_at": (1.0,)}` in its metadata: top-p 1, no nucleus cut).
Code asks `is_zero(value)` / `is_value(value, off)`, True only for such a concrete value:
a traced value may be anything, so it gets the general program (beta·ΔD added, tokens
drawn, the cut made). The checks of a traced field look at concrete values only
(`concrete_values_satisfy`), elementwise for an array (a sweep's values): a value that is
traced when the object is built (in user code under `jax.vmap`) was checked where it was
made, if anywhere.

A pytree's leaves are what jit traces, so rebuilding one inside a program must not run the
constructor's checks on traced values: unflattening sets the fields directly.

Numerics: a traced scalar is the float32 the constant was (a Python float becomes a weakly
typed float32 argument), and XLA computed `x / t`, `t · x` from an argument as from the
constant wherever it was measured: the golden records (tests/test_golden.py, every method,
float32 and bfloat16, on a CPU) and a 7B decode on an H200 were bitwise the same before and
after these fields became arguments (docs/benchmarks.md, "Hyperparameters as data").
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any, Callable, Optional

import jax
import numpy as np

__all__ = ["is_zero", "is_value", "concrete", "concrete_values_satisfy", "register_traced_dataclass",
           "traced_field_names", "FLOAT32_MAX"]

# The largest float32: a traced hyperparameter is float32 data of the program, where a
# larger magnitude is inf (the checks of alpha, beta and temperature refuse it).
FLOAT32_MAX = float(np.finfo(np.float32).max)


def is_value(value: Any, constant: float) -> bool:
    """True for a concrete number equal to `constant` (a Python or NumPy scalar, or a 0-d
    concrete array); False for anything else, traced values and arrays of a sweep included."""
    if isinstance(value, jax.core.Tracer):
        return False
    if isinstance(value, numbers.Number):
        return value == constant
    if isinstance(value, (np.ndarray, jax.Array)) and value.ndim == 0:
        return bool(value == constant)
    return False


def is_zero(value: Any) -> bool:
    """`is_value(value, 0)`: a concrete 0."""
    return is_value(value, 0)


def concrete(value: Any) -> Optional[np.ndarray]:
    """`value` as a NumPy array (for checks), or None when it is traced (not known here)."""
    if isinstance(value, jax.core.Tracer):
        return None
    return np.asarray(value)


def concrete_values_satisfy(value: Any, condition: Callable[[np.ndarray], Any]) -> bool:
    """True when `condition` holds for every element of `value`'s concrete value (NaN fails
    a comparison), or when `value` is traced (not known here, so not checked)."""
    values = concrete(value)
    return values is None or bool(np.all(condition(values)))


def traced_field_names(cls: type) -> tuple[str, ...]:
    """The fields of the dataclass `cls` whose metadata marks them traced (`{"traced": True}`)."""
    return tuple(f.name for f in dataclasses.fields(cls) if f.metadata.get("traced", False))


def _as_leaf(value: Any) -> Any:
    """A Python number as a float (an int alpha and a float alpha are the same program)."""
    if isinstance(value, numbers.Number) and not isinstance(value, (bool, np.ndarray)):
        return float(value)
    return value


def register_traced_dataclass(cls: type, traced: Optional[Callable[[type], tuple[str, ...]]] = None) -> type:
    """Register the frozen dataclass `cls` (itself, not its subclasses) as a pytree: the
    fields `traced(cls)` names (default: `traced_field_names`, from the fields' metadata;
    read when an object is flattened, after the dataclass decorator ran) are its children
    unless they hold a concrete 0 or a value their metadata's "static_at" lists; every
    other field, and those values, are its static auxiliary data (hashed and compared, as a
    static argument is). Unflattening sets the fields without calling the constructor
    (module docstring). Returns `cls`."""
    names_of = traced or traced_field_names

    def stays_static(x, name):
        value = getattr(x, name)
        off = next(f for f in dataclasses.fields(x) if f.name == name).metadata.get("static_at", ())
        return is_zero(value) or any(is_value(value, v) for v in off)

    def flatten(x):
        children = tuple(name for name in names_of(cls) if not stays_static(x, name))
        static = tuple((f.name, getattr(x, f.name)) for f in dataclasses.fields(x) if f.name not in children)
        return tuple(_as_leaf(getattr(x, name)) for name in children), (children, static)

    def unflatten(aux, leaves):
        children, static = aux
        x = object.__new__(cls)
        for name, value in static + tuple(zip(children, leaves)):
            object.__setattr__(x, name, value)
        return x

    jax.tree_util.register_pytree_node(cls, flatten, unflatten)
    return cls
