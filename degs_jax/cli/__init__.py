"""The `degs` command line.

  degs generate "prompt"                      greedy continuation (the default model)
  degs sample "prompt" --method degs_mcmc     any decoder, with log p, D(x), acceptance, its own
                                              statistics (extras), timing
  degs probe --input file.jsonl --out DIR     D(x) and per-layer lens entropies of completions
  degs eval / degs analyze                    benchmarks and the paper's analyses (cli/evaluation.py)
  degs train-grpo / degs train-lens           GRPO reference and tuned lens (cli/training.py)
  degs reproduce --model M --out DIR          the paper's whole study, resumable (cli/reproduction.py)

This package is the one command-line layer: it imports the library, nothing in the
library imports it. The options and checks the commands share are in `options.py`; each
command module registers its subcommands with `add_commands(sub, load_model)`, where
`load_model` is this module's `_load` (one place that loads a model for every command).

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
import select
import signal
import sys
import threading
import time
from pathlib import Path

import jax
from tqdm.auto import tqdm

from ..batching import (choose_batch_size, claim_device_memory, describe_batch_choice, parse_batch_size,
                        peak_memory)
from ..chat import encode_prompt
from ..eval.results import RunInUseError
from ..eval.sandbox import IsolationUnavailableError
from ..lens import DEFAULT_TAU
from ..method import Method
from ..model_api import params_dtype
from ..models import loading
from ..models.compilation import enable_compilation_cache
from ..models.sharding import make_mesh
from ..text import sample
from ..train.tuned_lens import read_lens_file
from . import evaluation, reproduction, training
from .options import (BATCH_SIZE_HELP, _add_decoder_args, _add_lens_args, _add_model_args,
                      _hyperparameters, _tuned_lens, check_output_dir, check_seed, finite_float,
                      method_help, method_value, prompt_text)

def _load(args):
    """The model `--model` names (default: the built-in default), on `--mesh`, with
    `--batch-invariant` numerics; a `--tuned-lens` file is checked first."""
    if getattr(args, "tuned_lens", None) is not None:  # before loading: a file that is no lens
        if args.lens not in ("tuned", "both"):
            raise ValueError("--tuned-lens needs --lens tuned"
                             + (" or --lens both" if args.command == "analyze" else ""))
        read_lens_file(args.tuned_lens)

    _persistent_cache(args)
    source = args.model or loading.DEFAULT_MODEL
    t0 = time.perf_counter()
    mesh = None
    if getattr(args, "mesh", None) is not None:
        mesh = make_mesh(*args.mesh)
        args.scope.enter_context(jax.set_mesh(mesh))  # every later jitted call sees it
    model = loading.load(source, dtype=args.dtype, progress=not getattr(args, "no_progress", False),
                         mesh=mesh)
    if getattr(args, "batch_invariant", False):
        model = dataclasses.replace(model, cfg=dataclasses.replace(model.cfg, batch_invariant=True))
    print(f"loaded {model.name} ({model.cfg.architecture}, {model.cfg.num_layers} layers) "
          f"in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    return model


def cmd_generate(args) -> int:
    prompt = prompt_text(args.prompt)
    model = _load(args)
    result = sample(model, prompt, "greedy", chat=not args.no_chat,
                    max_new_tokens=args.max_new_tokens, probe=False)
    print(result.outputs[0].chosen.text)
    return 0


# `degs sample`'s default budget of new tokens. The paper's 3,072 (`degs eval`, `degs
# reproduce`, the library's defaults) sizes the KV cache and the attention of every decode
# step, on a CPU the larger part of each step's cost, for answers that mostly end within a
# few hundred tokens.
SAMPLE_MAX_NEW_TOKENS = 512

SAMPLE_BUDGET_HELP = (f"Budget: unless --max-new-tokens (or, for the MCMC chains, "
                      f"--num-blocks) is given, `degs sample` decodes at most {SAMPLE_MAX_NEW_TOKENS} "
                      f"new tokens (the MCMC chains: ceil({SAMPLE_MAX_NEW_TOKENS} / block_len) blocks), "
                      "not the paper's 3,072 that `degs eval` and `degs reproduce` keep; a completion "
                      "that reaches it says so.")


def sample_budget(method: Method, given) -> Method:
    """`method` with `degs sample`'s budget, SAMPLE_MAX_NEW_TOKENS new tokens, where the
    command line (`given`: the hyperparameters it names) leaves the budget to the default:
    `max_new_tokens` for the methods that take it, `num_blocks` = ceil(budget / block_len)
    for the MCMC chains (whose budget is block_len · num_blocks)."""
    fields = {f.name for f in dataclasses.fields(method)}
    if "max_new_tokens" in fields and "max_new_tokens" not in given:
        return dataclasses.replace(method, max_new_tokens=SAMPLE_MAX_NEW_TOKENS)
    if "num_blocks" in fields and "num_blocks" not in given:
        return dataclasses.replace(method, num_blocks=-(-SAMPLE_MAX_NEW_TOKENS // method.block_len))
    return method


def cmd_sample(args) -> int:
    if (args.prompt is None) == (args.input is None):
        raise ValueError("give a prompt or --input FILE (one of them)")
    seed = check_seed(args.seed)
    method = method_value(args)  # bad names and values before loading the model
    method = sample_budget(method, _hyperparameters(args))
    if args.input is not None:
        return _sample_many(args, seed, method)
    prompt = prompt_text(args.prompt)
    model = _load(args)
    result = sample(model, prompt, method, key=jax.random.key(seed),
                    chat=not args.no_chat, progress=True, tuned_lens=_tuned_lens(args, model))
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
    budget = "" if c.ended else f" (budget of {method.max_new_tokens} reached, no EOS or stop string)"
    print(f"method {result.method}  tokens {len(c.tokens)}{budget}"
          f"  log p {c.log_p:.3f}  D(x) {depth}  final-layer entropy {c.final_entropy:.3f}",
          file=sys.stderr)
    if c.acceptance is not None:
        print("acceptance per block: " + " ".join(f"{a:.2f}" for a in c.acceptance)
              + "  |  decisions decided by beta·ΔD per block: " + " ".join(map(str, c.depth_decisions)),
              file=sys.stderr)
    if c.weight is not None:
        d = out.diagnostics
        print(f"particle weight {c.weight:.3f} of {len(out.candidates)}  log Z-hat {d['log_evidence']:.3f}  "
              f"resamplings {d['resamples']} ({d['copied_rows']} rows copied)", file=sys.stderr)
    if c.extras:  # the method's own statistics of its answer (`RunDetails.candidate_fields`)
        print(f"{result.method}'s own: " + "  ".join(f"{name} {_shown(value)}" for name, value in c.extras.items()),
              file=sys.stderr)
    s = result.seconds
    print(f"time: prefill {s['prefill']:.2f}s  decode {s['decode']:.2f}s  total {s['total']:.2f}s "
          f"(first call includes compilation)  |  generated {result.counters['generated_tokens']} tokens, "
          f"{fe:.0f} forward-equivalent tokens", file=sys.stderr)
    return 0


def _shown(value) -> str:
    """An extra statistic as `degs sample` prints it: a float to 4 significant digits, a
    string as it is, anything else as JSON."""
    if isinstance(value, float):
        return f"{value:.4g}"
    return value if isinstance(value, str) else json.dumps(value)


def _sample_report(result, out, seed, num_layers) -> dict:
    """The JSON report of one prompt's decode (the candidate the method chose)."""
    c = out.chosen
    return {
        "method": result.method, "seed": seed, "completion": c.text,
        "tokens": len(c.tokens), "ended_with_eos": c.ended, "ended_by": c.ended_by, "log_p": c.log_p, "D": c.depth,
        "final_entropy": c.final_entropy, "acceptance_per_block": c.acceptance,
        "depth_decisions_per_block": c.depth_decisions,
        "weight": c.weight, "diagnostics": out.diagnostics, "extras": c.extras,
        "counters": result.counters, "forward_equivalents": result.forward_equivalents(num_layers),
        "seconds": {k: round(v, 3) for k, v in result.seconds.items()},
        "hyperparameters": {k: v for k, v in result.hyperparameters.items() if v is not None},
    }


