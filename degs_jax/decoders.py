"""The decoders of docs/design.md §4 on token ids, host-driven (`decode`) or as one pure jitted
program (`decode_tokens`). The text API (`sample`) is in `degs_jax.text`.

| method              | what it returns                                               |
| ------------------- | ------------------------------------------------------------- |
| greedy              | argmax decoding                                               |
| temperature         | ancestral sampling at `temperature`                           |
| best_of_n           | N samples from p; the largest log p(x)                        |
| best_of_n_entropy   | the same pool; the lowest mean final-layer entropy            |
| degs_rerank         | the same pool; argmax alpha·log p(x) + beta·D(x) (alpha=0: depth only) |
| power_mcmc          | MH chain for p^alpha (beta = 0, no probing)                   |
| degs_mcmc           | MH chain for p^alpha·exp(beta·D)                              |
| power_smc           | Power-SMC: N particles for p^alpha, drawn by weight (smc.py)  |
| degs_smc            | the same particles for p^alpha·exp(beta·D)                    |
| scalable_power      | Scalable Power Sampling, block form (sps.py)                  |

Methods: frozen values with their typed hyperparameters and defaults (`degs_jax.method`;
the registry of names: `degs_jax.methods`). Rows: prompt i's candidate (pool
member, chain or particle) j is row i·n + j.

Two drivers, same tokens for the same per-prompt keys:
- `decode`: the method's kernel (`Method.init`, `advance` until `done`, `answer`) driven
  from the host in jitted chunks of `advance` calls, the carry donated between them
  (`advance_on_host`: progress bars, Ctrl-C within about a second, early stop); builds
  `Candidate` records, with what the method reports (`Method.run_details`). With
  `slots`, or as `decode_stream`, it batches continuously: a fixed number of prompt slots,
  and when a slot's prompt is done (`Method.prompt_done`) its answer is read from the
  slot's rows alone and the next waiting prompts, prefilled together and `init`-ed, are
  written over the free slots (`rows.take_slots` / `put_slots`, the carry donated: no other
  row's cache is copied, nothing is recompiled; the other rows go on where they were).
  Once no prompt waits and few slots are live, the live ones are gathered into a smaller
  carry (the tail: a step costs what its batch costs, live rows or not). Each prompt
  keeps its own keys and every counter of its phase is per row, so with a
  batch-invariant model a prompt's answer is bitwise the one it gets alone, whatever the
  schedule (tests/test_refill.py); a method with checkpoints (MCMC: a chain after each
  block) also hands out its prompts' snapshots and resumes prompts from them;
- `decode_tokens`: prefill, the kernel (`run_kernel`: `advance` in one `lax.while_loop`
  until `done`, then `answer`) and the choice of the answer in one jitted program, for
  `jit` / `vmap` in user code (e.g. inside an RL rollout step).
Neither driver switches on the method: what differs is the method's (`degs_jax.method`).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from .generation import GenState, completions, pad_prompts, prefill
from .methods import MCMC_METHODS, METHODS, RERANK_METHODS, SMC_METHODS, as_method
from .lens import masked_sum, mean_final_entropy, sequence_depth
from .method import NO_TOKEN, Method, PoolRows, positive_int
from .model_api import CausalLM, params_dtype
from .rows import gather_slots, put_slots, repeat_rows, take_slots, work_totals
from .stops import TokenBytes

Array = jax.Array

__all__ = ["METHODS", "MCMC_METHODS", "RERANK_METHODS", "SMC_METHODS", "Candidate", "Output", "DecodeResult",
           "Decoded", "decode", "decode_stream", "decode_tokens", "candidate_scores", "completion_tokens",
           "pool_rows", "row_keys", "run_kernel", "advance_chunk", "advance_on_host"]


@dataclasses.dataclass
class Candidate:
    """One completion with its scores. `depth` is None when it was not probed."""

    tokens: list[int]
    log_p: float
    depth: Optional[float]
    final_entropy: float
    ended: bool  # True: ended at EOS or a stop string; False: stopped by the token budget
    acceptance: Optional[list[float]] = None  # MCMC: per-block acceptance rate
    # MCMC: per block, the MH decisions that the depth term beta·ΔD decided (accepting
    # with and without it differ for the same u; 0 for power-MCMC). While 0, the chain is
    # the power-MCMC chain of the same key, token for token (`degs_jax.mcmc`'s docstring).
    depth_decisions: Optional[list[int]] = None
    # MCMC: every MH decision, field -> per block run -> per step (`mcmc.MHDecisions`,
    # `mcmc.decision_lists`): log r_0, D(x') - D(x), log u, null move, cut, suffix lengths
    mh_decisions: Optional[dict[str, Any]] = None
    text: Optional[str] = None
    # What ended it (`degs_jax.text.ended_by`, set with `text`): the end token's id (int),
    # the stop string (str), or None (the budget, or not set)
    ended_by: Optional[int | str] = None
    weight: Optional[float] = None  # SMC: normalised final importance weight of the particle
    # The method's own per-candidate statistics (JSON values), by name: what its
    # `RunDetails.candidate_fields` hold beyond the fields above; stored in the records
    # (`degs eval`) under "extras". None: none.
    extras: Optional[dict[str, Any]] = None


@dataclasses.dataclass
class Output:
    """A decoder's answer for one prompt, plus every candidate (pool or chains)."""

    chosen: Candidate
    candidates: list[Candidate]
    # SMC: log_evidence (log Z-hat), ess (per check), resamples, copied_rows;
    # scalable_power: rollouts.
    diagnostics: Optional[dict[str, Any]] = None
    # `decode_stream` (refill): this prompt's work counters (its rows' work totals and the
    # method's counters); None from a fixed batch (`DecodeResult.counters` are the batch's)
    counters: Optional[dict[str, int]] = None
    # `decode_stream`: the fastest seconds per `advance` (MCMC: per decode step of every row)
    # of the stream's chunks so far; the fastest, so that compilation and admissions'
    # prefills are left out. The stream's shape is fixed, so a step costs about the same
    # however many rows are live: the pace of a run's slowest prompt once it runs alone
    # (`degs reproduce --plan`); None from a fixed batch
    advance_seconds: Optional[float] = None


