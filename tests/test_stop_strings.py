"""Stop strings end a completion like EOS, in every decoder (`degs_jax.stops`).

The rule under test: the automaton runs over the completion's bytes only (a stop string
in the prompt, or spanning the prompt/completion boundary, ends nothing); a stop string
split across tokens ends the row at the token that completes it; the tokens keep that
token and the text is cut where the stop string begins.

The enumerable tiny model of test_mcmc_exactness (tokens 0, 1, 2 and EOS 3, prompt [0, 1],
3-token completions) is given the token bytes 0 = "ab", 1 = "b", 2 = "a" and the stop
string "ba". The prompt is "abb": its last "b" and a first completion token "a" would
make "ba" across the boundary, which must not end the row (under pi that first token 2
carries most of the mass). "ba" is completed by 2 ("a") or 0 ("ab") after a token ending
in "b", always split across two tokens. Under p^4 the stop ends 48% of the mass; 28
completions end (EOS or the stop) or reach 3 tokens.

- The MH chain's answer law after 3 blocks of finite steps, through both drivers, equals
  the exact law of the chain whose target, proposal and extension all end at the stop
  (`test_mcmc_multiblock.exact_answer_law` with the stop as an end rule), for power and
  DEGS targets; two mutants fail it: the proposal ignoring the stop while the extension
  honours it, and the proposal resuming the automaton from the start state at the cut.
- Power-SMC and DEGS-SMC keep their unnormalised identity E[Ẑ·Σ W̄ δ] = gamma over the
  completions with the stop as an end (the weights see the end).
- Sampling at temperature 1 draws p over those completions; SPS ends at the stop.
- Greedy with a stop equals greedy without it cut at the first stop the rule finds, for
  prompts with the stop inside, at the boundary, and none.
"""

from __future__ import annotations

import dataclasses
import json
import random
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from degs_jax import generation, mcmc as mcmc_mod
from degs_jax.decoders import decode
from degs_jax.eval.prompts import HUMANEVAL_DECODING_STOPS
from degs_jax.generation import START, pad_prompts, prefill
from degs_jax.lens import LensConfig
from degs_jax.models import TransformerLM
from degs_jax.rows import repeat_rows
from degs_jax.smc import SMCConfig, final_weights, run_smc
from degs_jax.stops import (STOPPED, TokenBytes, byte_level_alphabet, cut_at_stop, stop_automaton, token_bytes,
                            validate_stop)
from test_mcmc_exactness import (EOS, LSUB, PROMPT, WARM_STEPS, _mc, depth_setup, exact_stats,  # noqa: F401
                                 first_end, model, run_from_target, support, target, tv_and_threshold)
from test_mcmc_multiblock import (ALPHA, CASES, DRIVERS, N_CHAINS, answers, chain_states, exact_answer_law,
                                  method_for, next_token_logp)
from test_cli_hostile import degs, tiny_model  # noqa: F401
from test_smc_exactness import CASES as SMC_CASES, SMALL_N, Z_MAX, identity_z

PIECES = TokenBytes([b"ab", b"b", b"a", b""])
STOP = ("ba",)
AUTOMATON = stop_automaton(STOP, PIECES, EOS + 1)


def ends(completion) -> bool:
    """The end rule with the stop: the last token is EOS or completes "ba" (first time)."""
    return completion[-1] == EOS or AUTOMATON.run(completion) == STOPPED


# The automaton and the token bytes.

def _first_stop_by_bytes(pieces, tokens, stops):
    text = b""
    for i, token in enumerate(tokens):
        text += pieces[token]
        if any(s.encode() in text for s in stops):
            return i
    return None


def test_the_automaton_ends_at_the_token_that_completes_the_first_stop():
    """Against a brute-force search on the bytes: stops split across tokens, inside one
    token, overlapping each other, multi-byte UTF-8, empty tokens."""
    pieces = [b"a", b"b", b"c", b"ab", b"bc", b"ca", b"", b"aaa", "é".encode(), b"\xc3", b"\xa9x"]
    stops = ("ab", "bca", "c", "aaaa", "éx")
    automaton = stop_automaton(stops, TokenBytes(pieces), len(pieces) + 2)  # 2 ids past the tokenizer
    rng = random.Random(0)
    stopped = 0
    for _ in range(4000):
        tokens = [rng.randrange(len(pieces) + 2) for _ in range(rng.randrange(1, 8))]
        full = pieces + [b"", b""]
        want = _first_stop_by_bytes(full, tokens, stops)
        state, got = START, None
        for i, token in enumerate(tokens):
            state = automaton.step(state, token)
            if state == STOPPED:
                got = i
                break
        assert got == want, (tokens, got, want)
        stopped += want is not None
    assert 1000 < stopped < 3900, "the random sequences should both stop and not"
    # "é" split over two byte tokens, then "x": the stop completes at the third token.
    assert automaton.run([8, 1]) != STOPPED and automaton.run([9, 10]) == STOPPED


