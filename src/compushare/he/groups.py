"""Which weight projections of a decoder layer run encrypted, grouped by input.

The matrices that read the same input are stacked into one product (their rows
share the output ciphertexts, plan.py), so a layer is four encrypted products and
four round trips: q, k and v of the normed hidden state; o of the attention
output; gate and up of the normed hidden state; down of the SiLU-gated product.
Biases (Qwen2's q, k and v) are added by the consumer, in plaintext, after it
decrypts: they are a handful of numbers a layer and need no encryption. A
checkpoint that stores a group's rows as one matrix already (Phi-3's qkv_proj and
gate_up_proj) gives the group that matrix: the same rows in the same order.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .plan import plans

GROUPS: dict[str, tuple[str, ...]] = {
    "qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o": ("self_attn.o_proj",),
    "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
    "down": ("mlp.down_proj",),
}
PROJECTIONS_PER_LAYER = sum(len(parts) for parts in GROUPS.values())  # 7
FUSED_GROUPS = {"qkv": "self_attn.qkv_proj", "gate_up": "mlp.gate_up_proj"}


def layer_prefix(layer: int) -> str:
    return f"model.layers.{layer}."


def group_members(state: dict, layer: int, group: str) -> tuple[str, ...]:
    """The matrices holding a group's rows in `state`: its fused one if stored so, else its projections."""
    fused = FUSED_GROUPS.get(group)
    if fused is not None and f"{layer_prefix(layer)}{fused}.weight" in state:
        return (fused,)
    return GROUPS[group]


def group_weight(state: dict, layer: int, group: str) -> np.ndarray:
    """The stacked [rows, cols] float64 weight of one group of one layer, from a
    state dict of numpy-convertible tensors (torch's or numpy's)."""
    parts = [np.asarray(state[f"{layer_prefix(layer)}{name}.weight"], dtype=np.float64)
             for name in group_members(state, layer, group)]
    return np.concatenate(parts, axis=0)


def group_rows(state: dict, layer: int, group: str) -> list[int]:
    """Rows of each matrix of the group, in stacking order."""
    return [int(state[f"{layer_prefix(layer)}{name}.weight"].shape[0]) for name in group_members(state, layer, group)]


@dataclasses.dataclass(frozen=True)
class ShapeConfig:
    """What group_shapes reads of a transformers config, taken from config.json's own map
    (`of`): the HE worker computes with it without importing transformers."""
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    head_dim: int

    @classmethod
    def of(cls, config: dict) -> ShapeConfig:
        """From a config.json map; its defaults as transformers' configs fill them: K/V
        heads as many as the query's, head_dim hidden / heads."""
        hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        return cls(hidden, heads, int(config.get("num_key_value_heads") or heads), int(config["intermediate_size"]),
                   int(config.get("head_dim") or hidden // heads))


def group_shapes(config) -> dict[str, tuple[int, int]]:
    """[rows, cols] of each group for a transformers config (every family: model/families.py)
    or a ShapeConfig."""
    hidden = config.hidden_size
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv = config.num_key_value_heads * head_dim
    inter = config.intermediate_size
    return {"qkv": (heads * head_dim + 2 * kv, hidden), "o": (hidden, heads * head_dim),
            "gate_up": (2 * inter, hidden), "down": (hidden, inter)}


def required_steps(config, slots: int) -> frozenset[int]:
    """Every rotation the products of a model need, in either plan (the same for
    every layer): the Galois keys a consumer makes and a provider requires."""
    steps: set[int] = set()
    for rows, cols in group_shapes(config).values():
        for plan in plans(rows, cols, slots):
            steps |= plan.steps
    return frozenset(steps)


def preencoded_bytes(config, slots: int, poly_degree: int, data_primes: int) -> int:
    """Memory one layer's pre-encoded weights take: every plaintext of its four
    products' plans (decode and prompt), one polynomial per data prime (8 bytes a
    coefficient), all workers together."""
    plaintexts = sum(plan.products for rows, cols in group_shapes(config).values()
                     for plan in plans(rows, cols, slots))
    return plaintexts * poly_degree * 8 * data_primes
