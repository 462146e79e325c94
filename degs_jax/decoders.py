"""The decoders of DESIGN §4 behind one entry point, on token ids (`decode`) or text
(`sample`).

| method              | what it returns                                               |
| ------------------- | ------------------------------------------------------------- |
| greedy              | argmax decoding                                               |
| temperature         | ancestral sampling at `temperature` (default 0.25)            |
| best_of_n           | N samples from p; the largest log p(x)                        |
| best_of_n_entropy   | the same pool; the lowest mean final-layer entropy            |
| degs_rerank         | the same pool; argmax alpha·log p(x) + beta·D(x) (alpha=0: depth only) |
| power_mcmc          | MH chain for p^alpha (beta = 0, no probing)                   |
| degs_mcmc           | MH chain for p^alpha·exp(beta·D)                              |
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from .generation import SamplerSpec, generate, pad_prompts, prefill, repeat_rows
from .lens import LensConfig, default_lsub, mean_final_entropy, sequence_depth
from .mcmc import MCMCConfig, mcmc_block
from .models import ModelConfig, Params

RERANK_METHODS = ("best_of_n", "best_of_n_entropy", "degs_rerank")
MCMC_METHODS = ("power_mcmc", "degs_mcmc")
METHODS = ("greedy", "temperature") + RERANK_METHODS + MCMC_METHODS

_COMMON = dict(tau=0.25, lsub=None, lens_chunk=None, top_k=0, top_p=1.0, cache_dtype=None)
DEFAULTS: dict[str, dict[str, Any]] = {
    "greedy": dict(max_new_tokens=3072, probe=True),
    "temperature": dict(max_new_tokens=3072, temperature=0.25, probe=True),
    "best_of_n": dict(max_new_tokens=3072, n=16, temperature=1.0, probe=True),
    "best_of_n_entropy": dict(max_new_tokens=3072, n=16, temperature=1.0, probe=True),
    "degs_rerank": dict(max_new_tokens=3072, n=16, temperature=1.0, alpha=4.0, beta=5.0, probe=True),
    "power_mcmc": dict(alpha=4.0, beta=0.0, block_len=192, num_blocks=16, mh_steps=10,
                       n_chains=1, reference_quirks=False),
    "degs_mcmc": dict(alpha=4.0, beta=5.0, block_len=192, num_blocks=16, mh_steps=10,
                      n_chains=1, reference_quirks=False),
}


@dataclasses.dataclass
class Candidate:
    """One completion with its scores. `depth` is None when it was not probed."""

    tokens: list[int]
    log_p: float
    depth: Optional[float]
    final_entropy: float
    ended: bool  # False: stopped by the token budget without EOS
    acceptance: Optional[list[float]] = None  # MCMC: per-block acceptance rate
    text: Optional[str] = None


@dataclasses.dataclass
class Output:
    """A decoder's answer for one prompt, plus every candidate (pool or chains)."""

    chosen: Candidate
    candidates: list[Candidate]


@dataclasses.dataclass
class DecodeResult:
    method: str
    hyperparameters: dict[str, Any]
    outputs: list[Output]
    counters: dict[str, int]  # generated_tokens, forward_tokens, probed_token_layers
    seconds: dict[str, float]  # prefill, decode, total (compilation included)

    def forward_equivalents(self, num_layers: int) -> float:
        """Token forwards with probing charged K/L of a forward per probed token (DESIGN §5)."""
        return self.counters["forward_tokens"] + self.counters["probed_token_layers"] / num_layers


def resolve_hyperparameters(method: str, overrides: dict[str, Any]) -> dict[str, Any]:
    """The method's defaults updated with `overrides`; unknown names are an error."""
    if method not in DEFAULTS:
        raise ValueError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    hp = {**_COMMON, **DEFAULTS[method]}
    unknown = sorted(set(overrides) - set(hp))
    if unknown:
        raise ValueError(f"{method} does not take {', '.join(unknown)}; it takes {', '.join(sorted(hp))}")
    hp.update(overrides)
    if method == "power_mcmc" and hp["beta"] != 0:
        raise ValueError("power_mcmc is the beta = 0 chain; use degs_mcmc for beta > 0")
    for name in ("n", "n_chains", "max_new_tokens"):
        if name in hp and (not isinstance(hp[name], int) or isinstance(hp[name], bool) or hp[name] < 1):
            raise ValueError(f"{name} must be a positive integer, got {hp[name]!r}")
    if method == "degs_rerank" and not (hp["alpha"] >= 0 and hp["beta"] >= 0):
        raise ValueError("degs_rerank needs alpha >= 0 and beta >= 0")
    if method == "degs_rerank" and not hp["probe"]:
        raise ValueError("degs_rerank needs probe=True (it ranks by D(x))")
    return hp


