"""The lean forward of Llama- and Qwen2-style decoder layers: the span runner's hot path.

transformers' decoder layer builds its keyword arguments, mask and rotary inputs per
layer, per call; here the causal masks and rotary tables are built once per forward
and every layer runs the same few tensor operations, in the order transformers runs
them (so a dense fp32 span is bit-identical to transformers' layers:
tests/unit/test_blocks.py compares a split model with the whole one). The projections are whatever modules the layer holds:
nn.Linear for fp32 / bf16, model/kernels.py's weight-only kernels for int8 / q4.

Several sessions' steps run as one [N, n, H] forward (N sessions, n tokens each;
batched decode has n = 1): projections and MLPs see all N rows at once, attention
runs per session against its own KV cache.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
from transformers.masking_utils import create_causal_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS


def supports_lean(layers) -> bool:
    """Llama- and Qwen2-style layers with full attention (what this forward mirrors)."""
    for layer in layers:
        attn = getattr(layer, "self_attn", None)
        if attn is None or getattr(attn, "sliding_window", None) is not None:
            return False
        if not all(hasattr(attn, name) for name in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling")):
            return False
        if not all(hasattr(layer, name) for name in ("input_layernorm", "post_attention_layernorm", "mlp")):
            return False
    return True


def _module_norm(module: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    return module(hidden)


def fused_norm(module: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """Llama's / Qwen2's RMSNorm in one call (float32 activations, float32 weight)."""
    return torch.nn.functional.rms_norm(hidden, (hidden.shape[-1],), module.weight, module.variance_epsilon)


@torch.inference_mode()
def run_layers(runner, hidden: torch.Tensor, caches: list, positions: list[int], start: int, end: int,
               between_layers: Callable[[], None] | None = None) -> torch.Tensor:
    """Layers start..end-1 of `runner` on `hidden` [N, n, H]: session i's n tokens start
    at `positions[i]` and are appended to `caches[i]`. Returns [N, n, H]."""
    config = runner.config
    sessions, tokens = hidden.shape[0], hidden.shape[1]
    position_ids = torch.tensor(positions, dtype=torch.long).view(sessions, 1) + torch.arange(tokens)
    cos, sin = runner.rotary(hidden, position_ids)
    masks = [create_causal_mask(config=config, inputs_embeds=hidden[i:i + 1], attention_mask=None,
                                past_key_values=caches[i], position_ids=position_ids[i:i + 1], layer_idx=start)
             for i in range(sessions)]
    attention = ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, None)
    # Quantized spans owe transformers no bit-identity: torch's one-call RMSNorm is ~5 %
    # of a q4 decode step faster than the module's seven operations.
    norm = fused_norm if runner.format_label not in ("fp32", "bf16") else _module_norm
    shape = (sessions, tokens, -1, runner.head_dim)
    for index in range(start, end):
        if between_layers is not None:
            between_layers()
        layer = runner.layers[index]
        attn = layer.self_attn
        rotate = sys.modules[type(layer).__module__].apply_rotary_pos_emb
        residual = hidden
        normed = norm(layer.input_layernorm, hidden)
        qkv, kv = getattr(attn, "qkv_proj", None), getattr(attn, "kv_proj", None)
        if qkv is not None:  # a quantized layer: one kernel call (model/blocks.FUSED)
            query, key, value = (part.reshape(shape).transpose(1, 2)
                                 for part in qkv(normed).split(runner.qkv_sizes, dim=-1))
        elif kv is not None:
            query = attn.q_proj(normed).view(shape).transpose(1, 2)
            key, value = (part.reshape(shape).transpose(1, 2)
                          for part in kv(normed).split(runner.qkv_sizes[1:], dim=-1))
        else:
            query = attn.q_proj(normed).view(shape).transpose(1, 2)
            key = attn.k_proj(normed).view(shape).transpose(1, 2)
            value = attn.v_proj(normed).view(shape).transpose(1, 2)
        query, key = rotate(query, key, cos, sin)
        if sessions == 1:
            keys, values = caches[0].update(key, value, index)
            attended, _ = attention(attn, query, keys, values, masks[0], dropout=0.0, scaling=attn.scaling)
        else:
            outputs = []
            for i in range(sessions):
                keys, values = caches[i].update(key[i:i + 1], value[i:i + 1], index)
                out, _ = attention(attn, query[i:i + 1], keys, values, masks[i], dropout=0.0, scaling=attn.scaling)
                outputs.append(out)
            attended = torch.cat(outputs, dim=0)
        hidden = residual + attn.o_proj(attended.reshape(sessions, tokens, -1).contiguous())
        residual = hidden
        mlp, normed = layer.mlp, norm(layer.post_attention_layernorm, hidden)
        gate_up = getattr(mlp, "gate_up_proj", None)
        if gate_up is not None:
            gate, up = gate_up(normed).chunk(2, dim=-1)
            hidden = residual + mlp.down_proj(mlp.act_fn(gate) * up)
        else:
            hidden = residual + mlp(normed)
    return hidden
