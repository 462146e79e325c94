"""Answer extraction and grading for every benchmark, and pass@k.

- Math: the content of the LAST complete ``\\boxed{...}`` span (brace-balanced,
  nested braces allowed) is compared with the gold answer by ``math-verify``
  (``verify(parse(gold), parse(pred))``, gold first); DeepMind500 answers by the rules of
  :mod:`degs_jax.eval.deepmind` (yes/no, clock times, numbers in a base, sorted lists,
  multiple choice; math-verify for the rest), which read the question. math-verify runs in a
  worker process (``spawn`` start method: forking a process that has
  initialised JAX is unsafe) with a timeout; a hung worker is killed and the
  pool recreated, and the answer counts as incorrect. The worker exits when the
  grading process dies (even by ``SIGKILL``).
- GPQA: the letter in the last boxed span (``B``, ``\\text{B}``, ``(B)``,
  ``B)``, ``B. ...``), exact match with the shuffled gold letter.
- HumanEval: the completion runs in a sandbox that only answers calls of the entry
  point; the problem's test runs in a second sandbox and gives the verdict
  (:mod:`degs_jax.eval.sandbox`). Never in-process, and never without namespaces unless
  the caller allows the weaker fallback (``allow_unsandboxed``; each verdict says which
  isolation it had).
"""

from __future__ import annotations

import multiprocessing
import os
import re
import signal
import threading
import time
from concurrent.futures import ProcessPoolExecutor, TimeoutError as FutureTimeout
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from degs_jax.eval import deepmind, sandbox
from degs_jax.eval.benchmarks import MATH_BENCHMARKS, Problem
from degs_jax.eval.prompts import humaneval_solution

# The version of the grading rules, recorded with every re-grading (`degs reproduce
# --regrade`): 1, math-verify (True/False golds as words) for every math benchmark; 2, the
# DeepMind500 rules of degs_jax.eval.deepmind; 3, DeepMind500 answers in the question's
# Python syntax (``**``, ``sqrt(...)``) read as their value, and GSM8K numbers of hours
# answered as a clock time on the hour (``2:00 pm`` for 2).
RULES_VERSION = 3
DEFAULT_MATH_TIMEOUT_S = 20.0
DEFAULT_STARTUP_TIMEOUT_S = 120.0
_PARENT_POLL_S = 0.5
# math-verify's own parse/verify timeouts (deepmind.VERIFY_TIMEOUT_S, signal based, inside
# the worker) fire first; the pool timeout above is the backstop if they do not.

_BOXED_OPEN = re.compile(r"(?:\\boxed|\\fbox)\s*\{")
_LETTER = re.compile(
    r"^\s*(?:\\(?:text|textbf|mathrm|mathbf)\s*\{\s*)?[\(\[]?\s*([A-Da-d])\s*[\)\]]?\s*\}?"
    r"(?:$|[\s.:)]|\\)")


@dataclass(frozen=True)
class GradeResult:
    """One graded completion: verdict, the extracted answer and a short reason.

    ``extracted`` is the boxed content (math), the letter (GPQA) or ``None``;
    ``detail`` is ``"ok"``, ``"no boxed answer"``, ``"timeout"`` or the sandbox
    result for HumanEval; ``isolation`` is the sandbox's isolation level for HumanEval
    (:data:`~degs_jax.eval.sandbox.NAMESPACES` or :data:`~degs_jax.eval.sandbox.PROCESS`),
    else ``None``.
    """

    correct: bool
    extracted: str | None
    detail: str
    isolation: str | None = None


def boxed_spans(text: str) -> list[str]:
    """Contents of every complete top-level ``\\boxed{...}``/``\\fbox{...}``, in order.

    Braces are balanced, so ``\\boxed{\\frac{1}{2}}`` gives ``\\frac{1}{2}``;
    a box nested inside another is part of the outer span; an unclosed box
    (a truncated generation) is ignored. Escaped braces ``\\{``/``\\}`` do not
    count.
    """
    spans, i = [], 0
    while (m := _BOXED_OPEN.search(text, i)) is not None:
        depth, j = 1, m.end()
        while j < len(text) and depth:
            c = text[j]
            if c == "\\":
                j += 2  # skip the escaped character (\{, \}, \\)
                continue
            depth += (c == "{") - (c == "}")
            j += 1
        if depth:
            break  # unclosed: nothing after it can be a complete top-level span
        spans.append(text[m.end():j - 1])
        i = j
    return spans


def last_boxed(text: str) -> str | None:
    """Content of the last complete boxed span, or ``None``."""
    spans = boxed_spans(text)
    return spans[-1] if spans else None


