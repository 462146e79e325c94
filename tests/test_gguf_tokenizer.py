"""The tokenizer built from a GGUF's own metadata (`gguf_io.tokenizer_from_gguf`, no torch)
for both built-in models, against two references on benchmark text, code, edge cases and
chat-templated prompts:

* an independent re-implementation here of what llama.cpp does with the same metadata
  (regex pre-splits per `tokenizer.ggml.pre`, as listed in llama.cpp's llama-vocab.cpp,
  then byte-level BPE by merge rank, control tokens matched whole): equal ids everywhere;
* transformers' own GGUF tokenizer (the path used before, which imports torch): equal ids
  everywhere for Qwen2.5; for SmolLM2 equal except where a blank precedes a numeral
  (\p{N}). There transformers ignores the file's "smollm" pre-tokenizer, which splits every
  numeral off first (as SmolLM2's own tokenizer.json does with `Digits`), and uses GPT-2's
  " ?\p{N}+": it cuts "  1" into " " + " 1" where llama.cpp and we keep "  " whole (one
  token, "ĠĠ"), and glues the blank to a non-ASCII numeral (" Ⅻ" -> "Ġâ"...).
  Where only ASCII digits follow a single blank, the vocabulary has no "Ġ<digit>" merge
  and both agree.
"""

from __future__ import annotations

import functools
import gzip
import json

import pytest
import regex

from degs_jax.eval.benchmarks import default_data_dir
from degs_jax.models import load
from degs_jax.models.gguf_io import open_gguf, tokenizer_from_gguf
from degs_jax.models.loading import builtin_gguf

pytestmark = pytest.mark.slow

EDGE_CASES = [
    "", " ", "  ", "\n\n\n", "\t\t1", "12 * 13 = 156", "  1", "a  1", "   12  34\n\n 5", "x²+½ Ⅻ ٣",
    "héllo wörld 日本語 😀 \u200b", "don't I'LL WE'VE", "1,000,000.50", "$\\frac{1}{2}$",
    "<|im_start|>user\nhi<|im_end|>", "<tool_call>x</tool_call>", "a<|endoftext|>b",
    "def f(x):\n    return x  # comment\n\n\n", "\r\n\r\n", "🤖🤖", "ÀÉÎ", "\x00\x01",
]


def corpus() -> list[str]:
    texts = list(EDGE_CASES)
    data = default_data_dir()
    for name in ("math500.jsonl", "gsm8k_test.jsonl", "deepmind500.jsonl"):
        for line in (data / name).read_text().splitlines()[:60]:
            texts += [v for v in json.loads(line).values() if isinstance(v, str)]
    with gzip.open(data / "humaneval.jsonl.gz", "rt") as f:
        for line in list(f)[:40]:
            row = json.loads(line)
            texts += [row["prompt"], row["canonical_solution"]]
    return texts


