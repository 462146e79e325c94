"""Shared pieces of the GPU benchmarks: model shapes, environment record, timing."""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import sys
import time
from typing import Optional
from importlib import metadata

# Timings here are of compilations as they happen: the library's default persistent cache
# (models/compilation.py) stays off unless a script turns a cache on itself.
os.environ.setdefault("DEGS_JAX_COMPILATION_CACHE", "0")

import jax
import jax.numpy as jnp

import numpy as np

from degs_jax.methods import hyperparameters_for
from degs_jax.mcmc import MCMCConfig
from degs_jax.model_api import StepOutput
from degs_jax.models import TransformerLM
from degs_jax.models import ModelConfig, init_params

# The library's default buffer of the sampling decoders (prompt + this many slots); the MCMC
# default is `hyperparameters_for("power_mcmc")` (16 blocks x 192 = 3072 as well).
BUFFER_NEW = hyperparameters_for("temperature").max_new_tokens

# Model shapes (config.json of the hub checkpoints), for random weights.
_QWEN2 = dict(architecture="Qwen2ForCausalLM", rope_theta=1e6, rms_norm_eps=1e-6, qkv_bias=True)
SHAPES = {
    "tiny": dict(_QWEN2, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
                 head_dim=16, vocab_size=512, tie_word_embeddings=True),  # CPU smoke tests of the scripts
    "smollm2-135m": dict(architecture="LlamaForCausalLM", hidden_size=576, intermediate_size=1536,
                         num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, vocab_size=49152,
                         tie_word_embeddings=True, rope_theta=1e5, rms_norm_eps=1e-5, qkv_bias=False),
    "qwen2.5-0.5b": dict(_QWEN2, hidden_size=896, intermediate_size=4864, num_layers=24, num_heads=14,
                         num_kv_heads=2, head_dim=64, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(_QWEN2, hidden_size=1536, intermediate_size=8960, num_layers=28, num_heads=12,
                         num_kv_heads=2, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-7b": dict(_QWEN2, hidden_size=3584, intermediate_size=18944, num_layers=28, num_heads=28,
                       num_kv_heads=4, head_dim=128, vocab_size=152064, tie_word_embeddings=False),
    "qwen2.5-72b": dict(_QWEN2, hidden_size=8192, intermediate_size=29568, num_layers=80, num_heads=64,
                        num_kv_heads=8, head_dim=128, vocab_size=152064, tie_word_embeddings=False),
}


def shape_config(name: str, max_len: int = 32768, **runtime) -> ModelConfig:
    """The ModelConfig of shape `name`; `runtime`: e.g. kv_read="all"."""
    return ModelConfig(max_position_embeddings=max_len, **SHAPES[name], **runtime)


def random_model(name: str, seed: int = 0, **runtime):
    cfg = shape_config(name, **runtime)
    return cfg, init_params(cfg, jax.random.key(seed), jnp.bfloat16)


def param_bytes(params) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))


def environment() -> dict:
    def version(pkg):
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return None
    dev = jax.devices()[0]
    return {
        "device": getattr(dev, "device_kind", str(dev)), "device_count": jax.device_count(),
        "platform": dev.platform, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "python": platform.python_version(),
        "versions": {p: version(p) for p in ("jax", "jaxlib", "degs-jax", "transformers", "torch")},
    }


