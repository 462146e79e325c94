"""Tuned lens (Belrose et al. 2023, "Eliciting Latent Predictions from Transformers with
the Tuned Lens"): one learned affine translator per layer, so that early residuals are
read in the output basis instead of through the logit lens as they are.

Numerics. Layer l's lens distribution is
`p̃_l = softmax(W_U · RMSNorm_final(h_l + h_l·A_l + b_l))` with A_l [D, D], b_l [D] in
fp32, both zero-initialised (so an untrained lens *is* the logit lens); the translation
is `models.lens_head.translate_residuals`, the same function `forward` applies through
its `lens_translators` argument, so training and use share one code path. Translators
are fitted to minimise the forward KL to the model's own next-token distribution at
the same position, averaged over tokens,

    loss = Σ_l mean_t KL(p_L(t) ‖ p̃_l(t)),

each layer's term depending on its own translator only. As in the reference
implementation (`tuned-lens`: translators for the embeddings and every block but the
last, `h + translator(h)` so weight decay pulls towards the identity), the default
layers are 0..L-1; the final layer needs none (its lens is the model's output, so
`lens="tuned"` reads row L untranslated and log p is unchanged). A translator for L
may be requested: its optimum is the identity, which makes it a check of the fit.

Optimisation (defaults of the reference `tuned-lens` train loop): SGD with Nesterov
momentum 0.9 at rate 1.0 in the momentum-normalised convention (0.1 in optax's,
which sums rather than averages gradients), linear decay to 0 over 250 steps,
coupled weight decay 1e-3, global gradient-norm clip 1.0. The reference takes 2^18
tokens per step from the Pile; our default corpus, the GSM8K *train* solutions
(~1.2M tokens), gets 2^15 per step (~7 passes in 250 steps). The model is frozen: its
residuals and final log-probabilities are computed without gradients, and each layer's
[tokens, V] logits are recomputed in the backward pass (`jax.checkpoint`), so memory
holds one layer's logits of one micro-batch at a time.

Saved lenses are safetensors files (`weight`, `bias` + JSON metadata) cached under
`<cache_dir>/tuned-lens/<model fingerprint>.safetensors`; the fingerprint is the
sha256 of the model's weights rounded to bf16 (so bf16 and fp32 loads of one model
share a lens, and a fine-tuned model does not reuse its base model's).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from safetensors import safe_open
from safetensors.numpy import save_file
from tqdm.auto import tqdm

from ..eval.benchmarks import SHA256
from ..models import LensTranslators, ModelConfig, Params, forward, rms_norm, translate_residuals
from ..models.loading import default_cache_dir
from .data import default_gsm8k_train_path, read_gsm8k_rows
from .optim import accumulate_gradients, split_micro_batches

Array = jax.Array

LENS_DIR = "tuned-lens"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TunedLens:
    """Translators for `layers` (HF hidden_states numbering: 0 = embeddings, l = after
    block l): row k maps h_{layers[k]} to h + h·weight[k] + bias[k]."""

    layers: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
    weight: Array  # [K, D, D] fp32
    bias: Array  # [K, D] fp32

    def translators_for(self, lens_layers: Sequence[int]) -> LensTranslators:
        """The `forward(lens_translators=...)` rows for `lens_layers`, in that order; the
        identity (zeros) for a layer without a translator (layer L by default)."""
        index = {l: k for k, l in enumerate(self.layers)}
        D = self.bias.shape[-1]
        zeros_w, zeros_b = jnp.zeros((D, D), jnp.float32), jnp.zeros((D,), jnp.float32)
        rows = [index.get(int(l)) for l in lens_layers]
        return LensTranslators(
            weight=jnp.stack([zeros_w if k is None else self.weight[k] for k in rows]),
            bias=jnp.stack([zeros_b if k is None else self.bias[k] for k in rows]))

    def fingerprint(self) -> str:
        """sha256 of the layers and fp32 weights (`lens_fingerprint`; recorded by runs)."""
        return lens_fingerprint(self)


def default_lens_layers(cfg: ModelConfig) -> tuple[int, ...]:
    """Layers 0..L-1 (every residual the final layer's lens is not already the model's)."""
    return tuple(range(cfg.num_layers))


def identity_lens(cfg: ModelConfig, layers: Optional[Sequence[int]] = None) -> TunedLens:
    """Zero translators (the logit lens) for `layers` (default 0..L-1)."""
    layers = check_lens_layers(cfg, default_lens_layers(cfg) if layers is None else layers)
    D = cfg.hidden_size
    return TunedLens(layers=layers, weight=jnp.zeros((len(layers), D, D), jnp.float32),
                     bias=jnp.zeros((len(layers), D), jnp.float32))


def check_lens_layers(cfg: ModelConfig, layers: Sequence[int]) -> tuple[int, ...]:
    """``layers`` as a tuple if they are distinct increasing indices in 0..L; ValueError."""
    layers = tuple(int(l) for l in layers)
    bad = [l for l in layers if not 0 <= l <= cfg.num_layers]
    if not layers or bad or len(set(layers)) != len(layers) or list(layers) != sorted(layers):
        raise ValueError(f"tuned-lens layers must be distinct increasing indices in 0..{cfg.num_layers}, "
                         f"got {layers}")
    return layers


# ----------------------------------------------------------------------------- objective

def _layer_kl(final_logp: Array, lens_logits: Array) -> Array:
    """Σ over tokens of KL(p_final ‖ softmax(lens_logits)); both [N, V] fp32."""
    logq = jax.nn.log_softmax(lens_logits, axis=-1)
    return jnp.sum(jnp.exp(final_logp) * (final_logp - logq))


def lens_kl_sums(lens: TunedLens, params: Params, cfg: ModelConfig, tokens: Array) -> tuple[Array, Array]:
    """Per-layer Σ_t KL(p_L(t) ‖ p̃_l(t)) over every position of `tokens` [B, T], and the
    number of positions. Returns ([K] fp32, scalar). The model is not differentiated."""
    B, T = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None], (B, T))
    out = forward(params, cfg, tokens, positions, capture=lens.layers)
    final_logp = jax.lax.stop_gradient(jax.nn.log_softmax(out.logits, axis=-1)).reshape(B * T, -1)
    residuals = jax.lax.stop_gradient(out.residuals).reshape(len(lens.layers), B * T, -1)
    w_u = params.unembedding()

    @jax.checkpoint
    def one_layer(h, weight, bias):
        moved = translate_residuals(h[None], LensTranslators(weight[None], bias[None]))[0]
        normed = rms_norm(moved, params.final_norm, cfg.rms_norm_eps)
        logits = jnp.einsum("nd,vd->nv", normed, w_u, preferred_element_type=jnp.float32)
        return _layer_kl(final_logp, logits)

    def body(_, xs):
        return None, one_layer(*xs)

    _, sums = jax.lax.scan(body, None, (residuals, lens.weight, lens.bias))
    return sums, jnp.asarray(B * T, jnp.float32)


@functools.partial(jax.jit, static_argnames=("cfg", "micro_batch"))
def lens_kl(lens: TunedLens, params: Params, cfg: ModelConfig, tokens: Array, micro_batch: int) -> Array:
    """Mean KL(p_L ‖ p̃_l) per lens layer over `tokens` [B, T] (nats, [K] fp32),
    `micro_batch` rows at a time. With `identity_lens` this is the logit lens's KL."""
    def body(total, rows):
        sums, n = lens_kl_sums(lens, params, cfg, rows)
        return (total[0] + sums, total[1] + n), None

    zero = (jnp.zeros((len(lens.layers),), jnp.float32), jnp.zeros((), jnp.float32))
    (sums, n), _ = jax.lax.scan(body, zero, split_micro_batches(tokens, micro_batch))
    return sums / n