# llama.cpp's pre-tokenizer expressions (src/llama-vocab.cpp, `regex_exprs`), for the two
# built-ins' `tokenizer.ggml.pre`; written out here independently of gguf_io's table.
LLAMA_CPP_SPLITS = {
    "smollm": [r"\p{N}", r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"],
    "qwen2": [r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
              r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"],
}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte alphabet: printable bytes map to themselves, the rest to 256+."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


class LlamaCppReference:
    """llama.cpp's byte-level BPE tokenisation of a GGUF's metadata, written independently."""

    def __init__(self, reader):
        def field(key):
            return reader.fields[key].contents()

        self.tokens = field("tokenizer.ggml.tokens")
        self.ids = {t: i for i, t in enumerate(self.tokens)}
        self.ranks = {tuple(m.split(" ", 1)): r for r, m in enumerate(field("tokenizer.ggml.merges"))}
        self.splits = [regex.compile(r) for r in LLAMA_CPP_SPLITS[field("tokenizer.ggml.pre")]]
        types = field("tokenizer.ggml.token_type")
        whole = sorted((t for t, k in zip(self.tokens, types) if k in (3, 4)), key=len, reverse=True)
        self.whole = regex.compile("|".join(regex.escape(t) for t in whole))
        self.alphabet = _bytes_to_unicode()

    @functools.lru_cache(maxsize=None)
    def bpe(self, piece: str) -> tuple[int, ...]:
        symbols = [self.alphabet[b] for b in piece.encode("utf-8")]
        while len(symbols) > 1:
            pairs = [(self.ranks.get(p, float("inf")), i) for i, p in enumerate(zip(symbols, symbols[1:]))]
            rank, i = min(pairs)
            if rank == float("inf"):
                break
            symbols[i:i + 2] = [symbols[i] + symbols[i + 1]]
        return tuple(self.ids[s] for s in symbols)

    def pieces(self, text: str) -> list[str]:
        pieces = [text]
        for pattern in self.splits:  # "isolated": matches and the text between them
            split = []
            for piece in pieces:
                at = 0
                for m in pattern.finditer(piece):
                    if m.start() > at:
                        split.append(piece[at:m.start()])
                    if m.end() > m.start():
                        split.append(m.group())
                    at = m.end()
                if at < len(piece):
                    split.append(piece[at:])
            pieces = split
        return pieces

    def encode(self, text: str) -> list[int]:
        ids, at = [], 0
        for m in list(self.whole.finditer(text)) + [None]:
            end = len(text) if m is None else m.start()
            for piece in self.pieces(text[at:end]):
                ids += self.bpe(piece)
            if m is not None:
                ids.append(self.ids[m.group()])
                at = m.end()
        return ids


@pytest.fixture(scope="module", params=["smollm2-135m", "qwen2.5-coder-0.5b"])
def builtin(request):
    model = load(request.param, "float32", progress=False)
    gguf_path = builtin_gguf(request.param)
    return request.param, gguf_path, model


def _chat(tokenizer, text):
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                         add_generation_prompt=True)


def test_matches_llama_cpp_reference(builtin):
    """Fresh from the file and as read back from the conversion cache."""
    name, path, model = builtin
    reader = open_gguf(path)
    fresh = tokenizer_from_gguf(reader)
    reference = LlamaCppReference(reader)
    texts = corpus()
    chats = [_chat(fresh, t) for t in texts[::7]]
    assert all(c.startswith("<|im_start|>") for c in chats)
    for text in texts + chats:
        want = reference.encode(text)
        assert fresh(text)["input_ids"] == want, text[:80]
        assert model.tokenizer(text)["input_ids"] == want, text[:80]
        assert fresh.decode(want) == text
    assert [_chat(model.tokenizer, t) for t in texts[::7]] == chats
    assert fresh.eos_token == model.tokenizer.eos_token == "<|im_end|>"


def test_matches_transformers_gguf_tokenizer(builtin):
    pytest.importorskip("torch")  # transformers' GGUF reader needs it
    from transformers import AutoTokenizer

    name, path, model = builtin
    theirs = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    ours = model.tokenizer
    texts = corpus()
    texts += [_chat(theirs, t) for t in texts[::7]]
    blank_before_numeral = regex.compile(r"\s\p{N}")
    differ = [t for t in texts if theirs(t)["input_ids"] != ours(t)["input_ids"]]
    if name == "qwen2.5-coder-0.5b":
        assert differ == []
    else:
        assert [t for t in differ if not blank_before_numeral.search(t)] == []
        assert "12 * 13" not in differ and "  1" in differ
        assert ours.convert_ids_to_tokens(ours("  1")["input_ids"]) == ["ĠĠ", "1"]
        assert theirs.convert_ids_to_tokens(theirs("  1")["input_ids"]) == ["Ġ", "Ġ", "1"]
    assert theirs.all_special_tokens == ours.all_special_tokens
    assert [_chat(theirs, t) for t in texts[:50]] == [_chat(ours, t) for t in texts[:50]]
    for t in texts[:200]:
        assert theirs.decode(ours(t)["input_ids"], skip_special_tokens=True) == \
            ours.decode(ours(t)["input_ids"], skip_special_tokens=True)
