"""Messages of `/compushare/diloco/1.0.0`. Pure, no I/O.

Every request is one frame on its own stream, answered by one frame (a `join` and a
`part` are answered when the group closes or the part is averaged). Peers' frames
are checked here, field by field, before anything acts on them: PeerMisbehaved
otherwise (the handler answers `bad_request`).
"""

from __future__ import annotations

from ..errors import PeerMisbehaved
from ..net.signed import field
from .group import DIGEST_BYTES
from .run import MAX_GROUP

MAX_FRAME = 8 * 1024 * 1024  # a part of up to ~7.5M int8 elements (with its scales) per frame
MAX_PEER_ID = 128
MAX_ROUND = 1 << 31
MAX_ATTEMPTS = 4
MAX_EXCLUDED = 64  # peers a state reply names as excluded
_RUN_HEX = frozenset("0123456789abcdef")


def run_field(message: dict) -> str:
    run = field(message, "run", str, "request")
    if len(run) != 64 or not set(run) <= _RUN_HEX:
        raise PeerMisbehaved("'run' must be a run id (64 hex digits)")
    return run


def _round(message: dict) -> int:
    value = field(message, "round", int, "request")
    if not 0 <= value < MAX_ROUND:
        raise PeerMisbehaved("'round' out of range")
    return value


def _digest(message: dict, name: str) -> bytes:
    value = field(message, name, bytes, "request")
    if len(value) != DIGEST_BYTES:
        raise PeerMisbehaved(f"{name!r} must be {DIGEST_BYTES} bytes")
    return value


def members_field(message: dict) -> list[str]:
    members = field(message, "members", list, "message")
    if not (1 <= len(members) <= MAX_GROUP) or not all(isinstance(m, str) and 0 < len(m) <= MAX_PEER_ID
                                                        for m in members):
        raise PeerMisbehaved(f"'members' must list 1..{MAX_GROUP} peer ids")
    if len(set(members)) != len(members) or members != sorted(members):
        raise PeerMisbehaved("'members' must be sorted and distinct")
    return members


def error(code: str, message: str, **extra) -> dict:
    return {"type": "error", "code": code, "message": message[:200], **extra}


# -- state: where a joiner gets the current outer weights ------------------------------

def state_request(run_id: str) -> dict:
    return {"type": "state", "run": run_id}


def state_reply(run_id: str, round_: int, base: bytes, weights: str, momentum: str, members: list[str],
                excluded: list[str]) -> dict:
    return {"type": "state", "run": run_id, "round": round_, "base": base, "weights": weights,
            "momentum": momentum, "members": sorted(members), "excluded": sorted(excluded)[:MAX_EXCLUDED]}


def excluded_field(message: dict) -> list[str]:
    excluded = field(message, "excluded", list, "state reply")
    if len(excluded) > MAX_EXCLUDED or not all(isinstance(m, str) and 0 < len(m) <= MAX_PEER_ID for m in excluded):
        raise PeerMisbehaved(f"'excluded' must list at most {MAX_EXCLUDED} peer ids")
    return excluded


def parse_state_reply(message: dict) -> tuple[int, bytes, str, str]:
    """(round, base digest, weights model id, momentum model id)."""
    if message.get("type") != "state":
        raise PeerMisbehaved(f"expected a state reply, got {message.get('type')!r}")
    ids = tuple(field(message, name, str, "state reply") for name in ("weights", "momentum"))
    if not all(len(i) == 64 and set(i) <= _RUN_HEX for i in ids):
        raise PeerMisbehaved("state reply's model ids must be 64 hex digits")
    return _round(message), _digest(message, "base"), ids[0], ids[1]


# -- join: group formation, answered by the round's leader ------------------------------

def join_request(run_id: str, round_: int, base: bytes) -> dict:
    return {"type": "join", "run": run_id, "round": round_, "base": base}


def parse_join(message: dict) -> tuple[str, int, bytes]:
    return run_field(message), _round(message), _digest(message, "base")


def group_reply(members: list[str]) -> dict:
    return {"type": "group", "members": sorted(members)}


# -- part: one slice of one contribution, answered with the slice's average -------------

def part_request(run_id: str, round_: int, attempt: int, members: list[str], contribution: dict,
                 signature: bytes, part: dict) -> dict:
    return {"type": "part", "run": run_id, "round": round_, "attempt": attempt, "members": sorted(members),
            "contribution": contribution, "sig": signature, "part": part}


def parse_part(message: dict) -> tuple[str, int, int, list[str], dict, bytes, dict]:
    attempt = field(message, "attempt", int, "part")
    if not 0 <= attempt < MAX_ATTEMPTS:
        raise PeerMisbehaved("'attempt' out of range")
    signature = field(message, "sig", bytes, "part")
    if len(signature) > 1024:
        raise PeerMisbehaved("'sig' too long")
    return (run_field(message), _round(message), attempt, members_field(message),
            field(message, "contribution", dict, "part"), signature, field(message, "part", dict, "part"))


def averaged_reply(part: dict, receipt: bytes = b"") -> dict:
    return {"type": "averaged", "part": part, "receipt": receipt}


# -- report: a failure report against a participant -------------------------------------

def report_request(report: bytes) -> dict:
    return {"type": "report", "report": report}

