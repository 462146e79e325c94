r"""What the chain's own suffix would save as a speculative draft (issue 55), predicted
exactly from the per-token statistics a checkpointed chain already stores: no model run.

An MH step of power MCMC / DEGS-MCMC cuts the current completion x at m ~ Uniform{0..n-1}
and regenerates x'_{m:} from the proposal q (temperature 1/alpha), one decode step per
token. Issue 55 drafts the old tokens x_{m:} instead and verifies them with the target: a
point-mass draft token d is accepted with probability q(d | prefix), otherwise the token is
drawn from q with d removed (speculative sampling; Leviathan et al. 2023). While every
earlier token was accepted the prefix is x's own, so the chance that the first j draft
tokens all survive is a product the chain has stored:

    P(A >= j | m) = prod_{i=m}^{m+j-1} q(x_i | x_{<i}) = exp(sum of the state's logq over m..m+j-1)

(A: the aligned run; a bonus token drawn after k accepted ones equals the next draft token
with the same probability q(d), so the law of A does not depend on how the run is cut into
verification forwards). With k draft tokens per verification forward (k + 1 positions), the
aligned stretch and its first divergent token take ceil((A + 1) / (k + 1)) forwards, the
rest of the suffix one decode step per token, as today (a diverged proposal counted at the
current suffix's length; the draft switched off after the
first divergence; re-aligning it, as prompt-lookup decoding does, would save more, so these
are lower bounds on the saving), and a proposal that never diverges (a null move, A = L,
L = n - m) ceil(L / (k + 1)). Averaged over the uniform cut this gives the expected
sequential forwards of one MH step at this state, against the L decode steps of today, and
P(A = L) is the predicted null-move rate, which the chain's recorded null moves check.

Read: every checkpoint (`checkpoints/*.npz`, a chain at a block boundary: its tokens, their
logq, its block) under the given run or study directories; a record per state and a
summary. Forwards, not seconds: a verification forward of k + 1 positions costs about a
decode step when the step is bound by reading the weights (few active rows: the tail,
where the slowest chain runs alone) and more when it is compute-bound (a full batch).

    python bench/self_draft_acceptance.py docs/reproduction/qwen2.5-coder-1.5b-whole --k 1 4 8 16 64

Prints one JSON document (environment, per-state rows, summary); --out writes it too.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, write_record  # noqa: E402

from degs_jax.methods import hyperparameters_for  # noqa: E402

BLOCK_LEN = hyperparameters_for("power_mcmc").block_len  # the paper's block (16 x 192 = 3072)


def run_survival(logq: np.ndarray) -> np.ndarray:
    """[n, n + 1] P(A >= j | cut m) for the completion's per-token log q (n tokens): row m,
    column j (0 where j > n - m). A >= 0 always."""
    n = len(logq)
    cum = np.concatenate([[0.0], np.cumsum(logq, dtype=np.float64)])
    j = np.arange(n + 1)
    m = np.arange(n)[:, None]
    end = m + j[None, :]
    valid = end <= n
    survival = np.exp(np.where(valid, cum[np.minimum(end, n)] - cum[m], -np.inf))
    return survival


def forwards(aligned: np.ndarray, suffix: np.ndarray, k: int | None) -> np.ndarray:
    """Sequential forwards of a proposal of `suffix` tokens whose first `aligned` tokens equal
    the draft (k draft tokens per verification forward; k None: the whole suffix in one)."""
    span = np.where(aligned < suffix, aligned + 1, suffix)  # the aligned stretch and its first divergent token
    verifications = np.ones_like(span) if k is None else np.ceil(span / (k + 1))
    return verifications + (suffix - span)


def forwards_name(k: int | None) -> str:
    """The record's field of the expected forwards with k draft tokens per forward."""
    return f"forwards_k{'all' if k is None else k}"


