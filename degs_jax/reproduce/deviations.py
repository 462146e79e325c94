"""The report's deviations table: every setting where the study could differ from the paper's.

:func:`deviations_table` reads the recorded configuration (study.json, each run's
run.json) against :mod:`degs_jax.reproduce.paper` and the decoders' defaults (the
paper's), one row per setting with ``setting``, ``paper``, ``used``, ``deviates`` and,
where the records measure it, ``effect``: the model and its prompts, the completion token
cap, candidate sampling, Scalable Power Sampling's candidate temperature, the DeepMind500
grader, where a HumanEval completion ends, the other hyperparameters and selection
weights the study recorded as deviating, and which problems and Table 1 cells ran.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Optional

import numpy as np

from degs_jax.eval.graders import RULES_VERSION
from degs_jax.methods import BestOfN, ScalablePower
from degs_jax.method import Method
from degs_jax.models.loading import BUILTIN_MODELS
from degs_jax.reproduce import paper
from degs_jax.reproduce.study import POOL_METHOD, TABLE1_ORDER, row_label
from degs_jax.reproduce.study_files import Study, pool_sampling

# Settings reported as the completion token cap (an MCMC chain's is num_blocks · block_len).
_CAP_SETTINGS = ("max_new_tokens", "num_blocks", "block_len")
_SAMPLING = tuple(paper.CANDIDATE_SAMPLING)  # n, temperature, top_p


def _token_cap(method: Method) -> tuple[int, Optional[str]]:
    """(token cap, how an MCMC chain makes it up) of a run's method."""
    if hasattr(method, "num_blocks"):
        return method.max_new_tokens, f"{method.num_blocks} blocks of {method.block_len}"
    return method.max_new_tokens, None


def _range(low: float, high: float) -> str:
    return f"{low:.0f}" if round(low) == round(high) else f"{low:.0f}–{high:.0f}"


def _cap_text(cap: tuple[int, Optional[str]]) -> str:
    return f"{cap[0]}" + (f" ({cap[1]})" if cap[1] else "")


def _where(items) -> str:
    """(label, benchmark) pairs as ``"a, b on gsm8k, math500; c on humaneval"``."""
    by_label: dict[str, set] = {}
    for label, benchmark in items:
        by_label.setdefault(label, set()).add(benchmark)
    groups: dict[tuple, list] = {}
    for label, benchmarks in by_label.items():
        groups.setdefault(tuple(sorted(benchmarks)), []).append(label)
    return "; ".join(f"{', '.join(labels)} on {', '.join(bs)}" for bs, labels in groups.items())


def _mean_candidate_accuracy(records, indices) -> float:
    return float(np.mean([bool(c["correct"]) for r in records if r["index"] in indices
                          for c in r.get("candidates", [])]))


def _all_runs(study: Study) -> dict[tuple[str, str, str], dict]:
    """Every run of the study by (``"runs"`` or ``"pool"``, benchmark, decoder)."""
    runs = {("runs", b, m): data for (b, m), data in study.runs.items()}
    runs.update({("pool", b, POOL_METHOD): data for b, data in study.pools.items()})
    return runs


def _deviation(setting, paper_value, used, deviates, effect=None) -> dict:
    return {"setting": setting, "paper": paper_value, "used": used, "deviates": bool(deviates),
            "effect": effect}


