"""Every notebook in notebooks/ executes end to end (python3 kernel of this interpreter,
built-in SmolLM2-135M on CPU) and is stored without outputs.

The notebooks run with $DEGS_JAX_NOTEBOOK_QUICK=1: the ones that decode with the model
(collapse_depth, degs_vs_power, predictive_validity) then take their smallest settings
that still render every table and figure (fewer problems, shorter completions and
chains); a reader running them gets the settings written in them."""

import os
import sys
from pathlib import Path

import pytest

from xla_flags import decoding_flags

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


def test_the_three_notebooks_exist():
    assert {p.name for p in NOTEBOOKS} >= {"collapse_depth.ipynb", "degs_vs_power.ipynb",
                                           "predictive_validity.ipynb"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_stored_without_outputs(path):
    book = nbformat.read(path, as_version=4)
    nbformat.validate(book)
    for cell in book.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"{path.name} has outputs"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes(path, tmp_path, monkeypatch):
    # The kernel inherits the environment: the session's converted-weights cache
    # ($DEGS_JAX_CACHE, set by conftest), CPU JAX, and this interpreter's site-packages; its
    # XLA compiles with XLA's fusion emitters (the notebooks decode SmolLM2: tests/xla_flags.py).
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("XLA_FLAGS", decoding_flags(os.environ.get("XLA_FLAGS", "")))
    monkeypatch.setenv("DEGS_JAX_NOTEBOOK_QUICK", "1")
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # a notebook's tempfile work dirs go with tmp_path
    monkeypatch.setenv("PATH", os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    book = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(book, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    nbformat.write(book, tmp_path / path.name)  # executed copy, for inspection
    errors = [o for c in book.cells if c.cell_type == "code" for o in c.outputs
              if o.output_type == "error"]
    assert not errors
    images = [o for c in book.cells if c.cell_type == "code" for o in c.outputs
              if "image/png" in o.get("data", {})]
    assert images, f"{path.name} produced no figure"