def timed(fn, *args, repeats: int = 3):
    """Median wall-clock seconds of fn(*args) after one warm-up (compilation) call."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def decode_seconds(cfg, params, batch: int, prompt: int, new: int, temperature: float = 0.0,
                   repeats: int = 3, buffer_new: int | None = None, lens=None,
                   donate: bool = False) -> tuple[float, float]:
    """(median seconds of `generate` drawing `new` tokens for `batch` random prompts of
    `prompt` tokens, EOS suppressed; seconds of the first call, compilation included).
    The cache holds prompt + `buffer_new` slots (default `new`: exactly what is drawn);
    `lens`: a LensConfig to probe every step. The prefill is run before each timed call
    and not timed. donate: the state is donated, as `decode`'s host loop does (the
    cache is updated in place: no second copy of it, which a 72B batch cannot afford)."""
    from degs_jax.generation import Proposal, SamplerSpec, generate, prefill

    if donate:
        generate = jax.jit(generate.__wrapped__, static_argnames=("model",), donate_argnames=("state",))

    model = TransformerLM(cfg)
    spec = SamplerSpec(Proposal(temperature), eos_ids=(), lens=lens)
    tokens = jax.random.randint(jax.random.key(batch), (batch, prompt), 0, cfg.vocab_size, jnp.int32)
    lengths = jnp.full((batch,), prompt, jnp.int32)
    keys = jax.random.split(jax.random.key(1), batch)
    max_len = prompt + (new if buffer_new is None else buffer_new)

    def once():
        st = prefill(model, params, tokens, lengths, max_len, jnp.bfloat16)
        jax.block_until_ready(st.length)
        t = time.perf_counter()
        st = generate(model, params, st, lengths + new, keys, spec)
        jax.block_until_ready(st.length)
        return time.perf_counter() - t

    t0 = time.perf_counter()
    once()
    first = time.perf_counter() - t0
    return sorted(once() for _ in range(repeats))[repeats // 2], first


def decode_step_bytes(cfg, params, batch: int, prompt: int, new: int) -> float:
    """Bytes a decode step must read: every weight but the embedding table (only B rows
    are gathered), plus the bf16 KV cache up to the mean length."""
    weights = param_bytes(params) - (0 if cfg.tie_word_embeddings else params.embed.size * 2)
    kv = 2 * cfg.num_layers * batch * (prompt + new / 2) * cfg.num_kv_heads * cfg.head_dim * 2
    return weights + kv


def copy_bandwidth(gib: float = 4.0) -> float:
    """Device-memory bandwidth in bytes/s from a large elementwise pass (read + write)."""
    x = jnp.ones((int(gib * 2**30) // 4,), jnp.float32)
    f = jax.jit(lambda a: a * 1.0001)
    sec = timed(f, x, repeats=5)
    return 2 * x.size * 4 / sec


def emit(record: dict, out_name: str) -> None:
    """Print one JSON record and append it to $OUT/<out_name> (if $OUT is set)."""
    line = json.dumps(record)
    print(line, flush=True)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, out_name), "a") as f:
            f.write(line + "\n")


def write_record(record: dict, out: Optional[str | os.PathLike] = None) -> None:
    """Print one JSON record (indented; NaN refused) and, with `out`, write it there too."""
    text = json.dumps(record, indent=1, allow_nan=False)
    print(text)
    if out is not None:
        with open(out, "w") as f:
            f.write(text + "\n")


def target_lengths(problems: int, median: float, sigma: float, cap: int, seed: int = 0) -> np.ndarray:
    """Per-problem completion lengths (EOS included): lognormal(log median, sigma), in 8..cap."""
    rng = np.random.default_rng(seed)
    return np.clip(np.round(median * np.exp(sigma * rng.standard_normal(problems))), 8, cap).astype(np.int32)


def default_mcmc(method: str, num_layers: int, eos_ids: tuple[int, ...] = (), **overrides) -> MCMCConfig:
    """The MCMCConfig of `method` ("power_mcmc" or "degs_mcmc") with the library's defaults
    (`degs_jax.methods`) updated by `overrides` (e.g. block_len, mh_steps);
    no `eos_ids`: EOS suppressed."""
    return hyperparameters_for(method, **overrides).kernel_config(num_layers, tuple(eos_ids))


@dataclasses.dataclass(frozen=True)
class ForcedEOSLM(TransformerLM):
    """`TransformerLM` whose decode steps (one token per row) sample EOS exactly when row b's
    completion reaches targets[b] tokens, and never before (benchmark harness: a random
    model never ends on its own). Rows are the sampler's batch rows (prompts x chains, one
    chain here); the prefill (several tokens per row) is left alone. Static and hashable
    like any `CausalLM`: targets and prompt lengths are tuples baked into the program. One
    target and one prompt length (every prompt as long) serve a batch of any size: every
    row of every call (an SPS rollout batch too) ends at that many tokens."""

    targets: tuple[int, ...] = ()
    prompt_lens: tuple[int, ...] = ()
    eos: int = 0

    def step(self, params, tokens, positions, cache, lens_layers=()) -> StepOutput:
        out = super().step(params, tokens, positions, cache, lens_layers)
        if tokens.shape[1] != 1:
            return out
        if len(self.targets) != 1 and tokens.shape[0] != len(self.targets):
            raise ValueError(f"ForcedEOSLM has {len(self.targets)} targets for a batch of {tokens.shape[0]} rows")
        targets = jnp.asarray(self.targets, jnp.int32)
        prompt_lens = jnp.asarray(self.prompt_lens, jnp.int32)
        logits = out.logits[:, 0]
        # The step at position p samples the token at p + 1: completion length p + 2 - prompt.
        ends = positions[:, 0] + 2 - prompt_lens >= targets
        eos_logit = jnp.where(ends, jnp.max(logits, axis=-1) + 30.0, -1e9)
        return dataclasses.replace(out, logits=logits.at[:, self.eos].set(eos_logit)[:, None])


def forced_eos_model(cfg: ModelConfig, targets, prompt_lens, eos: int) -> ForcedEOSLM:
    """The model of `cfg` ending row b's completion with `eos` at exactly targets[b] tokens."""
    return ForcedEOSLM(cfg=cfg, targets=tuple(int(t) for t in targets),
                       prompt_lens=tuple(int(n) for n in prompt_lens), eos=int(eos))


