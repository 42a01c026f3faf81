"""Wire codec: length-prefixed msgpack frames. Pure, no I/O.

A frame is a 4-byte big-endian length, then a msgpack map with a string "type".
Tensors inside frames are net/tensors.py's business. Nothing here ever unpickles.
Every check raises FrameError with a stable `code` that goes into the error reply.
"""

from __future__ import annotations

import struct

import msgpack

from ..errors import FrameError

LENGTH = struct.Struct(">I")
DEFAULT_MAX_FRAME = 16 * 1024 * 1024


def encode_frame(message: dict) -> bytes:
    payload = msgpack.packb(message, use_bin_type=True)
    return LENGTH.pack(len(payload)) + payload


def decode_payload(payload: bytes) -> dict:
    try:
        message = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types
        raise FrameError("bad_frame", f"payload is not valid msgpack: {exc}") from None
    if not isinstance(message, dict) or not isinstance(message.get("type"), str):
        raise FrameError("bad_frame", "a frame must be a map with a string 'type'")
    return message


class FrameDecoder:
    """Turns a byte stream into messages. Feed bytes, then pull frames.

    An oversized length prefix is rejected as soon as its 4 bytes arrive, before
    any of the payload is buffered.
    """

    def __init__(self, max_frame_bytes: int = DEFAULT_MAX_FRAME) -> None:
        self.max_frame_bytes = max_frame_bytes
        self.last_frame_bytes = 0  # size of the frame next_message() last returned (rate limits)
        self._buffer = bytearray()

    def feed(self, data: bytes) -> None:
        self._buffer += data

    def needed(self) -> int:
        """How many more bytes complete the next frame (at least 1)."""
        if len(self._buffer) < LENGTH.size:
            return LENGTH.size - len(self._buffer)
        (length,) = LENGTH.unpack_from(self._buffer)
        self._check_length(length)
        return max(1, LENGTH.size + length - len(self._buffer))

    def next_message(self) -> dict | None:
        if len(self._buffer) < LENGTH.size:
            return None
        (length,) = LENGTH.unpack_from(self._buffer)
        self._check_length(length)
        end = LENGTH.size + length
        if len(self._buffer) < end:
            return None
        # Decode straight from the buffer: for a 1 MiB piece, slicing would copy twice.
        view = memoryview(self._buffer)
        payload = view[LENGTH.size:end]
        self.last_frame_bytes = end
        try:
            return decode_payload(payload)
        finally:
            payload.release()  # the buffer cannot shrink while a view of it lives
            view.release()
            del self._buffer[:end]  # a bad frame is consumed too: the stream can go on

    def _check_length(self, length: int) -> None:
        if length > self.max_frame_bytes:
            raise FrameError(
                "frame_too_large", f"frame of {length} bytes exceeds the limit of {self.max_frame_bytes}"
            )
