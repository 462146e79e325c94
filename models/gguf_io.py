"""Read llama.cpp GGUF checkpoints (llama, qwen2, qwen3 architectures) as HF-named fp32 tensors.

A GGUF file holds the config as metadata key/values and each tensor, possibly
block-quantised, under llama.cpp names. We build a `ModelConfig` from the
metadata, dequantise every tensor to fp32 with `gguf.quants.dequantize`, rename
it to its Hugging Face name and undo the q/k row permutation that
llama.cpp's `convert_hf_to_gguf.py` applies to llama-architecture files (its
rope kernel pairs adjacent dimensions, HF's `rotate_half` pairs halves). Qwen2
and Qwen3 files are written without that permutation. The result feeds
`checkpoint.params_from_hf`, which does all shape checks.

Shapes: GGUF lists dimensions fastest-first (`ne` order, what `ReaderTensor.shape`
shows); the numpy arrays the reader and `dequantize` return are row-major, i.e.
already in HF order ([out, in] for linear weights).

The tokenizer (`tokenizer_from_gguf`) is rebuilt from the file's own metadata with
`tokenizers` alone (transformers' GGUF tokenizer path imports torch): a byte-level BPE
over `tokenizer.ggml.tokens` / `merges`, split first by the regular expressions that
llama.cpp's `llama-vocab.cpp` uses for the file's `tokenizer.ggml.pre` type, control
tokens added as special tokens and user-defined ones as plain added tokens, the chat
template from `tokenizer.chat_template`.
"""

from __future__ import annotations

import os
import re
from typing import Iterator

import numpy as np

from .checkpoint import CheckpointError
from .config import ConfigError, ModelConfig
from .hf_import import transformers

GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                      "qwen3": "Qwen3ForCausalLM"}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(.+)")

# Pre-tokenizer splits per `tokenizer.ggml.pre`, applied in order (each to the pieces of
# the previous one), as llama.cpp's `llama_vocab` does; each piece is then byte-level BPE
# encoded. GPT-2's expression ends in `|\s+`, which llama.cpp leaves out because it keeps
# unmatched text as pieces anyway; "isolated" splitting in `tokenizers` does the same.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
GGUF_PRE_TOKENIZERS: dict[str, tuple[str, ...]] = {
    "gpt2": (_GPT2_SPLIT,),
    "smollm": (r"\p{N}", _GPT2_SPLIT),  # digits one by one, as SmolLM2's own tokenizer
    "qwen2": (_QWEN2_SPLIT,),
    "deepseek-r1-qwen": (_QWEN2_SPLIT,),
    "llama-bpe": (_LLAMA3_SPLIT,),
    "llama3": (_LLAMA3_SPLIT,),
}
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


class GGUFError(CheckpointError):
    """A GGUF file is unreadable (truncated, corrupt, not GGUF)."""


def open_gguf(path: str | os.PathLike):
    """A `gguf.GGUFReader` over `path` (memory-mapped); unreadable files raise GGUFError
    naming the file, a missing file FileNotFoundError."""
    import gguf  # ~0.2 s of start-up, paid only when a GGUF file is read (not its cached conversion)

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # the reader raises ValueError, KeyError, IndexError, ... on bad bytes
        raise GGUFError(f"cannot read GGUF file {path} (truncated or corrupt?): "
                        f"{type(e).__name__}: {e}") from e


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def config_from_gguf(reader) -> ModelConfig:
    """ModelConfig from GGUF metadata. Unknown architectures, partial rotary and rope
    scaling raise ConfigError."""
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ConfigError(f"unknown GGUF architecture {arch!r}; supported: "
                          f"{', '.join(GGUF_ARCHITECTURES)}")

    def need(key):
        value = _field(reader, f"{arch}.{key}")
        if value is None:
            raise ConfigError(f"GGUF metadata lacks {arch}.{key}")
        if isinstance(value, list):  # e.g. per-layer head counts
            raise ConfigError(f"GGUF metadata {arch}.{key} is per-layer ({value[:4]}...); not supported")
        return value

    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    head_dim = int(_field(reader, f"{arch}.attention.key_length", 0) or hidden // heads)
    rotary = _field(reader, f"{arch}.rope.dimension_count", head_dim)
    if rotary != head_dim:
        raise ConfigError(f"partial rotary embeddings ({rotary} of {head_dim} dims) are not supported")
    scaling = _field(reader, f"{arch}.rope.scaling.type", "none")
    if scaling != "none":
        raise ConfigError(f"GGUF rope scaling {scaling!r} is not supported")
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise ConfigError("GGUF rope frequency factors (rope_freqs.weight: Llama-3.1 rope scaling) "
                          "are not supported; load the Hugging Face checkpoint instead")
    vocab = _field(reader, f"{arch}.vocab_size")
    if vocab is None:
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        if tokens is None:
            raise ConfigError(f"GGUF metadata has neither {arch}.vocab_size nor tokenizer.ggml.tokens")
        vocab = len(tokens.data)
    return ModelConfig(
        architecture=GGUF_ARCHITECTURES[arch],
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_layers=int(need("block_count")),
        num_heads=heads,
        num_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=head_dim,
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(need("context_length")),
        qkv_bias=arch == "qwen2",
        qk_norm=arch == "qwen3",
        tie_word_embeddings=all(t.name != "output.weight" for t in reader.tensors),
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=gguf_end_token_ids(reader),
        pad_token_id=_field(reader, "tokenizer.ggml.padding_token_id"),
    )


# The metadata keys of a GGUF file's end tokens: end of sequence, end of turn, end of message
# (llama.cpp's `LLM_KV_TOKENIZER_EOS_ID`, `_EOT_ID`, `_EOM_ID`).
GGUF_END_TOKEN_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                       "tokenizer.ggml.eom_token_id")


