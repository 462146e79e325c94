"""The registry of decoding methods: method name -> its class (a frozen dataclass of
typed hyperparameters, `degs_jax.method.Method`). A class with a method name of its own
registers itself when it is defined (`Method.__init_subclass__`), so the classes are the
only list. The CLI (its --help is generated from the fields), `decode`, `degs eval`'s run
configuration, the study and the analyses find methods here. The library's:

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

`METHODS` names these, in this order (their families' order, each in the order its file
defines them). An installed package adds methods through the entry-point group
`degs_jax.methods`, this module's name (`name = "package.module:Class"`;
docs/extending.md): the first
`method_classes()` call loads them (a package that fails to load is a warning naming
it), and from then on `degs sample/eval/reproduce` list, run and resume them like the
library's. A method class defined in a script registers itself as well, for the Python
API, under a name of its own: a name an installed package declares is refused whether
the package was loaded before or after (`degs_jax.method._register` reads the entry
points' names). `method_origin` says where a class came from (its module and
distribution), which run.json records beside the method, so that a run of a method that
is not installed names the package to install.

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
import importlib.metadata
import typing
import warnings
from typing import Any, Mapping, Optional

import jax.numpy as jnp

from . import mcmc, sampling, smc, sps
from .mcmc import DegsMCMC, MCMCMethod, PowerMCMC
from .method import ENTRY_POINT_GROUP, Method, registered_methods
from .sampling import BestOfN, BestOfNEntropy, DegsRerank, Greedy, SamplingMethod, Temperature
from .smc import DegsSMC, PowerSMC, SMCMethod
from .sps import ScalablePower

__all__ = ["Method", "SamplingMethod", "MCMCMethod", "SMCMethod", "Greedy", "Temperature", "BestOfN",
           "BestOfNEntropy", "DegsRerank", "PowerMCMC", "DegsMCMC", "PowerSMC", "DegsSMC", "ScalablePower",
           "METHODS", "RERANK_METHODS", "MCMC_METHODS", "SMC_METHODS", "ENTRY_POINT_GROUP",
           "method_classes", "method_origin", "field_names", "hyperparameters_for",
           "resolve_hyperparameters", "field_types", "as_method", "method_record", "method_from_record",
           "RETIRED_HYPERPARAMETERS"]

# The library's families, in the order METHODS lists their methods.
LIBRARY_MODULES = tuple(m.__name__ for m in (sampling, mcmc, smc, sps))
LIBRARY_DISTRIBUTION = "degs-jax"

# module -> distribution of the classes loaded through an entry point; None until loaded
_installed: Optional[dict[str, str]] = None


# Classes registered while a package that did not load was imported (or by a package
# whose entry point names no method class of its name): not offered (`method_classes`).
_refused: set[type[Method]] = set()


def _load_installed_methods() -> dict[str, str]:
    """Import every class the `degs_jax.methods` entry points name (importing it registers
    it); module -> distribution of those that loaded. One that does not load (any
    exception, `SystemExit` included), or is not a method class of the entry point's name,
    is one warning naming its package, and every class its import registered is left out
    of `method_classes` (reported, not registered: no half-loaded package runs)."""
    loaded = {}
    for entry in sorted(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        package = entry.dist.name if entry.dist is not None else "?"
        before = set(registered_methods().values())
        try:
            cls = entry.load()
        except (Exception, SystemExit) as e:  # a broken package must not take the tool with it
            _refused.update(set(registered_methods().values()) - before)
            warnings.warn(f"the method {entry.name!r} of the package {package!r} ({entry.value}) "
                          f"did not load: {type(e).__name__}: {e}", stacklevel=2)
            continue
        if not (isinstance(cls, type) and issubclass(cls, Method) and cls.method == entry.name):
            _refused.update(set(registered_methods().values()) - before)
            named = ""
            if isinstance(cls, type) and issubclass(cls, Method):
                _refused.add(cls)  # (also where an earlier import registered it)
                named = f" (its class is the method {cls.method!r})"
            warnings.warn(f"the entry point {entry.name!r} of the package {package!r} ({entry.value}) "
                          f"is not the class of the method {entry.name!r}{named}; ignored", stacklevel=2)
            continue
        _refused.discard(cls)  # (a class another entry point's import registered)
        loaded[cls.__module__] = package
    return loaded


def _in_order(classes: Mapping[str, type[Method]]) -> dict[str, type[Method]]:
    """`classes` with the library's first, in METHODS' order, then the others as given."""
    rank = {module: i for i, module in enumerate(LIBRARY_MODULES)}
    names = sorted(classes, key=lambda name: rank.get(classes[name].__module__, len(rank)))  # stable
    return {name: classes[name] for name in names}


def method_classes() -> dict[str, type[Method]]:
    """Every registered method by name: the library's (METHODS' order), then the others
    (installed packages', loaded on the first call, and any defined since, e.g. in a
    script) in the order they were defined."""
    global _installed
    if _installed is None:
        _installed = {}  # (set first: a package that asks for the methods while it loads)
        _installed = _load_installed_methods()
    return _in_order({name: cls for name, cls in registered_methods().items() if cls not in _refused})


def method_origin(cls: type[Method]) -> dict[str, Optional[str]]:
    """Where a method class came from: its module and the distribution that installed it
    (this library's, or the package of its entry point; None for a class defined
    elsewhere, e.g. in a script)."""
    if cls.__module__ in LIBRARY_MODULES:
        distribution = LIBRARY_DISTRIBUTION
    else:
        method_classes()  # (the installed packages loaded)
        distribution = _installed.get(cls.__module__)
    return {"module": cls.__module__, "distribution": distribution}


# The library's methods (not the installed packages': the tests, the golden numbers and
# the paper's study are over these).
METHODS = tuple(name for name, cls in _in_order(registered_methods()).items()
                if cls.__module__ in LIBRARY_MODULES)


def _of_family(family: type[Method]) -> tuple[str, ...]:
    classes = registered_methods()
    return tuple(name for name in METHODS if issubclass(classes[name], family))


RERANK_METHODS = _of_family(BestOfN)  # a pool of samples, one answer chosen
MCMC_METHODS = _of_family(MCMCMethod)
SMC_METHODS = _of_family(SMCMethod)


def field_names(method: str) -> tuple[str, ...]:
    """The hyperparameters `method` takes."""
    return tuple(f.name for f in dataclasses.fields(method_classes()[method]))


def hyperparameters_for(method: str, **overrides: Any) -> Method:
    """The method's value with its defaults updated by `overrides`.

    ValueError for an unknown method, a name the method does not take, or a bad value.
    """
    classes = method_classes()
    if method not in classes:
        raise ValueError(f"unknown method {method!r}; choose one of {', '.join(classes)}")
    names = field_names(method)
    unknown = sorted(set(overrides) - set(names))
    if unknown:
        raise ValueError(f"{method} does not take {', '.join(unknown)}; "
                         f"it takes {', '.join(sorted(names))}")
    return classes[method](**overrides)


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
    (the file) for a record that names no known method (and the package it came from,
    where the record has its `method_origin`) or a hyperparameter it does not take or a
    bad value."""
    name, recorded = record.get("method"), record.get("hyperparameters")
    if not isinstance(name, str) or not isinstance(recorded, Mapping):
        raise ValueError(f"{source}: a run record needs a method name and its hyperparameters "
                         "(an object); repair it or use another run directory")
    origin = record.get("method_origin")
    if name not in method_classes() and isinstance(origin, Mapping):
        raise ValueError(f"{source}: {_missing(name, origin)}")
    values = {k: v for k, v in recorded.items()
              if not (k in RETIRED_HYPERPARAMETERS and v == RETIRED_HYPERPARAMETERS[k])}
    if values.get("cache_dtype") is not None:
        values["cache_dtype"] = jnp.dtype(values["cache_dtype"])
    try:
        return hyperparameters_for(name, **values)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{source}: {e}") from None


def _missing(name: str, origin: Mapping[str, Any]) -> str:
    """Why the method `name` of a run record whose `method_origin` is `origin` is unknown here."""
    if origin.get("distribution"):
        return (f"the method {name!r} comes from the package {origin['distribution']!r} (module "
                f"{origin.get('module')}), which is not installed here; install it to use this run")
    return (f"the method {name!r} was defined in the module {origin.get('module')}, which no "
            "installed package provides; import it first, or make it a package "
            "(docs/extending.md)")
