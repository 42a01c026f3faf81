"""The on-disk model store: `<data dir>/models/<model id>/` plus `aliases.json`.

A model directory holds `manifest.json` (torrent/manifest.py: every file, piece and
tensor of the model), a `config.json` derived from it, and whichever of the
model's files this node holds in full: a provider holds only its span's block
files, a consumer the head, tokenizer and norms file (manifest.NORMS_FILE). The model id is the SHA-256 of the
manifest, so two differently converted copies of "the same" model get different
ids and peers never mix them. Names like `smollm2-135m` are only local aliases.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
from functools import cached_property
from pathlib import Path

from ..errors import FrameError, UsageError
from .manifest import Manifest, parse
from .formats import FP32, WeightFormat
from .layout import LAYER_PREFIX, lay_out, write_config

log = logging.getLogger(__name__)

MANIFEST_FILE = "manifest.json"
_MODEL_ID = re.compile(r"[0-9a-f]{64}")
ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}


def is_model_id(name: str) -> bool:
    return bool(_MODEL_ID.fullmatch(name))


class StoredModel:
    def __init__(self, model_id: str, path: Path, manifest: Manifest) -> None:
        self.model_id, self.path, self.manifest = model_id, path, manifest

    def __eq__(self, other) -> bool:
        return isinstance(other, StoredModel) and (self.model_id, self.path) == (other.model_id, other.path)

    def __hash__(self) -> int:
        return hash((self.model_id, self.path))

    def __repr__(self) -> str:
        return f"StoredModel({self.model_id[:12]}, {self.path})"

    @property
    def num_blocks(self) -> int:
        return self.manifest.num_blocks

    @property
    def hidden_size(self) -> int:
        return int(self.manifest.config["hidden_size"])

    @cached_property
    def stored_block_bytes(self) -> int:
        """Bytes of the largest decoder block's file: what a ggml node holds of it (the
        file's own types; the Q4_0/Q4_K repacking keeps their size)."""
        return max(self.manifest.block_bytes().values(), default=0)

    @cached_property
    def block_bytes(self) -> int:
        """Bytes of one decoder block's weights as a torch node holds them (the largest, if
        they differ): as stored, but for a gguf model's matrices, their kernels' bytes
        (gguf_native.held_bytes: a Q4_0 block is ~11 % larger in its kernel, a Q6_K
        matrix 2.4x), which is what a memory budget must count. A ggml node holds
        stored_block_bytes."""
        types = dict(self.manifest.format.types)
        if not types:
            return self.stored_block_bytes
        from .gguf_native import held_bytes

        return max((sum(held_bytes(types[name], t.shape) if name in types else t.end - t.begin
                        for name, t in f.tensors.items()) for f in self.manifest.files if f.role == "block"),
                   default=0)

    @property
    def format(self) -> WeightFormat:
        return self.manifest.format

    @cached_property
    def dtype(self) -> str:
        dtypes = {t.dtype for t in self.manifest.tensors().values()}
        return "float32" if dtypes == {"F32"} else "bfloat16" if dtypes == {"BF16"} else "mixed"

    def held_files(self) -> set[int]:
        """Indexes of the manifest's files present here in full (files only ever
        appear complete: they are verified before being renamed into place)."""
        held = set()
        for i, entry in enumerate(self.manifest.files):
            try:
                if (self.path / entry.name).stat().st_size == entry.size:
                    held.add(i)
            except OSError:
                pass
        return held

    def missing_files(self, *, blocks: tuple[int, int] | None = None, head: bool = False) -> list[int]:
        return sorted(set(self.manifest.files_for(blocks=blocks, head=head)) - self.held_files())

    def held_blocks(self) -> list[int]:
        files = self.manifest.files
        return sorted(files[i].block for i in self.held_files() if files[i].role == "block")

    def holds(self, *, blocks: tuple[int, int] | None = None, head: bool = False) -> bool:
        return not self.missing_files(blocks=blocks, head=head)


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
        # Parsed manifests by (model id, mtime, size): a node lists its models every few
        # seconds (torrent announce), and parsing a large manifest holds the GIL.
        self._parsed: dict[tuple[str, int, int], Manifest] = {}

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
        if "/" in model_id or model_id.startswith(".") or not (path / MANIFEST_FILE).exists():
            return None
        stat = (path / MANIFEST_FILE).stat()
        key = (model_id, stat.st_mtime_ns, stat.st_size)
        manifest = self._parsed.get(key)
        if manifest is None:
            try:
                manifest = parse((path / MANIFEST_FILE).read_bytes(), expected_id=model_id)
            except FrameError as exc:
                raise UsageError(f"the stored manifest of {model_id[:12]} is damaged ({exc}); remove {path}") from None
            self._parsed = {k: v for k, v in self._parsed.items() if k[0] != model_id} | {key: manifest}
        return StoredModel(model_id, path, manifest)

    def list(self) -> list[tuple[list[str], StoredModel]]:
        names: dict[str, list[str]] = {}
        for alias, model_id in self.aliases().items():
            names.setdefault(model_id, []).append(alias)
        out = []
        for manifest in sorted(self.root.glob(f"*/{MANIFEST_FILE}")):
            try:
                model = self.get(manifest.parent.name)
            except UsageError as exc:  # one damaged model must not hide (or break) the others
                log.warning("skipping %s", exc)
                continue
            if model:
                out.append((sorted(names.get(model.model_id, [])), model))
        return out

    def add_manifest(self, manifest: Manifest, alias: str | None = None) -> StoredModel:
        """Make room for a model fetched from the swarm: its manifest, no files yet."""
        target = self.root / manifest.model_id
        if not (target / MANIFEST_FILE).exists():
            staging = Path(tempfile.mkdtemp(prefix=".fetch-", dir=self.root))
            (staging / MANIFEST_FILE).write_bytes(manifest.raw)
            write_config(staging, manifest)
            self._install(staging, target)
        if alias:
            self.set_alias(alias, manifest.model_id)
        return self.get(manifest.model_id)

    def import_dir(self, source: Path, alias: str | None = None, *, piece_size: int | None = None,
                   laid_out: bool = False, progress=None, fmt: WeightFormat | None = None) -> StoredModel:
        """Import an HF-style directory (config.json + safetensors + tokenizer files),
        laying it out as the store holds models. `laid_out=True` marks a directory
        this program laid out itself (the shared conversion cache): its files are
        hard-linked instead of rewritten."""
        source = Path(source)
        if laid_out:
            manifest = parse((source / MANIFEST_FILE).read_bytes())
            target = self.root / manifest.model_id
            if not (target / MANIFEST_FILE).exists():
                staging = Path(tempfile.mkdtemp(prefix=".import-", dir=self.root))
                for entry in manifest.files:
                    _link_or_copy(source / entry.name, staging / entry.name)
                (staging / MANIFEST_FILE).write_bytes(manifest.raw)
                write_config(staging, manifest)
                self._install(staging, target)
        else:
            if not (source / "config.json").exists():
                raise UsageError(f"{source} has no config.json: not a Hugging Face model directory")
            staging = Path(tempfile.mkdtemp(prefix=".import-", dir=self.root))
            try:
                manifest = lay_out(source, staging, piece_size=piece_size, progress=progress, fmt=fmt)
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)
                raise
            self._install(staging, self.root / manifest.model_id)
        if alias:
            self.set_alias(alias, manifest.model_id)
        return self.get(manifest.model_id)

    def _install(self, staging: Path, target: Path) -> None:
        """Move a staged model directory into place; files already held there (say,
        blocks fetched before a full import) are replaced by the staged ones."""
        if (target / MANIFEST_FILE).exists():
            for item in staging.iterdir():
                os.replace(item, target / item.name)
            shutil.rmtree(staging, ignore_errors=True)
            return
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)


def span_tensor_names(all_names, start: int, end: int) -> list[str]:
    """The names among `all_names` of blocks start:end's tensors."""
    wanted = []
    for name in all_names:
        if name.startswith(LAYER_PREFIX):
            index = int(name[len(LAYER_PREFIX):].split(".", 1)[0])
            if start <= index < end:
                wanted.append(name)
    return wanted


def stored_format(model_dir: Path) -> WeightFormat:
    """The weight format of a model directory: its manifest's (fp32 without one)."""
    path = Path(model_dir) / MANIFEST_FILE
    return parse(path.read_bytes()).format if path.exists() else FP32
