"""Row operations on batched state (take, repeat, select, copy rows) and per-row PRNG keys.

A state dataclass such as `generation.GenState` holds B rows: every data field has a row
axis, and a field says where on its declaration (`dataclasses.field` metadata), so these
operations need no list of field names:

- a data field without row metadata has its rows on axis 0 of every leaf;
- `rows_at(axis_field)`: the rows of every leaf lie on the axis held by the static field
  `axis_field` (the model's cache: `cache_row_axis`, model_api contract);
- `work_counter()`: a [B] count of work done by the row (token forwards, samples, probed
  token-layers). Work is charged to the row slot that did it, so copying another row's
  contents into a slot (SMC resampling, an MCMC decision) leaves the slot's counters;
- `per_prompt()`: a field of a pool method's carry whose leaves have one entry per prompt
  (rows i·n .. i·n + n - 1 share entry i) on axis 0 (SMC's evidence, ESS and counts);
- `metadata=dict(static=True)`: not pytree data, no rows. This is the convention of
  `jax.tree_util.register_dataclass`, which reads it when given no field lists: every
  state and output dataclass of the package is registered that way, so which fields are
  data and which are static is declared on the fields themselves.

A method's carry (the drivers' loop state) is a dataclass of such fields, some of them
states themselves: `take_slots` and `put_slots` read and overwrite the n rows (and one
per-prompt entry) of prompt slots of a whole carry, recursing into nested states
(the host driver's refill, `decoders.decode_stream`); `gather_slots` moves a carry's live
slots into a smaller one, freeing the old one leaf by leaf (the stream's tail).

Every operation is row-wise data movement (gathers, selects, scatters): no arithmetic, so
a row's values are bitwise those of the row it came from.

Per-row keys: `fold_in_rows(keys, *tags)` is fold_in(..fold_in(keys[b], tags[0]).., tags[-1])
for every row b (a tag is a scalar or one value per row): counter-based, so a row's draws
depend only on its key and the tags, never on the batch it runs in.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp

Array = jax.Array

# Field metadata keys. STATIC is jax.tree_util.register_dataclass's own.
STATIC = "static"
ROWS_AT = "rows_at"
WORK_COUNTER = "work_counter"
PER_PROMPT = "per_prompt"

# Rows moved per gather/scatter by `copy_rows` and `settle_rows`.
ROWS_PER_COPY = 8


def rows_at(axis_field: str, **kwargs) -> Any:
    """A pytree field whose every leaf has its rows at the axis held by static field `axis_field`."""
    return dataclasses.field(metadata={ROWS_AT: axis_field}, **kwargs)


def work_counter(total_name: str, **kwargs) -> Any:
    """A [B] int32 count of the work a row slot did (kept by the slot when rows are copied
    in); `total_name` names its sum over rows in run records (`work_totals`)."""
    return dataclasses.field(metadata={WORK_COUNTER: total_name}, **kwargs)


def per_prompt(**kwargs) -> Any:
    """A pytree field whose every leaf has one entry per prompt on axis 0 (a pool method's
    rows i·n .. i·n + n - 1 are prompt i)."""
    return dataclasses.field(metadata={PER_PROMPT: True}, **kwargs)


def _row_fields(state) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(state) if not f.metadata.get(STATIC, False)]


def work_counter_names(state) -> tuple[str, ...]:
    """The work-counter fields of a state (class or instance), in declaration order."""
    return tuple(f.name for f in dataclasses.fields(state) if WORK_COUNTER in f.metadata)


def work_counters(state) -> dict[str, Array]:
    """The work counters of a state by field name ([B] each), in declaration order."""
    return {name: getattr(state, name) for name in work_counter_names(state)}


def stacked_work(state) -> Array:
    """[C, B]: the C work counters of every row, in `work_counter_names` order."""
    return jnp.stack(list(work_counters(state).values()))


def work_totals(state) -> dict[str, int]:
    """Every work counter summed over the rows, on the host, by its `total_name`."""
    fields = [f for f in dataclasses.fields(state) if WORK_COUNTER in f.metadata]
    counts = jax.device_get([getattr(state, f.name) for f in fields])
    return {f.metadata[WORK_COUNTER]: int(count.sum()) for f, count in zip(fields, counts)}


def with_stacked_work(state, work: Array):
    """`state` with its work counters set from a [C, B] `stacked_work` array."""
    return dataclasses.replace(state, **dict(zip(work_counter_names(state), work)))


def map_rows(fn: Callable[..., Array], *states, caches: bool = True, work_counters: bool = True):
    """fn(*leaves, axis=row axis) on every leaf of every data field of `states` (same class,
    same row layout); static fields come from the first state. caches=False (fields with
    `rows_at`) or work_counters=False leave those fields of the first state as they are."""
    first = states[0]
    new = {}
    for f in _row_fields(first):
        if (not caches and ROWS_AT in f.metadata) or (not work_counters and WORK_COUNTER in f.metadata):
            continue
        axis = getattr(first, f.metadata[ROWS_AT]) if ROWS_AT in f.metadata else 0
        new[f.name] = jax.tree.map(lambda *leaves: fn(*leaves, axis=axis),
                                   *(getattr(s, f.name) for s in states))
    return dataclasses.replace(first, **new)


def take_rows(state, index: Array):
    """The rows `index` ([R] int, in range) of every field, caches included."""
    return map_rows(lambda a, axis: jnp.take(a, index, axis=axis), state)


@functools.partial(jax.jit, static_argnames=("n",))
def repeat_rows(state, n: int):
    """Each row repeated n times consecutively (problems x chains from one prefill).
    Jitted: run op by op, `jnp.repeat` materialises its broadcast and then the reshaped
    copy, so the repeated cache briefly existed twice (measured on an H100 at the 7B
    shape, 160 rows: a peak 15 GiB above the batch sizer's estimate, bench/batch_auto.py)."""
    return map_rows(lambda a, axis: jnp.repeat(a, n, axis=axis), state)


def _select(take_new: Array, new: Array, old: Array, axis: int) -> Array:
    shape = [1] * new.ndim
    shape[axis] = new.shape[axis]
    return jnp.where(take_new.reshape(shape), new, old)


def select_rows(take_new: Array, new, old):
    """Row-wise `where(take_new, new, old)` over every field, caches included."""
    return map_rows(lambda a, b, axis: _select(take_new, a, b, axis), new, old)


def _cache_fields(state) -> list[dataclasses.Field]:
    return [f for f in _row_fields(state) if ROWS_AT in f.metadata]


def _for_row_chunks(rows: Array, body: Callable[[Array, Any], Any], init: Any) -> Any:
    """body(index [R], carry) over the rows where `rows` ([B] bool), R = ROWS_PER_COPY at a
    time; index entries past the last such row are B (out of range: gathers clip them and
    scatters with mode="drop" drop them). Only the chosen rows move: a whole-cache select
    would move the whole cache; with the batch split over a mesh, XLA partitions the
    gathers and scatters per device (a dynamic slice of the split batch axis would
    all-gather the cache)."""
    B = rows.shape[0]
    R = min(B, ROWS_PER_COPY)
    order = jnp.nonzero(rows, size=B + R, fill_value=B)[0]

    def chunk(i, carry):
        return body(jax.lax.dynamic_slice_in_dim(order, i * R, R), carry)

    return jax.lax.fori_loop(0, (jnp.sum(rows) + R - 1) // R, chunk, init)


def copy_cache_rows(cache: Any, source: Array, copy: Array, axis: int) -> Any:
    """Row r := row source[r] (along `axis` of every leaf) for every r with copy[r], in place,
    ROWS_PER_COPY rows per gather/scatter. Needs no source row to be a destination."""
    B = copy.shape[0]
    leading = (slice(None),) * axis

    def move(dst, c):
        src = source[jnp.minimum(dst, B - 1)]
        return jax.tree.map(lambda a: a.at[leading + (dst,)].set(jnp.take(a, src, axis=axis), mode="drop"), c)

    return _for_row_chunks(copy, move, cache)


def copy_rows(state, source: Array, copy: Array):
    """Row r := row source[r] for every r with copy[r] (SMC resampling); the row slots keep
    their work counters. Caches move only the copied rows (`copy_cache_rows`), the other
    fields are gathered whole. Needs no source row to be a destination."""
    caches = {f.name: copy_cache_rows(getattr(state, f.name), source, copy,
                                      getattr(state, f.metadata[ROWS_AT]))
              for f in _cache_fields(state)}
    state = map_rows(lambda a, axis: a[source], state, caches=False, work_counters=False)
    return dataclasses.replace(state, **caches)


def _settle_cache_rows(current: Any, proposal: Any, decided: Array, take_proposal: Array, axis: int):
    B = decided.shape[0]
    leading = (slice(None),) * axis

    def settle(idx, caches):
        cur, prop = caches
        take = take_proposal[jnp.minimum(idx, B - 1)]
        cur_leaves, treedef = jax.tree.flatten(cur)
        new_cur, new_prop = [], []
        for c, p in zip(cur_leaves, treedef.flatten_up_to(prop)):
            shape = [1] * c.ndim
            shape[axis] = idx.shape[0]
            chosen = jnp.where(take.reshape(shape), jnp.take(p, idx, axis=axis, mode="clip"),
                               jnp.take(c, idx, axis=axis, mode="clip"))
            new_cur.append(c.at[leading + (idx,)].set(chosen, mode="drop"))
            new_prop.append(p.at[leading + (idx,)].set(chosen, mode="drop"))
        return treedef.unflatten(new_cur), treedef.unflatten(new_prop)

    return _for_row_chunks(decided, settle, (current, proposal))


def settle_rows(current, proposal, decided: Array, take_proposal: Array):
    """An MCMC decision: for every row with decided[r], both states' row r := the proposal's
    if take_proposal[r] else the current one's (take_proposal implies decided); undecided
    rows are left as they are. The proposal keeps its work counters (work on rejected
    proposals counts); the current state's follow its rows. Caches move only the decided
    rows, ROWS_PER_COPY at a time. Returns (current, proposal)."""
    settled = {f.name: _settle_cache_rows(getattr(current, f.name), getattr(proposal, f.name), decided,
                                          take_proposal, getattr(current, f.metadata[ROWS_AT]))
               for f in _cache_fields(current)}
    select = lambda take: (lambda a, b, axis: _select(take, a, b, axis))
    new_current = map_rows(select(take_proposal), proposal, current, caches=False)
    new_proposal = map_rows(select(decided), new_current, proposal, caches=False)
    counters = work_counters(proposal)
    return (dataclasses.replace(new_current, **{name: pair[0] for name, pair in settled.items()}),
            dataclasses.replace(new_proposal, **counters, **{name: pair[1] for name, pair in settled.items()}))


def _map_slot(fn: Callable[..., Array], *carries):
    """fn(*leaves, axis, per_prompt) over every leaf of every data field of `carries`
    (same class), recursing into fields that are dataclasses themselves (states)."""
    first = carries[0]
    new = {}
    for f in _row_fields(first):
        values = [getattr(c, f.name) for c in carries]
        if ROWS_AT not in f.metadata and dataclasses.is_dataclass(values[0]) and not isinstance(values[0], type):
            new[f.name] = _map_slot(fn, *values)  # a nested state (a cache is one field: `rows_at`)
            continue
        axis = getattr(first, f.metadata[ROWS_AT]) if ROWS_AT in f.metadata else 0
        prompt = bool(f.metadata.get(PER_PROMPT, False))

        def leaf_fn(*leaves, axis=axis, prompt=prompt, name=f.name):
            if leaves[0].ndim <= axis:
                raise ValueError(f"{type(first).__name__}.{name} has no row axis (shape {leaves[0].shape}): "
                                 "every carry leaf needs one for the refill's slot operations")
            return fn(*leaves, axis=axis, per_prompt=prompt)

        new[f.name] = jax.tree.map(leaf_fn, *values)
    return dataclasses.replace(first, **new)


@functools.partial(jax.jit, static_argnames=("n",))
def take_slots(carry, slots: Array, n: int):
    """The carry of prompt slots `slots` ([k] int32, in range, traced) alone, in that order:
    rows slots[j]·n .. slots[j]·n + n - 1 and per-prompt entry slots[j] of every leaf become
    prompt j's (a copy of those slots' caches only). One slot: a done prompt's rows, read
    out alone (`decoders.decode_stream`); several: the live slots of a stream's tail,
    gathered into a smaller carry."""
    rows = (slots[:, None] * n + jnp.arange(n)[None]).reshape(-1)
    return _map_slot(lambda a, axis, per_prompt: jnp.take(a, slots if per_prompt else rows, axis=axis), carry)


@functools.partial(jax.jit, static_argnames=("axis",))
def _take(a: Array, index: Array, axis: int) -> Array:
    return jnp.take(a, index, axis=axis)


def gather_slots(carry, slots: Array, n: int):
    """`take_slots(carry, slots, n)` leaf by leaf, each leaf of `carry` deleted once its
    slots are copied out: memory rises by one leaf's gathered part at most, not by the whole
    smaller carry (the tail's gather, `decoders.decode_stream`, whose carry may fill the
    device). `carry` is consumed: every array of it is deleted, so nothing else may hold
    one (a leaf that appears twice is gathered once)."""
    slots = jnp.asarray(slots, jnp.int32)
    rows = (slots[:, None] * n + jnp.arange(n)[None]).reshape(-1)
    gathered: dict[int, tuple[Array, Array]] = {}  # id(source leaf) -> (source, its gathered slots)

    def take(a, axis, per_prompt):
        if id(a) not in gathered:
            gathered[id(a)] = (a, _take(a, slots if per_prompt else rows, axis))
            a.delete()
        return gathered[id(a)][1]

    return _map_slot(take, carry)


@functools.partial(jax.jit, static_argnames=("n",), donate_argnames=("carry",))
def put_slots(carry, slots: Array, sub, n: int):
    """`carry` with prompt slot slots[j] overwritten by prompt j of `sub` (a carry of
    len(slots) prompts, n rows each) for every j: every leaf, caches and work counters
    included, so nothing of a slot's previous prompt is left. slots: [k] int32 (traced: one
    compiled program for every choice of slots); an entry past the carry's last slot
    writes nothing (the padding of a bucketed admission). `carry` is donated and updated
    in place (the other rows are not copied)."""
    rows = (slots[:, None] * n + jnp.arange(n)[None]).reshape(-1)
    return _map_slot(lambda a, b, axis, per_prompt: a.at[(slice(None),) * axis + (slots if per_prompt else rows,)]
                     .set(b, mode="drop"), carry, sub)


def fold_in_rows(keys: Array, *tags: int | Array) -> Array:
    """fold_in(..fold_in(keys[b], tags[0]).., tags[-1]) for every row b of [B] keys; a tag
    is a scalar (the same for every row) or a [B] array (one per row)."""
    for tag in tags:
        per_row = 0 if jnp.ndim(tag) else None
        keys = jax.vmap(jax.random.fold_in, in_axes=(0, per_row))(keys, tag)
    return keys
