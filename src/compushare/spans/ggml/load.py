"""A stored GGUF model's span onto ggml: the tensors' shapes from the block files'
headers first (the buffers are allocated once), then one tensor at a time."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from safetensors import safe_open

from ...model import gguf_native
from ...model.arch import config_fields
from ...model.manifest import parse
from ...model.store import MANIFEST_FILE
from ...model.store import span_tensor_names, stored_format
from ...model.layout import tensor_files
from .span import GgmlSpan


def stored_shapes(model_dir: Path, start: int, end: int) -> dict[str, tuple[int, ...]]:
    """{name: shape} of blocks start:end's tensors, read from the files' headers only."""
    shapes: dict[str, tuple[int, ...]] = {}
    for path in tensor_files(model_dir):
        with safe_open(str(path), framework="numpy") as handle:
            for name in span_tensor_names(list(handle.keys()), start, end):
                shapes[name] = tuple(handle.get_slice(name).get_shape())
    return shapes


NUMPY_DTYPES = {"U8": np.uint8, "F32": np.float32}  # what a gguf model's block files hold


def load_ggml_span(model_dir: Path, start: int, end: int, *, threads: int = 1, config=None) -> GgmlSpan:
    """`config`: the model's own unless given (tests give one that lies)."""
    config = config if config is not None else config_fields(model_dir)
    types = dict(stored_format(model_dir).types)
    manifest = parse((Path(model_dir) / MANIFEST_FILE).read_bytes())

    def one_layer(index: int):
        # A tensor at a time, read straight into one array from the byte range the
        # manifest gives (safetensors' reader holds a tensor twice: an MoE's expert stack
        # is 141 MB), so what loading holds beyond the span is one matrix.
        prefix = f"model.layers.{index}."
        for entry in manifest.files:
            if entry.role != "block" or entry.block != index:
                continue
            for name in span_tensor_names(list(entry.tensors), index, index + 1):
                tensor = entry.tensors[name]
                raw = gguf_native.read_rows(Path(model_dir) / entry.name, tensor.begin, (tensor.end - tensor.begin,))
                yield name[len(prefix):], raw.view(NUMPY_DTYPES[tensor.dtype]).reshape(tensor.shape)

    span = GgmlSpan(config, start, end, one_layer, types, stored_shapes(model_dir, start, end), threads=threads)
    span.model_dir = Path(model_dir)  # training builds its layers on torch from there (model/span_training.py)
    return span


def random_ggml_span(model_dir: Path, start: int, end: int, *, threads: int = 1, seed: int = 0) -> GgmlSpan:
    """Blocks start:end with random weights of the model's types and shapes (from its
    manifest: the node may hold no block yet), as fast as the real ones: the
    self-benchmark's span when the node serves on ggml."""
    config = config_fields(model_dir)
    types = dict(stored_format(model_dir).types)
    manifest = parse((Path(model_dir) / MANIFEST_FILE).read_bytes())
    shapes = {name: tensor.shape for entry in manifest.files if entry.role == "block"
              for name, tensor in entry.tensors.items()}
    shapes = {name: shapes[name] for name in span_tensor_names(list(shapes), start, end)}
    rng = np.random.default_rng(seed)

    def one_layer(index: int):
        prefix = f"model.layers.{index}."
        for name, shape in shapes.items():
            if name.startswith(prefix):
                kind = types.get(name)
                yield name[len(prefix):], (
                    gguf_native.random_rows(kind, int(np.prod(shape[:-1])), gguf_native.in_features_of(kind, shape[-1]),
                                            rng).reshape(shape)
                    if kind else np.ones(shape, dtype=np.float32))

    return GgmlSpan(config, start, end, one_layer, types, shapes, threads=threads)
