"""Which committed records decoded past an end token that was not one then (issue 54).

Until the fix, the built-in Qwen models ended a completion only at `<|im_end|>` (151645,
the one end token their GGUF files declare), not at `<|endoftext|>` (151643). A sampled
`<|endoftext|>` was dropped from the text as a special token (`skip_special_tokens`) and
decoding went on. Records keep the completion's text and its token count, not its ids, so
which token was generated where cannot be read back; what can be read is the count: a
greedy completion re-tokenises to its own tokens, so a record whose `n_tokens` exceeds its
text's token count by more than its final end token (1 if `ended`, else 0) generated
tokens that left no text: special tokens, `<|endoftext|>` among them (the only other
special tokens a chat completion produces are further `<|im_end|>`/`<|im_start|>`, which
would have ended it). Sampled completions can re-tokenise to fewer tokens than they were
drawn as (a non-canonical split), so for them the excess is an upper bound.

Usage: python bench/dropped_end_tokens.py [STUDY_DIR ...]
(default: every committed Qwen study under docs/reproduction). Prints, per run, the
records with an excess, and how many of them are graded right.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from degs_jax.models import load

ROOT = Path(__file__).resolve().parent.parent / "docs" / "reproduction"


def excess_tokens(tokenizer, record: dict) -> int:
    """Generated tokens that left no text, beyond the final end token."""
    return record["n_tokens"] - len(tokenizer.encode(record["completion"])) - int(record["ended"])


def main(argv: list[str]) -> int:
    studies = [Path(a) for a in argv] or sorted(p for p in ROOT.glob("qwen2.5-coder-*") if p.is_dir())
    # Qwen2.5-Coder 0.5B and 1.5B share one vocabulary and merges (151,665 tokens in both
    # GGUF files): the 0.5B tokenizer serves both.
    tokenizer = load("qwen2.5-coder-0.5b", progress=False).tokenizer
    for study in studies:
        for results in sorted(study.glob("runs/*/*/results.jsonl")):
            records = [json.loads(line) for line in results.read_text().splitlines()]
            if not records or "completion" not in records[0]:
                continue  # GPQA: completions stored as hashes
            flagged = [(r["index"], excess_tokens(tokenizer, r), r["ended"], r["correct"]) for r in records
                       if excess_tokens(tokenizer, r) > 0]
            name = results.parent.relative_to(ROOT if results.is_relative_to(ROOT) else study)
            print(f"{name}: {len(flagged)} of {len(records)} records with tokens that left no text"
                  + (f" (right: {sum(f[3] for f in flagged)}); index, excess, ended, right: {flagged}"
                     if flagged else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
