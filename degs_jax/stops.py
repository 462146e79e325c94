"""Stop strings (the `stop` of HF / vLLM sampling parameters) as an end of sequence.

A completion ends at the first stop string as it ends at EOS: the token that completes the
stop string is the last token (kept in the tokens, scored by log p like an EOS, never
consumed, so it has no d_t or H_L), the row is `ended`, and every decoder treats the end the
same way (the MCMC target and proposal, the SMC weights, SPS's completeness). The returned
text is cut where the first stop string begins (`cut_at_stop`), as the graders expect.

The rule, on the bytes of the completion's tokens (UTF-8; a byte-level BPE token's bytes
through the inverse of its byte-to-unicode map, a SentencePiece token with '▁' as a space
and <0xNN> byte-fallback tokens as their byte; special tokens are empty):
- only the completion is matched: the automaton starts empty at the first completion
  token, so a stop string inside the prompt, or one that would span the prompt/completion
  boundary, never ends a row (the prompt is the caller's text, not the model's);
- a stop string split across tokens ends the row at the token that completes it;
- a stop string inside one token (or completed in its middle) ends the row at that token.
Matching bytes is matching text: UTF-8 is self-synchronising, so a stop string occurs in
the bytes exactly where it occurs in the decoded text. (A SentencePiece tokenizer that
strips the space of a text's first token decodes that space away; the automaton still
sees it.)

How: an Aho-Corasick automaton over the stop strings' bytes, run on the host over every
token's bytes from every automaton state, gives a [states, vocabulary] transition table
(`StopAutomaton.table`: the state after the token, or STOPPED where a stop string is
completed inside it). On the device a row's state is one gather per sampled token. The
table is static data (a frozen value hashed by its content, closed over by the compiled
program as a constant like `eos_ids`), never part of a carry; a row's automaton state
after each of its completion tokens is stored per slot (`GenState.stop_state`), so a
continuation from any cut (an MCMC proposal) starts from the state its prefix left.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import re
from typing import Any, Optional, Sequence

import numpy as np

STOPPED = -1  # table entry: the token completes a stop string
START = 0  # the automaton's state before the first completion token


def validate_stop(stop: Any) -> Optional[tuple[str, ...]]:
    """`stop` as a tuple of stop strings (None stays None): ValueError unless every one is
    a non-empty string of valid UTF-8 text (no lone surrogate)."""
    if stop is None:
        return None
    if isinstance(stop, str):
        raise ValueError(f"stop must be a list of strings, not one string ({stop!r}): "
                         "pass a tuple, e.g. (\"\\ndef\",)")
    stop = tuple(stop)
    for text in stop:
        if not isinstance(text, str) or not text:
            raise ValueError(f"every stop string must be a non-empty string, got {text!r}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:  # a lone surrogate: bytes of a command line that are not UTF-8
            raise ValueError(f"the stop string {text!r} is not valid UTF-8 text (a lone surrogate "
                             f"at character {e.start})") from None
    return stop


def cut_at_stop(text: str, stop: Optional[Sequence[str]]) -> str:
    """`text` up to where its first stop string begins (the whole text when none occurs)."""
    cut = min((i for s in stop or () if (i := text.find(s)) >= 0), default=len(text))
    return text[:cut]


class TokenBytes:
    """The bytes of every token id of a vocabulary (`token_bytes(tokenizer)`), hashed by
    content so that it can be a static argument (`decode_tokens`)."""

    def __init__(self, pieces: Sequence[bytes]):
        self.pieces = tuple(bytes(p) for p in pieces)
        self.digest = hashlib.sha256(b"".join(len(p).to_bytes(4, "little") + p
                                              for p in self.pieces)).hexdigest()

    def __len__(self) -> int:
        return len(self.pieces)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TokenBytes) and other.digest == self.digest

    def __hash__(self) -> int:
        return hash(self.digest)

    def __repr__(self) -> str:
        return f"TokenBytes({len(self)} tokens, sha256 {self.digest[:12]})"


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class _NotByteLevel(Exception):
    pass


class _ByteLevelChars(dict):
    """str.translate's table from byte-level characters to the Latin-1 character of their
    byte; a character outside the alphabet stops the translation (`_NotByteLevel`)."""

    def __missing__(self, char: int):
        raise _NotByteLevel(char)


def _decoder_types(decoder: Optional[dict]) -> set[str]:
    if not decoder:
        return set()
    types = {decoder.get("type")}
    for inner in decoder.get("decoders") or ():
        types |= _decoder_types(inner)
    return types


def byte_level_alphabet() -> dict[int, str]:
    """Byte-level BPE's byte -> character map (GPT-2's): the printable Latin-1 bytes
    ('!'..'~', '¡'..'¬', '®'..'ÿ') stand for themselves, the other bytes, in increasing
    order, for the characters 256, 257, ...; a token's string is its bytes so mapped."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


