"""The registry of decoding methods: method name -> its class (a frozen dataclass of
typed hyperparameters, `degs_jax.method.Method`; the classes live beside their kernels).
The CLI (its --help is generated from the fields), `decode`, `degs eval`'s run
configuration, the study and the analyses find methods here.

    greedy             Greedy          degs_jax.sampling
    temperature        Temperature     degs_jax.sampling
    best_of_n          BestOfN         degs_jax.sampling
    best_of_n_entropy  BestOfNEntropy  degs_jax.sampling
    degs_rerank        DegsRerank      degs_jax.sampling
    power_mcmc         PowerMCMC       degs_jax.mcmc
    degs_mcmc          DegsMCMC        degs_jax.mcmc
    power_smc          PowerSMC        degs_jax.smc
    degs_smc           DegsSMC         degs_jax.smc
    scalable_power     ScalablePower   degs_jax.sps

`hyperparameters_for(method, **overrides)` builds one from a method name (unknown names
are an error); `as_method` takes a name with overrides or a value (what the layers above
`decode` accept). Above `decode` the value travels as it is; it becomes a dict only at the
run record (run.json), through the two functions of this module: `method_record` (value ->
`{"method": name, "hyperparameters": every field as JSON}`) and `method_from_record` (the
reverse, for every run.json ever written: hyperparameters the methods no longer take are
dropped at the one value they were recorded with, `RETIRED_HYPERPARAMETERS`).
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Mapping

import jax.numpy as jnp

from .mcmc import DegsMCMC, MCMCMethod, PowerMCMC
from .method import Method
from .sampling import BestOfN, BestOfNEntropy, DegsRerank, Greedy, SamplingMethod, Temperature
from .smc import DegsSMC, PowerSMC, SMCMethod
from .sps import ScalablePower

__all__ = ["Method", "SamplingMethod", "MCMCMethod", "SMCMethod", "Greedy", "Temperature", "BestOfN",
           "BestOfNEntropy", "DegsRerank", "PowerMCMC", "DegsMCMC", "PowerSMC", "DegsSMC", "ScalablePower",
           "METHOD_HYPERPARAMETERS", "METHODS", "RERANK_METHODS", "MCMC_METHODS", "SMC_METHODS",
           "field_names", "hyperparameters_for", "resolve_hyperparameters", "field_types", "as_method",
           "method_record", "method_from_record", "RETIRED_HYPERPARAMETERS"]

METHOD_HYPERPARAMETERS: dict[str, type[Method]] = {
    cls.method: cls for cls in (Greedy, Temperature, BestOfN, BestOfNEntropy, DegsRerank,
                                PowerMCMC, DegsMCMC, PowerSMC, DegsSMC, ScalablePower)}
METHODS = tuple(METHOD_HYPERPARAMETERS)


def _of_family(family: type[Method]) -> tuple[str, ...]:
    return tuple(name for name, cls in METHOD_HYPERPARAMETERS.items() if issubclass(cls, family))


RERANK_METHODS = _of_family(BestOfN)  # a pool of samples, one answer chosen
MCMC_METHODS = _of_family(MCMCMethod)
SMC_METHODS = _of_family(SMCMethod)


def field_names(method: str) -> tuple[str, ...]:
    """The hyperparameters `method` takes."""
    return tuple(f.name for f in dataclasses.fields(METHOD_HYPERPARAMETERS[method]))


def hyperparameters_for(method: str, **overrides: Any) -> Method:
    """The method's value with its defaults updated by `overrides`.

    ValueError for an unknown method, a name the method does not take, or a bad value.
    """
    if method not in METHOD_HYPERPARAMETERS:
        raise ValueError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    names = field_names(method)
    unknown = sorted(set(overrides) - set(names))
    if unknown:
        raise ValueError(f"{method} does not take {', '.join(unknown)}; "
                         f"it takes {', '.join(sorted(names))}")
    return METHOD_HYPERPARAMETERS[method](**overrides)


def resolve_hyperparameters(method: str, overrides: dict[str, Any]) -> dict[str, Any]:
    """`hyperparameters_for(method, **overrides).to_dict()`: every hyperparameter by name."""
    return hyperparameters_for(method, **overrides).to_dict()


def field_types(cls: type[Method]) -> dict[str, Any]:
    """The resolved type annotation of every field of `cls` (for the CLI's parsers)."""
    return typing.get_type_hints(cls)


def as_method(method: str | Method, overrides: Mapping[str, Any] = {}) -> Method:
    """`method` if it is a method value (then without `overrides`), else the value the
    name gives with `overrides` (`hyperparameters_for`). ValueError as there."""
    if isinstance(method, Method):
        if overrides:
            raise ValueError(f"pass hyperparameters either in the {type(method).__name__} or as "
                             f"overrides, not both (got {', '.join(sorted(overrides))})")
        return method
    return hyperparameters_for(method, **overrides)


# Hyperparameters that older run.json files record and the methods no longer take, with
# the one value they were ever recorded with: `lens_chunk` (None: the streamed lens's
# automatic vocabulary chunk) moved onto the transformer adapter (`TransformerLM`); it
# never changed a number. Reading drops them, so old run directories resume and report.
RETIRED_HYPERPARAMETERS = {"lens_chunk": None}


def _json_value(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_json_value(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(jnp.dtype(value))  # cache_dtype, the one field of another type


def method_record(method: Method) -> dict[str, Any]:
    """The run record of a method value: `{"method": its name, "hyperparameters": every
    field by name}` in JSON values (L_sub a list, a cache dtype its name). The inverse
    of `method_from_record`."""
    return {"method": method.method,
            "hyperparameters": {k: _json_value(v) for k, v in method.to_dict().items()}}


def method_from_record(record: Mapping[str, Any], source: Any = "run.json") -> Method:
    """The method value a run record holds (`method_record`'s output, or a run.json
    `config` with its other keys): retired hyperparameters at their recorded value are
    dropped, L_sub becomes a tuple and a cache dtype a dtype. ValueError naming `source`
    (the file) for a record that names no known method or a hyperparameter it does not
    take or a bad value."""
    name, recorded = record.get("method"), record.get("hyperparameters")
    if not isinstance(name, str) or not isinstance(recorded, Mapping):
        raise ValueError(f"{source}: a run record needs a method name and its hyperparameters "
                         "(an object); repair it or use another run directory")
    values = {k: v for k, v in recorded.items()
              if not (k in RETIRED_HYPERPARAMETERS and v == RETIRED_HYPERPARAMETERS[k])}
    if values.get("cache_dtype") is not None:
        values["cache_dtype"] = jnp.dtype(values["cache_dtype"])
    try:
        return hyperparameters_for(name, **values)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{source}: {e}") from None
