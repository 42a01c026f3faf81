"""A stored GGUF model's span onto ggml, a layer's tensors at a time."""

from __future__ import annotations

from pathlib import Path

from ...model.arch import load_config
from ...model.blocks import layer_states, span_tensor_names, stored_format
from ...model.weights import read_tensors
from .span import GgmlSpan


def load_ggml_span(model_dir: Path, start: int, end: int, *, threads: int = 1, config=None) -> GgmlSpan:
    """`config`: the model's own unless given (tests give one that lies)."""
    config = config if config is not None else load_config(model_dir)
    types = dict(stored_format(model_dir).types)

    def one_layer(index: int):
        state = read_tensors(model_dir, lambda names: span_tensor_names(names, index, index + 1))
        return {name: tensor.numpy() for name, tensor in layer_states(state)(index).items()}

    return GgmlSpan(config, start, end, one_layer, types, threads=threads)
