"""Row operations on GenState (`degs_jax.rows`), read from the fields' declarations: every
data field moves with its rows (the cache at `cache_row_axis`, here 1), static fields stay,
and copying rows into a slot leaves the slot's work counters. No model: random states of
B = 12 rows (more than `ROWS_PER_COPY`, so the chunked copies run two chunks)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from degs_jax import rows
from degs_jax.generation import GenState

B, S = 12, 5


def _state(seed: int) -> GenState:
    rng = np.random.default_rng(seed)
    ints = lambda *shape: jnp.asarray(rng.integers(0, 1000, shape), jnp.int32)
    floats = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
    cache = {"k": floats(2, B, 3), "v": floats(2, B, 4, 2)}  # rows on axis 1
    return GenState(tokens=ints(B, S), logp=floats(B, S), logq=floats(B, S), depth=ints(B, S),
                    final_entropy=floats(B, S), length=ints(B), prompt_len=ints(B),
                    ended=jnp.asarray(rng.random(B) < 0.5), cache=cache, n_generated=ints(B),
                    n_forward=ints(B), n_probed=ints(B), n_steps=ints(B), stop_state=ints(B, S),
                    cache_row_axis=1)


def _row(state: GenState, r: int) -> dict:
    """Row r of every data field, as numpy (the cache's at axis 1)."""
    out = {f.name: np.asarray(getattr(state, f.name))[r] for f in dataclasses.fields(state)
           if f.name not in ("cache", "cache_row_axis")}
    out.update({f"cache.{k}": np.asarray(v)[:, r] for k, v in state.cache.items()})
    return out


COUNTERS = ("n_generated", "n_forward", "n_probed", "n_steps")


def _assert_row(got: GenState, r: int, want: GenState, w: int, counters_from: GenState | None = None):
    have, expect = _row(got, r), _row(want, w)
    if counters_from is not None:
        expect.update({name: _row(counters_from, r)[name] for name in COUNTERS})
    for name in expect:
        np.testing.assert_array_equal(have[name], expect[name], err_msg=f"row {r}, {name}")


def test_pytree_and_counters_are_declared_on_the_fields():
    state = _state(0)
    leaves, treedef = jax.tree.flatten(state)
    assert len(leaves) == 15  # 13 array fields + the cache's two leaves; cache_row_axis is static
    assert jax.tree.unflatten(treedef, leaves).cache_row_axis == 1
    assert rows.work_counter_names(GenState) == COUNTERS
    assert list(rows.work_totals(state)) == ["generated_tokens", "forward_tokens", "probed_token_layers",
                                             "decode_steps"]
    assert rows.work_totals(state)["forward_tokens"] == int(np.asarray(state.n_forward).sum())


def test_take_repeat_select_move_every_field_with_its_rows():
    state, other = _state(1), _state(2)
    index = jnp.asarray([3, 0, 11, 3])
    taken = rows.take_rows(state, index)
    for r, w in enumerate(np.asarray(index)):
        _assert_row(taken, r, state, int(w))
    repeated = rows.repeat_rows(state, 3)
    for r in range(3 * B):
        _assert_row(repeated, r, state, r // 3)
    take_new = np.arange(B) % 3 == 0
    picked = rows.select_rows(jnp.asarray(take_new), other, state)
    for r in range(B):
        _assert_row(picked, r, other if take_new[r] else state, r)


def test_copy_rows_keeps_each_slots_work_counters():
    state = _state(3)
    source = np.arange(B)
    source[[1, 2, 5, 6, 7, 8, 9, 10, 11]] = [0, 0, 4, 4, 3, 3, 3, 0, 4]  # 9 copies: two chunks of 8
    copied = rows.copy_rows(state, jnp.asarray(source), jnp.asarray(source != np.arange(B)))
    for r in range(B):
        _assert_row(copied, r, state, int(source[r]), counters_from=state)


def test_settle_rows_takes_the_decided_rows_into_both_states():
    current, proposal = _state(4), _state(5)
    decided = np.arange(B) % 4 != 3  # 9 decided rows: two chunks of 8
    accept = decided & (np.arange(B) % 2 == 0)
    new_current, new_proposal = rows.settle_rows(current, proposal, jnp.asarray(decided), jnp.asarray(accept))
    for r in range(B):
        if not decided[r]:
            _assert_row(new_current, r, current, r)
            _assert_row(new_proposal, r, proposal, r)
            continue
        winner = proposal if accept[r] else current
        _assert_row(new_current, r, winner, r)
        _assert_row(new_proposal, r, winner, r, counters_from=proposal)


def test_fold_in_rows_folds_scalar_and_per_row_tags():
    keys = jax.random.split(jax.random.key(0), 4)
    per_row = jnp.asarray([5, 6, 7, 8])
    got = jax.random.key_data(rows.fold_in_rows(keys, 2, per_row))
    want = [jax.random.key_data(jax.random.fold_in(jax.random.fold_in(keys[b], 2), 5 + b)) for b in range(4)]
    np.testing.assert_array_equal(np.asarray(got), np.stack([np.asarray(w) for w in want]))


def test_gather_slots_takes_the_slots_and_frees_the_carry_leaf_by_leaf():
    """`gather_slots` gives `take_slots`' carry (slots 5, 0, 9 of 12, one row each) and
    deletes every leaf of the carry it was given, once, even a leaf that appears twice."""
    state = _state(3)
    state = dataclasses.replace(state, prompt_len=state.length)  # one array in two fields
    slots = jnp.asarray([5, 0, 9], jnp.int32)
    want = rows.take_slots(state, slots, 1)
    for r, w in enumerate([5, 0, 9]):
        _assert_row(want, r, state, w)
    got = rows.gather_slots(state, np.asarray(slots), 1)
    for r in range(3):
        _assert_row(got, r, want, r)
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves(state))
    assert got.prompt_len is got.length
