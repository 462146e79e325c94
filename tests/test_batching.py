"""`--batch-size auto`: the batch size from free memory and the method's buffer
(`degs_jax.batching`). The arithmetic is a pure function tested on exact integers; the
row cost is checked against the bytes the model's cache actually allocates."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from degs_jax import batching
from degs_jax.batching import (DEVICE_MEMORY_FRACTION, MAX_AUTO_BATCH, MEMORY_FRACTION_VARIABLE,
                               STATE_BYTES_PER_SLOT, WORKING_VOCAB_COPIES, BatchDoesNotFitError,
                               card_memory, choose_batch_size, claim_device_memory, describe_batch_choice,
                               device_memory_setting, parse_batch_size, peak_memory, pick_batch_size,
                               row_cost)
from degs_jax.methods import hyperparameters_for
from degs_jax.examples.nnx_lm import tiny_nnx_model

LM, _ = tiny_nnx_model()


@pytest.mark.parametrize("bytes_per_row, free, fraction, most, expected", [
    (100, 1000, 0.5, 256, 5),  # floor(500 / 100)
    (100, 1099, 1.0, 256, 10),  # floor, not round
    (300, 1000, 0.7, 256, 2),  # floor(700 / 300)
    (100, 10 ** 9, 0.7, 256, 256),  # capped at the largest batch
    (100, 10 ** 9, 0.7, 3, 3),  # capped at the number of prompts
    (10 ** 6, 1000, 0.7, 256, 1),  # nothing fits: still one row (the run says if it OOMs)
    (100, -5, 0.7, 256, 1),  # over-committed device
])
def test_pick_batch_size_arithmetic(bytes_per_row, free, fraction, most, expected):
    assert pick_batch_size(bytes_per_row, free, fraction, most) == expected


@pytest.mark.parametrize("args, match", [((0, 1000), "bytes_per_row"),
                                         ((100, 1000, 0.0), "fraction"),
                                         ((100, 1000, 1.5), "fraction"),
                                         ((100, 1000, 0.5, 0), "largest")])
def test_pick_batch_size_rejects_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        pick_batch_size(*args)


def _allocated_cache_bytes(max_len):
    cache = LM.init_cache(1, max_len, jnp.float32)
    return sum(leaf.nbytes for leaf in jax.tree.leaves(cache))


def test_row_cost_counts_the_cache_the_model_allocates_and_the_pool():
    config = hyperparameters_for("temperature", max_new_tokens=40)
    cost = row_cost(LM, config, longest_prompt=17, cache_dtype=jnp.float32)
    assert cost.max_len == 32 + 40  # the prompt padded to a multiple of 16
    assert cost.cache_bytes == _allocated_cache_bytes(72) > 0
    assert cost.state_bytes == STATE_BYTES_PER_SLOT * 72
    assert cost.working_bytes == WORKING_VOCAB_COPIES * LM.vocab_size * 4
    assert cost.sequences == 1
    assert cost.total == cost.cache_bytes + cost.state_bytes + cost.working_bytes
    pool = row_cost(LM, hyperparameters_for("best_of_n", n=4, max_new_tokens=40), 17, jnp.float32)
    assert pool.total == 4 * cost.total
    # An MCMC chain holds the chain and its proposal; its buffer is num_blocks * block_len.
    chain = row_cost(LM, hyperparameters_for("power_mcmc", block_len=8, num_blocks=5, n_chains=3),
                     17, jnp.float32)
    assert chain.sequences == 6 and chain.max_len == 32 + 40
    assert chain.total == 6 * cost.total


def test_choose_batch_size_keeps_an_integer_and_records_an_auto_choice():
    config = hyperparameters_for("temperature", max_new_tokens=40)
    assert choose_batch_size(7, LM, config, 17, 100, jnp.float32) == {"batch_size": 7,
                                                                      "requested": 7}
    record = choose_batch_size("auto", LM, config, 17, 5, jnp.float32)
    assert record["requested"] == "auto"
    assert record["bytes_per_row"] == row_cost(LM, config, 17, jnp.float32).total
    assert record["largest"] == 5
    assert record["batch_size"] == pick_batch_size(record["bytes_per_row"], record["free_bytes"],
                                                   record["fraction"], 5)
    if jax.devices()[0].platform == "cpu":
        assert "host free physical memory" in record["memory_source"]
    with pytest.raises(ValueError, match="positive integer or 'auto'"):
        choose_batch_size(0, LM, config, 17, 5, jnp.float32)
    assert MAX_AUTO_BATCH >= 64


def test_auto_batch_says_what_limited_it_and_refuses_a_row_that_cannot_fit(monkeypatch):
    """Issue 28: where memory is short the automatic batch says so; where one prompt row
    needs more than all the free memory it refuses before anything runs."""
    config = hyperparameters_for("degs_smc", n_particles=4, max_new_tokens=40)
    row = row_cost(LM, config, 17, jnp.float32).total
    free = {}
    monkeypatch.setattr(batching, "free_memory", lambda: (free["bytes"], "test memory"))
    cases = [(10 * row, 100, 7, "memory", 1),  # floor(0.7 * 10 rows)
             (10 * row, 100, 14, "memory", 2),  # two devices hold twice the rows
             (10 ** 6 * row, 3, 3, "the number of prompts", 1),
             (10 ** 6 * row, 10 ** 4, MAX_AUTO_BATCH, f"MAX_AUTO_BATCH ({MAX_AUTO_BATCH})", 1)]
    for free_bytes, n_prompts, batch, limited_by, devices in cases:
        free["bytes"] = free_bytes
        record = choose_batch_size("auto", LM, config, 17, n_prompts, jnp.float32, devices=devices)
        assert (record["batch_size"], record["limited_by"]) == (batch, limited_by)
        assert "warning" not in record
        line = describe_batch_choice(record)
        assert line.startswith(f"batch size {batch} (auto, limited by {limited_by}: ")
        assert ("on each of 2 devices" in line) == (devices == 2)
    # Fits only in the part the fraction keeps back: one row, with a warning.
    free["bytes"] = row + row // 10
    record = choose_batch_size("auto", LM, config, 17, 100, jnp.float32, devices=1)
    assert record["batch_size"] == 1 and record["limited_by"] == "memory"
    assert "batch 1 may run out of memory" in record["warning"]
    assert "; warning: one prompt needs" in describe_batch_choice(record)
    # Does not fit at all: refused, with what one prompt needs and what to change.
    free["bytes"] = row - 1
    with pytest.raises(BatchDoesNotFitError, match=r"one prompt of degs_smc needs .* \(4 sequence\(s\) "
                       r"of .*: a 72-slot cache.*more than the .* free on 1 device\(s\) \(test memory\); "
                       r"lower max_new_tokens"):
        choose_batch_size("auto", LM, config, 17, 100, jnp.float32, devices=1)
    free["bytes"] = (row + 1) // 2  # ... but on two devices it fits
    assert choose_batch_size("auto", LM, config, 17, 100, jnp.float32, devices=2)["batch_size"] == 1
    assert describe_batch_choice({"batch_size": 5, "requested": 5}) == "batch size 5"


def test_parse_batch_size_and_peak_memory_record():
    assert parse_batch_size("auto") == "auto" and parse_batch_size("12") == 12
    for bad in ("0", "-3", "many"):
        with pytest.raises(ValueError, match="--batch-size"):
            parse_batch_size(bad)
    peak = peak_memory()
    if jax.devices()[0].platform == "cpu":
        assert peak["peak_bytes"] is None and "no device memory statistics" in peak["note"]
    else:
        assert peak["peak_bytes"] > 0


class FakeDevice:
    """A device as `card_memory` reads it: its platform and its allocator's statistics."""

    def __init__(self, platform, stats):
        self.platform, self.stats = platform, stats

    def memory_stats(self):
        return self.stats