def _sample_many(args, seed: int, method: Method) -> int:
    """`degs sample --input FILE`: every prompt, in batches (--batch-size, auto by default)."""
    from ..probe import read_rows  # the probe's plots: matplotlib, ~0.5 s that other commands skip

    args.batch_size = parse_batch_size(args.batch_size)
    rows = read_rows(Path(args.input))
    model = _load(args)
    tuned_lens = _tuned_lens(args, model)
    chat = not args.no_chat
    longest = max(len(encode_prompt(model.tokenizer, r["prompt"], chat)) for r in rows)
    choice = choose_batch_size(args.batch_size, model.lm, method, longest,
                               len(rows), method.cache_dtype or params_dtype(model.params))
    batch = choice["batch_size"]
    print(describe_batch_choice(choice), file=sys.stderr)
    base = jax.random.key(seed)
    t0 = time.perf_counter()
    for start in tqdm(range(0, len(rows), batch), desc=method.method, unit="batch", file=sys.stderr):
        part = rows[start:start + batch]
        keys = jax.numpy.stack([jax.random.fold_in(base, start + i) for i in range(len(part))])
        result = sample(model, [r["prompt"] for r in part], method, keys=keys, chat=chat,
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
    from ..probe import read_rows, run_probe  # matplotlib, as in _sample_many

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
                       description=method_help() + " " + SAMPLE_BUDGET_HELP)
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
    p.add_argument("--tau", type=finite_float, default=DEFAULT_TAU,
                   help=f"collapse threshold in nats ({DEFAULT_TAU})")
    p.add_argument("--lsub", type=lambda s: tuple(int(x) for x in s.split(",")), default=None,
                   help="probed layers for D(x) (default grid)")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="budget for greedy completion of prompts without one (256)")
    p.add_argument("--limit", type=int, default=None, help="only the first N rows")
    _add_lens_args(p)
    p.set_defaults(func=cmd_probe)

    evaluation.add_commands(sub, _load)  # degs eval, degs analyze
    training.add_commands(sub, _load)  # train-grpo, train-lens
    reproduction.add_commands(sub, _load)  # degs reproduce
    return parser


