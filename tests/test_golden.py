"""Golden numbers: every decoder of `degs_jax.methods.METHODS`, on CPU, on a
tiny random transformer with fixed keys, gives the values recorded in
`tests/golden/decoders.json` (written from the code of 827a286, before the layering
refactor of issue 26; the `scalable_power` entry from 209f809, after issue 25 made SPS
draw its candidate blocks at temperature 1 by default). A refactor that claims to change
no numerics proves it here.

Recorded, for `decode` (every method): each candidate's tokens, log p, D(x), mean
final-layer entropy, EOS flag, MCMC acceptance per block and SMC weight; each prompt's
chosen candidate and diagnostics (SMC: log Z-hat, ESS per check, resamplings, copied
rows; SPS: rollouts); the work counters. For `decode_tokens`, on one sampling, one pool
and one MCMC method (`test_traced.py` ties the two drivers together): the whole final
`GenState` of every row (tokens, per-token log p, log q, d_t and final-layer entropy,
lengths, EOS flags, counters), the accepted MH steps and blocks run, the per-row scores
and the choices. Cases: the Qwen2-shaped model in float32 with EOS made likely (every
method; rows end early, late or never) and the Llama-shaped one in bfloat16 (DEGS-MCMC).
Compilation dominates the cost (~1 s of decoding against ~100 s of compiling on CPU),
so the methods and drivers recorded are the fewest that cover every code path. The
numbers are a user's: the test session compiles without LLVM's optimizations
(tests/xla_flags.py), which rounds some bfloat16 values differently, so the records are
computed in one process of their own compiled as a user's is, once per test run
(`users_records`).

What must match, and how closely:
- Everything discrete (tokens, lengths, EOS flags, the chosen candidate, accepted
  steps, resampling counts and copied rows, counters) and every float that a decoder
  computes from discrete choices alone (acceptance rates, D(x)) equals the record
  exactly: one different decision anywhere fails.
- The other floats (log probabilities, entropies, SMC weights, ESS, log Z-hat) agree to
  `RTOL` relative (and `ATOL` absolute, for values near 0). XLA's CPU code depends on
  the host beyond its instruction set: on an Intel Xeon with AVX-512 and AMX the same
  code, JAX and jaxlib give 195 of these floats different from the recording host's, by
  at most 5.7e-6 relative (65 float32 ulps, a log q near 0.5), and every discrete field
  equal. `RTOL` is about nine times that; a change of formula moves numbers by far more.
  Bitwise reproducibility on one host is what `test_batch_invariance.py` and the seeded
  tests check.

Floats are stored as `float.hex` of their float64 value (float32 and bfloat16 values
are exact in float64). Each entry stores the hyperparameters it was run at (`settings`,
beside tau), so the tests keep no table of them. `python tests/test_golden.py` records the
methods the file lacks (a new method's cases, at its `Method.smallest_run`; the others
kept as recorded); after a change that is *meant* to
move numbers, `python tests/test_golden.py METHOD ...` (or `--all`) records those again
(say why in the commit).
"""

from __future__ import annotations

import dataclasses
import fcntl
import functools
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Collection

from xla_flags import HOST_DEVICES, compiles_fast, one_host_device, users_flags

if __name__ == "__main__":  # the test session's CPU devices (tests/xla_flags.py), on CPU,
    # compiled as a user's process compiles
    os.environ["XLA_FLAGS"] = " ".join([one_host_device(users_flags(os.environ.get("XLA_FLAGS", ""))),
                                        HOST_DEVICES])
    os.environ["JAX_PLATFORMS"] = "cpu"

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from degs_jax.decoders import decode, decode_tokens
from degs_jax.generation import pad_prompts
from degs_jax.methods import METHODS, hyperparameters_for, method_classes
from degs_jax.models import TransformerLM
from degs_jax.models import init_params
from tiny_models import tiny_config

GOLDEN = Path(__file__).parent / "golden" / "decoders.json"
TAU = 3.3  # in the bulk of the tiny models' lens entropies: d_t takes several values
PROMPTS = [[3, 14, 15], [35, 89, 79, 32, 38, 46, 26]]
SEED = 7
# Small budgets with EOS likely enough that some rows end early (eos_biased): every
# method's end-of-row bookkeeping is exercised; SMC resamples (threshold 0.9, every
# 2 tokens), SPS runs several blocks with rollouts.
TRACED = ("temperature", "best_of_n", "degs_mcmc")  # recorded through `decode_tokens` too
RTOL = 5e-5  # relative tolerance of the floats that are not exact (module docstring)
ATOL = 1e-6  # absolute tolerance beside it, for floats near 0


