"""The prose that lists the library's methods says what the registry holds.

A method class registers itself (`degs_jax.method`), so the code has one list; the
README, docs/design.md §4 and the module docstrings still name every method for readers.
This test reads those tables and compares them, in order, with `METHODS` and the
classes, so a method added, renamed or moved without its prose fails here (and says
which table and which names).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from degs_jax import mcmc, method, methods, sampling, smc, sps
from degs_jax.methods import METHODS, method_classes

ROOT = Path(__file__).resolve().parents[1]
CLASSES = {name: method_classes()[name] for name in METHODS}


def table_names(text: str, header: str) -> list[str]:
    """The backticked method names in the first column of the Markdown table whose header
    row starts with `header`, in order."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {header} |"))
    names = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        names.append(re.match(r"\| `(\w+)` \|", line).group(1))
    return names


def docstring_rows(module) -> list[tuple[str, ...]]:
    """The rows `name  Class  [module or text]` of a module docstring's method table: lines
    indented by four spaces whose first word is a method name."""
    rows = []
    for line in module.__doc__.splitlines():
        words = line.split()
        if line.startswith("    ") and words and words[0] in CLASSES:
            rows.append(tuple(words))
    return rows


@pytest.mark.parametrize("path, header", [("README.md", "method"), ("docs/design.md", "name")])
def test_markdown_method_tables(path, header):
    names = table_names((ROOT / path).read_text(), header)
    assert names == list(METHODS), f"{path}: the method table lists {names}, the registry {list(METHODS)}"


def test_readme_class_list():
    text = (ROOT / "README.md").read_text()
    sentence = text[text.index("Decoders (`degs_jax.METHODS`"):text.index("| method | what it returns |")]
    listed = re.findall(r"`([A-Z]\w+)`", sentence)
    assert listed == [cls.__name__ for cls in CLASSES.values()], listed


def test_registry_docstring_table():
    rows = [row[:3] for row in docstring_rows(methods)]
    assert rows == [(name, cls.__name__, cls.__module__) for name, cls in CLASSES.items()]


@pytest.mark.parametrize("family", [sampling, mcmc, smc, sps], ids=lambda m: m.__name__)
def test_family_docstring_tables(family):
    """A family's module docstring table (where it has one) and degs_jax.method's table of
    the families name its own methods and classes, in the registry's order."""
    own = [(name, cls.__name__) for name, cls in CLASSES.items() if cls.__module__ == family.__name__]
    listed = [row[:2] for row in docstring_rows(family)]
    if listed:  # a family module with a table of its methods
        assert listed == own, f"{family.__name__}'s docstring lists {listed}, the registry {own}"
    assert method_module_table().get(family.__name__) == [cls for _, cls in own]


def method_module_table() -> dict[str, list[str]]:
    """degs_jax.method's docstring table of the families: module -> the classes it names."""
    table = method.__doc__.split("themselves live beside their kernels")[1].split("A class with")[0]
    families, current = {}, None
    for line in table.splitlines():
        found = re.search(r"(degs_jax\.\w+)(.*)", line)
        if found:
            current, line = found.group(1), found.group(2)
            families[current] = []
        if current:
            families[current] += re.findall(r"\b[A-Z]\w+\b", line)
    return families
