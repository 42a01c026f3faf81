"""Wire codec: length-prefixed msgpack frames. Pure, no I/O.

A frame is a 4-byte big-endian length, then a msgpack map with a string "type".
Tensors inside frames are net/tensors.py's business. Nothing here ever unpickles.
Every check raises FrameError with a stable `code` that goes into the error reply.
"""

from __future__ import annotations

import struct

import msgpack

from ..errors import FrameError
from ..wire import BAD_FRAME, FRAME_TOO_LARGE

LENGTH = struct.Struct(">I")
DEFAULT_MAX_FRAME = 16 * 1024 * 1024


def encode_frame(message: dict) -> bytes:
    payload = msgpack.packb(message, use_bin_type=True)
    return LENGTH.pack(len(payload)) + payload


def decode_payload(payload: bytes) -> dict:
    try:
        message = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types
        raise FrameError(BAD_FRAME, f"payload is not valid msgpack: {exc}") from None
    if not isinstance(message, dict) or not isinstance(message.get("type"), str):
        raise FrameError(BAD_FRAME, "a frame must be a map with a string 'type'")
    return message


class FrameDecoder:
    """Turns a byte stream into messages. Feed bytes, then pull frames.

    An oversized length prefix is rejected as soon as its 4 bytes arrive, before
    any of the payload is buffered.

    Received chunks are kept as they came and joined once, when a whole frame is
    in: growing one buffer by each chunk copied a 1 MiB piece several times over
    as it grew, a cost a downloader's main thread felt.
    """

    def __init__(self, max_frame_bytes: int = DEFAULT_MAX_FRAME) -> None:
        self.max_frame_bytes = max_frame_bytes
        self.last_frame_bytes = 0  # size of the frame next_message() last returned (rate limits)
        self._chunks: list = []  # bytes-like, in stream order; the first may be a view of a tail
        self._size = 0

    @property
    def buffered_bytes(self) -> int:
        """Bytes received and not yet returned as messages."""
        return self._size

    def feed(self, data: bytes) -> None:
        if data:
            self._chunks.append(data)
            self._size += len(data)

    def _contiguous(self, n: int):
        """The first chunk, after joining chunks until it holds at least `n` bytes."""
        first = self._chunks[0]
        if len(first) < n:
            first = b"".join(self._chunks)
            self._chunks = [first]
        return first

    def _length(self) -> int | None:
        if self._size < LENGTH.size:
            return None
        (length,) = LENGTH.unpack_from(self._contiguous(LENGTH.size))
        self._check_length(length)
        return length

    def needed(self) -> int:
        """How many more bytes complete the next frame (at least 1)."""
        length = self._length()
        if length is None:
            return LENGTH.size - self._size
        return max(1, LENGTH.size + length - self._size)

    def next_message(self) -> dict | None:
        length = self._length()
        end = LENGTH.size + (length or 0)
        if length is None or self._size < end:
            return None
        first = self._contiguous(end)
        # Decode straight from the buffer: no slice copies of a 1 MiB piece.
        view = memoryview(first)
        payload = view[LENGTH.size:end]
        self.last_frame_bytes = end
        try:
            return decode_payload(payload)
        finally:  # a bad frame is consumed too: the stream can go on
            payload.release()
            self._size -= end
            if len(first) > end:
                self._chunks[0] = view[end:]  # keeps `first` alive until the tail is used
            else:
                del self._chunks[0]
                view.release()

    def _check_length(self, length: int) -> None:
        if length > self.max_frame_bytes:
            raise FrameError(
                FRAME_TOO_LARGE, f"frame of {length} bytes exceeds the limit of {self.max_frame_bytes}"
            )