_TOKEN_BYTES: dict[int, tuple[Any, TokenBytes]] = {}  # id(tokenizer) -> (tokenizer, its bytes)


def token_bytes(tokenizer: Any) -> TokenBytes:
    """The bytes each token id of a Hugging Face fast tokenizer stands for: byte-level BPE
    (GPT-2, Qwen, SmolLM2) through the inverse of its byte-to-unicode map; SentencePiece
    (Llama, Mistral) with '▁' as a space and <0xNN> as byte NN; special tokens empty
    (`decode(..., skip_special_tokens=True)` drops them). ValueError for another decoder.
    Kept per tokenizer object (a 152k vocabulary takes seconds to read)."""
    known = _TOKEN_BYTES.get(id(tokenizer))
    if known is not None and known[0] is tokenizer:
        return known[1]
    pieces = _read_token_bytes(tokenizer)
    _TOKEN_BYTES[id(tokenizer)] = (tokenizer, pieces)
    return pieces


def _read_token_bytes(tokenizer: Any) -> TokenBytes:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError("stop strings need a Hugging Face fast tokenizer (its per-token bytes)")
    types = _decoder_types(json.loads(backend.decoder.__getstate__()) if backend.decoder else None)
    if "ByteLevel" in types:
        to_latin1 = _ByteLevelChars({ord(ch): chr(b) for b, ch in byte_level_alphabet().items()})

        def piece(token: str) -> bytes:
            try:
                return token.translate(to_latin1).encode("latin-1")
            except _NotByteLevel:  # an added token's own text
                return token.encode("utf-8")
    elif types & {"Metaspace", "ByteFallback", "Replace"}:
        def piece(token: str) -> bytes:
            byte = _BYTE_FALLBACK.fullmatch(token)
            return bytes([int(byte.group(1), 16)]) if byte else token.replace("\u2581", " ").encode("utf-8")
    else:
        raise ValueError(f"stop strings: no rule for this tokenizer's decoder ({sorted(t for t in types if t)}); "
                         "byte-level BPE and SentencePiece are supported")
    special = set(tokenizer.all_special_ids) | {i for i, added in tokenizer.added_tokens_decoder.items()
                                               if added.special}
    tokens: list[Optional[str]] = [None] * len(tokenizer)
    for token, i in tokenizer.get_vocab().items():
        if i < len(tokens):
            tokens[i] = token
    return TokenBytes([b"" if i in special or token is None else piece(token)
                       for i, token in enumerate(tokens)])


