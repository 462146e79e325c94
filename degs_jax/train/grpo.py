"""GRPO with verifiable rewards (the paper's "GRPO (MATH)" reference), in JAX with optax.

One step of `train_grpo`:

1. Rollouts. P prompts, G completions each (row r belongs to prompt r // G), sampled at
   temperature 1 with the project's jitted generator (`generation.prefill`, `repeat_rows`,
   `generate`) from the current policy; row r draws with `split(fold_in(key(seed), step),
   P·G)[r]`.
2. Rewards. `reward_fn(tasks, completions) -> [P·G]` on the host; the default
   (`rewards.MathReward`) grades the last boxed answer with math-verify in a worker
   process: 1 if correct, else 0.
3. Advantages, group-normalised (GRPO, Shao et al. 2024):
   `A_i = (r_i - mean_group r) / (std_group r + 1e-6)` over the G completions of one
   prompt (population std); `scale_advantages=False` keeps only the centring (Dr. GRPO,
   Liu et al. 2025). A group whose rewards are all equal has A = 0: no signal.
4. Objective, per generated token t of completion i (EOS included: it is an action;
   prompt and padding excluded), with token-level normalisation:

       L = (1/N) Σ_i Σ_t [ -min(ρ_t A_i, clip(ρ_t, 1-ε, 1+ε) A_i) + β k3_t ]

   ρ_t = π_θ(x_t | x_<t) / π_old(x_t | x_<t); k3_t = exp(q_t) - q_t - 1 with
   q_t = log π_ref(x_t | x_<t) - log π_θ(x_t | x_<t), Schulman's non-negative unbiased
   estimator of KL(π_θ ‖ π_ref), the one DeepSeekMath's GRPO uses; N = number of
   generated tokens in the (mini)batch. Token-level normalisation is DAPO's (Yu et al.
   2025): every generated token weighs the same. The original GRPO averages within each
   completion first, which gives the tokens of short completions more weight (a length
   bias pointed out by DAPO and Dr. GRPO); the global sum is also what makes the
   gradient of a batch exactly the sum of its micro-batches' gradients.
5. Updates. The rollouts are cut into `updates_per_step` minibatches of whole prompt
   groups, one AdamW step each (optax: global-norm clipping, then AdamW with a linear
   warm-up to a constant rate). π_old is the policy that drew the rollouts, scored by
   the same training forward before the first update (so ρ = 1 exactly there); with
   one update per step π_old = stop_gradient(π_θ) and that extra pass is skipped.

Precision ("bf16 params with fp32 optimizer state"): the optimizer keeps fp32 master
weights and fp32 Adam moments; each step casts the masters to the model's dtype (bf16
by default) for the rollouts and the training forward, takes gradients with respect to
that copy, and accumulates them in fp32 across micro-batches before the fp32 update.
Updates of size lr ~ 1e-6 are far below bf16's resolution (2^-8 relative), so without
fp32 masters they would round away. Log-probabilities, the softmax and every statistic
are fp32.

Memory: `remat=True` recomputes each transformer block in the backward pass
(`jax.checkpoint`), and `micro_batch` rows go through the model at a time (their
[rows, S, V] fp32 logits are the largest buffer). A mesh ("data", "model") splits the
rows over "data" (gradients all-reduced by XLA) and the weights, masters and Adam
moments over "model" as in inference (`models.sharding`).

Defaults follow the recipe the paper's appendix names for its GRPO references ("the
GRPO implementation of Shao et al. 2025 [Spurious Rewards] with its default
hyperparameters"): their scripts (`ruixin31/Rethink_RLVR`, `code/scripts/rlvr_*grpo*.sh`,
on TTRL / OpenRLHF) use 16 samples per prompt, 64 prompts per rollout batch, train batch
128 sequences (so 8 updates per rollout batch), actor lr 5e-7 constant without warm-up,
KL coefficient 0, temperature 1, group-normalised advantages, prompts up to 1024 and
completions up to 3072 tokens; clip ε = 0.2, Adam betas (0.9, 0.95), gradient-norm clip
1.0 and no weight decay are OpenRLHF's defaults there. The one deliberate departure is
the token-level normalisation (above; OpenRLHF averages per sequence).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm.auto import tqdm

from jax.sharding import NamedSharding, PartitionSpec

from ..eval.results import ResultStore, package_versions, read_run_file, write_json
from ..generation import Proposal, SamplerSpec, generate, prefill
from ..models import ModelConfig, Params, TransformerLM, forward
from ..models.sharding import DATA, MODEL, param_shardings, param_specs
from ..rows import repeat_rows
from .checkpoints import latest_checkpoint, restore_checkpoint, save_checkpoint
from .data import pad_prompts, step_tasks, tasks_fingerprint
from .optim import accumulate_gradients, cast_tree, split_micro_batches

Array = jax.Array

ADVANTAGE_EPS = 1e-6


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
    """Hyperparameters of a GRPO run (static; defaults: the recipe of the module docstring).

    group_size: completions per prompt (G).
    prompts_per_step: prompts per rollout batch (P); P·G rows per step.
    max_prompt_len: prompts are right-padded to this many tokens (longer ones are
      refused when the dataset is built); one compiled shape for every step.
    max_new_tokens: completion budget per rollout.
    temperature: rollout sampling temperature (1: samples from π itself, so the
      generator's distribution is the policy being optimised).
    learning_rate: peak AdamW rate; warmup_steps: linear warm-up (in optimizer
      updates) from 0 to it, constant afterwards.
    adam_b1, adam_b2, adam_eps, weight_decay: AdamW (decoupled weight decay).
    max_grad_norm: clip the global gradient norm to this (0 = off).
    clip_eps: PPO ratio clip ε.
    kl_coef: β of the k3 KL penalty to the frozen reference (0 = no penalty).
    reference_kl: score every rollout under the frozen reference to log KL(π_θ ‖ π_ref)
      (one forward pass per step); required when kl_coef > 0.
    updates_per_step: optimizer updates per rollout batch (minibatches of whole
      groups); P must be divisible by it.
    micro_batch: rows per gradient-accumulation chunk (memory only; must divide the
      rows of a minibatch).
    scale_advantages: divide by the group's reward std (GRPO); False: Dr. GRPO.
    remat: recompute transformer blocks in the backward pass (gradient checkpointing).
    seed: rollout keys and prompt order.
    """

    group_size: int = 16
    prompts_per_step: int = 64
    max_prompt_len: int = 1024
    max_new_tokens: int = 3072
    temperature: float = 1.0
    learning_rate: float = 5e-7
    warmup_steps: int = 0
    adam_b1: float = 0.9
    adam_b2: float = 0.95
    adam_eps: float = 1e-8
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    clip_eps: float = 0.2
    kl_coef: float = 0.0
    reference_kl: bool = True
    updates_per_step: int = 8
    micro_batch: int = 4
    scale_advantages: bool = True
    remat: bool = True
    seed: int = 0

    def __post_init__(self):
        for name in ("group_size", "prompts_per_step", "max_prompt_len", "max_new_tokens",
                     "updates_per_step", "micro_batch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.group_size < 2:
            raise ValueError(f"group_size must be >= 2 (advantages compare completions of one "
                             f"prompt), got {self.group_size}")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 for rollouts, got {self.temperature}")
        if not self.learning_rate > 0 or self.warmup_steps < 0:
            raise ValueError("learning_rate must be > 0 and warmup_steps >= 0")
        if not 0 < self.clip_eps < 1:
            raise ValueError(f"clip_eps must be in (0, 1), got {self.clip_eps}")
        if self.kl_coef < 0 or self.weight_decay < 0 or self.max_grad_norm < 0:
            raise ValueError("kl_coef, weight_decay and max_grad_norm must be >= 0")
        if self.kl_coef > 0 and not self.reference_kl:
            raise ValueError("kl_coef > 0 needs the reference log-probabilities (reference_kl=True)")
        if self.prompts_per_step % self.updates_per_step:
            raise ValueError(f"prompts_per_step ({self.prompts_per_step}) must be divisible by "
                             f"updates_per_step ({self.updates_per_step}): each update takes whole groups")
        rows = self.minibatch_rows
        if rows % self.micro_batch:
            raise ValueError(f"micro_batch ({self.micro_batch}) must divide the {rows} rows of a "
                             f"minibatch (prompts_per_step * group_size / updates_per_step)")

    @property
    def rows(self) -> int:
        """Completions per step (P·G)."""
        return self.prompts_per_step * self.group_size

    @property
    def minibatch_rows(self) -> int:
        return self.rows // self.updates_per_step


def learning_rate_schedule(config: GRPOConfig) -> optax.Schedule:
    """Linear warm-up from 0 over `warmup_steps` optimizer updates, then constant."""
    if config.warmup_steps:
        return optax.linear_schedule(0.0, config.learning_rate, config.warmup_steps)
    return optax.constant_schedule(config.learning_rate)


def make_optimizer(config: GRPOConfig) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW on the warm-up schedule."""
    parts = [optax.clip_by_global_norm(config.max_grad_norm)] if config.max_grad_norm else []
    parts.append(optax.adamw(learning_rate_schedule(config), b1=config.adam_b1, b2=config.adam_b2,
                             eps=config.adam_eps, weight_decay=config.weight_decay))
    return optax.chain(*parts)


# ----------------------------------------------------------------------------- math

def group_advantages(rewards: Array, group_size: int, scale: bool = True) -> Array:
    """Group-normalised advantages. rewards: [P·G] (rows of a prompt adjacent) -> [P·G] fp32."""
    r = jnp.asarray(rewards, jnp.float32).reshape(-1, group_size)
    centred = r - r.mean(axis=1, keepdims=True)
    if scale:
        centred = centred / (r.std(axis=1, keepdims=True) + ADVANTAGE_EPS)
    return centred.reshape(-1)


def grpo_token_loss(logp: Array, old_logp: Array, ref_logp: Optional[Array], advantages: Array,
                    mask: Array, n_tokens: Array, clip_eps: float, kl_coef: float):
    """The clipped objective of the module docstring, summed over `mask` and divided by
    `n_tokens` (the token count of the whole minibatch, so micro-batch losses add up).

    logp, old_logp, ref_logp: [B, S] fp32 per-token log-probabilities (ref_logp None: no
    KL term or statistic); advantages: [B]; mask: [B, S] bool, the generated tokens.
    Returns (loss, sums) with sums of per-token statistics over the mask: `kl` (k3),
    `clipped` (tokens where the clipped term is the smaller one, i.e. the gradient is
    cut), `ratio` and `tokens`.
    """
    mask = mask.astype(bool)
    ratio = jnp.exp(logp - old_logp)
    adv = advantages[:, None].astype(jnp.float32)
    unclipped = ratio * adv
    clipped = jnp.clip(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * adv
    per_token = -jnp.minimum(unclipped, clipped)
    zero = jnp.zeros((), jnp.float32)
    kl_sum = zero
    if ref_logp is not None:
        q = ref_logp - logp
        k3 = jnp.exp(q) - q - 1.0
        if kl_coef:
            per_token = per_token + kl_coef * k3
        kl_sum = jnp.sum(jnp.where(mask, k3, 0.0))
    loss = jnp.sum(jnp.where(mask, per_token, 0.0)) / n_tokens
    sums = {
        "kl": kl_sum,
        "clipped": jnp.sum(mask & (clipped < unclipped)).astype(jnp.float32),
        "ratio": jnp.sum(jnp.where(mask, ratio, 0.0)),
        "tokens": jnp.sum(mask).astype(jnp.float32),
    }
    return loss, sums


def token_logprobs(params: Params, cfg: ModelConfig, tokens: Array, remat: bool = False):
    """Teacher-forced log π(x_t | x_<t) and the entropy of π(· | x_<t), both [B, S] fp32
    (0 at t = 0, which has no prediction). tokens: [B, S] int32 at positions 0..S-1."""
    B, S = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32)[None], (B, S))
    logits = forward(params, cfg, tokens, positions, remat=remat).logits[:, :-1]  # predicts x_1..
    log_z = jax.nn.logsumexp(logits, axis=-1)
    chosen = jnp.take_along_axis(logits, tokens[:, 1:, None], axis=-1)[..., 0]
    logp = chosen - log_z
    probs = jax.lax.stop_gradient(jnp.exp(logits - log_z[..., None]))
    entropy = jax.lax.stop_gradient(log_z - jnp.sum(probs * logits, axis=-1))
    pad = jnp.zeros((B, 1), jnp.float32)
    return jnp.concatenate([pad, logp], axis=1), jnp.concatenate([pad, entropy], axis=1)


