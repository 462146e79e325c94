"""Resumable chains in a run directory: `degs eval` / `degs reproduce` store the snapshot of
every in-flight problem's rows each time it is renewed (an MCMC chain's after each block:
`Method.checkpoint`, through `decoders.decode_stream`'s `on_checkpoint`), so a run killed
mid-chain goes on from each chain's last completed block instead of its first token
(`decode_stream`'s `resume`). A snapshot is the chain's tokens, per-token statistics, work
counters and decision records; the keys need no state (every draw is keyed by the problem's
key, block, step and position), and the cache is rebuilt from the tokens.

Layout: ``<run>/checkpoints/<problem id, %-quoted>.npz``, one file per in-flight problem,
replaced atomically (written beside, then renamed) so a kill leaves the previous snapshot
or the new one, never half of one; removed once the problem's record is in results.jsonl.
The run's configuration is the run directory's (run.json): a snapshot of another
configuration cannot be met there, and one of another shape is refused when it is resumed.
"""

from __future__ import annotations

import os
import urllib.parse
from pathlib import Path
from typing import Iterable, Mapping, Optional

import numpy as np

CHECKPOINT_DIR = "checkpoints"
SUFFIX = ".npz"


class CheckpointStore:
    """The snapshots of one run directory's in-flight problems, by problem id."""

    def __init__(self, run_dir: Path):
        self.directory = Path(run_dir) / CHECKPOINT_DIR

    def path(self, problem_id: str) -> Path:
        return self.directory / (urllib.parse.quote(problem_id, safe="") + SUFFIX)

    def load(self, problem_id: str) -> Optional[dict[str, np.ndarray]]:
        """The stored snapshot of `problem_id`, or None. ValueError naming the file when it
        cannot be read (a damaged file is not silently restarted)."""
        path = self.path(problem_id)
        if not path.is_file():
            return None
        try:
            with np.load(path, allow_pickle=False) as stored:
                return {name: stored[name] for name in stored.files}
        except (OSError, ValueError, EOFError) as error:
            raise ValueError(f"{path}: not a readable chain snapshot ({error}); delete it to restart "
                             "that problem from its beginning") from None

    def save(self, problem_id: str, arrays: Mapping[str, np.ndarray]) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.path(problem_id)
        partial = path.with_name(path.name + ".partial")
        with open(partial, "wb") as file:
            np.savez(file, **arrays)
        os.replace(partial, path)

    def problem_ids(self) -> list[str]:
        """The ids of the problems with a stored snapshot, sorted."""
        if not self.directory.is_dir():
            return []
        return sorted(urllib.parse.unquote(path.name[:-len(SUFFIX)]) for path in self.directory.glob("*" + SUFFIX))

    def remove(self, problem_id: str) -> None:
        self.path(problem_id).unlink(missing_ok=True)

    def discard(self, problem_ids: Iterable[str]) -> None:
        """Remove the snapshots of these problems (those whose record was written before a
        kill removed their snapshot) and any half-written file."""
        for problem_id in problem_ids:
            self.remove(problem_id)
        if self.directory.is_dir():
            for partial in self.directory.glob("*.partial"):
                partial.unlink(missing_ok=True)
