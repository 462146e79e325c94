"""The package's layering: a module may import only from its own layer or lower ones.

    tiling, model API  <  models  <  lens / generation / scoring  <  mcmc / smc / sps
            <  decoders (+ hyperparameters)  <  text API  <  eval  <  analysis / probe
            <  CLI (degs_jax.cli, degs_jax.eval.commands)

`models/` knows nothing about sampling; samplers know a model only through the
protocol (`degs_jax.model_api`); the evaluation harness never imports the analyses
(the CLI wires them together). Every import statement counts, including the lazy
ones inside functions. A new module must be given a layer here.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import degs_jax
import degs_jax.models

ROOT = Path(degs_jax.__file__).parent
MODELS = Path(degs_jax.models.__file__).parent

LAYERS = [
    ("tiling / model API / chat", ("degs_jax.tiling", "degs_jax.model_api", "degs_jax.chat")),
    ("models", ("degs_jax.models",)),
    ("examples", ("degs_jax.examples",)),
    ("statistics", ("degs_jax.stats",)),
    ("lens / generation / scoring", ("degs_jax.lens", "degs_jax.generation", "degs_jax.scoring")),
    ("mcmc / smc / sps", ("degs_jax.mcmc", "degs_jax.smc", "degs_jax.sps")),
    ("decoders", ("degs_jax.hyperparameters", "degs_jax.decoders", "degs_jax.batching")),
    ("text API", ("degs_jax.text",)),
    ("eval", ("degs_jax.eval",)),
    ("analysis", ("degs_jax.analysis", "degs_jax.probe", "degs_jax.plots")),
    ("training", ("degs_jax.train",)),
    ("reproduction", ("degs_jax.reproduce",)),
    ("CLI", ("degs_jax.cli", "degs_jax.eval.commands", "degs_jax.train.commands",
             "degs_jax.reproduce.command")),
]


def layer_of(module: str) -> int | None:
    """Index in LAYERS of the longest prefix naming `module` (or a package above it)."""
    best, length = None, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > length:
                best, length = i, len(p)
    return best


def modules() -> dict[str, Path]:
    """Every module of the package (degs_jax.models lives in models/), but the package root."""
    found = {}
    for base, package in ((ROOT, "degs_jax"), (MODELS, "degs_jax.models")):
        for path in base.rglob("*.py"):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            name = ".".join([package] + parts)
            if name != "degs_jax":
                found[name] = path
    return found


def imports_of(name: str, path: Path) -> set[str]:
    """The degs_jax modules `name` imports anywhere in its source (lazy imports too)."""
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    known = modules()
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("degs_jax")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("degs_jax"):
                continue
            for alias in node.names:  # `from pkg import module` imports that module
                sub = f"{target}.{alias.name}"
                out.add(sub if sub in known else target)
    return out


def test_every_module_has_a_layer():
    missing = sorted(m for m in modules() if layer_of(m) is None)
    assert not missing, f"give these modules a layer in tests/test_layers.py: {missing}"


def test_no_import_from_a_lower_layer_to_a_higher_one():
    violations = []
    for name, path in sorted(modules().items()):
        mine = layer_of(name)
        for target in sorted(imports_of(name, path)):
            if target == "degs_jax":
                violations.append(f"{name} imports the package root degs_jax (import its modules)")
                continue
            theirs = layer_of(target)
            if theirs is not None and mine is not None and theirs > mine:
                violations.append(f"{name} ({LAYERS[mine][0]}) imports {target} ({LAYERS[theirs][0]})")
    assert not violations, "\n".join(violations)


def test_layer_check_sees_a_violation(tmp_path):
    """The checker itself: an upward import inside a function body is reported."""
    bad = tmp_path / "generation.py"
    bad.write_text("def f():\n    from .decoders import decode\n    from degs_jax import text\n")
    assert imports_of("degs_jax.generation", bad) >= {"degs_jax.decoders", "degs_jax.text"}
    assert layer_of("degs_jax.decoders") > layer_of("degs_jax.generation")
    assert layer_of("degs_jax.eval.commands") > layer_of("degs_jax.analysis") > layer_of("degs_jax.eval.runner")


def test_analysis_does_not_load_the_evaluation_harness():
    code = ("import sys, degs_jax.analysis; "
            "print(sorted(m for m in sys.modules if m.startswith('degs_jax.eval')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
