"""Which transformers classes run the decoder layers of each supported architecture."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from ..errors import ModelUnavailable


@dataclasses.dataclass(frozen=True)
class Architecture:
    decoder_layer: type
    rotary: type
    norm: type


def _family(names: tuple[str, ...], model_type: str | None) -> str:
    """The model family: "llama" or "qwen2" (their decoder layers differ, their RMSNorms do not)."""
    if "LlamaForCausalLM" in names or model_type == "llama":
        return "llama"
    if "Qwen2ForCausalLM" in names or model_type == "qwen2":
        return "qwen2"
    raise ModelUnavailable(f"unsupported architecture {names or model_type}: Llama and Qwen2 are")


def final_norm_eps(model_dir) -> float:
    """The final RMSNorm's epsilon, read from config.json without transformers: the
    consumer's head needs nothing else from the config, and importing transformers'
    config and modeling code costs a `run` seconds before its first token."""
    raw = json.loads((Path(model_dir) / "config.json").read_text())
    _family(tuple(raw.get("architectures") or ()), raw.get("model_type"))
    return float(raw.get("rms_norm_eps", 1e-6))  # transformers' default for both families


def architecture_of(config) -> Architecture:
    family = _family(tuple(getattr(config, "architectures", None) or ()), config.model_type)
    if family == "llama":
        from transformers.models.llama import modeling_llama as m

        return Architecture(m.LlamaDecoderLayer, m.LlamaRotaryEmbedding, m.LlamaRMSNorm)
    from transformers.models.qwen2 import modeling_qwen2 as m

    return Architecture(m.Qwen2DecoderLayer, m.Qwen2RotaryEmbedding, m.Qwen2RMSNorm)


def load_config(model_dir):
    """Config with the attention implementation set: standalone layers built from a
    config otherwise get none, and run a silently non-causal prefill."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(model_dir))
    config._attn_implementation = "sdpa"
    return config
