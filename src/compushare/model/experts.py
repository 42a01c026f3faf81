"""A mixture of experts' tensors: from the names its checkpoints use to transformers' modules.

Checkpoints on the Hub keep one 2-D matrix per expert (Qwen3-MoE: mlp.experts.E.gate_proj;
Mixtral: block_sparse_moe.experts.E.w1); transformers' modules hold each layer's experts
as two 3-D parameters, gate and up rows stacked ([E, 2 I, H]) and down ([E, H, I]), and
convert on load. A span reads its layers itself (model/blocks.py), so it converts the
same way here: stack in expert order, gate rows before up rows, values unchanged. gpt-oss
checkpoints store the 3-D form already. Torch tensors in, torch tensors out (no I/O).
"""

from __future__ import annotations

import re

import torch

# family.experts -> (its checkpoint's MoE module, gate, up and down matrices' names per expert)
PER_EXPERT = {"qwen": ("mlp", "gate_proj", "up_proj", "down_proj"),
              "mixtral": ("block_sparse_moe", "w1", "w3", "w2")}
_EXPERT = re.compile(r"^(?P<module>[a-z_]+)\.experts\.(?P<index>\d+)\.(?P<matrix>\w+)\.weight$")


def stack_experts(layer_state: dict[str, torch.Tensor], layout: str | None) -> dict[str, torch.Tensor]:
    """One layer's tensors (names within the layer) with its per-expert matrices stacked
    into transformers' mlp.experts.gate_up_proj / down_proj, and Mixtral's router renamed
    to mlp.gate. Anything else passes unchanged; a layer that is already stacked too.
    ValueError if the experts are not numbered 0..E-1, each with all three matrices."""
    if layout not in PER_EXPERT:
        return layer_state
    module, gate, up, down = PER_EXPERT[layout]
    out: dict[str, torch.Tensor] = {}
    found: dict[int, dict[str, torch.Tensor]] = {}
    for name, tensor in layer_state.items():
        match = _EXPERT.match(name)
        if match and match["module"] == module and match["matrix"] in (gate, up, down):
            found.setdefault(int(match["index"]), {})[match["matrix"]] = tensor
        elif name.startswith(module + "."):
            out["mlp." + name[len(module) + 1:]] = tensor  # the router: mlp.gate.weight
        else:
            out[name] = tensor
    if not found:
        return out
    if sorted(found) != list(range(len(found))) or any(len(matrices) != 3 for matrices in found.values()):
        raise ValueError(f"experts {sorted(found)[:8]}...: each of 0..{len(found) - 1} needs {gate}, {up} and {down}")
    experts = [found[i] for i in range(len(found))]
    out["mlp.experts.gate_up_proj"] = torch.stack([torch.cat([e[gate], e[up]], dim=0) for e in experts])
    out["mlp.experts.down_proj"] = torch.stack([e[down] for e in experts])
    return out


def stack_model_experts(state: dict[str, torch.Tensor], layout: str | None,
                        prefix: str = "model.layers.") -> dict[str, torch.Tensor]:
    """stack_experts for a whole model's tensors (full names), layer by layer."""
    if layout not in PER_EXPERT:
        return state
    out: dict[str, torch.Tensor] = {}
    layers: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in state.items():
        if name.startswith(prefix):
            index, rest = name[len(prefix):].split(".", 1)
            layers.setdefault(index, {})[rest] = tensor
        else:
            out[name] = tensor
    for index, layer in layers.items():
        out |= {f"{prefix}{index}.{name}": tensor for name, tensor in stack_experts(layer, layout).items()}
    return out