def _model_rows(study: Study, configs: Mapping) -> list[dict]:
    """The model and how it was prompted; HumanEval's prompt."""
    name = study.meta["model"]["name"]
    cfg = next(iter(configs.values()), {}).get("model", {})
    recorded = [inv["model"] for inv in study.meta["invocations"] if inv.get("model")]
    sources = sorted({Path(inv["model_source"]).name for data in _all_runs(study).values()
                      for inv in data["run"].get("invocations", []) if inv.get("model_source")}
                     | {Path(m["source"]).name for m in recorded})
    chat = sorted({bool(c.get("chat")) for c in configs.values()})
    template = sorted({m["chat_template"] for m in recorded})  # empty: not recorded
    described = [f"`{name}`"]
    if name in BUILTIN_MODELS:
        described.append(BUILTIN_MODELS[name].description)
    described.append(f"{cfg.get('architecture', '?')}, {study.num_layers} layers, "
                     f"{cfg.get('dtype', '?')} weights"
                     + (f" from {', '.join(sources)}" if sources else ""))
    if chat == [True]:
        described.append("chat requested, but the tokenizer has no chat template: raw prompts"
                         if template == [False] else "prompts through its chat template"
                         + ("" if template else " (run configuration chat = true)"))
    elif chat == [False]:
        described.append("raw prompts (no chat template)")
    elif chat:  # each benchmark in its own format (`degs reproduce --raw-prompts`)
        raw = sorted({b for (_, b, _), c in configs.items() if not c.get("chat")})
        described.append(f"prompts through its chat template; raw text for {', '.join(raw)}")
    rows = [_deviation("model", f"{', '.join(paper.MODELS)}: 7B base and math models",
                       "; ".join(described),
                       not any(m.lower() in name.lower() for m in paper.MODELS))]
    humaneval = [c for (kind, b, m), c in configs.items() if b == "humaneval"]
    if humaneval:
        as_chat = any(c.get("chat") for c in humaneval) and template != [False]
        rows.append(_deviation(
            "HumanEval prompt", paper.HUMANEVAL_PROMPT,
            "a chat turn asking for the whole function in a code block" if as_chat
            else paper.HUMANEVAL_PROMPT, as_chat))
    return rows


def _token_cap_rows(runs: Mapping) -> list[dict]:
    """The completion token cap of every run against its decoder's default (the paper's),
    with how many final completions ran into it."""
    caps: dict[str, list] = {}
    paper_caps, capped = set(), False
    for (kind, b, m), data in runs.items():
        used, cap = _token_cap(data["decoder"]), _token_cap(type(data["decoder"])())  # the defaults
        caps.setdefault(_cap_text(used), []).append(("pool" if kind == "pool" else m, b))
        paper_caps.add(cap)
        capped |= used != cap
    if not caps:
        return []
    cut: dict[str, list] = {}
    for (kind, b, m), data in runs.items():
        if kind == "runs" and data["records"]:
            cut.setdefault(b, []).append(np.mean([not r["ended"] for r in data["records"]]))
    effect = ("final completions that ended without EOS (at the cap), lowest and highest over "
              "a benchmark's decoders: " + ", ".join(
                  f"{b} {_range(100 * min(v), 100 * max(v))}%" for b, v in sorted(cut.items())))
    return [_deviation(
        "completion token cap",
        ", ".join(_cap_text(c) for c in sorted(paper_caps, key=lambda c: (c[0], c[1] or ""))),
        "; ".join(f"{used}: {_where(items)}" for used, items in caps.items()),
        capped, effect if cut else None)]


def _paper_best_of_n(pool: BestOfN) -> bool:
    """Whether a Best-of-N pool samples as the paper's Table 1 Best-of-N may
    (:data:`paper.BEST_OF_N_SAMPLING`)."""
    low, high = paper.BEST_OF_N_TEMPERATURES
    return (pool.n == paper.BEST_OF_N_N and low <= pool.temperature <= high
            and pool.top_p in paper.BEST_OF_N_TOP_P)


def _sampling_rows(runs: Mapping) -> list[dict]:
    """Candidate sampling of the Best-of-N runs (against Table 1's Best-of-N) and of the
    predictive-validity pools (against the paper's pool), with the mean candidate accuracy
    of both where a benchmark has both at different settings."""
    sampling = {(kind, b): pool_sampling(data["decoder"])
                for (kind, b, m), data in runs.items() if m == POOL_METHOD}
    rows = []
    for kind, setting in (("runs", "Best-of-N pool (Best-of-N and its selections)"),
                          ("pool", "predictive-validity pool")):
        by_value: dict[str, list] = {}
        for (k, b), value in sampling.items():
            if k == kind:
                by_value.setdefault(value, []).append(b)
        if not by_value:
            continue
        effects = []
        for b in sorted(b for (k, b) in sampling if k == kind == "runs"):
            other = sampling.get(("pool", b))
            if other is not None and other != sampling[("runs", b)]:
                records = runs[("runs", b, POOL_METHOD)]["records"]
                pool = runs[("pool", b, POOL_METHOD)]["records"]
                common = {r["index"] for r in records} & {r["index"] for r in pool}
                effects.append(
                    f"mean candidate accuracy on the {len(common)} {b} problems both drew: "
                    f"{_mean_candidate_accuracy(records, common):.3f} at {sampling[('runs', b)]} "
                    f"vs {_mean_candidate_accuracy(pool, common):.3f} at {other} (the "
                    "predictive-validity pool)")
        if kind == "runs":
            target = paper.BEST_OF_N_SAMPLING
            deviates = not all(_paper_best_of_n(data["decoder"]) for (k, b, m), data in runs.items()
                               if k == "runs" and m == POOL_METHOD)
        else:
            target = pool_sampling(BestOfN(**paper.CANDIDATE_SAMPLING))
            deviates = set(by_value) != {target}
        rows.append(_deviation(
            setting, target,
            "; ".join(f"{value}: {', '.join(sorted(bs))}" for value, bs in by_value.items()),
            deviates, "; ".join(effects) or None))
    return rows


