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
| power_smc           | Power-SMC: N particles for p^alpha, drawn by weight (smc.py)  |
| degs_smc            | the same particles for p^alpha·exp(beta·D)                    |
| scalable_power      | Scalable Power Sampling, block form (sps.py)                  |
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from .generation import (GenState, SamplerSpec, generate_chunk, initial_active, pad_prompts, prefill,
                         repeat_rows)
from .lens import LensConfig, default_lsub, mean_final_entropy, sequence_depth
from .mcmc import MCMCConfig, mcmc_block_donating
from .model_api import CausalLM, TransformerLM, params_dtype
from .smc import SMCConfig, final_weights, run_smc
from .sps import SPSConfig, run_sps

RERANK_METHODS = ("best_of_n", "best_of_n_entropy", "degs_rerank")
MCMC_METHODS = ("power_mcmc", "degs_mcmc")
SMC_METHODS = ("power_smc", "degs_smc")
METHODS = ("greedy", "temperature") + RERANK_METHODS + MCMC_METHODS + SMC_METHODS + ("scalable_power",)

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
    # Sources of the SMC and SPS values: SMCConfig's and SPSConfig's docstrings.
    "power_smc": dict(alpha=4.0, beta=0.0, n_particles=16, max_new_tokens=3072, ramp_tokens=400,
                      ess_threshold=0.5, resample_every=64),
    "degs_smc": dict(alpha=4.0, beta=5.0, n_particles=16, max_new_tokens=3072, ramp_tokens=400,
                     ess_threshold=0.5, resample_every=64),
    "scalable_power": dict(alpha=4.0, max_new_tokens=3072, block_len=192, candidate_pool=32,
                           candidates_kept=8, rollouts=8, rollout_horizon=192, jackknife=True,
                           candidate_temperature=None),
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
    weight: Optional[float] = None  # SMC: normalised final importance weight of the particle


@dataclasses.dataclass
class Output:
    """A decoder's answer for one prompt, plus every candidate (pool or chains)."""

    chosen: Candidate
    candidates: list[Candidate]
    # SMC: log_evidence (log Z-hat), ess (per check), resamples, copied_rows;
    # scalable_power: rollouts.
    diagnostics: Optional[dict[str, Any]] = None


@dataclasses.dataclass
class DecodeResult:
    method: str
    hyperparameters: dict[str, Any]
    outputs: list[Output]
    # generated_tokens, forward_tokens, probed_token_layers; SMC also copied_rows (particle rows
    # overwritten by resampling copies), scalable_power also rollouts (rollout rows run)
    counters: dict[str, int]
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
    if method == "power_smc" and hp["beta"] != 0:
        raise ValueError("power_smc is the beta = 0 sampler; use degs_smc for beta > 0")
    if method == "scalable_power" and (hp["top_k"], hp["top_p"]) != (_COMMON["top_k"], _COMMON["top_p"]):
        raise ValueError("scalable_power does not truncate; its candidates are drawn at candidate_temperature")
    for name in ("n", "n_chains", "max_new_tokens"):
        if name in hp and (not isinstance(hp[name], int) or isinstance(hp[name], bool) or hp[name] < 1):
            raise ValueError(f"{name} must be a positive integer, got {hp[name]!r}")
    if method == "degs_rerank" and not (hp["alpha"] >= 0 and hp["beta"] >= 0):
        raise ValueError("degs_rerank needs alpha >= 0 and beta >= 0")
    if method == "degs_rerank" and not hp["probe"]:
        raise ValueError("degs_rerank needs probe=True (it ranks by D(x))")
    return hp


def _lens(num_layers: int, hp: dict[str, Any]) -> LensConfig:
    lsub = tuple(hp["lsub"]) if hp["lsub"] is not None else default_lsub(num_layers)
    return LensConfig(lsub=lsub, tau=hp["tau"]).validate_for(num_layers)


def _candidates(state, num_layers: int, probed: bool, acceptance=None) -> list[Candidate]:
    comp = state.completion_mask()
    scored = state.completion_mask(scored=True)
    log_p = jnp.sum(jnp.where(comp, state.logp, 0.0), axis=1)
    depth = sequence_depth(state.depth, scored, num_layers)
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


# Host-driven generation runs `generate_chunk` calls of an adaptive number of steps, each
# aiming at CHUNK_SECONDS of device time: short enough that Ctrl-C (delivered when a
# call returns) and the progress bar respond within about a second, long enough that
# the per-chunk host round trip is negligible.
CHUNK_SECONDS = 0.5
FIRST_CHUNK_STEPS = 16
MAX_CHUNK_STEPS = 1024


