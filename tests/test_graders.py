"""Graders: boxed extraction, math-verify verdicts, GPQA letters, pass@k."""

import math
import signal
import subprocess
import sys
import time
from concurrent.futures import TimeoutError as FutureTimeout

import pytest

from degs_jax.eval.graders import (
    MathGrader,
    boxed_spans,
    extract_choice_letter,
    grade_gpqa,
    last_boxed,
    pass_at_k,
)


def box(answer: str) -> str:
    return "Let me think step by step. ... The answer is \\boxed{" + answer + "}."


# (case, benchmark, gold, completion, expected verdict). Verdicts are what
# math-verify 0.9 actually returns; where that differs from what a human grader
# might say, a comment says so.
MATH_CASES = [
    ("frac_same", "math500", r"\frac{1}{2}", box(r"\frac{1}{2}"), True),
    ("frac_vs_slash", "math500", r"\frac{1}{2}", box("1/2"), True),
    ("frac_vs_decimal", "math500", r"\frac{1}{2}", box("0.5"), True),
    ("decimal_gold_vs_frac", "math500", "0.5", box(r"\frac{1}{2}"), True),
    ("dfrac", "math500", r"\frac{3}{56}", box(r"\dfrac{3}{56}"), True),
    ("tfrac", "math500", r"\frac{3}{56}", box(r"\tfrac{3}{56}"), True),
    ("frac_shorthand", "math500", r"\frac{3}{2}", box(r"\frac32"), True),
    # Rounded decimals: equal after rounding to 6 digits only.
    ("third_vs_0.33", "math500", r"\frac{1}{3}", box("0.33"), False),
    ("third_vs_0.333333", "math500", r"\frac{1}{3}", box("0.333333"), True),
    ("wrong_frac", "math500", r"\frac{1}{2}", box(r"\frac{1}{3}"), False),
    ("pi_vs_decimal", "math500", r"\pi", box("3.14159"), False),
    ("units_text_cm", "math500", "5", box(r"5\text{ cm}"), True),
    ("units_mbox", "math500", "5", box(r"5 \mbox{ cm}"), True),
    ("units_cm2", "math500", "12", box(r"12\text{ cm}^2"), True),
    ("degrees_gold", "math500", r"30^\circ", box("30"), True),
    ("degrees_pred", "math500", "30", box(r"30^\circ"), True),
    ("degrees_vs_radians", "math500", r"30^\circ", box(r"\frac{\pi}{6}"), False),
    ("percent", "math500", "25", box(r"25\%"), True),
    ("dollar", "math500", "18", box(r"\$18"), True),
    ("interval_same", "math500", "(1,2]", box("(1, 2]"), True),
    ("interval_wrong_bracket", "math500", "(1,2]", box("(1, 2)"), False),
    # Surprise: gold-first matters. An inequality prediction does not match an
    # interval gold, while the same pair with roles swapped does.
    ("interval_gold_vs_inequality", "math500", "(1,2]", box(r"1 < x \le 2"), False),
    ("inequality_gold_vs_interval", "math500", r"1 < x \le 2", box("(1,2]"), True),
    ("interval_left_right", "math500", r"(-\infty, 3)", box(r"\left(-\infty, 3\right)"), True),
    ("tuple", "math500", r"\left( 3, \frac{\pi}{2} \right)", box(r"(3, \frac{\pi}{2})"), True),
    ("tuple_order_matters", "math500", "(1, 2)", box("(2, 1)"), False),
    ("set_order_free", "math500", r"\{1, 2, 3\}", box(r"\{3, 2, 1\}"), True),
    # Surprise: a bare comma list is compared as a set, so order is ignored.
    ("list_order_ignored", "math500", "1,-2", box("-2, 1"), True),
    # Surprise (pleasant): \pm expands to the two-element list.
    ("pm_vs_list", "math500", r"1 \pm \sqrt{2}", box(r"1+\sqrt{2}, 1-\sqrt{2}"), True),
    ("pm_same", "math500", r"1 \pm \sqrt{2}", box(r"1 \pm \sqrt{2}"), True),
    ("equation_gold_vs_value", "math500", "x=5", box("5"), True),
    # Surprise: an equation prediction is accepted for a bare-value gold (rhs taken).
    ("value_gold_vs_equation", "math500", "5", box("x=5"), True),
    ("equation_spaces", "math500", "x=5", box("x = 5"), True),
    ("last_box_wins_right", "math500", "7", r"First \boxed{3}, then corrected: \boxed{7}", True),
    ("last_box_wins_wrong", "math500", "3", r"First \boxed{3}, then corrected: \boxed{7}", False),
    ("no_box", "math500", "7", "The answer is 7.", False),
    ("empty_box", "math500", "7", box(""), False),
    # A truncated final box is ignored; the last complete one is graded.
    ("unclosed_last_box", "math500", "7", r"\boxed{7} ... so the answer is \boxed{8", True),
    ("nested_braces", "math500", r"\frac{\sqrt{3}}{2}", box(r"\dfrac{\sqrt{3}}{2}"), True),
    ("sqrt_simplified", "math500", r"3\sqrt{13}", box(r"\sqrt{117}"), True),
    ("sqrt_no_braces", "math500", r"11\sqrt2", box(r"11\sqrt{2}"), True),
    ("complex", "math500", "6 - 5i", box("6-5i"), True),
    ("negative_sign_wrong", "math500", "-50", box("50"), False),
    ("polynomial", "math500", "x^5 - x^4 + x^3 - x^2 + x - 1", box("x^5-x^4+x^3-x^2+x-1"), True),
    ("text_answer", "math500", r"\text{Evelyn}", box("Evelyn"), True),
    ("base_subscript", "math500", "52_8", box("52_8"), True),
    ("thousands_separator", "gsm8k", "2125", box("2,125"), True),
    ("thousands_not_list", "gsm8k", "1250", box("1,250.5"), False),
    ("gsm_dollar", "gsm8k", "18", box(r"\$18"), True),
    ("gsm_trailing_zeros", "gsm8k", "18", box("18.00"), True),
    ("gsm_units", "gsm8k", "18", box(r"18 \text{ dollars}"), True),
    # DeepMind golds use Python syntax; ** is rewritten to ^ before parsing.
    ("dm_power", "deepmind500", "-13402348*w**2", box("-13402348w^2"), True),
    ("dm_sqrt", "deepmind500", "15*sqrt(11)/14", box(r"\frac{15\sqrt{11}}{14}"), True),
    ("dm_true", "deepmind500", "True", box(r"\text{True}"), True),
    ("dm_false_vs_true", "deepmind500", "False", box("True"), False),
    ("dm_letter", "deepmind500", "c", box("(c)"), True),
    # Surprise: sort answers are compared as sets, so a wrong order passes.
    ("dm_sort_order_ignored", "deepmind500", "-78, 0, 1, 3, 4, 5, 22",
     box("22, 5, 4, 3, 1, 0, -78"), True),
    # Surprise: a clock time with \text{ PM} does not match the plain gold.
    ("dm_time_text", "deepmind500", "12:22 PM", box(r"12:22 \text{ PM}"), False),
]


