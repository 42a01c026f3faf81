"""The private protocol (wire.PRIVATE): encrypted projections. Messages and their checks. Pure.

One stream is one private session (protocol.md, "Private sessions"):

    consumer                                   provider
    open {model_id, start, end, params,   ->
          keys_digest, keys_size}
                                          <-   opened {need_keys, max_keys_bytes}
    keys {data} ... (if need_keys; chunks ->
          of at most KEYS_CHUNK bytes)
                                          <-   keys_ok {bytes}
    project {layer, group, tokens, cts}   ->
                                          <-   projected {cts, compute_s}
    wait {s} (between requests, 2.1.0)    ->
    ... (any number)
    close the stream

Any request may instead get `error {code, message}`; a session error (bad keys,
wrong span) ends the stream, a request error (one bad ciphertext) does not.

Both sides say what they are waiting on (2.1.0), so that no wait is bounded by a
constant tuned on one machine: a consumer whose next request to this hop waits for
the other hops' work sends `wait {s}` ("my next message comes within s seconds"),
and a provider still working on an answer (a turn in its queue, its HE workers,
installing keys) sends `busy` every BUSY_PERIOD_S. A stream silent past what it
announced is closed (the provider says `error idle` first); under 2.0.0, which is
still answered, neither is sent and the fixed limits hold.
Ciphertexts are SEAL's serialisation (he/ckks.py checks them); everything else
is msgpack, like every CompuShare protocol.
"""

from __future__ import annotations

import dataclasses
import re

from .. import wire
from ..errors import PeerMisbehaved, RemoteError
from ..he.groups import GROUPS

PRIVATE_PROTOCOL = wire.PRIVATE
PRIVATE_PROTOCOLS = (wire.PRIVATE, wire.PRIVATE_V2_0)  # a consumer's proposal, newest first
KEYS_CHUNK = 1 << 20  # Galois keys travel in chunks of 1 MiB (a frame holds at most 16 MiB)
MAX_KEYS_BYTES = 128 << 20  # all of a session's Galois keys (SmolLM2 needs 13.5 MB)
MAX_TOKENS_PER_REQUEST = 64
MAX_CTS_PER_REQUEST = 128  # input ciphertexts (groups x chunks)
MAX_OUTPUTS_PER_REPLY = 96  # output ciphertexts (groups x outputs): 96 x 128 KiB fit a 16 MiB frame
MAX_CIPHERTEXT_BYTES = 256 << 10
MAX_FRAME_BYTES = 16 << 20
MAX_WAIT_S = 600.0  # the most one `wait` announces
BUSY_PERIOD_S = 10.0  # a provider working on an answer says `busy` this often
BUSY = {"type": "busy"}

HEX64 = re.compile(r"^[0-9a-f]{64}$")


class PrivateProtocolError(PeerMisbehaved):
    """A private-session message that is malformed."""


@dataclasses.dataclass(frozen=True)
class Open:
    model_id: str
    start: int
    end: int
    params: str
    keys_digest: str
    keys_size: int

    def to_wire(self) -> dict:
        return {"type": "open", **dataclasses.asdict(self)}


@dataclasses.dataclass(frozen=True)
class Project:
    layer: int
    group: str
    tokens: int
    cts: tuple[bytes, ...]  # the plan's groups x chunks input ciphertexts (he/plan.py)

    def to_wire(self) -> dict:
        return {"type": "project", "layer": self.layer, "group": self.group, "tokens": self.tokens,
                "cts": list(self.cts)}


def _int(message: dict, key: str, low: int, high: int) -> int:
    value = message.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise PrivateProtocolError(f"{key} must be an integer in [{low}, {high}], got {value!r}")
    return value


def _str(message: dict, key: str, max_len: int = 128) -> str:
    value = message.get(key)
    if not isinstance(value, str) or not value or len(value) > max_len:
        raise PrivateProtocolError(f"{key} must be a non-empty string of at most {max_len} characters")
    return value