def _lens(cfg: ModelConfig, hp: dict[str, Any]) -> LensConfig:
    lsub = tuple(hp["lsub"]) if hp["lsub"] is not None else default_lsub(cfg.num_layers)
    return LensConfig(lsub=lsub, tau=hp["tau"], chunk=hp["lens_chunk"]).validate_for(cfg.num_layers)


def _candidates(state, cfg: ModelConfig, probed: bool, acceptance=None) -> list[Candidate]:
    comp = state.completion_mask()
    scored = state.completion_mask(scored=True)
    log_p = jnp.sum(jnp.where(comp, state.logp, 0.0), axis=1)
    depth = sequence_depth(state.depth, scored, cfg.num_layers)
    fent = mean_final_entropy(state.final_entropy, scored)
    tokens, start, end, ended, log_p, depth, fent = jax.device_get(
        (state.tokens, state.prompt_len, state.length, state.ended, log_p, depth, fent))
    return [Candidate(tokens=tokens[b, start[b]:end[b]].tolist(), log_p=float(log_p[b]),
                      depth=float(depth[b]) if probed else None, final_entropy=float(fent[b]),
                      ended=bool(ended[b]),
                      acceptance=None if acceptance is None else acceptance[b])
            for b in range(tokens.shape[0])]


def _counters(state) -> dict[str, int]:
    g, f, p = jax.device_get((state.n_generated, state.n_forward, state.n_probed))
    return dict(generated_tokens=int(g.sum()), forward_tokens=int(f.sum()),
                probed_token_layers=int(p.sum()))


def _choose(method: str, pool: list[Candidate], hp: dict[str, Any]) -> Candidate:
    if method == "best_of_n":
        return max(pool, key=lambda c: c.log_p)
    if method == "best_of_n_entropy":
        return min(pool, key=lambda c: c.final_entropy)
    if method == "degs_rerank":
        return max(pool, key=lambda c: hp["alpha"] * c.log_p + hp["beta"] * c.depth)
    return pool[0]


