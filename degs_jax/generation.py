"""KV-cached generation as one jitted `lax.while_loop` over a state dataclass.

Sequence layout. Each row's buffer holds prompt then completion: slot t holds token
x_t at position t (no left padding; prompts of different lengths are right-padded
and the padding is overwritten as the row generates). For every generated token the
state records, at the token's own slot:

- `logp[t]  = log p(x_t | x_<t)` from the raw logits (fp32, full vocabulary);
- `logq[t]` = the log density x_t was actually sampled from (temperature, top-k/p);
- `depth[t]` = collapse depth d_t and `final_entropy[t]` = H_L(t), both from the
  step that *consumes* x_t (DESIGN §3), so they exist for every generated token
  except a final EOS (which is never scored).

One loop step, for an active row of length n: consume x_{n-1} (write its KV at slot
n-1, read the logits of x_n and the lens statistics of position n-1), then sample
x_n unless the row has reached its limit. A row stops after sampling EOS (EOS is
not consumed) or after consuming the token at `limit - 1`. Statistics of positions
below `fresh_from` are never overwritten: a continuation from a cached prefix keeps
the prefix's stored values, bit for bit, and only re-reads the last prefix token's
logits (one step).

Randomness: token x_t of row b is drawn with `fold_in(keys[b], t)`, so a row's
samples depend only on its key and positions, not on the batch it runs in.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .lens import LensConfig, collapse_depth
from .models import KVCache, LensTranslators, ModelConfig, Params, forward, init_cache

Array = jax.Array


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["tokens", "logp", "logq", "depth", "final_entropy", "length",
                                "prompt_len", "ended", "cache", "n_generated", "n_forward",
                                "n_probed"],
                   meta_fields=[])
@dataclasses.dataclass
class GenState:
    """Per-row generation state; B rows, S slots."""

    tokens: Array  # [B, S] int32
    logp: Array  # [B, S] fp32
    logq: Array  # [B, S] fp32
    depth: Array  # [B, S] int32, -1 where not computed
    final_entropy: Array  # [B, S] fp32
    length: Array  # [B] int32: prompt + completion tokens in the buffer
    prompt_len: Array  # [B] int32
    ended: Array  # [B] bool: the last token is EOS
    cache: KVCache
    n_generated: Array  # [B] int32: tokens sampled
    n_forward: Array  # [B] int32: token positions run through the model (prefill included)
    n_probed: Array  # [B] int32: probed token-layers (K per lensed position)

    @property
    def max_len(self) -> int:
        return self.tokens.shape[1]

    def completion_mask(self, scored: bool = False) -> Array:
        """[B, S] bool: completion slots; `scored=True` also drops a final EOS (DESIGN §3)."""
        pos = jnp.arange(self.max_len)[None]
        mask = (pos >= self.prompt_len[:, None]) & (pos < self.length[:, None])
        if scored:
            mask &= ~(self.ended[:, None] & (pos == self.length[:, None] - 1))
        return mask


@dataclasses.dataclass(frozen=True)
class SamplerSpec:
    """How tokens are drawn (static: part of the compiled program).

    temperature: q = softmax(logits / temperature); 0 means greedy (argmax, log q = 0).
    top_k / top_p: optional truncation of q; log q is then the truncated density.
    lens: LensConfig to record collapse depth per token, or None (no probing).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    eos_ids: tuple[int, ...] = ()
    lens: Optional[LensConfig] = None

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


