"""HumanEval execution: canonical solutions pass, bad programs are contained."""

import os
import tempfile
import time

import pytest

from degs_jax.eval.benchmarks import load_benchmark
from degs_jax.eval.graders import grade_humaneval, humaneval_program
from degs_jax.eval.sandbox import STARTUP_GRACE_S, run_programs


@pytest.fixture(scope="module")
def humaneval():
    return load_benchmark("humaneval")


def assert_grader_still_works(problem):
    result = grade_humaneval(problem, problem.answer, chat=False)
    assert result.correct, result


def test_all_canonical_solutions_pass(humaneval):
    programs = [humaneval_program(p, p.answer, chat=False) for p in humaneval]
    start = time.monotonic()
    results = run_programs(programs)
    elapsed = time.monotonic() - start
    failed = [(p.id, r.result) for p, r in zip(humaneval, results) if not r.passed]
    assert failed == []
    assert elapsed < 120


def test_wrong_solution_fails(humaneval):
    problem = humaneval[0]
    result = grade_humaneval(problem, "    return True\n", chat=False)
    assert not result.correct and result.detail.startswith("failed")
    # A chat reply that rewrites the whole function, right and wrong.
    entry = problem.metadata["entry_point"]
    good = f"Here:\n```python\n{problem.question}{problem.answer}```"
    assert grade_humaneval(problem, good, chat=True).correct
    # Rewritten without the prompt's `from typing import List`: still runs,
    # because the prompt (imports, helpers) is kept in front of the rewrite.
    signature = f"def {entry}(numbers: List[float], threshold: float) -> bool:\n"
    no_imports = f"```python\n{signature}{problem.answer}```"
    assert grade_humaneval(problem, no_imports, chat=True).correct
    bad = f"```python\ndef {entry}(numbers, threshold):\n    return False\n```"
    assert not grade_humaneval(problem, bad, chat=True).correct


def test_hostile_programs_are_contained(humaneval, tmp_path, monkeypatch):
    """Infinite loops, fork bombs, huge allocations and file damage, in parallel."""
    # Scratch directories under a path unique to this test, to find leftovers.
    sandbox_root = tmp_path / "sandboxes"
    sandbox_root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(sandbox_root))
    victim_dir = tmp_path / "victim"
    victim_dir.mkdir()
    victim = victim_dir / "keep.txt"
    victim.write_text("original")
    new_file = victim_dir / "new.txt"
    programs = {
        "infinite_loop": "while True:\n    pass",
        # SIGALRM ignored: only the parent's deadline and group kill stop it.
        "ignores_alarm": "import signal\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)\n"
                         "while True:\n    pass",
        "fork_bomb_os": "import os\nwhile True:\n    os.fork()",
        "fork_bomb_posix": "import posix\nwhile True:\n    posix.fork()",
        "fork_bomb_multiprocessing": "import multiprocessing as mp\nwhile True:\n"
                                     "    mp.Process(target=print).start()",
        "spawn_shell": "import subprocess\nsubprocess.run(['sh', '-c', 'touch " + str(new_file) + "'])",
        "os_system": "import os\nos.system('touch " + str(new_file) + "')",
        "alloc_10gb": "x = bytearray(10 * 1024**3)",
        "alloc_list": "x = [0] * (10 * 1024**3 // 8)",
        "overwrite_file": f"open({str(victim)!r}, 'w').write('pwned')",
        "create_file": f"open({str(new_file)!r}, 'x').write('pwned')",
        "remove_file": f"import os\nos.remove({str(victim)!r})",
        "posix_unlink": f"import posix\nposix.unlink({str(victim)!r})",
        "rmtree": f"import shutil\nshutil.rmtree({str(victim_dir)!r})",
        "pathlib_write": f"import pathlib\npathlib.Path({str(victim)!r}).write_text('pwned')",
        "os_open_write": f"import os\nos.open({str(victim)!r}, os.O_WRONLY | os.O_TRUNC)",
        "rename": f"import posix\nposix.rename({str(victim)!r}, {str(new_file)!r})",
        "ctypes": "import ctypes\nctypes.CDLL(None).fork()",
        "exit_zero_early": "import os\nos._exit(0)",
        "fake_pass_on_stdout": "print('passed')\nimport sys\nsys.stdout.flush()\nraise SystemExit(1)",
    }
    start = time.monotonic()
    results = dict(zip(programs, run_programs(list(programs.values()))))
    elapsed = time.monotonic() - start
    for name, result in results.items():
        assert not result.passed, (name, result)
    assert results["infinite_loop"].result == "timed out"
    assert results["ignores_alarm"].result == "timed out"
    assert 2.5 < results["infinite_loop"].seconds < 3 + STARTUP_GRACE_S + 1
    assert results["ignores_alarm"].seconds < 3 + STARTUP_GRACE_S + 1
    assert "MemoryError" in results["alloc_10gb"].result
    assert elapsed < 30
    # Nothing outside the scratch directory changed.
    assert victim.read_text() == "original"
    assert sorted(os.listdir(victim_dir)) == ["keep.txt"]
    # No sandbox process or descendant survived, and scratch dirs were removed.
    assert _processes_mentioning(str(sandbox_root)) == []
    assert os.listdir(sandbox_root) == []
    assert_grader_still_works(humaneval[0])


def test_scratch_directory_is_fresh_and_writable():
    program = ("import os\nassert os.listdir('.') == []\n"
               "open('notes.txt', 'w').write('ok')\nassert open('notes.txt').read() == 'ok'")
    first, second = run_programs([program, program])
    assert first.passed and second.passed, (first, second)


def _processes_mentioning(text: str) -> list[int]:
    """Pids whose command line contains ``text`` (the runner's argv holds its scratch path,
    and forked descendants inherit it)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if text.encode() in f.read():
                        pids.append(int(entry))
            except OSError:
                continue
    return pids