@dataclasses.dataclass
class DecodeResult:
    method: str
    config: Method  # the method value: its resolved hyperparameters
    outputs: list[Output]
    # generated_tokens, forward_tokens, probed_token_layers; SMC also copied_rows (particle rows
    # overwritten by resampling copies), scalable_power also rollouts (rollout rows run)
    counters: dict[str, int]
    seconds: dict[str, float]  # prefill, decode, total (compilation included)

    @property
    def hyperparameters(self) -> dict[str, Any]:
        """Every hyperparameter by name (`config.to_dict()`)."""
        return self.config.to_dict()

    def forward_equivalents(self, num_layers: int) -> float:
        """Token forwards with probing charged K/L of a forward per probed token (docs/design.md §5)."""
        return self.counters["forward_tokens"] + self.counters["probed_token_layers"] / num_layers


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Decoded:
    """`decode_tokens`' result. Rows: prompt i's candidate j is row i·n + j."""

    state: GenState  # every row: tokens, per-token log p / log q / d_t / H_L, counters
    accepted: Array  # [rows, num_blocks] int32 accepted MH steps ([rows, 0] without MCMC)
    ran: Array  # [rows, num_blocks] bool: the chain ran the block
    depth_decided: Array  # [rows, num_blocks] int32 MH decisions beta·ΔD decided (`Candidate.depth_decisions`)
    decisions: Any  # MCMC: `mcmc.MHDecisions` [rows, num_blocks, mh_steps], every MH decision; else None
    log_p: Array  # [rows] log p(x)
    depth: Array  # [rows] D(x) (0 where nothing was probed)
    final_entropy: Array  # [rows] mean final-layer entropy
    chosen: Array  # [prompts] int32: the index j of each prompt's answer


@functools.partial(jax.jit, static_argnames=("num_layers", "batch_invariant"))
def candidate_scores(state: GenState, num_layers: int,
                     batch_invariant: bool = False) -> tuple[Array, Array, Array]:
    """(log p(x), D(x), mean final-layer entropy) of every row, [B] fp32 each, from the
    per-token values stored during generation (a final EOS is not scored: docs/design.md §3).
    batch_invariant: the model's (`CausalLM.batch_invariant`; `lens.masked_sum`). One
    jitted program: `decode` calls it on the host, where its ops run one by one would
    compile each row tile's `lax.map` again on every call."""
    completion = state.completion_mask()
    scored = state.completion_mask(scored=True)
    log_p = masked_sum(state.logp, completion, batch_invariant)
    return (log_p, sequence_depth(state.depth, scored, num_layers),
            mean_final_entropy(state.final_entropy, scored, batch_invariant))


@functools.partial(jax.jit, static_argnames=("width",))
def completion_tokens(state: GenState, width: int) -> Array:
    """[B, width] int32: each row's completion token ids from its first (a final end token
    included, as `completions`), NO_TOKEN past its end (and where a completion were longer
    than `width`, its first `width` tokens)."""
    column = jnp.arange(width)[None]
    slot = jnp.minimum(state.prompt_len[:, None] + column, state.max_len - 1)
    inside = column < (state.length - state.prompt_len)[:, None]
    return jnp.where(inside, jnp.take_along_axis(state.tokens, slot, axis=1), NO_TOKEN)


