"""The node's own karma evidence on disk: its countersigned receipts and the
failure reports it holds.

Receipts live in one append-only file, `<data dir>/karma/receipts.bin`: each entry
a 4-byte big-endian length and the receipt's wire bytes, written with one write()
and fsync'd. Append-only matters: a published record commits to the first `count`
entries, and those must stay what they were. A torn last entry (a crash mid-write)
is cut off on load. Reports are files `<data dir>/reports/<sha256>.msgpack`.
"""

from __future__ import annotations

import os
import struct
import time
from pathlib import Path

from libp2p.crypto.keys import KeyPair
from libp2p.peer.id import ID

from ..errors import PeerMisbehaved
from ..pipeline.proofs import FailureReport
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
        self._load()

    def _load(self) -> None:
        if not self.path.exists():
            return
        data = self.path.read_bytes()
        offset = 0
        while offset + LENGTH.size <= len(data):
            (length,) = LENGTH.unpack_from(data, offset)
            end = offset + LENGTH.size + length
            if length > MAX_RECEIPT_BYTES or end > len(data):
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
        self.on_change = on_change

    def accept(self, wire: bytes, receipt: Receipt) -> bytes:
        signed = countersign(wire, self.key_pair.private_key)
        self.ledger.append(signed, receipt)
        self.on_change()
        return signed

    def tally(self, now: float | None = None) -> Tally:
        return tally(self.ledger.entries, self.peer_id, as_of=time.time() if now is None else now)


class ReportStore:
    """Failure reports this node filed or was given, each checked before it is kept."""

    def __init__(self, data_dir: Path) -> None:
        self.folder = data_dir / "reports"

    def add(self, report: FailureReport) -> bool:
        """Keep a report (check() it first); False if it was here already."""
        path = self.folder / f"{report.digest}.msgpack"
        if path.exists():
            return False
        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(report.to_wire())
        os.replace(tmp, path)
        return True

    def all(self) -> list[bytes]:
        if not self.folder.is_dir():
            return []
        return [p.read_bytes() for p in sorted(self.folder.glob("*.msgpack"))]

    def against(self, peer_id: str) -> list[bytes]:
        """The reports accusing `peer_id` (unchecked: readers check every one)."""
        found = []
        for wire in self.all():
            try:
                if FailureReport.from_wire(wire).accused.peer_id == peer_id:
                    found.append(wire)
            except PeerMisbehaved:
                continue
        return found

    def accused(self) -> set[str]:
        peers = set()
        for wire in self.all():
            try:
                peers.add(FailureReport.from_wire(wire).accused.peer_id)
            except PeerMisbehaved:
                continue
        return peers
