"""Continuous batching (issue 39): `decode(..., slots=k)` / `decode_stream` run the prompts
through k prompt slots, refilling a slot with the next waiting prompt as soon as its
prompt is done. On the batch-invariant tiny model every prompt's Output (tokens, scores,
candidates, MCMC acceptance and decision records, SMC weights / evidence / ESS, SPS
rollouts) and its work counters are bitwise those of the prompt decoded alone, for every
method: prompts of 2 to 61 tokens through 2 slots, so slots are refilled while the other
slot is mid-run (asserted), and a refilled slot's rows held a longer prompt before (its
stale cache slots and the previous prompt's keys, block / step counters, decision
records and weights are all overwritten: were one carry field left, the refilled prompt
would read it). With refill off, `decode` is unchanged (the other test files).
"""

from __future__ import annotations

import dataclasses
import functools
import json

import jax
import numpy as np
import pytest

from degs_jax import decoders
from degs_jax.decoders import decode, decode_stream
from degs_jax.methods import METHODS, hyperparameters_for
from degs_jax.mcmc import ChainRows, MCMCMethod
from degs_jax.stops import TokenBytes
from test_batch_invariance import DECODER_EOS, DECODER_SETTINGS, _bits, _model

# Very different lengths (the buffers hold the longest, 61 + budget; alone, 16 + budget), in
# two prompt buckets (16, 64), so a prompt decoded alone compiles one of two shapes.
LENGTHS = (61, 2, 9, 50, 4, 14)
PROMPTS = [list(np.random.default_rng(n).integers(0, 89, n)) for n in LENGTHS]
KEYS = jax.numpy.stack([jax.random.key(100 + i) for i in range(len(PROMPTS))])
SLOTS = 2
CASES = {**{m: (m, DECODER_SETTINGS[m]) for m in METHODS},
         "scalable_power token form": ("scalable_power", dict(DECODER_SETTINGS["scalable_power"], block_len=1,
                                                              max_new_tokens=6))}


@functools.lru_cache(maxsize=None)
def _alone(case: str, index: int):
    method, settings = CASES[case]
    model, params = _model("float32")
    result = decode(model, params, [PROMPTS[index]], method, keys=KEYS[index:index + 1], eos_ids=DECODER_EOS,
                    **settings)
    return dataclasses.asdict(result.outputs[0]), result.counters


