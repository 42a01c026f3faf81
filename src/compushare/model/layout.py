"""Lay a Hugging Face directory out the way the store and the swarm hold models.

Weights are regrouped into one safetensors file per decoder block plus one for the
rest (embeddings, final norm, LM head), written byte-for-byte deterministically:
the same tensors always give the same files, the same manifest and the same model
id, whatever the source's sharding or the installed safetensors version. The
format is plain safetensors (any reader loads it): an 8-byte little-endian header
length, a JSON header with sorted keys and no spaces padded with spaces to a
multiple of 8, then the tensors' bytes packed in name order.

Beside them goes `norms.safetensors` (manifest.NORMS_FILE), in the same format: every
block's tensors but its weight matrices (norms, biases; 141 KiB for SmolLM2),
the very bytes the block files hold, for private mode's consumer. LAYOUT_VERSION names
this layout in cached conversions (model/sources.py, model/gguf_import.py): a new
layout gives new ids, so a conversion laid out by an older one is not reused.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from ..errors import UsageError
from .formats import WeightFormat, base_name
from .manifest import HEAD_FILE, NORMS_FILE, FileEntry, Manifest, TensorEntry, auto_piece_size, block_file_name

log = logging.getLogger(__name__)

LAYER_PREFIX = "model.layers."
# In cached conversions' names: bump when lay_out's bytes change (2: store layout; 3: NORMS_FILE).
LAYOUT_VERSION = 3
# config.json keys that say nothing about the computation.
VOLATILE_CONFIG_KEYS = {"transformers_version", "_name_or_path", "torch_dtype", "dtype", "use_cache"}
META_SUFFIXES = (".json", ".jinja", ".model", ".txt")
NOT_META = {"config.json", "manifest.json", "description.json", "model.safetensors.index.json"}


def block_of(tensor_name: str) -> int | None:
    if not tensor_name.startswith(LAYER_PREFIX):
        return None
    return int(tensor_name[len(LAYER_PREFIX):].split(".", 1)[0])


def is_norms_tensor(tensor_name: str) -> bool:
    """A block's tensor other than its weight matrices (a `*_proj.weight` and its
    quantized parts) and a mixture's experts (their 3-D stacks and biases, most of the
    model's bytes): what NORMS_FILE holds and a private-mode consumer runs with."""
    base = base_name(tensor_name)
    return block_of(base) is not None and not base.endswith("_proj.weight") and ".mlp.experts." not in base


ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
SAFETENSORS_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "int8": "I8", "uint8": "U8"}


@dataclasses.dataclass(frozen=True)
class StoredSpec:
    """What a stored tensor will be, known before its bytes are read."""
    dtype: str  # safetensors dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ITEMSIZE[self.dtype]


class TensorSource(Protocol):
    """Where lay_out reads the tensors it stores: every stored tensor's spec up front
    (the file sizes fix the piece size before the first byte is written), then each
    tensor's bytes (any buffer) in name order, one file's tensors at a time."""

    def specs(self) -> dict[str, StoredSpec]: ...

    def read(self, name: str): ...


def safetensors_header(specs: dict[str, StoredSpec]) -> tuple[bytes, dict[str, TensorEntry]]:
    """(the 8-byte length + JSON header of a file holding `specs`, each tensor's byte range)."""
    header, offset = {}, 0
    for name in sorted(specs):
        spec = specs[name]
        header[name] = {"dtype": spec.dtype, "shape": list(spec.shape), "data_offsets": [offset, offset + spec.nbytes]}
        offset += spec.nbytes
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    start = 8 + len(text)
    entries = {name: TensorEntry(h["dtype"], tuple(h["shape"]), start + h["data_offsets"][0],
                                 start + h["data_offsets"][1]) for name, h in header.items()}
    return struct.pack("<Q", len(text)) + text, entries


class PieceHasher:
    """SHA-256 of each `piece_size` piece of a byte stream fed in any chunks."""

    def __init__(self, piece_size: int) -> None:
        self.piece_size, self.digests = piece_size, []
        self._current, self._filled = hashlib.sha256(), 0

    def update(self, data) -> None:
        view = memoryview(data).cast("B")
        while len(view):
            take = min(len(view), self.piece_size - self._filled)
            self._current.update(view[:take])
            self._filled += take
            view = view[take:]
            if self._filled == self.piece_size:
                self.digests.append(self._current.hexdigest())
                self._current, self._filled = hashlib.sha256(), 0

    def finish(self) -> tuple[str, ...]:
        if self._filled:
            self.digests.append(self._current.hexdigest())
            self._current, self._filled = hashlib.sha256(), 0
        return tuple(self.digests)


def piece_hashes(data: bytes, piece_size: int) -> tuple[str, ...]:
    hasher = PieceHasher(piece_size)
    hasher.update(data)
    return hasher.finish()