def test_the_stop_rule_on_the_enumerable_vocabulary():
    assert AUTOMATON.run([1, 2]) == STOPPED  # "b" + "a": split across tokens
    assert AUTOMATON.run([0, 0]) == STOPPED  # "ab" + "ab"
    assert AUTOMATON.run([2]) != STOPPED  # "a": would end "abb" + "a" only across the prompt
    assert AUTOMATON.run([2, 2, 0]) != STOPPED  # "aaab"
    assert len(support(ends)) == 28


def test_byte_level_tokens_are_their_bytes():
    from degs_jax.examples.byte_tokenizer import byte_tokenizer
    from tokenizers import pre_tokenizers

    assert set(byte_level_alphabet().values()) == set(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = byte_tokenizer()
    pieces = token_bytes(tokenizer)
    assert len(pieces) == len(tokenizer)
    text = "def f():\n    return 'é'\n#"
    ids = tokenizer.encode(text)
    assert b"".join(pieces.pieces[i] for i in ids) == text.encode()
    assert pieces.pieces[tokenizer.eos_token_id] == b""  # special: decoded away


def test_sentencepiece_tokens_are_their_bytes():
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "</s>": 1, "<0x0A>": 2, "\u2581def": 3, "x": 4, "\u2581#": 5}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                         decoders.Fuse()])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="</s>")
    assert token_bytes(tokenizer).pieces == (b"", b"", b"\n", b" def", b"x", b" #")


def test_stop_strings_are_checked():
    assert validate_stop(None) is None and validate_stop(["\n#"]) == ("\n#",)
    for bad in ("\n#", ("",), (3,)):
        with pytest.raises(ValueError, match="stop"):
            validate_stop(bad)


def test_text_is_cut_where_the_first_stop_begins():
    assert cut_at_stop("x = 1\nprint(x)\n#", ("\n#", "\nprint")) == "x = 1"
    assert cut_at_stop("abc", ("z",)) == "abc" and cut_at_stop("abc", None) == "abc"


# Decoders.

@pytest.mark.parametrize("prompt", [[1, 2, 0, 1], PROMPT, [0, 0]], ids=["stop_in_prompt", "boundary", "plain"])
def test_greedy_with_a_stop_is_greedy_cut_at_the_first_stop(model, prompt):  # noqa: F811
    """prompt "ba"+"ab"+"b" holds the stop; "abb" ends where "a" would complete it."""
    cfg, params = model
    lm = TransformerLM(cfg)
    plain = decode(lm, params, [prompt], "greedy", jax.random.key(0), eos_ids=(EOS,), max_new_tokens=6)
    stopped = decode(lm, params, [prompt], "greedy", jax.random.key(0), eos_ids=(EOS,), max_new_tokens=6,
                     token_bytes=PIECES, stop=STOP)
    full, cut = plain.outputs[0].chosen.tokens, stopped.outputs[0].chosen
    end = first_end(tuple(full), ends)
    assert cut.tokens == (full if end is None else full[:end + 1])
    assert cut.ended == (end is not None)
    if prompt == PROMPT:
        assert full[0] == 2 and len(cut.tokens) > 1, "the boundary case must be exercised"


def test_stop_strings_need_the_vocabulary(model):  # noqa: F811
    cfg, params = model
    with pytest.raises(ValueError, match="token_bytes"):
        decode(TransformerLM(cfg), params, [PROMPT], "greedy", jax.random.key(0), eos_ids=(EOS,), stop=STOP)


def test_sampling_draws_p_with_the_stop_as_an_end(model):  # noqa: F811
    cfg, params = model
    seqs = support(ends)
    _, logp, _, _ = exact_stats(cfg, params, None, seqs, ends)
    assert abs(np.exp(logp).sum() - 1) < 1e-5, "the completions with the stop as an end are a distribution"
    result = decode(TransformerLM(cfg), params, [PROMPT] * 4000, "temperature", jax.random.key(3),
                    eos_ids=(EOS,), token_bytes=PIECES, stop=STOP, temperature=1.0, max_new_tokens=3,
                    probe=False)
    tv, threshold = tv_and_threshold(seqs, np.exp(logp), [tuple(o.chosen.tokens) for o in result.outputs])
    assert tv < threshold, f"TV {tv:.4f} >= {threshold:.4f}"