@pytest.fixture(scope="module")
def math_grader():
    with MathGrader(timeout=30.0) as grader:
        yield grader


def test_math_case_table_is_large_enough():
    assert len(MATH_CASES) >= 30
    assert len({c[0] for c in MATH_CASES}) == len(MATH_CASES)


@pytest.mark.parametrize("name,benchmark,gold,completion,expected", MATH_CASES,
                         ids=[c[0] for c in MATH_CASES])
def test_math_verdicts(math_grader, name, benchmark, gold, completion, expected):
    result = math_grader.grade(completion, gold, benchmark)
    assert result.correct is expected, (name, result)


def test_boxed_extraction_nested_and_last():
    text = r"a \boxed{\frac{1}{\sqrt{2}}} b \fbox{2} c \boxed{ \{1, 2\} }"
    assert boxed_spans(text) == [r"\frac{1}{\sqrt{2}}", "2", r" \{1, 2\} "]
    assert last_boxed(text) == r" \{1, 2\} "
    assert last_boxed(r"\boxed{\boxed{4}}") == r"\boxed{4}"  # outer span wins
    assert last_boxed(r"\boxed {5}") == "5"
    assert last_boxed("no box") is None
    assert last_boxed(r"\boxed{3") is None


@pytest.mark.parametrize("completion,letter", [
    (r"\boxed{B}", "B"),
    (r"\boxed{\text{B}}", "B"),
    (r"\boxed{(B)}", "B"),
    (r"\boxed{B)}", "B"),
    (r"\boxed{b}", "B"),
    (r"\boxed{\textbf{C}}", "C"),
    (r"\boxed{D. 42 kelvin}", "D"),
    (r"\boxed{A} no wait \boxed{C}", "C"),
    (r"\boxed{E}", None),
    (r"\boxed{Both}", None),
    ("The answer is B", None),
])
def test_gpqa_letter_extraction(completion, letter):
    assert extract_choice_letter(completion) == letter