def extract_choice_letter(text: str) -> str | None:
    """GPQA letter (A-D, upper case) from the last boxed span, or ``None``."""
    boxed = last_boxed(text)
    if boxed is None:
        return None
    m = _LETTER.match(boxed)
    return m.group(1).upper() if m else None


def grade_gpqa(completion: str, gold_letter: str) -> GradeResult:
    """Exact match of the extracted letter with the gold letter."""
    letter = extract_choice_letter(completion)
    if letter is None:
        return GradeResult(False, None, "no boxed letter")
    return GradeResult(letter == gold_letter, letter, "ok")


def verify_answer(benchmark: str, question: str, gold: str, pred: str) -> bool:
    """Whether the boxed content ``pred`` is a right answer to a math benchmark's problem
    (``question``, gold answer ``gold``). Runs in-process: used inside the grading worker;
    call it directly only where a hang cannot hurt.

    DeepMind500: :func:`degs_jax.eval.deepmind.grade_answer`. MATH500 and GSM8K: math-verify,
    gold first, except that a True/False gold is compared as a word (math-verify reads
    ``True`` as the product of symbols T*r*u*e).
    """
    if benchmark == "deepmind500":
        return deepmind.grade_answer(question, gold, pred)
    if gold.strip() in ("True", "False"):
        return deepmind.yes_no("", pred) == (gold.strip() == "True")
    return deepmind.math_equal(gold, pred) or (benchmark == "gsm8k" and on_the_hour(gold, pred))


def on_the_hour(gold: str, pred: str) -> bool:
    """Whether ``pred`` is a clock time on the hour whose hour is the number ``gold``: GSM8K
    golds are numbers, so "the latest time she can start" has the gold ``2`` (test problem
    1001) and ``2:00 pm`` (or ``2:00``, ``14:00``) answers it. The hour is read on the
    12-hour clock and on the 24-hour one (``14:00`` is 14 and 2)."""
    minutes = deepmind.clock_minutes(pred)
    if minutes is None or minutes % 60 or not re.fullmatch(r"\d{1,2}", gold.strip()):
        return False
    hour = minutes // 60
    return int(gold) in (hour, hour % 12 or 12)


def _import_math_verify() -> None:
    """Worker warm-up: importing math-verify (and sympy) takes about a second."""
    import math_verify  # noqa: F401  (the warm-up is the import itself)


def _exit_with_parent(parent: int) -> None:
    """Worker initializer: exit as soon as the grading process is gone, and leave Ctrl-C
    to the grading process.

    A thread polls the parent pid. Unlike a parent-death signal, which fires when the
    *thread* that started the worker ends, this follows the whole process, whichever
    thread created the pool; ``SIGKILL`` of the parent is caught within
    :data:`_PARENT_POLL_S`. A terminal's Ctrl-C (or ``timeout -s INT``) signals the whole
    process group: the worker ignores it, so it prints no traceback while the grading
    process stops and closes the pool.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(_PARENT_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


class MathGrader:
    """math-verify in a worker process with a per-answer timeout.

    Answers are graded one at a time, so one worker suffices.

    Use as a context manager (or call :meth:`close`). Workers start lazily on
    the first answer that has a boxed span. Workers are spawned, so a script
    using this needs the ``if __name__ == "__main__":`` guard.
    """

    def __init__(self, timeout: float = DEFAULT_MATH_TIMEOUT_S,
                 startup_timeout: float = DEFAULT_STARTUP_TIMEOUT_S):
        self.timeout = timeout
        self.startup_timeout = startup_timeout
        self._pool: ProcessPoolExecutor | None = None

    def __enter__(self) -> "MathGrader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Stop the worker processes."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def grade(self, completion: str, gold: str, benchmark: str = "math500",
              question: str | None = None) -> GradeResult:
        """Grade the last boxed span of ``completion`` against ``gold``. DeepMind500 needs
        the ``question`` (its rules read it: :mod:`degs_jax.eval.deepmind`)."""
        return self.grade_answer(last_boxed(completion), gold, benchmark, question)

    def grade_answer(self, pred: str | None, gold: str, benchmark: str = "math500",
                     question: str | None = None) -> GradeResult:
        """Grade an answer already extracted from its completion (a boxed span's content,
        ``None`` where the completion has none): :meth:`grade` after the extraction, and
        what re-grading a stored record's ``extracted`` answer uses."""
        if benchmark == "deepmind500" and question is None:
            raise ValueError("a deepmind500 answer is graded against its question (the rules "
                             "read it); pass question=")
        if pred is None:
            return GradeResult(False, None, "no boxed answer")
        try:
            ok = self.call(verify_answer, benchmark, question or "", gold, pred)
        except FutureTimeout:
            return GradeResult(False, pred, "timeout")
        return GradeResult(bool(ok), pred, "ok")

    def call(self, fn: Callable, *args: Any) -> Any:
        """Run ``fn(*args)`` in a worker; on timeout kill the pool and re-raise.

        ``concurrent.futures.TimeoutError`` is raised after the pool has been
        torn down, so the next call gets fresh workers. A worker that dies is
        replaced and the call retried once.
        """
        for attempt in range(2):
            if self._pool is None:
                self._start_pool()
            future = self._pool.submit(fn, *args)
            try:
                return future.result(timeout=self.timeout)
            except FutureTimeout:
                self._kill_pool()
                raise
            except BrokenProcessPool:
                # A worker died (e.g. killed by the OOM killer): one retry on
                # fresh workers; a second failure is a real problem, so raise.
                self._kill_pool()
                if attempt:
                    raise

    def _start_pool(self) -> None:
        """One spawned worker, warmed up so its start-up is not charged to an answer."""
        self._pool = ProcessPoolExecutor(max_workers=1,
                                         mp_context=multiprocessing.get_context("spawn"),
                                         initializer=_exit_with_parent,
                                         initargs=(os.getpid(),))
        try:
            self._pool.submit(_import_math_verify).result(timeout=self.startup_timeout)
        except BaseException:
            self._kill_pool()
            raise

    def _kill_pool(self) -> None:
        """Kill hung workers. ``ProcessPoolExecutor`` has no public kill before
        Python 3.14, so its ``_processes`` map is used."""
        pool, self._pool = self._pool, None
        for process in list((pool._processes or {}).values()):
            process.kill()
        pool.shutdown(wait=True, cancel_futures=True)