def proposal_log_density(logits: Array, spec: SamplerSpec) -> Array:
    """log q over the vocabulary, [B, V] fp32, with -inf outside a truncation."""
    z = logits / spec.temperature
    if spec.top_k and spec.top_k < z.shape[-1]:
        kth = jax.lax.top_k(z, spec.top_k)[0][:, -1:]
        z = jnp.where(z >= kth, z, -jnp.inf)
    if spec.top_p < 1.0:
        # Keep the smallest prefix of the sorted distribution whose mass reaches top_p
        # (the token that crosses the threshold is kept), as HF's TopPLogitsWarper.
        order = jnp.argsort(-z, axis=-1)
        sorted_z = jnp.take_along_axis(z, order, -1)
        probs = jax.nn.softmax(sorted_z, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        keep_sorted = mass_before < spec.top_p
        keep = jnp.zeros_like(keep_sorted).at[jnp.arange(z.shape[0])[:, None], order].set(keep_sorted)
        z = jnp.where(keep, z, -jnp.inf)
    return jax.nn.log_softmax(z, axis=-1)


def _is_eos(tokens: Array, eos_ids: tuple[int, ...]) -> Array:
    if not eos_ids:
        return jnp.zeros(tokens.shape, bool)
    return jnp.isin(tokens, jnp.asarray(eos_ids, tokens.dtype))


def _set(buf: Array, idx: Array, value: Array, where: Array) -> Array:
    """buf[b, idx[b]] = value[b] for rows where `where[b]`; buf: [B, S]."""
    rows = jnp.arange(buf.shape[0])
    idx = jnp.clip(idx, 0, buf.shape[1] - 1)
    return buf.at[rows, idx].set(jnp.where(where, value.astype(buf.dtype), buf[rows, idx]))


def decode_step(params: Params, cfg: ModelConfig, st: GenState, active: Array, limit: Array,
                keys: Array, fresh_from: Array, spec: SamplerSpec,
                translators: Optional[LensTranslators] = None) -> tuple[GenState, Array]:
    """One step of every `active` row (see the module docstring); the body of `generate`'s
    loop, also driven directly by loops that restart rows mid-way (mcmc.mh_steps).

    active, limit, fresh_from: [B]; keys: [B] PRNG keys. translators: tuned-lens rows for
    `spec.lens.lsub` (None: the logit lens). Returns (state, active [B]: rows that still
    have tokens to draw after this step).
    """
    B, S = st.tokens.shape
    rows = jnp.arange(B)
    lens_layers = spec.lens.lsub if spec.lens is not None else ()
    n = st.length
    consumed = jnp.take_along_axis(st.tokens, jnp.clip(n - 1, 0, S - 1)[:, None], 1)
    # Inactive rows write their KV to slot S, which the scatter drops.
    pos = jnp.where(active, n - 1, S)[:, None]
    out = forward(params, cfg, consumed, pos, st.cache, lens_layers=lens_layers,
                  lens_chunk=spec.lens.chunk if spec.lens is not None else None,
                  lens_translators=translators if spec.lens is not None else None)
    logits = out.logits[:, 0]  # [B, V] fp32
    logp_all = jax.nn.log_softmax(logits, axis=-1)
    write_stats = active & (n - 1 >= fresh_from)
    h_final = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
    final_entropy = _set(st.final_entropy, n - 1, h_final, write_stats)
    depth = st.depth
    if spec.lens is not None:
        d = collapse_depth(out.lens.entropy[:, :, 0], spec.lens.lsub, cfg.num_layers, spec.lens.tau)
        depth = _set(depth, n - 1, d, write_stats)

    sample = active & (n < limit)
    if spec.temperature == 0.0:
        tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        logq_tok = jnp.zeros((B,), jnp.float32)
    else:
        logq_all = proposal_log_density(logits, spec)
        step_keys = jax.vmap(jax.random.fold_in)(keys, n)
        tok = jax.vmap(jax.random.categorical)(step_keys, logq_all).astype(jnp.int32)
        logq_tok = logq_all[rows, tok]
    logp_tok = logp_all[rows, tok]
    hit_eos = sample & _is_eos(tok, spec.eos_ids)
    new = GenState(
        tokens=_set(st.tokens, n, tok, sample),
        logp=_set(st.logp, n, logp_tok, sample),
        logq=_set(st.logq, n, logq_tok, sample),
        depth=depth, final_entropy=final_entropy,
        length=n + sample.astype(jnp.int32), prompt_len=st.prompt_len,
        ended=st.ended | hit_eos, cache=out.cache,
        n_generated=st.n_generated + sample,
        n_forward=st.n_forward + active,
        n_probed=st.n_probed + active * len(lens_layers),
    )
    return new, sample & ~hit_eos


@functools.partial(jax.jit, static_argnames=("cfg", "spec"))
def generate(params: Params, cfg: ModelConfig, state: GenState, limit: Array, keys: Array,
             spec: SamplerSpec, fresh_from: Optional[Array] = None,
             translators: Optional[LensTranslators] = None) -> GenState:
    """Continue every row from its current length until EOS or `limit` tokens.

    state: a GenState (from `prefill`, a previous `generate`, or a truncated copy of
      one: set `length` to the cut; the cache need not be cleared).
    limit: [B] int32 total-length cap per row (prompt included), <= S.
    keys: [B] PRNG keys. fresh_from: [B] int32 first slot whose statistics may be
      (re)written; defaults to the current lengths. translators: tuned-lens rows for
      `spec.lens.lsub` (None: the logit lens).
    Rows that are already ended or at their limit are left untouched.
    """
    fresh_from = state.length if fresh_from is None else fresh_from
    active0 = ~state.ended & (state.length < limit)

    def body(carry):
        st, active = carry
        return decode_step(params, cfg, st, active, limit, keys, fresh_from, spec, translators)

    state, _ = jax.lax.while_loop(lambda carry: jnp.any(carry[1]), body, (state, active0))
    return state


@functools.partial(jax.jit, static_argnames=("cfg", "max_len", "cache_dtype"))
def prefill(params: Params, cfg: ModelConfig, prompts: Array, prompt_len: Array,
            max_len: int, cache_dtype=jnp.bfloat16) -> GenState:
    """Run the prompts through the model and build a fresh GenState with S = max_len slots.

    prompts: [B, P] int32, right-padded; prompt_len: [B] int32 (>= 1).
    """
    B, P = prompts.shape
    cache = init_cache(cfg, B, max_len, cache_dtype)
    positions = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32)[None], (B, P))
    out = forward(params, cfg, prompts, positions, cache, logits_at=prompt_len - 1)
    tokens = jnp.zeros((B, max_len), jnp.int32).at[:, :P].set(prompts)
    return GenState(
        tokens=tokens, logp=jnp.zeros((B, max_len), jnp.float32),
        logq=jnp.zeros((B, max_len), jnp.float32),
        depth=jnp.full((B, max_len), -1, jnp.int32),
        final_entropy=jnp.zeros((B, max_len), jnp.float32),
        length=prompt_len.astype(jnp.int32), prompt_len=prompt_len.astype(jnp.int32),
        ended=jnp.zeros((B,), bool), cache=out.cache,
        n_generated=jnp.zeros((B,), jnp.int32), n_forward=prompt_len.astype(jnp.int32),
        n_probed=jnp.zeros((B,), jnp.int32),
    )


