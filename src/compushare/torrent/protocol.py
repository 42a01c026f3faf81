"""The pieces protocol's (wire.PIECES) messages: constructors and checks. Pure, no I/O.

One stream per downloader and seeder pair. The downloader says `hello` with the
model id; the seeder answers with its `bitfield` (or an error), then sends `have`
for pieces it gains. The downloader may ask for the `manifest`, then `request`s
pieces (several in flight) and `cancel`s requests it no longer needs; the seeder
answers each request with a `piece` or a `reject`. See protocol.md.
"""

from __future__ import annotations

import re

import msgpack

from .. import wire
from ..errors import FrameError
from ..net.codec import LENGTH
from ..model.manifest import MAX_MANIFEST_BYTES, MAX_PIECE_SIZE, MAX_PIECES

PIECES_PROTOCOL = wire.PIECES
# Downloaders send only small control messages; seeders send pieces and manifests.
MAX_CONTROL_FRAME = 64 * 1024
MAX_DATA_FRAME = max(MAX_PIECE_SIZE, MAX_MANIFEST_BYTES) + 64 * 1024
REJECT_CODES = wire.PIECES_REJECTS
_MODEL_ID = re.compile(r"[0-9a-f]{64}")


def _bad(message: str) -> FrameError:
    return FrameError(wire.BAD_MESSAGE, message)


def _index(message: dict, num_pieces: int) -> int:
    index = message.get("index")
    if type(index) is not int or not 0 <= index < num_pieces:
        raise _bad(f"{message.get('type')}: index must be an integer in [0, {num_pieces})")
    return index


def _keys(message: dict, keys: set[str]) -> None:
    if set(message) != keys | {"type"}:
        raise _bad(f"{message['type']}: expected keys {sorted(keys | {'type'})}")


# ---------------------------------------------------------------- bitfields


def encode_bitfield(have, num_pieces: int) -> bytes:
    field = bytearray((num_pieces + 7) // 8)
    for i in have:
        field[i >> 3] |= 0x80 >> (i & 7)
    return bytes(field)


def decode_bitfield(field: bytes, num_pieces: int) -> set[int]:
    if not isinstance(field, bytes) or len(field) != (num_pieces + 7) // 8:
        raise _bad(f"a bitfield of {num_pieces} pieces is {(num_pieces + 7) // 8} bytes")
    if num_pieces % 8 and field[-1] & (0xFF >> (num_pieces % 8)):
        raise _bad("a bitfield's spare bits must be zero")
    return {i for i in range(num_pieces) if field[i >> 3] & (0x80 >> (i & 7))}


def _bin_header(size: int) -> bytes:
    """msgpack's bin header, smallest form first (as msgpack.packb writes it)."""
    if size < 1 << 8:
        return b"\xc4" + size.to_bytes(1, "big")
    if size < 1 << 16:
        return b"\xc5" + size.to_bytes(2, "big")
    return b"\xc6" + size.to_bytes(4, "big")


def piece_frame_head(index: int, length: int) -> bytes:
    """The bytes of a piece frame before its `length` bytes of data. A seeder reads the
    piece from disk right behind them, into one buffer: the piece is copied once."""
    packer = msgpack.Packer(use_bin_type=True)
    head = b"".join((packer.pack_map_header(3), packer.pack("type"), packer.pack("piece"), packer.pack("index"),
                     packer.pack(index), packer.pack("data"), _bin_header(length)))
    return LENGTH.pack(len(head) + length) + head


def piece_frame(index: int, data: bytes) -> bytes:
    """The frame of `{"type": "piece", "index": index, "data": data}`, byte for byte what
    codec.encode_frame makes, with one copy of the piece instead of two."""
    return piece_frame_head(index, len(data)) + data


# ---------------------------------------------------------------- downloader -> seeder


def parse_request(message: dict, num_pieces: int | None) -> tuple[str, object]:
    """A downloader's message as (type, argument). `num_pieces` is None before hello."""
    kind = message["type"]
    if kind == "hello":
        _keys(message, {"model"})
        if not isinstance(message["model"], str) or not _MODEL_ID.fullmatch(message["model"]):
            raise _bad("hello: model must be a 64-hex-digit model id")
        return kind, message["model"]
    if num_pieces is None:
        raise _bad(f"{kind} before hello")
    if kind == "manifest":
        _keys(message, set())
        return kind, None
    if kind in ("request", "cancel"):
        _keys(message, {"index"})
        return kind, _index(message, num_pieces)
    raise _bad(f"unknown message type {kind!r}")


# ---------------------------------------------------------------- seeder -> downloader


def parse_reply(message: dict, num_pieces: int | None) -> tuple[str, object]:
    """A seeder's message as (type, argument); sizes are checked by the caller against
    the manifest (data lengths) and by the framing (frame limit)."""
    kind = message["type"]
    if kind == "error":
        code, text = message.get("code"), message.get("message", "")
        return kind, f"{code}: {text}" if isinstance(code, str) and isinstance(text, str) else "malformed error"
    if kind == "bitfield":
        _keys(message, {"pieces", "have"})
        pieces = message["pieces"]
        if type(pieces) is not int or not 0 <= pieces <= MAX_PIECES or (num_pieces is not None
                                                                        and pieces != num_pieces):
            raise _bad("bitfield: wrong piece count")
        if num_pieces is None:  # no manifest yet: nothing to check it against, so not decoded
            return kind, (pieces, None)
        return kind, (pieces, decode_bitfield(message["have"], pieces))
    if kind == "manifest":
        _keys(message, {"data"})
        if not isinstance(message["data"], bytes):
            raise _bad("manifest: data must be bytes")
        return kind, message["data"]
    if num_pieces is None:
        raise _bad(f"{kind} before the bitfield")
    if kind == "have":
        _keys(message, {"index"})
        return kind, _index(message, num_pieces)
    if kind == "piece":
        _keys(message, {"index", "data"})
        if not isinstance(message["data"], bytes):
            raise _bad("piece: data must be bytes")
        return kind, (_index(message, num_pieces), message["data"])
    if kind == "reject":
        _keys(message, {"index", "code"})
        if message["code"] not in REJECT_CODES:
            raise _bad(f"reject: code must be one of {REJECT_CODES}")
        return kind, (_index(message, num_pieces), message["code"])
    raise _bad(f"unknown message type {kind!r}")
