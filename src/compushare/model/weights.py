"""Reading selected tensors from a model's safetensors files (torch and safetensors
only: the consumer's head loads through here without transformers' modeling code)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open


def read_tensors(model_dir: Path, names_filter) -> dict[str, torch.Tensor]:
    """Read only the tensors selected by `names_filter(all_names)` from safetensors files."""
    out: dict[str, torch.Tensor] = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            for name in names_filter(list(handle.keys())):
                out[name] = handle.get_tensor(name)
    return out
