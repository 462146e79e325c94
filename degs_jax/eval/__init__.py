"""Evaluation harness: benchmarks, prompts, graders, sandbox, result store.

Typical use (``degs eval``)::

    problems = load_benchmark("math500")
    with ResultStore(run_dir / "results.jsonl") as store, Grader() as grader:
        for problem in problems:
            if store.is_done(problem.id):
                continue
            prompt = build_prompt(problem, tokenizer)
            completion = ...  # any decoder
            verdict = grader.grade(problem, completion, chat=uses_chat_template(tokenizer))
            store.append({"id": problem.id, "correct": verdict.correct,
                          "extracted": verdict.extracted,
                          **transcript_fields(problem, completion)})
        write_summary(run_dir, summarize(store.records,
                                         template_sha256=template_hash("math500"),
                                         versions=package_versions()))

Nothing here imports JAX.
"""

from degs_jax.eval.benchmarks import (
    BENCHMARKS,
    ChecksumError,
    Problem,
    default_data_dir,
    gpqa_permutation,
    load_benchmark,
)
from degs_jax.eval.graders import (
    Grader,
    GradeResult,
    MathGrader,
    extract_choice_letter,
    grade_gpqa,
    grade_humaneval,
    humaneval_check,
    last_boxed,
    pass_at_k,
)
from degs_jax.eval.prompts import build_prompt, template_hash, uses_chat_template
from degs_jax.eval.results import (
    ResultStore,
    numeric_means,
    package_versions,
    summarize,
    transcript_fields,
    write_summary,
)
from degs_jax.stats import Accuracy, accuracy, wilson_interval  # the summaries' statistics
from degs_jax.eval.sandbox import (
    ExecutionResult,
    HumanEvalCheck,
    IsolationUnavailableError,
    run_check,
    run_checks,
)

__all__ = [
    "BENCHMARKS", "ChecksumError", "Problem", "default_data_dir", "gpqa_permutation",
    "load_benchmark", "Grader", "GradeResult", "MathGrader", "extract_choice_letter",
    "grade_gpqa", "grade_humaneval", "humaneval_check", "last_boxed", "pass_at_k",
    "build_prompt", "template_hash", "uses_chat_template", "Accuracy", "ResultStore",
    "accuracy", "numeric_means", "package_versions", "summarize", "transcript_fields",
    "wilson_interval", "write_summary", "ExecutionResult", "HumanEvalCheck",
    "IsolationUnavailableError", "run_check", "run_checks",
]
