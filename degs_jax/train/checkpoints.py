"""Training checkpoints a killed run resumes from bit-identically, readable by `load()`.

`<run>/checkpoints/step-<N>/` holds
- `model.safetensors` + `config.json` (+ tokenizer files): the fp32 master weights in the
  Hugging Face layout, so the directory is a model like any other for
  `degs_jax.models.load` (which casts to the requested dtype) and `degs eval --model DIR`;
- `optimizer.msgpack`: every leaf of the optax state (Adam moments, step counts) in
  flattening order, msgpack-encoded by `flax.serialization` (no orbax), restored onto
  the structure of a freshly initialised state;
- `trainer_state.json`: the step it was written after, and what the trainer records.

A checkpoint is written into a temporary directory and renamed into place, and
`<run>/checkpoints/latest` names the newest complete one (written atomically after the
rename), so a run killed while saving leaves the previous checkpoint intact. fp32
masters and moments are stored exactly; together with keys derived from (seed, step)
this makes resuming reproduce the uninterrupted run bit for bit on the same device.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Optional

import jax
import numpy as np
from flax import serialization
from safetensors import safe_open
from safetensors.numpy import save_file

from ..models import ModelConfig, Params
from ..models.checkpoint import params_from_hf, params_to_hf

CHECKPOINTS = "checkpoints"
LATEST = "latest"
MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.msgpack"
STATE_FILE = "trainer_state.json"


def checkpoint_dir(run_dir: str | os.PathLike, step: int) -> Path:
    return Path(run_dir) / CHECKPOINTS / f"step-{step:08d}"


def save_checkpoint(run_dir: str | os.PathLike, step: int, master: Params, opt_state,
                    cfg: ModelConfig, tokenizer=None, state: Optional[dict] = None,
                    keep: int = 2) -> Path:
    """Write the checkpoint of `step` (masters fp32, optimizer state, trainer state) and
    keep the newest `keep` checkpoints. Returns its directory."""
    final = checkpoint_dir(run_dir, step)
    root = final.parent
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{final.name}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    tensors = {k: np.ascontiguousarray(v) for k, v in params_to_hf(master, cfg).items()}
    save_file(tensors, str(tmp / MODEL_FILE), metadata={"format": "pt", "degs_jax_step": str(step)})
    (tmp / "config.json").write_text(json.dumps(cfg.to_hf(), indent=1))
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    (tmp / OPTIMIZER_FILE).write_bytes(optimizer_state_bytes(opt_state))
    (tmp / STATE_FILE).write_text(json.dumps({"step": step, **(state or {})}, indent=1))
    if final.exists():  # a checkpoint of this step from an interrupted earlier attempt
        shutil.rmtree(final)
    os.replace(tmp, final)
    _write_atomic(root / LATEST, final.name)
    for old in sorted(p for p in root.glob("step-*") if p.is_dir())[:-keep] if keep > 0 else []:
        if old != final:
            shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(run_dir: str | os.PathLike) -> Optional[Path]:
    """The newest complete checkpoint of a run, or None."""
    root = Path(run_dir) / CHECKPOINTS
    pointer = root / LATEST
    if pointer.is_file():
        path = root / pointer.read_text().strip()
        if (path / STATE_FILE).is_file():
            return path
    done = sorted(p for p in root.glob("step-*") if (p / STATE_FILE).is_file())
    return done[-1] if done else None


def restore_checkpoint(path: str | os.PathLike, cfg: ModelConfig, opt_template,
                       shardings: Optional[Params] = None):
    """(step, fp32 masters, optimizer state, trainer state dict) of a checkpoint directory.

    opt_template: an optimizer state of the right structure (e.g. `optimizer.init(masters)`),
    whose leaves' placements the restored leaves take. shardings: a Params of shardings
    for the masters (None: default device).
    """
    path = Path(path)
    with safe_open(path / MODEL_FILE, framework="numpy") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    master = params_from_hf(tensors, cfg, dtype=np.float32, shardings=shardings)
    opt_state = restore_optimizer_state((path / OPTIMIZER_FILE).read_bytes(), opt_template)
    state = json.loads((path / STATE_FILE).read_text())
    return int(state["step"]), master, opt_state, state


def optimizer_state_bytes(opt_state) -> bytes:
    """msgpack of the optimizer state's leaves, in flattening order."""
    leaves = jax.tree.leaves(opt_state)
    return serialization.msgpack_serialize({"leaves": {str(i): np.asarray(x) for i, x in enumerate(leaves)}})


def restore_optimizer_state(data: bytes, template: Any):
    """Inverse of :func:`optimizer_state_bytes` onto `template`'s structure and placements;
    a leaf whose shape or dtype differs is an error naming it."""
    stored = serialization.msgpack_restore(data)["leaves"]
    leaves, treedef = jax.tree.flatten(template)
    if len(stored) != len(leaves):
        raise ValueError(f"optimizer state has {len(stored)} arrays, the optimizer expects {len(leaves)}: "
                         "the checkpoint belongs to a different optimizer or model")
    out = []
    for i, like in enumerate(leaves):
        arr = np.asarray(stored[str(i)])
        if arr.shape != like.shape or arr.dtype != like.dtype:
            raise ValueError(f"optimizer state array {i} is {arr.dtype}{list(arr.shape)}, expected "
                             f"{like.dtype}{list(like.shape)}")
        out.append(jax.device_put(arr, like.sharding) if isinstance(like, jax.Array) else arr)
    return jax.tree.unflatten(treedef, out)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
