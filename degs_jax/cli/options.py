"""What the `degs` commands share: the options of the model, the decoders and the lens
(each hyperparameter option generated from `degs_jax.methods`), their parsers and
checks (seed, prompt, output directory, probe sets), and the HumanEval isolation that
`degs eval` and `degs reproduce` settle before loading a model. Every check raises
ValueError with the option's name: `main` prints it as one `degs: error: ...` line."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import re
import sys
import typing
from pathlib import Path
from typing import Iterable

from ..eval import sandbox
from ..eval.benchmarks import canonical_name
from ..methods import field_types, hyperparameters_for, method_classes
from ..lens import default_lsub, validate_lsub
from ..method import Method
from ..models.loading import AUTO_DTYPE, DTYPE_CHOICES, resolve_dtype
from ..models.sharding import parse_mesh
from ..traced_fields import FLOAT32_MAX
from ..train.tuned_lens import resolve_lens


def method_help() -> str:
    """What --method takes: the library's decoders and those of installed packages
    (`degs_jax.methods.method_classes`, read when the parser is built)."""
    return (f"decoders: {', '.join(method_classes())} (docs/design.md §4; an installed package "
            "adds its own, docs/extending.md). Hyperparameters a method does not take are rejected.")


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="built-in name (qwen2.5-coder-0.5b [default], smollm2-135m, "
                        "qwen2.5-coder-1.5b), a local HF directory, a .gguf file, or a hub id "
                        "(needs network)")
    p.add_argument("--dtype", default=AUTO_DTYPE, choices=DTYPE_CHOICES,
                   help="parameter dtype: auto (default) is float32 on CPU, where XLA emulates "
                        "bfloat16 several times slower, and bfloat16 on a GPU or TPU; a resumed "
                        "run keeps the dtype it was made with")
    p.add_argument("--no-chat", action="store_true",
                   help="feed the prompt as raw text even if the tokenizer has a chat template")
    p.add_argument("--mesh", type=_mesh_shape, default=None, metavar="DATAxMODEL",
                   help="spread over local devices: DATA replicas (rows split between them) x "
                        "MODEL-way tensor parallelism (heads and MLP split), e.g. 1x4 for a model "
                        "too big for one GPU, 4x1 for four independent replicas (default: one device)")
    p.add_argument("--batch-invariant", action="store_true",
                   help="make each prompt's results bitwise independent of the batch it shares and "
                        "of --batch-size (fixed matmul row tiles and attention chunks; slower, see "
                        "the README's Reproducibility section)")


def keep_recorded_dtype(args, recorded: str | None, what: str) -> None:
    """`--dtype auto` resuming `what` (a run or study directory) made in dtype `recorded`:
    load the model in `recorded`, as the run was made (its configuration, hence its
    records, depend on it), with one line on stderr where auto would choose otherwise
    here (e.g. a run begun in bfloat16 before auto chose float32 on CPU). An explicit
    --dtype is left as given (a resume then refuses a different one). Asks JAX for its
    platform, which starts JAX's backend: call it after joining a `jax.distributed` job."""
    if args.dtype != AUTO_DTYPE or recorded is None:
        return
    args.dtype = recorded
    chosen = resolve_dtype(AUTO_DTYPE)
    if recorded != chosen:
        print(f"degs: resuming {what} in {recorded}, the dtype it was made with (--dtype auto "
              f"would choose {chosen} here)", file=sys.stderr)