def test_scalable_power_ends_at_the_stop(model):  # noqa: F811
    cfg, params = model
    valid = set(support(ends))
    for block_len in (1, 2):
        result = decode(TransformerLM(cfg), params, [PROMPT] * 8, "scalable_power", jax.random.key(4),
                        eos_ids=(EOS,), token_bytes=PIECES, stop=STOP, max_new_tokens=3, block_len=block_len,
                        candidate_pool=4, candidates_kept=3, rollouts=2, rollout_horizon=3)
        outputs = [o.chosen for o in result.outputs]
        assert all(tuple(c.tokens) in valid for c in outputs), [c.tokens for c in outputs]
        assert all(c.ended == ends(tuple(c.tokens)) for c in outputs)
        assert any(AUTOMATON.run(c.tokens) == STOPPED for c in outputs), "some answer should end at the stop"


# MH: pi with the stop as an end is stationary (one block, warm start at pi, as
# test_mcmc_exactness), and the exact answer law after 3 blocks through both drivers.

@pytest.fixture(scope="module")
def stop_setup(model, depth_setup):  # noqa: F811
    cfg, params = model
    tau = depth_setup[0]
    seqs, logp, depth, _ = exact_stats(cfg, params, tau, support(ends), ends)
    return tau, seqs, logp, depth


def _stationary_tv(model, stop_setup, case, seed=0):  # noqa: F811
    cfg, params = model
    tau, seqs, logp, depth = stop_setup
    pi = target(logp, depth, ALPHA, CASES[case])
    samples, accepted = run_from_target(cfg, params, _mc(tau, CASES[case], WARM_STEPS, stop=AUTOMATON), seqs, pi,
                                        seed=seed, ends=ends)
    return (*tv_and_threshold(seqs, pi, samples, seed=seed), accepted.mean() / WARM_STEPS)


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_stop_target_is_stationary(model, stop_setup, case):  # noqa: F811
    tv, threshold, acceptance = _stationary_tv(model, stop_setup, case)
    print(f"{case}: TV {tv:.4f}, threshold {threshold:.4f}, acceptance {acceptance:.2f}")
    assert acceptance > 0.3, "the chains should move"
    assert tv < threshold, f"TV {tv:.4f} >= {threshold:.4f}"


@pytest.fixture(scope="module")
def stop_laws(model, depth_setup):  # noqa: F811
    cfg, params = model
    tau = depth_setup[0]
    logp_next = next_token_logp(cfg, params)
    _, _, depth, _ = exact_stats(cfg, params, tau, chain_states(logp_next, ends), ends)
    return {case: exact_answer_law(logp_next, depth, ALPHA, beta, ends) for case, beta in CASES.items()}


def _chain_answers(model, tau, case, driver, seed):  # noqa: F811
    cfg, params = model
    method = dataclasses.replace(method_for(case, tau), stop=STOP)
    keys = jax.random.split(jax.random.key(seed), N_CHAINS)
    return answers(driver, cfg, params, method, keys, PIECES)


