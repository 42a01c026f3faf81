"""The node's own karma evidence on disk: its countersigned receipts and the
failure reports it holds.

Receipts live in one append-only file, `<data dir>/karma/receipts.bin`: each entry
a 4-byte big-endian length and the receipt's wire bytes, written with one write()
and fsync'd. Append-only matters: a published record commits to the first `count`
entries, and those must stay what they were. A torn last entry (a crash mid-write)
is cut off on load. Reports are files `<data dir>/reports/<sha256>.msgpack`.
"""

from __future__ import annotations

import contextlib
import os
import struct
import threading
import time
from pathlib import Path

import trio
from libp2p.crypto.keys import KeyPair
from libp2p.peer.id import ID

from ..errors import PeerMisbehaved
from ..proofs.reports import Report, parse_report
from .receipts import MAX_RECEIPT_BYTES, Receipt, countersign, parse_receipt
from .rules import Tally, tally

LENGTH = struct.Struct(">I")
RECEIPTS_FILE = "receipts.bin"


class Ledger:
    """This node's countersigned receipts, in the order it signed them."""

    def __init__(self, data_dir: Path) -> None:
        self.path = data_dir / "karma" / RECEIPTS_FILE
        self.entries: list[bytes] = []
        self.slots: set[tuple] = set()
        self._lock = threading.Lock()
        self._load()

    def _load(self) -> None:
        if not self.path.exists():
            return
        data = self.path.read_bytes()
        offset = 0
        while offset + LENGTH.size <= len(data):
            (length,) = LENGTH.unpack_from(data, offset)
            end = offset + LENGTH.size + length
            if end > len(data):  # (append never writes an entry over MAX_RECEIPT_BYTES)
                break
            wire = data[offset + LENGTH.size:end]
            self.entries.append(wire)
            try:
                self.slots.add(parse_receipt(wire).slot)
            except PeerMisbehaved:
                pass  # kept as written (the record commits to it); it counts for nothing
            offset = end
        if offset < len(data):  # a torn tail: drop it so the next append starts clean
            with open(self.path, "r+b") as handle:
                handle.truncate(offset)

    def __len__(self) -> int:
        return len(self.entries)

    def append(self, wire: bytes, receipt: Receipt) -> None:
        """Append one countersigned receipt (thread-safe); PeerMisbehaved if it is too
        large or its slot is taken (a reopened session id, a replay)."""
        if len(wire) > MAX_RECEIPT_BYTES:
            raise PeerMisbehaved(f"a countersigned receipt is at most {MAX_RECEIPT_BYTES} bytes")
        with self._lock:
            if receipt.slot in self.slots:
                raise PeerMisbehaved("this session's receipt of that seq is in the ledger already")
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, LENGTH.pack(len(wire)) + wire)
                os.fsync(fd)
            finally:
                os.close(fd)
            self.entries.append(wire)
            self.slots.add(receipt.slot)


class ReceiptBook:
    """The server's side of receipts: countersign one the inference server checked,
    keep it in the ledger, and say so (the DHT record is then republished)."""

    def __init__(self, key_pair: KeyPair, data_dir: Path, on_change=lambda: None) -> None:
        self.key_pair = key_pair
        self.peer_id = ID.from_pubkey(key_pair.public_key).to_base58()
        self.ledger = Ledger(data_dir)
        self.on_change = on_change  # called in the trio thread

    async def accept(self, wire: bytes, receipt: Receipt) -> bytes:
        """Countersign and keep (the fsync'd write in a worker thread). Raises
        PeerMisbehaved for a slot already receipted or an oversized receipt."""
        signed = countersign(wire, self.key_pair.private_key)
        await trio.to_thread.run_sync(self.ledger.append, signed, receipt)
        self.on_change()
        return signed

    def tally(self, now: float | None = None) -> Tally:
        return tally(self.ledger.entries, self.peer_id, as_of=time.time() if now is None else now)


class ReportStore:
    """Failure reports this node filed or witnessed, each checked before it is kept:
    at most one per (accused, witness) pair (readers count one per witness anyway)
    and at most MAX_REPORTS in all."""

    MAX_REPORTS = 1024

    def __init__(self, data_dir: Path) -> None:
        self.folder = data_dir / "reports"
        self._index: dict[str, tuple[str, str]] | None = None  # digest -> (accused, witness)

    def _load(self) -> dict[str, tuple[str, str]]:
        if self._index is None:
            self._index = {}
            for path in sorted(self.folder.glob("*.msgpack")) if self.folder.is_dir() else []:
                try:
                    report = parse_report(path.read_bytes())
                except (OSError, PeerMisbehaved):
                    continue
                self._index[path.stem] = (report.accused.peer_id, report.witness.peer_id)
        return self._index

    def add(self, report: Report) -> bool:
        """Keep a report (check() it first); False if this pair's report, or the
        most this store keeps, is here already."""
        index = self._load()
        pair = (report.accused.peer_id, report.witness.peer_id)
        if pair in index.values() or len(index) >= self.MAX_REPORTS:
            return False
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"{report.digest}.msgpack"
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(report.to_wire())
        os.replace(tmp, path)
        index[report.digest] = pair
        return True

    def against(self, peer_id: str) -> list[bytes]:
        """The reports accusing `peer_id` (readers check every one)."""
        found = []
        for digest, (accused, _) in sorted(self._load().items()):
            if accused == peer_id:
                with contextlib.suppress(OSError):
                    found.append((self.folder / f"{digest}.msgpack").read_bytes())
        return found

    def accused(self) -> set[str]:
        return {accused for accused, _ in self._load().values()}
