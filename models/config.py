"""Frozen, hashable model configuration for the one transformer that serves
Qwen2 (`Qwen2ForCausalLM`) and Llama/DeepSeek-Math (`LlamaForCausalLM`).

The config is a static argument of every jitted function, so it must be
hashable and immutable; everything that varies between the two families is a
flag here, never a code copy.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

SUPPORTED_ARCHITECTURES = ("Qwen2ForCausalLM", "LlamaForCausalLM")


class ConfigError(ValueError):
    """A checkpoint's configuration cannot be served by this transformer."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
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

    @property
    def family(self) -> str:
        return "qwen2" if self.architecture == "Qwen2ForCausalLM" else "llama"

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> "ModelConfig":
        """Build from a Hugging Face `config.json` dict (or `PretrainedConfig.to_dict()`)."""
        archs = hf.get("architectures") or []
        if not archs:
            model_type = hf.get("model_type")
            archs = {"qwen2": ["Qwen2ForCausalLM"], "llama": ["LlamaForCausalLM"]}.get(model_type, [model_type])
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"unknown architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        rope_scaling = hf.get("rope_scaling")
        if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) not in (None, "default"):
            raise ConfigError(f"rope_scaling {rope_scaling!r} is not supported")
        if arch == "Qwen2ForCausalLM" and hf.get("use_sliding_window"):
            raise ConfigError("Qwen2 sliding-window attention is not supported")
        hidden = int(hf["hidden_size"])
        heads = int(hf["num_attention_heads"])
        if hf.get("head_dim") is None and hidden % heads:
            raise ConfigError(
                f"inconsistent head sizes: hidden_size={hidden} is not divisible by "
                f"num_attention_heads={heads}"
            )
        head_dim = int(hf.get("head_dim") or hidden // heads)
        is_qwen = arch == "Qwen2ForCausalLM"
        if not is_qwen and hf.get("attention_bias"):
            raise ConfigError("Llama attention_bias=True is not supported")
        if hf.get("mlp_bias"):
            raise ConfigError("mlp_bias=True is not supported")
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
        rope_params = hf.get("rope_parameters") or {}
        rope_theta = hf.get("rope_theta", rope_params.get("rope_theta", 10000.0))
        if rope_params.get("rope_type") not in (None, "default"):
            raise ConfigError(f"rope_parameters {rope_params!r} are not supported")
        return cls(
            architecture=arch,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            rope_theta=float(rope_theta),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 32768)),
            qkv_bias=is_qwen,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=tuple(int(e) for e in eos_ids),
            pad_token_id=hf.get("pad_token_id"),
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
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) or None,
            "pad_token_id": self.pad_token_id,
        }
