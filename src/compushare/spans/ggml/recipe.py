"""What a family's span graph on ggml needs of its config, as llama.cpp reads it.

llama.cpp builds each family's graph in its own file (src/models/<arch>.cpp); what
differs between ours is gathered here, read off the config our importer wrote from
the GGUF's metadata. Where llama.cpp departs from transformers, the ggml runtime
follows llama.cpp (its tokens are the target): Phi-3's sliding window is off there,
so it is off here. Pure: no ggml, no torch.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from ...model.families import SLIDING, family_of_config, layer_types

ROPE_NORMAL, ROPE_NEOX = 0, 2
# llama.cpp's rope type for each family (llama_model_rope_type): "normal" for
# Llama-architecture files (their q/k rows are stored permuted for it), NeoX otherwise.
ROPE_MODES = {"llama": ROPE_NORMAL, "mistral": ROPE_NORMAL, "qwen2": ROPE_NEOX, "qwen3": ROPE_NEOX,
              "gemma2": ROPE_NEOX, "gemma3": ROPE_NEOX, "phi3": ROPE_NEOX, "qwen3_moe": ROPE_NEOX,
              "mixtral": ROPE_NORMAL, "gpt_oss": ROPE_NEOX}
# llama.cpp's sliding-window families among ours (Phi-3's window it turns off)
WINDOWED = ("gemma2", "gemma3", "gpt_oss")
SOFTMAX, SOFTMAX_WEIGHT = "softmax", "softmax_weight"  # llama.cpp's expert gating functions


@dataclasses.dataclass(frozen=True)
class Experts:
    """A mixture of experts' routing, as llama.cpp's build_moe_ffn takes it."""
    count: int
    used: int
    # SOFTMAX: softmax over all experts' logits, the top `used` picked, their weights
    # renormalised to sum 1 (Qwen3-MoE, Mixtral). SOFTMAX_WEIGHT: the top `used` logits
    # picked, softmax over them (gpt-oss).
    gating: str = SOFTMAX
    normalise: bool = True
    swiglu_oai: bool = False  # gpt-oss's clamped SwiGLU (alpha 1.702, limit 7), else SwiGLU
    alpha: float = 1.702
    limit: float = 7.0


@dataclasses.dataclass(frozen=True)
class Yarn:
    """YaRN's arguments to ggml_rope_ext, as llama.cpp's context computes them."""
    original_context: int
    attn_factor: float
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    ext_factor: float = 1.0


@dataclasses.dataclass(frozen=True)
class Rope:
    base: float
    scale: float = 1.0  # llama.cpp's freq_scale: 1 / a linear or YaRN scaling's factor
    factors: tuple[float, ...] | None = None  # per-frequency divisors (Llama 3.x)
    yarn: Yarn | None = None


@dataclasses.dataclass(frozen=True)
class Recipe:
    family: str
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    rope_mode: int
    ropes: tuple[Rope, ...]  # per layer
    windows: tuple[int | None, ...]  # per layer: the sliding window, None for full attention
    qk_norm: bool = False  # Qwen3, Gemma 3: RMS norm of each head's q and k before rope
    sandwich: bool = False  # Gemma: norms after attention and after the MLP, before their residual adds
    norm_plus_one: bool = False  # Gemma: the file holds norms as 1 + w (our store keeps w)
    q_scale: float | None = None  # Gemma, Phi-3: q scaled after rope, attention then unscaled
    softcap: float = 0.0  # Gemma 2: attention scores soft-capped
    gelu: bool = False  # Gemma: GELU (tanh) gate, else SiLU
    fused: bool = False  # Phi-3: q/k/v one matrix, gate/up one matrix
    experts: Experts | None = None  # a mixture of experts' MLP
    sinks: bool = False  # gpt-oss: a learned logit per head in every softmax (flash attention's sinks)

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def attention_scale(self) -> float:
        return 1.0 if self.q_scale is not None else inverse_sqrt(self.head_dim)

    def window_for(self, index: int) -> int | None:
        return self.windows[index]


def yarn_attn_factor(freq_scale: float) -> float:
    """llama.cpp's YaRN attention factor, in its float32 operations: YaRN's magnitude
    scale 0.1 ln(factor) + 1, times the inverse of the one ggml's rope applies itself
    (so the two cancel up to rounding)."""
    f32 = np.float32
    factor = f32(1.0) / f32(freq_scale)
    mscale = f32(0.1) * np.log(factor, dtype=np.float32) + f32(1.0) if factor > 1 else f32(1.0)
    return float(mscale * (f32(1.0) / (f32(1.0) + f32(0.1) * np.log(factor, dtype=np.float32))))


def inverse_sqrt(value: float) -> float:
    """1 / sqrt(value) in float32 operations, as llama.cpp's C computes its scales
    (1.0f / sqrtf(x)): the double's rounding can be an ulp away."""
    return float(np.float32(1.0) / np.sqrt(np.float32(value)))


