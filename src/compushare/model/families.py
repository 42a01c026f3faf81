"""The model families CompuShare serves: one table, FAMILIES, found from a config.

Each entry says everything that differs between families, for every part that
runs one: which transformers classes hold a decoder layer (model/arch.py), the
steps the lean forward adds (model/lean.py), what the consumer's head does around
the embedding and the final norm (model/head.py), and which projections the
checkpoint stores fused (model/formats.py, model/quantize.py, model/blocks.py,
private mode). Adding a family is one entry here (docs/architecture.md).

Pure: no torch, no transformers (the head and `models import` read a config.json
with nothing else loaded); transformers' classes are named here, imported in arch.py.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from ..errors import ModelUnavailable

FULL, SLIDING = "full_attention", "sliding_attention"  # transformers' layer type names
# Projections a checkpoint may store fused (Phi-3): the one matrix and the rows it stacks, in order.
FUSED_PROJECTIONS = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                     "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}
SEPARATE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
FUSED = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
ATTENTION_ONLY = SEPARATE[:4]  # mixtures of experts: the experts' matrices are 3-D, not projections


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    title: str  # what users read: "Llama 2/3.x"
    architectures: tuple[str, ...]  # config.json's "architectures" entries
    model_types: tuple[str, ...]  # config.json's "model_type"
    module: str  # transformers' modeling module
    prefix: str  # its classes: {prefix}DecoderLayer, {prefix}RotaryEmbedding, {prefix}RMSNorm
    # transformers' attention implementation: sdpa, or eager where sdpa lacks a step
    # (Gemma 2's attention soft-capping).
    attention: str = "sdpa"
    # RMSNorm of each head's query and key: None, "before_transpose" (on [.., n, heads,
    # D], Qwen3) or "after_transpose" (on [.., heads, n, D], Gemma 3): the order
    # transformers runs, kept so that an fp32 span is bit-identical to it.
    qk_norm: str | None = None
    # Gemma: a norm on the attention's output before its residual add, and a pair of
    # norms around the MLP (pre_feedforward_layernorm, post_feedforward_layernorm).
    sandwich_norms: bool = False
    norm_plus_one: bool = False  # RMSNorm scales by (1 + w), not w (Gemma)
    embed_scale: bool = False  # embeddings multiplied by sqrt(hidden), in the embedding's dtype (Gemma)
    attention_softcap: bool = False  # tanh soft-capping of attention scores (Gemma 2)
    rotary_per_layer_type: bool = False  # one rotary table per layer type, own rope base each (Gemma 3)
    final_softcap_default: float | None = None  # final_logit_softcapping when config.json omits it
    rms_norm_eps_default: float = 1e-6  # rms_norm_eps when config.json omits it (transformers' class default)
    projections: tuple[str, ...] = SEPARATE  # the decoder's weight matrices as the checkpoint names them
    # general.architecture of its GGUF files (model/gguf_config.py); llama.cpp's converter
    # writes a Mistral as "llama" (without its sliding window).
    gguf_architectures: tuple[str, ...] = ()
    # A mixture of experts: how its checkpoints on the Hub store the experts (model/experts.py
    # stacks them into transformers' 3-D parameters): "qwen" (mlp.experts.E.gate_proj/up_proj/
    # down_proj), "mixtral" (block_sparse_moe.experts.E.w1/w3/w2), "stacked" (already 3-D: gpt-oss).
    experts: str | None = None
    attention_sinks: bool = False  # a learned per-head logit each softmax also normalises over (gpt-oss)

    @property
    def moe(self) -> bool:
        return self.experts is not None

    @property
    def fused(self) -> dict[str, tuple[str, ...]]:
        """The checkpoint's fused matrices: {stored name: the separate projections it stacks}."""
        return {name: FUSED_PROJECTIONS[name] for name in self.projections if name in FUSED_PROJECTIONS}


