"""LoRA adapters: what a consumer trains through frozen remote spans, and servers apply.

An adapter adds, to the output y = W x of chosen projections of every block, a
low-rank update  y += s * B (A x)  with A [r, in], B [out, r] and s = alpha / r
(alpha / sqrt(r) with rsLoRA), as PEFT's LoRA does, in the same order of operations:
so a span with an adapter computes what a PEFT model computes, within float32's
rounding. The frozen weights are never touched: the update is added to a
projection's output, whatever kernel computed it (fp32, int8, q4, GGUF), so an
adapter trained through an fp32 swarm applies on a q4 one.

Tensors are named as PEFT saves them, without its "base_model.model." prefix:
"model.layers.{i}.{module}.lora_A.weight" (and lora_B), where module is the
projection's path in the layer ("self_attn.q_proj"). Pure torch: no I/O here
(model/adapter_file.py reads and writes PEFT's files).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import re

import msgpack
import torch

# PEFT's target names (a projection's own name) and where each sits in a decoder layer.
TARGET_MODULES = {"q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
                  "o_proj": "self_attn.o_proj", "qkv_proj": "self_attn.qkv_proj", "gate_proj": "mlp.gate_proj",
                  "up_proj": "mlp.up_proj", "down_proj": "mlp.down_proj", "gate_up_proj": "mlp.gate_up_proj"}
DEFAULT_TARGETS = ("q_proj", "v_proj")  # PEFT's default for Llama-style models
MAX_RANK = 256
_NAME = re.compile(r"^model\.layers\.(\d+)\.((?:self_attn|mlp)\.[a-z_]+)\.lora_([AB])\.weight$")


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """An adapter's shape: rank, alpha and which projections of every layer it adapts."""

    rank: int
    alpha: float
    targets: tuple[str, ...] = DEFAULT_TARGETS
    rslora: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "targets", tuple(sorted(self.targets)))  # one spec, one digest
        if not (isinstance(self.rank, int) and 1 <= self.rank <= MAX_RANK):
            raise ValueError(f"LoRA rank must be 1..{MAX_RANK}, not {self.rank!r}")
        if not (isinstance(self.alpha, int | float) and math.isfinite(self.alpha) and self.alpha > 0):
            raise ValueError(f"LoRA alpha must be a positive number, not {self.alpha!r}")
        unknown = [t for t in self.targets if t not in TARGET_MODULES]
        if unknown or not self.targets or len(set(self.targets)) != len(self.targets):
            raise ValueError(f"LoRA targets must be distinct names among {sorted(TARGET_MODULES)}; "
                             f"got {list(self.targets)}")

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)

    @property
    def modules(self) -> tuple[str, ...]:
        """The adapted projections' paths in a layer."""
        return tuple(TARGET_MODULES[t] for t in self.targets)

    def to_wire(self) -> dict:
        return {"rank": self.rank, "alpha": float(self.alpha), "targets": list(self.targets), "rslora": self.rslora}

    @classmethod
    def from_wire(cls, value: object) -> LoraSpec:
        if not isinstance(value, dict) or set(value) != {"rank", "alpha", "targets", "rslora"}:
            raise ValueError("a LoRA spec is a map of exactly rank, alpha, targets, rslora")
        targets = value["targets"]
        if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets) or \
                not isinstance(value["rslora"], bool) or isinstance(value["rank"], bool):
            raise ValueError("a LoRA spec's targets are names and rslora a boolean")
        return cls(value["rank"], value["alpha"], tuple(targets), value["rslora"])


def tensor_name(layer: int, module: str, which: str) -> str:
    return f"model.layers.{layer}.{module}.lora_{which}.weight"


def parse_name(name: str) -> tuple[int, str, str]:
    """(layer, module path, "A" or "B") of an adapter tensor's name; ValueError otherwise."""
    match = _NAME.match(name)
    if match is None or match.group(2) not in TARGET_MODULES.values():
        raise ValueError(f"{name!r} is no LoRA tensor of a decoder layer's projection")
    return int(match.group(1)), match.group(2), match.group(3)


def projection_shapes(config) -> dict[str, tuple[int, int]]:
    """[out, in] of every projection a layer of `config` may hold."""
    hidden = config.hidden_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    heads = config.num_attention_heads
    kv = (getattr(config, "num_key_value_heads", None) or heads) * head_dim
    inter = config.intermediate_size
    return {"self_attn.q_proj": (heads * head_dim, hidden), "self_attn.k_proj": (kv, hidden),
            "self_attn.v_proj": (kv, hidden), "self_attn.o_proj": (hidden, heads * head_dim),
            "self_attn.qkv_proj": (heads * head_dim + 2 * kv, hidden), "mlp.gate_proj": (inter, hidden),
            "mlp.up_proj": (inter, hidden), "mlp.down_proj": (hidden, inter), "mlp.gate_up_proj": (2 * inter, hidden)}


