"""Which transformers classes run the decoder layers of each supported architecture."""

from __future__ import annotations

import dataclasses

from ..errors import ModelUnavailable


@dataclasses.dataclass(frozen=True)
class Architecture:
    decoder_layer: type
    rotary: type
    norm: type


def architecture_of(config) -> Architecture:
    names = tuple(getattr(config, "architectures", None) or ())
    if "LlamaForCausalLM" in names or config.model_type == "llama":
        from transformers.models.llama import modeling_llama as m

        return Architecture(m.LlamaDecoderLayer, m.LlamaRotaryEmbedding, m.LlamaRMSNorm)
    if "Qwen2ForCausalLM" in names or config.model_type == "qwen2":
        from transformers.models.qwen2 import modeling_qwen2 as m

        return Architecture(m.Qwen2DecoderLayer, m.Qwen2RotaryEmbedding, m.Qwen2RMSNorm)
    raise ModelUnavailable(f"unsupported architecture {names or config.model_type}: Llama and Qwen2 are")


def load_config(model_dir):
    """Config with the attention implementation set: standalone layers built from a
    config otherwise get none, and run a silently non-causal prefill."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(model_dir))
    config._attn_implementation = "sdpa"
    return config