class Grader:
    """One entry point for every benchmark.

    ``chat`` says whether completions came from a chat template (HumanEval
    code extraction differs). ``allow_unsandboxed`` lets HumanEval programs run under
    the sandbox's weaker fallback where there are no namespaces (else grading them
    raises :class:`~degs_jax.eval.sandbox.IsolationUnavailableError`). Holds a
    :class:`MathGrader`; use as a context manager.
    """

    def __init__(self, *, math_timeout: float = DEFAULT_MATH_TIMEOUT_S,
                 code_timeout: float = sandbox.DEFAULT_TIMEOUT_S,
                 allow_unsandboxed: bool = False):
        self.math = MathGrader(timeout=math_timeout)
        self.code_timeout = code_timeout
        self.allow_unsandboxed = allow_unsandboxed

    def __enter__(self) -> "Grader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Release the math workers."""
        self.math.close()

    def grade(self, problem: Problem, completion: str, *, chat: bool = True) -> GradeResult:
        """Grade one completion of ``problem``."""
        if problem.benchmark in MATH_BENCHMARKS:
            return self.math.grade(completion, problem.answer, problem.benchmark, problem.question)
        if problem.benchmark == "gpqa_diamond":
            return grade_gpqa(completion, problem.answer)
        return grade_humaneval(problem, completion, chat=chat, timeout=self.code_timeout,
                               allow_unsandboxed=self.allow_unsandboxed)


def grade_humaneval(problem: Problem, completion: str, *, chat: bool,
                    timeout: float = sandbox.DEFAULT_TIMEOUT_S,
                    allow_unsandboxed: bool = False) -> GradeResult:
    """Run the problem's test against one completion in the sandbox.

    ``detail`` is the sandbox's result: ``"passed"``, ``"timed out"`` or ``"failed: ..."``
    (printable ASCII, capped at :data:`degs_jax.eval.sandbox.DETAIL_CAP_CHARS`);
    ``isolation`` its isolation level. Without namespaces this raises
    :class:`~degs_jax.eval.sandbox.IsolationUnavailableError` unless ``allow_unsandboxed``.
    """
    result = sandbox.run_check(humaneval_check(problem, completion, chat=chat), timeout=timeout,
                               allow_unsandboxed=allow_unsandboxed)
    return GradeResult(result.passed, None, result.result, result.isolation)


def humaneval_check(problem: Problem, completion: str, *, chat: bool) -> sandbox.HumanEvalCheck:
    """The check of one completion: untrusted solution, trusted prompt and test."""
    return sandbox.HumanEvalCheck(
        solution=humaneval_solution(problem, completion, chat),
        test=problem.metadata["test"], entry_point=problem.metadata["entry_point"],
        context=problem.question)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of Chen et al. (2021): ``1 - C(n-c, k) / C(n, k)``.

    ``n`` samples of which ``c`` passed. Computed as a product for stability.
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))
