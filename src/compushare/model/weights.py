"""Reading selected tensors from a model's safetensors files (torch and safetensors
only: the consumer's head loads through here without transformers' modeling code)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from . import gguf_native
from .layout import tensor_files


def read_dense_tensors(model_dir: Path, names_filter, files: list[str] | None = None) -> dict[str, torch.Tensor]:
    """Like read_tensors, in float values whatever the format: `names_filter` sees the
    matrices' own names (not their "_scale" / "_min" parts), and a quantized matrix is
    dequantized to float32 (what private mode's encrypted products and the transformers
    reference compute with)."""
    from .formats import SCALE_SUFFIX, base_name
    from .quantize import dequantize, matrix_parts

    def wanted(names):
        chosen = set(names_filter(sorted({base_name(n) for n in names})))
        return [n for n in names if base_name(n) in chosen]

    raw = read_tensors(model_dir, wanted, files)
    out = {name: tensor for name, tensor in raw.items() if base_name(name) == name and name + SCALE_SUFFIX not in raw}
    for name in {base_name(n) for n in raw if n.endswith(SCALE_SUFFIX)}:
        out[name] = dequantize({k: v for k, v in matrix_parts(raw, name).items()})
    for name, kind in gguf_types(model_dir).items():  # a GGUF's raw blocks, as gguf-py dequantizes them
        if name in out:
            out[name] = torch.from_numpy(gguf_native.dequantize(out[name].numpy(), kind))
    return out


def gguf_types(model_dir: Path) -> dict[str, str]:
    """{matrix name: ggml type} of a gguf model (its manifest's); {} for any other."""
    from .manifest import parse

    path = Path(model_dir) / "manifest.json"
    return dict(parse(path.read_bytes()).format.types) if path.exists() else {}


def read_tensors(model_dir: Path, names_filter, files: list[str] | None = None) -> dict[str, torch.Tensor]:
    """Read only the tensors selected by `names_filter(all_names)` from safetensors files:
    `files` (names in `model_dir`), or every one holding its tensors once (a stored
    model's but its norms file, copies of block files' tensors that private mode's
    consumer reads by name: layout.tensor_files)."""
    out: dict[str, torch.Tensor] = {}
    paths = [Path(model_dir) / name for name in files] if files is not None else tensor_files(model_dir)
    for path in paths:
        with safe_open(str(path), framework="pt") as handle:
            for name in names_filter(list(handle.keys())):
                out[name] = handle.get_tensor(name)
    return out
