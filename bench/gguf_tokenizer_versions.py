"""Token ids of the converted built-in models' tokenizers under the installed transformers,
and whether loading them prints transformers' "incorrect regex pattern" warning (issue 54;
docs/benchmarks.md, "The GGUF tokenizer warning").

Run it under two transformers versions and compare the files, e.g. with a scratch venv:
  python3 -m venv /tmp/tf517 && /tmp/tf517/bin/pip install "transformers==5.17.*" tokenizers gguf
  /tmp/tf517/bin/pip install --no-deps -e .
  PYTHONPATH=/tmp/tf517/lib/python3.11/site-packages:.venv/lib/python3.11/site-packages \\
      /tmp/tf517/bin/python bench/gguf_tokenizer_versions.py ids_517.json
  python bench/gguf_tokenizer_versions.py ids_524.json
(the scratch venv's transformers and degs_jax first on the path, this venv's jax after them).
The corpus: every string field of the bundled MATH500, GSM8K and DeepMind500 files and the
HumanEval prompts and solutions. Needs both built-ins converted (any `degs` run on them);
for Qwen2.5 also transformers' own GGUF tokenizer (it imports torch), as a third reference.
"""

from __future__ import annotations

import gzip
import io
import json
import logging
import sys
from pathlib import Path

import transformers
from transformers import AutoTokenizer

from degs_jax.models.loading import BUILTIN_MODELS, GGUF_CACHE_VERSION, default_cache_dir

DATA = Path(__file__).resolve().parent.parent / "degs_jax" / "data"


def corpus() -> list[str]:
    texts = []
    for name in ("math500.jsonl", "gsm8k_test.jsonl", "deepmind500.jsonl"):
        for line in (DATA / name).read_text().splitlines():
            texts += [v for v in json.loads(line).values() if isinstance(v, str)]
    with gzip.open(DATA / "humaneval.jsonl.gz", "rt") as f:
        for line in f:
            row = json.loads(line)
            texts += [row["prompt"], row["canonical_solution"]]
    return texts


def main(out: str) -> None:
    texts, cache = corpus(), default_cache_dir()
    result = {"transformers": transformers.__version__, "n_texts": len(texts)}
    for name in ("qwen2.5-coder-0.5b", "smollm2-135m"):
        entry = cache / f"gguf-v{GGUF_CACHE_VERSION}" / BUILTIN_MODELS[name].sha256
        logged = io.StringIO()
        handler = logging.StreamHandler(logged)
        transformers.utils.logging.get_logger("transformers").addHandler(handler)
        tokenizer = AutoTokenizer.from_pretrained(entry)
        transformers.utils.logging.get_logger("transformers").removeHandler(handler)
        result[name] = {"warning": "incorrect regex pattern" in logged.getvalue(),
                        "ids": [tokenizer.encode(t) for t in texts]}
        if name.startswith("qwen"):
            gguf = AutoTokenizer.from_pretrained(cache / "builtin", gguf_file=BUILTIN_MODELS[name].filename)
            result[name]["transformers_gguf_ids"] = [gguf.encode(t) for t in texts]
    Path(out).write_text(json.dumps(result))
    print(result["transformers"], len(texts), {n: result[n]["warning"] for n in ("qwen2.5-coder-0.5b", "smollm2-135m")})


if __name__ == "__main__":
    main(sys.argv[1])