def pool_rows(model: CausalLM, state: GenState, width: int) -> PoolRows:
    """What a pool rule sees of the final rows `state` (`Method.choose`): their scores
    (`candidate_scores`) and completions (`completion_tokens`, `width`: the method's
    `max_new_tokens`). Traceable; on the host each part is one jitted program."""
    log_p, depth, final_entropy = candidate_scores(state, model.num_layers, model.batch_invariant)
    return PoolRows(log_p=log_p, depth=depth, final_entropy=final_entropy, tokens=completion_tokens(state, width),
                    length=state.length - state.prompt_len, ended=state.ended)


def row_keys(keys: Array, n: int) -> Array:
    """[prompts · n] row keys from one PRNG key per prompt: prompt i's rows use
    split(keys[i], n), so a prompt's samples do not depend on its batch."""
    return jax.vmap(lambda k: jax.random.split(k, n))(keys).reshape(-1)


@functools.partial(jax.jit, static_argnames=("model",))
def run_kernel(model: CausalLM, params: Any, state: GenState, keys: Array, method: Method, settings: Any) -> Any:
    """`method`'s kernel from prefilled rows `state` (`pool_size` consecutive rows per
    prompt) and row keys: `init`, then `advance` in one `lax.while_loop` until `done`.
    Returns the final carry (before `answer`). Traceable (jit, vmap: the loop then runs
    until every instance is done, finished ones unchanged); `state` is not donated.
    settings: `method.plan(model, eos_ids)`."""
    return jax.lax.while_loop(lambda carry: ~method.done(carry, settings),
                              lambda carry: method.advance(model, params, carry, keys, settings),
                              method.init(model, params, state, keys, settings))


@functools.partial(jax.jit, static_argnames=("model", "eos_ids", "token_bytes"))
def decode_tokens(model: CausalLM, params: Any, prompts: Array, prompt_len: Array, keys: Array,
                  config: Method, eos_ids: tuple[int, ...] = (),
                  token_bytes: Optional[TokenBytes] = None) -> Decoded:
    """The decoder `config.method` as one pure jitted program over token ids and keys.

    prompts: [B, P] int32 right-padded, prompt_len: [B] int32 (>= 1; prompt + budget
    within the model's context); keys: [B] PRNG keys, one per prompt (as `decode`'s
    `keys`: same tokens); config: the method value (e.g. `DegsMCMC(mh_steps=4)`): a
    pytree whose numeric hyperparameters (alpha, beta, tau, temperature, top-p, ...) are
    data of the program, so a sweep over them compiles once and `jax.vmap` over them works
    (`jax.vmap(lambda beta: decode_tokens(..., DegsMCMC(beta=beta), ...))(betas)`;
    `degs_jax.traced_fields`), the rest static; eos_ids: static; token_bytes: the
    vocabulary's bytes (`stops.token_bytes(tokenizer)`, static), needed when
    `config.stop` has stop strings. The buffer holds P + the method's budget slots.
    Prefill, the method's kernel (one `lax.while_loop` of its `advance`: decode steps,
    SMC ESS intervals or SPS blocks, until `done`) and the answer's choice
    run inside; wrap it in your own `jax.jit` or `jax.vmap` (e.g. over a leading
    axis of prompts and keys; under vmap the loop runs until every instance is done,
    finished ones unchanged).
    """
    settings = config.plan(model, eos_ids, token_bytes)
    n = config.pool_size
    cache_dtype = config.cache_dtype or params_dtype(params)
    max_len = prompts.shape[1] + config.max_new_tokens
    state = prefill(model, params, prompts, prompt_len, max_len, cache_dtype, bool(config.stop))
    state = repeat_rows(state, n)
    keys = row_keys(keys, n)
    answer = config.answer(model, params, run_kernel(model, params, state, keys, config, settings), keys, settings)
    state = answer.state
    if answer.accepted is None:
        accepted = depth_decided = jnp.zeros((state.length.shape[0], 0), jnp.int32)
        ran = jnp.zeros((state.length.shape[0], 0), bool)
    else:
        accepted, depth_decided, ran = answer.accepted, answer.depth_decided, answer.ran
    rows = pool_rows(model, state, config.max_new_tokens)
    chosen = config.choose(rows) if answer.chosen is None else answer.chosen
    log_p, depth, final_entropy = rows.log_p, rows.depth, rows.final_entropy
    return Decoded(state=state, accepted=accepted, ran=ran, depth_decided=depth_decided,
                   decisions=answer.decisions, log_p=log_p, depth=depth, final_entropy=final_entropy, chosen=chosen)