def _sps_rows(runs: Mapping) -> list[dict]:
    """The temperature of Scalable Power Sampling's candidate blocks (the paper's table
    gives it as T = 0.25; the decoder's default draws them from p, T = 1)."""
    used = {(data["decoder"].candidate_temperature, b) for (kind, b, m), data in runs.items()
            if isinstance(data["decoder"], ScalablePower)}
    if not used:
        return []
    by_value: dict[float, list] = {}
    for t, b in used:
        by_value.setdefault(t, []).append(b)
    return [_deviation(
        "Scalable Power Sampling candidate temperature", f"T = {paper.SPS_CANDIDATE_TEMPERATURE:g}",
        "; ".join(f"T = {t:g}: {', '.join(sorted(bs))}" for t, bs in sorted(by_value.items())),
        set(by_value) != {paper.SPS_CANDIDATE_TEMPERATURE})]


def grading_rules(run: Mapping[str, Any]) -> list[int]:
    """The grading-rule versions (:data:`degs_jax.eval.graders.RULES_VERSION`) behind a run's
    stored verdicts: the last re-grading's, and those of invocations that started after
    it (an invocation that records none graded by version 1)."""
    regrades = run.get("regrades") or []
    since = regrades[-1]["when"] if regrades else ""
    versions = {regrades[-1]["rules_version"]} if regrades else set()
    versions |= {inv.get("grading_rules", 1) for inv in run.get("invocations", [])
                 if inv.get("started", "") > since}
    return sorted(versions)


def _grader_rows(study: Study, runs: Mapping) -> list[dict]:
    """How DeepMind500 answers were graded (the paper: as MATH500's), with the verdicts a
    re-grading changed."""
    deepmind = {key: data for key, data in runs.items() if key[1] == "deepmind500"}
    if not deepmind:
        return []
    versions = sorted({v for data in deepmind.values() for v in grading_rules(data["run"])})
    used = ("math-verify with the DeepMind500 rules (yes/no for True/False golds, clock times, "
            "digits in a base, ordered lists where the question asks to sort, multiple choice "
            "by letter or option; degs_jax/eval/deepmind.py)")
    if versions != [RULES_VERSION]:
        used += (f"; stored verdicts by grading rules {', '.join(map(str, versions))} (the "
                 f"current rules are version {RULES_VERSION}: `degs reproduce --regrade`)")
    # a chosen completion of a run that keeps candidates is one of its candidates too
    kept = {f"{kind}/{b}" + ("" if kind == "pool" else f"/{m}")
            for (kind, b, m), data in deepmind.items()
            if any("candidates" in r for r in data["records"])}
    effects = []
    for regrade in study.meta.get("regrades", []):
        changed = [c for c in regrade["changed"] if c["problem_id"].startswith("deepmind500/")]
        if changed:
            distinct = sum(c["candidate"] is not None or c["directory"] not in kept
                           for c in changed)
            effects.append(
                f"re-grading on {regrade['when'][:10]} (rules version {regrade['rules_version']}) "
                f"changed {len(changed)} stored DeepMind500 verdicts, of {distinct} distinct "
                "completions (a chosen Best-of-N completion is stored again as a candidate); "
                "listed in study.json")
    return [_deviation("DeepMind500 grader", paper.DEEPMIND_GRADER, used, True,
                       "; ".join(effects) or None)]


