"""Every Python snippet of README.md and docs/ runs as pasted (issue 54).

The snippets of one markdown file run in order in one namespace, as a reader pastes them
into one session; the files run one after another in one fresh Python process (the
method a snippet registers, e.g. docs/extending.md's, stays out of the test process), in
the repository root, with the suite's degs_jax cache and XLA flags (the environment).

The code runs verbatim, but `degs_jax.models.load` of a built-in name returns a tiny
random model of the same kind (a `LoadedModel`: 2 layers over a byte tokenizer), so that
the snippets' four MCMC programs compile in seconds: what is checked is that the code
composes as written (every name defined, the calls' arguments and shapes right), in well
under a minute. With `DEGS_TESTS_SNIPPETS_REAL_MODEL=1` the built-in models themselves are
loaded (SmolLM2-135M: every snippet ran, 206 s on this project's 2-core CPU). A
snippet that cannot run here (a GPU, the hub, hours of training, a template with parts
left to the reader) says so on the line before its fence:

    <!-- snippet: skip: the reason -->

and is listed, with its reason, rather than left out silently; a marker without a reason,
or not followed by a Python fence, is an error."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SKIP = re.compile(r"^<!-- snippet: skip: (\S.*?) -->$")
MARKER = re.compile(r"^\s*<!-- snippet")  # a line of its own (prose may quote it)
FENCE = re.compile(r"^```(\S*)\s*$")


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def snippets(text: str, name: str) -> list[dict]:
    """The Python fences of a markdown text, in order: {"line", "code", "skip"} (skip: the
    marker's reason, or None). ValueError for a marker that is malformed or stray."""
    lines, found, k = text.splitlines(), [], 0
    while k < len(lines):
        fence = FENCE.match(lines[k])
        if MARKER.search(lines[k]):
            reason = SKIP.match(lines[k].strip())
            after = FENCE.match(lines[k + 1]) if k + 1 < len(lines) else None
            if reason is None or after is None or after.group(1) != "python":
                raise ValueError(f"{name}:{k + 1}: a snippet marker must read '<!-- snippet: skip: "
                                 "REASON -->' on the line before a ```python fence")
        if fence is None:
            k += 1
            continue
        end = next(j for j in range(k + 1, len(lines)) if lines[j].startswith("```"))
        if fence.group(1) == "python":
            skip = SKIP.match(lines[k - 1].strip()) if k else None
            found.append({"line": k + 1, "code": "\n".join(lines[k + 1:end]) + "\n",
                          "skip": skip.group(1) if skip else None})
        k = end + 1
    return found


def test_the_extractor_reads_markers():
    text = "x\n<!-- snippet: skip: needs a GPU -->\n```python\na = 1\n```\n```bash\nls\n```\n```python\nb = 2\n```\n"
    assert snippets(text, "t.md") == [{"line": 3, "code": "a = 1\n", "skip": "needs a GPU"},
                                      {"line": 9, "code": "b = 2\n", "skip": None}]
    for bad in ("<!-- snippet: skip: -->\n```python\na\n```\n",  # no reason
                "<!-- snippet: skip: why -->\n```bash\nls\n```\n",  # not Python
                "<!-- snippet: skip: why -->\n\n```python\na\n```\n"):  # not the line before
        with pytest.raises(ValueError, match="snippet marker"):
            snippets(bad, "t.md")


# Runs every file's snippets; prints one JSON line per snippet (file, line, seconds), and
# on the first failure its traceback, naming the snippet.
_RUNNER = r'''
import json, os, sys, time, traceback

if os.environ.get("DEGS_TESTS_SNIPPETS_REAL_MODEL") != "1":  # the module docstring's stand-in
    import jax.numpy as jnp
    import numpy as np
    import degs_jax.models
    from degs_jax.examples.byte_tokenizer import byte_tokenizer
    from degs_jax.models import BUILTIN_MODELS, LoadedModel, ModelConfig, param_shapes

    config = ModelConfig(architecture="LlamaForCausalLM", vocab_size=257, hidden_size=32,
                         intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                         rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=1024,
                         qkv_bias=False, tie_word_embeddings=False, eos_token_ids=(256,))

    def load(source, *args, **kwargs):
        if source not in BUILTIN_MODELS:
            raise ValueError(f"the snippets' stand-in loads built-in names only, not {source!r}")
        rng = np.random.default_rng(0)
        params = __import__("jax").tree.map(
            lambda shape: jnp.asarray((len(shape) == 1) + 0.1 * rng.standard_normal(shape), jnp.float32),
            param_shapes(config), is_leaf=lambda x: isinstance(x, tuple))
        return LoadedModel(cfg=config, params=params, tokenizer=byte_tokenizer(), source="random", name=source)

    degs_jax.models.load = load
for name, blocks in json.load(sys.stdin):
    namespace = {"__name__": "__main__"}
    for block in blocks:
        t0 = time.perf_counter()
        try:
            exec(compile(block["code"], f"{name}:{block['line']}", "exec"), namespace)
        except BaseException:
            print(f"{name}:{block['line']}: the snippet failed", file=sys.stderr)
            traceback.print_exc()
            sys.exit(1)
        print(json.dumps({"snippet": f"{name}:{block['line']}", "seconds": round(time.perf_counter() - t0, 1)}), flush=True)
'''


@pytest.mark.slow
def test_every_snippet_runs_as_pasted():
    runnable, skipped = [], []
    for path in markdown_files():
        name = str(path.relative_to(ROOT))
        blocks = snippets(path.read_text(), name)
        skipped += [(name, b["line"], b["skip"]) for b in blocks if b["skip"]]
        if any(not b["skip"] for b in blocks):
            runnable.append((name, [b for b in blocks if not b["skip"]]))
    assert sum(len(blocks) for _, blocks in runnable) >= 8  # the README's, sweeps.md's, extending.md's, ...
    done = subprocess.run([sys.executable, "-c", _RUNNER], input=json.dumps(runnable), cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    ran = [json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"snippet"')]
    print("ran:", ran, "\nskipped:", skipped)
    assert done.returncode == 0, done.stderr[-4000:]
    assert len(ran) == sum(len(blocks) for _, blocks in runnable)
