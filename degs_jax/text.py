"""The text API: prompts in, decoded completions out, with a `degs_jax.model_api.LanguageModel`
(or what `degs_jax.models.load` returns). Everything below this module works on token
ids (`degs_jax.decoders`)."""

from __future__ import annotations

from typing import Optional, Sequence

import jax

from .chat import encode_prompt
from .decoders import DecodeResult, decode
from .methods import as_method
from .method import Method
from .models import with_tuned_lens
from .stops import cut_at_stop, token_bytes


def sample(model, prompts: str | Sequence[str], method: str | Method = "degs_mcmc",
           key: Optional[jax.Array] = None, *, keys: Optional[jax.Array] = None, seed: int = 0,
           chat: bool = True, progress: bool = False, tuned_lens=None,
           **hyperparameters) -> DecodeResult:
    """Decode text prompts with a `LanguageModel` (e.g. `degs_jax.models.load(...)`).

    method / hyperparameters: as `decode` (a method name with keyword overrides, or a
    hyperparameter dataclass). key: a PRNG key (default `jax.random.key(seed)`); or keys:
    one key per prompt, so that each prompt's samples do not depend on the batch (as `decode`).
    tuned_lens: a `train.tuned_lens.TunedLens`: collapse depths (and everything built on
    them: D(x), DEGS reranking and acceptance) read the residuals through its
    translators (`models.with_tuned_lens`) instead of the logit lens.
    Stop strings (`stop=(...)`, a hyperparameter of every method) end a completion at
    the token that completes the first one (`degs_jax.stops`); the candidates' `text` is
    cut where it begins.
    Returns a DecodeResult whose candidates carry decoded `text`.
    """
    if isinstance(prompts, str):
        prompts = [prompts]
    key = jax.random.key(seed) if key is None and keys is None else key
    ids = [encode_prompt(model.tokenizer, p, chat) for p in prompts]
    lm, params = with_tuned_lens(model.lm, model.params, tuned_lens)
    config = as_method(method, hyperparameters)
    result = decode(lm, params, ids, config, key, keys=keys, eos_ids=model.eos_ids, progress=progress,
                    token_bytes=token_bytes(model.tokenizer) if config.stop else None)
    for out in result.outputs:
        for cand in out.candidates:
            decoded = model.tokenizer.decode(cand.tokens, skip_special_tokens=True)
            cand.text = cut_at_stop(decoded, config.stop)
            cand.ended_by = ended_by(cand.tokens, cand.ended, model.eos_ids, config.stop, decoded)
    return result


def ended_by(tokens: Sequence[int], ended: bool, eos_ids: Sequence[int],
             stop: Optional[Sequence[str]], decoded: str) -> Optional[int | str]:
    """What ended a completion, read on the host from its final tokens: the id of its last
    token if that is an end token (`eos_ids`), else the stop string that ended it: the
    first one to be completed in `decoded` (the tokens' text, uncut), which is where the
    decoder stopped (`degs_jax.stops`); None for a completion that did not end (its token
    budget ran out)."""
    if not ended:
        return None
    if tokens and int(tokens[-1]) in set(map(int, eos_ids)):
        return int(tokens[-1])
    completed = [(i + len(s), -len(s), s) for s in stop or () if (i := decoded.find(s)) >= 0]
    return min(completed)[2] if completed else None
