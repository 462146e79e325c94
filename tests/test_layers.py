"""The package's import graph: layers, the rules between them, no cycles, few lazy imports.

    tiling, model protocol, chat  <  models  <  examples  <  statistics
        <  stop strings / traced fields  <  lens / rows / generation / scoring / method  <  sampling / mcmc / smc / sps
        <  decoders (+ the method registry, methods)
        <  text API  <  eval  <  analysis / decisions / probe  <  training  <  reproduction  <  CLI

A module may import only from its own layer or lower ones. On top of that:

- the protocol (`model_api`), the row tiles (`tiling`) and `chat` import nothing of the
  package: implementing the protocol costs no model, loader or sampler (checked on the
  source and by importing `degs_jax.model_api` alone);
- `models/` imports nothing above the protocol and the tiles (test_params_table.py);
- the samplers never import the model file, nor anything of `degs_jax.models`;
- nothing outside the CLI layer (`degs_jax.cli`) imports it, and nothing in the library
  imports `degs_jax.examples`;
- no cycle among modules, nor among packages (a subpackage counts as one node);
- function-local imports only where they buy start-up time or availability, each with
  its reason in a comment on its line or the line above, at most LOCAL_IMPORTS_MAX.

Every import statement counts, including the lazy ones inside functions. A new module
must be given a layer here.
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
    ("tiling / model protocol / chat", ("degs_jax.tiling", "degs_jax.model_api", "degs_jax.chat")),
    ("models", ("degs_jax.models",)),
    ("examples", ("degs_jax.examples",)),
    ("statistics", ("degs_jax.stats",)),
    ("stop strings / traced fields", ("degs_jax.stops", "degs_jax.traced_fields")),
    ("lens / rows / generation / drafts / scoring / method", ("degs_jax.lens", "degs_jax.rows", "degs_jax.generation",
                                                              "degs_jax.drafts", "degs_jax.scoring",
                                                              "degs_jax.method")),
    ("sampling / mcmc / smc / sps", ("degs_jax.sampling", "degs_jax.mcmc", "degs_jax.smc", "degs_jax.sps")),
    ("decoders", ("degs_jax.methods", "degs_jax.hyperparameters", "degs_jax.decoders", "degs_jax.batching")),
    ("text API", ("degs_jax.text",)),
    ("eval", ("degs_jax.eval",)),
    ("analysis", ("degs_jax.analysis", "degs_jax.decisions", "degs_jax.probe", "degs_jax.plots")),
    ("training", ("degs_jax.train",)),
    ("reproduction", ("degs_jax.reproduce",)),
    ("CLI", ("degs_jax.cli",)),
]
PROTOCOL = ("degs_jax.model_api", "degs_jax.tiling", "degs_jax.chat")
SAMPLERS = ("degs_jax.stops", "degs_jax.traced_fields", "degs_jax.lens", "degs_jax.rows", "degs_jax.generation",
            "degs_jax.drafts", "degs_jax.scoring", "degs_jax.method", "degs_jax.sampling", "degs_jax.mcmc",
            "degs_jax.smc", "degs_jax.sps", "degs_jax.methods", "degs_jax.decoders", "degs_jax.batching")
LOCAL_IMPORTS_MAX = 20


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


def graph() -> dict[str, set[str]]:
    """module -> the package modules it imports (the package root excluded)."""
    return {name: imports_of(name, path) - {"degs_jax"} for name, path in modules().items()}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """A cycle of the directed graph as [a, b, ..., a] (self-loops ignored), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt == node:
                continue
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def package_of(module: str) -> str:
    """The node of `module` in the package graph: its subpackage of degs_jax (eval, train,
    models, ...), or the module itself for a top-level module."""
    parts = module.split(".")
    if len(parts) >= 2 and (ROOT / parts[1]).is_dir() or parts[:2] == ["degs_jax", "models"]:
        return ".".join(parts[:2])
    return module


