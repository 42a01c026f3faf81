"""The lean forward of decoder layers, every family's: the span runner's hot path.

transformers' decoder layer builds its keyword arguments, mask and rotary inputs per
layer, per call; here the masks (one per layer type: full or sliding-window) and
rotary tables (one per layer type where the family has several, Gemma 3) are built
once per forward and every layer runs the same few tensor operations, in the order
transformers runs them, with the family's own steps (model/families.py): QK-norm
(Qwen3, Gemma 3), Gemma's norms around attention and MLP and its (1 + w) norm
(the norm modules themselves), attention soft-capping (Gemma 2). So a dense fp32
span is bit-identical to transformers' layers (tests/unit/test_families.py compares
a split model with the whole one, per family). The projections are whatever modules
the layer holds: nn.Linear for fp32 / bf16, model/kernels.py's weight-only kernels
for int8 / q4 / gguf; fused ones (quantized layers' qkv / kv / gate_up, Phi-3's own
qkv_proj and gate_up_proj) run as one call.

Several sessions' steps run as one [N, n, H] forward (N sessions, n tokens each;
batched decode has n = 1): projections and MLPs see all N rows at once, attention
runs per session against its own KV cache and masks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .device import to_device, to_host
from .families import FULL, SLIDING
from .lora import Adapter, LayerLora, layer_lora

MASKS = {FULL: create_causal_mask, SLIDING: create_sliding_window_causal_mask}


def _module_norm(module: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    return module(hidden)


def _fused_norm(module: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """An RMSNorm (w) in one call (float32 activations, float32 weight)."""
    return torch.nn.functional.rms_norm(hidden, (hidden.shape[-1],), module.weight, module.variance_epsilon)


def _fused_norm_plus_one(module: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """Gemma's RMSNorm (1 + w) in one call; 1 + w is made once per norm, not per step."""
    weight = getattr(module, "_weight_plus_one", None)
    if weight is None:
        weight = module._weight_plus_one = 1.0 + module.weight
    return torch.nn.functional.rms_norm(hidden, (hidden.shape[-1],), weight, module.eps)


def norm_of(runner) -> Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]:
    """How `runner`'s layers run their norms. Quantized spans owe transformers no
    bit-identity: torch's one-call RMSNorm is ~5 % of a q4 decode step faster than
    the module's seven operations."""
    if runner.format_label in ("fp32", "bf16"):
        return _module_norm
    return _fused_norm_plus_one if runner.family.norm_plus_one else _fused_norm


def _projections(attn, normed: torch.Tensor, shape: tuple, sizes: tuple[int, int, int],
                 lora: LayerLora | None = None):
    """Query, key and value [N, n, heads, D] (not yet transposed), from whichever
    modules the attention holds, each with its LoRA update where an adapter has one."""
    qkv, kv = getattr(attn, "qkv_proj", None), getattr(attn, "kv_proj", None)
    if qkv is not None:  # quantized layers' stacked rows, or Phi-3's own fused matrix
        fused = qkv(normed)
        if lora is not None:
            fused = lora.add("self_attn.qkv_proj", normed, fused)  # Phi-3's own matrix, adapted whole
        query, key, value = fused.split(sizes, dim=-1)
    elif kv is not None:
        query, (key, value) = attn.q_proj(normed), kv(normed).split(sizes[1:], dim=-1)
    else:
        query, key, value = attn.q_proj(normed), attn.k_proj(normed), attn.v_proj(normed)
    if lora is not None:  # q, k, v adapted one by one, even where their rows are stacked here
        query = lora.add("self_attn.q_proj", normed, query)
        key = lora.add("self_attn.k_proj", normed, key)
        value = lora.add("self_attn.v_proj", normed, value)
    return query.reshape(shape), key.reshape(shape), value.reshape(shape)


def _adapted(module, name: str, x: torch.Tensor, lora: LayerLora | None) -> torch.Tensor:
    y = module(x)
    return y if lora is None else lora.add(name, x, y)


def _mlp(mlp, normed: torch.Tensor, lora: LayerLora | None = None) -> torch.Tensor:
    gate_up = getattr(mlp, "gate_up_proj", None)
    if gate_up is None:
        if lora is None:
            out = mlp(normed)
            return out[0] if isinstance(out, tuple) else out  # gpt-oss's MoE returns (out, router scores)
        # The family's MLP, step by step (the same operations as its module's forward).
        gate = _adapted(mlp.gate_proj, "mlp.gate_proj", normed, lora)
        up = _adapted(mlp.up_proj, "mlp.up_proj", normed, lora)
    else:  # quantized layers' stacked rows, or Phi-3's own
        fused = _adapted(gate_up, "mlp.gate_up_proj", normed, lora)
        gate, up = fused.chunk(2, dim=-1)
        if lora is not None:
            gate, up = lora.add("mlp.gate_proj", normed, gate), lora.add("mlp.up_proj", normed, up)
    act = getattr(mlp, "act_fn", None) or mlp.activation_fn  # Phi-3 names it activation_fn
    return _adapted(mlp.down_proj, "mlp.down_proj", act(gate) * up, lora)


