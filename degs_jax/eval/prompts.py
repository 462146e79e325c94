"""Prompt templates (one per benchmark, shared by every decoder) and HumanEval
program assembly.

- Math (MATH500, DeepMind500, GSM8K): zero-shot chain of thought, final answer
  in ``\\boxed{}`` (the Qwen2.5-Math instruction).
- GPQA: the question and four shuffled options, boxed letter.
- HumanEval: chat models are asked to complete the function in a fenced code
  block; base models get the raw prompt (signature + docstring) and continue it.

:func:`build_prompt` applies the tokenizer's chat template when it has one
(``add_generation_prompt=True``) and returns raw text otherwise. Record
:func:`template_hash` with every result so a changed template is visible.
"""

from __future__ import annotations

import hashlib
import re
import textwrap
from typing import Any, Optional

from degs_jax.chat import encode_prompt, uses_chat_template
from degs_jax.eval.benchmarks import LETTERS, MATH_BENCHMARKS, Problem, canonical_name

MATH_TEMPLATE = (
    "{question}\n\n"
    "Please reason step by step, and put your final answer within \\boxed{{}}."
)

GPQA_TEMPLATE = (
    "Answer the following multiple choice question. Think step by step, then give "
    "the letter of the correct option (A, B, C or D) within \\boxed{{}}.\n\n"
    "{question}\n\n"
    "A) {A}\nB) {B}\nC) {C}\nD) {D}"
)

HUMANEVAL_CHAT_TEMPLATE = (
    "Complete the following Python function. Reply with the complete function "
    "(including the signature) in a single ```python code block.\n\n"
    "```python\n{question}```"
)
# Base models continue the prompt itself (the HumanEval convention).
HUMANEVAL_RAW_TEMPLATE = "{question}"

# Base-model HumanEval completions are cut at the first line that starts a new
# top-level statement (the stop sequences of the Codex paper).
HUMANEVAL_STOP_SEQUENCES = ("\ndef ", "\nclass ", "\nif ", "\nprint(", "\n#", "\nassert ")
# The stop strings HumanEval decodes with in the completion format unless a run gives its
# own (`benchmark_stop`): the Codex paper's, as openai/human-eval's reference code uses
# them. The decoders end a completion there; the grader still cuts at the list above.
HUMANEVAL_DECODING_STOPS = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)


def benchmark_stop(benchmark: str, chat: bool, stop: Optional[tuple[str, ...]]) -> Optional[tuple[str, ...]]:
    """The stop strings a run of `benchmark` decodes with (None: none): `stop` when given
    (() is none: `--no-stop`), else HUMANEVAL_DECODING_STOPS for HumanEval in the
    completion format (not `chat`), else none. None for none, so that a run without stop
    strings records what runs recorded before stop strings existed (and resumes them)."""
    if stop is None and canonical_name(benchmark) == "humaneval" and not chat:
        return HUMANEVAL_DECODING_STOPS
    return stop or None


def templates(benchmark: str) -> tuple[str, ...]:
    """Every template text a benchmark can use (chat first, then raw)."""
    key = canonical_name(benchmark)
    if key in MATH_BENCHMARKS:
        return (MATH_TEMPLATE,)
    if key == "gpqa_diamond":
        return (GPQA_TEMPLATE,)
    return (HUMANEVAL_CHAT_TEMPLATE, HUMANEVAL_RAW_TEMPLATE)


def template_hash(benchmark: str) -> str:
    """sha256 of the benchmark's template text(s), to store with results."""
    return hashlib.sha256("\0".join(templates(benchmark)).encode("utf-8")).hexdigest()


def user_message(problem: Problem, chat: bool = True) -> str:
    """The filled-in template (the user turn for chat models, the text for base models)."""
    if problem.benchmark in MATH_BENCHMARKS:
        return MATH_TEMPLATE.format(question=problem.question)
    if problem.benchmark == "gpqa_diamond":
        return GPQA_TEMPLATE.format(question=problem.question, **dict(zip(LETTERS, problem.choices)))
    template = HUMANEVAL_CHAT_TEMPLATE if chat else HUMANEVAL_RAW_TEMPLATE
    return template.format(question=problem.question)


def problem_prompt_ids(problem: Problem, tokenizer, chat: bool) -> list[int]:
    """Token ids of ``problem``'s prompt: the benchmark template, through the tokenizer's
    chat template when ``chat`` and it has one (same ids as ``build_prompt`` + tokenize)."""
    chat = chat and uses_chat_template(tokenizer)
    return encode_prompt(tokenizer, user_message(problem, chat=chat), chat=chat)


def build_prompt(problem: Problem, tokenizer: Any = None) -> str:
    """The prompt text for ``problem``.

    With a chat-template tokenizer the template's user turn is wrapped by
    ``tokenizer.apply_chat_template(..., add_generation_prompt=True)`` (no
    system message is added beyond what the template itself inserts). Without
    one (base models, or ``tokenizer=None``) the raw text is returned.
    """
    chat = uses_chat_template(tokenizer)
    text = user_message(problem, chat=chat)
    if not chat:
        return text
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)


def extract_code(reply: str, entry_point: str | None = None) -> str:
    """The code in a chat reply.

    Fenced blocks (```python or bare ```, an unclosed last fence included) win:
    the first one that defines ``entry_point``, else the first python-tagged
    one, else the first. Without fences the whole reply is taken as code.
    """
    blocks = [(lang.lower(), body) for lang, body in _FENCE.findall(reply)]
    if not blocks:
        return reply
    if entry_point is not None:
        for _, body in blocks:
            if _defines(body, entry_point):
                return body
    for lang, body in blocks:
        if lang in ("python", "py", "python3"):
            return body
    return blocks[0][1]


def truncate_completion(completion: str) -> str:
    """Cut a base-model continuation at the first :data:`HUMANEVAL_STOP_SEQUENCES`."""
    cut = min((i for s in HUMANEVAL_STOP_SEQUENCES if (i := completion.find(s)) >= 0),
              default=len(completion))
    return completion[:cut]


def humaneval_solution(problem: Problem, completion: str, chat: bool) -> str:
    """``prompt + completion`` for human-eval's check program.

    - Base model (``chat=False``): the continuation, truncated at the stop
      sequences, is appended to the prompt (the standard protocol).
    - Chat model: code is extracted from the reply. If it defines the entry
      point the model rewrote the function: it is appended after the original
      prompt, so the prompt's imports and helper functions stay available and
      the model's definition (coming later) is the one tested. Otherwise it is
      taken as the body and indented to function level when it is not already.
    """
    if not chat:
        return problem.question + truncate_completion(completion)
    entry_point = problem.metadata["entry_point"]
    code = extract_code(completion, entry_point)
    if _defines(code, entry_point):
        return problem.question + "\n" + code
    if code.strip() and not code.lstrip("\n")[:1].isspace():
        code = textwrap.indent(code, "    ")
    return problem.question + code


def _defines(code: str, name: str) -> bool:
    """Whether ``code`` has a top-level ``def name(`` (possibly ``async``)."""
    return re.search(rf"^(async\s+)?def\s+{re.escape(name)}\s*\(", code, re.MULTILINE) is not None
