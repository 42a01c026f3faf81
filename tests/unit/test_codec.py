"""net/codec.py: length-prefixed msgpack frames and wire tensors."""

from __future__ import annotations

import math
import struct

import msgpack
import numpy as np
import pytest
import torch
import trio
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from compushare.errors import FrameError
from compushare.net.codec import DEFAULT_MAX_FRAME, LENGTH, FrameDecoder, decode_payload, encode_frame
from compushare.net.framing import FramedStream
from compushare.net.tensors import decode_tensor, encode_tensor

# ---------------------------------------------------------------- strategies

INT64 = st.integers(min_value=-(2**63), max_value=2**64 - 1)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    INT64,
    st.floats(allow_nan=False),  # NaN != NaN would make equality meaningless
    st.text(max_size=20),
    st.binary(max_size=40),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.text(max_size=8), inner, max_size=4),
    ),
    max_leaves=8,
)
messages = st.builds(
    lambda kind, rest: rest | {"type": kind},
    st.text(max_size=12),
    st.dictionaries(st.text(max_size=8), values, max_size=5),
)


def drain(decoder: FrameDecoder) -> list[dict]:
    out = []
    while (message := decoder.next_message()) is not None:
        out.append(message)
    return out


def split_at(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    bounds = [0, *points, len(data)]
    return [data[a:b] for a, b in zip(bounds, bounds[1:])]


# ---------------------------------------------------------------- frames


@given(messages)
def test_frame_round_trip(message):
    frame = encode_frame(message)
    (length,) = LENGTH.unpack_from(frame)
    assert length == len(frame) - 4
    assert decode_payload(frame[4:]) == message
    decoder = FrameDecoder()
    decoder.feed(frame)
    assert decoder.next_message() == message
    assert decoder.next_message() is None


@given(st.lists(messages, min_size=1, max_size=5), st.lists(st.integers(min_value=0), max_size=30))
def test_frames_survive_arbitrary_chunking(batch, cuts):
    stream = b"".join(encode_frame(m) for m in batch)
    decoder = FrameDecoder()
    received = []
    for chunk in split_at(stream, cuts):
        decoder.feed(chunk)
        received.extend(drain(decoder))
    assert received == batch
    assert decoder.next_message() is None
    assert decoder.needed() == 4  # buffer fully consumed: a fresh length prefix is next


@given(st.lists(messages, min_size=1, max_size=4), st.lists(st.integers(min_value=1, max_value=64), min_size=1))
def test_reading_needed_bytes_never_overshoots_a_frame(batch, sizes):
    """FramedStream reads min(needed(), chunk): it must never read past the frame it is on."""
    frames = [encode_frame(m) for m in batch]
    stream = b"".join(frames)
    boundaries = set(np.cumsum([len(f) for f in frames]).tolist())
    decoder = FrameDecoder()
    offset, received, step = 0, [], 0
    while offset < len(stream):
        needed = decoder.needed()
        assert needed >= 1
        take = min(needed, sizes[step % len(sizes)])
        step += 1
        decoder.feed(stream[offset:offset + take])
        offset += take
        got = drain(decoder)
        assert len(got) <= 1
        if got:
            assert offset in boundaries
        received.extend(got)
    assert received == batch


@given(st.binary(max_size=300), st.lists(st.integers(min_value=0), max_size=10),
       st.integers(min_value=0, max_value=200))
def test_arbitrary_bytes_only_raise_frame_error(garbage, cuts, max_frame):
    decoder = FrameDecoder(max_frame_bytes=max_frame)
    try:
        for chunk in split_at(garbage, cuts):
            decoder.feed(chunk)
            decoder.needed()
            drain(decoder)
    except FrameError as exc:
        assert exc.code in {"bad_frame", "frame_too_large"}


@given(st.binary(max_size=300))
def test_arbitrary_payload_only_raises_frame_error(payload):
    try:
        message = decode_payload(payload)
    except FrameError as exc:
        assert exc.code == "bad_frame"
    else:
        assert isinstance(message, dict) and isinstance(message["type"], str)


@given(values)
def test_payload_that_is_not_a_typed_map_is_bad_frame(value):
    assume(not (isinstance(value, dict) and isinstance(value.get("type"), str)))
    with pytest.raises(FrameError) as info:
        decode_payload(msgpack.packb(value, use_bin_type=True))
    assert info.value.code == "bad_frame"


@pytest.mark.parametrize(
    "payload",
    [
        b"",  # empty
        b"\x81",  # map header with no entries
        msgpack.packb({"type": "x"}) + b"\x00",  # trailing bytes
        msgpack.packb({1: "int key", "type": "x"}),  # non-string map key
        msgpack.packb({"type": 7}),  # type not a string
        msgpack.packb({"type": b"step"}, use_bin_type=True),  # type as bytes
        msgpack.packb(["type", "x"]),
    ],
)
def test_bad_payloads(payload):
    with pytest.raises(FrameError) as info:
        decode_payload(payload)
    assert info.value.code == "bad_frame"


@given(st.integers(min_value=0, max_value=10_000), st.integers(min_value=1, max_value=2**32 - 1 - 10_001),
       st.binary(max_size=20))
def test_oversized_length_rejected_as_soon_as_four_bytes_arrive(limit, excess, tail):
    length = limit + excess
    decoder = FrameDecoder(max_frame_bytes=limit)
    prefix = LENGTH.pack(length)
    for i in range(3):  # three bytes: nothing to judge yet
        decoder.feed(prefix[i:i + 1])
        assert decoder.next_message() is None
        assert decoder.needed() == 3 - i
    decoder.feed(prefix[3:] + tail)  # the 4th byte, possibly with some payload
    with pytest.raises(FrameError) as info:
        decoder.next_message()
    assert info.value.code == "frame_too_large"
    with pytest.raises(FrameError) as info:
        decoder.needed()
    assert info.value.code == "frame_too_large"


def test_frame_exactly_at_the_limit_is_accepted():
    frame = encode_frame({"type": "x" * 50})
    limit = len(frame) - 4
    decoder = FrameDecoder(max_frame_bytes=limit)
    decoder.feed(frame[:4])
    assert decoder.needed() == limit
    decoder.feed(frame[4:])
    assert decoder.next_message() == {"type": "x" * 50}
    small = FrameDecoder(max_frame_bytes=limit - 1)
    small.feed(frame[:4])
    with pytest.raises(FrameError):
        small.next_message()


def test_default_limit_is_16_mib():
    decoder = FrameDecoder()
    assert decoder.max_frame_bytes == DEFAULT_MAX_FRAME == 16 * 1024 * 1024
    decoder.feed(LENGTH.pack(DEFAULT_MAX_FRAME))
    assert decoder.needed() == DEFAULT_MAX_FRAME
    over = FrameDecoder()
    over.feed(LENGTH.pack(DEFAULT_MAX_FRAME + 1))
    with pytest.raises(FrameError):
        over.needed()


def test_length_prefix_is_big_endian():
    frame = encode_frame({"type": "a" * 300})
    assert frame[:4] == struct.pack(">I", len(frame) - 4)
    assert frame[:2] == b"\x00\x00"


def test_bad_frame_is_consumed_so_the_stream_can_continue():
    decoder = FrameDecoder()
    bad = msgpack.packb([1, 2, 3])
    decoder.feed(LENGTH.pack(len(bad)) + bad + encode_frame({"type": "next"}))
    with pytest.raises(FrameError):
        decoder.next_message()
    assert decoder.next_message() == {"type": "next"}


# ---------------------------------------------------------------- tensors

H = 8
WIRE = [torch.float32, torch.float16, torch.bfloat16]


@settings(suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(st.sampled_from(WIRE), st.integers(min_value=1, max_value=6),
       st.lists(st.floats(min_value=-60000, max_value=60000, width=32), min_size=6 * H, max_size=6 * H))
def test_tensor_round_trip_is_bit_exact(dtype, tokens, floats):
    tensor = torch.tensor(floats[: tokens * H], dtype=torch.float32).reshape(1, tokens, H).to(dtype)
    wire = encode_tensor(tensor)
    assert set(wire) == {"dtype", "shape", "data"}
    assert wire["shape"] == [1, tokens, H]
    assert len(wire["data"]) == tokens * H * tensor.element_size()
    back = decode_tensor(wire, hidden_size=H, max_tokens=6)
    assert back.dtype == dtype
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(back.view(bits), tensor.view(bits))  # bit-exact, -0.0 included


@pytest.mark.parametrize("dtype", WIRE)
def test_tensor_round_trip_through_a_frame(dtype):
    torch.manual_seed(0)
    tensor = torch.randn(1, 3, H).to(dtype)
    decoder = FrameDecoder()
    decoder.feed(encode_frame({"type": "step", "hidden": encode_tensor(tensor)}))
    message = decoder.next_message()
    back = decode_tensor(message["hidden"], hidden_size=H, max_tokens=3)
    assert back.dtype == dtype and torch.equal(back, tensor)


def test_bfloat16_travels_as_its_bit_pattern():
    tensor = torch.tensor([[[1.0, -2.0]]], dtype=torch.bfloat16)
    wire = encode_tensor(tensor)
    assert wire["dtype"] == "bfloat16"
    assert wire["data"] == tensor.view(torch.int16).numpy().astype("<i2").tobytes()
    assert wire["data"] == bytes([0x80, 0x3F, 0x00, 0xC0])  # little-endian bf16 of 1.0, -2.0


def test_non_contiguous_tensor_is_encoded_in_logical_order():
    base = torch.arange(2 * H, dtype=torch.float32).reshape(H, 2)
    tensor = base.T.unsqueeze(0)  # [1, 2, H], non-contiguous
    assert not tensor.is_contiguous()
    back = decode_tensor(encode_tensor(tensor), hidden_size=H, max_tokens=2)
    assert torch.equal(back, tensor)


@pytest.mark.parametrize("dtype", [torch.float64, torch.int64, torch.int16, torch.uint8, torch.bool])
def test_encode_rejects_dtypes_not_on_the_wire(dtype):
    with pytest.raises(ValueError):
        encode_tensor(torch.zeros(1, 1, H, dtype=dtype))


def _wire(dtype="float32", shape=(1, 2, H), data=None, **extra):
    itemsize = {"float32": 4, "float16": 2, "bfloat16": 2}.get(dtype, 4)
    if data is None:
        data = bytes(math.prod(shape) * itemsize)
    return {"dtype": dtype, "shape": list(shape), "data": data} | extra


@pytest.mark.parametrize(
    ("obj", "code"),
    [
        (None, "bad_tensor"),
        ([1, 2, 3], "bad_tensor"),
        ({"dtype": "float32", "shape": [1, 1, H]}, "bad_tensor"),  # missing data
        (_wire(extra=1), "bad_tensor"),  # extra key
        (_wire(dtype="float64"), "bad_dtype"),
        (_wire(dtype="int8"), "bad_dtype"),
        (_wire(dtype=None), "bad_dtype"),
        (_wire(dtype=b"float32"), "bad_dtype"),
        (_wire(dtype=4), "bad_dtype"),
        ({"dtype": "float32", "shape": (1, 2, H), "data": bytes(2 * H * 4)}, "bad_shape"),  # tuple, not list
        (_wire(shape=(2, H)), "bad_shape"),
        (_wire(shape=(1, 1, 1, H)), "bad_shape"),
        ({"dtype": "float32", "shape": [1, 2.0, H], "data": bytes(2 * H * 4)}, "bad_shape"),
        ({"dtype": "float32", "shape": [True, 2, H], "data": bytes(2 * H * 4)}, "bad_shape"),
        ({"dtype": "float32", "shape": [1, "2", H], "data": bytes(2 * H * 4)}, "bad_shape"),
        (_wire(shape=(2, 2, H)), "bad_shape"),  # batch must be 1
        (_wire(shape=(1, 2, H + 1)), "bad_shape"),  # wrong hidden size
        ({"dtype": "float32", "shape": [1, 0, H], "data": b""}, "bad_shape"),  # zero tokens
        (_wire(shape=(1, 5, H)), "bad_shape"),  # more than max_tokens
        ({"dtype": "float32", "shape": [1, -1, H], "data": b""}, "bad_shape"),
        (_wire(data="not bytes"), "bad_tensor"),
        (_wire(data=bytearray(2 * H * 4)), "bad_tensor"),
        (_wire(data=bytes(2 * H * 4 - 1)), "bad_shape"),  # one byte short
        (_wire(data=bytes(2 * H * 4 + 4)), "bad_shape"),  # one float too many
        (_wire(dtype="float16", data=bytes(2 * H * 4)), "bad_shape"),  # f32-sized data labelled f16
    ],
)
def test_decode_tensor_rejections(obj, code):
    with pytest.raises(FrameError) as info:
        decode_tensor(obj, hidden_size=H, max_tokens=4)
    assert info.value.code == code


def test_decode_tensor_checks_in_documented_order():
    # Bad dtype and bad shape and bad length: the dtype is reported first.
    assert _code({"dtype": "int8", "shape": [3], "data": b""}) == "bad_dtype"
    # Bad shape and bad length: shape first.
    assert _code({"dtype": "float32", "shape": [1, 9, H], "data": b"\x00"}) == "bad_shape"
    # NaN with a wrong byte length: the length is reported, not the NaN.
    nan = np.full(2 * H, np.nan, dtype="<f4").tobytes()
    assert _code({"dtype": "float32", "shape": [1, 2, H], "data": nan + b"\x00"}) == "bad_shape"


def _code(obj) -> str:
    with pytest.raises(FrameError) as info:
        decode_tensor(obj, hidden_size=H, max_tokens=4)
    return info.value.code


@pytest.mark.parametrize("dtype", WIRE)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_values_rejected(dtype, bad):
    tensor = torch.zeros(1, 3, H, dtype=dtype)
    tensor[0, 2, 5] = bad
    with pytest.raises(FrameError) as info:
        decode_tensor(encode_tensor(tensor), hidden_size=H, max_tokens=4)
    assert info.value.code == "non_finite"


def test_float16_overflow_pattern_is_rejected():
    # 0x7C00 is +inf in IEEE half precision; built from raw bytes, not from torch.
    data = bytearray(2 * H)
    data[0:2] = b"\x00\x7c"
    assert _code({"dtype": "float16", "shape": [1, 1, H], "data": bytes(data)}) == "non_finite"
    data[0:2] = b"\xff\x7b"  # the largest finite half: accepted
    out = decode_tensor({"dtype": "float16", "shape": [1, 1, H], "data": bytes(data)}, hidden_size=H, max_tokens=1)
    assert out[0, 0, 0].item() == 65504.0


def test_decoded_tensor_owns_its_memory():
    data = bytearray(np.arange(H, dtype="<f4").tobytes())
    out = decode_tensor({"dtype": "float32", "shape": [1, 1, H], "data": bytes(data)}, hidden_size=H, max_tokens=1)
    out += 1  # writable (np.frombuffer on bytes is read-only: the copy matters)
    assert out[0, 0, 0].item() == 1.0


# Any msgpack-shaped object as a tensor field.
hashable = st.one_of(st.none(), st.booleans(), st.integers(-5, 5), st.text(max_size=10),
                     st.binary(max_size=10), st.sampled_from(["float32", "float16", "bfloat16"]))
wire_like = st.fixed_dictionaries(
    {
        "dtype": st.one_of(hashable, values),
        "shape": st.one_of(values, st.lists(st.integers(-2, 10), min_size=0, max_size=4)),
        "data": st.one_of(values, st.binary(max_size=4 * 3 * H)),
    }
)


@settings(deadline=None)
@given(st.one_of(values, wire_like), st.integers(1, 4))
def test_decode_tensor_on_arbitrary_objects_only_raises_frame_error(obj, max_tokens):
    try:
        out = decode_tensor(obj, hidden_size=H, max_tokens=max_tokens)
    except FrameError:
        return
    assert out.shape[0] == 1 and out.shape[2] == H and 1 <= out.shape[1] <= max_tokens
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("dtype", [[], {}, ["float32"]])
def test_unhashable_dtype_is_a_frame_error(dtype):
    with pytest.raises(FrameError) as info:
        decode_tensor({"dtype": dtype, "shape": [1, 1, H], "data": bytes(4 * H)}, hidden_size=H, max_tokens=1)
    assert info.value.code == "bad_dtype"


class _EchoStream:
    """Reads return what was written, at most `n` bytes at a time."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self._unread = b""

    async def write(self, data) -> None:
        self.writes.append(bytes(data))
        self._unread += bytes(data)

    async def read(self, n: int) -> bytes:
        data, self._unread = self._unread[:n], self._unread[n:]
        return data


@given(st.lists(messages, max_size=6))
def test_send_many_is_one_write_that_reads_back_as_the_messages_in_order(batch):
    async def main() -> list[dict]:
        stream = _EchoStream()
        framed = FramedStream(stream, 1 << 20)
        await framed.send_many(batch)
        assert len(stream.writes) == (1 if batch else 0)
        received = []
        while (message := await framed.receive()) is not None:
            received.append(message)
        return received

    assert trio.run(main) == batch