@pytest.mark.parametrize("case", list(CASES))
def test_refill_equals_one_prompt_at_a_time(case, monkeypatch):
    method, settings = CASES[case]
    model, params = _model("float32")
    config = hyperparameters_for(method, **settings)
    plan = config.plan(model, DECODER_EOS)
    mid_run = []  # per admitted prompt: another watched slot was not done
    phases = []  # MCMC, per admission: the blocks of the rows of the other slots that are not done
    put = decoders.put_slots

    def watching_put(carry, slots, sub, n):
        done = np.asarray(config.prompt_done(carry, plan))
        targets = [int(s) for s in np.asarray(slots) if s < len(done)]
        others = np.setdiff1d(np.arange(len(done)), targets)
        mid_run.extend([bool((~done[others]).any())] * len(targets))
        if isinstance(carry, ChainRows):
            running = np.repeat(~done, n) & np.isin(np.arange(len(done) * n) // n, others)
            phases.append(np.asarray(carry.block)[running])
        return put(carry, slots, sub, n)

    monkeypatch.setattr(decoders, "put_slots", watching_put)
    result = decode(model, params, PROMPTS, config, keys=KEYS, eos_ids=DECODER_EOS, slots=SLOTS)
    assert len(mid_run) == len(PROMPTS) - SLOTS
    assert any(mid_run), "no slot was refilled while the other was mid-run"
    if isinstance(config, MCMCMethod):  # an admitted chain starts at block 0 beside chains past it
        assert any((blocks >= 1).any() for blocks in phases), "no prompt was admitted beside a chain past block 0"
    totals = {}
    for index, output in enumerate(result.outputs):
        alone, counters = _alone(case, index)
        got = dataclasses.asdict(output)
        assert _bits(got.pop("counters")) == _bits(counters), f"prompt {index}: counters"
        alone = dict(alone, counters=None, advance_seconds=None)  # (the stream's pace: a timing)
        got = dict(_untimed(output), counters=None)
        for name in alone:
            assert _bits(got[name]) == _bits(alone[name]), f"prompt {index}: {name} differs from the prompt alone"
        for name, value in counters.items():
            totals[name] = totals.get(name, 0) + value
    assert result.counters == totals


def test_stream_yields_prompts_as_they_finish():
    """`decode_stream` yields every prompt once, with its own counters and the stream's
    fastest pace so far (seconds per advance: never above a later prompt's, and no slower
    than the whole decode spread over its advances), and returns its seconds."""
    model, params = _model("float32")
    stream = decode_stream(model, params, PROMPTS, "greedy", keys=KEYS, eos_ids=DECODER_EOS, slots=3,
                           max_new_tokens=4)
    seen, paces = [], []
    while True:
        try:
            index, output = next(stream)
        except StopIteration as finished:
            seconds = finished.value
            break
        seen.append(index)
        paces.append(output.advance_seconds)
        assert output.counters["generated_tokens"] == len(output.chosen.tokens)
    assert sorted(seen) == list(range(len(PROMPTS)))
    assert set(seconds) == {"prefill", "decode", "total", "advances"} and seconds["total"] >= seconds["decode"] > 0
    assert seconds["advances"] >= 4  # a greedy advance is one decode step: at least the 4 tokens
    assert all(p is not None and p > 0 for p in paces) and paces == sorted(paces, reverse=True)
    assert paces[-1] <= seconds["decode"] / seconds["advances"]
    assert decode(model, params, PROMPTS, "greedy", keys=KEYS, eos_ids=DECODER_EOS,
                  max_new_tokens=4).outputs[0].advance_seconds is None  # a fixed batch times no advance


def test_stream_pace_is_the_fastest_chunk_so_far(monkeypatch):
    """`Output.advance_seconds` is the minimum over the chunks run before the prompt
    finished of chunk seconds / advances (a clock that makes the chunks take 2 s, 0.01 s,
    3 s, ... in turn, so the fastest chunk is neither the first nor the last)."""
    import types

    model, params = _model("float32")
    durations, chunks, clock = [2.0, 0.01, 3.0, 0.5], [], {"now": 0.0, "calls": 0}

    def perf_counter():  # calls: t0, t1, then (start, end) per chunk, then t2
        clock["calls"] += 1
        if clock["calls"] > 2 and clock["calls"] % 2 == 0:  # a chunk's end
            clock["now"] += durations[(len(chunks) - 1) % len(durations)]  # (counted already)
        return clock["now"]

    real_chunk = decoders.advance_chunk

    def counted(*args, **kwargs):
        out = real_chunk(*args, **kwargs)
        chunks.append((durations[len(chunks) % len(durations)], int(out[3])))
        return out

    monkeypatch.setattr(decoders, "time", types.SimpleNamespace(perf_counter=perf_counter))
    monkeypatch.setattr(decoders, "advance_chunk", counted)
    stream = decode_stream(model, params, PROMPTS, "greedy", keys=KEYS, eos_ids=DECODER_EOS, slots=3,
                           max_new_tokens=6)
    checked = 0
    for _, output in stream:
        want = min(d / ran for d, ran in chunks if ran)
        assert output.advance_seconds == pytest.approx(want)
        checked += output.advance_seconds != chunks[-1][0] / max(chunks[-1][1], 1)
    assert len(chunks) >= 3 and checked, "the fastest chunk was always the last: the check is vacuous"


# Prompt orders in which the tail gathers a live slot other than the first two (found by trying).
TAIL_ORDERS = {"power_mcmc": (0, 1, 2, 3, 4, 5), "best_of_n": (2, 3, 0, 1, 4, 5), "power_smc": (2, 1, 0, 5, 4, 3)}


@pytest.mark.parametrize("case", list(TAIL_ORDERS))
def test_the_tail_goes_on_in_a_smaller_carry_as_if_never_moved(case, monkeypatch):
    """Once every prompt is admitted and at most `tail_fraction` of the slots are live, the
    live slots are gathered into a smaller carry (`rows.gather_slots`) and go on there: four
    slots become two (and one, where the last prompt runs alone), a live slot moves to
    another position, and every prompt's Output and counters stay bitwise those of the
    prompt alone (one chain; a pool of n rows per slot; SMC's per-prompt fields). With
    tail_fraction=0 the carry keeps its four slots."""
    method, settings = CASES[case]
    order = TAIL_ORDERS[case]
    prompts, keys = [PROMPTS[i] for i in order], KEYS[np.asarray(order)]
    model, params = _model("float32")
    sizes, gathers = [], []
    real_chunk, real_gather = decoders.advance_chunk, decoders.gather_slots

    def watching_chunk(model_, params_, carry, keys, advances, method_, settings_, watch=None, admit_at=None):
        if watch is not None:  # (a stream's chunk; the prompt alone runs as a fixed batch)
            sizes.append(int(watch.shape[0]))
        return real_chunk(model_, params_, carry, keys, advances, method_, settings_, watch, admit_at)

    def watching_gather(carry, slots, n):
        gathers.append([int(s) for s in np.asarray(slots)])
        return real_gather(carry, slots, n)

    monkeypatch.setattr(decoders, "advance_chunk", watching_chunk)
    monkeypatch.setattr(decoders, "gather_slots", watching_gather)
    result = decode(model, params, prompts, method, keys=keys, eos_ids=DECODER_EOS, slots=4, tail_fraction=1 / 2,
                    **settings)
    assert sizes[0] == 4 and 2 in sizes and sizes == sorted(sizes, reverse=True), sorted(set(sizes))
    assert any(g != list(range(len(g))) for g in gathers), f"no live slot moved to another position: {gathers}"
    for position, output in enumerate(result.outputs):
        alone, counters = _alone(case, order[position])
        got = dataclasses.asdict(output)
        assert _bits(got.pop("counters")) == _bits(counters), f"prompt {order[position]}: counters"
        alone = dict(alone, counters=None, advance_seconds=None)
        got = dict(_untimed(output), counters=None)
        for name in alone:
            assert _bits(got[name]) == _bits(alone[name]), \
                f"prompt {order[position]}: {name} differs from the prompt alone"
    sizes.clear()
    decode(model, params, prompts, method, keys=keys, eos_ids=DECODER_EOS, slots=4, tail_fraction=0, **settings)
    assert set(sizes) == {4}
    with pytest.raises(ValueError, match="tail_fraction must be in \\[0, 1\\]"):
        decode(model, params, prompts, method, keys=keys, eos_ids=DECODER_EOS, slots=4, tail_fraction=2,
               **settings)


def test_refill_needs_one_key_per_prompt():
    model, params = _model("float32")
    with pytest.raises(ValueError, match="refill\\) needs keys"):
        decode(model, params, PROMPTS, "greedy", jax.random.key(0), eos_ids=DECODER_EOS, slots=2)
    with pytest.raises(ValueError, match="slots must be a positive integer"):
        decode(model, params, PROMPTS, "greedy", keys=KEYS, eos_ids=DECODER_EOS, slots=0)


def test_plan_prices_fixed_batches_by_their_useful_row_steps():
    """`degs reproduce --plan`'s refill estimate: a fixed batch of two MCMC chains whose
    answers have 4 and 12 tokens (1 and 3 blocks of 4, 2 MH steps: 8 and 36 sequential
    steps, sum_k (l + T·k·l/2)) used 44 of its 2 · 36 row-steps; a refilled record (no
    batch_share) and a batch of one count nothing."""
    from degs_jax.methods import PowerMCMC
    from degs_jax.reproduce.study import fixed_batch_utilisation

    method = PowerMCMC(block_len=4, num_blocks=4, mh_steps=2)
    assert [method.sequential_steps(n) for n in (4, 12)] == [8, 36]
    records = [{"index": 1, "n_tokens": 12, "batch_share": 2}, {"index": 0, "n_tokens": 4, "batch_share": 2},
               {"index": 2, "n_tokens": 16}]
    assert fixed_batch_utilisation(records, method) == 44 / 72
    assert fixed_batch_utilisation(records[2:], method) is None


def test_plan_prices_a_refilled_job_at_least_as_its_slowest_chain(tmp_path):
    """`degs reproduce --plan` with refill: one MCMC problem left costs at least its chain
    alone (worst-case decode steps x the fastest measured seconds per step), not the job's
    seconds per problem; the same method's rate and pace measured on another benchmark serve a job
    never run; a sampling method (no worst-case advances) and a finished job get none."""
    from degs_jax.eval.results import write_json
    from degs_jax.methods import PowerMCMC
    from degs_jax.reproduce import study

    small = {"max_new_tokens": 8, "block_len": 4, "num_blocks": 2, "mh_steps": 2}
    request = study.StudyRequest(benchmarks={"gsm8k": 3, "math500": 2, "deepmind500": 1},
                                 methods=("greedy", "power_mcmc"), pool_benchmarks={}, overrides={"*": small})
    steps = PowerMCMC(block_len=4, num_blocks=2, mh_steps=2).worst_case_advances()
    assert steps == 2 * 4 + 2 * 4 * 2 * 3 // 4  # B·l + T·l·B(B+1)/4
    records = {"runs/gsm8k/power_mcmc": [{"id": "a", "index": 0, "correct": True, "wall_clock_s": 1.0,
                                          "advance_s": 0.5},
                                         {"id": "b", "index": 1, "correct": False, "wall_clock_s": 1.0,
                                          "advance_s": 0.25}],
               "runs/gsm8k/greedy": [{"id": str(i), "index": i, "correct": True, "wall_clock_s": 0.1, "advance_s": 0.01}
                                     for i in range(3)],
               "runs/deepmind500/power_mcmc": [{"id": "d", "index": 0, "correct": True, "wall_clock_s": 1.0,
                                                "advance_s": 0.5}]}
    for directory, recs in records.items():
        (tmp_path / directory).mkdir(parents=True)
        (tmp_path / directory / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    write_json(tmp_path / "study.json", {"model": {"name": "m", "num_layers": 2}, "invocations": []})
    rows = {r["directory"]: r for r in study.plan_table(tmp_path, request)}
    mcmc = rows["runs/gsm8k/power_mcmc"]
    assert (mcmc["estimate_s"], mcmc["advance_s"]) == (1.0, 0.25)
    assert mcmc["slowest_prompt_s"] == 0.25 * steps and mcmc["refill_estimate_s"] == 0.25 * steps
    other = rows["runs/math500/power_mcmc"]  # never run: the method's rate (2 x 1 s) and pace
    assert other["estimate_s"] == 2.0 and other["slowest_prompt_s"] == other["refill_estimate_s"] == 0.25 * steps
    assert rows["runs/gsm8k/greedy"]["slowest_prompt_s"] is None  # done, and no worst-case advances
    assert rows["runs/deepmind500/power_mcmc"]["slowest_prompt_s"] is None  # done: nothing left to wait for
    assert rows["runs/math500/greedy"]["slowest_prompt_s"] is None
    assert "its slowest prompt alone" in study.format_plan(list(rows.values()))

    # A problem left whose chain is checkpointed after block 1 of 2: only the rest of it.
    from degs_jax.eval.checkpoints import CheckpointStore
    mcmc_method = PowerMCMC(block_len=4, num_blocks=2, mh_steps=2)
    for done in range(3):  # sum over the blocks left of l + T·k·l/2
        assert mcmc_method.worst_case_advances({"block": np.array([done, 2])}) == sum(
            4 + 2 * k * 4 / 2 for k in range(done + 1, 3))
    CheckpointStore(tmp_path / "runs/gsm8k/power_mcmc").save("2", {"block": np.array([1])})
    CheckpointStore(tmp_path / "runs/math500/power_mcmc").save("x", {"block": np.array([1])})
    rows = {r["directory"]: r for r in study.plan_table(tmp_path, request)}
    assert rows["runs/gsm8k/power_mcmc"]["slowest_prompt_s"] == 0.25 * (4 + 2 * 2 * 4 / 2)  # block 2 alone
    assert rows["runs/math500/power_mcmc"]["slowest_prompt_s"] == 0.25 * steps  # another problem has none


# Stop strings with refill: the tiny vocabulary spelled as bytes "a".."d" (EOS: none), so
# that "ab" ends many completions at different lengths, the stop states live in the carry.
STOP_PIECES = TokenBytes([bytes([ord("a") + i % 4]) for i in range(97)])


@pytest.mark.parametrize("method", ["greedy", "degs_mcmc", "power_smc"])
def test_refill_with_stop_strings_equals_one_prompt_at_a_time(method):
    model, params = _model("float32")
    settings = dict(DECODER_SETTINGS[method], stop=("ab",))
    alone = [decode(model, params, [PROMPTS[i]], method, keys=KEYS[i:i + 1], eos_ids=DECODER_EOS,
                    token_bytes=STOP_PIECES, **settings).outputs[0] for i in range(len(PROMPTS))]
    refilled = decode(model, params, PROMPTS, method, keys=KEYS, eos_ids=DECODER_EOS, slots=SLOTS,
                      token_bytes=STOP_PIECES, **settings)
    ended = 0
    for index, (output, single) in enumerate(zip(refilled.outputs, alone)):
        got, want = dict(_untimed(output), counters=None), dict(_untimed(single), counters=None)
        for name in want:
            assert _bits(got[name]) == _bits(want[name]), f"prompt {index}: {name} differs from the prompt alone"
        ended += sum(c.ended for c in output.candidates)
    assert ended > 0, "no completion ended at the stop: the check is vacuous"


# Checkpoints (issue 57): an MCMC chain's state after each block is what a killed run resumes
# from. Four blocks of 8, so that chains are stopped after a block with blocks still to run.
CHAIN = dict(DECODER_SETTINGS["degs_mcmc"], num_blocks=4)


class Killed(Exception):
    pass


def _untimed(output) -> dict:
    """An Output's fields without the stream's pace (`advance_seconds`: a timing)."""
    return dict(dataclasses.asdict(output), advance_seconds=None)


def _stream(prompts, keys, **kwargs):
    """Every (index, Output) of a `decode_stream` of degs_mcmc, and its returned stats."""
    model, params = _model("float32")
    stream = decode_stream(model, params, prompts, "degs_mcmc", keys=keys, eos_ids=DECODER_EOS, slots=SLOTS,
                           **CHAIN, **kwargs)
    outputs = {}
    while True:
        try:
            index, output = next(stream)
        except StopIteration as finished:
            return outputs, finished.value
        outputs[index] = output


@pytest.mark.parametrize("written", ["now", "before_step_counter"])
def test_a_killed_chain_resumes_from_its_last_block_as_if_never_stopped(written):
    """A run stopped as soon as some chain has completed 2 of its 4 blocks (the kill: an
    exception from `on_checkpoint`, so nothing after it runs), then resumed with the last
    snapshot of every unfinished prompt, gives every prompt the Output of a run never
    stopped, bitwise: tokens, scores, decision records, acceptance and work counters (the
    replay that rebuilds a resumed chain's cache is not counted as work). The resumed run
    takes fewer decode steps than the same prompts started afresh. A snapshot written
    before the decode-step counter (no n_steps: the study's checkpoints of 2026-12-02)
    resumes to the same counters."""
    uninterrupted, _ = _stream(PROMPTS, KEYS)
    snapshots = {}

    def store(index, snapshot):
        snapshots[index] = snapshot
        if snapshot["block"].min() >= 2 and (snapshot["block"] < CHAIN["num_blocks"]).any():
            raise Killed

    finished = {}
    stream = decode_stream(*_model("float32"), PROMPTS, "degs_mcmc", keys=KEYS, eos_ids=DECODER_EOS, slots=SLOTS,
                           on_checkpoint=store, **CHAIN)
    with pytest.raises(Killed):
        for index, output in stream:
            finished[index] = output
    left = [i for i in range(len(PROMPTS)) if i not in finished]
    stopped = {i: snapshots[i] for i in left if i in snapshots}
    assert any(s["block"].min() >= 2 for s in stopped.values()), "no chain was stopped past block 1"
    if written == "before_step_counter":
        stopped = {i: {name: value for name, value in s.items() if name != "n_steps"} for i, s in stopped.items()}
    prompts, keys = [PROMPTS[i] for i in left], KEYS[np.asarray(left)]
    resumed, resumed_stats = _stream(prompts, keys, resume={left.index(i): s for i, s in stopped.items()})
    _, restarted_stats = _stream(prompts, keys)
    assert resumed_stats["advances"] < restarted_stats["advances"], (resumed_stats, restarted_stats)
    for position, index in enumerate(left):
        got, want = _untimed(resumed[position]), _untimed(uninterrupted[index])
        for name in want:
            assert _bits(got[name]) == _bits(want[name]), f"prompt {index}: {name} differs from the run never stopped"
    for index, output in finished.items():
        assert _bits(_untimed(output)) == _bits(_untimed(uninterrupted[index]))


def test_a_snapshot_of_another_configuration_is_refused():
    """A stored snapshot whose decision records have another shape (a run of other MH steps)
    is one ValueError naming the field, not a wrong chain."""
    snapshots = {}
    _stream(PROMPTS[:SLOTS], KEYS[:SLOTS], on_checkpoint=lambda index, snapshot: snapshots.setdefault(index, snapshot))
    index, snapshot = next(iter(snapshots.items()))
    wrong = dict(snapshot, **{"decisions.accepted": snapshot["decisions.accepted"][..., :1]})
    with pytest.raises(ValueError, match="decisions.accepted"):
        _stream(PROMPTS[:SLOTS], KEYS[:SLOTS], resume={index: wrong})