@dataclasses.dataclass(frozen=True, eq=False)
class StopAutomaton:
    """The compiled stop strings of one vocabulary (module docstring). Frozen and hashed by
    content (`strings`, `digest`): a static argument of the compiled samplers.

    table: [states, V] int16/int32: the state after a token from each state, STOPPED where
    the token completes a stop string (the row then ends; no later state is needed)."""

    strings: tuple[str, ...]
    table: np.ndarray
    digest: str

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StopAutomaton) and (other.strings, other.digest) == (self.strings, self.digest)

    def __hash__(self) -> int:
        return hash((self.strings, self.digest))

    @property
    def num_states(self) -> int:
        return self.table.shape[0]

    def run(self, tokens: Sequence[int]) -> int:
        """The state after `tokens` from START, or STOPPED at the first stop (host, for tests)."""
        state = START
        for token in tokens:
            state = int(self.table[state, token])
            if state == STOPPED:
                break
        return state


def _aho_corasick(patterns: Sequence[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """(goto [states, 256] int32, accepting [states] bool) of the patterns' automaton: the
    state is the longest suffix of the bytes read that is a prefix of a pattern;
    accepting where some pattern ends at the last byte read."""
    children: list[dict[int, int]] = [{}]
    accepting = [False]
    for pattern in patterns:
        node = 0
        for byte in pattern:
            if byte not in children[node]:
                children.append({})
                accepting.append(False)
                children[node][byte] = len(children) - 1
            node = children[node][byte]
        accepting[node] = True
    goto = np.zeros((len(children), 256), np.int32)
    fail = [0] * len(children)
    order = list(children[0].values())  # breadth first: a state's failure is shallower
    for byte, child in children[0].items():
        goto[0, byte] = child
    for node in order:
        accepting[node] = accepting[node] or accepting[fail[node]]
        goto[node] = goto[fail[node]]
        for byte, child in children[node].items():
            goto[node, byte] = child
            fail[child] = goto[fail[node], byte]  # (a root child keeps failure 0, the root)
            order.append(child)
    return goto, np.array(accepting)


@functools.lru_cache(maxsize=8)
def stop_automaton(strings: tuple[str, ...], vocabulary: TokenBytes, vocab_size: int) -> StopAutomaton:
    """The stop strings' token-level automaton over a vocabulary of `vocab_size` ids (the
    model's logits; ids past the tokenizer's are empty tokens). Vectorised over tokens:
    every state advances over byte position j of every token longer than j at once
    (tokens sorted by length, so those are a suffix)."""
    strings = validate_stop(strings)
    if not strings:
        raise ValueError("no stop strings to compile")
    if len(vocabulary) > vocab_size:
        raise ValueError(f"the tokenizer has {len(vocabulary)} tokens, more than the model's "
                         f"{vocab_size} logits")
    goto, accepting = _aho_corasick([s.encode("utf-8") for s in strings])
    lengths = np.zeros(vocab_size, np.int64)
    lengths[:len(vocabulary)] = [len(p) for p in vocabulary.pieces]
    order = np.argsort(lengths, kind="stable")
    sorted_lengths = lengths[order]
    width = int(sorted_lengths[-1])
    padded = np.zeros((vocab_size, max(width, 1)), np.uint8)  # token bytes, in `order`
    for row, i in enumerate(order):
        if lengths[i]:  # (ids past the tokenizer's are empty)
            padded[row, :lengths[i]] = np.frombuffer(vocabulary.pieces[i], np.uint8)
    states = np.repeat(np.arange(goto.shape[0])[:, None], vocab_size, axis=1)  # [states, V in order]
    stopped = np.zeros(states.shape, bool)
    for j in range(width):
        longer = int(np.searchsorted(sorted_lengths, j, side="right"))  # tokens [longer:] have byte j
        moved = goto[states[:, longer:], padded[None, longer:, j]]
        states[:, longer:] = moved
        stopped[:, longer:] |= accepting[moved]
    dtype = np.int16 if goto.shape[0] < np.iinfo(np.int16).max else np.int32
    table = np.empty(states.shape, dtype)
    table[:, order] = np.where(stopped, STOPPED, states)
    table.setflags(write=False)
    digest = hashlib.sha256(table.tobytes() + str(table.shape).encode()).hexdigest()
    return StopAutomaton(strings=strings, table=table, digest=digest)