def expected_forwards(logq: np.ndarray, ks) -> dict:
    """Per k: expected forwards of one MH step at this state (cut uniform over its n
    tokens), with the expected regenerated tokens (today's decode steps), the expected
    aligned run and the predicted null-move probability."""
    n = len(logq)
    survival = run_survival(logq)
    suffix = (n - np.arange(n))[:, None].astype(np.float64)  # L = n - m per cut
    j = np.arange(n + 1)[None, :].astype(np.float64)
    # P(A = j) = P(A >= j) - P(A >= j + 1) (P(A >= L + 1) = 0: the run ends with the suffix)
    nxt = np.concatenate([survival[:, 1:], np.zeros((n, 1))], axis=1)
    law = np.where(j <= suffix, survival - nxt, 0.0)
    out = {"tokens": n, "regenerated": float(suffix.mean()),
           "aligned": float((law * j).sum(axis=1).mean()),
           "null_move": float(survival[np.arange(n), n - np.arange(n)].mean())}
    for k in ks:
        steps = forwards(np.broadcast_to(j, law.shape), np.broadcast_to(suffix, law.shape), k)
        out[forwards_name(k)] = float((law * steps).sum(axis=1).mean())
    return out


def completion_start(state) -> int:
    """Index of the first completion token: the prompt's positions carry logq 0 and depth
    -1; a DEGS chain records every completion token's depth, a power chain none, so there
    the completion is the last block · block_len tokens (a chain at its block boundary that
    has not ended)."""
    depth = state["depth"][0]
    probed = np.flatnonzero(depth >= 0)
    if len(probed):
        return int(probed[0])
    if bool(state["ended"][0]):
        raise ValueError("an ended chain without depths: its prompt's end is not recorded")
    return int(state["length"][0]) - int(state["block"][0]) * BLOCK_LEN


def states(paths):
    for root in map(Path, paths):
        for file in sorted(root.rglob("checkpoints/*.npz")):
            yield file, np.load(file)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dirs", nargs="+", help="run or study directories holding checkpoints/*.npz")
    ap.add_argument("--k", type=int, nargs="+", default=[1, 4, 8, 16, 64], help="draft tokens per verification forward")
    ap.add_argument("--mh-steps", type=int, default=10, help="MH steps per block (the paper's 10)")
    ap.add_argument("--out", help="also write the JSON document here")
    args = ap.parse_args(argv)
    if any(k < 1 for k in args.k):
        ap.error("--k: draft tokens per forward are >= 1")
    ks = list(args.k) + [None]
    rows = []
    for file, state in states(args.dirs):
        try:
            start, length = completion_start(state), int(state["length"][0])
        except ValueError as err:
            raise SystemExit(f"{file}: {err}")
        logq = state["logq"][0, start:length].astype(np.float64)
        if len(logq) == 0 or not np.all(np.isfinite(logq)) or np.any(logq > 1e-6):
            raise SystemExit(f"{file}: no completion or a log q outside (-inf, 0]")
        ran = state["ran"][0]
        recorded = state["decisions.null_move"][0][ran]
        row = {"state": str(file), "block": int(state["block"][0]), "ended": bool(state["ended"][0]),
               **expected_forwards(logq, ks),
               "recorded_null_moves": float(recorded.mean()), "recorded_decisions": int(recorded.size),
               "recorded_null_moves_last_block": float(state["decisions.null_move"][0][int(state["block"][0]) - 1].mean())}
        rows.append(row)
    if not rows:
        raise SystemExit(f"no checkpoints under {', '.join(args.dirs)}")
    names = [forwards_name(k) for k in ks]
    regenerated = sum(r["regenerated"] for r in rows)
    summary = {"states": len(rows), "mh_step_speedup": {n: regenerated / sum(r[n] for r in rows) for n in names},
               # one block at each state's length: its extension (block_len decode steps, not drafted) and its MH steps
               "block_speedup": {n: sum(BLOCK_LEN + args.mh_steps * r["regenerated"] for r in rows)
                                 / sum(BLOCK_LEN + args.mh_steps * r[n] for r in rows) for n in names},
               "predicted_null_moves": float(np.mean([r["null_move"] for r in rows])),
               "recorded_null_moves_last_block": float(np.mean([r["recorded_null_moves_last_block"] for r in rows])),
               "longest_state": max(rows, key=lambda r: r["tokens"])}
    write_record({**environment(), "what": "self-drafted MH proposals predicted from stored logq (issue 55)",
                  "k": args.k, "mh_steps": args.mh_steps, "rows": rows, "summary": summary}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
