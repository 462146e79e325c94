"""The `degs` command line.

  degs generate "prompt"                      greedy continuation (embedded default model)
  degs sample "prompt" --method degs_mcmc     any decoder, with log p, D(x), acceptance, timing
  degs probe --input file.jsonl --out DIR     D(x) and per-layer lens entropies of completions
  degs eval / degs analyze                    benchmarks and the paper's analyses (eval/commands.py)
  degs train-grpo / degs train-lens           GRPO reference and tuned lens (train/commands.py)
  degs reproduce --model M --out DIR          the paper's whole study, resumable (reproduce/)

Failures a user can cause (bad input, missing files, no network, a run directory in use)
end in one `degs: error: ...` line and exit status 2, never a traceback. Ctrl-C ends the
command within seconds (`interruptible`), with one line, and exit status 130.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

METHOD_HELP = """decoders: greedy, temperature, best_of_n, best_of_n_entropy, degs_rerank,
power_mcmc, degs_mcmc, power_smc, degs_smc, scalable_power (docs/design.md §4). Hyperparameters a
method does not take are rejected."""


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="built-in name (smollm2-135m [default], qwen2.5-coder-0.5b, "
                        "qwen2.5-coder-1.5b), a local HF directory, a .gguf file, or a hub id "
                        "(needs network)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="parameter dtype (default bfloat16)")
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


def _mesh_shape(text: str) -> tuple[int, int]:
    from .models.sharding import parse_mesh

    try:
        return parse_mesh(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _add_decoder_args(p: argparse.ArgumentParser, default_method: str) -> None:
    """--method, --seed and one option per hyperparameter field of the methods
    (`degs_jax.hyperparameters`: names, types, documentation and defaults come from there)."""
    from .hyperparameters import METHODS

    p.add_argument("--method", default=default_method, help=METHOD_HELP)
    p.add_argument("--seed", type=int, default=0, help="PRNG seed (same seed, same tokens)")
    g = p.add_argument_group("hyperparameters (unset: the method's default, as in the paper)")
    for name, (kind, texts) in _cli_fields().items():
        flag = "--" + name.replace("_", "-")
        help_text = "; ".join(
            text + " (" + ("every method" if len(methods) == len(METHODS) else ", ".join(methods))
            + ("" if default is None else f": default {default}") + ")"
            for (text, default), methods in texts.items())
        if kind is bool:  # --x / --no-x (unset: the method's default)
            g.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        elif kind is tuple:
            g.add_argument(flag, type=int_list, metavar="L1,L2,...", help=help_text)
        else:
            g.add_argument(flag, type=kind, help=help_text)
    _add_lens_args(g)


def _add_lens_args(p) -> None:
    p.add_argument("--lens", choices=["logit", "tuned"], default="logit",
                   help="how layer residuals are read for d_t and D(x): the logit lens (default, "
                        "the paper's) or a tuned lens (`degs train-lens`)")
    p.add_argument("--tuned-lens", default=None, metavar="FILE",
                   help="tuned-lens file (default: the one cached for the model's weights)")


def _tuned_lens(args, model):
    """The TunedLens `--lens tuned` asks for, or None."""
    from .train.tuned_lens import resolve_lens

    return resolve_lens(args.lens, model, args.tuned_lens)


BATCH_SIZE_HELP = (
    "{what} per decode call, or 'auto' (default): as many as fit in the device's free memory "
    "with the method's buffer (prompt + max new tokens of KV cache per candidate or chain; "
    "the choice and its terms are recorded). In float32 results do not depend on it; in "
    "bfloat16 they can (README, 'Reproducibility')")


def int_list(text: str) -> tuple[int, ...]:
    """An option's comma-separated integers (argparse type)."""
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _cli_fields() -> dict[str, tuple[type, dict[tuple[str, object], list[str]]]]:
    """name -> (argument type, {(help, default): methods}) over every method's fields
    shown on the command line, in the order the methods define them."""
    import typing

    from .hyperparameters import METHOD_HYPERPARAMETERS, field_types

    fields: dict = {}
    for method, cls in METHOD_HYPERPARAMETERS.items():
        types = field_types(cls)
        for f in dataclasses.fields(cls):
            if not f.metadata.get("cli"):
                continue
            kind = types[f.name]
            if typing.get_origin(kind) is typing.Union:  # Optional[X] -> X
                kind = next(a for a in typing.get_args(kind) if a is not type(None))
            kind = typing.get_origin(kind) or kind  # tuple[int, ...] -> tuple
            entry = fields.setdefault(f.name, (kind, {}))
            entry[1].setdefault((f.metadata["help"], f.default), []).append(method)
    return fields


