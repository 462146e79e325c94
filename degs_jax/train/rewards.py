"""Reward functions for GRPO: `reward_fn(tasks, completions) -> [n] float array`, one
reward per completion (completion i answers tasks[i]); completions are token ids (EOS
included when generated). Any callable of that shape plugs into `train_grpo`.

- :class:`MathReward`: 1 if math-verify accepts the last ``\\boxed{}`` answer against
  the task's gold answer, else 0 (the evaluation harness's grader, in a worker process
  with a timeout; a timeout counts as wrong).
- :class:`ContainsTokenReward`: 1 if a target token occurs in the completion (a toy
  verifiable task for tests and demonstrations).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..eval.graders import DEFAULT_MATH_TIMEOUT_S, MathGrader
from .data import Task


class MathReward:
    """Correctness of the completion's boxed answer (1.0 / 0.0) by math-verify.

    tokenizer: decodes completions (special tokens skipped). Each task's `target` is a
    :class:`~degs_jax.eval.benchmarks.Problem` (its `answer` and `benchmark` select the
    gold answer's normalisation). Holds a worker process: use as a context manager or
    call :meth:`close`.
    """

    def __init__(self, tokenizer, timeout: float | None = None):
        self.tokenizer = tokenizer
        self.grader = MathGrader(timeout=DEFAULT_MATH_TIMEOUT_S if timeout is None else timeout)

    def __enter__(self) -> "MathReward":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.grader.close()

    def __call__(self, tasks: Sequence[Task], completions: Sequence[Sequence[int]]) -> np.ndarray:
        texts = self.tokenizer.batch_decode([list(c) for c in completions], skip_special_tokens=True)
        return np.array([float(self.grader.grade(text, t.target.answer, t.target.benchmark,
                                                 t.target.question).correct)
                         for t, text in zip(tasks, texts, strict=True)], np.float32)

    def __repr__(self) -> str:
        return "MathReward(math-verify on the last boxed answer)"


class ContainsTokenReward:
    """1.0 for a completion that contains `token`, else 0.0."""

    def __init__(self, token: int):
        self.token = int(token)

    def __call__(self, tasks: Sequence[Task], completions: Sequence[Sequence[int]]) -> np.ndarray:
        return np.array([float(self.token in c) for c in completions], np.float32)

    def __repr__(self) -> str:
        return f"ContainsTokenReward({self.token})"