@functools.partial(jax.jit, static_argnames=("cfg", "micro_batch", "remat"))
def score_tokens(params: Params, cfg: ModelConfig, tokens: Array, micro_batch: int,
                 remat: bool = False) -> Array:
    """log π(x_t | x_<t), [B, S] fp32, `micro_batch` rows at a time (no gradient)."""
    def body(_, rows):
        return None, token_logprobs(params, cfg, rows, remat)[0]

    _, logp = jax.lax.scan(body, None, split_micro_batches(tokens, micro_batch))
    # Undo the strided split: [M, m, S] -> [m, M, S] -> [B, S].
    return jnp.swapaxes(logp, 0, 1).reshape(tokens.shape)


def _pin_params(tree, cfg: ModelConfig):
    """Under a ("data", "model") mesh, keep a Params-shaped tree (masters, Adam moments) in
    the inference layout (`sharding.param_specs`), so that the donated inputs' buffers
    are reused and the next step needs no resharding; unchanged without a mesh."""
    if not isinstance(tree, Params):
        return tree
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or MODEL not in mesh.axis_names:
        return tree
    specs = param_specs(cfg, mesh.shape[MODEL])
    return jax.tree.map(lambda spec, x: jax.lax.with_sharding_constraint(x, spec), specs, tree,
                        is_leaf=lambda x: isinstance(x, PartitionSpec))