def _get(config, key: str, default=None):
    return config.get(key, default) if isinstance(config, dict) else getattr(config, key, default)


def rope_of(parameters: dict, head_dim: int) -> Rope:
    kind = parameters.get("rope_type", "default") or "default"
    base = float(parameters.get("rope_theta", 10000.0))
    if kind == "default":
        return Rope(base)
    if kind == "linear":
        return Rope(base, 1.0 / float(parameters["factor"]))
    if kind == "llama3":
        return Rope(base, 1.0, tuple(llama3_factors(parameters, base, head_dim).tolist()))
    if kind == "yarn":
        scale = float(np.float32(1.0) / np.float32(parameters["factor"]))
        return Rope(base, scale, yarn=Yarn(int(parameters["original_max_position_embeddings"]), yarn_attn_factor(scale),
                                           float(parameters.get("beta_fast") or 32.0),
                                           float(parameters.get("beta_slow") or 1.0)))
    raise NotImplementedError(f"rope scaling {kind!r} does not run on ggml yet: serve the model with --runtime torch")


def llama3_factors(parameters: dict, base: float, head_dim: int) -> np.ndarray:
    """Llama 3.x's per-frequency divisors (float32), computed as llama.cpp's converter
    computes the rope_freqs tensor it writes: a frequency whose wavelength is under the
    original context / high_freq_factor keeps 1, one over context / low_freq_factor
    gets `factor`, and one between is interpolated smoothly."""
    import torch

    frequencies = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factor = parameters.get("factor", 8.0)
    low, high = parameters.get("low_freq_factor", 1.0), parameters.get("high_freq_factor", 4.0)
    context = parameters.get("original_max_position_embeddings", 8192)
    out = []
    for frequency in frequencies:
        wavelength = 2 * math.pi / frequency
        if wavelength < context / high:
            out.append(1)
        elif wavelength > context / low:
            out.append(factor)
        else:
            smooth = (context / wavelength - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32).numpy()


def recipe_of(config) -> Recipe:
    family = family_of_config(config)
    if family.name not in ROPE_MODES:
        raise NotImplementedError(f"{family.title} spans do not run on ggml: serve them with --runtime torch")
    heads = _get(config, "num_attention_heads")
    head_dim = _get(config, "head_dim") or _get(config, "hidden_size") // heads
    types = layer_types(config)
    parameters = _get(config, "rope_parameters") or {"rope_theta": _get(config, "rope_theta", 10000.0)}
    if "rope_type" in parameters or "rope_theta" in parameters:  # one set for every layer type
        ropes = tuple(rope_of(parameters, head_dim) for _ in types)
    else:  # Gemma 3: a set per layer type
        ropes = tuple(rope_of(parameters[kind], head_dim) for kind in types)
    window = _get(config, "sliding_window")
    windows = tuple(window if family.name in WINDOWED and kind == SLIDING else None for kind in types)
    gemma = family.name in ("gemma2", "gemma3")
    q_scale = None
    if gemma:
        q_scale = inverse_sqrt(_get(config, "query_pre_attn_scalar") or head_dim)
    elif family.name == "phi3":
        q_scale = inverse_sqrt(head_dim)
    softcap = float(_get(config, "attn_logit_softcapping") or 0.0) if family.attention_softcap else 0.0
    experts = None
    if family.moe:
        count = _get(config, "num_experts") or _get(config, "num_local_experts")
        used = _get(config, "num_experts_per_tok")
        if not (isinstance(count, int) and isinstance(used, int) and 1 <= used <= count):
            # ggml would abort the process on a top-k past its experts: a config comes from its publisher
            raise ValueError(f"{used!r} experts a token of {count!r}: not a mixture of experts ggml can run")
        gpt_oss = family.name == "gpt_oss"
        experts = Experts(int(count), int(_get(config, "num_experts_per_tok")),
                          gating=SOFTMAX_WEIGHT if gpt_oss else SOFTMAX, normalise=not gpt_oss, swiglu_oai=gpt_oss,
                          alpha=float(_get(config, "swiglu_alpha", 1.702) or 1.702),
                          limit=float(_get(config, "swiglu_limit", 7.0) or 7.0))
    return Recipe(family.name, _get(config, "hidden_size"), heads, _get(config, "num_key_value_heads") or heads,
                  head_dim, float(_get(config, "rms_norm_eps", family.rms_norm_eps_default)),
                  ROPE_MODES[family.name], ropes, windows, qk_norm=family.qk_norm is not None, sandwich=gemma,
                  norm_plus_one=family.norm_plus_one, q_scale=q_scale, softcap=softcap, gelu=gemma,
                  fused=bool(family.fused), experts=experts, sinks=family.attention_sinks)