# Row-steps seen by `PromptCodedEOSLM(count_row_steps=True)`: decode steps x batch rows, and
# the rows among them that were active (not parked at slot S: `generation.decode_step`).
ROW_STEPS = {"rows": 0, "active": 0}


def _count_row_steps(active, rows) -> None:
    ROW_STEPS["active"] += int(active)
    ROW_STEPS["rows"] += int(rows)


def encode_target(prompt: list[int], target: int, base: int) -> list[int]:
    """`prompt` with its first four tokens replaced by (target, prompt length) in base
    `base` (tokens below `base`), as `PromptCodedEOSLM` reads them."""
    n = len(prompt)
    if n < 4 or target >= base * base or n >= base * base:
        raise ValueError(f"cannot encode target {target} and length {n} in base {base} (4 tokens)")
    return [target // base, target % base, n // base, n % base] + list(prompt[4:])


@dataclasses.dataclass(frozen=True)
class PromptCodedEOSLM(TransformerLM):
    """`TransformerLM` whose decode steps sample EOS exactly when a row's completion reaches
    the target its prompt encodes (`encode_target`: the first four prompt tokens hold the
    target and the prompt length in base vocab - 1), and never before. Unlike `ForcedEOSLM`
    (targets baked per batch row), a row's end travels with its prompt: the prefill writes
    the row's end position into an extra cache leaf ([1, B], rows at the cache's row axis,
    so row copies, repeats and the refill's slot writes carry it), and so it serves any
    schedule, the refill's included. count_row_steps: every decode step adds its rows and
    its active rows to `ROW_STEPS` (a host callback per decode step)."""

    eos: int = 0
    count_row_steps: bool = False

    def init_cache(self, batch: int, max_len: int, dtype):
        return super().init_cache(batch, max_len, dtype), jnp.zeros((1, batch), jnp.int32)

    def step(self, params, tokens, positions, cache, lens_layers=()) -> StepOutput:
        kv, end = cache
        out = super().step(params, tokens, positions, kv, lens_layers)
        base = self.cfg.vocab_size - 1
        if tokens.shape[1] != 1:  # the prefill: read each row's target and prompt length
            target = tokens[:, 0] * base + tokens[:, 1]
            prompt_len = tokens[:, 2] * base + tokens[:, 3]
            return dataclasses.replace(out, cache=(out.cache, (prompt_len + target)[None].astype(jnp.int32)))
        slots = jax.tree.leaves(kv)[0].shape[-2]
        if self.count_row_steps:
            jax.debug.callback(_count_row_steps, jnp.sum(positions[:, 0] < slots), tokens.shape[0])
        logits = out.logits[:, 0]
        # The step at position p samples the token at p + 1: the completion then holds p + 2 - prompt tokens.
        ends = positions[:, 0] + 2 >= end[0]
        eos_logit = jnp.where(ends, jnp.max(logits, axis=-1) + 30.0, -1e9)
        return dataclasses.replace(out, logits=logits.at[:, self.eos].set(eos_logit)[:, None],
                                   cache=(out.cache, end))