def _hyperparameters(args) -> dict:
    """The hyperparameters given on the command line (the others keep their defaults)."""
    return {k: getattr(args, k) for k in _cli_fields() if getattr(args, k, None) is not None}


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


def _load(args):
    from .models.compilation import enable_compilation_cache
    from .models.loading import DEFAULT_MODEL, load

    if getattr(args, "tuned_lens", None) is not None:  # before loading: a file that is no lens
        if args.lens not in ("tuned", "both"):
            raise ValueError("--tuned-lens needs --lens tuned"
                             + (" or --lens both" if args.command == "analyze" else ""))
        from .train.tuned_lens import read_lens_file

        read_lens_file(args.tuned_lens)

    enable_compilation_cache()  # compiled programs persist across runs (models/compilation.py)
    source = args.model or DEFAULT_MODEL
    t0 = time.perf_counter()
    mesh = None
    if getattr(args, "mesh", None) is not None:
        import jax

        from .models.sharding import make_mesh

        mesh = make_mesh(*args.mesh)
        args.scope.enter_context(jax.set_mesh(mesh))  # every later jitted call sees it
    model = load(source, dtype=args.dtype, progress=True, mesh=mesh)
    if getattr(args, "batch_invariant", False):
        model = dataclasses.replace(model, cfg=dataclasses.replace(model.cfg, batch_invariant=True))
    print(f"loaded {model.name} ({model.cfg.architecture}, {model.cfg.num_layers} layers) "
          f"in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    return model


def cmd_generate(args) -> int:
    from .text import sample

    prompt = prompt_text(args.prompt)
    model = _load(args)
    result = sample(model, prompt, "greedy", chat=not args.no_chat,
                    max_new_tokens=args.max_new_tokens, probe=False)
    print(result.outputs[0].chosen.text)
    return 0


def cmd_sample(args) -> int:
    import jax

    from .batching import peak_memory
    from .hyperparameters import resolve_hyperparameters
    from .text import sample

    if (args.prompt is None) == (args.input is None):
        raise ValueError("give a prompt or --input FILE (one of them)")
    seed = check_seed(args.seed)
    resolve_hyperparameters(args.method, _hyperparameters(args))  # bad names before loading the model
    if args.input is not None:
        return _sample_many(args, seed)
    prompt = prompt_text(args.prompt)
    model = _load(args)
    result = sample(model, prompt, args.method, key=jax.random.key(seed),
                    chat=not args.no_chat, progress=True, tuned_lens=_tuned_lens(args, model),
                    **_hyperparameters(args))
    out = result.outputs[0]
    c = out.chosen
    fe = result.forward_equivalents(model.lm.num_layers)
    report = _sample_report(result, out, args.seed, model.lm.num_layers)
    report["peak_memory"] = peak_memory()
    if args.json:
        print(json.dumps(report))
        return 0
    print(c.text)
    print("---", file=sys.stderr)
    depth = "n/a (not probed)" if c.depth is None else f"{c.depth:.4f}"
    print(f"method {result.method}  tokens {len(c.tokens)}{'' if c.ended else ' (budget reached, no EOS)'}"
          f"  log p {c.log_p:.3f}  D(x) {depth}  final-layer entropy {c.final_entropy:.3f}",
          file=sys.stderr)
    if c.acceptance is not None:
        print("acceptance per block: " + " ".join(f"{a:.2f}" for a in c.acceptance), file=sys.stderr)
    if c.weight is not None:
        d = out.diagnostics
        print(f"particle weight {c.weight:.3f} of {len(out.candidates)}  log Z-hat {d['log_evidence']:.3f}  "
              f"resamplings {d['resamples']} ({d['copied_rows']} rows copied)", file=sys.stderr)
    s = result.seconds
    print(f"time: prefill {s['prefill']:.2f}s  decode {s['decode']:.2f}s  total {s['total']:.2f}s "
          f"(first call includes compilation)  |  generated {result.counters['generated_tokens']} tokens, "
          f"{fe:.0f} forward-equivalent tokens", file=sys.stderr)
    return 0


def _sample_report(result, out, seed, num_layers) -> dict:
    """The JSON report of one prompt's decode (the candidate the method chose)."""
    c = out.chosen
    return {
        "method": result.method, "seed": seed, "completion": c.text,
        "tokens": len(c.tokens), "ended_with_eos": c.ended, "log_p": c.log_p, "D": c.depth,
        "final_entropy": c.final_entropy, "acceptance_per_block": c.acceptance,
        "weight": c.weight, "diagnostics": out.diagnostics,
        "counters": result.counters, "forward_equivalents": result.forward_equivalents(num_layers),
        "seconds": {k: round(v, 3) for k, v in result.seconds.items()},
        "hyperparameters": {k: v for k, v in result.hyperparameters.items() if v is not None},
    }


def _sample_many(args, seed: int) -> int:
    """`degs sample --input FILE`: every prompt, in batches (--batch-size, auto by default)."""
    import jax
    from tqdm.auto import tqdm

    from .batching import choose_batch_size, parse_batch_size, peak_memory
    from .hyperparameters import hyperparameters_for
    from .model_api import params_dtype
    from .probe import read_rows
    from .chat import encode_prompt
    from .text import sample

    args.batch_size = parse_batch_size(args.batch_size)
    rows = read_rows(Path(args.input))
    model = _load(args)
    tuned_lens = _tuned_lens(args, model)
    chat = not args.no_chat
    config = hyperparameters_for(args.method, **_hyperparameters(args))
    longest = max(len(encode_prompt(model.tokenizer, r["prompt"], chat)) for r in rows)
    choice = choose_batch_size(args.batch_size, model.lm, config, longest,
                               len(rows), config.cache_dtype or params_dtype(model.params))
    batch = choice["batch_size"]
    print(f"batch size {batch}" + (f" (auto: {choice['bytes_per_row'] / 2**20:.1f} MiB per prompt, "
                                   f"{choice['free_bytes'] / 2**30:.1f} GiB free, "
                                   f"{choice['memory_source']})" if choice["requested"] == "auto"
                                   else ""), file=sys.stderr)
    base = jax.random.key(seed)
    t0 = time.perf_counter()
    for start in tqdm(range(0, len(rows), batch), desc=args.method, unit="batch", file=sys.stderr):
        part = rows[start:start + batch]
        keys = jax.numpy.stack([jax.random.fold_in(base, start + i) for i in range(len(part))])
        result = sample(model, [r["prompt"] for r in part], config, keys=keys, chat=chat,
                        tuned_lens=tuned_lens)
        for i, (row, out) in enumerate(zip(part, result.outputs)):
            report = _sample_report(result, out, seed, model.lm.num_layers)
            report["seconds"] = None  # the batch's time, not this prompt's (see the run record)
            print(json.dumps({"id": row.get("id", start + i), **report}), flush=True)
    print(json.dumps({"run": {"n_prompts": len(rows), "batch_choice": choice,
                              "peak_memory": peak_memory(),
                              "seconds": round(time.perf_counter() - t0, 3)}}), file=sys.stderr)
    return 0


def cmd_probe(args) -> int:
    from .probe import read_rows, run_probe

    read_rows(Path(args.input), args.limit)  # input errors before loading the model
    out = check_output_dir(Path(args.out))
    model = _load(args)
    return run_probe(model, Path(args.input), out, tau=args.tau, lsub=args.lsub,
                     chat=not args.no_chat, max_new_tokens=args.max_new_tokens or 256,
                     limit=args.limit, tuned_lens=_tuned_lens(args, model))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="degs", description="Depth-Entropy Guided Sampling (DEGS) and power sampling in JAX.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="greedy continuation of a prompt")
    g.add_argument("prompt")
    _add_model_args(g)
    g.add_argument("--max-new-tokens", type=int, default=128, help="token budget (128)")
    g.set_defaults(func=cmd_generate)

    s = sub.add_parser("sample", help="decode a prompt with any decoder and print its statistics",
                       description=METHOD_HELP)
    s.add_argument("prompt", nargs="?", default=None, help="the prompt (or --input)")
    _add_model_args(s)
    _add_decoder_args(s, "degs_mcmc")
    s.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    many = s.add_argument_group("many prompts")
    many.add_argument("--input", default=None, metavar="FILE",
                      help="JSONL with a 'prompt' (and optional 'id') per line: decode them all, "
                           "print one JSON object per prompt on stdout (prompt i draws from "
                           "fold_in(key(seed), i)) and the run record (batch choice, peak "
                           "memory, seconds) as one JSON line on stderr")
    many.add_argument("--batch-size", default="auto", metavar="N|auto",
                      help=BATCH_SIZE_HELP.format(what="prompts"))
    s.set_defaults(func=cmd_sample)

    p = sub.add_parser("probe", help="collapse depth D(x) and layer entropies of completions")
    _add_model_args(p)
    p.add_argument("--input", required=True,
                   help="JSONL with 'prompt' and optional 'completion' (else completed greedily)")
    p.add_argument("--out", required=True, help="output directory (probe.jsonl, entropy.png)")
    from .lens import DEFAULT_TAU

    p.add_argument("--tau", type=float, default=DEFAULT_TAU,
                   help=f"collapse threshold in nats ({DEFAULT_TAU})")
    p.add_argument("--lsub", type=lambda s: tuple(int(x) for x in s.split(",")), default=None,
                   help="probed layers for D(x) (default grid)")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="budget for greedy completion of prompts without one (256)")
    p.add_argument("--limit", type=int, default=None, help="only the first N rows")
    _add_lens_args(p)
    p.set_defaults(func=cmd_probe)

    from .eval.commands import add_commands  # degs eval, degs analyze

    add_commands(sub, _add_model_args, _add_decoder_args, _hyperparameters, _load)

    from .train.commands import add_commands as add_training_commands  # train-grpo, train-lens

    add_training_commands(sub, _add_model_args, _load)

    from .reproduce.command import add_command as add_reproduce  # degs reproduce

    add_reproduce(sub, _add_model_args, _load)
    return parser