# ----------------------------------------------------------------------------- fitting

@dataclasses.dataclass(frozen=True)
class TunedLensConfig:
    """How the translators are fitted (defaults: module docstring).

    layers: layers to translate (None: 0..L-1).
    steps: optimizer steps; seq_len: tokens per training sequence; batch_size:
      sequences per step; micro_batch: sequences per forward (memory only).
    learning_rate: SGD rate in optax's convention (reference: 1.0 · (1 - momentum)),
      decayed linearly to 0 over `steps`; momentum: Nesterov momentum;
      weight_decay: coupled L2 towards the identity; max_grad_norm: global clip.
    heldout: sequences kept out of training to measure the KL before and after.
    seed: sequence order.
    """

    layers: Optional[tuple[int, ...]] = None
    steps: int = 250
    seq_len: int = 512
    batch_size: int = 64
    micro_batch: int = 8
    learning_rate: float = 0.1
    momentum: float = 0.9
    weight_decay: float = 1e-3
    max_grad_norm: float = 1.0
    heldout: int = 32
    seed: int = 0

    def __post_init__(self):
        for name in ("steps", "seq_len", "batch_size", "micro_batch", "heldout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.batch_size % self.micro_batch:
            raise ValueError(f"micro_batch ({self.micro_batch}) must divide batch_size ({self.batch_size})")
        if not self.learning_rate > 0 or not 0 <= self.momentum < 1:
            raise ValueError("learning_rate must be > 0 and momentum in [0, 1)")
        if self.layers is not None:
            object.__setattr__(self, "layers", tuple(int(l) for l in self.layers))


def lens_optimizer(config: TunedLensConfig) -> optax.GradientTransformation:
    schedule = optax.linear_schedule(config.learning_rate, 0.0, config.steps)
    return optax.chain(optax.clip_by_global_norm(config.max_grad_norm),
                       optax.add_decayed_weights(config.weight_decay),
                       optax.sgd(schedule, momentum=config.momentum, nesterov=True))


@functools.partial(jax.jit, static_argnames=("cfg", "config"), donate_argnums=(0, 1))
def lens_step(lens: TunedLens, opt_state, params: Params, cfg: ModelConfig, tokens: Array,
              config: TunedLensConfig):
    """One optimizer step on a [batch_size, seq_len] batch; returns (lens, opt_state,
    per-layer mean KL of the batch before the step)."""
    def loss_fn(l, rows):
        sums, n = lens_kl_sums(l, params, cfg, rows["tokens"])
        return jnp.sum(sums) / tokens.size, {"sums": sums, "n": n}

    _, aux, grads = accumulate_gradients(loss_fn, lens, {"tokens": tokens}, config.micro_batch)
    updates, opt_state = lens_optimizer(config).update(grads, opt_state, lens)
    return optax.apply_updates(lens, updates), opt_state, aux["sums"] / aux["n"]


def chunk_corpus(documents: Sequence[Sequence[int]], seq_len: int, separator: Optional[int]) -> np.ndarray:
    """Token documents joined (with `separator` between them, if given) and cut into
    [n, seq_len] int32 rows; the incomplete tail is dropped."""
    flat: list[int] = []
    for doc in documents:
        flat.extend(doc)
        if separator is not None:
            flat.append(separator)
    n = len(flat) // seq_len
    if n == 0:
        raise ValueError(f"corpus of {len(flat)} tokens is shorter than one {seq_len}-token sequence")
    return np.asarray(flat[: n * seq_len], np.int32).reshape(n, seq_len)


def gsm8k_lens_corpus(tokenizer, seq_len: int, path: Optional[str | os.PathLike] = None) -> np.ndarray:
    """The GSM8K train split's questions and worked solutions as [n, seq_len] sequences
    (documents `question\\nsolution`, separated by the tokenizer's EOS)."""
    path = Path(path) if path is not None else default_gsm8k_train_path()
    if not path.is_file():
        raise FileNotFoundError(f"corpus not found: {path}")
    data = path.read_bytes()
    if hashlib.sha256(data).hexdigest() == SHA256["gsm8k_test.jsonl"]:
        raise ValueError(f"{path} is the GSM8K test split; fit the lens on training text")
    rows = read_gsm8k_rows(path, data)
    docs = [tokenizer.encode(f"{r['question']}\n{r['answer']}", add_special_tokens=False) for r in rows]
    return chunk_corpus(docs, seq_len, tokenizer.eos_token_id)


def fit_tuned_lens(params: Params, cfg: ModelConfig, sequences: np.ndarray, config: TunedLensConfig,
                   *, progress: bool = True) -> tuple[TunedLens, dict[str, Any]]:
    """Fit translators on `sequences` [n, seq_len] (the last `config.heldout` rows are
    held out). Returns (lens, report) where the report has the held-out mean KL per
    layer for the logit lens and the tuned lens, and the training curve."""
    sequences = np.asarray(sequences, np.int32)
    if sequences.ndim != 2 or sequences.shape[1] != config.seq_len:
        raise ValueError(f"sequences must be [n, {config.seq_len}], got {sequences.shape}")
    if sequences.shape[0] < config.heldout + config.batch_size:
        raise ValueError(f"{sequences.shape[0]} sequences: need at least heldout ({config.heldout}) + "
                         f"batch_size ({config.batch_size})")
    heldout_micro = np.gcd(config.heldout, config.micro_batch)
    train, heldout = sequences[:-config.heldout], jnp.asarray(sequences[-config.heldout:])
    lens = identity_lens(cfg, config.layers)
    before = np.asarray(lens_kl(lens, params, cfg, heldout, int(heldout_micro)))
    opt_state = lens_optimizer(config).init(lens)
    curve = []
    rng = np.random.default_rng(config.seed)
    order = rng.permutation(len(train))
    cursor = 0
    t0 = time.perf_counter()
    for step in tqdm(range(config.steps), desc="tuned lens", unit="step", disable=not progress,
                     file=sys.stderr):
        if cursor + config.batch_size > len(order):
            order, cursor = rng.permutation(len(train)), 0
        batch = jnp.asarray(train[order[cursor:cursor + config.batch_size]])
        cursor += config.batch_size
        lens, opt_state, kl = lens_step(lens, opt_state, params, cfg, batch, config)
        curve.append(float(jnp.mean(kl)))
    after = np.asarray(lens_kl(lens, params, cfg, heldout, int(heldout_micro)))
    report = {"layers": list(lens.layers), "heldout_kl_logit": before.tolist(),
              "heldout_kl_tuned": after.tolist(), "train_kl_curve": curve,
              "tokens_seen": int(config.steps * config.batch_size * config.seq_len),
              "seconds": time.perf_counter() - t0, "config": dataclasses.asdict(config)}
    return lens, report


# ----------------------------------------------------------------------------- storage

def params_fingerprint(params: Params) -> str:
    """sha256 over every weight rounded to bf16 (with its shape), in Params order."""
    digest = hashlib.sha256()
    leaves = jax.tree.leaves(params)
    as_bf16 = jax.jit(lambda xs: [x.astype(jnp.bfloat16) for x in xs])(leaves)
    for x in as_bf16:
        arr = np.asarray(jax.device_get(x))
        digest.update(json.dumps(list(arr.shape)).encode())
        digest.update(arr.view(np.uint16).tobytes())
    return digest.hexdigest()


def lens_fingerprint(lens: TunedLens) -> str:
    """sha256 of a lens's layers and fp32 weights (recorded by runs that use it)."""
    digest = hashlib.sha256(json.dumps(list(lens.layers)).encode())
    for x in (lens.weight, lens.bias):
        digest.update(np.asarray(x, np.float32).tobytes())
    return digest.hexdigest()


def default_lens_path(fingerprint: str, cache_dir: Optional[str | os.PathLike] = None) -> Path:
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return root / LENS_DIR / f"{fingerprint}.safetensors"


def save_tuned_lens(lens: TunedLens, path: str | os.PathLike, cfg: ModelConfig, fingerprint: str,
                    report: Optional[dict] = None) -> Path:
    """Write `lens` as safetensors with its layers, model shape and fingerprint (atomic)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {"layers": json.dumps(list(lens.layers)), "model_fingerprint": fingerprint,
            "num_layers": str(cfg.num_layers), "hidden_size": str(cfg.hidden_size),
            "report": json.dumps(report or {})}
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        save_file({"weight": np.asarray(lens.weight, np.float32),
                   "bias": np.asarray(lens.bias, np.float32)}, str(tmp), metadata=meta)
        os.replace(tmp, path)
    finally:  # nothing half-written is left behind (a full disk, --out a directory)
        tmp.unlink(missing_ok=True)
    return path


def check_lens_destination(path: str | os.PathLike, option: str = "--out") -> Path:
    """`path` if a lens file can be written there (checked by writing, then removing, an
    empty file beside it: before hours of fitting, not after); ValueError otherwise."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{option} {path} is a directory; give a file path (e.g. {path}/lens.safetensors)")
    parent = next((p for p in path.parents if p.exists()), Path("."))
    if not parent.is_dir():
        raise ValueError(f"{option} {path} is under {parent}, which is a file")
    try:
        with tempfile.NamedTemporaryFile(dir=parent, prefix=".degs-write-check-"):
            pass
    except OSError as e:
        raise ValueError(f"{option} {path}: cannot write in {parent} ({e.strerror})") from None
    return path


