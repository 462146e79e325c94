"""The `degs` command line on the embedded default model (SmolLM2-135M, CPU), with tiny
budgets: generate, sample (every statistic printed), probe, and clear errors."""

from __future__ import annotations

import json

import pytest

from degs_jax.cli import main

pytestmark = pytest.mark.slow


def test_generate_prints_a_continuation(capsys):
    assert main(["generate", "What is 2 + 2?", "--max-new-tokens", "8"]) == 0
    assert capsys.readouterr().out.strip()


def test_sample_degs_mcmc_reports_its_statistics(capsys):
    argv = ["sample", "What is 3 + 4?", "--method", "degs_mcmc", "--block-len", "8",
            "--num-blocks", "2", "--mh-steps", "2", "--seed", "3", "--json"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["method"] == "degs_mcmc" and report["seed"] == 3
    assert 0 < report["tokens"] <= 16
    assert report["log_p"] < 0
    assert 0.0 <= report["D"] <= 1.0
    assert 1 <= len(report["acceptance_per_block"]) <= 2
    assert all(0.0 <= a <= 1.0 for a in report["acceptance_per_block"])
    assert report["counters"]["probed_token_layers"] > 0
    assert report["forward_equivalents"] > report["counters"]["generated_tokens"]
    assert set(report["seconds"]) == {"prefill", "decode", "total"}
    # Same seed, same tokens.
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["completion"] == report["completion"]


@pytest.mark.parametrize("argv, message", [
    (["sample", "x", "--method", "nucleus"], "unknown method 'nucleus'"),
    (["sample", "x", "--method", "degs_mcmc", "--alpha", "0.5"], "alpha must be >= 1"),
    (["sample", "x", "--method", "greedy", "--block-len", "8"], "greedy does not take block_len"),
    (["sample", "x", "--method", "degs_mcmc", "--tau", "0"], "tau"),
])
def test_bad_input_exits_2_with_a_clear_message(capsys, argv, message):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_probe_scores_given_and_greedy_completions(tmp_path, capsys):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"id": "given", "prompt": "Say hello.", "completion": "Hello there!"})
                    + "\n" + json.dumps({"prompt": "What is 5 + 5?"}) + "\n")
    out = tmp_path / "probe"
    assert main(["probe", "--input", str(rows), "--out", str(out), "--max-new-tokens", "6"]) == 0
    records = [json.loads(line) for line in (out / "probe.jsonl").read_text().splitlines()]
    assert [r["id"] for r in records] == ["given", 1]
    assert records[0]["completion"] == "Hello there!"
    for r in records:
        assert 0.0 < r["D"] <= 1.0
        assert r["log_p"] < 0
        assert len(r["layer_entropy"]) == 31  # embeddings + 30 blocks of SmolLM2-135M
        assert r["mean_final_entropy"] >= 0
    assert (out / "entropy.png").stat().st_size > 1000
    assert main(["probe", "--input", str(tmp_path / "missing.jsonl"), "--out", str(out)]) == 2
    assert "not found" in capsys.readouterr().err


def test_mesh_option_splits_rows_and_refuses_uneven_heads(capsys):
    import jax

    # fp32: in bf16, the partitioned program rounds in other places (other fusions) and
    # greedy tokens of this model can differ from one device's.
    argv = ["generate", "What is 2 + 2?", "--max-new-tokens", "6", "--dtype", "float32"]
    assert main(argv) == 0
    alone = capsys.readouterr().out
    # Two data-parallel replicas on the 4 host devices of the test session: same tokens.
    assert main(argv + ["--mesh", "2x1"]) == 0
    assert capsys.readouterr().out == alone
    assert jax.sharding.get_abstract_mesh().empty  # the mesh ends with the command
    # SmolLM2-135M has 3 key/value heads: they cannot be split over 4 devices.
    assert main(argv + ["--mesh", "1x4"]) == 2
    assert "key/value heads (3) not divisible by 4" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(argv + ["--mesh", "4"])
    assert "DATAxMODEL" in capsys.readouterr().err
