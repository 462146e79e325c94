"""The anatomy of a run's Metropolis-Hastings decisions, and the beta at which the depth
term starts to decide them (docs/design.md §4; the records are `mcmc.MHDecisions`).

Every MH decision of DEGS-MCMC accepts when

    log u < log r = log r_0 + beta·ΔD,

where log r_0 is the log ratio of power sampling (beta = 0; the alpha·Δlog p of the suffix
cancels against Δlog q only in part: what is left is the proposal's and the cut index's
share of the ratio) and ΔD = D(x') - D(x). A run's records hold log r_0, ΔD and log u of
every decision, so for any other beta they say, at the states the chain visited:

- **expected flips**: the decisions whose outcome beta·ΔD changes, in expectation over u,
  sum_i |min(1, exp(log r_0 + beta·ΔD)) - min(1, exp(log r_0))| (first order: a flipped
  decision moves the chain elsewhere, and later decisions are then other decisions);
- **realized flips**, with the run's own u: the decisions with log u between log r_0 and
  log r_0 + beta·ΔD. Under common random numbers (the same keys) a chain at another beta
  draws the same cuts, proposals and u as the recorded chain until their decisions first
  differ, so a chain whose records show no decided decision (`depth_decided`: then it is
  the power-MCMC chain of its keys) and no realized flip at beta is, at beta, that same
  chain token for token; the first realized flip is where the chain at beta departs
  (exactly, up to float32 rounding of log r between the kernel and this sum).
- **departing chains**: expected, sum over chains of 1 - prod_i (1 - p_i), and realized.

Null moves (the proposal equals the current state) have log r_0 = 0 up to rounding and
ΔD = 0: always accepted, never flipped; the statistics are given with and without them.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping, Optional, Sequence

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from .plots import save_png

__all__ = ["DecisionTable", "decision_table", "has_decision_records", "flip_curve", "first_decided", "departures",
           "decision_anatomy", "format_anatomy",
           "plot_decisions", "BETA_GRID", "NEAR_ZERO_NATS"]

# The betas of the flip curve: 0.1 .. 10,000 on a log grid, with the paper's range in it.
BETA_GRID = tuple(sorted({0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0,
                          1000.0, 2000.0, 5000.0, 10000.0}))
# |log r_0| within this many nats of 0: decisions a small depth term can tip.
NEAR_ZERO_NATS = 0.25


@dataclasses.dataclass
class DecisionTable:
    """Every recorded MH decision of a run, flattened ([n] each); `chain` numbers the
    chains (one per record and candidate), `order` is the decision's place in its chain."""

    chain: np.ndarray  # int
    problem: np.ndarray  # int: the record's problem index
    block: np.ndarray  # int
    step: np.ndarray  # int
    log_ratio_power: np.ndarray  # float64
    depth_delta: np.ndarray  # float64 (NaN where the chain did not probe)
    log_u: np.ndarray  # float64
    null_move: np.ndarray  # bool
    accepted: np.ndarray  # bool
    depth_decided: np.ndarray  # bool
    cut: np.ndarray  # int
    current_suffix: np.ndarray  # int
    proposal_suffix: np.ndarray  # int

    @property
    def n_chains(self) -> int:
        return int(self.chain.max()) + 1 if len(self.chain) else 0

    def where(self, keep: np.ndarray) -> "DecisionTable":
        return DecisionTable(**{f.name: getattr(self, f.name)[keep] for f in dataclasses.fields(self)})


