"""`degs probe`: collapse depth and layer entropies of completions from a JSONL file."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import jax
import numpy as np
from tqdm.auto import tqdm

from .decoders import decode
from .lens import DEFAULT_TAU, LensConfig
from .models import with_tuned_lens
from .plots import plot_entropy_trajectories
from .scoring import EntropyTrajectory, score_sequences
from .chat import encode_prompt


def read_rows(path: Path, limit: Optional[int] = None) -> list[dict]:
    """The rows of a `degs probe` input file (JSON lines): each an object with a non-empty
    string 'prompt' and, optionally, a non-empty string 'completion' (absent or null: the
    prompt is completed greedily). ValueError naming the file and line otherwise."""
    if limit is not None and limit < 1:
        raise ValueError(f"--limit must be at least 1, got {limit}")
    if not path.exists():
        raise FileNotFoundError(f"input file not found: {path}")
    if not path.is_file():
        raise ValueError(f"input {path} is not a file (a JSONL file, one object per line)")
    rows = []
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not UTF-8 text ({e.reason} at byte {e.start})") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e})") from None
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"].strip():
                raise ValueError(f"{path}:{lineno}: each row needs a non-empty string 'prompt'")
            completion = row.get("completion")
            if completion is not None and (not isinstance(completion, str) or not completion.strip()):
                raise ValueError(f"{path}:{lineno}: 'completion' must be a non-empty string (leave it "
                                 "out to complete the prompt greedily), got "
                                 f"{json.dumps(completion)[:40]}")
            for field in ("prompt", "completion"):
                try:
                    (row.get(field) or "").encode("utf-8")
                except UnicodeEncodeError as e:  # a lone surrogate, written as a JSON escape
                    raise ValueError(f"{path}:{lineno}: '{field}' is not valid text (a lone "
                                     f"surrogate \\u{ord(row[field][e.start]):04x} at "
                                     f"character {e.start})") from None
            rows.append(row)
            if limit is not None and len(rows) >= limit:
                break
    if not rows:
        raise ValueError(f"{path}: no rows")
    return rows


def run_probe(model, input_path: Path, out_dir: Path, *, tau: float = DEFAULT_TAU, lsub=None,
              chat: bool = True, max_new_tokens: int = 256, limit: Optional[int] = None,
              batch_size: int = 8, tuned_lens=None) -> int:
    """Score every row's completion (greedy-completing rows without one) and write
    `probe.jsonl` (id, D, per-layer mean entropies, mean final-layer entropy, log p, the
    lens) and `entropy.png` (mean entropy per layer over all rows). tuned_lens: read the
    layers through a tuned lens (`train.tuned_lens`) instead of the logit lens.
    model: a `degs_jax.model_api.LanguageModel` (or a loaded model)."""
    lm, params, tok = model.lm, model.params, model.tokenizer
    lens = LensConfig.default(lm.num_layers, tau=tau, lsub=lsub or None)
    rows = read_rows(input_path, limit)
    out_dir.mkdir(parents=True, exist_ok=True)
    eos = model.eos_ids
    prompts = [encode_prompt(tok, r["prompt"], chat) for r in rows]
    completions: list[list[int]] = [
        None if r.get("completion") is None else tok.encode(r["completion"], add_special_tokens=False)
        for r in rows]
    todo = [i for i, c in enumerate(completions) if c is None]
    for start in tqdm(range(0, len(todo), batch_size), desc="greedy completion", disable=not todo):
        idx = todo[start:start + batch_size]
        res = decode(lm, params, [prompts[i] for i in idx], "greedy", jax.random.key(0),
                     eos_ids=eos, max_new_tokens=max_new_tokens, probe=False)
        for i, out in zip(idx, res.outputs):
            completions[i] = out.chosen.tokens
            rows[i]["completion"] = tok.decode(out.chosen.tokens, skip_special_tokens=True)

    # One teacher-forced pass per batch: D(x) from L_sub and the entropy of every layer.
    layers = tuple(range(lm.num_layers + 1))
    probe_lm, probe_params = with_tuned_lens(lm, params, tuned_lens)
    scores = []
    for start in tqdm(range(0, len(rows), batch_size), desc="probing", unit="batch"):
        sl = slice(start, start + batch_size)
        scores += score_sequences(probe_lm, probe_params, prompts[sl], completions[sl], lens, eos,
                                  batch_size=batch_size, layers=layers)
    traj = EntropyTrajectory.from_sums(layers, [s["layer_entropy_sum"] for s in scores],
                                       [s["n_scored"] for s in scores])
    lens_name = "logit" if tuned_lens is None else "tuned"

    with (out_dir / "probe.jsonl").open("w") as f:
        for i, (row, s) in enumerate(zip(rows, scores)):
            record = {
                "id": row.get("id", i), "completion": row["completion"], "lens": lens_name,
                "D": s["depth"], "log_p": s["log_p"], "n_tokens": s["n_tokens"],
                "mean_final_entropy": s["final_entropy"],
                "layer_entropy": [None if np.isnan(v) else float(v) for v in traj.per_sequence[i]],
            }
            f.write(json.dumps(record) + "\n")
    plot_entropy_trajectories({model.name: (traj.layers, traj.mean)}, out_dir / "entropy.png",
                              title=f"{lens_name}-lens entropy per layer ({len(rows)} completions)",
                              tau=tau)
    mean_d = float(np.mean([s["depth"] for s in scores]))
    print(f"probed {len(rows)} completions: mean D(x) {mean_d:.4f}; wrote {out_dir / 'probe.jsonl'} "
          f"and {out_dir / 'entropy.png'}", file=sys.stderr)
    return 0
