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

How: an Aho-Corasick automaton over the stop strings' bytes, run on the host over the
tokens' bytes, gives the [states, vocabulary] transition table (the state after the
token, or STOPPED where a stop string is completed inside it), held sparse: the row of
START for every token, and per state only the tokens whose result differs from it
(`StopAutomaton`: a token differs only where the automaton's state after its first byte
still reaches back before the token, so a state has a handful; memory grows with those
exceptions, not with states x vocabulary: measured at Qwen's 151,936 tokens, 0.73 MiB for
one stop character, 0.87 MiB for 10,000, 59 MiB for 3,326 three-character stops;
`MAX_STOP_EXCEPTIONS` bounds it with a one-line error; docs/benchmarks.md, "Stop
strings"). On the device a row's state is a binary search in its state's exceptions per
sampled token (`StopAutomaton.next_state`). The arrays are static data (a frozen value
hashed by its content, closed over by the compiled program as constants like
`eos_ids`), never part of a carry; a row's automaton state
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


# Most exceptions (state, token) a stop automaton may hold (`stop_automaton`): 8 bytes
# each, 128 MiB at most. Ordinary stop strings need a few thousand.
MAX_STOP_EXCEPTIONS = 1 << 24


@dataclasses.dataclass(frozen=True, eq=False)
class StopAutomaton:
    """The compiled stop strings of one vocabulary (module docstring). Frozen and hashed by
    content (`strings`, `digest`): a static argument of the compiled samplers.

    The transition table [states, V] is held sparse: `default` [V] is the state after
    each token from START (STOPPED where the token completes a stop string), `empty` [V]
    marks the tokens without bytes (the state stays), and the (state, token) pairs whose
    state after the token differs from `default` are listed per state, tokens sorted:
    `tokens[offsets[s]:offsets[s + 1]]` with their `values`. A token can only differ
    from its default where the automaton's state after its first byte still reaches back
    before the token (or a stop completes there), so a state has few exceptions; memory
    is V·5 + 8 per exception + 4 per state bytes (measured in docs/benchmarks.md, "Stop
    strings")."""

    strings: tuple[str, ...]
    default: np.ndarray
    empty: np.ndarray
    offsets: np.ndarray
    tokens: np.ndarray
    values: np.ndarray
    digest: str

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StopAutomaton) and (other.strings, other.digest) == (self.strings, self.digest)

    def __hash__(self) -> int:
        return hash((self.strings, self.digest))

    @property
    def num_states(self) -> int:
        return len(self.offsets) - 1

    @property
    def nbytes(self) -> int:
        """Host memory of the automaton's arrays."""
        return sum(a.nbytes for a in (self.default, self.empty, self.offsets, self.tokens, self.values))

    def step(self, state: int, token: int) -> int:
        """The state after `token` from `state` (host)."""
        if self.empty[token]:
            return state
        lo, hi = int(self.offsets[state]), int(self.offsets[state + 1])
        k = lo + int(np.searchsorted(self.tokens[lo:hi], token))
        return int(self.values[k]) if k < hi and self.tokens[k] == token else int(self.default[token])

    def next_state(self, before: Any, tok: Any) -> Any:
        """[B] int32: the state after token `tok` from state `before` (device; a row whose
        `before` is STOPPED has ended and gets an unused value). A binary search in
        `before`'s exceptions (a fixed number of steps: the most any state has), else
        the token's default."""
        import jax.numpy as jnp  # (start-up: the automaton is built with numpy alone; jax only to run it)

        state = jnp.maximum(jnp.asarray(before, jnp.int32), 0)
        tok = jnp.asarray(tok, jnp.int32)
        offsets, tokens = jnp.asarray(self.offsets), jnp.asarray(self.tokens)
        lo, end = offsets[state], offsets[state + 1]
        hi = end
        last = tokens.shape[0] - 1
        for _ in range(int(np.diff(self.offsets).max(initial=0)).bit_length()):
            mid = (lo + hi) // 2
            right = (lo < hi) & (tokens[jnp.clip(mid, 0, last)] < tok)
            lo, hi = jnp.where(right, mid + 1, lo), jnp.where((lo < hi) & ~right, mid, hi)
        at = jnp.clip(lo, 0, last)
        found = (lo < end) & (tokens[at] == tok)
        after = jnp.where(found, jnp.asarray(self.values)[at], jnp.asarray(self.default)[tok])
        return jnp.where(jnp.asarray(self.empty)[tok], state, after).astype(jnp.int32)

    def run(self, tokens: Sequence[int]) -> int:
        """The state after `tokens` from START, or STOPPED at the first stop (host, for tests)."""
        state = START
        for token in tokens:
            state = self.step(state, token)
            if state == STOPPED:
                break
        return state


