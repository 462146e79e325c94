"""A method of a user's own package (docs/extending.md): the walk-through run exactly as
written, and the registry's rules in-process.

The walk-through takes the package's files and the commands from the page itself:
installs the package with pip (into a directory on PYTHONPATH, what `pip install` writes
into site-packages: its module and a .dist-info with the entry points), checks that
`degs sample --help` lists the method and its hyperparameter, starts the page's
`degs eval`, kills it after its first record, repeats it to resume, and repeats it once
more where the package is not installed (in this process, which never saw it). The
commands run as the page gives them, with a tiny random model, a short budget and a
smaller pool appended (later options win), so that each process loads and compiles in
seconds.
"""

import dataclasses
import json
import re
import shlex
import subprocess
import sys
import warnings
from pathlib import Path
from typing import ClassVar

import pytest

import degs_jax.method
from degs_jax import cli
from degs_jax.methods import (METHODS, hyperparameters_for, method_classes, method_from_record,
                              method_origin)
from degs_jax.method import method_field
from degs_jax.reproduce.study import TABLE1_ORDER, StudyRequest, available_methods
from degs_jax.sampling import BestOfN
from test_dtype_choice import write_tiny_model
from test_cli_hostile import degs, tiny_model  # noqa: F401 (fixtures)
from test_eval_cli import _count_lines, _records, kill_after_first_record, process_env

PAGE = Path(__file__).resolve().parents[1] / "docs" / "extending.md"
# What the test appends to the page's `degs eval`: a tiny model, 8 new tokens, a pool of 2,
# one problem per slot, PROBLEMS problems. Once compiled, a problem takes ~6 ms here (60
# were written within 0.37 s of the first record, measured; with 6 the kill, which the
# test's poll sends up to 50 ms after the first record and later on a busy machine, once
# came after the last), so the kill lands with most of them left to do.
PROBLEMS = 100
CHEAP = ["--model", "{model}", "--max-new-tokens", "8", "--n", "2", "--batch-size", "1", "--limit", str(PROBLEMS),
         "--no-progress"]


def page_files(text: str) -> dict[str, str]:
    """The page's files: each code block whose first line is a comment naming its path
    (the page's other blocks are examples)."""
    files = {}
    for block in re.findall(r"```(?:python|toml)\n(.*?)```", text, flags=re.S):
        first, _, rest = block.partition("\n")
        path = first.removeprefix("# ")
        if path == first or " " in path:
            continue
        files[path] = block if path.endswith(".py") else rest  # (a Python file keeps its comment)
    return files


def page_commands(text: str) -> list[list[str]]:
    """The page's shell commands (its ```bash block), split into arguments."""
    (block,) = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    return [shlex.split(line) for line in block.splitlines() if line.strip()]


def _process(argv):
    """A `degs ...` command line as this interpreter runs it."""
    assert argv[0] == "degs"
    return [sys.executable, "-m", "degs_jax.cli", *argv[1:]]


