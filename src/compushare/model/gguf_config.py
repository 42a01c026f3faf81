"""A GGUF file's model config as llama.cpp runs it: what transformers' GGUF reader
leaves out or reads otherwise, taken from the file's metadata.

transformers maps a few keys per architecture (sizes, one rope base, the norms' eps)
and drops the rest; llama.cpp's converter writes these, and llama.cpp reads them so:

  {arch}.attention.key_length      the head size (Qwen3's is not hidden / heads)
  {arch}.attention.sliding_window  Gemma 2 / 3 and Phi-3's window (0: none); which layers
                                   slide: {arch}.attention.sliding_window_pattern (one
                                   flag per layer, or every n-th layer global), else
                                   Gemma 2's every 2nd and Gemma 3's every 6th layer global
  {arch}.rope.freq_base_swa        the sliding layers' rope base (Gemma 3)
  {arch}.rope.scaling.*            linear rope scaling (Gemma 3's global layers), YaRN
                                   (gpt-oss: factor, original context, betas)
  rope_freqs.weight (a tensor)     Llama 3.x's rope scaling, as per-frequency divisors
  {arch}.attn_logit_softcapping, {arch}.final_logit_softcapping   Gemma's soft-capping
  Gemma's query scaling            1 / sqrt(head size), or 1 / sqrt(hidden / heads) for
                                   the 27B models (46 or 62 layers), as llama.cpp has it

Mixtures of experts (transformers reads their sizes wrongly or not at all):

  {arch}.expert_count, {arch}.expert_used_count   experts, and how many a token uses
  {arch}.expert_feed_forward_length               each expert's hidden size (Qwen3-MoE,
                                                  gpt-oss; Mixtral's is feed_forward_length)
  a "llama" file with expert_count > 0            a Mixtral (llama.cpp's converter writes
                                                  one so); llama.cpp normalises its top-k
                                                  weights, as Qwen3-MoE's (norm_topk_prob)
  gpt-oss's sliding window                        every 2nd layer slides unless the file
                                                  says otherwise, as llama.cpp reads it

Not in any file llama.cpp's converter writes: Mistral's sliding window (a Mistral is
written as a "llama" file, and llama.cpp runs it without a window).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from ..errors import UsageError
from .families import FULL, SLIDING

# GGUF architecture -> (the layer pattern llama.cpp assumes, the layer count of its 27B model)
GEMMA_DEFAULTS = {"gemma2": (2, 46), "gemma3": (6, 62)}
# GGUF architecture -> its mixture of experts' model_type, where the file has experts
MOE_MODEL_TYPES = {"qwen3moe": "qwen3_moe", "llama": "mixtral", "gpt-oss": "gpt_oss"}
GPT_OSS_PATTERN = 2  # llama.cpp's default: layers 0, 2, 4, ... slide
# Llama 3.x's low / high frequency factors: the file keeps only the divisors they give.
LLAMA3_LOW, LLAMA3_HIGH = 1.0, 4.0


def read_fields(path: Path) -> tuple[dict, np.ndarray | None, set[str]]:
    """(the file's metadata {key: value} without the vocabulary, the rope_freqs tensor's
    values or None, the tensors' names)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    fields = {key: field.contents() for key, field in reader.fields.items()
              if not key.startswith(("tokenizer.", "GGUF.")) or key in TOKEN_IDS}
    if "tokenizer.ggml.tokens" in reader.fields:  # the vocabulary's size, not its tokens
        fields["tokenizer.ggml.tokens.count"] = len(reader.fields["tokenizer.ggml.tokens"].data)
    rope_freqs = next((np.array(t.data, dtype=np.float32) for t in reader.tensors if t.name == "rope_freqs.weight"),
                      None)
    return fields, rope_freqs, {tensor.name for tensor in reader.tensors}


