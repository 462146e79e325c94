"""`degs train-grpo` and `degs train-lens` (registered by `degs_jax.cli`).

  degs train-grpo --model qwen2.5-coder-0.5b --out runs/grpo --steps 200     GRPO on GSM8K train
  degs train-lens --model qwen2.5-coder-0.5b                                 tuned lens, cached
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from ..eval.runner import recorded_dtype
from ..models.sharding import make_mesh
from ..train.data import gsm8k_train_tasks, read_gsm8k_rows
from ..train.grpo import GRPOConfig, train_grpo
from ..train.rewards import MathReward
from ..train.tuned_lens import (TunedLensConfig, check_lens_destination, check_lens_layers, default_lens_path,
                                fit_tuned_lens, gsm8k_lens_corpus, params_fingerprint, save_tuned_lens)
from .options import _add_model_args, check_output_dir, check_seed, finite_float, int_list, keep_recorded_dtype

GRPO_DESCRIPTION = """GRPO with a verifiable math reward (math-verify on the last boxed answer) on the
GSM8K train split, with the evaluation harness's prompt template.

OUT/run.json records the configuration (a rerun with another one is refused),
OUT/log.jsonl one record per step (reward, KL to the frozen reference, clip fraction,
entropy, tokens/s, timings), OUT/checkpoints/step-N/ the fp32 weights as a Hugging Face
directory (`degs eval --model OUT/checkpoints/step-N`) plus the optimizer state. Rerun
the same command to resume from the newest checkpoint (bit-identical to an
uninterrupted run); raise --steps to train further. Defaults are the recipe of the
paper's GRPO references (Spurious Rewards' scripts; see degs_jax/train/grpo.py), which
are sized for 7B models on several GPUs: for a quick run lower --prompts-per-step and
--max-new-tokens.
"""

LENS_DESCRIPTION = """Fit a tuned lens (Belrose et al. 2023: one affine translator per layer, trained so
that each layer's lens distribution matches the model's output) on the GSM8K train
solutions, print the held-out KL to the final layer per layer (logit lens vs tuned),
and save it where `--lens tuned` finds it (cached by the model's weights fingerprint),
or to --out.
"""

GRPO_HELP = {
    "group_size": "completions per prompt (G)",
    "prompts_per_step": "prompts per rollout batch (P)",
    "max_prompt_len": "prompt buffer in tokens (longer problems are skipped)",
    "max_new_tokens": "completion budget of a rollout",
    "temperature": "rollout temperature",
    "learning_rate": "peak AdamW learning rate",
    "warmup_steps": "linear warm-up, in optimizer updates",
    "adam_b1": "Adam beta1", "adam_b2": "Adam beta2", "adam_eps": "Adam epsilon",
    "weight_decay": "AdamW decoupled weight decay",
    "max_grad_norm": "global gradient-norm clip (0 = off)",
    "clip_eps": "PPO ratio clip epsilon",
    "kl_coef": "weight of the k3 KL penalty to the frozen reference",
    "reference_kl": "score rollouts under the frozen reference to log the KL",
    "updates_per_step": "optimizer updates per rollout batch",
    "micro_batch": "rows per gradient-accumulation chunk (memory only)",
    "scale_advantages": "divide advantages by the group's reward std (GRPO; off: Dr. GRPO)",
    "remat": "recompute transformer blocks in the backward pass",
    "seed": "rollout keys and prompt order",
}

LENS_HELP = {
    "steps": "optimizer steps", "seq_len": "tokens per training sequence",
    "batch_size": "sequences per step", "micro_batch": "sequences per forward (memory only)",
    "learning_rate": "SGD (Nesterov) rate, decayed linearly to 0",
    "momentum": "Nesterov momentum", "weight_decay": "coupled L2 towards the identity",
    "max_grad_norm": "global gradient-norm clip", "heldout": "sequences held out for the KL report",
    "seed": "sequence order",
}


def _add_dataclass_options(group, cls, help_text: dict, skip=()) -> None:
    """One option per field of a config dataclass, defaulting to the dataclass's own default."""
    defaults = cls()
    for field in dataclasses.fields(cls):
        if field.name in skip:
            continue
        default = getattr(defaults, field.name)
        flag = "--" + field.name.replace("_", "-")
        text = f"{help_text[field.name]} ({default})"
        if isinstance(default, bool):
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=text)
        else:
            kind = finite_float if isinstance(default, float) else type(default)
            group.add_argument(flag, type=kind, default=None, help=text)


def _config_from(cls, args, **extra):
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
             if getattr(args, f.name, None) is not None}
    return cls(**given, **extra)