# The host driver calls the method's `advance` in jitted chunks of an adaptive number of
# advances (decode steps, SMC ESS intervals, SPS blocks), each chunk aiming
# at CHUNK_SECONDS of device time: short enough that Ctrl-C (delivered when a call
# returns) and the progress bar respond within about a second, long enough that the
# per-call host round trip is negligible. The first chunk is one advance (an SPS block
# may take seconds); the count doubles while calls are fast.
CHUNK_SECONDS = 0.5
FIRST_CHUNK_ADVANCES = 1
MAX_CHUNK_ADVANCES = 1024


@functools.partial(jax.jit, static_argnames=("model",), donate_argnames=("carry",))
def advance_chunk(model: CausalLM, params: Any, carry: Any, keys: Array, max_advances: Array,
                  method: Method, settings: Any, watch: Optional[Array] = None,
                  admit_at: Optional[Array] = None) -> tuple[Any, Array, Array, Array]:
    """At most `max_advances` (int32 scalar, traced: any chunk size runs the same compiled
    program) calls of `method.advance`, stopping early at `method.done`, in one
    `lax.while_loop`: chained calls run `decode_tokens`' loop, advance for advance.
    watch: optional [prompts] bool, the refill's slots that hold an unfinished prompt;
    then also stop as soon as `admit_at` (int32 scalar, traced) of them are done (the
    refill's admission: `decode_stream`). `carry` is donated (do not use it afterwards,
    nor pass arrays that belong to it as other arguments). Returns (carry, prompt_done:
    [prompts] bool `method.prompt_done`, progress: `method.progress`, advances: int32, the
    calls of `advance` run)."""
    def more(loop):
        carry, count = loop
        prompt_done = method.prompt_done(carry, settings)
        stop = jnp.all(prompt_done)
        if watch is not None:
            stop |= jnp.sum(prompt_done & watch) >= admit_at
        return (count < max_advances) & ~stop

    def body(loop):
        carry, count = loop
        return method.advance(model, params, carry, keys, settings), count + 1

    carry, count = jax.lax.while_loop(more, body, (carry, jnp.int32(0)))
    return carry, method.prompt_done(carry, settings), method.progress(carry), count