def generate_in_chunks(model: CausalLM, params: Any, state: GenState, limit: jax.Array,
                       keys: jax.Array, spec: SamplerSpec, on_steps=None) -> GenState:
    """`generate(model, params, state, limit, keys, spec)` driven from the host in chunks
    (same tokens, bit for bit). `state` is donated: do not use it afterwards.
    on_steps(n): called after each chunk with the number of loop steps it ran at most."""
    active = initial_active(state, limit)
    fresh_from = jnp.array(state.length, copy=True)  # not a buffer of the donated state
    steps = FIRST_CHUNK_STEPS
    while True:
        started = time.perf_counter()
        state, active = generate_chunk(model, params, state, active, limit, keys, fresh_from,
                                       spec, jnp.int32(steps))
        more = bool(np.any(jax.device_get(active)))
        if on_steps is not None:
            on_steps(steps)
        if not more:
            return state
        elapsed = time.perf_counter() - started
        if elapsed < CHUNK_SECONDS / 2:
            steps = min(2 * steps, MAX_CHUNK_STEPS)
        elif elapsed > 2 * CHUNK_SECONDS:
            steps = max(steps // 2, 1)


def decode(model: CausalLM, params: Any, prompts: Sequence[Sequence[int]], method: str,
           key: Optional[jax.Array] = None, *, keys: Optional[jax.Array] = None,
           eos_ids: Sequence[int], progress: bool = False, **hyperparameters) -> DecodeResult:
    """Run `method` on token-id prompts.

    Randomness: with one `key`, row r of the batch (prompt i, candidate or chain j,
    r = i·n + j) uses `split(key, rows)[r]`. With `keys` ([len(prompts)] PRNG keys, one
    per prompt), prompt i's rows use `split(keys[i], n)`, so each prompt's samples do not
    depend on which prompts share its batch (a single prompt decodes identically either way).
    """
    hp = resolve_hyperparameters(method, hyperparameters)
    if hp["lens_chunk"] is not None:
        if not isinstance(model, TransformerLM):
            raise ValueError("lens_chunk applies to TransformerLM models only")
        model = dataclasses.replace(model, lens_chunk=hp["lens_chunk"])
    lens = _lens(model.num_layers, hp)
    eos_ids = tuple(int(e) for e in eos_ids)
    if method in MCMC_METHODS:
        mc = MCMCConfig(alpha=float(hp["alpha"]), beta=float(hp["beta"]), block_len=hp["block_len"],
                        num_blocks=hp["num_blocks"], mh_steps=hp["mh_steps"],
                        lens=lens if hp["beta"] > 0 else None, eos_ids=eos_ids,
                        top_k=hp["top_k"], top_p=hp["top_p"],
                        reference_quirks=bool(hp["reference_quirks"]))
        n, max_new = hp["n_chains"], mc.max_new_tokens
    elif method in SMC_METHODS:
        smc = SMCConfig(alpha=float(hp["alpha"]), beta=float(hp["beta"]), n_particles=hp["n_particles"],
                        max_new_tokens=hp["max_new_tokens"], ramp_tokens=hp["ramp_tokens"],
                        ess_threshold=float(hp["ess_threshold"]), resample_every=hp["resample_every"],
                        lens=lens if hp["beta"] > 0 else None, eos_ids=eos_ids, top_k=hp["top_k"],
                        top_p=hp["top_p"])
        n, max_new = smc.n_particles, smc.max_new_tokens
    elif method == "scalable_power":
        temperature = hp["candidate_temperature"]
        sps = SPSConfig(alpha=float(hp["alpha"]), max_new_tokens=hp["max_new_tokens"], block_len=hp["block_len"],
                        candidate_pool=hp["candidate_pool"], candidates_kept=hp["candidates_kept"],
                        rollouts=hp["rollouts"], rollout_horizon=hp["rollout_horizon"],
                        jackknife=bool(hp["jackknife"]),
                        candidate_temperature=None if temperature is None else float(temperature),
                        eos_ids=eos_ids)
        n, max_new = 1, sps.max_new_tokens
    else:
        temperature = 0.0 if method == "greedy" else float(hp["temperature"])
        spec = SamplerSpec(temperature=temperature, top_k=hp["top_k"], top_p=hp["top_p"],
                           eos_ids=eos_ids, lens=lens if hp["probe"] else None)
        n, max_new = hp.get("n", 1), hp["max_new_tokens"]
    longest = max(len(p) for p in prompts) if prompts else 0
    if longest + max_new > model.max_context:
        raise ValueError(f"prompt of {longest} tokens + {max_new} new tokens exceeds the model's "
                         f"context of {model.max_context} tokens")
    cache_dtype = hp["cache_dtype"] or params_dtype(params)

    t0 = time.perf_counter()
    tokens, lengths = pad_prompts(prompts)
    state = prefill(model, params, jnp.asarray(tokens), jnp.asarray(lengths),
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
    acceptance = None
    diagnostics = [None] * len(prompts)
    extra_counters: dict[str, int] = {}
    if method in MCMC_METHODS:
        acceptance = [[] for _ in range(rows)]
        bar = tqdm(range(mc.num_blocks), desc=method, unit="block", disable=not progress)
        for block in bar:
            state, accepted, active = mcmc_block_donating(model, params, state, keys,
                                                          jnp.int32(block), mc)
            accepted, active = jax.device_get((accepted, active))
            for r in np.flatnonzero(active):
                acceptance[r].append(float(accepted[r]) / mc.mh_steps)
            if bool(jax.device_get(state.ended).all()):
                break
        probed = mc.beta > 0
    elif method in SMC_METHODS:
        bar = tqdm(total=max_new + 1, desc=method, unit="step", disable=not progress)
        particles = run_smc(model, params, state, keys, smc, progress=lambda steps: bar.update(steps - bar.n))
        bar.close()
        weights, log_z, picked = jax.device_get(final_weights(particles, keys, n))
        ess, resamples, copied = jax.device_get((particles.ess, particles.resamples, particles.copied_rows))
        state = particles.gen
        diagnostics = [dict(log_evidence=float(log_z[i]), ess=[float(e) for e in ess[i] if np.isfinite(e)],
                            resamples=int(resamples[i]), copied_rows=int(copied[i]))
                       for i in range(len(prompts))]
        extra_counters = dict(copied_rows=int(copied.sum()))
        probed = smc.beta > 0
    elif method == "scalable_power":
        bar = tqdm(total=sps.num_blocks, desc=method, unit="block", disable=not progress)
        state, rollouts = run_sps(model, params, state, keys, sps, progress=lambda blocks: bar.update(blocks - bar.n))
        bar.close()
        rollouts = jax.device_get(rollouts)
        diagnostics = [dict(rollouts=int(r)) for r in rollouts]
        extra_counters = dict(rollouts=int(rollouts.sum()))
        probed = False
    else:
        limit = state.prompt_len + max_new
        bar = tqdm(total=max_new + 1, desc=method, unit="step", disable=not progress)
        state = generate_in_chunks(model, params, state, limit, keys, spec, bar.update)
        bar.close()
        probed = spec.lens is not None
    jax.block_until_ready(state.length)
    t2 = time.perf_counter()

    pool = _candidates(state, model.num_layers, probed, acceptance)
    if method in SMC_METHODS:
        for cand, w in zip(pool, weights.reshape(-1)):
            cand.weight = float(w)
        chosen = [pool[i * n + int(picked[i])] for i in range(len(prompts))]
    else:
        chosen = [_choose(method, pool[i * n:(i + 1) * n], hp) for i in range(len(prompts))]
    outputs = [Output(chosen=chosen[i], candidates=pool[i * n:(i + 1) * n], diagnostics=diagnostics[i])
               for i in range(len(prompts))]
    return DecodeResult(method=method, hyperparameters=hp, outputs=outputs,
                        counters={**_counters(state), **extra_counters},
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
           progress: bool = False, **hyperparameters) -> DecodeResult:
    """Decode text prompts with a loaded model (`degs_jax.models.loading.load`).

    Returns a DecodeResult whose candidates carry decoded `text`.
    """
    if isinstance(prompts, str):
        prompts = [prompts]
    key = jax.random.key(seed) if key is None else key
    ids = [encode_prompt(model.tokenizer, p, chat) for p in prompts]
    eos = eos_ids_of(model.cfg, model.tokenizer)
    result = decode(TransformerLM(model.cfg), model.params, ids, method, key, eos_ids=eos,
                    progress=progress, **hyperparameters)
    for out in result.outputs:
        for cand in out.candidates:
            cand.text = model.tokenizer.decode(cand.tokens, skip_special_tokens=True)
    return result