def read_lens_file(path: str | os.PathLike) -> tuple[dict, np.ndarray, np.ndarray, tuple[int, ...]]:
    """(metadata, weight [K, D, D], bias [K, D], layers) of a saved lens; ValueError naming
    the file if it is not one (another safetensors file, or none)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"tuned lens not found: {path}")
    try:
        with safe_open(path, framework="numpy") as f:
            meta, names = f.metadata() or {}, set(f.keys())
            if not {"weight", "bias"} <= names:
                raise ValueError(f"{path} is not a tuned-lens file (its tensors are "
                                 f"{', '.join(sorted(names)) or 'none'}; a lens has 'weight' and "
                                 "'bias', written by `degs train-lens`)")
            weight, bias = f.get_tensor("weight"), f.get_tensor("bias")
    except ValueError:
        raise
    except Exception as e:  # safetensors' own error for a file that is not one
        raise ValueError(f"{path} is not a safetensors file ({' '.join(str(e).split())})") from None
    try:
        layers = tuple(int(l) for l in json.loads(meta["layers"]))
        int(meta["num_layers"])
    except (KeyError, ValueError, TypeError):
        raise ValueError(f"{path} is not a tuned-lens file (no valid 'layers' and 'num_layers' in "
                         "its metadata)") from None
    if (weight.ndim != 3 or weight.shape[1] != weight.shape[2]
            or bias.shape != weight.shape[:2] or weight.shape[0] != len(layers)):
        raise ValueError(f"{path}: weight {weight.shape} and bias {bias.shape} do not make "
                         f"translators for its {len(layers)} layers")
    return meta, weight, bias, layers


def load_tuned_lens(path: str | os.PathLike, cfg: ModelConfig,
                    fingerprint: Optional[str] = None) -> TunedLens:
    """Read a saved lens for a model of config `cfg`; with `fingerprint`, refuse a lens
    trained on other weights."""
    meta, weight, bias, layers = read_lens_file(path)
    if int(meta["num_layers"]) != cfg.num_layers or weight.shape[1:] != (cfg.hidden_size,) * 2:
        raise ValueError(f"{path}: a lens for {meta.get('num_layers')} layers of width "
                         f"{weight.shape[-1]}, not this model's {cfg.num_layers} x {cfg.hidden_size}")
    if fingerprint is not None and meta.get("model_fingerprint") != fingerprint:
        raise ValueError(f"{path} was fitted to other weights (fingerprint "
                         f"{meta.get('model_fingerprint', '?')[:12]}..., this model {fingerprint[:12]}...)")
    return TunedLens(layers=check_lens_layers(cfg, layers), weight=jnp.asarray(weight), bias=jnp.asarray(bias))


def lens_report(path: str | os.PathLike) -> dict:
    """The fitting report stored with a saved lens."""
    with safe_open(Path(path), framework="numpy") as f:
        return json.loads((f.metadata() or {}).get("report", "{}"))


def resolve_lens(kind: str, model, path: Optional[str | os.PathLike] = None,
                 cache_dir: Optional[str | os.PathLike] = None) -> Optional[TunedLens]:
    """The lens a command asked for: None for "logit"; for "tuned", the lens at `path`,
    else the one cached for this model's fingerprint (a clear error if there is none)."""
    if kind == "logit":
        if path is not None:
            raise ValueError("--tuned-lens needs --lens tuned")
        return None
    if kind != "tuned":
        raise ValueError(f"lens must be 'logit' or 'tuned', got {kind!r}")
    fingerprint = params_fingerprint(model.params)
    if path is None:
        path = default_lens_path(fingerprint, cache_dir)
        if not path.is_file():
            raise FileNotFoundError(f"no tuned lens cached for {model.name} (weights fingerprint "
                                    f"{fingerprint[:12]}...); fit one with `degs train-lens --model ...` "
                                    "or pass --tuned-lens FILE")
    return load_tuned_lens(path, model.cfg, fingerprint)