@functools.partial(jax.jit, static_argnames=("cfg", "config", "compute_dtype"),
                   donate_argnums=(0, 1))
def update_step(master: Params, opt_state, cfg: ModelConfig, tokens: Array, mask: Array,
                advantages: Array, old_logp: Optional[Array], ref_logp: Optional[Array],
                config: GRPOConfig, compute_dtype: str = "bfloat16"):
    """One AdamW update on a minibatch: tokens, mask [B, S], advantages [B], old_logp /
    ref_logp [B, S] or None (old: stop_gradient of the current policy). The fp32 masters
    are cast to `compute_dtype` for the forward; masters and optimizer state are
    donated. Returns (master, opt_state, metrics)."""
    params = cast_tree(master, jnp.dtype(compute_dtype))
    n_tokens = jnp.maximum(jnp.sum(mask), 1).astype(jnp.float32)
    batch = {"tokens": tokens, "mask": mask, "advantages": advantages}
    if old_logp is not None:
        batch["old_logp"] = old_logp
    if ref_logp is not None:
        batch["ref_logp"] = ref_logp

    def loss_fn(p, mb):
        logp, entropy = token_logprobs(p, cfg, mb["tokens"], config.remat)
        old = mb["old_logp"] if "old_logp" in mb else jax.lax.stop_gradient(logp)
        loss, sums = grpo_token_loss(logp, old, mb.get("ref_logp"), mb["advantages"], mb["mask"],
                                     n_tokens, config.clip_eps, config.kl_coef)
        sums["entropy"] = jnp.sum(jnp.where(mb["mask"], entropy, 0.0))
        return loss, sums

    loss, sums, grads = accumulate_gradients(loss_fn, params, batch, config.micro_batch)
    grad_norm = optax.global_norm(grads)
    optimizer = make_optimizer(config)
    updates, opt_state = optimizer.update(grads, opt_state, master)
    master = _pin_params(optax.apply_updates(master, updates), cfg)
    opt_state = jax.tree.map(lambda x: _pin_params(x, cfg), opt_state,
                             is_leaf=lambda x: isinstance(x, Params))
    tokens_n = jnp.maximum(sums["tokens"], 1.0)
    metrics = {"loss": loss, "grad_norm": grad_norm, "tokens": sums["tokens"],
               "kl": sums["kl"] / tokens_n, "clip_fraction": sums["clipped"] / tokens_n,
               "ratio": sums["ratio"] / tokens_n, "entropy": sums["entropy"] / tokens_n}
    return master, opt_state, metrics


