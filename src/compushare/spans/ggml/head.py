"""The consumer's LM head on ggml: the final RMS norm and the product with the output
matrix in the file's own type, as llama.cpp computes them (so a consumer holds its
head at the file's bytes: a 128k-vocabulary Q6_K head stays 6.6 bits a weight)."""

from __future__ import annotations

import threading

import numpy as np

from .lib import ggml
from .span import _input, _rms, _set
from .weights import TENSOR_OVERHEAD, Context, Weights

GRAPH_NODES = 16


class GgmlHead:
    def __init__(self, matrix: np.ndarray, kind: str, norm: np.ndarray, eps: float, *, threads: int = 1,
                 norm_plus_one: bool = False) -> None:
        weight = norm.astype(np.float32) + (1.0 if norm_plus_one else 0.0)  # Gemma's (1 + w), as its file holds it
        self.weights = Weights([("output.weight", matrix, kind), ("output_norm.weight", weight, "F32")])
        self.vocab = int(self.weights["output.weight"].contents.ne[1])
        self.hidden = int(self.weights["output.weight"].contents.ne[0])
        self.eps = eps
        self.backend = ggml.ggml_backend_cpu_init()
        ggml.ggml_backend_cpu_set_n_threads(self.backend, threads)
        self.allocator = ggml.ggml_gallocr_new(ggml.ggml_backend_cpu_buffer_type())
        self._graphs: dict[int, tuple] = {}
        self._allocated: int | None = None
        self._lock = threading.Lock()

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        """float32 [n, vocab] for hidden states float32 [n, H]."""
        hidden = np.ascontiguousarray(hidden, dtype=np.float32)
        rows = hidden.shape[0]
        with self._lock:
            if rows not in self._graphs:
                self._graphs[rows] = self._build(rows)
            context, graph, x, out = self._graphs[rows]
            if self._allocated != rows:
                if not ggml.ggml_gallocr_alloc_graph(self.allocator, graph):
                    raise MemoryError("ggml could not allocate the head's graph")
                self._allocated = rows
            _set(x, hidden)
            status = ggml.ggml_backend_graph_compute(self.backend, graph)
            if status != ggml.GGML_STATUS_SUCCESS:
                raise RuntimeError(f"ggml graph compute failed with status {status}")
            logits = np.empty((rows, self.vocab), dtype=np.float32)
            ggml.ggml_backend_tensor_get(out, logits.ctypes.data, 0, logits.nbytes)
        return logits

    def _build(self, rows: int):
        context = Context(1)
        ggml.ggml_free(context.ctx)
        context.ctx = ggml.ggml_init(ggml.ggml_init_params(
            mem_size=TENSOR_OVERHEAD * GRAPH_NODES + ggml.ggml_graph_overhead_custom(GRAPH_NODES, False),
            mem_buffer=None, no_alloc=True))
        ctx = context.ctx
        graph = ggml.ggml_new_graph_custom(ctx, GRAPH_NODES, False)
        x = _input(ctx, ggml.GGML_TYPE_F32, self.hidden, rows)
        out = ggml.ggml_mul_mat(ctx, self.weights["output.weight"],
                                _rms(ctx, x, self.weights["output_norm.weight"], self.eps))
        ggml.ggml_set_output(out)
        ggml.ggml_build_forward_expand(graph, out)
        return context, graph, x, out

    def close(self) -> None:
        for context, *_ in self._graphs.values():
            context.free()
        self._graphs = {}
        if self.allocator:
            ggml.ggml_gallocr_free(self.allocator)
            self.allocator = None
        if self.backend:
            ggml.ggml_backend_free(self.backend)
            self.backend = None
        self.weights.free()
