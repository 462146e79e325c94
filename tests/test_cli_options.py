"""The decoder options of `degs sample` / `degs eval` are generated from the typed
hyperparameter dataclasses: one flag per command-line field, its --help built from the
field's documentation and default, values parsed to the field's type."""

from __future__ import annotations

import dataclasses

from degs_jax.cli import build_parser
from degs_jax.cli.options import _cli_fields, _hyperparameters
from degs_jax.methods import METHODS, method_classes


def _sample_parser():
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return sub.choices["sample"]


def test_every_command_line_field_has_a_flag_with_its_documentation_and_default():
    options = {a.dest: a for a in _sample_parser()._actions}
    shown = 0
    for method, cls in method_classes().items():
        for f in dataclasses.fields(cls):
            if not f.metadata["cli"]:
                assert f.name not in options, f"{f.name} is Python-only"
                continue
            action = options[f.name]
            assert action.default is None  # unset: the method's own default applies
            assert f.metadata["help"] in action.help
            if f.default is not None:
                assert f"{method}" in action.help or "every method" in action.help
                assert f"default {f.default}" in action.help
            shown += 1
    assert shown > 20  # 7 methods, most fields shown


def test_flags_parse_to_the_field_types_and_only_given_ones_are_passed_on():
    parser = _sample_parser()
    args = parser.parse_args(["p", "--method", "degs_mcmc", "--lsub", "2,4,6", "--alpha", "2",
                              "--mh-steps", "3", "--reference-quirks"])
    given = _hyperparameters(args)
    assert given == {"lsub": (2, 4, 6), "alpha": 2.0, "mh_steps": 3, "reference_quirks": True}
    assert type(given["alpha"]) is float and type(given["mh_steps"]) is int
    assert _hyperparameters(parser.parse_args(["p"])) == {}
    assert set(_cli_fields()) >= {"tau", "top_k", "max_new_tokens", "temperature", "n", "alpha",
                                  "beta", "block_len", "num_blocks", "mh_steps", "n_chains"}


def test_no_progress_also_silences_the_weight_loading_bars(monkeypatch, tmp_path, capsys):
    from degs_jax import cli

    seen = []

    def load(source, *, progress, **kwargs):
        seen.append(progress)
        raise ValueError("stopped after the load call")

    monkeypatch.setattr(cli.loading, "load", load)
    for extra, progress in (([], True), (["--no-progress"], False)):
        argv = ["eval", "--benchmark", "gsm8k", "--limit", "1", "--out", str(tmp_path / str(progress)),
                *extra]
        assert cli.main(argv) == 2
        assert "stopped after the load call" in capsys.readouterr().err
        assert seen.pop() is progress


def test_the_persistent_compilation_cache_is_the_programs_choice(monkeypatch, tmp_path, capsys):
    """`degs` (entry_point) turns JAX's process-wide persistent cache on; a Python caller of
    `main` keeps its own JAX configuration unless it names a directory; `degs reproduce
    --compilation-cache none` keeps it off (it used to be turned back on at the model load)."""
    from degs_jax import cli

    enabled = []
    monkeypatch.setattr(cli, "enable_compilation_cache", enabled.append)

    def load(source, **kwargs):
        raise ValueError("stopped at the load call")

    monkeypatch.setattr(cli.loading, "load", load)
    reproduce = ["reproduce", "--model", "m", "--out", str(tmp_path / "study"), "--benchmarks", "gsm8k",
                 "--methods", "greedy", "--pool-benchmarks", "none", "--no-layer-pass"]
    cases = [(["sample", "x"], False, []),
             (["sample", "x"], True, [None]),
             (reproduce, False, []),
             (reproduce, True, [None]),
             (reproduce + ["--compilation-cache", "none"], True, []),
             (reproduce + ["--compilation-cache", str(tmp_path / "xla")], False, [str(tmp_path / "xla")])]
    for argv, persistent, expected in cases:
        assert cli.main(argv, persistent_cache=persistent) == 2
        assert "stopped at the load call" in capsys.readouterr().err
        assert enabled == expected, (argv, persistent)
        enabled.clear()


def test_degs_sample_budgets_512_new_tokens_unless_told_and_eval_keeps_the_papers():
    """`degs sample`'s rule (cli.SAMPLE_MAX_NEW_TOKENS): 512 new tokens where the command
    line leaves the budget to the default (MCMC chains: ceil(512 / block_len) blocks);
    a given --max-new-tokens or --num-blocks is kept; `degs eval` keeps the paper's 3,072."""
    from degs_jax.cli import SAMPLE_MAX_NEW_TOKENS, sample_budget
    from degs_jax.cli.options import method_value

    assert SAMPLE_MAX_NEW_TOKENS == 512
    parser = build_parser()

    def budget(*flags):
        args = parser.parse_args(["sample", "x", *flags])
        return sample_budget(method_value(args), _hyperparameters(args))

    for method in METHODS:
        chosen = budget("--method", method)
        if method in ("power_mcmc", "degs_mcmc"):
            assert (chosen.block_len, chosen.num_blocks) == (192, 3)  # 576 >= 512 > 384
        else:
            assert chosen.max_new_tokens == 512, method
    assert budget("--method", "degs_mcmc", "--block-len", "32").num_blocks == 16
    assert budget("--method", "degs_mcmc", "--block-len", "32", "--num-blocks", "4").max_new_tokens == 128
    assert budget("--method", "degs_mcmc", "--num-blocks", "20").max_new_tokens == 20 * 192
    assert budget("--method", "greedy", "--max-new-tokens", "4000").max_new_tokens == 4000
    assert budget("--method", "scalable_power", "--max-new-tokens", "64").max_new_tokens == 64
    assert "at most 512 new tokens" in " ".join(_sample_parser().description.split())
    eval_args = parser.parse_args(["eval", "--benchmark", "gsm8k", "--out", "o", "--method", "greedy"])
    assert method_value(eval_args).max_new_tokens == 3072
