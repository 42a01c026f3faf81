"""Every decoder layer of a model on the consumer, for private mode.

In private mode the consumer runs all of each layer but its weight projections:
the norms, rotary embeddings, attention (with its own KV cache, in plaintext, on
its own machine), SiLU and the residual adds. Each projection (q, k, v, o, gate,
up, down) is a `_Remote` module that hands its input to `project(layer, group, x)`
and gets back the product of the whole group (q, k and v come from one call: the
three modules see the same input tensor, the first asks, the others take their
rows of the answer). So the layers are transformers' own, op for op, and only the
products come from elsewhere (encrypted: pipeline/client/private_chain.py).

The consumer holds no projection weight: per layer it reads the norms (Gemma's
four and the QK-norms included) and any biases (Qwen2's q, k, v), a few kilobytes,
from the model's norms file (manifest.NORMS_FILE, fetched with the head) or, for a
model laid out before that file, from its block files.
Every family (model/families.py) runs so: its masks per layer type (sliding
windows) and rotary tables come from model/lean.py, as a span runner's do. A family
whose layers hold a projection no group covers is refused (PrivateModeUnsupported).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from ..errors import PrivateModeUnsupported
from .arch import architecture_of, load_config
from .families import layer_types
from .kv_cache import new_cache
from .layout import is_norms_tensor
from .lean import attention_inputs
from .manifest import NORMS_FILE
from .weights import read_dense_tensors

GROUP_OF = {
    "q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2), "o_proj": ("o", 0),
    "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1), "down_proj": ("down", 0),
    "qkv_proj": ("qkv", 0), "gate_up_proj": ("gate_up", 0),  # Phi-3's fused matrices: the whole group
}


Project = Callable[[int, str, torch.Tensor], torch.Tensor]  # (layer, group, x [T, cols]) -> [T, rows]


class _Remote(torch.nn.Module):
    def __init__(self, owner: PrivateLayers, layer: int, group: str, part: int, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.owner, self.layer, self.group, self.part, self.bias = owner, layer, group, part, bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.owner.product(self.layer, self.group, self.part, x)
        return out + self.bias if self.bias is not None else out


class PrivateLayers:
    def __init__(self, config, state: dict[str, torch.Tensor], project: Project) -> None:
        self.config, self.project = config, project
        arch = architecture_of(config)
        if arch.family.moe:  # a token's experts would tell whoever serves them which ones it chose
            raise PrivateModeUnsupported(
                f"private mode cannot run {arch.family.title}: a mixture of experts' routing is not encrypted "
                f"(the experts a token reaches would show which were chosen); run it without --private")
        self.family, self.kinds = arch.family, layer_types(config)
        self.rotary = arch.rotary(config=config)
        self.layers: list[torch.nn.Module] = []
        self.products = 0  # group products asked for (one per group, layer and step)
        self._last: dict[tuple[int, str], tuple[torch.Tensor, list[torch.Tensor]]] = {}
        self._splits: dict[str, dict[int, int]] = {}  # group -> part -> rows (the replaced Linear's)
        for index in range(config.num_hidden_layers):
            with torch.device("meta"):
                layer = arch.decoder_layer(config, layer_idx=index)
            prefix = f"model.layers.{index}."
            for parent in (layer.self_attn, layer.mlp):
                for name, (group, part) in GROUP_OF.items():
                    if hasattr(parent, name):
                        owner = "self_attn" if parent is layer.self_attn else "mlp"
                        bias = state.get(f"{prefix}{owner}.{name}.bias")
                        if index == 0:  # every layer splits its groups alike
                            self._splits.setdefault(group, {})[part] = getattr(parent, name).out_features
                        setattr(parent, name, _Remote(self, index, group, part,
                                                      None if bias is None else bias.float()))
            uncovered = sorted(name for name, module in layer.named_modules() if isinstance(module, torch.nn.Linear))
            if uncovered:
                raise PrivateModeUnsupported(
                    f"private mode cannot run {arch.family.title}: its layers' {', '.join(uncovered)} belong to no "
                    f"encrypted group (he/groups.py: {', '.join(sorted(set(g for g, _ in GROUP_OF.values())))})")
            local = {k[len(prefix):]: v.float() for k, v in state.items()
                     if k.startswith(prefix) and not k.endswith("_proj.bias")}
            missing, unexpected = layer.load_state_dict(local, strict=False, assign=True)
            if unexpected or any(not m.endswith("_proj.bias") for m in missing):
                raise ValueError(f"layer {index}: missing {missing}, unexpected {unexpected}")
            layer.eval()
            self.layers.append(layer)

    @classmethod
    def load(cls, model_dir: Path, project: Project) -> PrivateLayers:
        """The layers of the model in `model_dir`, their tensors read from its norms file
        (NORMS_FILE: fetched with the head) where it holds one, else from its block files."""
        config = load_config(model_dir)
        files = [NORMS_FILE] if (Path(model_dir) / NORMS_FILE).is_file() else None

        def local(names):
            return [n for n in names if is_norms_tensor(n)]

        return cls(config, read_dense_tensors(model_dir, local, files), project)

    def product(self, layer: int, group: str, part: int, x: torch.Tensor) -> torch.Tensor:
        """Rows of one projection: the group's product is asked for once per input."""
        key = (layer, group)
        cached = self._last.get(key)
        if cached is None or cached[0] is not x:
            flat = x.reshape(-1, x.shape[-1])
            out = self.project(layer, group, flat)
            self.products += 1
            splits = self._splits[group]
            sizes = [splits[i] for i in sorted(splits)]
            parts = [p.reshape(*x.shape[:-1], p.shape[-1]) for p in torch.split(out, sizes, dim=-1)]
            cached = self._last[key] = (x, parts)
        return cached[1][part]

    def new_cache(self):
        return new_cache(self.config)

    @torch.inference_mode()
    def forward(self, hidden: torch.Tensor, cache, position: int, start: int = 0, end: int | None = None
                ) -> torch.Tensor:
        """Layers start..end-1 (default: all) on `hidden` [1, n, H] whose first token
        sits at `position`. Different layer ranges may run at once in different
        threads (a pipelined prefill), each range's chunks in order."""
        end = len(self.layers) if end is None else end
        hidden = hidden.float()
        n = hidden.shape[1]
        position_ids = torch.arange(position, position + n).unsqueeze(0)
        rotary, masks = attention_inputs(self.config, self.family, self.rotary, self.kinds, hidden, position_ids,
                                         [cache], start, end)
        try:
            for index in range(start, end):
                kind = self.kinds[index]
                hidden = self.layers[index](hidden, attention_mask=masks[kind][0], position_ids=position_ids,
                                            past_key_values=cache, use_cache=True, position_embeddings=rotary[kind])
        finally:
            for key in [k for k in self._last if start <= k[0] < end]:
                del self._last[key]  # no activation outlives its step
        return hidden