class ConvertedTensors:
    """A tensor source whose tensors are converted to `fmt` (model/quantize.py) as each
    is read (as they are with `fmt` None). `shapes`: {name: (safetensors dtype, shape)}
    of the source tensors; `value(name)`: one source tensor, as torch. Specs come from
    converting an empty tensor of each shape on the meta device: nothing is read up front."""

    def __init__(self, shapes: dict[str, tuple[str, tuple[int, ...]]], value, fmt: WeightFormat | None,
                 where: str) -> None:
        self.fmt, self._value, self._specs = fmt, value, {}
        self._cached: tuple[str | None, dict] = (None, {})
        for name, (dtype, shape) in shapes.items():
            for stored, spec in self._convert_spec(name, dtype, shape).items():
                if stored in self._specs:
                    raise UsageError(f"tensor {name} is already quantized in {where}")
                self._specs[stored] = spec

    def _convert_spec(self, name: str, dtype: str, shape: tuple[int, ...]) -> dict[str, StoredSpec]:
        if self.fmt is None:
            return {name: StoredSpec(dtype, shape)}
        import torch

        from .quantize import quantize

        empty = torch.empty(shape, device="meta")
        return {stored: StoredSpec(SAFETENSORS_DTYPES[str(t.dtype).removeprefix("torch.")], tuple(t.shape))
                for stored, t in quantize(self.fmt, name, empty).items()}

    def specs(self) -> dict[str, StoredSpec]:
        return self._specs

    def read(self, name: str):
        import torch

        from .quantize import quantize

        base = base_name(name) if self.fmt is not None else name
        if self._cached[0] != base:  # a matrix's parts (X.weight, X.weight_min, X.weight_scale) come in a row
            self._cached = (None, {})  # the previous matrix's parts freed before this one is read
            tensor = self._value(base)
            stored = quantize(self.fmt, base, tensor) if self.fmt is not None else {base: tensor}
            del tensor
            self._cached = (base, {k: v.contiguous().reshape(-1).view(torch.uint8).numpy() for k, v in stored.items()})
        return self._cached[1][name]


def tensor_files(directory: Path) -> list[Path]:
    """A directory's safetensors files, each tensor in one of them: in store layout (a
    manifest.json beside them), all but NORMS_FILE, whose tensors are block files' copies."""
    laid_out = (Path(directory) / "manifest.json").exists()
    return sorted(path for path in Path(directory).glob("*.safetensors") if not (laid_out and path.name == NORMS_FILE))


def safetensors_source(source: Path, fmt: WeightFormat | None) -> ConvertedTensors:
    """lay_out's tensor source for a Hugging Face directory's safetensors files."""
    from safetensors import safe_open

    file_of, shapes = {}, {}
    files = tensor_files(source)
    if not files:
        raise UsageError(f"{source} holds no .safetensors weights")
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                if name in file_of:
                    raise UsageError(f"tensor {name} appears in two files of {source}")
                file_of[name] = path
                piece = handle.get_slice(name)
                shapes[name] = (piece.get_dtype(), tuple(piece.get_shape()))

    def value(name: str):
        with safe_open(str(file_of[name]), framework="pt") as handle:
            return handle.get_tensor(name)

    return ConvertedTensors(shapes, value, fmt, str(source))


def _write_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def lay_out(source: Path, target: Path, *, piece_size: int | None = None,
            progress: Callable[[int, int], None] | None = None, fmt: WeightFormat | None = None,
            tensors: TensorSource | None = None) -> Manifest:
    """Write `source` (config.json + safetensors + tokenizer files) into the empty
    directory `target` in store layout, with manifest.json and config.json;
    `progress(bytes written, total bytes)` as it goes. With `fmt`, every weight is
    converted to that format (model/quantize.py); `tensors` replaces the source's
    weights (a GGUF's own, model/gguf_import.py), `fmt` then only naming their format.
    Streams: one tensor's bytes in memory at a time, piece hashes computed as written."""
    source = Path(source)
    config = _source_config(source)
    if tensors is None:
        tensors = safetensors_source(source, fmt)
    # (name, role, block, header, entries, tensor specs) of the weight files, then the meta files' bytes
    weight_files = []
    for block, group in _group_by_block(tensors, config["num_hidden_layers"]).items():
        header, entries = safetensors_header(group)
        name, role = (HEAD_FILE, "head") if block is None else (block_file_name(block), "block")
        weight_files.append((name, role, block, header, entries, group))
    meta = [(path.name, path.read_bytes()) for path in sorted(source.iterdir())
            if path.is_file() and path.name.endswith(META_SUFFIXES) and path.name not in NOT_META]
    total = sum(len(w[3]) + sum(s.nbytes for s in w[5].values()) for w in weight_files) + sum(len(m[1]) for m in meta)
    total += _norms_file_size(tensors.specs())
    piece_size = piece_size or auto_piece_size(total)
    written = 0

    def wrote(size: int) -> None:
        nonlocal written
        written += size
        if progress is not None:
            progress(written, total)

    files = []
    kept: dict[str, bytes] = {}  # the norms file's tensors, kept as their block files are written
    target.mkdir(parents=True, exist_ok=True)
    for name, role, block, header, entries, group in weight_files:
        pieces = _write_weight_file(target / name, header, group, tensors, piece_size, wrote, kept)
        size = len(header) + sum(s.nbytes for s in group.values())
        files.append(FileEntry(name, role, block, size, pieces, entries))
    if kept:
        files.append(_write_norms_file(target, kept, tensors.specs(), piece_size, wrote))
    for name, data in meta:
        files.append(FileEntry(name, "meta", None, len(data), piece_hashes(data, piece_size), {}))
        _write_file(target / name, data)
        wrote(len(data))
    weights = fmt.spec() if fmt is not None and fmt.quantized else None
    manifest = Manifest(config, piece_size, files, weights=weights)
    _write_file(target / "manifest.json", manifest.raw)
    write_config(target, manifest)
    return manifest


