"""The parts of /compushare/infer/1.5.0's messages: a hidden state on the wire, a
session's downstream, a step proof, a peer id. Pure: no I/O, no torch, no libp2p.
Each checks itself where it is read (`from_wire`), with the error codes of
messages.py, which builds its requests and replies from them."""

from __future__ import annotations

import dataclasses
from typing import TypeGuard

from .. import wire
from ..errors import FrameError
from ..net.dtypes import WIRE_NUMPY_DTYPES
from ..proofs.inference import MAX_RUNTIME_CHARS
from .protocol import BAD_REQUEST, SESSION_ID_BYTES

MAX_ADDRS = 8  # multiaddrs in a link's downstream
MAX_ADDR_CHARS = 256
MAX_PEER_CHARS = 128
_BASE58 = frozenset("123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz")


@dataclasses.dataclass(frozen=True)
class WireTensor:
    """A hidden state as it travels: [1, tokens, hidden] of `dtype`, little-endian bytes."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes

    @property
    def tokens(self) -> int:
        return self.shape[1]

    def to_wire(self) -> dict:
        return {"dtype": self.dtype, "shape": list(self.shape), "data": self.data}

    @classmethod
    def from_wire(cls, obj: object, dims: int = 3) -> WireTensor:
        """The structure checks of net.tensors.decode_tensor, with its codes and messages:
        a map of exactly dtype (on the whitelist), shape (`dims` integers), data (bytes)."""
        if not isinstance(obj, dict) or set(obj) != {"dtype", "shape", "data"}:
            raise FrameError(wire.BAD_TENSOR, "a tensor is a map of exactly dtype, shape, data")
        dtype, shape, data = obj["dtype"], obj["shape"], obj["data"]
        if not isinstance(dtype, str) or dtype not in WIRE_NUMPY_DTYPES:
            raise FrameError(wire.BAD_DTYPE, f"dtype {dtype!r} is not one of {sorted(WIRE_NUMPY_DTYPES)}")
        if (not isinstance(shape, list) or len(shape) != dims
                or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape)):
            what = "[batch, tokens, hidden]" if dims == 3 else "dimensions"
            raise FrameError(wire.BAD_SHAPE, f"shape must be {dims} integers {what}, got {shape!r}")
        if not isinstance(data, bytes):
            raise FrameError(wire.BAD_TENSOR, "tensor data must be bytes")
        return cls(dtype, tuple(shape), data)


@dataclasses.dataclass(frozen=True)
class Downstream:
    """Where a session's outputs go: the next hop's server and its session."""

    peer: str
    addrs: tuple[str, ...]
    session: bytes

    def to_wire(self) -> dict:
        return {"peer": self.peer, "addrs": list(self.addrs), "session": self.session}

    @classmethod
    def from_wire(cls, value: object) -> Downstream | None:
        if value is None:
            return None
        if not isinstance(value, dict):
            raise FrameError(BAD_REQUEST, "'downstream' must be a map or nil")
        peer = parse_peer(value.get("peer"), "downstream.peer")
        addrs, session = value.get("addrs"), value.get("session")
        if (not isinstance(addrs, list) or len(addrs) > MAX_ADDRS
                or not all(isinstance(a, str) and len(a) <= MAX_ADDR_CHARS for a in addrs)):
            raise FrameError(BAD_REQUEST, f"'downstream.addrs' must be at most {MAX_ADDRS} multiaddr strings")
        if not isinstance(session, bytes) or len(session) != SESSION_ID_BYTES:
            raise FrameError(BAD_REQUEST, f"'downstream.session' must be {SESSION_ID_BYTES} bytes")
        return cls(peer, tuple(addrs), session)


@dataclasses.dataclass(frozen=True)
class Proof:
    """A step proof (proofs/inference.py): the server's signed statement about the last chunk."""

    position: int
    tokens: int
    mode: str
    prefix: bytes
    input_digest: bytes
    output_digest: bytes
    sig: bytes
    runtime: str = ""  # the span runtime's build (revision 27)
    forwards: bytes = bytes(32)  # the session's forwards chain through this step (revision 27)

    def to_wire(self) -> dict:
        return {"position": self.position, "tokens": self.tokens, "mode": self.mode, "prefix": self.prefix,
                "input": self.input_digest, "output": self.output_digest, "sig": self.sig, "rt": self.runtime,
                "forwards": self.forwards}

    @classmethod
    def from_wire(cls, value: object) -> Proof | None:
        """None unless a map of these typed fields: a proof that cannot be read cannot
        convict anyone, so it counts as none."""
        if not isinstance(value, dict):
            return None
        position, tokens, mode, prefix, digest, output, sig, runtime, forwards = (value.get(k) for k in (
            "position", "tokens", "mode", "prefix", "input", "output", "sig", "rt", "forwards"))
        if not (is_int(position) and is_int(tokens) and isinstance(mode, str) and len(mode) <= 16
                and _is_digest(prefix) and _is_digest(digest) and _is_digest(output) and _is_digest(forwards)
                and isinstance(sig, bytes) and len(sig) <= 128
                and isinstance(runtime, str) and len(runtime) <= MAX_RUNTIME_CHARS):
            return None
        return cls(position, tokens, mode, prefix, digest, output, sig, runtime, forwards)


def _is_digest(value: object) -> TypeGuard[bytes]:
    return isinstance(value, bytes) and len(value) == 32


def parse_peer(value: object, name: str) -> str:
    """A peer id in base58, as libp2p's ID.from_base58 accepts it (trailing whitespace
    and all), without importing libp2p here."""
    if not isinstance(value, str) or len(value) > MAX_PEER_CHARS:
        raise FrameError(BAD_REQUEST, f"{name!r} must be a peer id")
    if not all(c in _BASE58 for c in value.rstrip()):
        raise FrameError(BAD_REQUEST, f"{name!r} is not a valid peer id")
    return value


def is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)
