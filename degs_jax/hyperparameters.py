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
are an error); `to_dict()` is the flat record `degs eval` stores in run.json.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from .mcmc import DegsMCMC, MCMCMethod, PowerMCMC
from .method import Method
from .sampling import BestOfN, BestOfNEntropy, DegsRerank, Greedy, SamplingMethod, Temperature
from .smc import DegsSMC, PowerSMC, SMCMethod
from .sps import ScalablePower

__all__ = ["Method", "SamplingMethod", "MCMCMethod", "SMCMethod", "Greedy", "Temperature", "BestOfN",
           "BestOfNEntropy", "DegsRerank", "PowerMCMC", "DegsMCMC", "PowerSMC", "DegsSMC", "ScalablePower",
           "METHOD_HYPERPARAMETERS", "METHODS", "RERANK_METHODS", "MCMC_METHODS", "SMC_METHODS",
           "field_names", "hyperparameters_for", "resolve_hyperparameters", "field_types"]

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