def _humaneval_end_rows(runs: Mapping) -> list[dict]:
    """Where a HumanEval completion ends: at a stop sequence, or at EOS / the token cap, with
    how many final completions ran to the cap."""
    humaneval = {key: data for key, data in runs.items() if key[1] == "humaneval"}
    if not humaneval:
        return []
    stops = sorted({json.dumps(data["run"]["config"]["hyperparameters"].get("stop") or None)
                    for data in humaneval.values()})
    if stops == ["null"]:
        used = ("no stop sequences: a completion runs to EOS or the token cap; the function is "
                "cut out of it before grading")
    else:
        used = "stop sequences " + "; ".join(stops)
    capped = [np.mean([not r["ended"] for r in data["records"]])
              for (kind, b, m), data in humaneval.items() if kind == "runs" and data["records"]]
    effect = (f"final completions that ended without EOS or stop (at the cap): "
              f"{_range(100 * min(capped), 100 * max(capped))}% over the HumanEval decoders"
              if capped else None)
    return [_deviation("HumanEval completion end", paper.HUMANEVAL_END, used, stops == ["null"],
                       effect)]


def _recorded_rows(study: Study, status: Mapping) -> list[dict]:
    """The other hyperparameters and selection weights the study recorded as differing
    from the paper's (study.json; token caps and candidate sampling have their own rows)."""
    grouped: dict[tuple, list] = {}
    for job in study.latest("jobs").values():
        label = "pool" if job["kind"] == "pool" else job["method"]
        for k, v in job["deviations"].items():
            if k in _CAP_SETTINGS or (job["method"] == POOL_METHOD and k in _SAMPLING):
                continue
            grouped.setdefault((k, json.dumps(v["paper"]), json.dumps(v["used"])), []).append(
                (label, job["benchmark"]))
    rows = [_deviation(k, json.loads(paper_value), f"{json.loads(used)}: {_where(items)}", True)
            for (k, paper_value, used), items in sorted(grouped.items())]
    rows += [_deviation(f"{row_label(m)} selection weights", v["paper"],
                        f"{v['used']}: {b}", True)
             for b, dev in status["selection_deviations"].items() for m, v in dev.items()]
    return rows


def _coverage_rows(study: Study, status: Mapping, verdict) -> list[dict]:
    """Problems per benchmark, Table 1 cells not run, and how the L_sub ablation measures."""
    done: dict[str, list] = {}
    for job in status["jobs"]:
        if job["kind"] == "decoder":
            done.setdefault(job["benchmark"], []).append(job["done"])
    sizes = paper.BENCHMARK_SIZES
    rows = [_deviation(
        "problems per benchmark", ", ".join(f"{b} {n}" for b, n in sizes.items()),
        ", ".join(f"{b} {_range(min(v), max(v))}"
                  + ("" if b in sizes else " (not in the paper's Table 1)") for b, v in done.items()),
        any(b not in sizes or min(v) < sizes[b] for b, v in done.items()))]
    table_rows = {m for table in paper.TABLE1.values() for m in table}
    ours = {m for _, m in verdict}
    missing = [", ".join(row_label(m) for m in TABLE1_ORDER if m in table_rows - ours),
               ", ".join(paper.BENCHMARK_LABELS[b] for b in sizes if b not in done)]
    rows.append(_deviation("Table 1 cells", f"{len(table_rows)} methods × {len(sizes)} benchmarks",
                           "not run: " + "; ".join(x for x in missing if x) if any(missing)
                           else "all run", any(missing)))
    if any("layers" in pool for pool in study.pools.values()):
        rows.append(_deviation(
            "L_sub ablation", paper.LSUB_MEASURE,
            "each probe set scored on the predictive-validity pool: reranking accuracy and AUC "
            "(one teacher-forced pass; no chain per set)", True))
    return rows


def deviations_table(study: Study, status: Mapping, verdict) -> list[dict]:
    """Every setting where this study could differ from the paper's, from the recorded
    configuration (study.json, each run's run.json) against :mod:`paper` and the
    decoders' defaults (the paper's): one row each with ``setting``, ``paper``, ``used``,
    ``deviates`` and, where the records measure it, ``effect``."""
    runs = _all_runs(study)
    configs = {key: data["run"]["config"] for key, data in runs.items()}
    return (_model_rows(study, configs) + _token_cap_rows(runs)
            + _sampling_rows(runs) + _sps_rows(runs) + _grader_rows(study, runs)
            + _humaneval_end_rows(runs) + _recorded_rows(study, status)
            + _coverage_rows(study, status, verdict))
