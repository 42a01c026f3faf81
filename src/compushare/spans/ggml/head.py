"""The consumer's LM head on ggml: the final RMS norm and the product with the output
matrix in the file's own type, as llama.cpp computes them (so a consumer holds its
head at the file's bytes: a 128k-vocabulary Q6_K head stays 6.6 bits a weight)."""

from __future__ import annotations

import collections
import threading

import numpy as np

from .lib import ggml
from .graph import rms
from .span import _input, _set
from .weights import Context, filled_weights

GRAPH_NODES = 16
MAX_GRAPHS = 4  # graphs kept, by rows (1 for a decode step, k + 1 for a verify pass)


def _free(context: Context, allocator) -> None:
    ggml.ggml_gallocr_free(allocator)
    context.free()


class GgmlHead:
    def __init__(self, matrix: np.ndarray, kind: str, norm: np.ndarray, eps: float, *, threads: int = 1,
                 norm_plus_one: bool = False, softcap: float | None = None) -> None:
        self.softcap = softcap  # Gemma 2: logits soft-capped here, as llama.cpp does
        weight = norm.astype(np.float32) + np.float32(1.0 if norm_plus_one else 0.0)  # Gemma's (1 + w), as its file holds it
        self.weights = filled_weights([("output.weight", matrix, kind), ("output_norm.weight", weight, "F32")])
        self.vocab = int(self.weights["output.weight"].contents.ne[1])
        self.hidden = int(self.weights["output.weight"].contents.ne[0])
        self.eps = eps
        self.backend = ggml.ggml_backend_cpu_init()
        ggml.ggml_backend_cpu_set_n_threads(self.backend, threads)
        self._graphs: collections.OrderedDict[int, tuple] = collections.OrderedDict()  # by rows, least recent first
        self._lock = threading.Lock()

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        """float32 [n, vocab] for hidden states float32 [n, H]."""
        hidden = np.ascontiguousarray(hidden, dtype=np.float32)
        rows = hidden.shape[0]
        with self._lock:
            if rows not in self._graphs:
                while len(self._graphs) >= MAX_GRAPHS:
                    _free(*self._graphs.popitem(last=False)[1][:2])
                self._graphs[rows] = self._build(rows)
            self._graphs.move_to_end(rows)
            _context, _allocator, graph, x, out = self._graphs[rows]
            _set(x, hidden)
            status = ggml.ggml_backend_graph_compute(self.backend, graph)
            if status != ggml.GGML_STATUS_SUCCESS:
                raise RuntimeError(f"ggml graph compute failed with status {status}")
            logits = np.empty((rows, self.vocab), dtype=np.float32)
            ggml.ggml_backend_tensor_get(out, logits.ctypes.data, 0, logits.nbytes)
        return logits

    def _build(self, rows: int):
        context = Context.for_graph(GRAPH_NODES)
        ctx = context.ctx
        graph = ggml.ggml_new_graph_custom(ctx, GRAPH_NODES, False)
        x = _input(ctx, ggml.GGML_TYPE_F32, self.hidden, rows)
        out = ggml.ggml_mul_mat(ctx, self.weights["output.weight"],
                                rms(ctx, x, self.weights["output_norm.weight"], self.eps))
        if self.softcap:  # Gemma 2's final soft-capping, in llama.cpp's order of ops
            out = ggml.ggml_scale(ctx, ggml.ggml_tanh(ctx, ggml.ggml_scale(ctx, out, float(
                np.float32(1.0) / np.float32(self.softcap)))), self.softcap)
        ggml.ggml_set_output(out)
        ggml.ggml_build_forward_expand(graph, out)
        allocator = ggml.ggml_gallocr_new(ggml.ggml_backend_cpu_buffer_type())  # its own: see span._Graph
        if not ggml.ggml_gallocr_alloc_graph(allocator, graph):
            _free(context, allocator)
            raise MemoryError("ggml could not allocate the head's graph")
        return context, allocator, graph, x, out

    def close(self) -> None:
        with self._lock:
            for context, allocator, *_ in self._graphs.values():
                _free(context, allocator)
            self._graphs.clear()
        if self.backend:
            ggml.ggml_backend_free(self.backend)
            self.backend = None
        self.weights.free()


def lm_head_on_ggml(matrix, kind: str, norm, spec) -> GgmlHead:
    """model.head.ConsumerHead's `lm_head` factory: the GGUF's head on ggml, with the
    threads torch computes with in this process (an 8B head reads 0.4 GB a token)."""
    import torch

    return GgmlHead(matrix.numpy(), kind, norm.float().numpy(), spec.rms_norm_eps, norm_plus_one=spec.norm_plus_one,
                    softcap=spec.final_softcap, threads=torch.get_num_threads())
