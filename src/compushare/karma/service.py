"""Karma on the network: `/compushare/karma/1.0.0`, the ledger record in the DHT,
and reading anyone's score from both.

A node serves its receipts (to whoever checks its record) and the failure reports
it holds (to whoever checks the accused), and takes reports from consumers (which
may be short-lived: the witness of a report keeps it available). Every request is
one frame and one reply on its own stream.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import time
from pathlib import Path

import trio
from libp2p.abc import IHost, INetStream
from libp2p.crypto.keys import KeyPair
from libp2p.kad_dht.kad_dht import KadDHT
from libp2p.peer.id import ID

from .. import wire
from ..errors import FrameError, PeerMisbehaved
from ..net.dht import find_provider_infos_fresh, get_value_fresh
from ..net.dial import dial
from ..net.framing import FramedStream, request_reply
from ..net.host import advertised_addrs
from ..net.serve import GuardedHandler
from ..proofs.reports import Report, parse_report
from .ledger import ReceiptBook, ReportStore
from .receipts import MAX_RECEIPT_BYTES
from .record import KarmaRecord, check_evidence, karma_key, make_record, parse_karma_record
from .rules import Tally, score, verified_reports

log = logging.getLogger(__name__)

KARMA_PROTOCOL = wire.KARMA
MAX_FRAME = 1 << 20
PAGE = 512  # receipts per "receipts" reply at most...
REPLY_BYTES = 768 * 1024  # ...and items of at most this many bytes in one reply (under MAX_FRAME)
MAX_REPORTS_REPLY = 32
MAX_EVIDENCE = 1_000_000  # receipts a reader fetches for one record at most
REQUEST_TIMEOUT_S = 10.0
RECORD_TTL_S = 3600.0
REPUBLISH_S = 600.0  # the record is re-put this often, and soon after a new receipt
DEBOUNCE_S = 2.0
PROVIDE_REPORTS_S = 600.0
RETRY_S = 5.0  # a failed put or provide is tried again this soon, doubling up to the period
MAX_STREAMS_PER_PEER = 4  # concurrent karma requests one peer may have served (more are reset)


def reports_key(peer_id: str) -> str:
    """Provider key: "holds failure reports against this peer"."""
    return hashlib.sha256(f"{wire.REPORTS_KEY}{peer_id}".encode()).hexdigest()


class KarmaService:
    """One node's karma: its ledger, the reports it keeps, its DHT record."""

    def __init__(self, host: IHost, dht: KadDHT, key_pair: KeyPair, data_dir: Path) -> None:
        self.host, self.dht, self.key_pair = host, dht, key_pair
        self.peer_id = host.get_id().to_string()
        self.receipts = ReceiptBook(key_pair, data_dir, on_change=lambda: self._changed.set())
        self.reports = ReportStore(data_dir)
        self.record: KarmaRecord | None = None
        self.signed_record: bytes | None = None  # what we last put in the DHT
        self._changed = trio.Event()
        self._new_reports = trio.Event()
        # The stream handler (host.set_stream_handler(KARMA_PROTOCOL, service.handle)):
        # at most MAX_STREAMS_PER_PEER of one peer's requests at once, more are reset.
        self.handle = GuardedHandler(self._serve, per_peer=MAX_STREAMS_PER_PEER)

    def keep_report(self, report: Report) -> bool:
        """Keep a checked report and advertise it; False if not kept (known, or full)."""
        new = self.reports.add(report)
        if new:
            self._new_reports.set()
        return new

    # -- publishing -------------------------------------------------------------------

    async def publish_once(self) -> KarmaRecord:
        now = time.time()
        seq = max(time.time_ns(), (self.record.seq + 1) if self.record else 0)
        entries = list(self.receipts.ledger.entries)
        record = await trio.to_thread.run_sync(
            lambda: make_record(self.peer_id, entries, seq=seq, now=now, ttl_s=RECORD_TTL_S,
                                addrs=tuple(advertised_addrs(self.host))))
        value = record.sign(self.key_pair)
        self.record, self.signed_record = record, value  # served at once, even if the put fails
        await self.dht.put_value(karma_key(self.peer_id), value)
        return record

    async def publish_loop(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        started, failures = False, 0
        while True:
            self._changed = trio.Event()
            try:
                with trio.fail_after(60):
                    record = await self.publish_once()
                log.debug("karma record: %d receipts, %.0f ms, score %.3f", record.count, record.compute_ms,
                          record.score)
                failures = 0
            except Exception as exc:  # the DHT may be empty or slow: try again soon
                log.info("publishing the karma record failed: %s", exc)
                failures += 1
            if not started:
                task_status.started()
                started = True
            with trio.move_on_after(retry_wait(failures, REPUBLISH_S)):
                await self._changed.wait()
                await trio.sleep(DEBOUNCE_S)  # a burst of receipts makes one record

    async def provide_reports_loop(self) -> None:
        """Provider records for every peer we hold reports against (py-libp2p keeps
        them 24 h): re-sent on a new report and every PROVIDE_REPORTS_S, and soon
        again (RETRY_S, doubling) while one of them reached no peer."""
        failures = 0
        while True:
            self._new_reports = trio.Event()
            accused = await trio.to_thread.run_sync(self.reports.accused)
            reached = True
            for peer in sorted(accused):
                stored = False
                with contextlib.suppress(Exception), trio.move_on_after(30):
                    stored = await self.dht.provide(reports_key(peer))  # False: no peer took it
                reached = reached and stored is True
            failures = 0 if reached else failures + 1
            if not reached:
                log.info("advertising failure reports reached no peer; trying again")
            with trio.move_on_after(retry_wait(failures, PROVIDE_REPORTS_S)):
                await self._new_reports.wait()

    # -- serving ----------------------------------------------------------------------

    async def _serve(self, stream: INetStream) -> None:
        """One request, one reply (task boundary: never raises)."""
        framed = FramedStream(stream, MAX_FRAME)
        try:
            with trio.fail_after(REQUEST_TIMEOUT_S):
                try:
                    request = await framed.receive()
                    reply = await self._answer(request)
                except (FrameError, PeerMisbehaved) as exc:
                    reply = {"type": "error", "code": getattr(exc, "code", "bad_request"), "message": str(exc)}
                await framed.send(reply)
                await framed.close()
        except Exception as exc:  # a handler must not raise into py-libp2p's connection task
            log.debug("karma request failed: %s", exc)
            with contextlib.suppress(Exception):
                await framed.reset()

    async def _answer(self, request: dict | None) -> dict:
        kind = request.get("type") if request else None
        if kind == "record":
            return {"type": "record", "value": self.signed_record}
        if kind == "receipts":
            count, offset, limit = (_natural(request, name) for name in ("count", "offset", "limit"))
            entries = self.receipts.ledger.entries[:count]
            return {"type": "receipts", "total": len(entries),
                    "items": _budget(entries[offset:offset + min(limit, PAGE)], PAGE)}
        if kind == "reports":
            peer = request.get("peer")
            if not isinstance(peer, str):
                raise PeerMisbehaved("'peer' must be a peer id")
            items = await trio.to_thread.run_sync(self.reports.against, peer)
            return {"type": "reports", "items": _budget(items, MAX_REPORTS_REPLY)}
        if kind == "report":
            report = parse_report(request.get("report"))
            # Only a report this node witnessed: anyone could mint reports between two
            # throwaway keys, and a node keeps and advertises only what it can vouch for.
            if report.witness.peer_id != self.peer_id:
                raise PeerMisbehaved("this node is not the witness of that report")
            await trio.to_thread.run_sync(report.check)
            return {"type": "kept", "new": self.keep_report(report)}
        raise PeerMisbehaved(f"unknown karma request {kind!r}")


def retry_wait(failures: int, period: float) -> float:
    """How long a publishing loop waits: its period after a success; after the
    n-th failure in a row RETRY_S * 2**(n-1), at most the period."""
    return period if failures == 0 else min(period, RETRY_S * 2 ** (failures - 1))


def _budget(items: list[bytes], most: int) -> list[bytes]:
    """The first items (at most `most`) that fit REPLY_BYTES together; at least one
    if it fits a frame, so a page always makes progress."""
    taken, size = [], 0
    for item in items[:most]:
        size += len(item) + 8
        if size > REPLY_BYTES and taken:
            break
        taken.append(item)
    return taken


def _natural(request: dict, name: str) -> int:
    value = request.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise PeerMisbehaved(f"{name!r} must be a non-negative integer")
    return value


# -- reading anyone's karma -------------------------------------------------------------


async def _ask(host: IHost, peer: ID, request: dict, addrs: tuple[str, ...] = ()) -> dict:
    with trio.fail_after(REQUEST_TIMEOUT_S):
        if addrs and peer not in host.get_network().connections:
            for addr in addrs:
                with contextlib.suppress(Exception):
                    await dial(host, peer, [addr], timeout=REQUEST_TIMEOUT_S)
                    break
        reply = await request_reply(host, peer, KARMA_PROTOCOL, request, MAX_FRAME)
    if reply is None or reply.get("type") == "error":
        raise PeerMisbehaved(f"{peer} refused a karma request: {reply and reply.get('message')}")
    return reply


async def fetch_receipts(host: IHost, record: KarmaRecord) -> list[bytes]:
    """The receipts `record` commits to, page by page from its owner."""
    if record.count > MAX_EVIDENCE:
        raise PeerMisbehaved(f"{record.peer_id}'s record commits to {record.count} receipts, over {MAX_EVIDENCE}")
    peer = ID.from_base58(record.peer_id)
    items: list[bytes] = []
    while len(items) < record.count:
        reply = await _ask(host, peer, {"type": "receipts", "count": record.count, "offset": len(items),
                                        "limit": PAGE}, record.addrs)
        page = reply.get("items")
        if (not isinstance(page, list) or not page or len(page) > min(PAGE, record.count - len(items))
                or not all(isinstance(i, bytes) and len(i) <= MAX_RECEIPT_BYTES for i in page)):
            raise PeerMisbehaved(f"{record.peer_id} sent a malformed page of receipts")
        items.extend(page)
    return items


async def submit_report(host: IHost, peer: str, report: Report, addrs: tuple[str, ...] = ()) -> bool:
    """Hand `report` to `peer` (dialled at `addrs` first if not connected); True if new to it."""
    reply = await _ask(host, ID.from_base58(peer), {"type": "report", "report": report.to_wire()}, addrs)
    return reply.get("new") is True


async def fetch_reports(host: IHost, dht: KadDHT, accused: str) -> list[bytes]:
    """Every failure report against `accused` that the peers providing them hand out."""
    holders = await find_provider_infos_fresh(dht, reports_key(accused))
    found: list[bytes] = []

    async def one(peer: ID, addrs: tuple[str, ...]) -> None:
        with contextlib.suppress(Exception):
            reply = await _ask(host, peer, {"type": "reports", "peer": accused}, addrs)
            items = reply.get("items")
            if isinstance(items, list):
                found.extend(i for i in items[:MAX_REPORTS_REPLY] if isinstance(i, bytes))

    async with trio.open_nursery() as nursery:
        for peer, info in holders.items():
            nursery.start_soon(one, peer, tuple(str(a) for a in info.addrs))
    return found


@dataclasses.dataclass
class KarmaReport:
    """One peer's karma as a reader computed it from the DHT and the evidence."""

    peer_id: str
    score: float
    compute_ms: float = 0.0
    receipts: int = 0  # committed to by the record
    counted: int = 0
    reports: int = 0  # verified failure reports applied
    record: KarmaRecord | None = None
    problem: str = ""  # why the record was not used ("" if it was, or there was none)
    rejected: dict = dataclasses.field(default_factory=dict)

    def to_wire(self) -> dict:
        return {"peer_id": self.peer_id, "score": self.score, "compute_ms": self.compute_ms,
                "receipts": self.receipts, "counted": self.counted, "failure_reports": self.reports,
                "record_seq": self.record.seq if self.record else None,
                "record_issued": self.record.issued if self.record else None, "problem": self.problem,
                "rejected": self.rejected}


async def karma_of(host: IHost, dht: KadDHT, peer_id: str) -> KarmaReport:
    """Fetch `peer_id`'s record, check it against its receipts, apply the verified
    failure reports against it. A missing record, or one its evidence does not bear
    out, leaves the peer at the newcomer's 1.0 (reports still apply)."""
    key = karma_key(peer_id)
    record: KarmaRecord | None = None
    counted: Tally | None = None
    problem = ""
    wires: list[bytes] = []

    async def get_record() -> None:
        nonlocal record, counted, problem
        try:
            found = [await get_value_fresh(dht, key, lambda v: parse_karma_record(key, v),
                                           newest=lambda r: r.seq, drop_cached=peer_id != dht.local_peer_id.to_string())]
            # The owner holds its latest record: a DHT copy may lag a republish.
            with contextlib.suppress(Exception):
                value = (await _ask(host, ID.from_base58(peer_id), {"type": "record"},
                                    found[0].addrs if found[0] else ())).get("value")
                found.append(parse_karma_record(key, value) if value is not None else None)
            record = max((r for r in found if r is not None), key=lambda r: r.seq, default=None)
            if record is None:
                problem = "no karma record in the DHT"
                return
            evidence = await fetch_receipts(host, record)
            counted = await trio.to_thread.run_sync(check_evidence, record, evidence)
        except Exception as exc:  # a peer's failure to show evidence, whatever form it takes
            problem = f"record rejected: {exc}" if record is not None else f"no usable record: {exc}"
            counted = None

    async def get_reports() -> None:
        with contextlib.suppress(Exception):  # no reports found is the same as none made
            wires.extend(await fetch_reports(host, dht, peer_id))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(get_record)
        nursery.start_soon(get_reports)
    reports = await trio.to_thread.run_sync(verified_reports, wires, peer_id)
    compute = counted.compute_ms if counted is not None else 0.0
    return KarmaReport(peer_id, score(compute, len(reports)), compute, record.count if record else 0,
                       counted.counted if counted else 0, len(reports), record if counted else None, problem,
                       dict(counted.rejected) if counted else {})


class KarmaBook:
    """Verified scores of the peers a consumer may route through, recomputed at most
    every MAX_AGE_S: routing breaks ties by them. A peer whose check failed (no
    record yet, unreachable) is tried again after RETRY_S, not on every refresh. It
    remembers at most MAX_PEERS peers: past that, what a check would redo anyway
    goes first (stale scores, old failures), then the oldest entries, so a stream
    of fresh identities cannot grow it."""

    MAX_AGE_S = 60.0
    RETRY_S = 30.0
    MAX_PEERS = 4096

    def __init__(self) -> None:
        self._scores: dict[str, tuple[float, float]] = {}  # peer -> (score, when)
        self._failed: dict[str, float] = {}  # peer -> when its last check failed

    def get(self, peer_id: str) -> float:
        return self._scores.get(peer_id, (1.0, 0.0))[0]

    def known(self, peer_id: str) -> float | None:
        """The checked score, None if not checked yet."""
        entry = self._scores.get(peer_id)
        return entry[0] if entry is not None else None

    def due(self, peers, now: float) -> list[str]:
        """The peers to check now: never checked, or checked too long ago, and not failed lately."""
        def is_due(peer: str) -> bool:
            if now - self._failed.get(peer, -self.RETRY_S) < self.RETRY_S:
                return False
            entry = self._scores.get(peer)
            return entry is None or now - entry[1] >= self.MAX_AGE_S
        return [p for p in peers if is_due(p)]

    def checked(self, peer_id: str, score: float | None, now: float) -> None:
        """A check's outcome (None: it failed)."""
        if score is None:
            self._failed[peer_id] = now
        else:
            self._scores[peer_id] = (score, now)
            self._failed.pop(peer_id, None)
        if len(self._scores) + len(self._failed) > self.MAX_PEERS:
            self._forget(now)

    def _forget(self, now: float) -> None:
        for peer in [p for p, when in self._failed.items() if now - when >= self.RETRY_S]:
            del self._failed[peer]
        for peer in [p for p, (_, when) in self._scores.items() if now - when >= self.MAX_AGE_S]:
            del self._scores[peer]
        surplus = len(self._scores) + len(self._failed) - self.MAX_PEERS
        if surplus > 0:  # all fresh: the oldest go, failures first
            oldest = sorted(self._failed, key=self._failed.get)[:surplus]
            for peer in oldest:
                del self._failed[peer]
            for peer in sorted(self._scores, key=lambda p: self._scores[p][1])[:surplus - len(oldest)]:
                del self._scores[peer]

    async def refresh(self, host: IHost, dht: KadDHT, peers, *, timeout_s: float) -> None:
        """Check the peers that are due, for at most `timeout_s`."""
        async def one(peer: str) -> None:
            try:
                score = (await karma_of(host, dht, peer)).score
            except Exception:  # no evidence to be had now: as unknown, retried later
                score = None
            self.checked(peer, score, time.monotonic())

        with trio.move_on_after(timeout_s):
            async with trio.open_nursery() as nursery:
                for peer in self.due(peers, time.monotonic()):
                    nursery.start_soon(one, peer)
