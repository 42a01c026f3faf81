"""GgmlSpan: a contiguous span of decoder layers computed by ggml, as llama.cpp does.

Each layer's graph is llama.cpp's (spans/ggml/graph.py), its family's differences
read off the config (recipe.py). Weights keep the file's types, in the file's own row
order: llama.cpp's converter permutes a Llama's q/k rows for its "normal" rope, our
store keeps transformers' order, so those rows are permuted back at load; Gemma's
norms are held as 1 + w, as the file holds them. The KV cache is float16, values
untransposed, as llama.cpp's with flash attention (its default on CPU); new keys and
values are written by slot (`ggml_set_rows`), and attention reads the cache through
float16 causal masks, one per sliding window in the span.

A graph is kept per (layers, tokens, cache view length, cache): positions, slots and
the mask are its input tensors, so a decode step reuses its graph while the cache's
padded length stays the same (KV_PAD tokens, as llama.cpp pads).
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import itertools
import threading
import time
from collections.abc import Callable, Iterable

import numpy as np
import torch

from ...errors import UsageError
from ...model.gguf_native import permute
from .adapter import AdaptedWeights, KeptAdapters
from .graph import Inputs, layer
from .lib import build_id, ggml
from .recipe import ROPE_NORMAL, recipe_of
from .weights import Context, Weights

KV_PAD = 256  # the cache view grows by this many tokens (llama.cpp's padding with flash attention)
GRAPH_NODES = 96  # graph nodes per layer at most (a dense layer uses ~30, an MoE one ~45 + its top-k)
MAX_GRAPHS = 8  # built graphs kept (each with its compute buffer), least recently used dropped first
MAX_ADAPTERS = 4  # sessions' adapters kept uploaded (with their graphs), least recently used dropped first
# Only graphs of this many tokens at most are kept: decode steps and verify passes,
# which repeat. A prompt's graph is built, run and freed (its compute buffer grows
# with its tokens: an 8B layer's for 2,048 tokens is hundreds of MB).
KEPT_GRAPH_TOKENS = 16


_SERIALS = itertools.count()


class KVCache:
    """One session's keys and values for the span's layers: float16 [kv_dim, capacity]
    per layer (a token's keys are one row), grown by KV_PAD tokens at a time."""

    def __init__(self, span: GgmlSpan) -> None:
        self.span, self.length, self.capacity = span, 0, 0
        self.k: dict[int, ctypes._Pointer] = {}
        self.v: dict[int, ctypes._Pointer] = {}
        self._context: Context | None = None
        self._buffer = None
        self.generation = 0  # changes when the tensors are reallocated: graphs keyed on it
        self.serial = next(_SERIALS)  # never reused, unlike id(): a graph over a dead cache never matches

    def reserve(self, tokens: int) -> None:
        if tokens <= self.capacity:
            return
        capacity = -(-tokens // KV_PAD) * KV_PAD
        layers = range(self.span.start, self.span.end)
        context = Context(2 * len(layers))
        k, v = {}, {}
        for index in layers:
            k[index] = ggml.ggml_new_tensor_2d(context.ctx, ggml.GGML_TYPE_F16, self.span.recipe.kv_dim, capacity)
            v[index] = ggml.ggml_new_tensor_2d(context.ctx, ggml.GGML_TYPE_F16, self.span.recipe.kv_dim, capacity)
        buffer = ggml.ggml_backend_alloc_ctx_tensors_from_buft(context.ctx, ggml.ggml_backend_cpu_buffer_type())
        if not buffer:
            context.free()
            raise MemoryError(f"could not allocate a KV cache of {capacity} tokens")
        ggml.ggml_backend_buffer_clear(buffer, 0)
        if self.length:  # rows are tokens: the old cache's first rows, copied as they are
            row = self.span.recipe.kv_dim * 2
            scratch = np.empty(self.length * row, dtype=np.uint8)
            for index in layers:
                for old, new in ((self.k[index], k[index]), (self.v[index], v[index])):
                    ggml.ggml_backend_tensor_get(old, scratch.ctypes.data, 0, scratch.nbytes)
                    ggml.ggml_backend_tensor_set(new, scratch.ctypes.data, 0, scratch.nbytes)
        self.free()
        self.k, self.v, self._context, self._buffer, self.capacity = k, v, context, buffer, capacity
        self.generation += 1
        self.span.forget_graphs(self)

    @property
    def nbytes(self) -> int:
        return ggml.ggml_backend_buffer_get_size(self._buffer) if self._buffer else 0

    def free(self) -> None:
        if self._buffer:
            ggml.ggml_backend_buffer_free(self._buffer)
            self._buffer = None
        if self._context is not None:
            self._context.free()
            self._context = None

    def __del__(self) -> None:
        self.free()


@dataclasses.dataclass
class _Graph:
    """A built graph with its own compute buffer: an allocator laying out another graph
    would leave this one's tensors pointing into freed memory."""
    context: Context
    allocator: object
    graph: object
    x: object
    inputs: Inputs
    out: object
    layers: list[str]  # the prefixes of the layers it runs

    def free(self) -> None:
        if self.allocator:
            ggml.ggml_gallocr_free(self.allocator)
            self.allocator = None
        self.context.free()


class GgmlSpan:
    """Layers start..end-1 of a model on ggml's CPU backend. Synchronous: callers run
    it in a worker thread; one forward at a time (a lock)."""

    runtime = "ggml"
    dtype = torch.float32  # what it takes and answers in (its weights keep their file's types)
    device = torch.device("cpu")

    def __init__(self, config, start: int, end: int, layer_state: Callable[[int], Iterable[tuple[str, np.ndarray]]],
                 types: dict[str, str], shapes: dict[str, tuple[int, ...]], *, threads: int = 1,
                 repack: bool = True) -> None:
        """`shapes`: every tensor of the span, as stored (numpy shapes, full names);
        `layer_state(index)`: that layer's (name in the layer, array) pairs, read one at
        a time as they are filled in (what loading holds beyond the buffers is one
        tensor: a 48 MB matrix of an 8B model, not its 223 MB layer)."""
        if not (0 <= start < end <= config.num_hidden_layers):
            raise ValueError(f"span {start}:{end} outside 0:{config.num_hidden_layers}")
        self.config, self.start, self.end = config, start, end
        self.recipe = recipe_of(config)
        self.family = self.recipe.family
        specs = [(name, tuple(shape), types.get(name, "F32")) for name, shape in shapes.items()]
        factors = {rope.factors for rope in self.recipe.ropes[start:end]} - {None}
        if factors:
            (values,) = factors
            specs.append(("rope_freqs.weight", (len(values),), "F32"))
        self.weights = Weights(specs, repack=repack)
        try:
            self._check_shapes()
            for index in range(start, end):  # a layer read, filled in, let go
                for name, array in self._stored(index, layer_state(index)):
                    self.weights.set(name, array)
            if factors:
                self.weights.set("rope_freqs.weight", np.asarray(values, dtype=np.float32))
            if self.weights.missing():
                raise ValueError(f"no data for {self.weights.missing()[:4]}")
        except BaseException:
            self.weights.free()
            raise
        self.weight_bytes = self.weights.nbytes
        self.reads = WeightReads.of(self.weights)
        self.format_label = "gguf"
        self.backend = ggml.ggml_backend_cpu_init()
        if not self.backend:
            raise RuntimeError("ggml_backend_cpu_init failed")
        self.threads = threads
        ggml.ggml_backend_cpu_set_n_threads(self.backend, threads)
        self._graphs: collections.OrderedDict[tuple, _Graph] = collections.OrderedDict()  # least recent first
        self._adapters = KeptAdapters(  # sessions' adapters uploaded, with the graphs over them
            MAX_ADAPTERS, lambda a: AdaptedWeights(self.weights, a, self.recipe, start, end),
            lambda key: self._forget(lambda graph_key: graph_key[6] == key))
        self._lock = threading.Lock()
        self.slowdown = 1.0
        self.batchable = False

    # -- what the server asks of a span ------------------------------------------------

    def _check_shapes(self) -> None:
        """Every matrix the graph multiplies is the shape the config says (ggml would
        abort the process on a product of mismatched shapes: a model's config and its
        tensors come from whoever published it)."""
        r = self.recipe
        q, kv, ff = r.heads * r.head_dim, r.kv_dim, None
        expected = {"self_attn.o_proj": (q, r.hidden)}
        if r.fused:
            expected |= {"self_attn.qkv_proj": (r.hidden, q + 2 * kv)}
        else:
            expected |= {"self_attn.q_proj": (r.hidden, q), "self_attn.k_proj": (r.hidden, kv),
                         "self_attn.v_proj": (r.hidden, kv)}
        for index in range(self.start, self.end):
            p = f"model.layers.{index}."
            for name, shape in expected.items():
                _expect(self.weights.get(p + name + ".weight"), shape, p + name)
            if r.experts:
                check_experts(self.weights, r, p)
                continue
            down = self.weights.get(p + "mlp.down_proj.weight")
            _expect(down, (down.contents.ne[0] if down else 0, r.hidden), p + "mlp.down_proj")
            ff = down.contents.ne[0]
            for name in ("mlp.gate_up_proj",) if r.fused else ("mlp.gate_proj", "mlp.up_proj"):
                _expect(self.weights.get(p + name + ".weight"), (r.hidden, 2 * ff if r.fused else ff), p + name)

    def _stored(self, index: int, state: Iterable[tuple[str, np.ndarray]]):
        """(full name, array) of layer `index`'s tensors as the file held them."""
        r = self.recipe
        for name, array in state:
            if r.rope_mode == ROPE_NORMAL and name in ("self_attn.q_proj.weight", "self_attn.k_proj.weight"):
                array = permute(array, r.heads if "q_proj" in name else r.kv_heads)
            if r.norm_plus_one and name.endswith("norm.weight"):
                array = array.astype(np.float32) + np.float32(1.0)
            yield f"model.layers.{index}.{name}", array

    @property
    def hidden_size(self) -> int:
        return self.recipe.hidden

    @property
    def build(self) -> str:
        """The runtime and its build, as ads name it (lib.build_id)."""
        return build_id()

    def parameter_count(self) -> int:
        return sum(ggml.ggml_nelements(t) for t in self.weights.tensors.values())

    def new_cache(self) -> KVCache:
        return KVCache(self)

    def cached_length(self, cache: KVCache) -> int:
        return cache.length

    def truncate(self, cache: KVCache, length: int) -> None:
        """Roll back to the first `length` tokens: later slots are overwritten and masked."""
        cache.length = min(cache.length, length)

    def forward(self, hidden, cache: KVCache, position: int, start: int | None = None, end: int | None = None, *,
                between_layers: Callable[[], None] | None = None, adapter=None):
        """Layers start..end-1 (default: the span) on `hidden` [1, n, H] (a torch
        tensor, as the torch runtime takes) whose first token sits at `position`;
        appends to `cache`; returns float32 [1, n, H]. With `between_layers`, a
        prompt of several tokens runs a graph per layer and the callback runs before
        each, outside the span's lock (a paused prompt lets a decode step through).
        `adapter`: a LoRA adapter (model/lora.py) applied to its projections (adapter.py)."""
        out = self.slowed(self._forward, hidden[0].detach().to(torch.float32).numpy(), cache, position, start, end,
                          between_layers, adapter)
        return torch.from_numpy(out).unsqueeze(0)

    def slowed(self, compute: Callable, *args, **kwargs):
        """`compute(*args, **kwargs)`, taking `slowdown` times as long (fault injection, as the torch runtime's)."""
        if self.slowdown <= 1.0:
            return compute(*args, **kwargs)
        began = time.perf_counter()
        out = compute(*args, **kwargs)
        time.sleep((self.slowdown - 1.0) * (time.perf_counter() - began))
        return out

    def _forward(self, hidden: np.ndarray, cache: KVCache, position: int, start: int | None, end: int | None,
                 between_layers: Callable[[], None] | None, adapter=None) -> np.ndarray:
        start = self.start if start is None else start
        end = self.end if end is None else end
        if not (self.start <= start < end <= self.end):
            raise ValueError(f"sub-span {start}:{end} outside served span {self.start}:{self.end}")
        hidden = np.ascontiguousarray(hidden, dtype=np.float32)
        tokens = hidden.shape[0]
        if hidden.ndim != 2 or hidden.shape[1] != self.recipe.hidden or tokens == 0:
            raise ValueError(f"hidden states of shape {hidden.shape}, not [tokens, {self.recipe.hidden}]")
        if position > cache.length:
            raise ValueError(f"position {position} is past the cache's {cache.length} tokens")
        with self._lock:
            cache.reserve(position + tokens)
        if between_layers is not None and tokens > 1:
            for index in range(start, end):
                between_layers()
                with self._lock:
                    hidden = self._run(hidden, cache, position, index, index + 1, self._adapters.get(adapter))
        else:
            with self._lock:
                hidden = self._run(hidden, cache, position, start, end, self._adapters.get(adapter))
        cache.length = position + tokens
        return hidden

    def __del__(self) -> None:
        self.close()  # ggml's buffers are C memory: the garbage collector alone would not give them back

    def close(self) -> None:
        if not hasattr(self, "_lock"):  # the constructor failed before there was anything to free
            return
        with self._lock:
            for graph in self._graphs.values():
                graph.free()
            self._graphs.clear()
            self._adapters.free()
        if self.backend:
            ggml.ggml_backend_free(self.backend)
            self.backend = None
        self.weights.free()

    def forget_graphs(self, cache: KVCache) -> None:
        """Drop the graphs over `cache`'s tensors (reallocated or freed). Callers hold the lock."""
        self._forget(lambda key: key[5] == cache.serial)

    def _forget(self, which: Callable[[tuple], bool]) -> None:
        for key in [k for k in self._graphs if which(k)]:
            self._graphs.pop(key).free()

    # -- the graph ---------------------------------------------------------------------

    def _run(self, hidden: np.ndarray, cache: KVCache, position: int, start: int, end: int,
             adapted: AdaptedWeights | None = None) -> np.ndarray:
        tokens = hidden.shape[0]
        n_kv = min(cache.capacity, -(-(position + tokens) // KV_PAD) * KV_PAD)
        key = (start, end, tokens, n_kv, cache.generation, cache.serial, 0 if adapted is None else id(adapted.adapter))
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._build(cache, start, end, tokens, n_kv, adapted)
            if tokens > KEPT_GRAPH_TOKENS:
                try:
                    return self._compute(graph, hidden, position, n_kv)
                finally:
                    graph.free()
            while len(self._graphs) >= MAX_GRAPHS:
                self._graphs.popitem(last=False)[1].free()
            self._graphs[key] = graph
        self._graphs.move_to_end(key)
        return self._compute(graph, hidden, position, n_kv)

    def _compute(self, graph: _Graph, hidden: np.ndarray, position: int, n_kv: int) -> np.ndarray:
        tokens = hidden.shape[0]
        positions = np.arange(position, position + tokens, dtype=np.int32)
        _set(graph.x, hidden)
        _set(graph.inputs.positions, positions)
        _set(graph.inputs.slots, positions.astype(np.int64))
        for window, mask in graph.inputs.masks.items():
            _set(mask, causal_mask(position, tokens, n_kv, window))
        status = ggml.ggml_backend_graph_compute(self.backend, graph.graph)
        if status != ggml.GGML_STATUS_SUCCESS:
            raise RuntimeError(f"ggml graph compute failed with status {status}")
        out = np.empty((tokens, self.recipe.hidden), dtype=np.float32)
        ggml.ggml_backend_tensor_get(graph.out, out.ctypes.data, 0, out.nbytes)
        self.reads.count(graph.layers, graph.inputs.routes, tokens)
        return out

    def _build(self, cache: KVCache, start: int, end: int, tokens: int, n_kv: int,
               adapted: AdaptedWeights | None = None) -> _Graph:
        r = self.recipe
        weights = self.weights if adapted is None else adapted
        nodes = GRAPH_NODES * (end - start) + 64
        context = Context.for_graph(nodes)
        ctx = context.ctx
        graph = ggml.ggml_new_graph_custom(ctx, nodes, False)
        x = _input(ctx, ggml.GGML_TYPE_F32, r.hidden, tokens)
        windows = {r.window_for(index) for index in range(start, end)}
        inputs = Inputs(_input(ctx, ggml.GGML_TYPE_I32, tokens), _input(ctx, ggml.GGML_TYPE_I64, tokens),
                        {window: _input(ctx, ggml.GGML_TYPE_F16, n_kv, tokens) for window in windows}, n_kv, tokens)
        cur = x
        for index in range(start, end):
            cur = layer(ctx, graph, weights, r, index, cur, cache.k[index], cache.v[index], inputs)
        if adapted is not None:
            try:
                adapted.check_applied(start, end)
            except UsageError:
                context.free()
                raise
        ggml.ggml_set_output(cur)
        ggml.ggml_build_forward_expand(graph, cur)
        allocator = ggml.ggml_gallocr_new(ggml.ggml_backend_cpu_buffer_type())
        built = _Graph(context, allocator, graph, x, inputs, cur, [f"model.layers.{i}." for i in range(start, end)])
        if not ggml.ggml_gallocr_alloc_graph(allocator, graph):
            built.free()
            raise MemoryError("ggml could not allocate the span's graph")
        return built


class WeightReads:
    """What the span's forwards read of its weights: every dense tensor of each layer
    run, and of a mixture of experts only the experts some token of the forward chose
    (ggml's mul_mat_id reads an expert once for all the rows routed to it, and skips the
    rest), counted from each forward's routes."""

    def __init__(self, dense: dict[str, int], expert: dict[str, int]) -> None:
        self.dense, self.expert = dense, expert
        self.bytes = 0  # read by every forward so far
        self.tokens = 0  # the tokens those forwards carried
        self.forwards = 0
        self.last = 0  # read by the last forward

    @classmethod
    def of(cls, weights) -> WeightReads:
        """From a span's weights: each layer's dense bytes, and one expert's (a stack's
        bytes over its experts)."""
        dense: dict[str, int] = {}
        expert: dict[str, int] = {}
        for name, tensor in weights.tensors.items():
            if not name.startswith("model.layers."):
                continue
            prefix = name[:name.index(".", len("model.layers.")) + 1]
            size = int(ggml.ggml_nbytes(tensor))
            if ".mlp.experts." in name and not name.endswith("_bias"):
                expert[prefix] = expert.get(prefix, 0) + size // int(tensor.contents.ne[2])
            else:
                dense[prefix] = dense.get(prefix, 0) + size
        return cls(dense, expert)

    def count(self, layers: list[str], routes: list, tokens: int) -> None:
        """One forward through `layers` (prefixes) whose MoE layers chose `routes`."""
        read = sum(self.dense[prefix] for prefix in layers)
        for prefix, selected in routes:
            used, rows = int(selected.contents.ne[0]), int(selected.contents.ne[1])
            chosen = np.empty((rows, used), dtype=np.int32)
            ggml.ggml_backend_tensor_get(selected, chosen.ctypes.data, 0, chosen.nbytes)
            read += len(np.unique(chosen)) * self.expert[prefix]
        self.bytes, self.tokens, self.forwards, self.last = self.bytes + read, self.tokens + tokens, \
            self.forwards + 1, read

    def active_bytes(self, used: int) -> int:
        """Bytes of the span's active parameters: every dense tensor and `used` experts a layer."""
        return sum(self.dense.values()) + used * sum(self.expert.values())


def check_experts(weights, r, p: str) -> None:
    """Layer `p`'s router, expert stacks and biases are the shapes recipe `r` says."""
    count = r.experts.count
    router = "mlp.router" if r.sinks else "mlp.gate"
    _expect(weights.get(p + router + ".weight"), (r.hidden, count), p + router)
    down = weights.get(p + "mlp.experts.down_proj")
    ff = down.contents.ne[0] if down else 0
    _expect(down, (ff, r.hidden, count), p + "mlp.experts.down_proj")
    for name in ("mlp.experts.gate_proj", "mlp.experts.up_proj"):
        _expect(weights.get(p + name), (r.hidden, ff, count), p + name)
    for name, rows in (("gate_proj_bias", ff), ("up_proj_bias", ff), ("down_proj_bias", r.hidden)):
        bias = weights.get(p + "mlp.experts." + name)
        if bias is not None:
            _expect(bias, (rows, count), p + "mlp.experts." + name)


def _expect(tensor, shape: tuple[int, ...], name: str) -> None:
    """`tensor`'s ne is `shape` (and 1 beyond it)."""
    if tensor is None:
        raise ValueError(f"{name}: missing from the span's weights")
    got = tuple(int(tensor.contents.ne[i]) for i in range(4))
    if got != (*shape, *(1,) * (4 - len(shape))):
        said = "x".join(str(n) for n in reversed(shape))
        raise ValueError(f"{name} is {'x'.join(str(n) for n in reversed(got[:len(shape)]))}, not the {said} the config "
                         "says")


def causal_mask(position: int, tokens: int, n_kv: int, window: int | None = None) -> np.ndarray:
    """float16 [tokens, n_kv]: 0 where token position+i may see cache slot j, -inf elsewhere."""
    queries = np.arange(position, position + tokens)[:, None]
    slots = np.arange(n_kv)[None, :]
    visible = slots <= queries
    if window is not None:
        visible &= queries - slots < window
    return np.where(visible, np.float16(0.0), np.float16(-np.inf)).astype(np.float16)


def _input(ctx, kind: int, *shape: int):
    tensor = (ggml.ggml_new_tensor_1d(ctx, kind, shape[0]) if len(shape) == 1
              else ggml.ggml_new_tensor_2d(ctx, kind, shape[0], shape[1]))
    ggml.ggml_set_input(tensor)
    return tensor


def _set(tensor, array: np.ndarray) -> None:
    array = np.ascontiguousarray(array)
    if array.nbytes != ggml.ggml_nbytes(tensor):
        raise ValueError(f"{array.nbytes} bytes for an input of {ggml.ggml_nbytes(tensor)}")
    ggml.ggml_backend_tensor_set(tensor, array.ctypes.data, 0, array.nbytes)
