"""Wire codec: length-prefixed msgpack frames and raw tensors. Pure, no I/O.

A frame is a 4-byte big-endian length, then a msgpack map with a string "type".
Tensors travel as {"dtype", "shape", "data"} with little-endian raw bytes; bf16 is
sent as its int16 bit pattern (numpy has no bf16). Nothing here ever unpickles.
Every check raises FrameError with a stable `code` that goes into the error reply.
"""

from __future__ import annotations

import math
import struct

import msgpack
import numpy as np
import torch

from ..errors import FrameError

LENGTH = struct.Struct(">I")
DEFAULT_MAX_FRAME = 16 * 1024 * 1024

# name -> (torch dtype, numpy dtype used for the raw bytes)
WIRE_DTYPES: dict[str, tuple[torch.dtype, np.dtype]] = {
    "float32": (torch.float32, np.dtype("<f4")),
    "float16": (torch.float16, np.dtype("<f2")),
    "bfloat16": (torch.bfloat16, np.dtype("<i2")),
}
TORCH_TO_WIRE = {torch_dtype: name for name, (torch_dtype, _) in WIRE_DTYPES.items()}


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
        payload = bytes(self._buffer[LENGTH.size:end])
        del self._buffer[:end]
        return decode_payload(payload)

    def _check_length(self, length: int) -> None:
        if length > self.max_frame_bytes:
            raise FrameError(
                "frame_too_large", f"frame of {length} bytes exceeds the limit of {self.max_frame_bytes}"
            )


def encode_tensor(tensor: torch.Tensor) -> dict:
    name = TORCH_TO_WIRE.get(tensor.dtype)
    if name is None:
        raise ValueError(f"dtype {tensor.dtype} cannot go on the wire")
    tensor = tensor.detach().contiguous()
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(torch.int16)
    return {"dtype": name, "shape": list(tensor.shape), "data": tensor.numpy().tobytes()}


def decode_tensor(obj: object, *, hidden_size: int, max_tokens: int) -> torch.Tensor:
    """Validate a wire tensor of shape [1, tokens, hidden_size] and build it.

    Checks, in order: structure, dtype whitelist, shape, byte length, finiteness.
    """
    if not isinstance(obj, dict) or set(obj) != {"dtype", "shape", "data"}:
        raise FrameError("bad_tensor", "a tensor is a map of exactly dtype, shape, data")
    dtype_name, shape, data = obj["dtype"], obj["shape"], obj["data"]
    if not isinstance(dtype_name, str) or dtype_name not in WIRE_DTYPES:
        raise FrameError("bad_dtype", f"dtype {dtype_name!r} is not one of {sorted(WIRE_DTYPES)}")
    if (
        not isinstance(shape, list)
        or len(shape) != 3
        or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape)
    ):
        raise FrameError("bad_shape", f"shape must be 3 integers [batch, tokens, hidden], got {shape!r}")
    batch, tokens, hidden = shape
    if batch != 1 or hidden != hidden_size or not (1 <= tokens <= max_tokens):
        raise FrameError(
            "bad_shape",
            f"shape {shape} must be [1, 1..{max_tokens}, {hidden_size}]",
        )
    if not isinstance(data, bytes):
        raise FrameError("bad_tensor", "tensor data must be bytes")
    torch_dtype, np_dtype = WIRE_DTYPES[dtype_name]
    expected = math.prod(shape) * np_dtype.itemsize
    if len(data) != expected:
        raise FrameError(
            "bad_shape", f"shape {shape} of {dtype_name} needs {expected} bytes, frame has {len(data)}"
        )
    array = np.frombuffer(data, dtype=np_dtype).reshape(shape)
    tensor = torch.from_numpy(array.copy())
    if torch_dtype == torch.bfloat16:
        tensor = tensor.view(torch.bfloat16)
    if not torch.isfinite(tensor).all():
        raise FrameError("non_finite", "tensor holds NaN or infinity")
    return tensor
