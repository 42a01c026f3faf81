"""Weight formats: how a model's weights are stored, and so how its spans compute.

A format is part of what a model id names: the manifest of an int8 or q4 model says
so (its "weights" map), and its block files hold the quantized tensors themselves,
so every node serving that id computes from the very same integers and scales.

  fp32   float32 everywhere (manifests without a "weights" map whose tensors are F32)
  bf16   bfloat16 everywhere (likewise, BF16 tensors)
  int8   each decoder projection's weight as int8 with one float32 scale per output
         row (symmetric, w = q * scale); the embedding / LM head likewise
  q4     decoder projections as 4-bit integers in groups of `group_size` along the
         input dimension, with a float16 scale and minimum per group (asymmetric,
         w = q * scale + min, q in 0..15: GGUF's Q4_1 exactly, and Q4_0 with
         min = -8 * scale); the projections the "weights" map lists under "int8" at
         int8 instead; the embedding / LM head as int8, as llama.cpp's 4-bit files
         keep theirs at 8 bits (the LM head is the most sensitive matrix).
         Our quantizer keeps k, v and down at int8 (INT8_IN_Q4), as llama.cpp's
         Q4_K_M keeps v and down at 6 bits: on SmolLM2 (bench/node_compute.py),
         all-4-bit gave 1.23x fp32's perplexity, these three at int8 1.08x, for 0.175
         of fp32's bytes per block instead of 0.141.
  gguf   a GGUF file's own tensors as they come (model/gguf_native.py): every matrix
         (every 2-D tensor) stored as the file's raw ggml blocks, U8 [out, row bytes],
         its ggml type ("Q4_K", "Q6_K", "F16" ...) named in the "weights" map's
         "types"; a mixed file keeps its mix. 1-D tensors (norms, biases) as F32.

Stored tensor names: a quantized `X.weight` keeps its name for the integers (int8:
I8 [out, in]; q4: U8 [out, in / 2], element 2j in the low nibble of byte j, 2j+1 in
the high one) and adds `X.weight_scale` (and `X.weight_min` for q4). Norms stay F32.

The quantizer is deterministic (round to nearest, ties to even; a fixed search in
float64), so every node that quantizes the same fp32 model gets the same bytes and
the same id.
Pure, no I/O and no torch (`status` and `models list` read formats): the
quantizer itself is model/quantize.py.
"""

from __future__ import annotations

import dataclasses
import re

from ..errors import UsageError
from .families import all_projections

FORMATS = ("fp32", "bf16", "int8", "q4", "gguf")
QUANTIZED = ("int8", "q4", "gguf")
# ggml types a gguf model may name (what gguf-py reads; model/kernels.py says which kernel runs each)
GGUF_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
              "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS", "TQ1_0", "TQ2_0",
              "MXFP4")
DEFAULT_Q4_GROUP = 64
Q4_GROUPS = (32, 64, 128)
QUANTIZER_VERSION = 2  # model/quantize.py's; in cached derivations' names: bump when its bytes change
# Our q4's int8 projections. Phi-3 stores q, k and v as one matrix (qkv_proj): 4-bit
# there, like every projection of a GGUF's own Q4_0 file.
INT8_IN_Q4 = ("mlp.down_proj", "self_attn.k_proj", "self_attn.v_proj")
SCALE_SUFFIX, MIN_SUFFIX = "_scale", "_min"
# Decoder projections, every family's (model/families.py; Phi-3's fused qkv_proj and
# gate_up_proj among them): the matrices that hold nearly all of a block's bytes.
PROJECTIONS = all_projections()
_PROJECTION = re.compile(r"model\.layers\.\d+\.(" + "|".join(map(re.escape, PROJECTIONS)) + r")\.weight")
HEAD_MATRICES = ("model.embed_tokens.weight", "lm_head.weight")


