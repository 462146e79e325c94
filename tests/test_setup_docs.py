"""The README's set-up commands and the ones CI runs (.ci/run) are the same text: CI runs
what a newcomer pastes. The first one installs no torch and no test extras."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def ci_commands() -> dict[str, str]:
    """The single-quoted command variables of .ci/run."""
    return dict(re.findall(r"^(\w+_COMMAND)='([^']*)'$", (ROOT / ".ci" / "run").read_text(), flags=re.M))


def test_ci_runs_the_readme_commands_verbatim():
    sys.path.insert(0, str(ROOT / ".ci"))
    try:
        from readme_commands import setup_commands
    finally:
        sys.path.pop(0)
    readme = setup_commands((ROOT / "README.md").read_text(encoding="utf-8"))
    ci = ci_commands()
    assert set(ci) == {"FIRST_COMMAND", "TEST_COMMAND"}
    assert readme[0] == ci["FIRST_COMMAND"]
    assert ci["TEST_COMMAND"] in readme
    assert "torch" not in readme[0] and "[test]" not in readme[0] and "degs sample" in readme[0]
    checker = [sys.executable, str(ROOT / ".ci" / "readme_commands.py"), "--check"]
    assert subprocess.run(checker + [ci["FIRST_COMMAND"], ci["TEST_COMMAND"]]).returncode == 0
    changed = subprocess.run(checker + [ci["FIRST_COMMAND"] + " --seed 1", ci["TEST_COMMAND"]],
                             capture_output=True, text=True)
    assert changed.returncode == 1 and "disagree" in changed.stderr


def tracked_files() -> list[Path]:
    """The repository's tracked files (`git ls-files`; every file but build and cache
    folders when the tree is not a git checkout)."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True)
    if listed.returncode == 0:
        return [ROOT / name for name in listed.stdout.decode().split("\0") if name]
    skip = {".git", ".venv", "__pycache__", ".pytest_cache", "build"}
    return [p for p in ROOT.rglob("*") if p.is_file() and not skip & set(p.relative_to(ROOT).parts)]


def test_no_tracked_file_names_a_folder_beside_the_repository():
    """A clone is the whole product: no code, test, notebook or document refers to the
    workspace folder that sat beside the repository while it was written."""
    names = [".." + "/shared", "shared" + "/DESIGN", "shared" + "/data"]  # spelled apart: not in this file
    offenders = []
    for path in tracked_files():
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            continue  # binary data (compressed benchmarks, images)
        if any(name in text for name in names):
            offenders.append(str(path.relative_to(ROOT)))
    assert len(tracked_files()) > 100
    assert not offenders, offenders


def test_test_modules_import_without_torch():
    """torch is only the parity reference: a test module imports it (or `hf_reference`,
    which does) inside the HF-comparison tests after `pytest.importorskip("torch")`, or
    skips the whole module that way, never at its top, so the JAX tests run without it
    (CI installs torch: nothing is skipped there)."""
    import ast

    offenders = []
    for path in sorted((ROOT / "tests").glob("*.py")):
        if path.name == "hf_reference.py":
            continue
        for node in ast.parse(path.read_text(encoding="utf-8")).body:  # module level only
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n.split(".")[0] in ("torch", "hf_reference") for n in names):
                offenders.append(f"{path.name}:{node.lineno}")
    assert not offenders, offenders