def attention_inputs(config, family, rotary_embedding, kinds: list[str], hidden: torch.Tensor,
                     position_ids: torch.Tensor, caches: list, start: int, end: int) -> tuple[dict, dict]:
    """For layers start..end-1 of one forward: {layer type: (cos, sin)} and {layer type:
    [session i's mask]}. Per layer type, the first layer of that type in the range sizes
    its mask (a span's cache holds nothing for layers outside it), as transformers'
    model does for the whole."""
    first_of: dict[str, int] = {}
    for index in range(start, end):
        first_of.setdefault(kinds[index], index)
    if family.rotary_per_layer_type:
        rotary = {kind: rotary_embedding(hidden, position_ids, kind) for kind in first_of}
    else:
        rotary = dict.fromkeys(first_of, rotary_embedding(hidden, position_ids))
    masks = {kind: [MASKS[kind](config=config, inputs_embeds=hidden[i:i + 1], attention_mask=None,
                                past_key_values=caches[i], position_ids=position_ids[i:i + 1], layer_idx=first)
                    for i in range(hidden.shape[0])]
             for kind, first in first_of.items()}
    return rotary, masks


@torch.inference_mode()
def run_layers(runner, hidden: torch.Tensor, caches: list, positions: list[int], start: int, end: int,
               between_layers: Callable[[], None] | None = None,
               adapters: list[Adapter | None] | None = None) -> torch.Tensor:
    """Layers start..end-1 of `runner` on `hidden` [N, n, H]: session i's n tokens start
    at `positions[i]` and are appended to `caches[i]`, with `adapters[i]`'s LoRA
    updates (model/lora.py) where given. Returns [N, n, H], on the host (the span's
    layers, caches and activations on `runner.device`)."""
    return layers_forward(runner, hidden, caches, positions, start, end, between_layers, adapters)


def layers_forward(runner, hidden: torch.Tensor, caches: list, positions: list[int], start: int, end: int,
                   between_layers: Callable[[], None] | None = None,
                   adapters: list[Adapter | None] | None = None) -> torch.Tensor:
    """run_layers under whatever grad mode the caller chose (training records the graph)."""
    if adapters is not None and all(adapter is None for adapter in adapters):
        adapters = None  # a batch of plain sessions: no per-layer look-ups
    config, family, kinds = runner.config, runner.family, runner.layer_types
    sessions, tokens = hidden.shape[0], hidden.shape[1]
    hidden = to_device(hidden, runner.device)  # a span on CUDA: in through a pinned buffer, out likewise
    position_ids = (torch.tensor(positions, dtype=torch.long).view(sessions, 1) + torch.arange(tokens)).to(
        runner.device)
    rotary, masks = attention_inputs(config, family, runner.rotary, kinds, hidden, position_ids, caches, start, end)
    attention = ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, runner.eager_attention)
    rotate, norm = runner.apply_rotary, norm_of(runner)
    shape = (sessions, tokens, -1, runner.head_dim)
    for index in range(start, end):
        if between_layers is not None:
            between_layers()
        layer, kind = runner.layers[index], kinds[index]
        attn, lora = layer.self_attn, layer_lora(adapters, index)
        residual = hidden
        query, key, value = _projections(attn, norm(layer.input_layernorm, hidden), shape, runner.qkv_sizes, lora)
        if family.qk_norm == "before_transpose":
            query, key = norm(attn.q_norm, query), norm(attn.k_norm, key)
        query, key, value = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
        if family.qk_norm == "after_transpose":
            query, key = norm(attn.q_norm, query), norm(attn.k_norm, key)
        cos, sin = rotary[kind]
        query, key = rotate(query, key, cos, sin)
        options = {"dropout": 0.0, "scaling": attn.scaling,
                   "sliding_window": config.sliding_window if kind == SLIDING else None}
        if family.attention_softcap:
            options["softcap"] = attn.attn_logit_softcapping
        outputs = []
        for i in range(sessions):
            one = slice(None) if sessions == 1 else slice(i, i + 1)
            keys, values = caches[i].update(key[one], value[one], index)
            outputs.append(attention(attn, query[one], keys, values, masks[kind][i], **options)[0])
        attended = outputs[0] if sessions == 1 else torch.cat(outputs, dim=0)
        out = _adapted(attn.o_proj, "self_attn.o_proj", attended.reshape(sessions, tokens, -1).contiguous(), lora)
        if family.sandwich_norms:
            out = norm(layer.post_attention_layernorm, out)
            hidden = residual + out
            residual = hidden
            out = _mlp(layer.mlp, norm(layer.pre_feedforward_layernorm, hidden), lora)
            hidden = residual + norm(layer.post_feedforward_layernorm, out)
        else:
            hidden = residual + out
            residual = hidden
            hidden = residual + _mlp(layer.mlp, norm(layer.post_attention_layernorm, hidden), lora)
    return to_host(hidden)
