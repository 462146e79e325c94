"""A byte-level tokenizer with no merges (256 byte tokens + EOS = 257 ids) for tiny random
models: any text round-trips, and `save_pretrained` / `AutoTokenizer` read it back."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast


EOS = "<|eos|>"


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """The tokenizer (EOS: id 256)."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    vocab[EOS] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS)