def architecture(path: Path) -> str:
    """general.architecture, read before anything else (the header only)."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, OSError) as exc:
        raise UsageError(f"{path.name} is not a readable GGUF file ({exc})") from None
    field = reader.fields.get("general.architecture")
    if field is None:
        raise UsageError(f"{path.name} names no general.architecture")
    return str(field.contents())


TOKEN_IDS = ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.padding_token_id")


def moe_base_config(fields: dict) -> dict:
    """A mixture of experts' config.json fields read off the metadata alone, for
    `completed` to finish: transformers' GGUF reader fails on some of these files
    (a gpt-oss file's YaRN keys) and misreads others' sizes."""
    arch = fields["general.architecture"]

    def get(key, default=None):
        return fields.get(f"{arch}.{key}", default)

    heads = int(get("attention.head_count"))
    config = {"hidden_size": int(get("embedding_length")), "num_hidden_layers": int(get("block_count")),
              "num_attention_heads": heads, "num_key_value_heads": int(get("attention.head_count_kv", heads)),
              "max_position_embeddings": int(get("context_length")), "vocab_size": int(fields["tokenizer.ggml.tokens.count"]),
              "intermediate_size": int(get("feed_forward_length", get("expert_feed_forward_length")))}
    for key, name in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                      ("pad_token_id", "padding_token_id")):
        if f"tokenizer.ggml.{name}" in fields:
            config[key] = int(fields[f"tokenizer.ggml.{name}"])
    return config


def expert_count(path: Path) -> int:
    """{arch}.expert_count of a GGUF file (0 for a dense model), from its header."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    arch = reader.fields["general.architecture"].contents()
    field = reader.fields.get(f"{arch}.expert_count")
    return int(field.contents()) if field is not None else 0


def moe_model_type(arch: str, fields: dict) -> str | None:
    """The model_type of a mixture-of-experts file, None for a dense one."""
    if not fields.get(f"{arch}.expert_count"):
        return None
    if arch not in MOE_MODEL_TYPES:
        raise UsageError(f"a {arch} file with experts is not served yet: CompuShare serves Qwen3-MoE, Mixtral "
                         f"and gpt-oss mixtures of experts")
    return MOE_MODEL_TYPES[arch]


def _moe_fields(config: dict, arch: str, get, model_type: str, window: int | None) -> dict:
    experts, used = int(get("expert_count")), int(get("expert_used_count"))
    expert_ff = get("expert_feed_forward_length")
    config = dict(config, model_type=model_type, num_experts_per_tok=used)
    if model_type == "qwen3_moe":
        config |= dict(architectures=["Qwen3MoeForCausalLM"], num_experts=experts, moe_intermediate_size=int(expert_ff),
                       norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
    elif model_type == "mixtral":
        config |= dict(architectures=["MixtralForCausalLM"], num_local_experts=experts,
                       intermediate_size=int(get("feed_forward_length")))
    else:  # gpt-oss
        config |= dict(architectures=["GptOssForCausalLM"], num_local_experts=experts,
                       intermediate_size=int(expert_ff), sliding_window=window,
                       layer_types=gemma_layer_types(get("attention.sliding_window_pattern", GPT_OSS_PATTERN),
                                                     config["num_hidden_layers"], window))
    return config


def shortest(value: float) -> float:
    """A float32 metadata value as its shortest decimal (1e-06, not 9.999999974752427e-07)."""
    return float(str(np.float32(value)))


def completed(config: dict, fields: dict, rope_freqs: np.ndarray | None, tensor_names: set[str]) -> dict:
    """transformers' config dict of a GGUF file, with what the metadata says besides."""
    arch = fields["general.architecture"]

    def get(key, default=None):
        return fields.get(f"{arch}.{key}", default)

    config = dict(config)
    if get("attention.layer_norm_rms_epsilon") is not None:
        config["rms_norm_eps"] = shortest(get("attention.layer_norm_rms_epsilon"))
    if get("attention.key_length") is not None:
        config["head_dim"] = int(get("attention.key_length"))
    config["tie_word_embeddings"] = "output.weight" not in tensor_names
    base = float(get("rope.freq_base", 10000.0))
    rope = {"rope_type": "default", "rope_theta": base}
    scaling = get("rope.scaling.type")
    if scaling == "linear":
        rope = rope | {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
    elif scaling == "yarn":  # gpt-oss: llama.cpp's defaults where the file names no betas
        rope = rope | {"rope_type": "yarn", "factor": shortest(get("rope.scaling.factor")),
                       "original_max_position_embeddings": int(get("rope.scaling.original_context_length")),
                       "beta_fast": shortest(get("rope.scaling.yarn_beta_fast", 32.0)),
                       "beta_slow": shortest(get("rope.scaling.yarn_beta_slow", 1.0)),
                       # llama.cpp rounds YaRN's correction range out to whole dimensions
                       # (transformers' gpt-oss does not: truncate False), and runs every file so.
                       "truncate": True}
    elif scaling not in (None, "none"):
        raise UsageError(f"rope scaling {scaling!r} in a GGUF file is not served yet")
    if rope_freqs is not None:
        head_dim = int(get("rope.dimension_count", config.get("head_dim") or 0))
        rope = llama3_rope(rope_freqs, base, head_dim)
    window = get("attention.sliding_window")
    window = int(window) if window else None
    if arch in GEMMA_DEFAULTS:
        pattern, layers_27b = GEMMA_DEFAULTS[arch]
        layers = config["num_hidden_layers"]
        hidden, heads = config["hidden_size"], config["num_attention_heads"]
        config["query_pre_attn_scalar"] = hidden // heads if layers == layers_27b else config["head_dim"]
        config["final_logit_softcapping"] = _float(get("final_logit_softcapping"))
        if arch == "gemma2":
            config["attn_logit_softcapping"] = _float(get("attn_logit_softcapping"))
        config["sliding_window"] = window
        config["layer_types"] = gemma_layer_types(get("attention.sliding_window_pattern", pattern), layers, window)
        config.pop("sliding_window_pattern", None)
        if arch == "gemma3":
            local = {"rope_type": "default", "rope_theta": float(get("rope.freq_base_swa", 10000.0))}
            rope = {FULL: rope, SLIDING: local}
    elif arch == "phi3":
        config["sliding_window"] = window
    model_type = moe_model_type(arch, fields)
    if model_type is not None:
        config = _moe_fields(config, arch, get, model_type, window)
    config["rope_parameters"] = rope
    config.pop("rope_theta", None)
    return config


def _float(value) -> float | None:
    return shortest(value) if value is not None else None


def gemma_layer_types(pattern, layers: int, window: int | None) -> list[str]:
    """Which layers slide, as llama.cpp reads it: one flag per layer, or every
    `pattern`-th layer global (0: every layer slides); none without a window."""
    if window is None:
        return [FULL] * layers
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise UsageError(f"a sliding-window pattern of {len(pattern)} layers for {layers} layers")
        return [SLIDING if flag else FULL for flag in pattern]
    pattern = int(pattern)
    return [SLIDING if pattern == 0 or i % pattern < pattern - 1 else FULL for i in range(layers)]


def llama3_rope(divisors: np.ndarray, base: float, head_dim: int) -> dict:
    """Llama 3.x's rope parameters from the per-frequency divisors the file holds
    (1 for short wavelengths, `factor` for long ones, a blend between), taking its
    low / high frequency factors (1 and 4; only their ratio to the original context
    shows in the divisors). UsageError if no such parameters give the file's divisors."""
    divisors = divisors.astype(np.float64)
    if head_dim < 2 or len(divisors) != head_dim // 2:
        raise UsageError(f"rope_freqs holds {len(divisors)} values for a head size of {head_dim}")
    factor = float(divisors.max())
    wavelength = 2 * math.pi * base ** (np.arange(0, head_dim, 2) / head_dim)
    blended = (divisors > 1 + 1e-6) & (divisors < factor * (1 - 1e-6))
    if blended.any():  # 1 / divisor = (1 - s) / factor + s, s = (context / wavelength - low) / (high - low)
        s = (1 / divisors[blended] - 1 / factor) / (1 - 1 / factor)
        context = float(np.median(wavelength[blended] * (LLAMA3_LOW + s * (LLAMA3_HIGH - LLAMA3_LOW))))
    else:  # any context between the bands' wavelengths: the shortest unscaled one's times `high`
        context = float(wavelength[divisors <= 1 + 1e-6].max(initial=1.0)) * LLAMA3_HIGH
    context = round(context)
    rope = {"rope_type": "llama3", "rope_theta": base, "factor": factor, "low_freq_factor": LLAMA3_LOW,
            "high_freq_factor": LLAMA3_HIGH, "original_max_position_embeddings": context}
    if not np.allclose(llama3_divisors(rope, wavelength), divisors, rtol=1e-5, atol=0):
        raise UsageError("rope_freqs are not Llama 3's rope scaling with low / high frequency factors 1 and 4")
    return rope


def llama3_divisors(rope: dict, wavelength: np.ndarray) -> np.ndarray:
    """What Llama 3's scaling divides each frequency by (transformers' definition)."""
    low, high = rope["low_freq_factor"], rope["high_freq_factor"]
    context, factor = rope["original_max_position_embeddings"], rope["factor"]
    s = np.clip((context / wavelength - low) / (high - low), 0.0, 1.0)
    return 1 / ((1 - s) / factor + s)