def _chains(record: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The decision records of one problem: its kept candidates' (every chain), else the
    chosen chain's."""
    kept = [c["mh_decisions"] for c in record.get("candidates", []) if c.get("mh_decisions")]
    if kept:
        return kept
    return [record["mh_decisions"]] if record.get("mh_decisions") else []


def has_decision_records(records: Sequence[Mapping[str, Any]]) -> bool:
    """Whether any record (or a kept candidate of one) holds MH decision records."""
    return any(_chains(record) for record in records)


def decision_table(records: Sequence[Mapping[str, Any]]) -> DecisionTable:
    """Every MH decision in `degs eval` records (`mh_decisions`); ValueError if none has any."""
    columns: dict[str, list] = {f.name: [] for f in dataclasses.fields(DecisionTable)}
    chain = 0
    for record in records:
        for decisions in _chains(record):
            steps = np.asarray(decisions["accepted"], bool)  # [blocks run, mh_steps]
            blocks, per_block = steps.shape if steps.ndim == 2 else (0, 0)
            n = blocks * per_block
            columns["chain"].append(np.full(n, chain))
            columns["problem"].append(np.full(n, int(record.get("index", chain))))
            columns["block"].append(np.repeat(np.arange(blocks), per_block))
            columns["step"].append(np.tile(np.arange(per_block), blocks))
            for name in ("log_ratio_power", "log_u"):
                columns[name].append(np.asarray(decisions[name], np.float64).reshape(n))
            delta = decisions.get("depth_delta")
            columns["depth_delta"].append(np.full(n, np.nan) if delta is None
                                          else np.asarray(delta, np.float64).reshape(n))
            for name in ("null_move", "accepted", "depth_decided"):
                columns[name].append(np.asarray(decisions[name], bool).reshape(n))
            for name in ("cut", "current_suffix", "proposal_suffix"):
                columns[name].append(np.asarray(decisions[name], np.int64).reshape(n))
            chain += 1
    if chain == 0:
        raise ValueError("no MH decision records in these results (`mh_decisions`: an MCMC run "
                         "of this version of degs_jax records them)")
    return DecisionTable(**{name: np.concatenate(parts) for name, parts in columns.items()})


def _accept_probability(log_r: np.ndarray) -> np.ndarray:
    return np.exp(np.minimum(log_r, 0.0))


def flip_curve(table: DecisionTable, betas: Sequence[float] = BETA_GRID) -> list[dict[str, Any]]:
    """Per beta: expected and realized flips (module docstring) over the decisions that
    have a depth difference, with and without null moves, and the chains expected and
    realized to depart from the chain of the records' trajectory. NaN ΔD (no probe):
    ValueError."""
    if np.isnan(table.depth_delta).any():
        raise ValueError("these decisions have no depth difference (the chain did not probe: "
                         "power MCMC); run DEGS-MCMC to measure beta·ΔD")
    r0, delta, log_u = table.log_ratio_power, table.depth_delta, table.log_u
    base = _accept_probability(r0)
    accept_power = log_u < r0
    rows = []
    for beta in betas:
        log_r = r0 + beta * delta
        p_flip = np.abs(_accept_probability(log_r) - base)
        realized = (log_u < log_r) != accept_power
        stay = np.ones(table.n_chains)
        np.multiply.at(stay, table.chain, 1.0 - p_flip)
        departed = np.zeros(table.n_chains, bool)
        departed[table.chain[realized]] = True
        rows.append({
            "beta": float(beta),
            "expected_flips": float(p_flip.sum()),
            "expected_flips_non_null": float(p_flip[~table.null_move].sum()),
            "realized_flips": int(realized.sum()),
            "expected_departing_chains": float((1.0 - stay).sum()),
            "realized_departing_chains": int(departed.sum()),
            "first_flips": _first_at(table, realized),
        })
    return rows


def _first_at(table: DecisionTable, marked: np.ndarray) -> dict[str, list[int]]:
    """Per chain with a `marked` decision: (block, step) of its first one."""
    order = np.lexsort((table.step, table.block, table.chain))
    first: dict[str, list[int]] = {}
    for i in order[marked[order]]:
        first.setdefault(str(int(table.chain[i])), [int(table.block[i]), int(table.step[i])])
    return dict(sorted(first.items(), key=lambda item: int(item[0])))


def first_decided(table: DecisionTable) -> dict[str, list[int]]:
    """Per chain that has one: (block, step) of its first decision that beta·ΔD decided,
    i.e. where the chain departed from the power chain of its keys."""
    return _first_at(table, table.depth_decided)


def departures(base: DecisionTable, other: DecisionTable, beta: float) -> dict[str, Any]:
    """The records' prediction checked against a run: `base`, a run's decisions in which
    no decision was depth-decided (its chains are the power chains of their keys),
    predicts where each chain of a run at `beta` with the same keys departs (its first
    realized flip); `other` is that run's decisions. Both runs must hold the same chains
    in the same order."""
    if base.depth_decided.any():
        raise ValueError("the base run has depth-decided decisions: its chains are not the power "
                         "chains, so it predicts nothing past them")
    if base.n_chains != other.n_chains:
        raise ValueError(f"the runs hold {base.n_chains} and {other.n_chains} chains: not the same problems")
    predicted = flip_curve(base, [beta])[0]["first_flips"]
    actual = first_decided(other)
    return {"beta": float(beta), "chains": base.n_chains, "predicted": predicted, "departed": actual,
            "predicted_departing": len(predicted), "departed_count": len(actual),
            "all_as_predicted": predicted == actual,
            "mismatches": {chain: [predicted.get(chain), actual.get(chain)]
                           for chain in sorted(set(predicted) | set(actual), key=int)
                           if predicted.get(chain) != actual.get(chain)}}


def _quantiles(values: np.ndarray) -> dict[str, Optional[float]]:
    if not len(values):
        return {q: None for q in ("p10", "p25", "median", "p75", "p90")}
    p = np.quantile(values, [0.1, 0.25, 0.5, 0.75, 0.9])
    return dict(zip(("p10", "p25", "median", "p75", "p90"), map(float, p)))


def decision_anatomy(table: DecisionTable, beta: Optional[float] = None,
                     betas: Sequence[float] = BETA_GRID) -> dict[str, Any]:
    """What decided a run's MH steps: counts, null moves, |log r_0| and |beta·ΔD| (at the
    run's `beta`; None: the power chain, no ΔD), and the flip curve over `betas`."""
    non_null = ~table.null_move
    probed = not np.isnan(table.depth_delta).any()
    anatomy: dict[str, Any] = {
        "decisions": int(len(table.chain)), "chains": table.n_chains,
        "problems": int(len(np.unique(table.problem))),
        "null_moves": int(table.null_move.sum()),
        "null_move_fraction": float(table.null_move.mean()) if len(table.chain) else None,
        "acceptance_pooled": float(table.accepted.mean()) if len(table.chain) else None,
        "acceptance_pooled_non_null": float(table.accepted[non_null].mean()) if non_null.any() else None,
        "depth_decided": int(table.depth_decided.sum()),
        "abs_log_ratio_power_non_null": _quantiles(np.abs(table.log_ratio_power[non_null])),
        "near_zero_fraction_non_null": (float((np.abs(table.log_ratio_power[non_null]) < NEAR_ZERO_NATS).mean())
                                         if non_null.any() else None),
        "near_zero_nats": NEAR_ZERO_NATS,
        "mean_current_suffix": float(table.current_suffix.mean()) if len(table.chain) else None,
        "mean_proposal_suffix": float(table.proposal_suffix.mean()) if len(table.chain) else None,
        "beta": beta,
    }
    if probed:
        anatomy["abs_depth_delta_non_null"] = _quantiles(np.abs(table.depth_delta[non_null]))
        if beta is not None:
            anatomy["abs_beta_depth_delta_non_null"] = _quantiles(np.abs(beta * table.depth_delta[non_null]))
        curve = flip_curve(table, betas)
        anatomy["flip_curve"] = curve
        per_chain = [row["beta"] for row in curve if row["expected_departing_chains"] >= 0.5 * table.n_chains]
        anatomy["beta_half_chains_depart"] = per_chain[0] if per_chain else None
        if beta is not None:
            own = flip_curve(table, [beta])[0]
            anatomy["realized_flips_at_run_beta"] = own["realized_flips"]
    return anatomy


def plot_decisions(table: DecisionTable, anatomy: Mapping[str, Any], path: str | os.PathLike,
                   title: str = "") -> str:
    """Two panels: the distribution of |log r_0| beside |beta·ΔD| (non-null decisions, at
    the run's beta and at the beta where half the chains are expected to depart), and the
    expected / realized flips and departing chains against beta. Writes a PNG."""
    fig = Figure(figsize=(11.0, 4.0), dpi=130)
    FigureCanvasAgg(fig)
    ax1, ax2 = fig.subplots(1, 2)
    non_null = ~table.null_move
    floor = 1e-6
    series = [(np.abs(table.log_ratio_power[non_null]), "|log $r_0$| (β = 0 ratio)", "tab:blue")]
    if "flip_curve" in anatomy:
        for beta, color in ((anatomy.get("beta"), "tab:orange"), (anatomy.get("beta_half_chains_depart"), "tab:red")):
            if beta:
                series.append((np.abs(beta * table.depth_delta[non_null]), f"|β·ΔD|, β = {beta:g}", color))
    values = np.concatenate([v for v, _, _ in series]) if series else np.zeros(0)
    top = max(float(values.max()) if len(values) else 1.0, 10 * floor)
    bins = np.logspace(np.log10(floor), np.log10(top), 41)
    for v, label, color in series:
        ax1.hist(np.clip(v, floor, None), bins=bins, alpha=0.5, color=color, label=label)
    ax1.axvline(NEAR_ZERO_NATS, color="gray", linestyle=":", linewidth=1)
    ax1.set_xscale("log")
    ax1.set_xlabel(f"nats (values below {floor:g} drawn at {floor:g})")
    ax1.set_ylabel("non-null MH decisions")
    ax1.set_title(f"(a) {int(non_null.sum())} non-null decisions, {int(table.null_move.sum())} null moves")
    ax1.legend(frameon=False, fontsize=8)
    if "flip_curve" in anatomy:
        curve = anatomy["flip_curve"]
        b = [row["beta"] for row in curve]
        ax2.plot(b, [row["expected_flips"] for row in curve], "o-", label="expected flips")
        ax2.plot(b, [row["realized_flips"] for row in curve], "s--", label="realized flips (run's u)")
        ax2.plot(b, [row["expected_departing_chains"] for row in curve], "^-", label="chains expected to depart")
        ax2.axhline(table.n_chains, color="gray", linestyle=":", linewidth=1, label=f"{table.n_chains} chains")
        ax2.set_xscale("log")
        ax2.set_yscale("symlog", linthresh=1.0)
        ax2.set_ylim(bottom=0.0)
        ax2.set_xlabel("β")
        ax2.set_ylabel("count")
        ax2.set_title("(b) decisions the depth term would flip")
        ax2.legend(frameon=False, fontsize=8)
    else:
        ax2.axis("off")
        ax2.text(0.0, 0.5, "no ΔD recorded (power MCMC does not probe)", transform=ax2.transAxes)
    return save_png(fig, path, title)


def _number(x: Optional[float]) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def format_anatomy(anatomy: Mapping[str, Any]) -> str:
    """Plain text of `decision_anatomy`'s output."""
    def q(stats: Optional[Mapping[str, Any]]) -> str:
        if not stats or stats.get("median") is None:
            return "n/a"
        return (f"median {stats['median']:.3g} (p10 {stats['p10']:.3g}, p90 {stats['p90']:.3g})")

    lines = [
        f"{anatomy['decisions']} MH decisions in {anatomy['chains']} chains of {anatomy['problems']} problems; "
        f"null moves {anatomy['null_moves']} ({anatomy['null_move_fraction']:.1%}); pooled acceptance "
        f"{anatomy['acceptance_pooled']:.3f} ({_number(anatomy['acceptance_pooled_non_null'])} without null moves)",
        f"|log r_0| over non-null decisions: {q(anatomy['abs_log_ratio_power_non_null'])}; "
        f"{(anatomy['near_zero_fraction_non_null'] or 0.0):.1%} within {anatomy['near_zero_nats']} nats of 0",
    ]
    if "abs_depth_delta_non_null" in anatomy:
        lines.append(f"|ΔD| over non-null decisions: {q(anatomy['abs_depth_delta_non_null'])}")
    if "abs_beta_depth_delta_non_null" in anatomy:
        lines.append(f"|β·ΔD| at the run's β = {anatomy['beta']:g}: {q(anatomy['abs_beta_depth_delta_non_null'])}; "
                     f"decisions it decided: {anatomy['depth_decided']} (recomputed from the records: "
                     f"{anatomy['realized_flips_at_run_beta']})")
    if "flip_curve" in anatomy:
        lines.append(f"  {'beta':>8}  {'expected flips':>14}  {'realized flips':>14}  "
                     f"{'chains expected to depart':>25}  {'realized':>8}")
        for row in anatomy["flip_curve"]:
            lines.append(f"  {row['beta']:>8g}  {row['expected_flips']:>14.2f}  {row['realized_flips']:>14d}  "
                         f"{row['expected_departing_chains']:>25.2f}  {row['realized_departing_chains']:>8d}")
        lines.append(f"half the chains are expected to depart from the power chain at beta = "
                     f"{anatomy['beta_half_chains_depart']}")
    return "\n".join(lines)
