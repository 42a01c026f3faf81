"""One forward for the decode steps of several sessions of one span (batching).

A decode step reads every weight of the span to compute one token: memory-bound,
so N sessions' steps cost little more than one when their projections and MLPs
run as one [N, 1, H] product. Attention stays per session (each has its own KV
cache and length), through the very attention function transformers would call.

So for N = 1 the result is bit-identical to SpanRunner.forward; for N > 1 the
projections' rows come from a matrix product instead of a matrix-vector one, which
rounds differently (about 1e-6 relative on SmolLM2's hidden states, far inside the
protocol's fp32 tolerance of 1e-3; tests/unit/test_batched.py measures it). The
next token can only change where the model's two best tokens are that close.
"""

from __future__ import annotations

import sys

import torch
from transformers.masking_utils import create_causal_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

MAX_BATCH = 16


def supports_batching(runner) -> bool:
    """Llama- and Qwen2-style layers with full attention (what this forward mirrors)."""
    for layer in runner.layers.values():
        attn = getattr(layer, "self_attn", None)
        if attn is None or getattr(attn, "sliding_window", None) is not None:
            return False
        if not all(hasattr(attn, name) for name in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling")):
            return False
    return True


@torch.inference_mode()
def decode_batch(runner, hiddens: list[torch.Tensor], caches: list, positions: list[int], start: int,
                 end: int) -> list[torch.Tensor]:
    """Layers start..end-1 of `runner` for N one-token steps at once: `hiddens[i]`
    [1, 1, H] at `positions[i]`, appended to `caches[i]`. The outputs, [1, 1, H] each."""
    config = runner.config
    hidden = torch.cat([h.to(runner.dtype) for h in hiddens], dim=0)  # [N, 1, H]
    n = hidden.shape[0]
    position_ids = torch.tensor(positions, dtype=torch.long).view(n, 1)
    cos, sin = runner.rotary(hidden, position_ids)
    masks = [create_causal_mask(config=config, inputs_embeds=hidden[i:i + 1], attention_mask=None,
                                past_key_values=caches[i], position_ids=position_ids[i:i + 1], layer_idx=start)
             for i in range(n)]
    attention = ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, None)
    for index in range(start, end):
        layer = runner.layers[index]
        attn = layer.self_attn
        rotate = sys.modules[type(layer).__module__].apply_rotary_pos_emb
        residual = hidden
        normed = layer.input_layernorm(hidden)
        shape = (n, 1, -1, attn.head_dim)
        query = attn.q_proj(normed).view(shape).transpose(1, 2)
        key = attn.k_proj(normed).view(shape).transpose(1, 2)
        value = attn.v_proj(normed).view(shape).transpose(1, 2)
        query, key = rotate(query, key, cos, sin)
        outputs = []
        for i in range(n):
            keys, values = caches[i].update(key[i:i + 1], value[i:i + 1], index)
            out, _ = attention(attn, query[i:i + 1], keys, values, masks[i], dropout=0.0, scaling=attn.scaling)
            outputs.append(out)
        attended = torch.cat(outputs, dim=0).reshape(n, 1, -1).contiguous()
        hidden = residual + attn.o_proj(attended)
        residual = hidden
        hidden = residual + layer.mlp(layer.post_attention_layernorm(hidden))
    return list(hidden.split(1, dim=0))
