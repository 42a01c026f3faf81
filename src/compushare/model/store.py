"""The on-disk model store: `<data dir>/models/<model id>/` plus `aliases.json`.

A model's id is the SHA-256 of its *description*: the architecture config and, for
every stored tensor, its name, dtype, shape and the SHA-256 of its bytes. Two
differently converted copies of "the same" model therefore get different ids, and
peers never mix them. Names like `smollm2-135m` are only local aliases.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import shutil
import tempfile
from pathlib import Path

from safetensors import safe_open

from ..errors import UsageError

DESCRIPTION_FILE = "description.json"
FORMAT = "compushare-model/1"
# config.json keys that say nothing about the computation.
VOLATILE_CONFIG_KEYS = {"transformers_version", "_name_or_path", "torch_dtype", "dtype", "use_cache"}
COPIED_SUFFIXES = (".json", ".safetensors", ".jinja", ".model", ".txt")


@dataclasses.dataclass(frozen=True)
class StoredModel:
    model_id: str
    path: Path
    description: dict

    @property
    def num_blocks(self) -> int:
        return int(self.description["config"]["num_hidden_layers"])

    @property
    def hidden_size(self) -> int:
        return int(self.description["config"]["hidden_size"])

    @property
    def block_bytes(self) -> int:
        """Bytes of one decoder block's weights (the largest, if they differ)."""
        sizes: dict[str, int] = {}
        for name, tensor in self.description["tensors"].items():
            if name.startswith("model.layers."):
                block = name.split(".")[2]
                itemsize = {"F32": 4, "F16": 2, "BF16": 2}.get(tensor["dtype"], 4)
                sizes[block] = sizes.get(block, 0) + itemsize * math.prod(tensor["shape"])
        return max(sizes.values(), default=0)

    @property
    def dtype(self) -> str:
        dtypes = {t["dtype"] for t in self.description["tensors"].values()}
        return "float32" if dtypes == {"F32"} else "bfloat16" if dtypes == {"BF16"} else "mixed"


def describe(model_dir: Path) -> dict:
    """Hash every tensor's bytes; this is what the model id commits to."""
    config = json.loads((model_dir / "config.json").read_text())
    config = {k: v for k, v in config.items() if k not in VOLATILE_CONFIG_KEYS}
    tensors: dict[str, dict] = {}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise UsageError(f"{model_dir} holds no .safetensors weights")
    import torch  # here, not at the top: `status` and `models list` need no torch

    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                raw = handle.get_tensor(name).contiguous().reshape(-1).view(torch.uint8).numpy()
                sl = handle.get_slice(name)
                tensors[name] = {
                    "dtype": sl.get_dtype(),
                    "shape": list(sl.get_shape()),
                    "sha256": hashlib.sha256(raw).hexdigest(),
                    "file": path.name,
                }
    return {"format": FORMAT, "config": config, "tensors": dict(sorted(tensors.items()))}


def model_id_of(description: dict) -> str:
    canonical = json.dumps(
        {k: v for k, v in description.items() if k != "tensors"}
        | {"tensors": {n: {k: v for k, v in t.items() if k != "file"} for n, t in description["tensors"].items()}},
        sort_keys=True,
        separators=(",", ":"),
    )
    return hashlib.sha256(canonical.encode()).hexdigest()


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


class ModelStore:
    def __init__(self, data_dir: Path) -> None:
        self.root = data_dir / "models"
        self.root.mkdir(parents=True, exist_ok=True)
        self._aliases_path = self.root / "aliases.json"

    def aliases(self) -> dict[str, str]:
        if not self._aliases_path.exists():
            return {}
        return json.loads(self._aliases_path.read_text())

    def set_alias(self, name: str, model_id: str) -> None:
        aliases = self.aliases() | {name: model_id}
        tmp = self._aliases_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(aliases, indent=2, sort_keys=True))
        os.replace(tmp, self._aliases_path)

    def get(self, name_or_id: str) -> StoredModel | None:
        model_id = self.aliases().get(name_or_id, name_or_id)
        path = self.root / model_id
        desc = path / DESCRIPTION_FILE
        if "/" in model_id or not desc.exists():
            return None
        return StoredModel(model_id, path, json.loads(desc.read_text()))

    def list(self) -> list[tuple[list[str], StoredModel]]:
        names: dict[str, list[str]] = {}
        for alias, model_id in self.aliases().items():
            names.setdefault(model_id, []).append(alias)
        out = []
        for desc in sorted(self.root.glob(f"*/{DESCRIPTION_FILE}")):
            model = self.get(desc.parent.name)
            if model:
                out.append((sorted(names.get(model.model_id, [])), model))
        return out

    def import_dir(self, source: Path, alias: str | None = None, description: dict | None = None) -> StoredModel:
        """Import an HF-style directory (config.json + safetensors). Files are hard-linked
        when possible. `description` may be passed when the caller already computed it
        for exactly these files (the shared conversion cache)."""
        source = Path(source)
        if not (source / "config.json").exists():
            raise UsageError(f"{source} has no config.json: not a Hugging Face model directory")
        description = description or describe(source)
        model_id = model_id_of(description)
        target = self.root / model_id
        if not (target / DESCRIPTION_FILE).exists():
            staging = Path(tempfile.mkdtemp(prefix=".import-", dir=self.root))
            for item in source.iterdir():
                if item.is_file() and item.name.endswith(COPIED_SUFFIXES) and item.name != DESCRIPTION_FILE:
                    _link_or_copy(item, staging / item.name)
            (staging / DESCRIPTION_FILE).write_text(json.dumps(description, indent=1, sort_keys=True))
            if target.exists():
                shutil.rmtree(target)
            os.replace(staging, target)
        if alias:
            self.set_alias(alias, model_id)
        return self.get(model_id)
