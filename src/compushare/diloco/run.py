"""A training run's record: what every participant agrees on, signed by whoever
started it. Pure, no I/O.

Wire: a sealed envelope (net/signed.py) signed by the starter, stored in the DHT
under `/csrun/<run_id>` where run_id is the SHA-256 (hex) of the sealed bytes: the
record is immutable and anyone holding the id can check any copy of it. The body:

    {"v": 1, "peer": starter, "name": str, "created": unix s, "recipe": Recipe.to_wire(),
     "aggregator": "mean" | "centered_clip", "gather_s": float, "part_wait_s": float,
     "check_rate": float, "max_group": int, "start": unix s, "init": model id | ""}

init names the initial weights as a stored model (a base model, or an earlier run's
outer weights; "" = the recipe's seeded initialisation); start is when round 0 begins (participants join before it: round 0's group expects
every peer that announced itself by then); gather_s bounds how long a round waits for its participants (stragglers then sit it
out), part_wait_s how long an owner waits for the parts of its slice, check_rate the
share of each round's participants whose work another participant re-runs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import time

from libp2p.crypto.keys import KeyPair

from .. import wire
from ..errors import PeerMisbehaved
from ..net.signed import SignedRecordValidator, field, open_sealed, seal, signer_of
from .aggregate import AGGREGATORS
from .recipe import Recipe

RUN_NAMESPACE = wire.RUN_RECORDS
RUN_VERSION = 1
MAX_RUN_RECORD_BYTES = 8 * 1024
MAX_GROUP = 16  # members of one all-reduce at most
MAX_NAME = 64
MAX_WAIT_S = 600.0
CLOCK_SKEW_S = 300.0
MAX_START_DELAY_S = 86_400.0


def run_key(run_id: str) -> str:
    return f"/{RUN_NAMESPACE}/{run_id}"


def run_id_of(value: bytes) -> str:
    return hashlib.sha256(value).hexdigest()


@dataclasses.dataclass(frozen=True)
class RunRecord:
    run_id: str
    starter: str  # peer id
    name: str
    created: float
    recipe: Recipe
    aggregator: str = "centered_clip"
    gather_s: float = 20.0
    part_wait_s: float = 20.0
    check_rate: float = 0.25
    max_group: int = MAX_GROUP
    start: float = 0.0  # unix seconds: round 0 begins then
    init: str = ""  # the initial weights' model id ("": the model built from the recipe's seed)


def make_run(recipe: Recipe, key_pair: KeyPair, *, name: str, aggregator: str = "centered_clip",
             gather_s: float = 20.0, part_wait_s: float = 20.0, check_rate: float = 0.25,
             max_group: int = MAX_GROUP, start_in_s: float = 0.0, init: str = "",
             now: float | None = None) -> tuple[RunRecord, bytes]:
    """A new run's record and its sealed bytes (checked as a reader would); round 0
    begins `start_in_s` after now."""
    from libp2p.peer.id import ID

    created = time.time() if now is None else now
    body = {"v": RUN_VERSION, "peer": ID.from_pubkey(key_pair.public_key).to_base58(), "name": name,
            "created": created, "recipe": recipe.to_wire(), "aggregator": aggregator, "gather_s": gather_s,
            "part_wait_s": part_wait_s, "check_rate": check_rate, "max_group": max_group,
            "start": created + start_in_s, "init": init}
    value = seal(body, key_pair)
    run_id = run_id_of(value)
    return parse_run(run_key(run_id), value, now=now), value


def parse_run(key: str, value: bytes, *, now: float | None = None) -> RunRecord:
    """Key, hash, signature, then schema; raise PeerMisbehaved."""
    parts = key.split("/")
    if len(parts) != 3 or parts[0] != "" or parts[1] != RUN_NAMESPACE or len(parts[2]) != 64:
        raise PeerMisbehaved(f"not a run record key: {key!r}")
    if not isinstance(value, bytes | bytearray) or run_id_of(bytes(value)) != parts[2]:
        raise PeerMisbehaved("run record does not hash to its key")
    signer = signer_of(bytes(value))
    if signer is None:
        raise PeerMisbehaved("run record names no signer")
    body = open_sealed(bytes(value), signer, max_bytes=MAX_RUN_RECORD_BYTES, what="run record")
    if body.get("v") != RUN_VERSION:
        raise PeerMisbehaved("run record of an unknown version")
    what = "run record"
    recipe_wire = field(body, "recipe", dict, what)
    record = RunRecord(
        run_id=parts[2], starter=signer, name=field(body, "name", str, what),
        created=float(field(body, "created", (int, float), what)), recipe=Recipe.from_wire(recipe_wire),
        aggregator=field(body, "aggregator", str, what),
        gather_s=float(field(body, "gather_s", (int, float), what)),
        part_wait_s=float(field(body, "part_wait_s", (int, float), what)),
        check_rate=float(field(body, "check_rate", (int, float), what)),
        max_group=field(body, "max_group", int, what), start=float(field(body, "start", (int, float), what)),
        init=field(body, "init", str, what))
    if set(body) != {"v", "peer", "name", "created", "recipe", "aggregator", "gather_s", "part_wait_s",
                     "check_rate", "max_group", "start", "init"}:
        raise PeerMisbehaved("run record has unknown fields")
    _check_ranges(record, time.time() if now is None else now)
    return record


def _check_ranges(record: RunRecord, now: float) -> None:
    if len(record.name) > MAX_NAME:
        raise PeerMisbehaved(f"a run's name is at most {MAX_NAME} characters")
    if record.aggregator not in AGGREGATORS:
        raise PeerMisbehaved(f"run aggregator {record.aggregator!r} is not one of {AGGREGATORS}")
    if not all(math.isfinite(x) for x in (record.created, record.gather_s, record.part_wait_s, record.check_rate,
                                          record.start)):
        raise PeerMisbehaved("run record has a non-finite number")
    if not (0.5 <= record.gather_s <= MAX_WAIT_S and 0.5 <= record.part_wait_s <= MAX_WAIT_S):
        raise PeerMisbehaved(f"run waits must be within 0.5..{MAX_WAIT_S:.0f} s")
    if not 0.0 <= record.check_rate <= 1.0:
        raise PeerMisbehaved("check_rate must be within 0..1")
    if not 2 <= record.max_group <= MAX_GROUP:
        raise PeerMisbehaved(f"max_group must be within 2..{MAX_GROUP}")
    if record.created > now + CLOCK_SKEW_S:
        raise PeerMisbehaved("run record created in the future")
    if record.init and (len(record.init) != 64 or not set(record.init) <= set("0123456789abcdef")):
        raise PeerMisbehaved("a run's init is a model id (64 hex digits) or empty")
    if not record.created <= record.start <= record.created + MAX_START_DELAY_S:
        raise PeerMisbehaved("a run starts between its creation and a day later")


def run_validators() -> dict[str, SignedRecordValidator]:
    """The DHT validator of run records: every copy of one key is the same bytes."""
    return {RUN_NAMESPACE: SignedRecordValidator(parse_run, _first_valid)}


def _first_valid(key: str, values: list[bytes]) -> int:
    for index, value in enumerate(values):
        try:
            parse_run(key, value)
            return index
        except PeerMisbehaved:
            continue
    return 0