def gguf_end_token_ids(reader) -> tuple[int, ...]:
    """The end tokens a GGUF file declares (`GGUF_END_TOKEN_KEYS`), sorted. A file declares
    one end of sequence, so the model's other end tokens (Qwen's `<|endoftext|>` beside its
    declared `<|im_end|>`) come from its vocabulary: `loading.end_token_ids`."""
    return tuple(sorted({int(i) for key in GGUF_END_TOKEN_KEYS if (i := _field(reader, key)) is not None}))


def tokenizer_from_gguf(reader):
    """A `transformers.PreTrainedTokenizerFast` built from the GGUF's tokenizer metadata
    (module docstring), without torch. GGUFError for tokenizer types it does not know
    (name the file's `tokenizer.ggml.model` / `pre`)."""
    # tokenizers and transformers: ~2 s of start-up, paid only when a GGUF file is converted
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    PreTrainedTokenizerFast = transformers().PreTrainedTokenizerFast  # (see the line above)

    where = reader.data.filename
    kind, pre = _field(reader, "tokenizer.ggml.model"), _field(reader, "tokenizer.ggml.pre", "gpt2")
    if kind != "gpt2":
        raise GGUFError(f"{where}: tokenizer model {kind!r} is not supported (only byte-level BPE, "
                        "'gpt2'); load the model from its Hugging Face directory instead")
    if pre not in GGUF_PRE_TOKENIZERS:
        raise GGUFError(f"{where}: pre-tokenizer {pre!r} is not supported (supported: "
                        f"{', '.join(GGUF_PRE_TOKENIZERS)}); load the model from its Hugging Face "
                        "directory instead")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    merges = _field(reader, "tokenizer.ggml.merges")
    if not tokens or merges is None:
        raise GGUFError(f"{where}: GGUF metadata lacks tokenizer.ggml.tokens or tokenizer.ggml.merges")
    types = _field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)},
                     merges=[tuple(m.split(" ", 1)) for m in merges], fuse_unk=False)
    tokenizer = Tokenizer(bpe)
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in GGUF_PRE_TOKENIZERS[pre]]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    special = {name: tokens[i] for name, i in (
        (name, _field(reader, f"tokenizer.ggml.{key}_token_id"))
        for name, key in (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"),
                          ("pad_token", "padding"))) if i is not None}
    if _field(reader, "tokenizer.ggml.add_bos_token", False) and "bos_token" in special:
        bos = special["bos_token"]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokens.index(bos))])
    else:
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    # Control tokens (<|im_start|>...) are matched whole before BPE and skipped by
    # decode(skip_special_tokens=True); user-defined ones (<tool_call>) are matched whole.
    tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True)
                                  for t, k in zip(tokens, types) if k == _CONTROL])
    tokenizer.add_tokens([AddedToken(t, normalized=False, special=False)
                          for t, k in zip(tokens, types) if k == _USER_DEFINED])
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, **special)
    template = _field(reader, "tokenizer.chat_template")
    if template:
        wrapped.chat_template = template
    return wrapped


def hf_name(gguf_name: str) -> str:
    """The HF tensor name of a llama.cpp tensor name; unknown names are returned
    unchanged so that the shape check reports them as unexpected."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK_RE.fullmatch(gguf_name)
    if m and m.group(2) in _BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}"
    return gguf_name


def unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's rope permutation of a q or k projection, w: [n_heads*Dh, ...].

    convert_hf_to_gguf.py reorders each head's rows from HF's halves layout
    (x_0..x_{Dh/2-1}, x_{Dh/2}..x_{Dh-1}) to interleaved pairs via
    `w.reshape(n_heads, 2, Dh/2, ...).swapaxes(1, 2)`; the inverse swaps the
    other way. Pure index shuffle: bit-exact.
    """
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's permutation (the inverse of `unpermute_rows`), for writing test files."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def iter_hf_tensors(reader, cfg: ModelConfig) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (HF name, fp32 array in HF layout) for every tensor of the file, in file order.

    Dequantisation is exact in fp32 (scale * quant + min per block), so the arrays
    equal what llama.cpp and HF's GGUF loader compute. q/k rows are un-permuted for
    llama files only, and only when the row count fits the config (otherwise the
    array is passed through and the shape check names it).
    """
    from gguf.quants import dequantize  # as in open_gguf: only when a GGUF file is read

    for t in reader.tensors:
        try:
            arr = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
            arr = arr.reshape(tuple(int(d) for d in reversed(t.shape)))
        except Exception as e:
            raise GGUFError(f"cannot dequantize tensor {t.name} ({t.tensor_type.name}) of "
                            f"{reader.data.filename}: {type(e).__name__}: {e}") from e
        name = hf_name(t.name)
        if cfg.family == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_heads if name.endswith("q_proj.weight") else cfg.num_kv_heads
            if arr.ndim == 2 and arr.shape[0] == heads * cfg.head_dim:
                arr = unpermute_rows(arr, heads)
        yield name, arr