def local_imports(path: Path) -> list[tuple[int, bool]]:
    """(line, has a reason) of every import statement inside a function body of `path`; the
    reason is a comment on the statement's lines or on the line above."""
    source = path.read_text()
    lines = source.splitlines()
    tree = ast.parse(source)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        owner = parents.get(node)
        while owner is not None and not isinstance(owner, (ast.FunctionDef, ast.AsyncFunctionDef)):
            owner = parents.get(owner)
        if owner is None:
            continue
        own = lines[node.lineno - 1:node.end_lineno]
        above = lines[node.lineno - 2] if node.lineno >= 2 else ""
        out.append((node.lineno, any("#" in line for line in own + [above])))
    return sorted(out)


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


def test_the_protocol_imports_nothing_of_the_package():
    edges = graph()
    assert {m: edges[m] for m in PROTOCOL} == {m: set() for m in PROTOCOL}
    code = ("import sys, degs_jax.model_api; "
            "print(sorted(m for m in sys.modules if m.startswith(('degs_jax', 'transformers', 'tokenizers', "
            "'flax', 'optax'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "['degs_jax', 'degs_jax.model_api']", out.stdout


def test_samplers_do_not_import_the_model_file():
    found = {(m, t) for m in SAMPLERS for t in graph()[m] if t.startswith("degs_jax.models")}
    assert not found, sorted(found)


def test_only_the_cli_imports_the_cli_and_nothing_imports_the_examples():
    edges = graph()
    to_cli = sorted(f"{m} -> {t}" for m, ts in edges.items() for t in ts
                    if t.startswith("degs_jax.cli") and not m.startswith("degs_jax.cli"))
    assert not to_cli, to_cli
    to_examples = sorted(f"{m} -> {t}" for m, ts in edges.items() for t in ts
                         if t.startswith("degs_jax.examples") and not m.startswith("degs_jax.examples"))
    assert not to_examples, to_examples


def test_no_cycle_among_modules_or_packages():
    edges = graph()
    assert find_cycle(edges) is None, " -> ".join(find_cycle(edges))
    packages: dict[str, set[str]] = {}
    for module, targets in edges.items():
        packages.setdefault(package_of(module), set()).update(package_of(t) for t in targets)
    assert find_cycle(packages) is None, " -> ".join(find_cycle(packages))


def test_function_local_imports_are_few_and_say_why():
    found = {f"{path.relative_to(ROOT.parent)}:{line}": reason
             for path in sorted(modules().values()) for line, reason in local_imports(path)}
    unexplained = sorted(where for where, reason in found.items() if not reason)
    assert not unexplained, f"say why these imports are inside a function (start-up time): {unexplained}"
    assert len(found) <= LOCAL_IMPORTS_MAX, sorted(found)


def test_the_checks_see_violations(tmp_path):
    """The checkers themselves: an upward import inside a function body is reported, a
    cycle is found, an unexplained lazy import is seen."""
    bad = tmp_path / "generation.py"
    bad.write_text("def f():\n    from .decoders import decode\n    from degs_jax import text\n\n\n"
                   "def g():\n    # start-up: heavy\n    import json\n    import os  # heavy too\n"
                   "    try:  # optional\n        import datasets\n    except ImportError:\n        pass\n\n\n"
                   "def h():\n    x = 1\n    import sys\n")
    assert imports_of("degs_jax.generation", bad) >= {"degs_jax.decoders", "degs_jax.text"}
    assert layer_of("degs_jax.decoders") > layer_of("degs_jax.generation")
    assert layer_of("degs_jax.cli.evaluation") > layer_of("degs_jax.analysis") > layer_of("degs_jax.eval.runner")
    assert local_imports(bad) == [(2, False), (3, False), (8, True), (9, True), (11, True), (18, False)]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"a", "b"}, "b": set()}) is None
    assert package_of("degs_jax.eval.runner") == "degs_jax.eval" and package_of("degs_jax.lens") == "degs_jax.lens"
    assert package_of("degs_jax.models.transformer") == "degs_jax.models"


def test_analysis_does_not_load_the_evaluation_harness():
    code = ("import sys, degs_jax.analysis; "
            "print(sorted(m for m in sys.modules if m.startswith('degs_jax.eval')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
