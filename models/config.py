"""Frozen, hashable model configuration for the one transformer that serves
Qwen2 (`Qwen2ForCausalLM`), Qwen3 dense (`Qwen3ForCausalLM`) and Llama/DeepSeek-Math/
DeepSeek-R1-Distill-Llama (`LlamaForCausalLM`, optionally with Llama-3 `rope_scaling`).

The config is a static argument of every jitted function, so it must be
hashable and immutable; everything that varies between the families is a
flag here, never a code copy:

| family | q/k/v bias | q/k RMSNorm per head | head_dim           |
| ------ | ---------- | -------------------- | ------------------ |
| qwen2  | yes        | no                   | hidden / heads     |
| qwen3  | no         | yes (before RoPE)    | from the config    |
| llama  | no         | no                   | hidden / heads (or the config's) |
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

SUPPORTED_ARCHITECTURES = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "LlamaForCausalLM")
_FAMILY = {"Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3", "LlamaForCausalLM": "llama"}
KV_READS = ("auto", "kernel", "loop", "buckets", "all")
LENS_ROWS = ("live", "all")


class ConfigError(ValueError):
    """A checkpoint's configuration cannot be served by this transformer."""


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 (`rope_type: "llama3"`, Llama-3.1 and DeepSeek-R1-Distill-Llama) frequency
    scaling of the rotary embedding. With wavelength w = 2*pi / inv_freq of each rotary
    frequency: w < original_max_position_embeddings / high_freq_factor keeps its frequency,
    w > original_max_position_embeddings / low_freq_factor is divided by `factor`, and the
    band between interpolates smoothly (HF `_compute_llama3_parameters`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self):
        if not self.factor > 0 or not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ConfigError(f"llama3 rope_scaling needs factor > 0 and 0 < low_freq_factor < "
                              f"high_freq_factor, got {self}")
        if not isinstance(self.original_max_position_embeddings, int) or self.original_max_position_embeddings <= 0:
            raise ConfigError("llama3 rope_scaling needs a positive original_max_position_embeddings, "
                              f"got {self.original_max_position_embeddings!r}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """One checkpoint's architecture, plus how its KV cache is read. Sizes are counts;
    `head_dim` is the size of one attention head; `qkv_bias`: q/k/v projections carry a
    bias (Qwen2); `qk_norm`: queries and keys are RMS-normalised per head, with learned
    [head_dim] weights, before RoPE (Qwen3); `rope_scaling`: Llama-3 frequency scaling or
    None (plain RoPE).

    Runtime settings (not part of a checkpoint; `dataclasses.replace` to change them):
    `kv_chunk`: cache slots per attention chunk (the unit of the live-length reads);
    `kv_read`: how a call chooses which cache slots it reads (module docstring of
      `transformer` for the numerics) --
      "loop": a `lax.while_loop` per layer over the chunks below the batch's longest
        live length (work exactly proportional; cheap where a loop iteration is cheap:
        CPU);
      "buckets": one `lax.switch` per call around the layer stack, over windows of
        0, C, 2C, 4C, ... slots and the whole buffer (work at most twice the live
        length; for GPUs, where each iteration of a data-dependent `while_loop` waits
        for the host); compiles the layer stack once per window, so pair it with
        stacked layers (`params.stack_layers`) where compile time matters;
      "kernel": one-token calls (decode steps) read each row's own live slots in a
        Pallas flash-decoding kernel (`decode_kernel`; Triton on GPUs, Pallas'
        interpreter elsewhere, which is slow); calls of several tokens use "loop";
      "all": every slot of the allocated buffer (the cost before live-length reads;
        for comparisons);
      "auto" (default): "loop" on CPU and for calls of several tokens (prefills: a
        switch reserves its largest window's memory); for decode steps, "kernel" on a
        GPU (head size a power of two >= 16; under a device mesh, a batch and KV heads
        that split evenly over its axes: the kernel runs per shard), else "buckets".
    `batch_invariant`: a row's results do not depend on the other rows of its batch (nor
      on their number): every matmul over rows runs on fixed tiles (padded; one program
      per tile shape, so the same kernel and reduction order for any batch) -- in a
      decode step (and an uncached call) tiles of `row_tile` rows, in a prefill tiles of
      half a row's chunk (multi-token calls with a cache run in `kv_chunk`-token chunks,
      so a prefill does not see the batch's longest prompt); attention uses the "loop"
      read (fixed KV chunks combined in a fixed order, on tiles of `row_tile` rows;
      chunks past a row's length are exact identities) and the lens streams a fixed
      vocabulary chunk. Costs speed (2.4x to 2.8x per 7B decode step, head and probe
      included, on an H200 at batch 1 to 128, docs/benchmarks.md); off by default. What
      it guarantees: the README's Reproducibility section.
    `lens_rows`: the rows of a decode step (one token per row, at least
      `lens_head.LENS_LIVE_ROWS_MIN_BATCH` rows, no device mesh) whose lens is computed --
      "live" (default): the rows whose position is inside the cache (an idle row's lens
      statistics are NaN); the live rows are gathered and the lens runs on the smallest of
      8 static row counts that holds them, in one `lax.switch`. Under `jax.vmap` with a
      live count that differs between the mapped instances a switch runs every branch
      (4.5x the lens of all rows): use "all" there. "all": every row's lens.
    `row_tile`: rows per tile under `batch_invariant`; None (default): 64 on GPUs and
      TPUs (a decode step reads the weights once per tile, and 64 rows cost about what
      one does: 2.4-2.8x the plain step on an H200 at batch 1-128, against 2.1-15.8x
      with 8), 8 on CPU (where padded rows cost compute; for the same reason a prefill
      chunk's attention reads the cache one row per tile there, each row bringing
      kv_chunk queries).
      An explicit value applies to every tiled call but a prefill's per-token work.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    qkv_bias: bool
    tie_word_embeddings: bool
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    qk_norm: bool = False
    rope_scaling: RopeScaling | None = None
    kv_chunk: int = 256
    kv_read: str = "auto"
    batch_invariant: bool = False
    row_tile: int | None = None
    lens_rows: str = "live"

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"unknown architecture {self.architecture!r}; supported: "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"inconsistent head sizes: num_heads={self.num_heads} is not a multiple "
                f"of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.rope_theta <= 0 or self.rms_norm_eps <= 0:
            raise ConfigError("rope_theta and rms_norm_eps must be positive")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ConfigError(f"rope_scaling must be a RopeScaling or None, got {self.rope_scaling!r}")
        if not isinstance(self.kv_chunk, int) or self.kv_chunk <= 0:
            raise ConfigError(f"kv_chunk must be a positive integer, got {self.kv_chunk!r}")
        if self.row_tile is not None and (not isinstance(self.row_tile, int) or self.row_tile <= 0):
            raise ConfigError(f"row_tile must be a positive integer or None, got {self.row_tile!r}")
        if self.kv_read not in KV_READS:
            raise ConfigError(f"kv_read must be one of {', '.join(KV_READS)}, got {self.kv_read!r}")
        if self.lens_rows not in LENS_ROWS:
            raise ConfigError(f"lens_rows must be one of {', '.join(LENS_ROWS)}, got {self.lens_rows!r}")

    @property
    def family(self) -> str:
        return _FAMILY[self.architecture]

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> "ModelConfig":
        """Build from a Hugging Face `config.json` dict (or `PretrainedConfig.to_dict()`)."""
        archs = hf.get("architectures") or []
        if not archs:
            model_type = hf.get("model_type")
            archs = [{family: arch for arch, family in _FAMILY.items()}.get(model_type, model_type)]
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"unknown architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        family = _FAMILY[arch]
        rope_theta, rope_scaling = _rope_from_hf(hf)
        if family in ("qwen2", "qwen3") and hf.get("use_sliding_window"):
            raise ConfigError(f"{arch} sliding-window attention is not supported")
        if any(t != "full_attention" for t in hf.get("layer_types") or ()):
            raise ConfigError(f"per-layer attention types {sorted(set(hf['layer_types']))} are not "
                              "supported (only full attention)")
        hidden = int(hf["hidden_size"])
        heads = int(hf["num_attention_heads"])
        if hf.get("head_dim") is None and hidden % heads:
            raise ConfigError(
                f"inconsistent head sizes: hidden_size={hidden} is not divisible by "
                f"num_attention_heads={heads}"
            )
        head_dim = int(hf.get("head_dim") or hidden // heads)
        if family != "qwen2" and hf.get("attention_bias"):
            raise ConfigError(f"{arch} attention_bias=True is not supported")
        if hf.get("mlp_bias"):
            raise ConfigError("mlp_bias=True is not supported")
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
        return cls(
            architecture=arch,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            rope_theta=rope_theta,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 32768)),
            qkv_bias=family == "qwen2",
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=tuple(int(e) for e in eos_ids),
            pad_token_id=hf.get("pad_token_id"),
            qk_norm=family == "qwen3",
            rope_scaling=rope_scaling,
        )

    def to_hf(self) -> dict[str, Any]:
        """The equivalent Hugging Face config dict (used to build parity references)."""
        return {
            "architectures": [self.architecture],
            "model_type": self.family,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta}
            if self.rope_scaling is None else
            {"rope_type": "llama3", "rope_theta": self.rope_theta, **dataclasses.asdict(self.rope_scaling)},
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "attention_bias": self.qkv_bias,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) or None,
            "pad_token_id": self.pad_token_id,
        }


def _rope_from_hf(hf: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from either config format: transformers >= 5 `rope_parameters`
    or the older top-level `rope_theta` + `rope_scaling` (what hub config.json files hold)."""
    kind = lambda d: d.get("rope_type", d.get("type")) or "default"
    params = dict(hf.get("rope_parameters") or {})
    if kind(params) == "default":  # the older key, or both with the scaling only in rope_scaling
        params.update(hf.get("rope_scaling") or {})
    rope_type = kind(params)
    theta = float(hf.get("rope_theta") or params.get("rope_theta") or 10000.0)
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise ConfigError(f"rope_scaling {params!r} is not supported (only 'llama3' and plain RoPE)")
    missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor") if k not in params]
    if missing:
        raise ConfigError(f"llama3 rope_scaling lacks {', '.join(missing)}: {params!r}")
    original = params.get("original_max_position_embeddings") or hf.get("max_position_embeddings", 32768)
    return theta, RopeScaling(factor=float(params["factor"]), low_freq_factor=float(params["low_freq_factor"]),
                              high_freq_factor=float(params["high_freq_factor"]),
                              original_max_position_embeddings=int(original))
