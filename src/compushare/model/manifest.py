"""The manifest: what a model is made of, piece by piece. Pure, no I/O.

A stored model is a set of files: `head.safetensors` (embeddings, final norm, LM
head), one `block-NNNN.safetensors` per decoder block, and small `meta` files (the
tokenizer; since layout version 3 also `norms.safetensors`: a copy of every block's
small tensors, norms and biases, which a private-mode consumer runs itself, so it
fetches those with the head instead of every block). Each file is cut into pieces of `piece_size` bytes (the last one
shorter); pieces never cross files, so a provider fetches exactly the files of its
span. The manifest lists every file's pieces by SHA-256 and, for the weight
files, the byte range of every tensor.

The model id is the SHA-256 of the manifest's bytes: whoever holds the id can check
a manifest from any peer, then every piece against it. A quantized model's manifest
also names its weight format (the optional "weights" map, model/formats.py), so the
format is part of what the id names.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re

from ..errors import FrameError, UsageError
from .formats import WeightFormat, format_from_manifest

FORMAT = "compushare-manifest/1"
MIN_PIECE_SIZE = 16 * 1024
MAX_PIECE_SIZE = 4 * 1024 * 1024
TARGET_PIECES = 1024  # the automatic piece size aims at about this many pieces
MAX_MANIFEST_BYTES = 8 * 1024 * 1024
MAX_FILES = 65536
MAX_PIECES = 1 << 22
MAX_TENSORS_PER_FILE = 4096
HEAD_FILE = "head.safetensors"
# A meta file: every decoder block's tensors but its weight matrices (norms, biases), the
# bytes its block file holds for them (private mode's consumer, model/private_layers.py).
NORMS_FILE = "norms.safetensors"
# Names the store writes itself next to a model's files: a manifest may not use them.
RESERVED_NAMES = {"manifest.json", "config.json"}
ROLES = ("head", "block", "meta")
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_DTYPES = {"F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL"}


def block_file_name(block: int) -> str:
    return f"block-{block:04d}.safetensors"


def auto_piece_size(total_bytes: int) -> int:
    """A power of two giving at most about TARGET_PIECES pieces, within 16 KiB..4 MiB."""
    wanted = max(1, math.ceil(total_bytes / TARGET_PIECES))
    size = 1 << (wanted - 1).bit_length()
    return min(MAX_PIECE_SIZE, max(MIN_PIECE_SIZE, size))


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    dtype: str
    shape: tuple[int, ...]
    begin: int  # byte range inside its file (header included in the offset)
    end: int


@dataclasses.dataclass(frozen=True)
class FileEntry:
    name: str
    role: str  # "head" | "block" | "meta"
    block: int | None
    size: int
    pieces: tuple[str, ...]
    tensors: dict[str, TensorEntry]


@dataclasses.dataclass(frozen=True)
class Piece:
    index: int  # global: pieces are numbered through the files in manifest order
    file: int
    offset: int
    length: int
    sha256: str


class Manifest:
    def __init__(self, config: dict, piece_size: int, files: list[FileEntry], raw: bytes | None = None, *,
                 weights: dict | None = None) -> None:
        self.config = config
        self.piece_size = piece_size
        self.files = files
        self.weights = weights  # the "weights" map: a quantized model's format
        self.raw = raw if raw is not None else encode(config, piece_size, files, weights)
        self.model_id = hashlib.sha256(self.raw).hexdigest()
        self.pieces: list[Piece] = []
        self._first_piece: list[int] = []
        for f, entry in enumerate(files):
            self._first_piece.append(len(self.pieces))
            for k, digest in enumerate(entry.pieces):
                offset = k * piece_size
                self.pieces.append(Piece(len(self.pieces), f, offset, min(piece_size, entry.size - offset), digest))

    @property
    def num_blocks(self) -> int:
        return int(self.config["num_hidden_layers"])

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def file_pieces(self, file_index: int) -> range:
        first = self._first_piece[file_index]
        return range(first, first + len(self.files[file_index].pieces))

    def files_for(self, *, blocks: tuple[int, int] | None = None, head: bool = False) -> list[int]:
        """Indexes of the files a role needs: a span's block files; the head and the
        meta files (tokenizer) for a consumer."""
        out = []
        for i, entry in enumerate(self.files):
            if entry.role == "block" and blocks is not None and entry.block is not None \
                    and blocks[0] <= entry.block < blocks[1]:
                out.append(i)
            elif entry.role in ("head", "meta") and head:
                out.append(i)
        return out

    def pieces_for(self, *, blocks: tuple[int, int] | None = None, head: bool = False) -> set[int]:
        return {p for f in self.files_for(blocks=blocks, head=head) for p in self.file_pieces(f)}

    def all_pieces(self) -> set[int]:
        return set(range(len(self.pieces)))

    def tensors_in_piece(self, index: int) -> list[str]:
        piece = self.pieces[index]
        end = piece.offset + piece.length
        return sorted(name for name, t in self.files[piece.file].tensors.items()
                      if t.begin < end and t.end > piece.offset)

    def block_bytes(self) -> dict[int, int]:
        return {f.block: sum(t.end - t.begin for t in f.tensors.values()) for f in self.files
                if f.role == "block" and f.block is not None}

    def tensors(self) -> dict[str, TensorEntry]:
        """Every stored tensor once: where its block or head file holds it (not the norms file's copy)."""
        return {name: t for f in self.files if f.role != "meta" for name, t in f.tensors.items()}

    @property
    def norms_file(self) -> int | None:
        """Index of the norms file (NORMS_FILE), or None: a manifest laid out before it."""
        return next((i for i, f in enumerate(self.files) if f.role == "meta" and f.name == NORMS_FILE), None)

    @property
    def format(self) -> WeightFormat:
        """The weight format every span of this model computes in."""
        return format_from_manifest(self.weights, {t.dtype for t in self.tensors().values()})


def encode(config: dict, piece_size: int, files: list[FileEntry], weights: dict | None = None) -> bytes:
    """Canonical JSON (sorted keys, no spaces): the bytes the model id hashes."""
    doc = ({"weights": weights} if weights is not None else {}) | {
        "format": FORMAT,
        "config": config,
        "piece_size": piece_size,
        "files": [
            {"name": f.name, "role": f.role, "size": f.size, "pieces": list(f.pieces),
             "tensors": {n: {"dtype": t.dtype, "shape": list(t.shape), "offsets": [t.begin, t.end]}
                         for n, t in f.tensors.items()}}
            | ({"block": f.block} if f.role == "block" else {})
            for f in files
        ],
    }
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def _fail(message: str) -> FrameError:
    return FrameError("bad_manifest", message)


def _int(value, what: str, lo: int = 0, hi: int = 1 << 62) -> int:
    if type(value) is not int or not lo <= value <= hi:
        raise _fail(f"{what} must be an integer in [{lo}, {hi}], got {value!r}")
    return value


def _map(value, keys: set[str], what: str, optional: frozenset[str] | set[str] = frozenset()) -> dict:
    if not isinstance(value, dict) or not keys <= set(value) or set(value) - keys - optional:
        raise _fail(f"{what} must be a map with keys {sorted(keys | optional)}")
    return value


def parse(raw: bytes, expected_id: str | None = None) -> Manifest:
    """Check a manifest from anywhere (a peer, the disk) and return it. With
    `expected_id`, the bytes must hash to it. Raises FrameError("bad_manifest")."""
    if not isinstance(raw, (bytes, bytearray)) or len(raw) > MAX_MANIFEST_BYTES:
        raise _fail(f"a manifest is at most {MAX_MANIFEST_BYTES} bytes")
    raw = bytes(raw)
    if expected_id is not None and hashlib.sha256(raw).hexdigest() != expected_id:
        raise _fail(f"manifest does not hash to model id {expected_id[:12]}")
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # RecursionError: nested deeper than the parser goes
        raise _fail(f"not JSON: {exc}") from None
    doc = _map(doc, {"format", "config", "piece_size", "files"}, "the manifest", optional={"weights"})
    if doc["format"] != FORMAT:
        raise _fail(f"unknown manifest format {doc['format']!r}")
    weights = _parse_weights(doc.get("weights"))
    config = doc["config"]
    if not isinstance(config, dict):
        raise _fail("config must be a map")
    num_blocks = _int(config.get("num_hidden_layers"), "config.num_hidden_layers", 1, 100_000)
    piece_size = _int(doc["piece_size"], "piece_size", MIN_PIECE_SIZE, MAX_PIECE_SIZE)
    if piece_size & (piece_size - 1):
        raise _fail("piece_size must be a power of two")
    files = _parse_files(doc["files"], num_blocks, piece_size)
    if weights is not None and weights.get("types"):  # gguf: each type names a stored byte matrix
        stored = {name: t for f in files for name, t in f.tensors.items()}
        if not all(name in stored and stored[name].dtype == "U8" and len(stored[name].shape) in (2, 3)
                   for name in weights["types"]):
            raise _fail("weights.types names a tensor that is not a stored U8 matrix (or stack of experts)")
    return Manifest(config, piece_size, files, raw, weights=weights)


def _parse_weights(weights) -> dict | None:
    """The manifest's `weights`: absent (the source's dtype) or a quantized format."""
    if weights is None:
        return None
    weights = _map(weights, {"format"}, "weights", optional={"group_size", "int8", "types"})
    try:
        if not format_from_manifest(weights, set()).quantized or \
                any(type(v) not in (str, int, list, dict) for v in weights.values()):
            raise _fail("weights names a quantized format (int8, q4, gguf)")
    except UsageError as exc:
        raise _fail(f"weights: {exc}") from None
    return weights


def _parse_files(value, num_blocks: int, piece_size: int) -> list[FileEntry]:
    """The file entries: one per block, exactly one head, at most MAX_PIECES pieces in all."""
    if not isinstance(value, list) or not 0 < len(value) <= MAX_FILES:
        raise _fail(f"files must be a list of 1..{MAX_FILES} entries")
    files: list[FileEntry] = []
    names: set[str] = set()
    blocks: set[int] = set()
    total_pieces = 0
    for item in value:
        entry = _parse_file(item, names, blocks, num_blocks, piece_size)
        total_pieces += len(entry.pieces)
        if total_pieces > MAX_PIECES:
            raise _fail(f"more than {MAX_PIECES} pieces")
        files.append(entry)
    if blocks != set(range(num_blocks)):
        raise _fail(f"blocks without a file: {sorted(set(range(num_blocks)) - blocks)[:8]}")
    if sum(f.role == "head" for f in files) != 1:
        raise _fail("exactly one head file is required")
    _check_norms(files)
    return files


def _check_norms(files: list[FileEntry]) -> None:
    """The norms file's tensors must be block tensors of the same dtype and shape (their
    bytes are the pieces' to check); every other meta file holds no tensors."""
    in_blocks = {name: (t.dtype, t.shape) for f in files if f.role == "block" for name, t in f.tensors.items()}
    for f in files:
        if f.role != "meta" or not f.tensors:
            continue
        if f.name != NORMS_FILE:
            raise _fail(f"{f.name}: only {NORMS_FILE} of the meta files holds tensors")
        for name, t in f.tensors.items():
            if in_blocks.get(name) != (t.dtype, t.shape):
                raise _fail(f"{NORMS_FILE}: {name!r} is not a block tensor of that dtype and shape")


def _parse_file(item, names: set[str], blocks: set[int], num_blocks: int, piece_size: int) -> FileEntry:
    """One file entry; its name and block must be new to `names` and `blocks` (added to them)."""
    f = _map(item, {"name", "role", "size", "pieces", "tensors"}, "a file entry", optional={"block"})
    name = f["name"]
    if not isinstance(name, str) or not _NAME.fullmatch(name) or name in names or name in RESERVED_NAMES:
        raise _fail(f"bad or repeated file name {name!r}")
    names.add(name)
    if f["role"] not in ROLES:
        raise _fail(f"{name}: role must be one of {ROLES}")
    block = None
    if f["role"] == "block":
        block = _int(f.get("block"), f"{name}: block", 0, num_blocks - 1)
        if block in blocks:
            raise _fail(f"block {block} has two files")
        blocks.add(block)
    elif "block" in f:
        raise _fail(f"{name}: only block files have a block")
    size = _int(f["size"], f"{name}: size")
    pieces = f["pieces"]
    if not isinstance(pieces, list) or len(pieces) != math.ceil(size / piece_size):
        raise _fail(f"{name}: {size} bytes need {math.ceil(size / piece_size)} pieces")
    if not all(isinstance(p, str) and _SHA256.fullmatch(p) for p in pieces):
        raise _fail(f"{name}: pieces must be lowercase hex SHA-256 digests")
    return FileEntry(name, f["role"], block, size, tuple(pieces), _parse_tensors(f["tensors"], name, size))


def _parse_tensors(value, name: str, size: int) -> dict[str, TensorEntry]:
    if not isinstance(value, dict) or len(value) > MAX_TENSORS_PER_FILE:
        raise _fail(f"{name}: tensors must be a map of at most {MAX_TENSORS_PER_FILE}")
    out = {}
    for tensor_name, t in value.items():
        t = _map(t, {"dtype", "shape", "offsets"}, f"{name}: tensor {tensor_name!r}")
        if not isinstance(t["dtype"], str) or t["dtype"] not in _DTYPES:  # a list is unhashable
            raise _fail(f"{name}: tensor {tensor_name!r} has unknown dtype {t['dtype']!r}")
        shape, offsets = t["shape"], t["offsets"]
        if not isinstance(shape, list) or len(shape) > 8:
            raise _fail(f"{name}: tensor {tensor_name!r} has a bad shape")
        shape = tuple(_int(d, "a dimension", 0, 1 << 40) for d in shape)
        if not isinstance(offsets, list) or len(offsets) != 2:
            raise _fail(f"{name}: tensor {tensor_name!r} offsets must be [begin, end]")
        begin, end = (_int(o, "an offset", 0, size) for o in offsets)
        if begin > end:
            raise _fail(f"{name}: tensor {tensor_name!r} ends before it begins")
        out[tensor_name] = TensorEntry(t["dtype"], shape, begin, end)
    return out