FAMILIES: dict[str, Family] = {family.name: family for family in (
    Family("llama", "Llama 2/3.x", ("LlamaForCausalLM",), ("llama",),
           "transformers.models.llama.modeling_llama", "Llama", gguf_architectures=("llama",)),
    Family("qwen2", "Qwen2/2.5", ("Qwen2ForCausalLM",), ("qwen2",),
           "transformers.models.qwen2.modeling_qwen2", "Qwen2", gguf_architectures=("qwen2",)),
    Family("qwen3", "Qwen3", ("Qwen3ForCausalLM",), ("qwen3",),
           "transformers.models.qwen3.modeling_qwen3", "Qwen3", qk_norm="before_transpose", gguf_architectures=("qwen3",)),
    Family("mistral", "Mistral", ("MistralForCausalLM",), ("mistral",),
           "transformers.models.mistral.modeling_mistral", "Mistral"),
    Family("gemma2", "Gemma 2", ("Gemma2ForCausalLM",), ("gemma2",),
           "transformers.models.gemma2.modeling_gemma2", "Gemma2", attention="eager", sandwich_norms=True,
           norm_plus_one=True, embed_scale=True, attention_softcap=True, final_softcap_default=30.0, gguf_architectures=("gemma2",)),
    Family("gemma3", "Gemma 3 (text)", ("Gemma3ForCausalLM",), ("gemma3_text",),
           "transformers.models.gemma3.modeling_gemma3", "Gemma3", qk_norm="after_transpose",
           sandwich_norms=True, norm_plus_one=True, embed_scale=True, rotary_per_layer_type=True, gguf_architectures=("gemma3",)),
    Family("phi3", "Phi-3", ("Phi3ForCausalLM",), ("phi3",),
           "transformers.models.phi3.modeling_phi3", "Phi3", rms_norm_eps_default=1e-5, projections=FUSED, gguf_architectures=("phi3",)),
    Family("qwen3_moe", "Qwen3-MoE", ("Qwen3MoeForCausalLM",), ("qwen3_moe",),
           "transformers.models.qwen3_moe.modeling_qwen3_moe", "Qwen3Moe", qk_norm="before_transpose",
           projections=ATTENTION_ONLY, gguf_architectures=("qwen3moe",), experts="qwen"),
    Family("mixtral", "Mixtral", ("MixtralForCausalLM",), ("mixtral",),
           "transformers.models.mixtral.modeling_mixtral", "Mixtral", rms_norm_eps_default=1e-5,
           projections=ATTENTION_ONLY, experts="mixtral"),
    Family("gpt_oss", "gpt-oss", ("GptOssForCausalLM",), ("gpt_oss",),
           "transformers.models.gpt_oss.modeling_gpt_oss", "GptOss", attention="eager", rms_norm_eps_default=1e-5,
           projections=ATTENTION_ONLY, gguf_architectures=("gpt-oss",), experts="stacked", attention_sinks=True),
)}


def all_projections() -> tuple[str, ...]:
    """Every family's decoder weight matrices, sorted (what the quantizer knows)."""
    return tuple(sorted({name for family in FAMILIES.values() for name in family.projections}))


def supported() -> str:
    """The families, as users read them: "Llama 2/3.x, Qwen2/2.5, ..."."""
    return ", ".join(family.title for family in FAMILIES.values())


def family_of(architectures, model_type: str | None) -> Family:
    """The family of a config (its "architectures" first, then its "model_type"), or
    ModelUnavailable naming the supported ones."""
    names = tuple(architectures or ())
    for family in FAMILIES.values():
        if set(names) & set(family.architectures):
            return family
    for family in FAMILIES.values():
        if model_type in family.model_types:
            return family
    described = ", ".join(names) if names else f"model_type {model_type!r}"
    raise ModelUnavailable(f"unsupported architecture {described}: CompuShare serves {supported()}")


def family_of_gguf(architecture: str) -> Family:
    """The family of a GGUF file's general.architecture, or ModelUnavailable naming the supported ones."""
    for family in FAMILIES.values():
        if architecture in family.gguf_architectures:
            return family
    raise ModelUnavailable(f"unsupported GGUF architecture {architecture}: CompuShare serves {supported()}")


def family_of_config(config) -> Family:
    """family_of for a transformers config object or a config.json dict."""
    if isinstance(config, dict):
        return family_of(config.get("architectures"), config.get("model_type"))
    return family_of(getattr(config, "architectures", None), getattr(config, "model_type", None))


def read_config(model_dir) -> dict:
    return json.loads((Path(model_dir) / "config.json").read_text())


def layer_types(config) -> list[str]:
    """Each layer's attention, FULL or SLIDING: the config's own "layer_types" (Qwen2,
    Qwen3, Gemma), else every layer sliding if it names a window (Mistral, Phi-3), as
    transformers' caches read it."""
    def get(key: str) -> Any:
        return config.get(key) if isinstance(config, dict) else getattr(config, key, None)

    types = get("layer_types")
    if types:
        return list(types)
    return [SLIDING if get("sliding_window") is not None else FULL] * get("num_hidden_layers")


@dataclasses.dataclass(frozen=True)
class HeadSpec:
    """What the consumer's head does besides the embedding lookup, final norm and LM
    head product, read off config.json (model/head.py)."""
    rms_norm_eps: float
    embed_scale: float | None = None  # sqrt(hidden): Gemma
    norm_plus_one: bool = False
    final_softcap: float | None = None


def head_spec(config: dict) -> HeadSpec:
    family = family_of_config(config)
    softcap = config.get("final_logit_softcapping", family.final_softcap_default)
    return HeadSpec(rms_norm_eps=float(config.get("rms_norm_eps", family.rms_norm_eps_default)),
                    embed_scale=config["hidden_size"] ** 0.5 if family.embed_scale else None,  # as transformers computes it
                    norm_plus_one=family.norm_plus_one,
                    final_softcap=float(softcap) if softcap is not None else None)