def _degs(argv, env, cwd):
    return subprocess.run(_process(argv), env=env, cwd=cwd, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_the_walk_through_installs_lists_runs_and_resumes_a_users_method(tmp_path, monkeypatch, capsys):
    text = PAGE.read_text()
    files = page_files(text)
    assert set(files) == {"my-methods/my_methods.py", "my-methods/pyproject.toml"}
    for path, content in files.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(content)
    install, help_cmd, eval_cmd = page_commands(text)
    assert install[:3] == ["pip", "install", "-e"] and help_cmd == ["degs", "sample", "--help"]
    assert eval_cmd[:2] == ["degs", "eval"] and "entropy_penalized" in eval_cmd

    # pip install, into a directory on PYTHONPATH (the environment stays as it is)
    site = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                           "--no-build-isolation", "--no-index", "--target", str(site), install[-1]],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    installed = process_env(tmp_path, PYTHONPATH=str(site))

    shown = _degs(help_cmd, installed, tmp_path)
    assert shown.returncode == 0, shown.stderr[-3000:]
    help_text = " ".join(shown.stdout.split())
    assert re.search(r"decoders: greedy, .*scalable_power, entropy_penalized \(", help_text)
    assert ("--gamma GAMMA weight of the mean final-layer entropy subtracted from log p(x) "
            "(entropy_penalized: default 1.0)") in help_text

    model = write_tiny_model(tmp_path / "tiny")
    argv = [a.replace("{model}", str(model)) for a in eval_cmd + CHEAP]
    out = tmp_path / "runs" / "dm-ep"
    kill_after_first_record(_process(argv), installed, out, tmp_path / "killed.log", cwd=tmp_path)
    first = (out / "results.jsonl").read_bytes()
    assert 1 <= _count_lines(out / "results.jsonl") < PROBLEMS  # killed mid-run, with a record written

    resumed = _degs(argv, installed, tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "accuracy" in resumed.stdout
    records = _records(out)
    assert sorted(r["index"] for r in records) == list(range(PROBLEMS))  # nothing lost, nothing repeated
    for r in records:  # the method's own statistic of the chosen candidate (gamma 1; float32)
        assert r["extras"]["penalized_score"] == pytest.approx(r["log_p"] - r["final_entropy"], rel=1e-5, abs=1e-5)
    mean = sum(r["extras"]["penalized_score"] for r in records) / PROBLEMS  # summarised (float64 sums)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["extras"] == {"penalized_score": {"mean": pytest.approx(mean, rel=1e-12), "n": PROBLEMS}}
    assert re.search(rf"^  mean penalized_score +{summary['extras']['penalized_score']['mean']:.4g}$",
                     resumed.stdout, re.M)
    assert (out / "results.jsonl").read_bytes().startswith(first[:first.rindex(b"\n") + 1])
    run = json.loads((out / "run.json").read_text())
    assert run["config"]["method"] == "entropy_penalized"
    assert run["config"]["hyperparameters"]["gamma"] == 1.0 and run["config"]["hyperparameters"]["n"] == 2
    assert run["config"]["method_origin"] == {"module": "my_methods", "distribution": "my-methods"}
    assert [i["versions"]["my-methods"] for i in run["invocations"]] == ["0.1.0", "0.1.0"]

    # where the package is not installed (this process: it never saw `site`), before loading
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert cli.main(argv[1:]) == 2
    error = capsys.readouterr().err
    assert error == ("degs: error: runs/dm-ep/run.json: the method 'entropy_penalized' comes from the "
                     "package 'my-methods' (module my_methods), which is not installed here; install it "
                     "to use this run\n")
    assert error.strip() in text  # the page quotes it


# --------------------------------------------------------------------------- the registry


@pytest.fixture
def registry(monkeypatch):
    """Classes the test defines are registered only for the test."""
    monkeypatch.setattr(degs_jax.method, "_REGISTERED", dict(degs_jax.method._REGISTERED))


def _define(name, base=BestOfN, **namespace):
    body = {"__module__": "my_script", "__qualname__": f"Rule_{name}", "method": name,
            "__annotations__": {"method": ClassVar[str]}, **namespace}
    return dataclasses.dataclass(frozen=True)(type(f"Rule_{name}", (base,), body))


def test_a_class_with_a_name_registers_itself(registry):
    rule = _define("my_rule", weight=method_field(2.0, "a weight"),
                   __annotations__={"method": ClassVar[str], "weight": float})
    assert list(method_classes())[-1] == "my_rule"  # after the library's
    assert list(method_classes())[:len(METHODS)] == list(METHODS)
    assert "my_rule" not in METHODS  # the library's methods only
    assert hyperparameters_for("my_rule", weight=3.0) == rule(weight=3.0)
    assert method_origin(rule) == {"module": "my_script", "distribution": None}
    assert method_origin(BestOfN) == {"module": "degs_jax.sampling", "distribution": "degs-jax"}
    assert _define("my_rule") is method_classes()["my_rule"]  # defined again: the new class


def test_names_are_checked_when_the_class_is_defined(registry):
    with pytest.raises(TypeError, match="'best_of_n' is taken by degs_jax.sampling.BestOfN"):
        _define("best_of_n")
    with pytest.raises(TypeError, match="must be lower-case letters"):
        _define("My-Rule")
    with pytest.raises(TypeError, match="subclasses the method 'best_of_n': give it a name of its own"):
        type("Unnamed", (BestOfN,), {})  # its runs would record, and resume as, best_of_n


def test_the_registrys_old_name_warns_and_is_the_same_module(monkeypatch):
    """`degs_jax.hyperparameters` (the registry's name until issue 54, shown in the README
    and docs/sweeps.md) still imports, with a DeprecationWarning, as `degs_jax.methods`."""
    import sys

    import degs_jax.methods

    monkeypatch.delitem(sys.modules, "degs_jax.hyperparameters", raising=False)
    with pytest.warns(DeprecationWarning, match="degs_jax.hyperparameters is now degs_jax.methods"):
        from degs_jax.hyperparameters import DegsMCMC, method_classes
    assert sys.modules["degs_jax.hyperparameters"] is degs_jax.methods
    assert (DegsMCMC, method_classes) == (degs_jax.methods.DegsMCMC, degs_jax.methods.method_classes)


def test_a_record_of_a_method_not_installed_names_its_package():
    record = {"method": "nowhere", "hyperparameters": {},
              "method_origin": {"module": "their_methods", "distribution": "their-methods"}}
    with pytest.raises(ValueError, match=r"^runs/x/run.json: the method 'nowhere' comes from the package "
                                         r"'their-methods' \(module their_methods\), which is not installed"):
        method_from_record(record, "runs/x/run.json")
    record["method_origin"] = {"module": "__main__", "distribution": None}
    with pytest.raises(ValueError, match="defined in the module __main__, which no installed package"):
        method_from_record(record, "runs/x/run.json")


def test_the_default_study_is_the_papers_and_a_users_method_joins_when_named(registry):
    _define("my_rule")
    assert available_methods() == TABLE1_ORDER + ("my_rule",)
    from degs_jax.cli import build_parser
    from degs_jax.cli.reproduction import build_request

    args = build_parser().parse_args(["reproduce", "--out", "o", "--benchmarks", "gsm8k"])
    assert build_request(args).methods == TABLE1_ORDER
    args = build_parser().parse_args(["reproduce", "--out", "o", "--benchmarks", "gsm8k",
                                      "--methods", "best_of_n,my_rule"])
    assert build_request(args).methods == ("best_of_n", "my_rule")
    assert StudyRequest(benchmarks={"gsm8k": 2}, methods=("my_rule",)).methods == ("my_rule",)


def _installed_package(site, module, entry_points, source=""):
    """What pip installs, by hand: `module`.py and a .dist-info naming its entry points."""
    (site / f"{module}.py").write_text(source)
    info = site / f"{module}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module.replace('_', '-')}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[degs_jax.methods]\n" + entry_points)