def add_commands(sub, load_model) -> None:
    """Register `train-grpo` and `train-lens` on the `degs` subparsers object; `load_model(args)`
    loads the model the options name."""
    g = sub.add_parser("train-grpo", help="GRPO on GSM8K train with a math-verify reward (resumable)",
                       description=GRPO_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_model_args(g)
    g.add_argument("--out", required=True, help="run directory (created; resumed if it exists)")
    g.add_argument("--steps", type=int, required=True, help="train up to this many steps in total")
    g.add_argument("--data", default=None,
                   help="training JSONL with GSM8K's fields (default: the gsm8k_train.jsonl installed with degs_jax)")
    g.add_argument("--limit", type=int, default=None, help="only the first N training problems")
    g.add_argument("--checkpoint-every", type=int, default=10, help="steps between checkpoints (10)")
    g.add_argument("--keep-checkpoints", type=int, default=2, help="newest checkpoints kept (2)")
    g.add_argument("--time-limit", type=float, default=None, metavar="SECONDS",
                   help="stop (after a checkpoint) before a step that would end past this")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_dataclass_options(g.add_argument_group("GRPO hyperparameters"), GRPOConfig, GRPO_HELP)
    g.set_defaults(func=lambda args: cmd_train_grpo(args, load_model))

    t = sub.add_parser("train-lens", help="fit a tuned lens (per-layer affine translators)",
                       description=LENS_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_model_args(t)
    t.add_argument("--out", default=None,
                   help="lens file (default: the cache entry `--lens tuned` reads for this model)")
    t.add_argument("--corpus", default=None,
                   help="GSM8K-format JSONL whose question + solution texts are the corpus "
                        "(default: the gsm8k_train.jsonl installed with degs_jax)")
    t.add_argument("--layers", type=int_list, default=None, metavar="L1,L2,...",
                   help="layers to translate, comma-separated, increasing, in 0..L (default 0..L-1)")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_dataclass_options(t.add_argument_group("fitting"), TunedLensConfig, LENS_HELP, skip=("layers",))
    t.set_defaults(func=lambda args: cmd_train_lens(args, load_model))


def cmd_train_grpo(args, load_model) -> int:
    # Bad values and files fail before the model loads.
    if args.seed is not None:
        check_seed(args.seed)
    config = _config_from(GRPOConfig, args)
    for flag, value in (("--steps", args.steps), ("--checkpoint-every", args.checkpoint_every),
                        ("--keep-checkpoints", args.keep_checkpoints), ("--limit", args.limit)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be at least 1, got {value}"
                             + (" (the newest checkpoint is what a rerun resumes from)"
                                if flag == "--keep-checkpoints" else ""))
    if args.time_limit is not None and not args.time_limit > 0:
        raise ValueError(f"--time-limit must be a positive number of seconds, got {args.time_limit}")
    check_output_dir(Path(args.out))
    if args.data is not None:
        read_gsm8k_rows(args.data)
    # A resumed run keeps the dtype it was made with (its run.json records it as an eval's does).
    keep_recorded_dtype(args, recorded_dtype(Path(args.out)), args.out)
    model = load_model(args)
    tasks = gsm8k_train_tasks(model.tokenizer, args.data, chat=not args.no_chat,
                              max_prompt_len=config.max_prompt_len, limit=args.limit,
                              verify_checksum=args.data is None)
    mesh = None
    if args.mesh is not None:  # the mesh `load_model` put the weights on (same devices, same axes)
        mesh = make_mesh(*args.mesh)
    with MathReward(model.tokenizer) as reward:
        result = train_grpo(model, Path(args.out), config, tasks=tasks, reward_fn=reward,
                            steps=args.steps, mesh=mesh, checkpoint_every=args.checkpoint_every,
                            keep_checkpoints=args.keep_checkpoints, progress=not args.no_progress,
                            time_limit=args.time_limit, argv=sys.argv[1:])
    print(json.dumps(result))
    return 0


def cmd_train_lens(args, load_model) -> int:
    if args.seed is not None:
        check_seed(args.seed)
    config = _config_from(TunedLensConfig, args)  # --layers included; bad values fail here
    if args.out is not None:
        check_lens_destination(args.out)  # before the fit, not after
    if args.corpus is not None:
        read_gsm8k_rows(args.corpus)
    model = load_model(args)
    if config.layers is not None:
        try:
            check_lens_layers(model.cfg, config.layers)
        except ValueError as e:
            raise ValueError(f"--layers: {e}") from None
    sequences = gsm8k_lens_corpus(model.tokenizer, config.seq_len, args.corpus)
    lens, report = fit_tuned_lens(model.params, model.cfg, sequences, config,
                                  progress=not args.no_progress)
    fingerprint = params_fingerprint(model.params)
    path = Path(args.out) if args.out else default_lens_path(fingerprint)
    report["model"] = model.name
    save_tuned_lens(lens, path, model.cfg, fingerprint, report)
    print(f"{'layer':>5}  {'KL logit lens':>13}  {'KL tuned lens':>13}  (held-out, nats)")
    for layer, a, b in zip(report["layers"], report["heldout_kl_logit"], report["heldout_kl_tuned"]):
        print(f"{layer:>5}  {a:>13.4f}  {b:>13.4f}")
    print(f"saved {path} ({len(sequences)} sequences of {config.seq_len} tokens, "
          f"{report['seconds']:.0f}s)", file=sys.stderr)
    return 0