def user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that report a problem with the input or the environment (one line)
    rather than a bug (a traceback)."""
    from .eval.results import RunInUseError
    from .eval.sandbox import IsolationUnavailableError

    return (ValueError, OSError, RunInUseError, IsolationUnavailableError)


def one_line(error: BaseException) -> str:
    """The message of `error` on one line (OSError: its reason and file)."""
    if isinstance(error, OSError) and error.strerror and error.filename:
        text = f"{error.strerror}: {error.filename}"
    else:
        text = str(error) or type(error).__name__
    return " ".join(text.split())


@contextlib.contextmanager
def interruptible(message: str, grace_s: float = 3.0):
    """Ctrl-C ends the command within `grace_s` seconds, printing `message` once.

    Python raises KeyboardInterrupt only between bytecodes, so a jitted decode running in
    XLA would delay it until the whole loop returns (minutes). The signal also writes its
    number to a pipe (`signal.set_wakeup_fd`), which wakes a thread at once: it gives the
    main thread `grace_s` to unwind (its `except KeyboardInterrupt` prints `message`),
    then prints it itself and ends the process (exit status 130). Everything a run keeps
    is already on disk (results are fsynced per problem), so this is as safe as SIGKILL,
    which the resumable store is built for. A second Ctrl-C ends it at once. Only in the
    main thread (elsewhere there are no signals); restores what it replaces."""
    if threading.current_thread() is not threading.main_thread():
        yield lambda: None
        return
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    previous_handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    done, printed = threading.Event(), threading.Lock()
    said = []

    def say() -> None:
        with printed:
            if not said:
                said.append(True)
                print(message, file=sys.stderr, flush=True)

    def watch() -> None:
        deadline = None
        while not done.is_set():
            import select

            ready, _, _ = select.select([read_fd], [], [], 0.2 if deadline is None else
                                        max(0.0, min(0.2, deadline - time.monotonic())))
            if ready:
                try:
                    signals = os.read(read_fd, 64)
                except OSError:
                    return
                if signal.SIGINT in signals:
                    if deadline is not None:  # a second Ctrl-C
                        deadline = time.monotonic()
                    else:
                        deadline = time.monotonic() + grace_s
            if deadline is not None and time.monotonic() >= deadline and not done.is_set():
                say()
                os._exit(130)

    watcher = threading.Thread(target=watch, name="degs-interrupt", daemon=True)
    watcher.start()
    try:
        yield say
    finally:
        done.set()
        os.write(write_fd, b"\0")  # wakes the watcher at once
        watcher.join()
        signal.set_wakeup_fd(previous_fd)
        signal.signal(signal.SIGINT, previous_handler)
        os.close(read_fd)
        os.close(write_fd)


def interrupted_message(args) -> str:
    """The line Ctrl-C prints: for a resumable command, where its work is and how to resume."""
    command = getattr(args, "command", None)
    if command == "eval":
        return (f"degs: interrupted; finished problems are saved in {args.out}: rerun the same "
                "command to resume")
    if command == "reproduce" and not (args.plan or args.report_only or args.export):
        return (f"degs: interrupted; finished batches are saved in {args.out}: rerun the same "
                "command to resume")
    if command == "train-grpo":
        return (f"degs: interrupted; the checkpoints written so far are in {args.out}: rerun the "
                "same command to resume from the newest")
    return "degs: interrupted"


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    with interruptible(interrupted_message(args)) as say_interrupted:
        try:
            with contextlib.ExitStack() as scope:  # what the command enters (the mesh) ends with it
                args.scope = scope
                return args.func(args)
        except KeyboardInterrupt:
            say_interrupted()
            return 130
        except user_errors() as e:
            print(f"degs: error: {one_line(e)}", file=sys.stderr)
            return 2


def entry_point() -> None:
    """The `degs` console script: `main`, ended by `os._exit` after Ctrl-C, because the
    interpreter's normal shutdown (jax's atexit backend clean-up) can crash while XLA
    threads are still compiling or decoding for the interrupted call."""
    code = main()
    if code == 130:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130)
    sys.exit(code)


if __name__ == "__main__":
    entry_point()