def user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that report a problem with the input or the environment (one line)
    rather than a bug (a traceback)."""
    return (ValueError, OSError, RunInUseError, IsolationUnavailableError)


def one_line(error: BaseException) -> str:
    """The message of `error` on one line (OSError: its reason and file), with every
    character that is not printable (a terminal escape, a lone surrogate from a file name
    or a stored value) written as its Python escape."""
    if isinstance(error, OSError) and error.strerror and error.filename:
        text = f"{error.strerror}: {error.filename}"
    else:
        text = str(error) or type(error).__name__
    return "".join(c if c.isprintable() and not 0xD800 <= ord(c) <= 0xDFFF else repr(c)[1:-1]
                   for c in " ".join(text.split()))


@contextlib.contextmanager
def interruptible(message: str, grace_s: float = 3.0):
    """Ctrl-C ends the command within `grace_s` seconds, printing `message` once.

    Python raises KeyboardInterrupt only between bytecodes, so a jitted decode running in
    XLA would delay it until the whole loop returns (minutes). The signal also writes its
    number to a pipe (`signal.set_wakeup_fd`), which wakes a thread at once: it gives the
    main thread `grace_s` to unwind (its `except KeyboardInterrupt` prints `message`),
    then prints it itself and ends the process (exit status 130). Everything a run keeps
    is already on disk (results are fsynced per problem), so this is as safe as SIGKILL,
    which the resumable store is built for. A second Ctrl-C ends it at once. A Ctrl-C that
    lands while the main thread runs a finalizer or a garbage-collector callback (JAX's
    `_xla_gc_callback`) raises KeyboardInterrupt where Python cannot propagate it: it
    would print "Exception ignored in ..." with a traceback and carry on; here it prints
    nothing (`sys.unraisablehook`) and the watcher ends the process after the grace
    period as above. Only in the main thread (elsewhere there are no signals); restores
    what it replaces."""
    if threading.current_thread() is not threading.main_thread():
        yield lambda: None
        return
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    previous_handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    done, printed = threading.Event(), threading.Lock()
    said = []
    previous_unraisable_hook = sys.unraisablehook

    def unraisable(report) -> None:
        if not isinstance(report.exc_value, KeyboardInterrupt):
            previous_unraisable_hook(report)

    sys.unraisablehook = unraisable

    def say() -> None:
        with printed:
            if not said:
                said.append(True)
                print(message, file=sys.stderr, flush=True)

    def watch() -> None:
        deadline = None
        while not done.is_set():
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
        sys.unraisablehook = previous_unraisable_hook
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


def _persistent_cache(args) -> None:
    """Turn on JAX's persistent compilation cache (models/compilation.py) for this run, or not.

    `degs reproduce --compilation-cache DIR|none` decides where given. Otherwise the cache
    is on for the `degs` program (`entry_point`), so compiled programs persist across runs,
    and off for a Python caller of `main` (a notebook, a test), whose process keeps the JAX
    configuration it has: the cache is process-wide and would outlive the call."""
    choice = getattr(args, "compilation_cache", None)
    if choice is not None and choice.lower() == "none":
        return
    if choice is not None or args.persistent_cache:
        enable_compilation_cache(choice)


def main(argv=None, *, persistent_cache: bool = False) -> int:
    """Run one `degs` command; returns its exit status. persistent_cache: turn on JAX's
    persistent compilation cache for it (the `degs` program does; see `_persistent_cache`)."""
    args = build_parser().parse_args(argv)
    args.persistent_cache = persistent_cache
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
    threads are still compiling or decoding for the interrupted call. Before anything
    starts JAX's backend, XLA's GPU allocator is allowed most of each card
    (`batching.claim_device_memory`)."""
    claim_device_memory()
    code = main(persistent_cache=True)
    if code == 130:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130)
    sys.exit(code)