def _source_config(source: Path) -> dict:
    """The source's config.json, less its volatile keys; it must say how many blocks."""
    if not (source / "config.json").exists():
        raise UsageError(f"{source} has no config.json: not a Hugging Face model directory")
    config = json.loads((source / "config.json").read_text())
    config = {k: v for k, v in config.items() if k not in VOLATILE_CONFIG_KEYS}
    num_blocks = config.get("num_hidden_layers")
    if type(num_blocks) is not int or num_blocks < 1:
        raise UsageError(f"{source}/config.json has no valid num_hidden_layers")
    return config


def _group_by_block(tensors: TensorSource, num_blocks: int) -> dict[int | None, dict[str, StoredSpec]]:
    """{block (None: the head file): {tensor name: spec}}, every block present."""
    groups: dict[int | None, dict[str, StoredSpec]] = {None: {}} | {b: {} for b in range(num_blocks)}
    for name, spec in tensors.specs().items():
        block = block_of(base_name(name))
        if block not in groups:
            raise UsageError(f"tensor {name} belongs to no block of a {num_blocks}-block model")
        groups[block][name] = spec
    return groups


def _write_weight_file(path: Path, header: bytes, group: dict[str, StoredSpec], tensors: TensorSource,
                       piece_size: int, wrote: Callable[[int], None], kept: dict[str, bytes]) -> tuple[str, ...]:
    """Write the header, then each tensor (one in memory at a time); return the piece
    hashes. The norms file's tensors (is_norms_tensor) are copied into `kept` too."""
    hasher = PieceHasher(piece_size)
    with open(path, "wb") as handle:
        for chunk_name, chunk in [("", header)] + [(n, None) for n in sorted(group)]:
            data = chunk if chunk is not None else tensors.read(chunk_name)
            size = memoryview(data).nbytes
            if chunk_name and size != group[chunk_name].nbytes:
                raise UsageError(f"tensor {chunk_name} holds {size} bytes, not the "
                                 f"{group[chunk_name].nbytes} of {group[chunk_name]}")
            if chunk_name and is_norms_tensor(chunk_name):
                kept[chunk_name] = memoryview(data).cast("B").tobytes()
            handle.write(data)
            hasher.update(data)
            del data
            wrote(size)
        handle.flush()
        os.fsync(handle.fileno())
    return hasher.finish()


def _norms_file_size(specs: dict[str, StoredSpec]) -> int:
    norms = {name: spec for name, spec in specs.items() if is_norms_tensor(name)}
    return len(safetensors_header(norms)[0]) + sum(spec.nbytes for spec in norms.values()) if norms else 0


def _write_norms_file(target: Path, kept: dict[str, bytes], specs: dict[str, StoredSpec], piece_size: int,
                      wrote: Callable[[int], None]) -> FileEntry:
    """NORMS_FILE: the kept tensors, with the bytes their block files hold, as a meta file."""
    header, entries = safetensors_header({name: specs[name] for name in kept})
    data = header + b"".join(kept[name] for name in sorted(kept))
    _write_file(target / NORMS_FILE, data)
    wrote(len(data))
    return FileEntry(NORMS_FILE, "meta", None, len(data), piece_hashes(data, piece_size), entries)


def write_config(target: Path, manifest: Manifest) -> None:
    """config.json for transformers, derived from the manifest (which the id covers)."""
    _write_file(target / "config.json", json.dumps(manifest.config, indent=2, sort_keys=True).encode())
