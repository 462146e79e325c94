"""The `degs` command line.

  degs generate "prompt"                      greedy continuation (embedded default model)
  degs sample "prompt" --method degs_mcmc     any decoder, with log p, D(x), acceptance, timing
  degs probe --input file.jsonl --out DIR     D(x) and per-layer lens entropies of completions
  degs eval / degs analyze                    benchmarks and the paper's analyses (eval/commands.py)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

METHOD_HELP = """decoders: greedy, temperature, best_of_n, best_of_n_entropy, degs_rerank,
power_mcmc, degs_mcmc, power_smc, degs_smc, scalable_power (DESIGN §4). Hyperparameters a
method does not take are rejected."""


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="built-in name (smollm2-135m [default], qwen2.5-coder-0.5b), a local HF "
                        "directory, a .gguf file, or a hub id (needs network)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="parameter dtype (default bfloat16)")
    p.add_argument("--no-chat", action="store_true",
                   help="feed the prompt as raw text even if the tokenizer has a chat template")
    p.add_argument("--mesh", type=_mesh_shape, default=None, metavar="DATAxMODEL",
                   help="spread over local devices: DATA replicas (rows split between them) x "
                        "MODEL-way tensor parallelism (heads and MLP split), e.g. 1x4 for a model "
                        "too big for one GPU, 4x1 for four independent replicas (default: one device)")


def _mesh_shape(text: str) -> tuple[int, int]:
    from .models.sharding import parse_mesh

    try:
        return parse_mesh(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _add_decoder_args(p: argparse.ArgumentParser, default_method: str) -> None:
    p.add_argument("--method", default=default_method, help=METHOD_HELP)
    p.add_argument("--seed", type=int, default=0, help="PRNG seed (same seed, same tokens)")
    g = p.add_argument_group("hyperparameters (default: the method's, as in the paper)")
    g.add_argument("--max-new-tokens", type=int, help="token budget of non-MCMC methods (3072)")
    g.add_argument("--temperature", type=float, help="sampling temperature")
    g.add_argument("--top-k", type=int, help="truncate the sampling/proposal distribution (0 = off)")
    g.add_argument("--top-p", type=float, help="nucleus truncation (1.0 = off)")
    g.add_argument("--n", type=int, help="candidates for the Best-of-N family (16)")
    g.add_argument("--alpha", type=float, help="power / likelihood weight (4)")
    g.add_argument("--beta", type=float, help="weight of D(x) (5; power_mcmc: 0)")
    g.add_argument("--tau", type=float, help="collapse threshold in nats (0.25)")
    g.add_argument("--lsub", type=lambda s: tuple(int(x) for x in s.split(",")),
                   help="probed layers, comma-separated (default grid of DESIGN §3)")
    g.add_argument("--block-len", type=int, help="MCMC / scalable_power block length (192)")
    g.add_argument("--num-blocks", type=int, help="MCMC blocks (16)")
    g.add_argument("--mh-steps", type=int, help="MH steps per block (10)")
    g.add_argument("--n-chains", type=int, help="independent MCMC chains per prompt (1)")
    g.add_argument("--reference-quirks", action="store_true", default=None,
                   help="reproduce the public power-sampling code's deviations (off)")
    g.add_argument("--n-particles", type=int, help="SMC particles per prompt (16)")
    g.add_argument("--ramp-tokens", type=int, help="SMC exponent ramp length in tokens (400; 0 = none)")
    g.add_argument("--ess-threshold", type=float, help="SMC resamples when ESS < this x N (0.5)")
    g.add_argument("--resample-every", type=int, help="SMC checks the ESS every this many tokens (64)")
    g.add_argument("--candidate-pool", type=int, help="scalable_power: candidate blocks sampled, L (32)")
    g.add_argument("--candidates-kept", type=int, help="scalable_power: most likely candidates kept, K (8)")
    g.add_argument("--rollouts", type=int, help="scalable_power: rollouts per kept candidate, M (8)")
    g.add_argument("--rollout-horizon", type=int, help="scalable_power: rollout length cap, H (192)")
    g.add_argument("--jackknife", action=argparse.BooleanOptionalAction, default=None,
                   help="scalable_power: jackknife-corrected block probabilities (on)")
    g.add_argument("--candidate-temperature", type=float,
                   help="scalable_power: temperature of the candidate blocks (1/alpha)")


_HP_NAMES = ("max_new_tokens", "temperature", "top_k", "top_p", "n", "alpha", "beta", "tau", "lsub",
             "block_len", "num_blocks", "mh_steps", "n_chains", "reference_quirks", "n_particles",
             "ramp_tokens", "ess_threshold", "resample_every", "candidate_pool", "candidates_kept",
             "rollouts", "rollout_horizon", "jackknife", "candidate_temperature")


def _hyperparameters(args) -> dict:
    return {k: getattr(args, k) for k in _HP_NAMES if getattr(args, k, None) is not None}


def _load(args):
    from .models.loading import DEFAULT_MODEL, load

    source = args.model or DEFAULT_MODEL
    t0 = time.perf_counter()
    mesh = None
    if getattr(args, "mesh", None) is not None:
        import jax

        from .models.sharding import make_mesh

        mesh = make_mesh(*args.mesh)
        args.scope.enter_context(jax.set_mesh(mesh))  # every later jitted call sees it
    model = load(source, dtype=args.dtype, progress=True, mesh=mesh)
    print(f"loaded {model.name} ({model.cfg.architecture}, {model.cfg.num_layers} layers) "
          f"in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    return model


def cmd_generate(args) -> int:
    from .decoders import sample

    model = _load(args)
    result = sample(model, args.prompt, "greedy", chat=not args.no_chat,
                    max_new_tokens=args.max_new_tokens, probe=False)
    print(result.outputs[0].chosen.text)
    return 0


def cmd_sample(args) -> int:
    import jax

    from .decoders import sample

    model = _load(args)
    result = sample(model, args.prompt, args.method, key=jax.random.key(args.seed),
                    chat=not args.no_chat, progress=True, **_hyperparameters(args))
    out = result.outputs[0]
    c = out.chosen
    fe = result.forward_equivalents(model.cfg.num_layers)
    report = {
        "method": result.method, "seed": args.seed, "completion": c.text,
        "tokens": len(c.tokens), "ended_with_eos": c.ended, "log_p": c.log_p, "D": c.depth,
        "final_entropy": c.final_entropy, "acceptance_per_block": c.acceptance,
        "weight": c.weight, "diagnostics": out.diagnostics,
        "counters": result.counters, "forward_equivalents": fe,
        "seconds": {k: round(v, 3) for k, v in result.seconds.items()},
        "hyperparameters": {k: v for k, v in result.hyperparameters.items() if v is not None},
    }
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


def cmd_probe(args) -> int:
    from .probe import run_probe

    model = _load(args)
    return run_probe(model, Path(args.input), Path(args.out), tau=args.tau, lsub=args.lsub,
                     chat=not args.no_chat, max_new_tokens=args.max_new_tokens or 256,
                     limit=args.limit)


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
    s.add_argument("prompt")
    _add_model_args(s)
    _add_decoder_args(s, "degs_mcmc")
    s.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    s.set_defaults(func=cmd_sample)

    p = sub.add_parser("probe", help="collapse depth D(x) and layer entropies of completions")
    _add_model_args(p)
    p.add_argument("--input", required=True,
                   help="JSONL with 'prompt' and optional 'completion' (else completed greedily)")
    p.add_argument("--out", required=True, help="output directory (probe.jsonl, entropy.png)")
    p.add_argument("--tau", type=float, default=0.25, help="collapse threshold in nats (0.25)")
    p.add_argument("--lsub", type=lambda s: tuple(int(x) for x in s.split(",")), default=None,
                   help="probed layers for D(x) (default grid)")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="budget for greedy completion of prompts without one (256)")
    p.add_argument("--limit", type=int, default=None, help="only the first N rows")
    p.set_defaults(func=cmd_probe)

    from .eval.commands import add_commands  # degs eval, degs analyze

    add_commands(sub, _add_model_args, _add_decoder_args, _hyperparameters, _load)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        with contextlib.ExitStack() as scope:  # what the command enters (the mesh) ends with it
            args.scope = scope
            return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"degs: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