def test_gpqa_exact_match():
    assert grade_gpqa(r"so \boxed{(C)}", "C").correct
    assert not grade_gpqa(r"so \boxed{(C)}", "A").correct
    assert not grade_gpqa("so C", "C").correct


def test_hung_worker_is_replaced():
    with MathGrader(timeout=0.5) as grader:
        assert grader.grade(box("1/2"), r"\frac{1}{2}").correct  # pool warm
        workers = list(grader._pool._processes.values())
        start = time.monotonic()
        with pytest.raises(FutureTimeout):
            grader.call(time.sleep, 60)
        assert time.monotonic() - start < 10
        for worker in workers:  # the hung worker was killed, not left behind
            worker.join(5)
            assert not worker.is_alive()
        # Fresh workers afterwards.
        assert grader.grade(box("0.5"), r"\frac{1}{2}").correct


def test_pass_at_k():
    assert pass_at_k(10, 0, 1) == 0.0
    assert pass_at_k(10, 10, 5) == 1.0
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    # 1 - C(7,2)/C(10,2) = 1 - 21/45
    assert pass_at_k(10, 3, 2) == pytest.approx(1 - 21 / 45)
    assert pass_at_k(5, 3, 3) == 1.0  # fewer than k failures
    assert math.isclose(pass_at_k(200, 17, 10), 1 - math.comb(183, 10) / math.comb(200, 10))
    with pytest.raises(ValueError):
        pass_at_k(3, 4, 1)


MATH_SCRIPT = r'''
import time
from degs_jax.eval.graders import MathGrader
grader = MathGrader()
assert grader.grade("\\boxed{2}", "2").correct
print(*grader._pool._processes, flush=True)
time.sleep(120)
'''


def test_math_worker_dies_with_killed_grader():
    grader = subprocess.Popen([sys.executable, "-c", MATH_SCRIPT], stdout=subprocess.PIPE)
    try:
        workers = [int(pid) for pid in grader.stdout.readline().split()]
        assert len(workers) == 1 and _alive(workers[0])
        grader.send_signal(signal.SIGKILL)
        grader.wait()
        end = time.monotonic() + 5  # the worker's watchdog polls every 0.5 s
        while _alive(workers[0]) and time.monotonic() < end:
            time.sleep(0.1)
        assert not _alive(workers[0])
    finally:
        grader.kill()
        grader.wait()


def _alive(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except FileNotFoundError:
        return False


def test_the_math_worker_leaves_ctrl_c_to_the_grading_process():
    """Ctrl-C reaches the whole process group: the worker ignores SIGINT (no traceback, no
    broken pool); the grading process decides what stops."""
    import os
    import signal
    import time

    with MathGrader(timeout=30.0) as grader:
        assert grader.grade(r"\boxed{4}", "4").correct
        (worker,) = list(grader._pool._processes.values())
        os.kill(worker.pid, signal.SIGINT)
        time.sleep(0.5)
        assert worker.is_alive()
        assert grader.grade(r"\boxed{5}", "5").correct
        assert list(grader._pool._processes.values()) == [worker]  # the same worker
