"""Tensors on the wire: {"dtype", "shape", "data"} with little-endian raw bytes.
Pure, no I/O. bf16 is sent as its int16 bit pattern (numpy has no bf16). Every
check raises FrameError with a stable `code` that goes into the error reply.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..errors import FrameError
from ..wire import BAD_DTYPE, BAD_SHAPE, BAD_TENSOR, NON_FINITE
from .dtypes import WIRE_NUMPY_DTYPES

# name -> (torch dtype, numpy dtype used for the raw bytes)
WIRE_DTYPES: dict[str, tuple[torch.dtype, np.dtype]] = {
    name: (getattr(torch, name), numpy_dtype) for name, numpy_dtype in WIRE_NUMPY_DTYPES.items()}
TORCH_TO_WIRE = {torch_dtype: name for name, (torch_dtype, _) in WIRE_DTYPES.items()}



def encode_tensor(tensor: torch.Tensor) -> dict:
    name = TORCH_TO_WIRE.get(tensor.dtype)
    if name is None:
        raise ValueError(f"dtype {tensor.dtype} cannot go on the wire")
    tensor = tensor.detach().contiguous()
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(torch.int16)
    return {"dtype": name, "shape": list(tensor.shape), "data": tensor.numpy().tobytes()}


def decode_tensor(obj: object, *, hidden_size: int, max_tokens: int, max_batch: int = 1) -> torch.Tensor:
    """Validate a wire tensor of shape [1, tokens, hidden_size] and build it (with
    `max_batch` > 1: [batch, tokens, hidden_size], batch x tokens at most max_tokens).

    Checks, in order: structure, dtype whitelist, shape, byte length, finiteness.
    """
    if not isinstance(obj, dict) or set(obj) != {"dtype", "shape", "data"}:
        raise FrameError(BAD_TENSOR, "a tensor is a map of exactly dtype, shape, data")
    dtype_name, shape, data = obj["dtype"], obj["shape"], obj["data"]
    if not isinstance(dtype_name, str) or dtype_name not in WIRE_DTYPES:
        raise FrameError(BAD_DTYPE, f"dtype {dtype_name!r} is not one of {sorted(WIRE_DTYPES)}")
    if (
        not isinstance(shape, list)
        or len(shape) != 3
        or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape)
    ):
        raise FrameError(BAD_SHAPE, f"shape must be 3 integers [batch, tokens, hidden], got {shape!r}")
    batch, tokens, hidden = shape
    if max_batch > 1:
        if hidden != hidden_size or not (1 <= batch <= max_batch and tokens >= 1 and batch * tokens <= max_tokens):
            raise FrameError(BAD_SHAPE, f"shape {shape} must be [1..{max_batch}, tokens, {hidden_size}] with at "
                                        f"most {max_tokens} tokens in all")
    elif batch != 1 or hidden != hidden_size or not (1 <= tokens <= max_tokens):
        raise FrameError(
            BAD_SHAPE,
            f"shape {shape} must be [1, 1..{max_tokens}, {hidden_size}]",
        )
    if not isinstance(data, bytes):
        raise FrameError(BAD_TENSOR, "tensor data must be bytes")
    torch_dtype, np_dtype = WIRE_DTYPES[dtype_name]
    expected = math.prod(shape) * np_dtype.itemsize
    if len(data) != expected:
        raise FrameError(
            BAD_SHAPE, f"shape {shape} of {dtype_name} needs {expected} bytes, frame has {len(data)}"
        )
    array = np.frombuffer(data, dtype=np_dtype).reshape(shape)
    tensor = torch.from_numpy(array.copy())
    if torch_dtype == torch.bfloat16:
        tensor = tensor.view(torch.bfloat16)
    if not torch.isfinite(tensor).all():
        raise FrameError(NON_FINITE, "tensor holds NaN or infinity")
    return tensor