def _aho_corasick(patterns: Sequence[bytes]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(goto [states, 256] int32, accepting [states] bool, depth [states]) of the patterns'
    automaton: the state is the longest suffix of the bytes read that is a prefix of a
    pattern (of `depth` bytes); accepting where some pattern ends at the last byte read."""
    children: list[dict[int, int]] = [{}]
    accepting = [False]
    depth = [0]
    for pattern in patterns:
        node = 0
        for byte in pattern:
            if byte not in children[node]:
                children.append({})
                accepting.append(False)
                depth.append(depth[node] + 1)
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
    return goto, np.array(accepting), np.array(depth)


def _advance(goto: np.ndarray, accepting: np.ndarray, starts: np.ndarray, padded: np.ndarray,
             lengths: np.ndarray) -> np.ndarray:
    """[len(starts), tokens] int32: the state after each token (rows of `padded`, their
    bytes; `lengths` sorted ascending) from each start state, STOPPED where a stop string
    is completed inside it. Vectorised: every start advances over byte position j of every
    token longer than j at once (a suffix of the sorted tokens)."""
    states = np.repeat(starts.astype(np.int32)[:, None], len(lengths), axis=1)
    stopped = np.zeros(states.shape, bool)
    for j in range(int(lengths[-1]) if len(lengths) else 0):
        longer = int(np.searchsorted(lengths, j, side="right"))  # tokens [longer:] have byte j
        moved = goto[states[:, longer:], padded[None, longer:, j]]
        states[:, longer:] = moved
        stopped[:, longer:] |= accepting[moved]
    return np.where(stopped, STOPPED, states).astype(np.int32)


# States x tokens advanced at once while looking for exceptions (bounds the work memory).
_CHUNK_ENTRIES = 1 << 22


@functools.lru_cache(maxsize=8)
def stop_automaton(strings: tuple[str, ...], vocabulary: TokenBytes, vocab_size: int) -> StopAutomaton:
    """The stop strings' token-level automaton over a vocabulary of `vocab_size` ids (the
    model's logits; ids past the tokenizer's are empty tokens), sparse (`StopAutomaton`).

    The default row runs every token from START. A token whose first byte b leaves state
    s at depth <= 1 without completing a stop is where it would be from START after b
    (the state is the longest suffix of what was read that begins a stop string, here
    within the token), so it continues as from START: only the states whose goto on b is
    deeper, or accepting, are run over the tokens beginning with b, and the results that
    differ from the default are kept. ValueError past MAX_STOP_EXCEPTIONS."""
    strings = validate_stop(strings)
    if not strings:
        raise ValueError("no stop strings to compile")
    if len(vocabulary) > vocab_size:
        raise ValueError(f"the tokenizer has {len(vocabulary)} tokens, more than the model's "
                         f"{vocab_size} logits")
    goto, accepting, depth = _aho_corasick([s.encode("utf-8") for s in strings])
    lengths = np.zeros(vocab_size, np.int64)
    lengths[:len(vocabulary)] = [len(p) for p in vocabulary.pieces]
    order = np.argsort(lengths, kind="stable")
    order = order[lengths[order] > 0]  # the tokens with bytes, shortest first
    padded = np.zeros((len(order), max(int(lengths.max()), 1)), np.uint8)  # their bytes
    for row, i in enumerate(order):
        padded[row, :lengths[i]] = np.frombuffer(vocabulary.pieces[i], np.uint8)
    default = np.zeros(vocab_size, np.int32)  # (empty tokens: `empty`)
    default[order] = _advance(goto, accepting, np.array([START]), padded, lengths[order])[0]
    found_tokens, found_states, found_values = [], [], []
    count = 0
    inner = np.arange(1, goto.shape[0])
    for byte in range(256):
        group = np.flatnonzero(padded[:, 0] == byte)  # rows of `padded`, still by length
        after = goto[inner, byte]
        starts = inner[(depth[after] > 1) | accepting[after]]
        if not len(group) or not len(starts):
            continue
        ids = order[group]
        step = max(1, _CHUNK_ENTRIES // len(group))
        for k in range(0, len(starts), step):
            chunk = starts[k:k + step]
            values = _advance(goto, accepting, chunk, padded[group], lengths[ids])
            rows, cols = np.nonzero(values != default[ids][None, :])
            count += len(rows)
            if count > MAX_STOP_EXCEPTIONS:
                raise ValueError(
                    f"the stop strings ({len(strings)}, {sum(len(t) for t in strings)} characters) "
                    f"need more than {MAX_STOP_EXCEPTIONS} automaton transitions beside the "
                    "default ones; give fewer or shorter stop strings")
            found_states.append(chunk[rows])
            found_tokens.append(ids[cols])
            found_values.append(values[rows, cols])
    states = np.concatenate(found_states) if found_states else np.zeros(0, np.int64)
    tokens = np.concatenate(found_tokens) if found_tokens else np.zeros(0, np.int64)
    values = np.concatenate(found_values) if found_values else np.zeros(0, np.int32)
    by = np.lexsort((tokens, states))
    offsets = np.zeros(goto.shape[0] + 1, np.int32)
    np.add.at(offsets, states + 1, 1)
    arrays = dict(default=default, empty=lengths == 0, offsets=np.cumsum(offsets).astype(np.int32),
                  # (one entry at least: the device search indexes them)
                  tokens=np.append(tokens[by], -1).astype(np.int32),
                  values=np.append(values[by], START).astype(np.int32))
    for array in arrays.values():
        array.setflags(write=False)
    digest = hashlib.sha256(b"".join(a.tobytes() + str(a.shape).encode()
                                     for a in arrays.values())).hexdigest()
    return StopAutomaton(strings=strings, digest=digest, **arrays)