# ----------------------------------------------------------------------------- rollouts

def rollout(params: Params, cfg: ModelConfig, prompts: Array, prompt_len: Array, key: Array, *,
            group_size: int, max_new_tokens: int, spec: SamplerSpec):
    """`group_size` completions of every prompt with the project's generator.

    prompts: [P, Lp] int32 right-padded; prompt_len: [P]. Row r of the result is prompt
    r // group_size and draws with `split(key, P·G)[r]`. Returns the GenState (tokens,
    lengths, per-token log p of the generator)."""
    P, Lp = prompts.shape
    model = TransformerLM(cfg)
    state = prefill(model, params, prompts, prompt_len, Lp + max_new_tokens, params.embed.dtype)
    state = repeat_rows(state, group_size)
    keys = jax.random.split(key, P * group_size)
    return generate(model, params, state, state.prompt_len + max_new_tokens, keys, spec)


@functools.partial(jax.jit, static_argnames=("dtype",))
def _cast(tree, dtype: str):
    return cast_tree(tree, jnp.dtype(dtype))


# ----------------------------------------------------------------------------- training loop

RUN_FILE = "run.json"
LOG_FILE = "log.jsonl"


def _run_record(model, config: GRPOConfig, tasks, reward_fn) -> dict[str, Any]:
    return {
        "grpo": dataclasses.asdict(config),
        "model": {"name": model.name, "source": str(model.source),
                  "architecture": model.cfg.architecture, "num_layers": model.cfg.num_layers,
                  "dtype": str(jnp.dtype(model.params.embed.dtype))},
        "tasks": {"n": len(tasks), "sha256": tasks_fingerprint(tasks)},
        "reward": repr(reward_fn),
    }