def test_the_degs_program_claims_the_card_and_records_what_it_claimed(monkeypatch):
    """Issue 39: XLA's pool is DEVICE_MEMORY_FRACTION of the card unless the user set the
    variable; the record says which value holds, where it came from and the card's size."""
    from degs_jax import cli

    # set first, so that the variable is restored to its state before the test (absent)
    # after claim_device_memory sets it behind monkeypatch's back
    monkeypatch.setenv(MEMORY_FRACTION_VARIABLE, "0.5")
    monkeypatch.delenv(MEMORY_FRACTION_VARIABLE)
    assert device_memory_setting()["fraction"] == 0.75 and "JAX's default" in device_memory_setting()["source"]
    order = []
    monkeypatch.setattr(cli, "claim_device_memory", lambda: order.append("claim"))
    monkeypatch.setattr(cli, "main", lambda **kw: order.append("main") or 0)
    with pytest.raises(SystemExit):
        cli.entry_point()
    assert order == ["claim", "main"]  # before any command can start JAX's backend
    claim_device_memory()
    assert device_memory_setting() == {"variable": MEMORY_FRACTION_VARIABLE, "fraction": DEVICE_MEMORY_FRACTION,
                                       "source": "the environment"}
    monkeypatch.setenv(MEMORY_FRACTION_VARIABLE, "0.5")
    claim_device_memory()  # a user's own value is kept
    assert device_memory_setting()["fraction"] == 0.5
    gpu = FakeDevice("gpu", {"bytes_limit": 70 * 2**30, "bytes_in_use": 0})
    assert card_memory(gpu)["card_bytes"] == 140 * 2**30 and card_memory(gpu)["bytes_limit"] == 70 * 2**30
    assert card_memory(FakeDevice("cpu", {})) is None and card_memory(FakeDevice("gpu", None)) is None
    for bad in ("1.5", "0", "most"):
        monkeypatch.setenv(MEMORY_FRACTION_VARIABLE, bad)
        with pytest.raises(ValueError, match=f"{MEMORY_FRACTION_VARIABLE}='{bad}'.*in \\(0, 1\\]"):
            device_memory_setting()
    # an automatic choice on a GPU carries the card's record and says it in its line
    monkeypatch.setenv(MEMORY_FRACTION_VARIABLE, "0.9")
    monkeypatch.setattr(batching, "card_memory", lambda: card_memory(FakeDevice("gpu", {"bytes_limit": 9 * 2**30})))
    monkeypatch.setattr(batching, "free_memory", lambda: (9 * 2**30, "test memory"))
    record = choose_batch_size("auto", LM, hyperparameters_for("greedy", max_new_tokens=40), 17, 4, jnp.float32)
    assert record["device_memory"]["card_bytes"] == 10 * 2**30
    assert describe_batch_choice(record).endswith("; XLA may use 90% of the 10.00 GiB card)")