def _mesh_shape(text: str) -> tuple[int, int]:
    try:
        return parse_mesh(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _add_decoder_args(p: argparse.ArgumentParser, default_method: str) -> None:
    """--method, --seed and one option per hyperparameter field of the methods
    (`degs_jax.methods`: names, types, documentation and defaults come from there)."""
    p.add_argument("--method", default=default_method, help=method_help())
    p.add_argument("--seed", type=int, default=0, help="PRNG seed (same seed, same tokens)")
    g = p.add_argument_group("hyperparameters (unset: the method's default, as in the paper)")
    every = len(method_classes())
    for name, (kind, texts) in _cli_fields().items():
        flag = "--" + name.replace("_", "-")
        help_text = "; ".join(
            text + " (" + ("every method" if len(methods) == every else ", ".join(methods))
            + ("" if default is None else f": default {default}") + ")"
            for (text, default), methods in texts.items())
        if kind is bool:  # --x / --no-x (unset: the method's default)
            g.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        elif kind is tuple:
            g.add_argument(flag, type=int_list, metavar="L1,L2,...", help=help_text)
        elif kind is list:  # strings: the option repeated, --no-x for none
            g.add_argument("--no-" + name.replace("_", "-"), dest=name, action="store_const", const=[],
                           help=f"no {name} strings at all (overrides a benchmark's default)")
            g.add_argument(flag, action="append", type=escaped_text, metavar="TEXT",
                           help=help_text + r"; repeat the option for several (\n, \t and \\ are "
                           "read as a newline, a tab and a backslash)")
        else:
            g.add_argument(flag, type=finite_float if kind is float else kind, help=help_text)
    _add_lens_args(g)


def _add_lens_args(p) -> None:
    p.add_argument("--lens", choices=["logit", "tuned"], default="logit",
                   help="how layer residuals are read for d_t and D(x): the logit lens (default, "
                        "the paper's) or a tuned lens (`degs train-lens`)")
    p.add_argument("--tuned-lens", default=None, metavar="FILE",
                   help="tuned-lens file (default: the one cached for the model's weights)")


def _tuned_lens(args, model):
    """The TunedLens `--lens tuned` asks for, or None."""
    return resolve_lens(args.lens, model, args.tuned_lens)


BATCH_SIZE_HELP = (
    "{what} per decode call, or 'auto' (default): as many as fit in the device's free memory "
    "with the method's buffer (prompt + max new tokens of KV cache per candidate or chain; "
    "the choice and its terms are recorded). In float32 results do not depend on it; in "
    "bfloat16 they can (README, 'Reproducibility')")


REFILL_HELP = (
    "decode in fixed batches: every batch lasts as long as its slowest problem (the default "
    "streams the problems through --batch-size slots and gives a finished problem's slot to "
    "the next one at once; recorded in run.json as 'refill')")


def int_list(text: str) -> tuple[int, ...]:
    """An option's comma-separated integers (argparse type)."""
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


_ESCAPES = {"n": "\n", "t": "\t", "\\": "\\"}


def escaped_text(text: str) -> str:
    """An option's text with \\n, \\t and \\\\ read as a newline, a tab and a backslash
    (argparse type; other backslashes are kept as typed)."""
    return re.sub(r"\\(.)", lambda m: _ESCAPES.get(m.group(1), m.group(0)), text)


def finite_float(text: str) -> float:
    """An option's real number (argparse type): ``inf`` and ``nan`` are refused (they
    would reach a decoder, and run.json as ``Infinity``), and so is a magnitude past
    float32's (``--alpha 4e38``): the compiled programs take hyperparameters as float32,
    where it is inf."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    if abs(value) > FLOAT32_MAX:
        raise argparse.ArgumentTypeError(f"must be at most {FLOAT32_MAX:.7g} in magnitude "
                                         f"(float32), got {text!r}")
    return value


def _cli_fields() -> dict[str, tuple[type, dict[tuple[str, object], list[str]]]]:
    """name -> (argument type, {(help, default): methods}) over every method's fields
    shown on the command line, in the order the methods define them."""
    fields: dict = {}
    for method, cls in method_classes().items():
        types = field_types(cls)
        for f in dataclasses.fields(cls):
            if not f.metadata.get("cli"):
                continue
            kind = types[f.name]
            if typing.get_origin(kind) is typing.Union:  # Optional[X] -> X
                kind = next(a for a in typing.get_args(kind) if a is not type(None))
            if typing.get_origin(kind) is tuple and typing.get_args(kind)[0] is str:
                kind = list  # tuple[str, ...] -> a repeated option
            kind = typing.get_origin(kind) or kind  # tuple[int, ...] -> tuple
            entry = fields.setdefault(f.name, (kind, {}))
            entry[1].setdefault((f.metadata["help"], f.default), []).append(method)
    return fields


def _hyperparameters(args) -> dict:
    """The hyperparameters given on the command line (the others keep their defaults)."""
    return {k: getattr(args, k) for k in _cli_fields() if getattr(args, k, None) is not None}


def method_value(args) -> Method:
    """The method value `--method` and the hyperparameter options give (built once, before
    the model loads; what the command passes down). ValueError naming the hyperparameter."""
    return hyperparameters_for(args.method, **_hyperparameters(args))


SEED_RANGE = (0, 2**63 - 1)  # jax.random.key takes a signed 64-bit seed


def check_seed(seed: int) -> int:
    """`seed` if jax can take it; ValueError naming the range otherwise."""
    if not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
        raise ValueError(f"--seed must be an integer from {SEED_RANGE[0]} to {SEED_RANGE[1]}, got {seed}")
    return seed


def prompt_text(prompt: str) -> str:
    """The prompt argument, if it is text: the shell passes bytes, and bytes that are not
    UTF-8 reach Python as lone surrogates, which no tokenizer can encode."""
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"the prompt is not valid UTF-8 text (byte 0x{ord(prompt[e.start]) & 0xFF:02x} "
                         f"at character {e.start})") from None
    if not prompt.strip():
        raise ValueError("the prompt is empty")
    return prompt


def check_output_dir(path: Path, option: str = "--out") -> Path:
    """`path` if a directory can be created or used there; ValueError saying why not."""
    for parent in [path, *path.parents]:
        if parent.exists():
            if not parent.is_dir():
                where = "is a file" if parent == path else f"is under {parent}, which is a file"
                raise ValueError(f"{option} {path} {where}; give a directory")
            if not os.access(parent, os.W_OK | os.X_OK):
                raise ValueError(f"{option} {path}: {parent} is not writable")
            return path
    return path


def parse_lsub_sweep(spec: str, num_layers: int) -> list[tuple[int, ...]]:
    """``"4,8,12;16,20,24,28;all;default"`` -> probe sets (``all`` = 1..L, ``default`` =
    the default grid of docs/design.md §3). Each set is validated against ``num_layers``."""
    sets = []
    for part in spec.split(";"):
        part = part.strip()
        if not part:
            continue
        if part == "all":
            layers = tuple(range(1, num_layers + 1))
        elif part == "default":
            layers = default_lsub(num_layers)
        else:
            try:
                layers = tuple(int(x) for x in part.split(","))
            except ValueError:
                raise ValueError(f"bad L_sub {part!r} in --lsub-sweep: expected comma-separated "
                                 "layer numbers, 'all' or 'default'") from None
        sets.append(validate_lsub(layers, num_layers))
    if not sets:
        raise ValueError("--lsub-sweep is empty")
    return sets


def add_unsafe_grading_flag(group) -> None:
    """The opt-in to grading HumanEval without namespaces (`degs eval`, `degs reproduce`)."""
    group.add_argument(sandbox.UNSAFE_FLAG, dest="unsafe_unsandboxed_grading", action="store_true",
                       help="HumanEval where bubblewrap cannot create namespaces: run the "
                            "model-written programs under process-level layers only (Landlock "
                            "and seccomp, both required; docs/sandbox.md says what that leaves "
                            "open); results are labelled isolation=process. Without it such a "
                            "run stops before loading the model")


@contextlib.contextmanager
def code_isolation(benchmarks: Iterable[str], allow_unsandboxed: bool):
    """Around a command that grades ``benchmarks``: before the model loads, how HumanEval
    programs will be isolated (``None`` without HumanEval), or the one-line refusal
    (:class:`~degs_jax.eval.sandbox.IsolationUnavailableError`); under the fallback a
    warning at the start and at the end of the run."""
    level = None
    if "humaneval" in {canonical_name(b) for b in benchmarks}:
        level = sandbox.isolation(allow_unsandboxed)
    if level == sandbox.PROCESS:
        print(sandbox.unsandboxed_warning(), file=sys.stderr, flush=True)
    try:
        yield level
    finally:
        if level == sandbox.PROCESS:
            print(sandbox.unsandboxed_warning(), file=sys.stderr, flush=True)