class Adapter:
    """A LoRA adapter's tensors for some layers (all of a model's, or a span's)."""

    def __init__(self, spec: LoraSpec, tensors: dict[str, torch.Tensor], model_id: str = "") -> None:
        self.spec, self.tensors, self.model_id = spec, tensors, model_id
        layers: dict[int, dict[str, list]] = {}
        for name, tensor in tensors.items():
            index, module, which = parse_name(name)
            if module not in spec.modules:
                raise ValueError(f"{name}: {module} is not among the adapter's targets {list(spec.targets)}")
            pair = layers.setdefault(index, {}).setdefault(module, [None, None])
            pair[0 if which == "A" else 1] = tensor
        for index, modules in layers.items():
            for module, (a, b) in modules.items():
                if a is None or b is None:
                    raise ValueError(f"layer {index} {module}: lora_A and lora_B come together")
                if a.dim() != 2 or b.dim() != 2 or a.shape[0] != spec.rank or b.shape[1] != spec.rank:
                    raise ValueError(f"layer {index} {module}: A {tuple(a.shape)} and B {tuple(b.shape)} are not "
                                     f"rank {spec.rank} factors")
        self._layers = {index: {module: (pair[0], pair[1]) for module, pair in modules.items()}
                        for index, modules in layers.items()}

    @classmethod
    def initialised(cls, spec: LoraSpec, config, layers: range, *, seed: int = 0, model_id: str = "") -> Adapter:
        """A fresh adapter, as PEFT initialises one: A Kaiming-uniform (a = sqrt 5), B
        zero, so it starts as the base model."""
        generator = torch.Generator().manual_seed(seed)
        shapes, tensors = projection_shapes(config), {}
        for index in layers:
            for module in spec.modules:
                out_features, in_features = shapes[module]
                bound = 1.0 / math.sqrt(in_features)  # kaiming_uniform_(a=sqrt(5)) on [r, in]
                a = torch.empty(spec.rank, in_features).uniform_(-bound, bound, generator=generator)
                tensors[tensor_name(index, module, "A")] = a
                tensors[tensor_name(index, module, "B")] = torch.zeros(out_features, spec.rank)
        return cls(spec, tensors, model_id)

    @property
    def layers(self) -> list[int]:
        return sorted(self._layers)

    def layer(self, index: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]] | None:
        return self._layers.get(index)

    def check_fits(self, config) -> None:
        """ValueError unless every factor fits `config`'s projections and layers."""
        shapes = projection_shapes(config)
        for index, modules in self._layers.items():
            if not 0 <= index < config.num_hidden_layers:
                raise ValueError(f"the adapter has layer {index}; the model has {config.num_hidden_layers}")
            for module, (a, b) in modules.items():
                out_features, in_features = shapes[module]
                if a.shape[1] != in_features or b.shape[0] != out_features:
                    raise ValueError(f"layer {index} {module}: A {tuple(a.shape)}, B {tuple(b.shape)} do not fit "
                                     f"a [{out_features}, {in_features}] projection")

    def span(self, start: int, end: int) -> Adapter:
        """The adapter's tensors for layers start..end-1 (what one server needs)."""
        keep = {name: t for name, t in self.tensors.items() if start <= parse_name(name)[0] < end}
        return Adapter(self.spec, keep, self.model_id)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def digest(self) -> bytes:
        """What a server caches an adapter under (protocol.md): SHA-256 over a domain tag,
        the msgpack of [rank, alpha, targets, rslora], then per tensor in name order the
        msgpack of [name, shape] and its float32 little-endian bytes."""
        spec = self.spec
        h = hashlib.sha256(b"compushare/adapter/v1\x00")
        h.update(msgpack.packb([spec.rank, float(spec.alpha), list(spec.targets), spec.rslora]))
        for name in sorted(self.tensors):
            t = self.tensors[name].detach().float().contiguous().cpu()
            h.update(msgpack.packb([name, list(t.shape)]))
            h.update(t.numpy().astype("<f4", copy=False).tobytes())
        return h.digest()


class LayerLora:
    """The updates that apply in one layer of one forward, per session row: a batched
    forward's sessions may carry different adapters (or none)."""

    def __init__(self, per_row: list[tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], float] | None]) -> None:
        self.per_row = per_row

    def add(self, module: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (the projection `module`'s output for input x, [N, n, out]) plus each row's update."""
        rows = [None if entry is None or module not in entry[0] else (entry[0][module], entry[1])
                for entry in self.per_row]
        if all(row is None for row in rows):
            return y
        first = rows[0]
        if first is not None and all(row is not None and row[0] is first[0] for row in rows):
            return y + _update(x, *first).to(y.dtype)  # one adapter for every row: one product
        parts = [y[i:i + 1] if row is None else y[i:i + 1] + _update(x[i:i + 1], *row).to(y.dtype)
                 for i, row in enumerate(rows)]
        return torch.cat(parts, dim=0)


def _update(x: torch.Tensor, factors: tuple[torch.Tensor, torch.Tensor], scaling: float) -> torch.Tensor:
    a, b = factors
    # PEFT's order: lora_B(lora_A(x)) * scaling, in the factors' dtype.
    return torch.nn.functional.linear(torch.nn.functional.linear(x.to(a.dtype), a), b) * scaling


def layer_lora(adapters: list[Adapter | None] | None, index: int) -> LayerLora | None:
    """What applies in layer `index` for each session row (None: nothing does)."""
    if not adapters:
        return None
    per_row = []
    for adapter in adapters:
        factors = None if adapter is None else adapter.layer(index)
        per_row.append(None if factors is None else (factors, adapter.spec.scaling))
    return None if all(entry is None for entry in per_row) else LayerLora(per_row)