def pad_prompts(prompts: Sequence[Sequence[int]], multiple: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """Right-pad token lists to a common length rounded up to `multiple` (bucketing keeps
    the number of compiled shapes small). Returns ([B, P] int32, [B] int32 lengths)."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt must have at least one token")
    P = max(len(p) for p in prompts)
    P = -(-P // multiple) * multiple
    out = np.zeros((len(prompts), P), np.int32)
    for i, p in enumerate(prompts):
        out[i, : len(p)] = p
    return out, np.array([len(p) for p in prompts], np.int32)


def _map_rows(fn, *states: GenState) -> GenState:
    """Apply fn(*arrays, axis) to every field, with `axis` the field's row axis."""
    fields = {f.name: fn(*(getattr(s, f.name) for s in states), axis=0)
              for f in dataclasses.fields(GenState) if f.name != "cache"}
    cache = KVCache(k=fn(*(s.cache.k for s in states), axis=1),
                    v=fn(*(s.cache.v for s in states), axis=1))
    return GenState(cache=cache, **fields)


def repeat_rows(state: GenState, n: int) -> GenState:
    """Each row repeated n times consecutively (problems x chains from one prefill)."""
    return _map_rows(lambda x, axis: jnp.repeat(x, n, axis=axis), state)


def select_rows(take_new: Array, new: GenState, old: GenState) -> GenState:
    """Row-wise `where(take_new, new, old)` over every field, caches included."""
    def pick(a, b, axis):
        shape = [1] * a.ndim
        shape[axis] = a.shape[axis]
        return jnp.where(take_new.reshape(shape), a, b)
    return _map_rows(pick, new, old)


def completions(state: GenState) -> list[list[int]]:
    """Completion token ids per row (EOS included when generated)."""
    tokens, start, end = jax.device_get((state.tokens, state.prompt_len, state.length))
    return [tokens[b, start[b]:end[b]].tolist() for b in range(tokens.shape[0])]
