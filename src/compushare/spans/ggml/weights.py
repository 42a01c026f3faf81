"""A span's weights in ggml backend buffers, as stored in the GGUF file.

Matrices keep their file's type (Q4_K, Q6_K, Q8_0, ...): ggml computes every type as
stored. A matrix goes to the CPU backend's repacking buffer (CPU_REPACK) where the
backend says a product with it runs there, as llama.cpp decides it: the weights
are rearranged at load for the CPU's SIMD; the rest go to plain CPU buffers.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable

import numpy as np

from ...model import gguf_native
from .lib import cpu_device, cpu_extra_buffer_types, ggml

TENSOR_OVERHEAD = ggml.ggml_tensor_overhead()


def ggml_type(name: str) -> int:
    value = getattr(ggml, f"GGML_TYPE_{name}", None)
    if value is None:
        raise ValueError(f"ggml has no type {name!r}")
    return value


class Context:
    """A ggml context holding tensor descriptions only (no_alloc): the data lives in
    backend buffers."""

    def __init__(self, tensors: int) -> None:
        params = ggml.ggml_init_params(mem_size=TENSOR_OVERHEAD * max(tensors, 1) + 1024, mem_buffer=None,
                                       no_alloc=True)
        self.ctx = ggml.ggml_init(params)
        if not self.ctx:
            raise MemoryError("ggml_init failed")

    @classmethod
    def for_graph(cls, nodes: int) -> Context:
        """A context with room for a graph of `nodes` nodes and their tensors."""
        context = cls.__new__(cls)
        context.ctx = ggml.ggml_init(ggml.ggml_init_params(
            mem_size=TENSOR_OVERHEAD * (nodes + 16) + ggml.ggml_graph_overhead_custom(nodes, False),
            mem_buffer=None, no_alloc=True))
        if not context.ctx:
            raise MemoryError("ggml_init failed")
        return context

    def free(self) -> None:
        if self.ctx:
            ggml.ggml_free(self.ctx)
            self.ctx = None


def _repack_supported(buft: int, kind: int, shape: tuple[int, ...]) -> bool:
    """Would a product with a weight of this type and shape, held in `buft`, run on
    the CPU device? (llama.cpp's weight_buft_supported: a zero-sized buffer of the
    type stands in for the weight's.) A stack of experts [in, out, experts] is asked
    about the product that reads it, mul_mat_id."""
    scratch = Context(5)
    try:
        if len(shape) == 3:
            weight = ggml.ggml_new_tensor_3d(scratch.ctx, kind, *shape)
            x = ggml.ggml_new_tensor_3d(scratch.ctx, ggml.GGML_TYPE_F32, shape[0], 1, 1)
            ids = ggml.ggml_new_tensor_2d(scratch.ctx, ggml.GGML_TYPE_I32, 1, 1)
            product = ggml.ggml_mul_mat_id(scratch.ctx, weight, x, ids)
        else:
            weight = ggml.ggml_new_tensor_2d(scratch.ctx, kind, shape[0], shape[1])
            x = ggml.ggml_new_tensor_2d(scratch.ctx, ggml.GGML_TYPE_F32, shape[0], 1)
            product = ggml.ggml_mul_mat(scratch.ctx, weight, x)
        buffer = ggml.ggml_backend_buft_alloc_buffer(buft, 0)
        try:
            weight.contents.buffer = buffer
            return bool(ggml.ggml_backend_dev_supports_op(cpu_device(), product))
        finally:
            weight.contents.buffer = None
            ggml.ggml_backend_buffer_free(buffer)
    finally:
        scratch.free()


class Weights:
    """Named ggml tensors in backend buffers, allocated from their specs (name, numpy
    shape as stored, ggml type), then filled one at a time (`set`): a span is read a
    layer at a time, so loading holds one layer's arrays beside the buffers, never the
    span twice. 2-D tensors are raw GGUF rows (uint8 [out, row bytes]); 1-D ones
    float32 vectors."""

    def __init__(self, specs: Iterable[tuple[str, tuple[int, ...], str]], *, repack: bool = True) -> None:
        extra = cpu_extra_buffer_types().get("CPU_REPACK") if repack else None
        self.tensors: dict[str, ctypes._Pointer] = {}
        self.repacked: list[str] = []
        groups: dict[str, list[tuple[str, tuple[int, ...], str]]] = {"repack": [], "plain": []}
        for name, stored, kind in specs:
            shape = ggml_shape(stored, kind)
            use_repack = (extra is not None and len(shape) in (2, 3)
                          and _repack_supported(extra, ggml_type(kind), shape))
            groups["repack" if use_repack else "plain"].append((name, shape, kind))
        self._contexts: list[Context] = []
        self._buffers: list[int] = []
        self.nbytes = 0
        try:
            for group, members in groups.items():
                if members:
                    self._allocate(group, members, extra)
        except BaseException:
            self.free()
            raise
        self.repacked = [name for name, _shape, _kind in groups["repack"]]
        self.filled: set[str] = set()

    def _allocate(self, group: str, members: list, extra) -> None:
        context = Context(len(members))
        self._contexts.append(context)
        for name, shape, kind in members:
            if len(shape) == 3:
                tensor = ggml.ggml_new_tensor_3d(context.ctx, ggml_type(kind), *shape)
            elif len(shape) == 2:
                tensor = ggml.ggml_new_tensor_2d(context.ctx, ggml_type(kind), shape[0], shape[1])
            else:
                tensor = ggml.ggml_new_tensor_1d(context.ctx, ggml_type(kind), shape[0])
            ggml.ggml_set_name(tensor, name.encode()[:63])
            self.tensors[name] = tensor
        buft = extra if group == "repack" else ggml.ggml_backend_cpu_buffer_type()
        buffer = ggml.ggml_backend_alloc_ctx_tensors_from_buft(context.ctx, buft)
        if not buffer:
            raise MemoryError(f"could not allocate a {group} weight buffer")
        ggml.ggml_backend_buffer_set_usage(buffer, ggml.GGML_BACKEND_BUFFER_USAGE_WEIGHTS)
        self._buffers.append(buffer)
        self.nbytes += ggml.ggml_backend_buffer_get_size(buffer)

    def set(self, name: str, array: np.ndarray) -> None:
        """Fill tensor `name` (a repacking buffer rearranges the rows here)."""
        tensor = self.tensors.get(name)
        if tensor is None:
            raise ValueError(f"{name}: no such tensor in the span")
        data = np.ascontiguousarray(array)
        if data.nbytes != ggml.ggml_nbytes(tensor):
            raise ValueError(f"{name}: {data.nbytes} bytes for a tensor of {ggml.ggml_nbytes(tensor)}")
        ggml.ggml_backend_tensor_set(tensor, data.ctypes.data, 0, data.nbytes)
        self.filled.add(name)

    def missing(self) -> list[str]:
        return sorted(set(self.tensors) - self.filled)

    def __getitem__(self, name: str):
        return self.tensors[name]

    def get(self, name: str):
        return self.tensors.get(name)

    def lora(self, projection: str):
        """No adapter's factors here (adapter.AdaptedWeights has them)."""
        return None

    def free(self) -> None:
        for buffer in self._buffers:
            ggml.ggml_backend_buffer_free(buffer)
        for context in self._contexts:
            context.free()
        self._buffers, self._contexts, self.tensors = [], [], {}


def filled_weights(entries: Iterable[tuple[str, np.ndarray, str]], *, repack: bool = True) -> Weights:
    """Weights from arrays at hand (a head's few tensors)."""
    entries = list(entries)
    weights = Weights([(name, array.shape, kind) for name, array, kind in entries], repack=repack)
    for name, array, _kind in entries:
        weights.set(name, array)
    return weights


def ggml_shape(stored: tuple[int, ...], kind: str) -> tuple[int, ...]:
    """ggml's ne (innermost first) of a tensor stored as `stored`: a matrix's raw rows
    [out, row bytes] are (in_features, out_features), a stack of experts' [experts,
    out, row bytes] (in_features, out_features, experts); a vector keeps its length."""
    if len(stored) >= 2:
        return (gguf_native.in_features_of(kind, stored[-1]), *reversed(stored[:-1]))
    return (stored[0],)