def decode(params: Params, cfg: ModelConfig, prompts: Sequence[Sequence[int]], method: str,
           key: Optional[jax.Array] = None, *, keys: Optional[jax.Array] = None,
           eos_ids: Sequence[int], progress: bool = False, tuned_lens=None,
           **hyperparameters) -> DecodeResult:
    """Run `method` on token-id prompts.

    tuned_lens: a `train.tuned_lens.TunedLens`: collapse depths (and everything built on
    them: D(x), DEGS reranking and acceptance) read the residuals through its
    translators instead of the logit lens.

    Randomness: with one `key`, row r of the batch (prompt i, candidate or chain j,
    r = i·n + j) uses `split(key, rows)[r]`. With `keys` ([len(prompts)] PRNG keys, one
    per prompt), prompt i's rows use `split(keys[i], n)`, so each prompt's samples do not
    depend on which prompts share its batch (a single prompt decodes identically either way).
    """
    hp = resolve_hyperparameters(method, hyperparameters)
    lens = _lens(cfg, hp)
    eos_ids = tuple(int(e) for e in eos_ids)
    if method in MCMC_METHODS:
        mc = MCMCConfig(alpha=float(hp["alpha"]), beta=float(hp["beta"]), block_len=hp["block_len"],
                        num_blocks=hp["num_blocks"], mh_steps=hp["mh_steps"],
                        lens=lens if hp["beta"] > 0 else None, eos_ids=eos_ids,
                        top_k=hp["top_k"], top_p=hp["top_p"],
                        reference_quirks=bool(hp["reference_quirks"]))
        n, max_new = hp["n_chains"], mc.max_new_tokens
    else:
        temperature = 0.0 if method == "greedy" else float(hp["temperature"])
        spec = SamplerSpec(temperature=temperature, top_k=hp["top_k"], top_p=hp["top_p"],
                           eos_ids=eos_ids, lens=lens if hp["probe"] else None)
        n, max_new = hp.get("n", 1), hp["max_new_tokens"]
    longest = max(len(p) for p in prompts) if prompts else 0
    if longest + max_new > cfg.max_position_embeddings:
        raise ValueError(f"prompt of {longest} tokens + {max_new} new tokens exceeds the model's "
                         f"context of {cfg.max_position_embeddings} tokens")
    cache_dtype = hp["cache_dtype"] or params.embed.dtype

    t0 = time.perf_counter()
    tokens, lengths = pad_prompts(prompts)
    state = prefill(params, cfg, jnp.asarray(tokens), jnp.asarray(lengths),
                    tokens.shape[1] + max_new, cache_dtype)
    state = repeat_rows(state, n)
    jax.block_until_ready(state.length)
    t1 = time.perf_counter()
    rows = state.length.shape[0]
    if (key is None) == (keys is None):
        raise ValueError("pass exactly one of key (one PRNG key) or keys (one per prompt)")
    if keys is None:
        keys = jax.random.split(key, rows)
    else:
        if keys.shape != (len(prompts),):
            raise ValueError(f"keys must hold one key per prompt ({len(prompts)}), got shape {keys.shape}")
        keys = jax.vmap(lambda k: jax.random.split(k, n))(keys).reshape(-1)
    translators = None if tuned_lens is None else tuned_lens.translators_for(lens.lsub)
    acceptance = None
    if method in MCMC_METHODS:
        acceptance = [[] for _ in range(rows)]
        bar = tqdm(range(mc.num_blocks), desc=method, unit="block", disable=not progress)
        for block in bar:
            state, accepted, active = mcmc_block(params, cfg, state, keys, jnp.int32(block), mc,
                                                 translators if mc.lens is not None else None)
            accepted, active = jax.device_get((accepted, active))
            for r in np.flatnonzero(active):
                acceptance[r].append(float(accepted[r]) / mc.mh_steps)
            if bool(jax.device_get(state.ended).all()):
                break
        probed = mc.beta > 0
    else:
        limit = state.prompt_len + max_new
        state = generate(params, cfg, state, limit, keys, spec,
                         translators=translators if spec.lens is not None else None)
        probed = spec.lens is not None
    jax.block_until_ready(state.length)
    t2 = time.perf_counter()

    pool = _candidates(state, cfg, probed, acceptance)
    outputs = [Output(chosen=_choose(method, pool[i * n:(i + 1) * n], hp),
                      candidates=pool[i * n:(i + 1) * n]) for i in range(len(prompts))]
    return DecodeResult(method=method, hyperparameters=hp, outputs=outputs,
                        counters=_counters(state),
                        seconds=dict(prefill=t1 - t0, decode=t2 - t1, total=t2 - t0))


def encode_prompt(tokenizer, prompt: str, chat: bool = True) -> list[int]:
    """Token ids of `prompt`, through the tokenizer's chat template when it has one."""
    if chat and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                            add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)
    return tokenizer.encode(prompt)


def eos_ids_of(cfg: ModelConfig, tokenizer) -> tuple[int, ...]:
    """EOS ids from the config and the tokenizer (chat models often end turns with a
    different token than their base EOS)."""
    ids = set(cfg.eos_token_ids)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return tuple(sorted(ids))


def sample(model, prompts: str | Sequence[str], method: str = "degs_mcmc",
           key: Optional[jax.Array] = None, *, seed: int = 0, chat: bool = True,
           progress: bool = False, tuned_lens=None, **hyperparameters) -> DecodeResult:
    """Decode text prompts with a loaded model (`degs_jax.models.loading.load`).

    tuned_lens: as in `decode`. Returns a DecodeResult whose candidates carry decoded `text`.
    """
    if isinstance(prompts, str):
        prompts = [prompts]
    key = jax.random.key(seed) if key is None else key
    ids = [encode_prompt(model.tokenizer, p, chat) for p in prompts]
    eos = eos_ids_of(model.cfg, model.tokenizer)
    result = decode(model.params, model.cfg, ids, method, key, eos_ids=eos, progress=progress,
                    tuned_lens=tuned_lens, **hyperparameters)
    for out in result.outputs:
        for cand in out.candidates:
            cand.text = model.tokenizer.decode(cand.tokens, skip_special_tokens=True)
    return result