@dataclasses.dataclass(frozen=True)
class Case:
    architecture: str
    dtype: str
    eos_likely: bool  # EOS probability ~0.02-0.2 at every step (else the rows use their budget)
    methods: tuple[str, ...]
    traced: tuple[str, ...] = ()


CASES = {
    "qwen2_float32": Case("Qwen2ForCausalLM", "float32", True, METHODS, TRACED),
    "llama_bfloat16": Case("LlamaForCausalLM", "bfloat16", False, ("degs_mcmc",)),
}
# Floats decided by discrete choices alone: they match exactly on every host.
EXACT_FLOATS = ("acceptance", "depth")
STATE_FIELDS = ("tokens", "logp", "logq", "depth", "final_entropy", "length", "prompt_len",
                "ended", "n_generated", "n_forward", "n_probed")


@functools.lru_cache(maxsize=None)
def _model(case: str):
    """The case's tiny random model (vocabulary 97, 3 layers, EOS = 96), its parameters
    and EOS ids."""
    spec = CASES[case]
    cfg = tiny_config(spec.architecture)
    params = init_params(cfg, jax.random.key(0), jnp.dtype(spec.dtype), scale=0.3)
    eos = cfg.eos_token_ids[0]
    if spec.eos_likely:  # every embedding shifted along unit 0, which the EOS row reads
        params = dataclasses.replace(params, embed=params.embed.at[:, 0].add(3.0),
                                     lm_head=params.lm_head.at[eos].set(0.0).at[eos, 0].set(2.0))
    return TransformerLM(cfg), params, cfg.eos_token_ids


def _keys():
    return jnp.stack([jax.random.fold_in(jax.random.key(SEED), i) for i in range(len(PROMPTS))])


