"""Training prompts: tasks and the prompts of each training step.

A :class:`Task` is a prompt as token ids plus whatever its reward needs (`target`: for
math, the :class:`~degs_jax.eval.benchmarks.Problem` with its gold answer). Step `s` of a
run takes positions `s·n .. s·n + n - 1` of an endless stream that visits the tasks in a
fresh permutation every epoch, drawn by numpy's PCG64 from `(seed, epoch)`. The prompts
of a step are therefore a pure function of (tasks, seed, step): a resumed run sees the
prompts an uninterrupted one would, without storing a data cursor.

The default training set is GSM8K's *train* split (`gsm8k_train.jsonl` of the benchmark
data directory, by default the copy installed with the package; sha256-checked); the prompt is the evaluation harness's math template through
the tokenizer's chat template, so a trained policy is asked exactly what `degs eval`
asks. The test split is refused.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from ..eval.benchmarks import SHA256, Problem, default_data_dir, gsm8k_gold
from ..eval.prompts import problem_prompt_ids

GSM8K_TRAIN_FILE = "gsm8k_train.jsonl"
GSM8K_TRAIN_SHA256 = "17f347dc51477c50d4efb83959dbb7c56297aba886e5544ee2aaed3024813465"


@dataclasses.dataclass(frozen=True)
class Task:
    """One training prompt. id: stable name; prompt_ids: token ids (chat template
    applied); target: what the reward function compares against (e.g. a Problem)."""

    id: str
    prompt_ids: tuple[int, ...]
    target: Any = dataclasses.field(default=None, compare=False)


def step_tasks(tasks: Sequence[Task], step: int, n: int, seed: int) -> list[Task]:
    """The `n` tasks of training step `step` (module docstring)."""
    if not tasks:
        raise ValueError("no training tasks")
    N = len(tasks)
    out, cache = [], {}
    for i in range(step * n, step * n + n):
        epoch, pos = divmod(i, N)
        if epoch not in cache:
            cache[epoch] = np.random.default_rng([seed, epoch]).permutation(N)
        out.append(tasks[int(cache[epoch][pos])])
    return out


def tasks_fingerprint(tasks: Sequence[Task]) -> str:
    """sha256 of the tasks' ids and prompt ids (recorded so a resumed run can check that
    it trains on the same prompts)."""
    digest = hashlib.sha256()
    for t in tasks:
        digest.update(json.dumps([t.id, list(t.prompt_ids)]).encode())
    return digest.hexdigest()


def pad_prompts(tasks: Sequence[Task], length: int) -> tuple[np.ndarray, np.ndarray]:
    """Prompt ids right-padded with 0 to `length`: ([n, length] int32, [n] int32 lengths)."""
    out = np.zeros((len(tasks), length), np.int32)
    for i, t in enumerate(tasks):
        if not 0 < len(t.prompt_ids) <= length:
            raise ValueError(f"task {t.id}: prompt of {len(t.prompt_ids)} tokens does not fit "
                             f"the {length}-token prompt buffer")
        out[i, : len(t.prompt_ids)] = t.prompt_ids
    return out, np.array([len(t.prompt_ids) for t in tasks], np.int32)


def default_gsm8k_train_path() -> Path:
    return default_data_dir() / GSM8K_TRAIN_FILE


def read_gsm8k_rows(path: str | os.PathLike, data: Optional[bytes] = None) -> list[dict]:
    """The rows of a GSM8K-format JSONL file (``data``: its bytes, if already read): each
    an object with a string ``question`` and a string ``answer`` ending in a
    ``#### <final answer>`` line. ValueError naming the file and line otherwise; checked
    by the commands before a model loads."""
    path = Path(path)
    if data is None:
        if not path.is_file():
            raise FileNotFoundError(f"training data not found: {path}")
        data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (byte {e.start})") from None
    rows = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            raise ValueError(f"{path}:{number}: not valid JSON ({e})") from None
        if not (isinstance(row, dict) and isinstance(row.get("question"), str)
                and isinstance(row.get("answer"), str)):
            raise ValueError(f"{path}:{number}: each row needs a string 'question' and a string "
                             "'answer' (GSM8K's fields)")
        if "####" not in row["answer"]:
            raise ValueError(f"{path}:{number}: the 'answer' has no '#### <final answer>' line")
        rows.append(row)
    if not rows:
        raise ValueError(f"{path} holds no rows")
    return rows


def gsm8k_train_tasks(tokenizer, path: Optional[str | os.PathLike] = None, *, chat: bool = True,
                      max_prompt_len: Optional[int] = None, limit: Optional[int] = None,
                      verify_checksum: bool = True) -> list[Task]:
    """GSM8K training problems as tasks, in file order (ids `gsm8k_train/<row>`).

    path: default `gsm8k_train.jsonl` of the data directory, checked against its sha256 (a modified
    copy needs verify_checksum=False). The GSM8K test split is refused whatever its path.
    max_prompt_len: drop problems whose prompt is longer (their number is in the error
    when nothing is left). limit: the first `limit` problems.
    """
    path = Path(path) if path is not None else default_gsm8k_train_path()
    if not path.is_file():
        raise FileNotFoundError(f"training data not found: {path}")
    data = path.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if digest == SHA256["gsm8k_test.jsonl"]:
        raise ValueError(f"{path} is the GSM8K test split; training on it would contaminate the "
                         "evaluation (use gsm8k_train.jsonl)")
    if verify_checksum and digest != GSM8K_TRAIN_SHA256:
        raise ValueError(f"{path}: sha256 {digest} is not that of gsm8k_train.jsonl "
                         f"({GSM8K_TRAIN_SHA256}); pass verify_checksum=False for another file")
    rows = read_gsm8k_rows(path, data)
    if limit is not None:
        rows = rows[:limit]
    tasks, too_long = [], 0
    for i, row in enumerate(rows):
        problem = Problem(id=f"gsm8k_train/{i}", benchmark="gsm8k", question=row["question"],
                          answer=gsm8k_gold(row["answer"]))
        ids = tuple(problem_prompt_ids(problem, tokenizer, chat))
        if max_prompt_len is not None and len(ids) > max_prompt_len:
            too_long += 1
            continue
        tasks.append(Task(id=problem.id, prompt_ids=ids, target=problem))
    if not tasks:
        raise ValueError(f"{path}: no problem has a prompt of at most {max_prompt_len} tokens "
                         f"({too_long} too long)")
    return tasks