def next_chunk(advances: int, elapsed: float) -> int:
    """The next chunk's advances after one of `advances` took `elapsed` seconds: doubled
    while calls are fast, halved when slow (aiming at CHUNK_SECONDS)."""
    if elapsed < CHUNK_SECONDS / 2:
        return min(2 * advances, MAX_CHUNK_ADVANCES)
    if elapsed > 2 * CHUNK_SECONDS:
        return max(advances // 2, 1)
    return advances


def advance_on_host(model: CausalLM, params: Any, carry: Any, keys: Array, method: Method, settings: Any,
                    on_progress: Optional[Callable[[int], Any]] = None) -> Any:
    """`method.advance` until `method.done`, from the host in `advance_chunk` calls (the
    tokens of `decode_tokens`' loop, bit for bit), each sized to take about
    CHUNK_SECONDS. Per call the host reads [prompts] done flags and the progress in one
    transfer.
    `carry` is donated. on_progress(units done): called after each call."""
    advances = FIRST_CHUNK_ADVANCES
    while True:
        started = time.perf_counter()
        carry, prompt_done, progress, _ = advance_chunk(model, params, carry, keys, jnp.int32(advances), method,
                                                        settings)
        prompt_done, progress = jax.device_get((prompt_done, progress))
        if on_progress is not None:
            on_progress(int(progress))
        if prompt_done.all():
            return carry
        advances = next_chunk(advances, time.perf_counter() - started)


# The tail (`decode_stream`): once no prompt waits and at most this fraction of the slots
# hold an unfinished prompt, the live slots are gathered into a carry of the next power of
# two of slots (their rows and caches copied once; the done slots' dropped) and the stream
# goes on with it. A decode step costs what its batch costs, live or not: measured on an H200 at 1.5B
# with drafted proposals (k = 4), 28.9 ms per MCMC step with 256 slots against 2.2 ms with
# 2 (docs/benchmarks.md), so the last chains of a benchmark, its critical path, otherwise
# run at the full batch's price. Each new slot count compiles the method's programs once
# (sizes are powers of two, so at most log2(slots) of them).
TAIL_FRACTION = 1 / 4


def decode(model: CausalLM, params: Any, prompts: Sequence[Sequence[int]],
           method: str | Method, key: Optional[Array] = None, *,
           keys: Optional[Array] = None, eos_ids: Sequence[int], progress: bool = False,
           token_bytes: Optional[TokenBytes] = None, slots: Optional[int] = None,
           tail_fraction: float = TAIL_FRACTION, **hyperparameters) -> DecodeResult:
    """Run a decoder on token-id prompts, returning to the host between chunks of the
    method's work (`advance_on_host`: progress bars, Ctrl-C, early stop).

    model: a `CausalLM` (e.g. `TransformerLM(cfg)`); params: its parameters.
    method: a method name (then `hyperparameters` override its defaults, e.g.
      `decode(..., "degs_mcmc", key, eos_ids=eos, mh_steps=4)`) or a hyperparameter
      dataclass (`DegsMCMC(mh_steps=4)`, no keywords).
    Randomness: with one `key`, row r of the batch (prompt i, candidate or chain j,
    r = i·n + j) uses `split(key, rows)[r]`. With `keys` ([len(prompts)] PRNG keys, one
    per prompt), prompt i's rows use `split(keys[i], n)`, so each prompt's samples do not
    depend on which prompts share its batch (a single prompt decodes identically either
    way), and `decode_tokens` gives the same tokens.
    token_bytes: the vocabulary's bytes (`stops.token_bytes(tokenizer)`), needed when the
      method has stop strings (`stop`; a candidate's tokens then end with the token that
      completes one; `degs_jax.text.sample` also cuts its text there).
    slots: decode through this many prompt slots, refilling each with the next waiting
      prompt as soon as its prompt is done (`decode_stream`; needs `keys`); outputs in
      prompt order, each with its own `counters`. None: one fixed batch of every prompt.
    tail_fraction: with slots, the share of live slots at which the stream's tail goes on
      in a smaller carry (`decode_stream`; 0: never).
    """
    config = as_method(method, hyperparameters)
    if slots is not None:
        if keys is None:
            raise ValueError("decoding with slots (refill) needs keys, one per prompt (a prompt's draws must "
                             "not depend on its slot)")
        return _collect(decode_stream(model, params, prompts, config, keys=keys, eos_ids=eos_ids, slots=slots,
                                      progress=progress, token_bytes=token_bytes, tail_fraction=tail_fraction),
                        config)
    settings = config.plan(model, eos_ids, token_bytes)
    n, max_new = config.pool_size, config.max_new_tokens
    tokens, lengths = _checked_prompts(model, config, prompts, key, keys)
    cache_dtype = config.cache_dtype or params_dtype(params)

    t0 = time.perf_counter()
    state = prefill(model, params, jnp.asarray(tokens), jnp.asarray(lengths),
                    tokens.shape[1] + max_new, cache_dtype, bool(config.stop))
    if n > 1:  # one chain per prompt: no copy. A copied cache leaves a hole of its size: at
        # the 7B shape, 128 rows, the MCMC block's 24.6 GiB temporary fit in neither that
        # hole nor the rest of an 80 GB H100 (docs/benchmarks.md, runs 37-39)
        state = repeat_rows(state, n)
    jax.block_until_ready(state.length)
    t1 = time.perf_counter()
    rows = state.length.shape[0]
    keys = jax.random.split(key, rows) if keys is None else row_keys(keys, n)
    bar = tqdm(total=config.progress_total(settings), desc=config.method, unit=config.progress_unit,
               disable=not progress)
    carry = advance_on_host(model, params, config.init(model, params, state, keys, settings), keys, config,
                            settings, lambda units: bar.update(units - bar.n))
    if bar.n < bar.total:  # (a disabled bar counts nothing and shows nothing)
        bar.set_postfix_str("every row ended")
    bar.close()
    details = config.run_details(model, carry, keys, settings)
    answer = config.answer(model, params, carry, keys, settings)  # (may consume the carry)
    state = answer.state
    jax.block_until_ready(state.length)
    t2 = time.perf_counter()
    outputs = _outputs(model, config, state, answer, details)
    return DecodeResult(method=config.method, config=config, outputs=outputs,
                        counters={**work_totals(state), **details.counters},
                        seconds=dict(prefill=t1 - t0, decode=t2 - t1, total=t2 - t0))


def _checked_prompts(model: CausalLM, config: Method, prompts: Sequence[Sequence[int]], key: Optional[Array],
                     keys: Optional[Array]):
    """The prompts right-padded (`pad_prompts`), after the checks of `decode`'s arguments."""
    tokens, lengths = pad_prompts(prompts)
    longest, max_new = int(lengths.max()), config.max_new_tokens
    if longest + max_new > model.max_context:
        raise ValueError(f"prompt of {longest} tokens + {max_new} new tokens exceeds the model's "
                         f"context of {model.max_context} tokens")
    if (key is None) == (keys is None):
        raise ValueError("pass exactly one of key (one PRNG key) or keys (one per prompt)")
    if keys is not None and keys.shape != (len(prompts),):
        raise ValueError(f"keys must hold one key per prompt ({len(prompts)}), got shape {keys.shape}")
    return tokens, lengths


def _outputs(model: CausalLM, config: Method, state: GenState, answer: Any, details: Any) -> list[Output]:
    """Every prompt's `Output` from the final rows of its run (`answer`: the method's
    `Answer`, `details`: its `RunDetails`), prompt i's rows i·n .. i·n + n - 1."""
    n = config.pool_size
    if answer.chosen is None:  # the method's rule on the rows
        rows = pool_rows(model, state, config.max_new_tokens)
        log_p, depth, final_entropy, chosen = rows.log_p, rows.depth, rows.final_entropy, config.choose(rows)
    else:  # drawn by the method (SMC)
        log_p, depth, final_entropy = candidate_scores(state, model.num_layers, model.batch_invariant)
        chosen = answer.chosen
    ended, log_p, depth, final_entropy, chosen = jax.device_get(
        (state.ended, log_p, depth, final_entropy, chosen))
    pool = [Candidate(tokens=tokens, log_p=float(log_p[r]),
                      depth=float(depth[r]) if config.probed else None,
                      final_entropy=float(final_entropy[r]), ended=bool(ended[r]),
                      **_method_fields(details.candidate_fields, r))
            for r, tokens in enumerate(completions(state))]
    return [Output(chosen=pool[i * n + int(chosen[i])], candidates=pool[i * n:(i + 1) * n],
                   diagnostics=None if details.diagnostics is None else details.diagnostics[i])
            for i in range(len(chosen))]


# What a method's `RunDetails.candidate_fields` may set directly (the rest become `extras`).
_METHOD_CANDIDATE_FIELDS = frozenset(f.name for f in dataclasses.fields(Candidate)) - {
    "tokens", "log_p", "depth", "final_entropy", "ended", "text", "ended_by", "extras"}


def _method_fields(candidate_fields: Optional[list[dict[str, Any]]], row: int) -> dict[str, Any]:
    """Row `row`'s `Candidate` keyword arguments from a method's `candidate_fields`: the
    Candidate fields it names, and every other name under `extras`."""
    if candidate_fields is None:
        return {}
    fields = {k: v for k, v in candidate_fields[row].items() if k in _METHOD_CANDIDATE_FIELDS}
    extras = {k: v for k, v in candidate_fields[row].items() if k not in _METHOD_CANDIDATE_FIELDS}
    return {**fields, **({"extras": extras} if extras else {})}


def _fresh_carry(model: CausalLM, params: Any, config: Method, settings: Any, prompts: Sequence[Sequence[int]],
                 keys: Array, width: int, max_len: int,
                 saved: Sequence[Optional[Mapping[str, np.ndarray]]] = ()) -> tuple[Any, Array]:
    """(carry, row keys) of prompts freshly prefilled together into buffers of `max_len`
    slots and `init`-ed: the refill's first batch, and each admission; a prompt with a
    snapshot (`saved[i]`, from `Method.checkpoint`) is then resumed from it
    (`Method.resume`). Prompts are right-padded to `width` (the run's longest prompt,
    bucketed), so one prefill program serves every admission of the same number of
    prompts whatever their lengths."""
    tokens, lengths = pad_prompts(prompts)
    tokens = np.pad(tokens, ((0, 0), (0, width - tokens.shape[1])))
    cache_dtype = config.cache_dtype or params_dtype(params)
    state = prefill(model, params, jnp.asarray(tokens), jnp.asarray(lengths), max_len, cache_dtype,
                    bool(config.stop))
    if config.pool_size > 1:
        state = repeat_rows(state, config.pool_size)
    row_key = row_keys(keys, config.pool_size)
    carry = config.init(model, params, state, row_key, settings)
    if any(snapshot is not None for snapshot in saved):
        carry = config.resume(model, params, carry, row_key, settings, saved)
    return carry, row_key


# Admission (`decode_stream`): a chunk of the method's work stops early once this fraction
# of the slots (at least one) is free while prompts wait; after every chunk the waiting
# prompts are admitted into every free slot together, prefilled in one call whose prompt
# count is bucketed to a power of two (few compiled prefills). A free slot therefore idles
# for at most one chunk (about CHUNK_SECONDS), and a run pays one prefill call per
# admission rather than per prompt.
ADMIT_FRACTION = 1 / 8


def admission_size(count: int, slots: int) -> int:
    """The next power of two from `count`, at most `slots`: the prompts prefilled by an
    admission into `count` free slots, and the slots of a stream's tail for `count` live
    prompts (few compiled shapes either way)."""
    return min(1 << (count - 1).bit_length(), slots)


def _stop_at(watch: np.ndarray, prompts_wait: bool, admit_at: int, tail_fraction: float) -> int:
    """The done slots among `watch` at which a stream's chunk stops: `admit_at` while prompts
    wait (to admit them); then as many as bring the live slots to the tail's share, if that
    gathers them into fewer slots; else none (more than the slots: a done slot is read out
    after the chunk)."""
    if prompts_wait:
        return admit_at
    live, slots = int(watch.sum()), len(watch)
    done = live - int(tail_fraction * slots)  # done slots that leave tail_fraction of the slots live
    if done >= 1 and admission_size(live - done, slots) < slots:
        return done
    return slots + 1


def decode_stream(model: CausalLM, params: Any, prompts: Sequence[Sequence[int]], method: str | Method, *,
                  keys: Array, eos_ids: Sequence[int], slots: int, progress: bool = False,
                  token_bytes: Optional[TokenBytes] = None,
                  resume: Optional[Mapping[int, Mapping[str, np.ndarray]]] = None,
                  on_checkpoint: Optional[Callable[[int, dict[str, np.ndarray]], Any]] = None,
                  tail_fraction: float = TAIL_FRACTION, **hyperparameters) -> Iterator[tuple[int, Output]]:
    """Continuous batching: decode `prompts` through `slots` prompt slots (each of the
    method's `pool_size` rows), yielding (prompt index, Output) as each prompt finishes,
    in the order they finish; the generator's return value is the seconds spent
    (prefill: the first batch's; decode: the rest, admissions' prefills included; total)
    and `advances`, the method's `advance` calls run (MCMC: decode steps).

    The first `slots` prompts are prefilled together; then the method's `advance` runs in
    chunks (`advance_chunk`, each aiming at CHUNK_SECONDS) that also stop once
    ADMIT_FRACTION of the slots are done (`Method.prompt_done`) while prompts wait. Each
    done slot's rows are read out alone (`rows.take_slots`: its answer, `Method.run_details`
    and scores come from its rows only), and the waiting prompts, prefilled together and
    `init`-ed, overwrite the free slots in place (`rows.put_slots`, the carry donated; one
    compiled program for every choice of slots). The other slots' rows go on where they
    were: with a method whose rows are at their own phase (MCMC: each row at its own block
    and MH step, `mcmc.chain_step`), no prompt waits for another. Once every prompt is
    admitted and at most `tail_fraction` of the slots are live (0: never), the live slots
    are gathered into a carry of `admission_size` slots (`rows.gather_slots`, the done
    slots as its padding; the old carry freed leaf by leaf, so memory does not rise by the
    new one) and the stream goes on with it: the tail's steps cost a small batch's, at one
    compilation per new slot count. Buffers hold the longest prompt of the whole run (padded as `pad_prompts` does) plus the method's budget, so
    every prompt fits every slot. keys: [len(prompts)] PRNG keys, one per prompt (a
    prompt's rows use `split(keys[i], n)` whatever its slot: with a batch-invariant model
    its Output is bitwise the one `decode` gives it alone). Each Output carries its own
    `counters`. progress: a bar of finished prompts. token_bytes: as `decode`'s (stop strings).

    Checkpoints, for methods that have them (`Method.checkpoint_versions`; MCMC: a chain's
    state after each block): after every chunk, on_checkpoint(prompt index, snapshot) is
    called for each unfinished prompt whose rows' snapshot was renewed (`Method.checkpoint`:
    named host arrays, to store); resume: {prompt index: snapshot}, prompts that go on from
    a stored snapshot rather than from the start (`Method.resume`).
    """
    config = as_method(method, hyperparameters)
    positive_int("slots", slots)
    if not 0 <= tail_fraction <= 1:
        raise ValueError(f"tail_fraction must be in [0, 1] (the share of live slots at which the tail is "
                         f"gathered into a smaller carry; 0: never), got {tail_fraction}")
    settings = config.plan(model, eos_ids, token_bytes)
    n = config.pool_size
    tokens, _ = _checked_prompts(model, config, prompts, None, keys)
    width = tokens.shape[1]
    max_len = width + config.max_new_tokens
    slots = min(slots, len(prompts))
    admit_at = max(1, round(ADMIT_FRACTION * slots))
    resume = dict(resume or {})

    def fresh(indices: Sequence[int]) -> tuple[Any, Array]:
        return _fresh_carry(model, params, config, settings, [prompts[i] for i in indices],
                            keys[np.asarray(indices)], width, max_len, [resume.get(i) for i in indices])

    t0 = time.perf_counter()
    carry, row_key = fresh(list(range(slots)))
    jax.block_until_ready(row_key)
    t1 = time.perf_counter()
    holding: list[Optional[int]] = list(range(slots))  # the prompt each slot decodes (None: none left)
    waiting = slots  # the next prompt to admit
    versions = config.checkpoint_versions(carry)
    checkpointing = on_checkpoint is not None and versions is not None
    saved_versions = np.asarray(jax.device_get(versions)) if checkpointing else None
    bar = tqdm(total=len(prompts), desc=config.method, unit="prompt", disable=not progress)
    advances, total_advances = FIRST_CHUNK_ADVANCES, 0
    fastest = None  # seconds per advance of the fastest chunk so far
    while any(h is not None for h in holding):
        watch = np.array([h is not None for h in holding])
        started = time.perf_counter()
        carry, prompt_done, _, ran = advance_chunk(model, params, carry, row_key, jnp.int32(advances), config,
                                                   settings, jnp.asarray(watch),
                                                   jnp.int32(_stop_at(watch, waiting < len(prompts), admit_at,
                                                                      tail_fraction)))
        prompt_done, ran, versions = jax.device_get(
            (prompt_done, ran, config.checkpoint_versions(carry) if checkpointing else None))
        prompt_done = np.asarray(prompt_done)
        total_advances += int(ran)
        elapsed = time.perf_counter() - started
        if ran:
            fastest = elapsed / int(ran) if fastest is None else min(fastest, elapsed / int(ran))
        advances = next_chunk(advances, elapsed)
        if checkpointing:
            for slot in np.flatnonzero(watch & ~prompt_done):
                rows = slice(slot * n, (slot + 1) * n)
                if (versions[rows] != saved_versions[rows]).any():
                    on_checkpoint(holding[slot], config.checkpoint(carry, rows))
            saved_versions = np.asarray(versions)
        free = np.flatnonzero(prompt_done & watch)
        for slot in free:
            index, rows = holding[slot], slice(slot * n, (slot + 1) * n)
            sub_keys = row_key[rows]
            sub = take_slots(carry, jnp.asarray([slot], jnp.int32), n)
            details = config.run_details(model, sub, sub_keys, settings)
            answer = config.answer(model, params, sub, sub_keys, settings)
            (output,) = _outputs(model, config, answer.state, answer, details)
            output.counters = {**work_totals(answer.state), **details.counters}
            output.advance_seconds = fastest
            holding[slot] = None
            bar.update(1)
            yield index, output
        admitted = list(range(waiting, min(waiting + len(free), len(prompts))))
        if admitted:
            size = admission_size(len(admitted), slots)
            padded = admitted + admitted[-1:] * (size - len(admitted))  # (the padding writes nothing)
            new, new_keys = fresh(padded)
            targets = np.full(size, slots, np.int32)  # past the last slot: dropped
            targets[:len(admitted)] = free[:len(admitted)]
            carry = put_slots(carry, jnp.asarray(targets), new, n)
            target_rows = (targets[:, None] * n + np.arange(n)[None]).reshape(-1)
            row_key = row_key.at[jnp.asarray(target_rows)].set(new_keys, mode="drop")
            for slot, index in zip(free, admitted):
                holding[slot] = index
            waiting += len(admitted)
            if checkpointing:  # (a resumed prompt's snapshot is stored already)
                saved_versions = np.asarray(jax.device_get(config.checkpoint_versions(carry)))
        live = [slot for slot, index in enumerate(holding) if index is not None]
        if waiting == len(prompts) and live and len(live) <= tail_fraction * len(holding):
            size = admission_size(len(live), len(holding))  # (the next power of two)
            if size < len(holding):  # padded with done slots: they do no work
                kept = live + [slot for slot, index in enumerate(holding) if index is None][:size - len(live)]
                kept_rows = (np.asarray(kept)[:, None] * n + np.arange(n)[None]).reshape(-1)
                row_key = row_key[jnp.asarray(kept_rows)]
                carry = gather_slots(carry, np.asarray(kept, np.int32), n)  # (the old carry freed as it goes)
                holding = [holding[slot] for slot in kept]
                if checkpointing:
                    saved_versions = saved_versions[kept_rows]
    bar.close()
    t2 = time.perf_counter()
    return dict(prefill=t1 - t0, decode=t2 - t1, total=t2 - t0, advances=total_advances)


def _collect(stream: Iterator[tuple[int, Output]], config: Method) -> DecodeResult:
    """`decode`'s result from `decode_stream`: outputs in prompt order, counters summed."""
    outputs: dict[int, Output] = {}
    while True:
        try:
            index, output = next(stream)
        except StopIteration as finished:
            seconds = {name: finished.value[name] for name in ("prefill", "decode", "total")}
            break
        outputs[index] = output
    counters: dict[str, int] = {}
    for output in outputs.values():
        for name, value in output.counters.items():
            counters[name] = counters.get(name, 0) + value
    return DecodeResult(method=config.method, config=config, outputs=[outputs[i] for i in sorted(outputs)],
                        counters=counters, seconds=seconds)
