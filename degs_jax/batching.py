"""The batch size from the device's memory (`--batch-size auto` of `degs eval` and
`degs sample`), and the peak memory a run used.

What one prompt row costs (an estimate, computed before anything is compiled):

- the method's `sequences_per_prompt` sequences (`degs_jax.method.Method`: its pool of
  candidates, chains or particles; an MCMC chain counts two, the chain x and its running
  proposal x'; a scalable_power prompt its candidates and rollouts), each holding
  * the model's cache for `max_len` = padded prompt + `max_new_tokens` slots; its bytes
    come from `jax.eval_shape(model.init_cache(1, max_len, dtype))`, so any `CausalLM`
    is sized by its own cache pytree, without allocating it;
  * GenState's per-slot records: token and depth (int32), log p, log q and final
    entropy (fp32), `STATE_BYTES_PER_SLOT` = 20 bytes a slot, and with stop strings the
    automaton's state (int32), `STOP_STATE_BYTES_PER_SLOT` = 4 more;
- the step's working set over the vocabulary: `WORKING_VOCAB_COPIES` fp32 vectors of V
  per sequence (logits, log-softmax, probabilities, noise, the lens's streamed logits).

`pick_batch_size` then takes `floor(fraction · free / bytes_per_row)` rows, at least 1
and at most `MAX_AUTO_BATCH` and the number of prompts; the record says which of the three
limited it. Where one prompt row needs more than all the free memory, `choose_batch_size`
refuses (`BatchDoesNotFitError`, before anything is compiled) instead of starting a run that
must run out of memory; where it fits only in the part the fraction leaves over, it takes
one row and the record carries a warning. The fraction (default
`DEFAULT_MEMORY_FRACTION`) leaves the rest of the free memory for what the estimate
leaves out: the prefill's activations (prompt length × hidden size per row) and XLA's
temporaries. Free memory is read after the parameters are loaded: `bytes_limit -
bytes_in_use` of `device.memory_stats()`. Backends that report no statistics (CPU) fall
back to the host's free physical memory, and say so in the record. Rows split over a
mesh of `devices` devices multiply the capacity (each holds 1/devices of the rows or of
the heads).

How much of a GPU JAX may use at all is XLA's allocator pool, a fraction of the card set by
the environment variable `XLA_PYTHON_CLIENT_MEM_FRACTION` when the backend starts; JAX's
own default, 0.75, left a quarter of every card to nothing (a 7B Scalable Power Sampling
batch peaked at 70.8 GB of an H200's 143.7 GB). The `degs` program sets it to
`DEVICE_MEMORY_FRACTION` unless the user did (`claim_device_memory`, before JAX starts a
backend); `device_memory_setting` says which value is in force and where it came from, and
the batch record carries it with the card's size (`bytes_limit` / the fraction).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Optional

import jax
import numpy as np

from .generation import PROMPT_BUCKET

DEFAULT_MEMORY_FRACTION = 0.7
# XLA's GPU allocator pool as a fraction of the card (module docstring): what the `degs`
# program asks for, and JAX's default where nobody sets it. The rest of the card holds
# what the pool does not (the CUDA context, cuBLAS/cuDNN workspaces): 14 GB of an H200.
MEMORY_FRACTION_VARIABLE = "XLA_PYTHON_CLIENT_MEM_FRACTION"
DEVICE_MEMORY_FRACTION = 0.9
JAX_DEFAULT_DEVICE_MEMORY_FRACTION = 0.75
MAX_AUTO_BATCH = 256
STATE_BYTES_PER_SLOT = 20
STOP_STATE_BYTES_PER_SLOT = 4
WORKING_VOCAB_COPIES = 8
AUTO = "auto"


class BatchDoesNotFitError(ValueError):
    """`--batch-size auto`: one prompt row of the method needs more than the free memory."""


def pick_batch_size(bytes_per_row: int, free_bytes: int,
                    fraction: float = DEFAULT_MEMORY_FRACTION, most: int = MAX_AUTO_BATCH) -> int:
    """Rows that fit: floor(fraction · free_bytes / bytes_per_row), clipped to [1, most]."""
    if bytes_per_row <= 0:
        raise ValueError(f"bytes_per_row must be positive, got {bytes_per_row}")
    if not 0 < fraction <= 1:
        raise ValueError(f"the memory fraction must be in (0, 1], got {fraction}")
    if most < 1:
        raise ValueError(f"the largest batch must be >= 1, got {most}")
    fits = int(max(free_bytes, 0) * fraction) // int(bytes_per_row)
    return max(1, min(most, fits))


@dataclasses.dataclass(frozen=True)
class RowCost:
    """Estimated bytes of one prompt row (module docstring)."""

    max_len: int  # cache slots per sequence
    sequences: int  # the method's sequences_per_prompt
    cache_bytes: int  # per sequence
    state_bytes: int  # per sequence
    working_bytes: int  # per sequence

    @property
    def per_sequence(self) -> int:
        return self.cache_bytes + self.state_bytes + self.working_bytes

    @property
    def total(self) -> int:
        return self.sequences * self.per_sequence


def row_cost(model: Any, config: Any, longest_prompt: int, cache_dtype: Any) -> RowCost:
    """The bytes one prompt row of `decode(model, ..., config)` needs (module docstring).

    model: a `CausalLM`; config: the method (`degs_jax.method.Method`); longest_prompt: tokens of
    the longest prompt of the batch (padded as `pad_prompts` pads it).
    """
    padded = -(-int(longest_prompt) // PROMPT_BUCKET) * PROMPT_BUCKET
    max_len = padded + config.max_new_tokens
    shapes = jax.eval_shape(lambda: model.init_cache(1, max_len, cache_dtype))
    cache_bytes = sum(int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize
                      for leaf in jax.tree.leaves(shapes))
    return RowCost(max_len=max_len, sequences=config.sequences_per_prompt, cache_bytes=cache_bytes,
                   state_bytes=(STATE_BYTES_PER_SLOT + STOP_STATE_BYTES_PER_SLOT * bool(config.stop)) * max_len,
                   working_bytes=WORKING_VOCAB_COPIES * model.vocab_size * 4)


def claim_device_memory() -> None:
    """Let XLA's GPU allocator take DEVICE_MEMORY_FRACTION of each card, unless the user set
    XLA_PYTHON_CLIENT_MEM_FRACTION. Takes effect only before JAX starts its GPU backend
    (the `degs` program calls it first thing); a CPU backend ignores the variable."""
    os.environ.setdefault(MEMORY_FRACTION_VARIABLE, str(DEVICE_MEMORY_FRACTION))


def device_memory_setting() -> dict[str, Any]:
    """{"variable", "fraction": the pool's fraction of the card in force, "source"}: the
    environment's value (set by the user or by `claim_device_memory`) or JAX's default.
    ValueError for a value that is not a number in (0, 1]."""
    text = os.environ.get(MEMORY_FRACTION_VARIABLE)
    if text is None:
        return {"variable": MEMORY_FRACTION_VARIABLE, "fraction": JAX_DEFAULT_DEVICE_MEMORY_FRACTION,
                "source": "JAX's default (the variable is not set)"}
    try:
        fraction = float(text)
    except ValueError:
        fraction = float("nan")
    if not 0 < fraction <= 1:
        raise ValueError(f"{MEMORY_FRACTION_VARIABLE}={text!r}: XLA's allocator takes a fraction of the "
                         "card in (0, 1]")
    return {"variable": MEMORY_FRACTION_VARIABLE, "fraction": fraction, "source": "the environment"}


def card_memory(device: Optional[Any] = None) -> Optional[dict[str, Any]]:
    """For a GPU (default: the first local device): `device_memory_setting()` with XLA's
    pool (`bytes_limit`) and the card's size it implies (`card_bytes` = bytes_limit /
    fraction); None for a device without an allocator pool (CPU)."""
    device = device or jax.local_devices()[0]
    stats = device.memory_stats() or {}
    if device.platform != "gpu" or "bytes_limit" not in stats:
        return None
    setting = device_memory_setting()
    return {**setting, "bytes_limit": int(stats["bytes_limit"]),
            "card_bytes": round(int(stats["bytes_limit"]) / setting["fraction"])}


def free_memory(device: Optional[Any] = None) -> tuple[int, str]:
    """(free bytes, where they were read) for `device` (default: the first local one)."""
    device = device or jax.local_devices()[0]
    stats = device.memory_stats()
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0)), \
            f"{device.platform} device memory_stats: bytes_limit - bytes_in_use"
    free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return int(free), (f"host free physical memory ({device.platform} backend reports no "
                       "device memory statistics)")


def peak_memory(device: Optional[Any] = None) -> dict[str, Any]:
    """{"peak_bytes": the device's peak bytes in use so far or None, "note": ...}."""
    device = device or jax.local_devices()[0]
    stats = device.memory_stats()
    if stats and "peak_bytes_in_use" in stats:
        return {"peak_bytes": int(stats["peak_bytes_in_use"]),
                "note": f"{device.platform} memory_stats peak_bytes_in_use since process start"}
    return {"peak_bytes": None,
            "note": f"the {device.platform} backend reports no device memory statistics"}


def choose_batch_size(requested: int | str, model: Any, config: Any, longest_prompt: int,
                      n_prompts: int, cache_dtype: Any, devices: Optional[int] = None,
                      fraction: float = DEFAULT_MEMORY_FRACTION) -> dict[str, Any]:
    """The batch size and the record of how it was chosen.

    requested: a positive integer (kept as given) or "auto" (sized from free memory).
    devices: devices the rows and heads spread over (default: the size of the mesh set
    with `jax.set_mesh`, else 1).
    Returns {"batch_size": int, "requested": ..., and for auto the estimate's terms}.
    """
    if requested != AUTO:
        if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
            raise ValueError(f"batch size must be a positive integer or 'auto', got {requested!r}")
        return {"batch_size": requested, "requested": requested}
    if devices is None:
        mesh = jax.sharding.get_abstract_mesh()
        devices = 1 if mesh.empty else mesh.size
    cost = row_cost(model, config, longest_prompt, cache_dtype)
    free, source = free_memory()
    capacity = max(free, 0) * devices
    if cost.total > capacity:
        raise BatchDoesNotFitError(
            f"--batch-size auto: one prompt of {config.method} needs {_gib(cost.total)} "
            f"({cost.sequences} sequence(s) of {_gib(cost.per_sequence)}: a {cost.max_len}-slot "
            f"cache, its records and the step's working set), more than the {_gib(capacity)} free "
            f"on {devices} device(s) ({source}); lower max_new_tokens or the method's sequences "
            "per prompt, or spread the rows over more devices")
    most = max(1, min(MAX_AUTO_BATCH, n_prompts))
    chosen = pick_batch_size(cost.total, capacity, fraction, most)
    fits = int(capacity * fraction) // cost.total
    limited_by = ("memory" if fits < most else
                  "the number of prompts" if most == n_prompts else f"MAX_AUTO_BATCH ({MAX_AUTO_BATCH})")
    record = {"batch_size": chosen, "requested": AUTO, "limited_by": limited_by,
              "bytes_per_row": cost.total, "row_cost": dataclasses.asdict(cost), "free_bytes": free,
              "devices": devices, "memory_source": source, "fraction": fraction, "largest": most,
              "rule": "min(largest, max(1, floor(fraction * free_bytes * devices / bytes_per_row)))"}
    card = card_memory()
    if card is not None:
        record["device_memory"] = card
    if fits == 0:
        record["warning"] = (f"one prompt needs {_gib(cost.total)} of the {_gib(capacity)} free, more "
                             f"than the {fraction:.0%} the estimate leaves room for: batch 1 may "
                             "run out of memory")
    return record


def describe_batch_choice(choice: dict[str, Any]) -> str:
    """One line for a user: the batch size and, for an automatic choice, why."""
    if choice["requested"] != AUTO:
        return f"batch size {choice['batch_size']}"
    line = (f"batch size {choice['batch_size']} (auto, limited by {choice['limited_by']}: "
            f"{choice['bytes_per_row'] / 2**20:.1f} MiB per prompt, {_gib(choice['free_bytes'])} free"
            + (f" on each of {choice['devices']} devices" if choice["devices"] > 1 else "")
            + f", {choice['memory_source']}"
            + (f"; XLA may use {choice['device_memory']['fraction']:.0%} of the "
               f"{_gib(choice['device_memory']['card_bytes'])} card" if "device_memory" in choice else "")
            + ")")
    return line + (f"; warning: {choice['warning']}" if "warning" in choice else "")


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def parse_batch_size(text: str) -> int | str:
    """The --batch-size argument: 'auto' or a positive integer."""
    if text == AUTO:
        return AUTO
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"--batch-size takes a positive integer or 'auto', got {text!r}")
    return value