def decode_open(message: dict) -> Open:
    if not isinstance(message, dict) or message.get("type") != "open":
        raise PrivateProtocolError("a private session starts with an open message")
    digest = _str(message, "keys_digest", 64)
    if not HEX64.match(digest):
        raise PrivateProtocolError("keys_digest must be a sha256 in lowercase hex")
    start = _int(message, "start", 0, 1 << 16)
    end = _int(message, "end", start + 1, 1 << 16)
    return Open(_str(message, "model_id"), start, end, _str(message, "params", 64), digest,
                _int(message, "keys_size", 1, MAX_KEYS_BYTES))


def decode_keys_chunk(message: dict) -> bytes:
    if not isinstance(message, dict) or message.get("type") != "keys":
        raise PrivateProtocolError("expected a keys message")
    data = message.get("data")
    if not isinstance(data, bytes) or not 0 < len(data) <= KEYS_CHUNK:
        raise PrivateProtocolError(f"keys data must be 1..{KEYS_CHUNK} bytes")
    return data


def wait(seconds: float) -> dict:
    return {"type": "wait", "s": float(seconds)}


def decode_wait(message: dict) -> float:
    """A `wait`'s announced seconds (within 1..MAX_WAIT_S)."""
    if not isinstance(message, dict) or message.get("type") != "wait":
        raise PrivateProtocolError("expected a wait message")
    value = message.get("s")
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 1.0 <= value <= MAX_WAIT_S:
        raise PrivateProtocolError(f"a wait's s must be a number of seconds in [1, {MAX_WAIT_S:.0f}], got {value!r}")
    return float(value)


def decode_project(message: dict) -> Project:
    if not isinstance(message, dict) or message.get("type") != "project":
        raise PrivateProtocolError("expected a project message")
    group = message.get("group")
    if not isinstance(group, str) or group not in GROUPS:  # a list or map would be unhashable
        raise PrivateProtocolError(f"unknown group {group!r}; known: {sorted(GROUPS)}")
    cts = message.get("cts")
    if not isinstance(cts, list) or not 1 <= len(cts) <= MAX_CTS_PER_REQUEST:
        raise PrivateProtocolError(f"cts must be a list of 1..{MAX_CTS_PER_REQUEST} ciphertexts")
    if not all(isinstance(ct, bytes) and 0 < len(ct) <= MAX_CIPHERTEXT_BYTES for ct in cts):
        raise PrivateProtocolError(f"each ciphertext must be 1..{MAX_CIPHERTEXT_BYTES} bytes")
    return Project(_int(message, "layer", 0, 1 << 16), group, _int(message, "tokens", 1, MAX_TOKENS_PER_REQUEST),
                   tuple(cts))


def decode_projected(message: dict, groups: int) -> tuple[list[list[bytes]], float]:
    """A provider's answer: per group of the plan, its output ciphertexts."""
    if not isinstance(message, dict):
        raise PrivateProtocolError("reply is not a map")
    if message.get("type") == "error":
        raise PrivateRemoteError(str(message.get("code")), str(message.get("message"))[:500])
    if message.get("type") != "projected":
        raise PrivateProtocolError(f"expected projected, got {message.get('type')!r}")
    cts = message.get("cts")
    if not isinstance(cts, list) or len(cts) != groups or not all(
            isinstance(out, list) and out and all(isinstance(c, bytes) and len(c) <= MAX_CIPHERTEXT_BYTES
                                                  for c in out) for out in cts):
        raise PrivateProtocolError(f"projected must hold {groups} lists of ciphertexts")
    compute_s = message.get("compute_s", 0.0)
    return cts, float(compute_s) if isinstance(compute_s, (int, float)) else 0.0


def error(code: str, message: str) -> dict:
    return {"type": "error", "code": code, "message": message}


class PrivateRemoteError(RemoteError):
    """The provider answered with an error."""
