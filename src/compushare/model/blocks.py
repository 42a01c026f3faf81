"""SpanRunner: a contiguous span of decoder layers of one model, with KV caches.

Layers keep their *global* index (the KV cache and causal mask are indexed by it),
so a stage holding blocks 10:20 builds layers 10..19 and a DynamicCache whose
entries 10..19 fill up. Runs synchronously: callers put it in a worker thread.

The layers are transformers' modules (their norms, MLP activation and rotary
embedding), with each projection the weight format's own module (model/kernels.py:
nn.Linear for fp32 / bf16, weight-only int8 / 4-bit kernels for quantized models);
forwards run through model/lean.py, not transformers' per-layer call, for every
family (model/families.py): so every span is batchable and may be quantized.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from transformers import DynamicCache

from . import gguf_native, kernels
from ..errors import ModelUnavailable
from .arch import architecture_of, load_config
from .experts import stack_experts, stack_model_experts
from .formats import MIN_SUFFIX, Q4_GROUPS, SCALE_SUFFIX, WeightFormat, base_name
from .device import CPU
from .kv_cache import new_cache
from .families import layer_types
from .lean import run_layers
from .lora import Adapter
from .layout import LAYER_PREFIX
from .store import MANIFEST_FILE, span_tensor_names, stored_format  # noqa: F401 (callers find them here)
from .quantize import matrix_parts, random_parts, stack_rows
from .weights import read_dense_tensors, read_tensors

# Products that share their input, run as one kernel call in quantized layers (model/lean.py).
# In order: q/k/v together if they share a format, else k/v (our q4 keeps k, v at int8).
FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "self_attn.kv_proj": ("self_attn.k_proj", "self_attn.v_proj"),
         "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}


def span_device(device: str | torch.device) -> torch.device:
    """`device` as a torch.device, a CUDA one with its index (the current device's if unsaid)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def layer_states(state: dict[str, torch.Tensor]) -> Callable[[int], dict[str, torch.Tensor]]:
    """Layer index -> that layer's tensors under their names in the layer, out of a span's whole state."""
    def of(index: int) -> dict[str, torch.Tensor]:
        prefix = f"{LAYER_PREFIX}{index}."
        return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
    return of


class SpanRunner:
    runtime = "torch"  # spans/__init__.py: the runtime interface this class implements
    build = f"torch/{torch.__version__.split('+')[0]}"

    def __init__(self, config, start: int, end: int,
                 state: dict[str, torch.Tensor] | Callable[[int], dict[str, torch.Tensor]], dtype=torch.float32,
                 gguf_types: dict[str, str] | None = None, device: str | torch.device = "cpu"):
        """`state` is the span's tensors, or a function reading one layer's (`load`: a
        span is read a layer at a time, so what loading holds beyond the span's kernels
        is one layer's stored bytes, not the span's). `gguf_types`: a gguf model's
        {matrix name: ggml type} (its manifest's), whose matrices are raw blocks.
        `device`: where weights, KV caches and activations live ("cpu", "cuda",
        "cuda:1"); forward takes and returns CPU tensors whatever it is."""
        if not (0 <= start < end <= config.num_hidden_layers):
            raise ValueError(f"span {start}:{end} outside 0:{config.num_hidden_layers}")
        self.config, self.start, self.end, self.dtype = config, start, end, dtype
        self.device = span_device(device)
        arch = architecture_of(config)
        self.family, self.layer_types = arch.family, layer_types(config)
        self.rotary = arch.rotary(config=config).to(self.device)
        self.apply_rotary, self.eager_attention = arch.apply_rotary, arch.eager_attention
        self.layers: dict[int, torch.nn.Module] = {}
        self.weight_bytes = 0  # as held in memory, in the model's format (scales included)
        states = layer_states(state) if isinstance(state, dict) else state
        # CUDA kernels are built on the current device (model/kernels.py): this one.
        with torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext():
            for index in range(start, end):
                self._add_layer(arch, index, states(index), gguf_types)
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.qkv_sizes = (config.num_attention_heads * self.head_dim, kv_heads * self.head_dim,
                          kv_heads * self.head_dim)
        # Fault injection for tests and demos: >1 makes every forward take that many
        # times as long (emulates slower hardware; seen by the self-benchmark too).
        self.slowdown = 1.0
        self.batchable = True  # decode steps of sessions may share a forward (model/batched.py)

    def _add_layer(self, arch, index: int, layer_state: dict[str, torch.Tensor], gguf_types: dict[str, str] | None
                   ) -> None:
        with torch.device("meta"):
            layer = arch.decoder_layer(self.config, layer_idx=index)
        if index == self.start:  # what records, proofs and Opened name
            self.format_label = "gguf" if gguf_types else self._format_label(layer_state, self.dtype)
        if self.family.moe:
            if self.format_label not in ("fp32", "bf16"):
                raise ModelUnavailable(f"{self.family.title} spans run on torch from fp32 or bf16 checkpoints only; "
                                       f"a quantized mixture of experts runs on ggml from its GGUF file")
            layer_state = stack_experts(layer_state, self.family.experts)
        prefix = f"{LAYER_PREFIX}{index}."
        self._load_layer(layer, layer_state, self.dtype, {name[len(prefix):]: kind for name, kind in
                                                          (gguf_types or {}).items() if name.startswith(prefix)},
                         self.device)
        del layer_state
        layer.eval()
        layer.requires_grad_(False)  # frozen: training computes gradients for inputs and adapters only
        self.layers[index] = layer
        self.weight_bytes += sum(t.numel() * t.element_size()
                                 for t in (*layer.parameters(), *layer.buffers()) if t.device.type != "meta")

    @staticmethod
    def _format_label(state: dict[str, torch.Tensor], dtype: torch.dtype) -> str:
        """The weight format's label (model/formats.py), read off the weights themselves."""
        minimums = [(k, v) for k, v in state.items() if k.endswith(MIN_SUFFIX)]
        if minimums:
            name, minimum = minimums[0]
            return f"q4/g{state[base_name(name)].shape[1] * 2 // minimum.shape[1]}"
        if any(k.endswith(SCALE_SUFFIX) for k in state):
            return "int8"
        return "bf16" if dtype == torch.bfloat16 else "fp32"

    @staticmethod
    def _load_layer(layer: torch.nn.Module, layer_state: dict[str, torch.Tensor], dtype: torch.dtype,
                    types: dict[str, str] | None = None, device: torch.device = CPU) -> None:
        """Give `layer` (built on the meta device) its weights: each quantized matrix
        becomes its format's kernel module (a GGUF matrix, named in `types`, its ggml
        type's), the rest is assigned as `dtype`."""
        types = types or {}
        quantized = sorted({base_name(k) for k in layer_state if k.endswith(SCALE_SUFFIX)} | set(types))
        parts = {name: matrix_parts(layer_state, name) for name in quantized}
        for name, matrix in parts.items():
            shape = layer.get_submodule(name.removesuffix(".weight")).weight.shape
            if name in types:
                check_gguf_rows(name, matrix.get(""), types[name], shape)
            else:
                check_parts(name, matrix, shape)
            for suffix in matrix:
                del layer_state[name + suffix]
        # Biases of quantized products (Qwen2's q, k, v) go with their kernel module.
        biases = {name: layer_state.pop(bias) for name in quantized
                  if (bias := name.removesuffix(".weight") + ".bias") in layer_state}
        for fused, members in FUSED.items():
            # A quantized layer's products that share an input run as one: their rows
            # (each with its own scales) stacked, so one kernel call reads them all.
            names = [f"{member}.weight" for member in members]
            if all(name in parts for name in names) and same_layout([parts[name] for name in names]) and len(
                    {types.get(name) for name in names}) == 1:  # GGUF rows stack within one type
                bias = None
                if any(name in biases for name in names):
                    bias = torch.cat([biases.pop(name) if name in biases else torch.zeros(parts[name][""].shape[0])
                                      for name in names])
                layer.set_submodule(fused, kernels.linear(stack_rows([parts.pop(name) for name in names]), device,
                                                          bias=bias, gguf_type=types.get(names[0])))
                for member in members:
                    layer.set_submodule(member, torch.nn.Identity())  # its rows live in the fused module
        for name, matrix in parts.items():
            layer.set_submodule(name.removesuffix(".weight"), kernels.linear(matrix, device, bias=biases.pop(name, None),
                                                                             gguf_type=types.get(name)))
        expected = {k for k, v in layer.state_dict().items() if v.device.type == "meta"}
        if set(layer_state) != expected:
            missing, extra = sorted(expected - set(layer_state)), sorted(set(layer_state) - expected)
            raise RuntimeError(f"layer weights do not fit: missing {missing[:4]}, unexpected {extra[:4]}")
        # Where matrices became kernels, the rest (norms) is copied: a tensor read from the
        # block file keeps the file's whole mapping, and with it the stored matrices' pages,
        # resident (an 8B Q4_0 span held its 123 MB a block twice).
        # Dense weights in aligned storage: torch's float32 products round differently for
        # weights that are not 64-byte aligned (seen: 1 ulp off transformers' logits),
        # and a tensor read from a file sits at the file's offset.
        copy = bool(quantized)
        layer.load_state_dict({k: kernels.aligned(v.to(dtype, copy=copy)) for k, v in layer_state.items()},
                              strict=False, assign=True)
        layer.to(device)  # the norms and dense matrices (kernel modules are built there)

    @classmethod
    def load(cls, model_dir: Path, start: int, end: int, dtype=torch.float32, device: str | torch.device = "cpu"
             ) -> SpanRunner:
        config = load_config(model_dir)
        # One rule for the compute dtype, the manifest's (format_from_manifest): a bf16
        # model (every tensor BF16) computes in bf16; anything else in float32.
        gguf_types = None
        if (Path(model_dir) / MANIFEST_FILE).exists():
            fmt = stored_format(model_dir)
            if fmt.name == "bf16":
                dtype = torch.bfloat16
            gguf_types = dict(fmt.types) or None
        else:  # a plain safetensors directory (tests): its dtypes say
            state = read_tensors(model_dir, lambda names: span_tensor_names(names, start, end))
            if state and all(v.dtype == torch.bfloat16 for v in state.values()):
                dtype = torch.bfloat16
            return cls(config, start, end, state, dtype, device=device)

        def one_layer(index: int) -> dict[str, torch.Tensor]:
            return layer_states(read_tensors(model_dir, lambda names: span_tensor_names(names, index, index + 1)))(index)

        return cls(config, start, end, one_layer, dtype, gguf_types, device)

    @classmethod
    def random(cls, model_dir: Path, start: int, end: int, seed: int = 0, device: str | torch.device = "cpu"
               ) -> SpanRunner:
        """The span with freshly initialised weights in the model's weight format: as
        fast as the real ones (the kernels do not care about the values), for
        benchmarking blocks not held."""
        return cls.random_from_config(load_config(model_dir), stored_format(model_dir), start, end, seed, device)

    @classmethod
    def random_from_config(cls, config, fmt: WeightFormat, start: int, end: int, seed: int = 0,
                           device: str | torch.device = "cpu") -> SpanRunner:
        """`random` for a config and format given (a model not stored: bench/gpu.py's 8B shapes)."""
        arch = architecture_of(config)
        generator = torch.Generator().manual_seed(seed)

        def one_layer(index: int) -> dict[str, torch.Tensor]:
            # A layer at a time, a matrix at a time: an 8B-shaped block is 0.9 GB in
            # float32, more than a 4-bit node's whole budget may leave.
            with torch.device("meta"):
                shapes = {k: v.shape for k, v in arch.decoder_layer(config, layer_idx=index).state_dict().items()}
            state = {}
            for name, shape in shapes.items():
                full = f"{LAYER_PREFIX}{index}.{name}"
                if full in types:  # a gguf model: random blocks of the matrix's own type
                    rows = gguf_native.random_rows(types[full], shape[0], shape[1], rng)
                    state[full] = torch.from_numpy(rows)
                    continue
                value = torch.ones(shape) if len(shape) == 1 else torch.empty(shape).normal_(0, 0.02,
                                                                                             generator=generator)
                state |= random_parts(fmt, full, value, generator)
                del value
            return layer_states(state)(index)

        types, rng = dict(fmt.types), np.random.default_rng(seed)
        return cls(config, start, end, one_layer, torch.bfloat16 if fmt.name == "bf16" else torch.float32,
                   types or None, device)

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    def parameter_count(self) -> int:
        """Weights of the span (a quantized matrix counts its elements, not its bytes)."""
        count = 0
        for layer in self.layers.values():
            for module in layer.modules():
                if isinstance(module, (kernels.Int8Linear, kernels.Int4CpuLinear, kernels.GroupedInt4Linear,
                                       kernels.DenseLinear, kernels.CudaInt4Linear)):
                    count += module.in_features * module.out_features
                elif not list(module.children()):
                    count += sum(p.numel() for p in module.parameters(recurse=False))
        return count

    def new_cache(self) -> DynamicCache:
        return new_cache(self.config)

    def forward(self, hidden: torch.Tensor, cache: DynamicCache, position: int,
                start: int | None = None, end: int | None = None, *,
                between_layers: Callable[[], None] | None = None, adapter: Adapter | None = None) -> torch.Tensor:
        """Run layers start..end-1 (default: the whole span) on `hidden` [1, n, H],
        whose first token sits at `position`; appends to `cache`. `between_layers`
        is called before every layer (it may block: the server pauses a long forward
        there while a decode step runs). `adapter`: a LoRA adapter's updates apply."""
        return self.slowed(self._forward, hidden, cache, position, start, end, between_layers, adapter)

    def slowed(self, compute: Callable, *args, **kwargs):
        """`compute(*args, **kwargs)`, taking `slowdown` times as long (fault injection)."""
        if self.slowdown <= 1.0:
            return compute(*args, **kwargs)
        began = time.perf_counter()
        out = compute(*args, **kwargs)
        time.sleep((self.slowdown - 1.0) * (time.perf_counter() - began))
        return out

    @torch.inference_mode()
    def _forward(self, hidden: torch.Tensor, cache: DynamicCache, position: int, start: int | None,
                 end: int | None, between_layers: Callable[[], None] | None, adapter: Adapter | None = None
                 ) -> torch.Tensor:
        start = self.start if start is None else start
        end = self.end if end is None else end
        if not (self.start <= start < end <= self.end):
            raise ValueError(f"sub-span {start}:{end} outside served span {self.start}:{self.end}")
        return run_layers(self, hidden.to(self.dtype), [cache], [position], start, end, between_layers,
                          None if adapter is None else [adapter])

    def cached_length(self, cache: DynamicCache) -> int:
        """Tokens held. A session may run only a suffix of the span, leaving the
        span's first layers empty: take the longest layer."""
        return max(cache.get_seq_length(index) for index in self.layers)

    def truncate(self, cache: DynamicCache, length: int) -> None:
        """Roll the cache back to its first `length` tokens (speculative decoding)."""
        surplus = self.cached_length(cache) - length
        if surplus > 0:
            cache.crop(-surplus)  # transformers 5.x: a negative count of tokens to drop


def check_parts(name: str, parts: dict[str, torch.Tensor], shape: torch.Size) -> None:
    """A quantized matrix's stored parts fit the layer's [out, in] and a format
    (model/formats.py), or loading fails here, before the node advertises the span."""
    out_features, in_features = shape
    q, scale, minimum = parts[""], parts[SCALE_SUFFIX], parts.get(MIN_SUFFIX)
    if minimum is None:
        fits = (q.dtype == torch.int8 and tuple(q.shape) == (out_features, in_features)
                and scale.dtype == torch.float32 and tuple(scale.shape) == (out_features,))
    else:
        groups = scale.shape[1] if scale.dim() == 2 else 0
        fits = (q.dtype == torch.uint8 and tuple(q.shape) == (out_features, in_features // 2) and in_features % 2 == 0
                and groups > 0 and in_features % groups == 0 and in_features // groups in Q4_GROUPS
                and all(t.dtype == torch.float16 and tuple(t.shape) == (out_features, groups)
                        for t in (scale, minimum)))
    if not fits:
        raise ValueError(f"{name}: stored parts {({k: (str(t.dtype), tuple(t.shape)) for k, t in parts.items()})} "
                         f"are no quantized [{out_features}, {in_features}] matrix")


def check_gguf_rows(name: str, raw: torch.Tensor | None, kind: str, shape: torch.Size) -> None:
    """A GGUF matrix's stored rows fit the layer's [out, in]: U8 [out, whole blocks of `kind`]."""
    out_features, in_features = shape
    try:
        expected = (out_features, gguf_native.row_bytes(kind, in_features))
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None
    if raw is None or raw.dtype != torch.uint8 or tuple(raw.shape) != expected:
        found = None if raw is None else (str(raw.dtype), tuple(raw.shape))
        raise ValueError(f"{name}: stored {found} are no {kind} rows of a [{out_features}, {in_features}] matrix")


def same_layout(matrices: list[dict[str, torch.Tensor]]) -> bool:
    """Whether quantized matrices can be stacked into one: the same parts, each with
    the same width (one format, one group size)."""
    return all(m.keys() == matrices[0].keys() and all(t.shape[1:] == matrices[0][k].shape[1:] for k, t in m.items())
               for m in matrices)


def load_full_model(model_dir: Path, dtype=torch.float32):
    """The whole model as one transformers model - the single-process reference that
    tests and benchmarks compare the swarm with. `from_pretrained` cannot read the
    store's layout (one file per block), so the weights are loaded here."""
    from transformers import AutoModelForCausalLM

    config = load_config(model_dir)
    with torch.random.fork_rng():  # initialising the skeleton must not move sampling's RNG
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    state = read_dense_tensors(model_dir, lambda names: names)  # a quantized model dequantized
    state = stack_model_experts(state, architecture_of(config).family.experts)
    if "lm_head.weight" not in state:  # tied embeddings (SmolLM2)
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True)
    return model.eval()