@dataclasses.dataclass(frozen=True)
class WeightFormat:
    name: str
    group_size: int = 0  # q4 only
    int8: tuple[str, ...] = ()  # q4 only: projections ("mlp.down_proj", ...) kept at int8
    types: tuple[tuple[str, str], ...] = ()  # gguf only: (tensor name, ggml type), sorted

    def __post_init__(self) -> None:
        if self.name not in FORMATS:
            raise UsageError(f"unknown weight format {self.name!r}: one of {', '.join(FORMATS)}")
        if (self.name == "q4") != (self.group_size in Q4_GROUPS):
            raise UsageError(f"q4 needs a group size in {Q4_GROUPS}; {self.name} takes none")
        if self.int8 and (self.name != "q4" or list(self.int8) != sorted(set(self.int8))
                          or not set(self.int8) <= set(PROJECTIONS)):
            raise UsageError(f"only q4 keeps projections at int8, a sorted list of {PROJECTIONS}")
        if (self.name == "gguf") != bool(self.types) or list(self.types) != sorted(set(self.types)) or not all(
                isinstance(n, str) and kind in GGUF_TYPES for n, kind in self.types):
            raise UsageError(f"gguf (and only gguf) names each matrix's ggml type, one of {', '.join(GGUF_TYPES)}")

    @property
    def label(self) -> str:
        """What users, records and ads see: "fp32", "int8", "q4/g64"."""
        return f"q4/g{self.group_size}" if self.name == "q4" else self.name

    @property
    def quantized(self) -> bool:
        return self.name in QUANTIZED

    def spec(self) -> dict:
        """The manifest's "weights" map (quantized formats only; dense ones are read off the dtypes)."""
        return {"format": self.name} | ({"group_size": self.group_size} if self.name == "q4" else {}) | (
            {"int8": list(self.int8)} if self.int8 else {}) | ({"types": dict(self.types)} if self.types else {})

    def head_format(self) -> WeightFormat:
        """The embedding / LM head's own format: int8 under q4 (see the module doc)."""
        return INT8 if self.name == "q4" else self


FP32, BF16, INT8 = WeightFormat("fp32"), WeightFormat("bf16"), WeightFormat("int8")


def parse_format(text: str) -> WeightFormat:
    """"fp32", "bf16", "int8", "q4" (group 64), "q4/g32" (as `label` prints them): what
    our quantizer makes (q4 with INT8_IN_Q4 at int8)."""
    name, _, group = str(text).strip().lower().partition("/g")
    if name == "q4":
        if "/g" in str(text).lower() and (not group.isdigit() or int(group) not in Q4_GROUPS):
            raise UsageError(f"bad q4 group size in {text!r}: say q4/g32, q4/g64 or q4/g128")
        return WeightFormat("q4", int(group) if group else DEFAULT_Q4_GROUP, INT8_IN_Q4)
    if group:
        raise UsageError(f"{name} takes no group size")
    return WeightFormat(name)


def format_from_manifest(weights: dict | None, tensor_dtypes: set[str]) -> WeightFormat:
    """A manifest's format: its "weights" map if it has one, else its tensors' dtype."""
    if weights is None:
        return BF16 if tensor_dtypes == {"BF16"} else FP32
    int8 = weights.get("int8", [])
    if not isinstance(int8, list) or not all(isinstance(p, str) for p in int8):
        raise UsageError("weights.int8 must be a list of projection names")
    types = weights.get("types", {})
    if not isinstance(types, dict):
        raise UsageError("weights.types must map tensor names to ggml types")
    return WeightFormat(weights.get("format", "?"), weights.get("group_size", 0), tuple(int8),
                        tuple(sorted(types.items())))


def projection_of(name: str) -> str | None:
    """"model.layers.3.mlp.down_proj.weight" -> "mlp.down_proj"; None for other tensors."""
    match = _PROJECTION.fullmatch(name)
    return match.group(1) if match else None


def is_quantized_matrix(name: str) -> bool:
    return bool(_PROJECTION.fullmatch(name)) or name in HEAD_MATRICES


def base_name(stored_name: str) -> str:
    """The matrix a stored tensor belongs to (`X.weight_scale` -> `X.weight`)."""
    for suffix in (SCALE_SUFFIX, MIN_SUFFIX):
        if stored_name.endswith(".weight" + suffix):
            return stored_name[: -len(suffix)]
    return stored_name
