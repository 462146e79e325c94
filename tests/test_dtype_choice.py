"""`dtype="auto"` (the default of `load` and of every command's --dtype): float32 on CPU,
bfloat16 on accelerators, decided from the platform name (so the choice is tested here
without a GPU), and a resumed run keeps the dtype it was made with."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import pytest
from safetensors.numpy import save_file

from degs_jax.cli import build_parser, main
from degs_jax.examples.byte_tokenizer import byte_tokenizer
from degs_jax.models import auto_dtype, init_params, load, resolve_dtype
from degs_jax.models.checkpoint import params_to_hf
from degs_jax.reproduce.study import recorded_dtype as study_dtype
from tiny_models import tiny_config


@pytest.mark.parametrize("platform,want", [("cpu", "float32"), ("CPU", "float32"), ("gpu", "bfloat16"),
                                           ("cuda", "bfloat16"), ("rocm", "bfloat16"),
                                           ("tpu", "bfloat16"), ("METAL", "bfloat16")])
def test_auto_chooses_float32_on_cpu_and_bfloat16_on_accelerators(platform, want):
    assert auto_dtype(platform) == want
    assert resolve_dtype("auto", platform) == want
    assert resolve_dtype(None, platform) == want


def test_explicit_dtypes_are_kept_and_bad_ones_refused():
    for given, want in [("float32", "float32"), ("bfloat16", "bfloat16"), (jnp.bfloat16, "bfloat16"),
                        (jnp.float32, "float32")]:
        assert resolve_dtype(given, "tpu") == resolve_dtype(given, "cpu") == want
    assert resolve_dtype("auto") == auto_dtype(jax.default_backend())  # this process's device
    for bad in ("float16", "fp32", "Auto"):
        with pytest.raises(ValueError, match=f"'auto', 'bfloat16' or 'float32', got '{bad}'"):
            resolve_dtype(bad, "cpu")


@pytest.mark.parametrize("argv", [["sample", "x"], ["generate", "x"], ["probe", "--input", "f", "--out", "o"],
                                  ["eval", "--benchmark", "gsm8k", "--out", "o"],
                                  ["reproduce", "--out", "o"]])
def test_every_command_defaults_to_auto(argv):
    assert build_parser().parse_args(argv).dtype == "auto"


def write_tiny_model(directory):
    """A tiny random Llama-style model with the byte tokenizer, as a HF directory (for
    `--model DIR`: a `degs` process loads and compiles it in seconds)."""
    cfg = dataclasses.replace(tiny_config(vocab=257, layers=2, hidden=32, head_dim=8, intermediate=48),
                              max_position_embeddings=2048)
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(cfg.to_hf()))
    save_file(params_to_hf(init_params(cfg, jax.random.key(3), jnp.float32, scale=0.1), cfg),
              str(directory / "model.safetensors"))
    byte_tokenizer().save_pretrained(directory)
    return directory


def test_load_defaults_to_float32_on_cpu(tmp_path):
    model = load(write_tiny_model(tmp_path / "m"), progress=False)
    assert {x.dtype for x in jax.tree.leaves(model.params)} == {jnp.dtype(jnp.float32)}


def test_a_resumed_eval_keeps_the_dtype_it_was_made_with(tmp_path, capsys):
    """A run begun in bfloat16 (the old default) resumed with the new default: loaded in
    bfloat16, one line saying so, the same configuration (no refusal); an explicit other
    --dtype is refused as before, and a new run records auto's float32."""
    model = write_tiny_model(tmp_path / "m")
    out = tmp_path / "run"
    argv = ["eval", "--model", str(model), "--benchmark", "gsm8k", "--method", "greedy",
            "--max-new-tokens", "4", "--limit", "1", "--out", str(out), "--no-progress"]
    assert main(argv + ["--dtype", "bfloat16"]) == 0
    capsys.readouterr()
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert (f"degs: resuming {out} in bfloat16, the dtype it was made with (--dtype auto would "
            "choose float32 here)") in err
    run = json.loads((out / "run.json").read_text())
    assert run["config"]["model"]["dtype"] == "bfloat16" and len(run["invocations"]) == 2
    assert main(argv + ["--dtype", "float32"]) == 2
    assert "model.dtype: stored 'bfloat16', requested 'float32'" in capsys.readouterr().err
    # the same dtype as auto's: no line
    fresh = tmp_path / "fresh"
    assert main([*argv[:-2], str(fresh), "--no-progress"]) == 0
    assert main([*argv[:-2], str(fresh), "--no-progress"]) == 0
    assert "resuming" not in capsys.readouterr().err
    assert json.loads((fresh / "run.json").read_text())["config"]["model"]["dtype"] == "float32"


def test_a_study_reports_the_dtype_of_its_runs(tmp_path):
    def run(directory, dtype):
        directory.mkdir(parents=True)
        (directory / "run.json").write_text(json.dumps(
            {"config": {"model": {"name": "m", "dtype": dtype}}, "invocations": []}))

    assert study_dtype(tmp_path) is None  # a new study
    run(tmp_path / "runs" / "gsm8k" / "greedy", "bfloat16")
    run(tmp_path / "pool" / "gsm8k", "bfloat16")
    (tmp_path / "runs" / "gsm8k" / "best_of_n").mkdir()  # begun, no run.json yet
    assert study_dtype(tmp_path) == "bfloat16"
    run(tmp_path / "runs" / "math500" / "greedy", "float32")
    with pytest.raises(ValueError, match=r"different dtypes \(bfloat16, float32\)"):
        study_dtype(tmp_path)