def _plain(value):
    """JSON-able, with every float as the hex of its float64 value (bitwise)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (np.ndarray, jax.Array)):
        array = np.asarray(value)
        if array.dtype.kind == "f" or array.dtype == jnp.bfloat16:
            array = array.astype(np.float64)
        return _plain(array.tolist())
    if isinstance(value, (np.floating, float)):
        return float(value).hex()
    if isinstance(value, (np.integer, np.bool_)):
        return value.item()
    return value


def _decode_record(model, params, eos, method, settings) -> dict:
    result = decode(model, params, PROMPTS, method, keys=_keys(), eos_ids=eos, **{"tau": TAU, **settings})
    return _plain({
        "outputs": [{"chosen": next(j for j, c in enumerate(o.candidates) if c is o.chosen),
                     "candidates": [{"tokens": c.tokens, "log_p": c.log_p, "depth": c.depth,
                                     "final_entropy": c.final_entropy, "ended": c.ended,
                                     "acceptance": c.acceptance, "weight": c.weight}
                                    for c in o.candidates],
                     "diagnostics": o.diagnostics}
                    for o in result.outputs],
        "counters": result.counters,
    })


def _decode_tokens_record(model, params, eos, method, settings) -> dict:
    tokens, lengths = pad_prompts(PROMPTS)
    config = hyperparameters_for(method, tau=TAU, **settings)
    out = jax.device_get(decode_tokens(model, params, jnp.asarray(tokens), jnp.asarray(lengths), _keys(),
                                       config, eos_ids=tuple(eos)))
    return _plain({"state": {f: getattr(out.state, f) for f in STATE_FIELDS},
                   "accepted": out.accepted, "ran": out.ran, "log_p": out.log_p,
                   "depth": out.depth, "final_entropy": out.final_entropy, "chosen": out.chosen})


def record(case: str, method: str, settings: dict) -> dict:
    """The case's record of `method` run at `settings` (its hyperparameters beside tau),
    stored with it."""
    model, params, eos = _model(case)
    out = {"settings": settings, "decode": _decode_record(model, params, eos, method, settings)}
    if method in CASES[case].traced:
        out["decode_tokens"] = _decode_tokens_record(model, params, eos, method, settings)
    return out


def record_all(golden: dict) -> dict:
    """Every (case, method) of the golden file recorded again at the settings it was
    recorded with: {case: {method: record}}."""
    return {case: {method: record(case, method, golden[case][method]["settings"])
                   for method in spec.methods if method in golden.get(case, {})}
            for case, spec in CASES.items()}


@pytest.fixture(scope="module")
def users_records(golden):
    """`record_all`, from programs compiled as a user's process compiles them: in this
    process if it does, else (the test session's fast compilation, tests/xla_flags.py) in
    one process of its own (`python tests/test_golden.py --record-all`, whose `__main__`
    drops the fast flags), which shares the run's persistent compilation cache
    (tests/conftest.py). The records are computed once per test run: the first xdist
    worker to need them writes them beside that cache, under a lock another worker
    waits on before it reads them."""
    flags = os.environ.get("XLA_FLAGS", "")
    if not compiles_fast(flags):
        return record_all(golden)
    cache = Path(os.environ["DEGS_JAX_CACHE"])
    shared = cache / "golden_records.json"
    with open(cache / "golden_records.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not shared.exists():
            child = subprocess.run([sys.executable, __file__, "--record-all", str(cache / "xla")],
                                   capture_output=True, text=True, timeout=900)
            assert child.returncode == 0, child.stderr
            shared.write_text(child.stdout)
    return json.loads(shared.read_text())


def first_difference(want, got, path="") -> str | None:
    """The first path where two records differ, with both values, or None."""
    if isinstance(want, dict) and isinstance(got, dict):
        for k in sorted(set(want) | set(got)):
            if k not in want or k not in got:
                return f"{path}/{k}: {'missing now' if k not in got else 'new'}"
            found = first_difference(want[k], got[k], f"{path}/{k}")
            if found:
                return found
        return None
    if isinstance(want, list) and isinstance(got, list):
        if len(want) != len(got):
            return f"{path}: length {len(want)} recorded, {len(got)} now"
        for i, (a, b) in enumerate(zip(want, got)):
            found = first_difference(a, b, f"{path}[{i}]")
            if found:
                return found
        return None
    if want == got:
        return None
    shown = [_float(v) for v in (want, got)]
    if (None not in shown and math.isfinite(shown[0]) and _inexact(path)
            and abs(shown[1] - shown[0]) <= ATOL + RTOL * abs(shown[0])):
        return None
    return f"{path}: recorded {want} ({shown[0]}), now {got} ({shown[1]})"


def _float(value) -> float | None:
    """A recorded float (its hex), or None for anything else."""
    if isinstance(value, str):
        try:
            return float.fromhex(value)
        except ValueError:
            return None
    return None


def _inexact(path: str) -> bool:
    """Whether the record's field at `path` is a float that may move with the host."""
    field = path.rsplit("/", 1)[-1].split("[")[0]
    return field not in EXACT_FLOATS


@pytest.fixture(scope="module")
def golden():
    return json.loads(GOLDEN.read_text())


def test_golden_file_covers_every_method(golden):
    assert {case: set(golden[case]) for case in golden} == {
        case: set(spec.methods) for case, spec in CASES.items()}
    assert set(CASES["qwen2_float32"].methods) == set(METHODS)
    for method in TRACED:
        assert "decode_tokens" in golden["qwen2_float32"][method]
    # The recorded runs exercise what they claim: some rows end early, chains accept and
    # reject, SMC resamples.
    rows = [c for o in golden["qwen2_float32"]["degs_mcmc"]["decode"]["outputs"] for c in o["candidates"]]
    assert any(c["ended"] for c in rows) and not all(c["ended"] for c in rows)
    rates = {float.fromhex(a) for c in rows for a in c["acceptance"]}
    assert len(rates) > 1, rates
    smc = golden["qwen2_float32"]["degs_smc"]["decode"]["outputs"]
    assert any(o["diagnostics"]["resamples"] > 0 for o in smc)


@pytest.mark.parametrize("case, method", [(c, m) for c, spec in CASES.items() for m in spec.methods])
def test_decoders_match_the_golden_file(golden, users_records, case, method):
    difference = first_difference(golden[case][method], users_records[case][method], f"{case}/{method}")
    assert difference is None, f"numbers moved: {difference}"


def test_first_difference_tolerates_only_what_a_host_moves():
    value = 0.5
    recorded = _plain({"log_p": [value], "depth": [value], "tokens": [3]})
    assert first_difference(recorded, _plain({"log_p": [value], "depth": [value], "tokens": [3]})) is None
    # a float that may move with the host: within the tolerance passes, beyond it fails
    assert first_difference(recorded, _plain({"log_p": [value * (1 + RTOL / 2)], "depth": [value],
                                              "tokens": [3]})) is None
    assert first_difference(recorded, _plain({"log_p": [value * (1 + 2 * RTOL)], "depth": [value],
                                              "tokens": [3]})) == (
        f"/log_p[0]: recorded {value.hex()} ({value}), now {(value * (1 + 2 * RTOL)).hex()} "
        f"({value * (1 + 2 * RTOL)})")
    # exact fields: one ulp of D(x), one token
    assert first_difference(recorded, _plain({"log_p": [value], "depth": [math.nextafter(value, 1.0)],
                                              "tokens": [3]})) is not None
    assert first_difference(recorded, _plain({"log_p": [value], "depth": [value], "tokens": [4]})) is not None


def updated_golden(recorded: dict, rewrite: Collection[str], record_case=record) -> tuple[dict, list[str]]:
    """The golden file's content with every (case, method) of CASES that `recorded` lacks
    recorded from the current code at the method's smallest run (`Method.smallest_run`),
    the methods in `rewrite` recorded again at the settings they were recorded with, and
    the others kept as they were (a new method's cases are added without touching the
    others'); cases and methods no longer in CASES are dropped. Returns (content,
    "case/method" written)."""
    out, written = {}, []
    for case, spec in CASES.items():
        out[case] = {}
        for method in spec.methods:
            known = recorded.get(case, {}).get(method)
            if method in rewrite or known is None:
                settings = known["settings"] if known else dict(method_classes()[method].smallest_run)
                out[case][method] = record_case(case, method, settings)
                written.append(f"{case}/{method}")
            else:
                out[case][method] = recorded[case][method]
    return out, written


def test_golden_writer_adds_without_rewriting():
    """A method missing from the file is recorded; the recorded ones are kept as they are,
    unless named; a method that left CASES is dropped."""
    fake = lambda case, method, settings: {"new": f"{case}/{method}", "settings": settings}
    recorded = {case: {m: {"old": m, "settings": {"as": "recorded"}} for m in spec.methods if m != "greedy"}
                for case, spec in CASES.items()}
    recorded["qwen2_float32"]["retired_method"] = {"old": "retired"}
    out, written = updated_golden(recorded, (), fake)
    assert written == ["qwen2_float32/greedy"]
    assert out["qwen2_float32"]["greedy"] == {"new": "qwen2_float32/greedy", "settings": {"max_new_tokens": 6}}
    assert out["qwen2_float32"]["degs_mcmc"] == recorded["qwen2_float32"]["degs_mcmc"]
    assert "retired_method" not in out["qwen2_float32"]
    out, written = updated_golden(recorded, ("degs_mcmc",), fake)
    assert written == ["qwen2_float32/greedy", "qwen2_float32/degs_mcmc", "llama_bfloat16/degs_mcmc"]
    # recorded again at the settings it was recorded with, not at today's smallest run
    assert out["qwen2_float32"]["degs_mcmc"] == {"new": "qwen2_float32/degs_mcmc", "settings": {"as": "recorded"}}


if __name__ == "__main__":
    # python tests/test_golden.py            record the methods the file lacks (a new method)
    # python tests/test_golden.py M [M ...]  also record these again (a change meant to
    #                                        move their numbers: say why in the commit)
    # python tests/test_golden.py --all      record everything again
    names = sys.argv[1:]
    if names[:1] == ["--record-all"]:  # every record on stdout (`users_records`)
        from degs_jax.models.compilation import enable_compilation_cache

        enable_compilation_cache(names[1])
        print(json.dumps(record_all(json.loads(GOLDEN.read_text()))))
        sys.exit(0)
    rewrite = METHODS if names == ["--all"] else names
    unknown = sorted(set(rewrite) - set(METHODS))
    if unknown:
        sys.exit(f"test_golden.py: unknown methods {', '.join(unknown)}; the methods: {', '.join(METHODS)}")
    GOLDEN.parent.mkdir(exist_ok=True)
    recorded = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
    golden, written = updated_golden(recorded, rewrite)
    GOLDEN.write_text(json.dumps(golden, indent=1, sort_keys=True) + "\n")
    print(f"wrote {GOLDEN}: recorded {', '.join(written) or 'nothing'}; kept the others", file=sys.stderr)