def test_installed_packages_are_loaded_once_and_a_broken_one_is_a_warning(registry, monkeypatch, tmp_path):
    import degs_jax.methods as registry_module

    _installed_package(tmp_path, "pkg_rule_ok", "ok_rule = pkg_rule_ok:OkRule\n",
                       "import dataclasses\nfrom typing import ClassVar\nfrom degs_jax.sampling import BestOfN\n\n"
                       "@dataclasses.dataclass(frozen=True)\nclass OkRule(BestOfN):\n"
                       "    method: ClassVar[str] = 'ok_rule'\n")
    _installed_package(tmp_path, "pkg_rule_broken", "broken_rule = pkg_rule_broken:Missing\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry_module, "_installed", None)  # as in a fresh process
    with pytest.warns(UserWarning, match="the method 'broken_rule' of the package 'pkg-rule-broken' "
                                         r"\(pkg_rule_broken:Missing\) did not load: AttributeError"):
        classes = method_classes()
    assert list(classes)[len(METHODS):] == ["ok_rule"] and "broken_rule" not in classes
    assert method_origin(classes["ok_rule"]) == {"module": "pkg_rule_ok", "distribution": "pkg-rule-ok"}


def test_the_pages_truncation_example_runs():
    """The page's per-token rule (a `Truncation` subclass) as written: it cuts, the proposal
    renormalises over what it keeps, and an MCMC chain's proposal carries it."""
    import jax
    import numpy as np

    (block,) = re.findall(r"## A per-token sampling rule.*?```python\n(.*?)```", PAGE.read_text(), flags=re.S)
    namespace = {"__name__": "page_example"}
    exec(block, namespace)
    z = 3.0 * jax.random.normal(jax.random.key(0), (2, 50))
    log_q = np.asarray(namespace["spec"].proposal.log_density(z))
    kept = np.isfinite(log_q)
    assert 1 <= kept.sum(axis=1).min() and kept.sum(axis=1).max() < 50
    np.testing.assert_allclose(np.exp(log_q.astype(np.float64)).sum(axis=1), 1.0, atol=1e-5)
    assert namespace["chain"].proposal.proposal.truncations == (namespace["Epsilon"](3e-4),)


def test_a_package_that_exits_or_misnames_its_method_is_one_warning_and_never_runs(
        registry, monkeypatch, tmp_path):
    """Issue 58: a package whose import raises SystemExit (after defining a method class),
    and an entry point whose name is not its class's method, are each one warning naming
    the package; neither class is offered, and the tool works (its parser, every library
    method)."""
    import degs_jax.methods as registry_module
    from degs_jax.cli import build_parser

    rule = ("import dataclasses\nfrom typing import ClassVar\nfrom degs_jax.sampling import BestOfN\n\n"
            "@dataclasses.dataclass(frozen=True)\nclass {cls}(BestOfN):\n"
            "    method: ClassVar[str] = '{name}'\n")
    _installed_package(tmp_path, "pkg_rule_exits", "exits_rule = pkg_rule_exits:ExitsRule\n",
                       rule.format(cls="ExitsRule", name="exits_rule") + "raise SystemExit(3)\n")
    _installed_package(tmp_path, "pkg_rule_misnamed", "wrong_name = pkg_rule_misnamed:Misnamed\n",
                       rule.format(cls="Misnamed", name="misnamed_rule"))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry_module, "_installed", None)  # as in a fresh process
    monkeypatch.setattr(registry_module, "_refused", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        classes = method_classes()
    messages = sorted(str(w.message) for w in caught)
    assert messages == [
        "the entry point 'wrong_name' of the package 'pkg-rule-misnamed' (pkg_rule_misnamed:Misnamed) "
        "is not the class of the method 'wrong_name' (its class is the method 'misnamed_rule'); ignored",
        "the method 'exits_rule' of the package 'pkg-rule-exits' (pkg_rule_exits:ExitsRule) did not "
        "load: SystemExit: 3"], messages
    assert list(classes) == list(METHODS)  # neither exits_rule nor misnamed_rule
    with pytest.raises(ValueError, match="unknown method 'misnamed_rule'"):
        hyperparameters_for("misnamed_rule")
    assert "misnamed_rule" not in build_parser().format_help()
    assert hyperparameters_for("best_of_n", n=2).n == 2


# --------------------------------------------------------------------------- issue 54, item 4


def test_a_pool_rule_on_lengths_needs_only_pool_score(registry):
    """A length-rewarding rerank (log p(x) + bonus · length) is one `pool_score` over
    `PoolRows`: both drivers pick what the candidates' own lengths and log p say, which is
    not what best_of_n picks; the rows it sees hold each candidate's tokens (NO_TOKEN past
    its end), length and end flag, as the candidates report them."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from degs_jax.decoders import decode, decode_tokens
    from degs_jax.generation import pad_prompts
    from degs_jax.method import NO_TOKEN
    from test_drivers import PROMPTS, transformer

    seen = []

    @dataclasses.dataclass(frozen=True)
    class LengthBonus(BestOfN):
        method: ClassVar[str] = "length_bonus"
        bonus: float = method_field(10.0, "log p(x) gained per completion token")

        def pool_score(self, rows):
            if not isinstance(rows.length, jax.core.Tracer):  # (decode's host call: keep what it saw)
                seen.append(jax.device_get(rows))
            return rows.log_p + self.bonus * rows.length

    lm, params, eos = transformer()  # EOS likely: some candidates end early
    keys = jax.random.split(jax.random.key(1), len(PROMPTS))
    config = LengthBonus(n=4, max_new_tokens=6)
    result = decode(lm, params, PROMPTS, config, keys=keys, eos_ids=eos)
    (rows,) = seen
    pool = [c for o in result.outputs for c in o.candidates]
    lengths = np.array([len(c.tokens) for c in pool])
    np.testing.assert_array_equal(rows.length, lengths)
    np.testing.assert_array_equal(rows.ended, [c.ended for c in pool])
    assert rows.tokens.shape == (len(pool), 6)
    for r, c in enumerate(pool):
        assert rows.tokens[r].tolist() == c.tokens + [NO_TOKEN] * (6 - len(c.tokens))
    log_p = np.array([c.log_p for c in pool])
    want = np.argmax((log_p + 10.0 * lengths).reshape(-1, 4), axis=1)
    assert len(set(lengths)) > 1 and (want != np.argmax(log_p.reshape(-1, 4), axis=1)).any()  # the rule decides
    assert [o.candidates.index(o.chosen) for o in result.outputs] == want.tolist()
    tokens, prompt_len = pad_prompts(PROMPTS)
    decoded = decode_tokens(lm, params, jnp.asarray(tokens), jnp.asarray(prompt_len), keys, config, eos)
    assert jax.device_get(decoded.chosen).tolist() == want.tolist()  # the same rule, traced


def test_a_method_missing_a_hook_fails_when_defined_naming_it(registry):
    """A class with a method name that leaves a hook of its family open is one TypeError
    where it is defined, naming every missing hook (and it is not registered); a family
    without a name may leave them to its methods."""
    import degs_jax.method as method_module
    from degs_jax.mcmc import DegsMCMC
    from degs_jax.sampling import SamplingMethod

    def kernel_hooks(*left_out):
        hooks = {name: (lambda self, *args: None) for name in
                 ("kernel_config", "init", "advance", "prompt_done", "answer", "progress_total", "progress")}
        hooks["probed"] = property(lambda self: False)
        return {k: v for k, v in hooks.items() if k not in left_out}

    with pytest.raises(TypeError, match=r"^my_script\.Rule_own_kernel \(the method 'own_kernel'\) does not define "
                                        r"max_new_tokens \(a field or a property\), probed, progress: "):
        _define("own_kernel", base=degs_jax.method.Method, **kernel_hooks("progress", "probed"))
    with pytest.raises(TypeError, match=r"\(the method 'no_temperature'\) does not define temperature_of: "):
        _define("no_temperature", base=SamplingMethod)
    with pytest.raises(TypeError, match=r"\(the method 'half_checkpoints'\) does not define checkpoint, resume: "):
        _define("half_checkpoints", base=BestOfN, checkpoint_versions=lambda self, carry: None)
    assert not {"own_kernel", "no_temperature", "half_checkpoints"} & set(method_classes())

    # a family (no name) leaves hooks open; its method defines the rest
    family = dataclasses.dataclass(frozen=True)(type("KernelFamily", (method_module.Method,), {
        "__module__": "my_script", **kernel_hooks("progress")}))
    with pytest.raises(TypeError, match="abstract"):
        family()  # (an abstract class)
    done = _define("own_kernel", base=family, progress=lambda self, carry: 0,
                   max_new_tokens=method_field(4, "budget"), __annotations__={"method": ClassVar[str],
                                                                              "max_new_tokens": int})
    assert method_classes()["own_kernel"] is done and done().max_new_tokens == 4
    # a budget given as a property or as a field without a default, and a library
    # method's subclass: nothing missing
    _define("budget_property", base=family, progress=lambda self, carry: 0, max_new_tokens=property(lambda s: 4))
    budget_field = dataclasses.dataclass(frozen=True, kw_only=True)(type("Rule_kw", (family,), {
        "__module__": "my_script", "method": "budget_field", "progress": lambda self, carry: 0,
        "__annotations__": {"method": ClassVar[str], "max_new_tokens": int}}))
    assert budget_field(max_new_tokens=3).max_new_tokens == 3
    _define("my_chain", base=DegsMCMC)


def test_an_installed_methods_name_is_the_same_error_in_either_load_order(registry, monkeypatch, tmp_path):
    """A script's class under a name an installed package declares fails where it is
    defined with one message, whether the package was loaded before it or not; the
    package's class is offered either way."""
    import degs_jax.methods as registry_module

    _installed_package(tmp_path, "pkg_rule_owner", "owned_rule = pkg_rule_owner:OwnedRule\n",
                       "import dataclasses\nfrom typing import ClassVar\nfrom degs_jax.sampling import BestOfN\n\n"
                       "@dataclasses.dataclass(frozen=True)\nclass OwnedRule(BestOfN):\n"
                       "    method: ClassVar[str] = 'owned_rule'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    message = (r"^my_script\.Rule_owned_rule: the method name 'owned_rule' is taken by the installed package "
               r"'pkg-rule-owner' \(pkg_rule_owner:OwnedRule\); choose another$")
    errors, before = [], dict(degs_jax.method._REGISTERED)
    for package_first in (True, False):  # each as in a fresh process
        monkeypatch.setattr(registry_module, "_installed", None)
        monkeypatch.setattr(degs_jax.method, "_REGISTERED", dict(before))
        monkeypatch.delitem(sys.modules, "pkg_rule_owner", raising=False)
        if package_first:
            method_classes()
        with pytest.raises(TypeError, match=message) as info:
            _define("owned_rule")
        errors.append(str(info.value))
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the package loads as it would alone
            classes = method_classes()
        assert classes["owned_rule"].__module__ == "pkg_rule_owner"
    assert errors[0] == errors[1]
    # the package's own class, where its entry point names a re-export of it, is its own
    monkeypatch.setattr(degs_jax.method, "_REGISTERED", dict(before))
    own = _define("owned_rule", __module__="pkg_rule_owner.rules")
    assert degs_jax.method.registered_methods()["owned_rule"] is own


def test_degs_sample_shows_a_methods_own_statistics(degs, registry):
    """`degs sample` prints a method's extras (its `RunDetails.candidate_fields` beyond
    the `Candidate` fields) and puts them in its --json report; a method without any
    prints no such line."""
    import jax

    from degs_jax.decoders import pool_rows
    from degs_jax.method import RunDetails

    @dataclasses.dataclass(frozen=True)
    class Reports(BestOfN):
        method: ClassVar[str] = "reports_extras"

        def run_details(self, model, carry, keys, settings):
            rows = jax.device_get(pool_rows(model, carry.state, self.max_new_tokens))
            return RunDetails(candidate_fields=[{"score": float(s), "parity": "even" if n % 2 == 0 else "odd"}
                                                for s, n in zip(rows.log_p, rows.length)])

    argv = ("sample", "x", "--method", "reports_extras", "--n", "2", "--max-new-tokens", "4")
    rc, out, err, _ = degs(*argv, "--json")
    assert rc == 0, err
    report = json.loads(out)
    assert report["extras"]["score"] == report["log_p"]  # the chosen candidate's
    assert report["extras"]["parity"] == ("even" if report["tokens"] % 2 == 0 else "odd")
    rc, out, err, _ = degs(*argv)
    assert rc == 0, err
    (line,) = [x for x in err.splitlines() if x.startswith("reports_extras's own: ")]
    assert line == f"reports_extras's own: score {report['log_p']:.4g}  parity {report['extras']['parity']}"
    rc, out, err, _ = degs("sample", "x", "--method", "best_of_n", "--n", "2", "--max-new-tokens", "4")
    assert rc == 0 and "'s own: " not in err
