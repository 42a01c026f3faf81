"""Lay a Hugging Face directory out the way the store and the swarm hold models.

Weights are regrouped into one safetensors file per decoder block plus one for the
rest (embeddings, final norm, LM head), written byte-for-byte deterministically:
the same tensors always give the same files, the same manifest and the same model
id, whatever the source's sharding or the installed safetensors version. The
format is plain safetensors (any reader loads it): an 8-byte little-endian header
length, a JSON header with sorted keys and no spaces padded with spaces to a
multiple of 8, then the tensors' bytes packed in name order.
"""

from __future__ import annotations

from collections.abc import Callable

import hashlib
import json
import logging
import os
import struct
from pathlib import Path

from ..errors import UsageError
from .formats import WeightFormat, base_name
from .manifest import HEAD_FILE, FileEntry, Manifest, TensorEntry, auto_piece_size, block_file_name

log = logging.getLogger(__name__)

LAYER_PREFIX = "model.layers."
# config.json keys that say nothing about the computation.
VOLATILE_CONFIG_KEYS = {"transformers_version", "_name_or_path", "torch_dtype", "dtype", "use_cache"}
META_SUFFIXES = (".json", ".jinja", ".model", ".txt")
NOT_META = {"config.json", "manifest.json", "description.json", "model.safetensors.index.json"}


def block_of(tensor_name: str) -> int | None:
    if not tensor_name.startswith(LAYER_PREFIX):
        return None
    return int(tensor_name[len(LAYER_PREFIX):].split(".", 1)[0])


def safetensors_bytes(tensors: dict[str, tuple[str, tuple[int, ...], bytes]]) -> tuple[bytes, dict[str, TensorEntry]]:
    """(file bytes, byte range of each tensor) for {name: (dtype, shape, raw bytes)}."""
    header, offset = {}, 0
    for name in sorted(tensors):
        dtype, shape, data = tensors[name]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    start = 8 + len(text)
    entries = {name: TensorEntry(h["dtype"], tuple(h["shape"]), start + h["data_offsets"][0],
                                 start + h["data_offsets"][1]) for name, h in header.items()}
    body = b"".join(tensors[name][2] for name in sorted(tensors))
    return struct.pack("<Q", len(text)) + text + body, entries


def piece_hashes(data: bytes, piece_size: int) -> tuple[str, ...]:
    return tuple(hashlib.sha256(data[i:i + piece_size]).hexdigest() for i in range(0, len(data), piece_size))


SAFETENSORS_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "int8": "I8", "uint8": "U8"}


def _entry(tensor) -> tuple[str, tuple[int, ...], bytes]:
    import torch

    dtype = SAFETENSORS_DTYPES[str(tensor.dtype).removeprefix("torch.")]
    return dtype, tuple(tensor.shape), tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _read_source_tensors(source: Path, fmt: WeightFormat | None = None, kept: dict | None = None
                         ) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    import torch  # here, not at the top: `status` and `models list` need no torch
    from safetensors import safe_open

    from .quantize import quantize

    out = {}
    files = sorted(source.glob("*.safetensors"))
    if not files:
        raise UsageError(f"{source} holds no .safetensors weights")
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                if name in out:
                    raise UsageError(f"tensor {name} appears in two files of {source}")
                if kept is not None and name in kept:  # stored already (a GGUF's own 4-bit weights)
                    stored = {k: v for k, v in kept.items() if base_name(k) == name}
                elif fmt is not None:
                    stored = quantize(fmt, name, handle.get_tensor(name))
                if fmt is not None:
                    if set(stored) & set(out):
                        raise UsageError(f"tensor {name} is already quantized in {source}")
                    out |= {stored_name: _entry(tensor) for stored_name, tensor in stored.items()}
                    continue
                sl = handle.get_slice(name)
                raw = handle.get_tensor(name).contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
                out[name] = (sl.get_dtype(), tuple(sl.get_shape()), raw)
    return out


def _write_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def native_gguf_tensors(source: Path, gguf_path: Path) -> tuple[WeightFormat, dict]:
    """q4/g32 tensors for `source` (a GGUF's converted directory) that keep the GGUF's
    own 4-bit matrices (model/gguf_native.py); the rest quantized by our quantizer."""
    from .gguf_native import GROUP, native_matrices

    fmt = WeightFormat("q4", GROUP)
    kept, others = native_matrices(gguf_path, json.loads((source / "config.json").read_text()))
    if others:
        log.warning("%d matrices of %s are not Q4_0/Q4_1 (%s): quantized to %s by our quantizer", len(others),
                    gguf_path.name, ", ".join(sorted(set(others.values()))), fmt.label)
    return fmt, _read_source_tensors(source, fmt, kept)


def lay_out(source: Path, target: Path, *, piece_size: int | None = None,
            progress: Callable[[int, int], None] | None = None, fmt: WeightFormat | None = None,
            tensors: dict[str, tuple[str, tuple[int, ...], bytes]] | None = None) -> Manifest:
    """Write `source` (config.json + safetensors + tokenizer files) into the empty
    directory `target` in store layout, with manifest.json and config.json;
    `progress(bytes written, total bytes)` after each file. With `fmt`, every weight
    is converted to that format (model/quantize.py); `tensors` replaces the source's
    weights with ready stored ones (a GGUF's own quantization, model/gguf_native.py)."""
    source = Path(source)
    if not (source / "config.json").exists():
        raise UsageError(f"{source} has no config.json: not a Hugging Face model directory")
    config = json.loads((source / "config.json").read_text())
    config = {k: v for k, v in config.items() if k not in VOLATILE_CONFIG_KEYS}
    num_blocks = config.get("num_hidden_layers")
    if type(num_blocks) is not int or num_blocks < 1:
        raise UsageError(f"{source}/config.json has no valid num_hidden_layers")
    if tensors is None:
        tensors = _read_source_tensors(source, fmt)
    groups: dict[int | None, dict] = {None: {}} | {b: {} for b in range(num_blocks)}
    for name, value in tensors.items():
        block = block_of(base_name(name))
        if block not in groups:
            raise UsageError(f"tensor {name} belongs to no block of a {num_blocks}-block model")
        groups[block][name] = value
    contents: list[tuple[str, str, int | None, bytes, dict]] = []
    for block, group in groups.items():
        data, entries = safetensors_bytes(group)
        name, role = (HEAD_FILE, "head") if block is None else (block_file_name(block), "block")
        contents.append((name, role, block, data, entries))
    for path in sorted(source.iterdir()):
        if path.is_file() and path.name.endswith(META_SUFFIXES) and path.name not in NOT_META:
            contents.append((path.name, "meta", None, path.read_bytes(), {}))
    piece_size = piece_size or auto_piece_size(sum(len(c[3]) for c in contents))
    files = []
    target.mkdir(parents=True, exist_ok=True)
    total, written = sum(len(c[3]) for c in contents), 0
    for name, role, block, data, entries in contents:
        files.append(FileEntry(name, role, block, len(data), piece_hashes(data, piece_size), entries))
        _write_file(target / name, data)
        written += len(data)
        if progress is not None:
            progress(written, total)
    weights = fmt.spec() if fmt is not None and fmt.quantized else None
    manifest = Manifest(config, piece_size, files, weights=weights)
    _write_file(target / "manifest.json", manifest.raw)
    write_config(target, manifest)
    return manifest


def write_config(target: Path, manifest: Manifest) -> None:
    """config.json for transformers, derived from the manifest (which the id covers)."""
    _write_file(target / "config.json", json.dumps(manifest.config, indent=2, sort_keys=True).encode())