def _prepare_run(out: Path, record: dict, invocation: dict) -> None:
    run_file = out / RUN_FILE
    if run_file.exists():
        run = read_run_file(run_file)
        stored = run["config"]
        if stored != json.loads(json.dumps(record)):
            diffs = sorted(k for k in set(stored) | set(record)
                           if json.dumps(stored.get(k), sort_keys=True)
                           != json.dumps(record.get(k), sort_keys=True))
            raise ValueError(f"{out} holds a GRPO run with a different configuration ({', '.join(diffs)} "
                             "differ); use another --out directory or repeat the original command")
        run["invocations"].append(invocation)
    else:
        out.mkdir(parents=True, exist_ok=True)
        run = {"config": record, "invocations": [invocation]}
    write_json(run_file, run)


def _truncate_log(path: Path, before_step: int) -> None:
    """Keep the log records of steps < before_step (later ones are redone after a resume);
    a torn last line is dropped."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record.get("step", before_step) < before_step:
            kept.append(line)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(k + "\n" for k in kept))
    tmp.replace(path)


def _place_rows(x, mesh):
    """Put a host array on the mesh split by rows over "data" (default device without one)."""
    if mesh is None:
        return jnp.asarray(x)
    return jax.device_put(x, NamedSharding(mesh, PartitionSpec(DATA, *([None] * (np.ndim(x) - 1)))))


def train_grpo(model, out_dir, config: GRPOConfig, *, tasks, reward_fn: Callable, steps: int,
               eos_ids: Optional[Sequence[int]] = None, mesh=None, checkpoint_every: int = 10,
               keep_checkpoints: int = 2, progress: bool = True, time_limit: Optional[float] = None,
               argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    """Train `model` (a LoadedModel: cfg, params, tokenizer, name, source) with GRPO up to
    `steps` steps, resuming from the newest checkpoint in `out_dir` if there is one.

    tasks: :class:`~degs_jax.train.data.Task` list; reward_fn: `(tasks, completions) ->
    [n]` (see `rewards`). Writes `out_dir/run.json` (configuration, refused if it differs
    on resume; one entry per invocation), `out_dir/log.jsonl` (one record per step) and
    checkpoints every `checkpoint_every` steps and after the last (`checkpoints`).
    mesh: a ("data", "model") mesh the model was loaded onto (rows split over "data").
    time_limit: seconds; stop (after a checkpoint) before a step that would likely end
    past it, so the next invocation resumes there. Returns a summary dict.
    """
    t_start = time.perf_counter()
    if steps < 0 or checkpoint_every < 1:
        raise ValueError("steps must be >= 0 and checkpoint_every >= 1")
    cfg = model.cfg
    if config.max_prompt_len + config.max_new_tokens > cfg.max_position_embeddings:
        raise ValueError(f"max_prompt_len + max_new_tokens = {config.max_prompt_len + config.max_new_tokens} "
                         f"exceeds the model's context of {cfg.max_position_embeddings}")
    if mesh is not None:
        n_data = mesh.shape[DATA]
        if config.micro_batch % n_data or config.prompts_per_step % n_data:
            raise ValueError(f"prompts_per_step ({config.prompts_per_step}) and micro_batch "
                             f"({config.micro_batch}) must be divisible by the mesh's data axis "
                             f"({n_data}): rows are split evenly over it")
    out = Path(out_dir)
    eos = tuple(eos_ids) if eos_ids is not None else model.eos_ids
    spec = SamplerSpec(Proposal(config.temperature), eos_ids=eos)
    compute_dtype = str(jnp.dtype(model.params.embed.dtype))
    invocation = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                  "argv": list(argv) if argv is not None else None, "steps": steps,
                  "device": str(jax.devices()[0]), "versions": package_versions()}
    _prepare_run(out, _run_record(model, config, tasks, reward_fn), invocation)

    optimizer = make_optimizer(config)
    master = _cast(model.params, "float32")
    opt_state = jax.jit(optimizer.init)(master)
    if mesh is not None:
        shardings = param_shardings(cfg, mesh)
        # Adam moments in the masters' layout (optax.init makes them on the default device).
        opt_state = jax.tree.map(lambda x: jax.device_put(x, shardings) if isinstance(x, Params) else x,
                                 opt_state, is_leaf=lambda x: isinstance(x, Params))
    else:
        shardings = None
    start = 0
    found = latest_checkpoint(out)
    if found is not None:
        start, master, opt_state, _ = restore_checkpoint(found, cfg, opt_state, shardings)
    reference = model.params if config.reference_kl else None
    log_path = out / LOG_FILE
    _truncate_log(log_path, start)
    root_key = jax.random.key(config.seed)
    G, U, R = config.group_size, config.updates_per_step, config.minibatch_rows
    last_saved = done_steps = start
    step_seconds = []
    stopped = None
    scope = jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()
    with scope, ResultStore(log_path, id_key="step") as log, \
            tqdm(total=steps, initial=min(start, steps), unit="step", desc="GRPO", file=sys.stderr,
                 disable=not progress) as bar:
        for step in range(start, steps):
            if time_limit is not None and step_seconds:
                elapsed = time.perf_counter() - t_start
                if elapsed + 1.5 * max(step_seconds[-3:]) > time_limit:
                    stopped = f"time limit of {time_limit:.0f}s"
                    break
            t0 = time.perf_counter()
            batch = step_tasks(tasks, step, config.prompts_per_step, config.seed)
            prompts, prompt_len = pad_prompts(batch, config.max_prompt_len)
            params = _cast(master, compute_dtype)
            state = rollout(params, cfg, _place_rows(prompts, mesh), _place_rows(prompt_len, mesh),
                            jax.random.fold_in(root_key, step), group_size=G,
                            max_new_tokens=config.max_new_tokens, spec=spec)
            tokens, plen, length, ended = jax.device_get(
                (state.tokens, state.prompt_len, state.length, state.ended))
            del state
            completions = [tokens[r, plen[r]:length[r]].tolist() for r in range(tokens.shape[0])]
            t1 = time.perf_counter()
            rewards = np.asarray(reward_fn([t for t in batch for _ in range(G)], completions), np.float32)
            if rewards.shape != (config.rows,) or not np.all(np.isfinite(rewards)):
                raise ValueError(f"reward_fn returned {rewards.shape} {rewards.dtype} values; expected "
                                 f"{config.rows} finite rewards")
            t2 = time.perf_counter()
            advantages = np.asarray(group_advantages(rewards, G, config.scale_advantages))
            pos = np.arange(tokens.shape[1])[None]
            mask = (pos >= plen[:, None]) & (pos < length[:, None])
            tokens_d = _place_rows(tokens, mesh)
            ref_logp = (score_tokens(reference, cfg, tokens_d, config.micro_batch)
                        if reference is not None else None)
            old_logp = score_tokens(params, cfg, tokens_d, config.micro_batch) if U > 1 else None
            del params
            metrics = []
            for u in range(U):
                rows = slice(u * R, (u + 1) * R)
                sub = lambda x: None if x is None else _place_rows(np.asarray(x)[rows], mesh)
                master, opt_state, m = update_step(
                    master, opt_state, cfg, sub(tokens), sub(mask), sub(advantages),
                    sub(old_logp), sub(ref_logp), config, compute_dtype)
                metrics.append(m)
            metrics = jax.device_get(metrics)
            t3 = time.perf_counter()
            generated = int((length - plen).sum())
            record = _step_record(step, config, rewards, metrics, length - plen, ended, generated,
                                  (t0, t1, t2, t3))
            log.append(record)
            step_seconds.append(t3 - t0)
            bar.update(1)
            bar.set_postfix(reward=f"{record['reward_mean']:.3f}", kl=f"{record['kl']:.4f}")
            done_steps = step + 1
            if done_steps % checkpoint_every == 0 or done_steps == steps:
                save_checkpoint(out, done_steps, master, opt_state, cfg, model.tokenizer,
                                {"seed": config.seed}, keep=keep_checkpoints)
                last_saved = done_steps
        if last_saved < done_steps:  # stopped by the time limit between checkpoints
            save_checkpoint(out, done_steps, master, opt_state, cfg, model.tokenizer,
                            {"seed": config.seed}, keep=keep_checkpoints)
            last_saved = done_steps
    return {"run_dir": str(out), "resumed_from": start, "steps_done": done_steps, "steps": steps,
            "stopped": stopped, "checkpoint": str(latest_checkpoint(out)) if last_saved else None,
            "seconds": time.perf_counter() - t_start}


def _step_record(step: int, config: GRPOConfig, rewards: np.ndarray, metrics: list[dict],
                 completion_len: np.ndarray, ended: np.ndarray, generated: int, times) -> dict:
    t0, t1, t2, t3 = times
    groups = rewards.reshape(-1, config.group_size)
    tokens = np.array([m["tokens"] for m in metrics], np.float64)
    weight = tokens / max(tokens.sum(), 1.0)
    mean = lambda key: float(np.sum(weight * np.array([m[key] for m in metrics], np.float64)))
    last_update = (step + 1) * config.updates_per_step - 1  # the rate of the step's last update
    return {
        "step": step,
        "reward_mean": float(rewards.mean()), "reward_std": float(rewards.std()),
        "groups_rewarded": float(np.mean(groups.max(axis=1) > 0)),
        "groups_without_signal": float(np.mean(groups.max(axis=1) == groups.min(axis=1))),
        "kl": mean("kl") if config.reference_kl else None, "clip_fraction": mean("clip_fraction"), "entropy": mean("entropy"),
        "ratio": mean("ratio"), "loss": float(np.mean([m["loss"] for m in metrics])),
        "grad_norm": float(np.mean([m["grad_norm"] for m in metrics])),
        "learning_rate": float(learning_rate_schedule(config)(last_update)),
        "completion_tokens": float(completion_len.mean()), "ended_fraction": float(ended.mean()),
        "generated_tokens": generated,
        "tokens_per_s": generated / max(t3 - t0, 1e-9),
        "rollout_tokens_per_s": generated / max(t1 - t0, 1e-9),
        "seconds": {"rollout": t1 - t0, "reward": t2 - t1, "train": t3 - t2, "total": t3 - t0},
    }
