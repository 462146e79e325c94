"""The paper's study for one model, from one resumable command (`degs reproduce`).

- :mod:`degs_jax.reproduce.study`: what runs (Table 1 decoders, the predictive-validity
  pool, the layer pass), in which order, within which time budget; resumable. Its rows
  (``study_rows``) are what the method classes state of themselves
  (``degs_jax.method.StudyRow``).
- :mod:`degs_jax.reproduce.report`: tables, figures and ``report.md`` from the stored
  files alone; a compact export for committing. It composes ``study_files`` (reading the
  directory), the tables of ``accuracy``, ``pool_tables``, ``compute_accounting``,
  ``deviations`` and ``claims``, ``figures`` and ``markdown``.
- :mod:`degs_jax.reproduce.paper`: the paper's numbers, quoted, for side-by-side tables.
- :mod:`degs_jax.cli.reproduction` (the CLI layer): the `degs reproduce` command line.

Running a study needs neither scipy nor matplotlib (they are imported by the report
only), so a GPU machine can run it with ``--no-report`` and the report be written
elsewhere with ``--report-only``.
"""

from degs_jax.reproduce.study import (
    StudyRequest,
    available_methods,
    format_plan,
    paper_lsub_sets,
    plan_jobs,
    plan_table,
    run_study,
    study_rows,
)

_REPORT = ("build_tables", "export_study", "load_study", "write_report")

__all__ = ["StudyRequest", "available_methods", "format_plan", "paper_lsub_sets", "plan_jobs",
           "plan_table", "run_study", "study_rows", *_REPORT]


def __getattr__(name):
    if name in _REPORT:
        from degs_jax.reproduce import report  # scipy, matplotlib: only when asked for

        return getattr(report, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