@pytest.mark.parametrize("driver", DRIVERS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_mh_answer_law_with_a_stop_is_exact(model, depth_setup, stop_laws, case, driver):  # noqa: F811
    seqs, law = support(ends), stop_laws[case]
    stopped = np.array([x[-1] != EOS and ends(x) for x in seqs])
    assert 0.2 < law[stopped].sum() < 0.8, "the stop must end a good part of the law"
    seed = 31 + 2 * sorted(CASES).index(case) + DRIVERS.index(driver)
    started = time.perf_counter()
    samples = _chain_answers(model, depth_setup[0], case, driver, seed)
    tv, threshold = tv_and_threshold(seqs, law, samples, seed=seed)
    print(f"{case} {driver}: TV {tv:.4f}, threshold {threshold:.4f}, {time.perf_counter() - started:.1f} s")
    assert tv < threshold, f"TV {tv:.4f} >= {threshold:.4f}"


def _proposal_ignores_the_stop(model, params, state, active, limit, keys, fresh_from, sampler):
    return REAL_DECODE_STEP(model, params, state, active, limit, keys, fresh_from,
                            dataclasses.replace(sampler, stop=None))


def _automaton_restarted_at_the_cut(model, params, state, active, limit, keys, fresh_from, sampler):
    at_cut = active & (state.length == fresh_from) & (fresh_from > state.prompt_len)
    forgotten = generation._set(state.stop_state, fresh_from - 1, jnp.full_like(fresh_from, START), at_cut)
    return REAL_DECODE_STEP(model, params, dataclasses.replace(state, stop_state=forgotten), active, limit, keys,
                            fresh_from, sampler)


REAL_DECODE_STEP = mcmc_mod.decode_step


@pytest.mark.parametrize("wrong", [_proposal_ignores_the_stop, _automaton_restarted_at_the_cut],
                         ids=["proposal_ignores_stop", "automaton_restarted_at_cut"])
def test_wrong_stop_handling_is_not_stationary(model, stop_setup, monkeypatch, wrong):  # noqa: F811
    monkeypatch.setattr(mcmc_mod, "decode_step", wrong)
    jax.clear_caches()  # the jitted steps must be retraced with the mutant
    try:
        tv, threshold, _ = _stationary_tv(model, stop_setup, "power")
    finally:
        jax.clear_caches()
    print(f"{wrong.__name__}: TV {tv:.4f}, threshold {threshold:.4f}")
    assert tv > threshold, f"a wrong stop handling passed: TV {tv:.4f} < {threshold:.4f}"


# SMC: the weights see the end.

@pytest.mark.parametrize("case", sorted(SMC_CASES))
def test_smc_identity_with_a_stop(model, depth_setup, case):  # noqa: F811
    cfg, params = model
    tau = depth_setup[0]
    seqs = support(ends)
    _, logp, depth, _ = exact_stats(cfg, params, tau, seqs, ends)
    n, runs = SMALL_N[case], 3000
    smc = SMCConfig(alpha=ALPHA, n_particles=n, max_new_tokens=3, lens=LensConfig(lsub=LSUB, tau=tau),
                    eos_ids=(EOS,), stop=AUTOMATON, **SMC_CASES[case])
    lm = TransformerLM(cfg)
    toks, lens = pad_prompts([PROMPT], multiple=1)
    gen = prefill(lm, params, jnp.asarray(toks), jnp.asarray(lens), len(PROMPT) + 3, jnp.float32, True)
    keys = jax.random.split(jax.random.key(5), runs * n)
    state = run_smc(lm, params, repeat_rows(gen, runs * n), keys, smc)
    weights, log_z, _ = jax.device_get(final_weights(state, keys, n))
    tokens, length = jax.device_get((state.gen.tokens, state.gen.length))
    index_of = {x: i for i, x in enumerate(seqs)}
    index = np.array([index_of.get(tuple(tokens[r, len(PROMPT):length[r]].tolist()), len(seqs))
                      for r in range(runs * n)]).reshape(runs, n)

    @dataclasses.dataclass
    class Runs:
        index: np.ndarray
        weights: np.ndarray
        z_hat: np.ndarray

    z = identity_z((tau, seqs, logp, depth), case,
                   Runs(index, np.asarray(weights, np.float64), np.exp(np.asarray(log_z, np.float64))))
    print(f"{case}: max |z| {np.abs(z).max():.2f}")
    assert np.abs(z).max() < Z_MAX, f"E[Ẑ·Σ W̄ δ] differs from gamma with the stop: z = {np.round(z, 1)}"


# The command line and the run record.

def test_degs_sample_takes_stop_strings(degs):  # noqa: F811
    rc, out, err, _ = degs("sample", "def f():", "--method", "greedy", "--max-new-tokens", "6", "--json",
                           "--stop", r"\n#", "--stop", "xyz")
    assert rc == 0, err
    assert json.loads(out)["hyperparameters"]["stop"] == ["\n#", "xyz"]
    rc, out, err, loads = degs("sample", "def f():", "--stop", "")
    assert rc == 2 and loads == [] and err.startswith("degs: error: every stop string must be a non-empty string"), err


@pytest.mark.parametrize("flags, recorded", [((), list(HUMANEVAL_DECODING_STOPS)), (("--no-stop",), None),
                                             (("--stop", r"\n\n"), ["\n\n"])])
def test_humaneval_completions_stop_at_the_codex_stops_by_default(degs, tmp_path, flags, recorded):  # noqa: F811
    out = tmp_path / "run"
    rc, _, err, _ = degs("eval", "--benchmark", "humaneval", "--method", "greedy", "--limit", "1",
                         "--max-new-tokens", "4", "--batch-size", "1", "--no-progress", "--out", out, *flags)
    assert rc == 0, err
    run = json.loads((out / "run.json").read_text())
    assert run["config"]["chat"] is False  # the byte tokenizer has no chat template: completion format
    assert run["config"]["hyperparameters"].get("stop") == recorded  # none: not recorded, as before stops


def test_other_benchmarks_record_no_stop(degs, tmp_path):  # noqa: F811
    out = tmp_path / "run"
    rc, _, err, _ = degs("eval", "--benchmark", "gsm8k", "--method", "greedy", "--limit", "1",
                         "--max-new-tokens", "4", "--batch-size", "1", "--no-progress", "--out", out)
    assert rc == 0, err
    assert "stop" not in json.loads((out / "run.json").read_text())["config"]["hyperparameters"]


@pytest.mark.parametrize("stop, deviates", [(list(HUMANEVAL_DECODING_STOPS), False), (None, True), ([], True)])
def test_the_report_reads_the_recorded_stops(stop, deviates):
    from degs_jax.reproduce.deviations import _humaneval_end_rows

    run = {"run": {"config": {"hyperparameters": {"stop": stop}}}, "records": [{"ended": True}, {"ended": False}]}
    (row,) = _humaneval_end_rows({("runs", "humaneval", "greedy"): run})
    assert row["deviates"] == deviates
    assert row["used"].startswith("no stop sequences" if deviates else 'stop sequences ["\\nclass", "\\ndef"')
    assert row["effect"].startswith("final completions that ended without EOS or stop (at the cap): 50")


def test_the_sparse_automaton_is_the_transition_table():
    """Issue 58: the automaton is held sparse (a default row, per-state exceptions). On
    random vocabularies (empty tokens, multi-byte characters, ids past the tokenizer) and
    random stop strings: its host steps end every sequence where a search of the bytes
    does, and its device lookup (`next_state`, what decoding gathers) equals the host step
    at every (state, token)."""
    import jax.numpy as jnp

    rng = random.Random(1)
    alphabet = b"ab\nc\xc3\xa9"
    for _ in range(25):
        pieces = [bytes(rng.choice(alphabet) for _ in range(rng.randrange(0, 6)))
                  for _ in range(rng.randrange(5, 40))]
        stops = tuple({"".join(rng.choice(["a", "b", "\n", "c", "é"]) for _ in range(rng.randrange(1, 7)))
                       for _ in range(rng.randrange(1, 5))})
        vocab = len(pieces) + rng.randrange(0, 3)
        automaton = stop_automaton(stops, TokenBytes(pieces), vocab)
        full = pieces + [b""] * (vocab - len(pieces))
        for _ in range(60):
            tokens = [rng.randrange(vocab) for _ in range(rng.randrange(1, 9))]
            want = _first_stop_by_bytes(full, tokens, stops)
            states = [START]
            for token in tokens:
                states.append(automaton.step(states[-1], token))
                if states[-1] == STOPPED:
                    break
            assert (len(states) - 2 if states[-1] == STOPPED else None) == want, (stops, tokens)
        grid = [(s, t) for s in range(automaton.num_states) for t in range(vocab)]
        device = automaton.next_state(jnp.asarray([s for s, _ in grid]), jnp.asarray([t for _, t in grid]))
        assert [int(x) for x in device] == [automaton.step(s, t) for s, t in grid]


def test_a_long_stop_string_stays_small(monkeypatch):
    """10,000 characters of stop string over a 5,000-token vocabulary: about a hundred
    kilobytes, not a [10,001 x 5,000] table (100 MB); past the documented bound, one
    error (Qwen's vocabulary: docs/benchmarks.md, "Stop strings")."""
    import string

    import degs_jax.stops as stops_module

    rng = random.Random(2)
    letters = string.ascii_letters + string.digits
    pieces = [rng.choice(letters).encode() for _ in range(200)] + [
        "".join(rng.choice(letters) for _ in range(rng.randrange(2, 7))).encode() for _ in range(4_800)]
    long = "".join(rng.choice(letters) for _ in range(10_000))
    automaton = stop_automaton((long,), TokenBytes(pieces), len(pieces))
    assert automaton.num_states == 10_001
    dense_bytes = 10_001 * 5_000 * 2
    assert automaton.nbytes < dense_bytes / 200, automaton.nbytes
    monkeypatch.setattr(stops_module, "MAX_STOP_EXCEPTIONS", 100)
    with pytest.raises(ValueError, match=r"need more than 100 automaton transitions beside the default "
                                         "ones; give fewer or shorter stop strings"):
        stops_module.stop_automaton((long[:5000],), TokenBytes(pieces), len(pieces))
