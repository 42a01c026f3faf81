"""A relay's quotas: who may reserve, open circuits and move bytes, and for how long.
Pure, no I/O: net/relay.py asks before every reservation, circuit and chunk.

Each of the four kinds has a per-peer and a total limit; a request over one is
refused with the kind and a reason (the relay answers RESOURCE_LIMIT_EXCEEDED with
that reason, or resets the circuit mid-stream for bytes and duration).

  reservation   slots held (one per peer; `reservations` in total), each for `reservation_ttl_s`
  circuit       open circuits per peer (as either end) and in total
  bytes         per circuit, and per peer and in total within the last `window_s`
  duration      a circuit's lifetime

Defaults (config.RelayQuotas) are sized for relayed inference: a SmolLM2 hidden state is
2.3 KB per token per hop, so a 2,000-token session moves ~10 MB each way through
each relayed hop; 256 MiB per circuit is ~25 such sessions, and a NAT'd server
that stays relayed because hole punching failed opens a new circuit when one ends.
"""

from __future__ import annotations

import collections
import dataclasses

from ..config import RelayQuotas

KINDS = ("reservation", "circuit", "bytes", "duration")
__all__ = ["KINDS", "Circuit", "RelayLedger", "RelayQuotas", "Refusal"]


@dataclasses.dataclass(frozen=True)
class Refusal:
    # one of KINDS, or no quota involved: "no_reservation" (the target holds no slot),
    # "invalid" (a circuit from a peer to itself)
    kind: str
    reason: str


@dataclasses.dataclass
class Circuit:
    src: str
    dst: str
    opened: float
    moved: int = 0  # bytes, both directions
    refused: Refusal | None = None  # once refused, a circuit stays refused (counted once, not per direction)

    def ends(self) -> tuple[str, str]:
        return (self.src, self.dst)


class RelayLedger:
    """The relay's accounts. Every method takes `now` (monotonic seconds)."""

    def __init__(self, quotas: RelayQuotas = RelayQuotas()) -> None:
        self.quotas = quotas
        self.reservations: dict[str, float] = {}  # peer -> expiry
        self.circuits: set[int] = set()
        self._circuits: dict[int, Circuit] = {}
        self._next_id = 0
        self._per_peer_circuits: collections.Counter[str] = collections.Counter()
        # (time, bytes) samples for the sliding window, per peer and in total
        self._peer_window: dict[str, collections.deque[tuple[float, int]]] = {}
        self._total_window: collections.deque[tuple[float, int]] = collections.deque()
        self._peer_sum: collections.Counter[str] = collections.Counter()
        self._total_sum = 0
        self.relayed_bytes = 0  # ever, through every circuit: this node's relaying contribution
        self.circuits_opened = 0
        self.refusals: collections.Counter[str] = collections.Counter()  # kind -> count
        self.last_refusal: dict[str, str] = {}  # kind -> reason

    # -- reservations -------------------------------------------------------

    def reserve(self, peer: str, now: float) -> Refusal | float:
        """A slot for `peer` (a new one or its own renewed): its expiry, or a refusal."""
        self._expire_reservations(now)
        if peer not in self.reservations and len(self.reservations) >= self.quotas.reservations:
            return self._refuse("reservation", f"all {self.quotas.reservations} reservation slots are taken")
        expiry = now + self.quotas.reservation_ttl_s
        self.reservations[peer] = expiry
        return expiry

    def holds_reservation(self, peer: str, now: float) -> bool:
        return self.reservations.get(peer, -1.0) > now

    def release_reservation(self, peer: str) -> None:
        self.reservations.pop(peer, None)

    def _expire_reservations(self, now: float) -> None:
        for peer in [p for p, expiry in self.reservations.items() if expiry <= now]:
            del self.reservations[peer]

    # -- circuits -----------------------------------------------------------

    def open(self, src: str, dst: str, now: float) -> Refusal | int:
        """A circuit from `src` to `dst` (which must hold a reservation): its id, or a refusal."""
        if src == dst:
            return Refusal("invalid", "a circuit from a peer to itself")
        if not self.holds_reservation(dst, now):
            return Refusal("no_reservation", f"{dst} holds no reservation on this relay")  # no quota involved
        if len(self._circuits) >= self.quotas.circuits:
            return self._refuse("circuit", f"all {self.quotas.circuits} circuits are open")
        for peer in (src, dst):
            if self._per_peer_circuits[peer] >= self.quotas.circuits_per_peer:
                return self._refuse("circuit", f"{peer} is an end of {self.quotas.circuits_per_peer} open circuits")
        self._roll_window(now)
        for peer in (src, dst):
            if self._peer_sum[peer] >= self.quotas.peer_bytes:
                return self._refuse("bytes", f"{peer} moved its {self.quotas.peer_bytes} bytes of this window")
        if self._total_sum >= self.quotas.total_bytes:
            return self._refuse("bytes", f"this relay moved its {self.quotas.total_bytes} bytes of this window")
        circuit_id = self._next_id
        self._next_id += 1
        self._circuits[circuit_id] = Circuit(src, dst, now)
        self.circuits.add(circuit_id)
        for peer in (src, dst):
            self._per_peer_circuits[peer] += 1
        self.circuits_opened += 1
        return circuit_id

    def ends_of(self, circuit_id: int) -> tuple[str, str] | None:
        circuit = self._circuits.get(circuit_id)
        return None if circuit is None else circuit.ends()

    def deadline(self, circuit_id: int) -> float:
        return self._circuits[circuit_id].opened + self.quotas.circuit_duration_s

    def carry(self, circuit_id: int, nbytes: int, now: float) -> Refusal | None:
        """Account `nbytes` read from one end of a circuit before they are passed on:
        None, or a refusal (the circuit must then be closed, the bytes dropped; it
        stays refused, and the refusal is counted once)."""
        circuit = self._circuits[circuit_id]
        if circuit.refused is None:
            circuit.refused = self._over(circuit, nbytes, now)
        if circuit.refused is not None:
            return circuit.refused
        circuit.moved += nbytes
        self.relayed_bytes += nbytes
        for peer in set(circuit.ends()):
            _add(self._peer_window.setdefault(peer, collections.deque()), now, nbytes)
            self._peer_sum[peer] += nbytes
        _add(self._total_window, now, nbytes)
        self._total_sum += nbytes
        return None

    def _over(self, circuit: Circuit, nbytes: int, now: float) -> Refusal | None:
        if now >= circuit.opened + self.quotas.circuit_duration_s:
            return self._refuse("duration", f"circuit open for its {self.quotas.circuit_duration_s} s")
        if circuit.moved + nbytes > self.quotas.circuit_bytes:
            return self._refuse("bytes", f"circuit moved its {self.quotas.circuit_bytes} bytes")
        self._roll_window(now)
        for peer in circuit.ends():
            if self._peer_sum[peer] + nbytes > self.quotas.peer_bytes:
                return self._refuse("bytes", f"{peer} moved its {self.quotas.peer_bytes} bytes of this window")
        if self._total_sum + nbytes > self.quotas.total_bytes:
            return self._refuse("bytes", f"this relay moved its {self.quotas.total_bytes} bytes of this window")
        return None

    def close(self, circuit_id: int) -> None:
        circuit = self._circuits.pop(circuit_id, None)
        if circuit is None:
            return
        self.circuits.discard(circuit_id)
        for peer in circuit.ends():
            self._per_peer_circuits[peer] -= 1
            if self._per_peer_circuits[peer] <= 0:
                del self._per_peer_circuits[peer]

    def _roll_window(self, now: float) -> None:
        start = now - self.quotas.window_s
        while self._total_window and self._total_window[0][0] <= start:
            self._total_sum -= self._total_window.popleft()[1]
        for peer in list(self._peer_window):
            samples = self._peer_window[peer]
            while samples and samples[0][0] <= start:
                self._peer_sum[peer] -= samples.popleft()[1]
            if not samples:
                del self._peer_window[peer]
                self._peer_sum.pop(peer, None)

    def _refuse(self, kind: str, reason: str) -> Refusal:
        self.refusals[kind] += 1
        self.last_refusal[kind] = reason
        return Refusal(kind, reason)

    def stats(self) -> dict:
        return {
            "reservations": len(self.reservations),
            "circuits_open": len(self._circuits),
            "circuits_opened": self.circuits_opened,
            "relayed_bytes": self.relayed_bytes,
            "refusals": {kind: self.refusals[kind] for kind in KINDS},
        }


def _add(window: collections.deque, now: float, nbytes: int) -> None:
    """Bytes into a sliding window in one-second buckets: its length is bounded by
    the window's seconds, however small the chunks a peer sends."""
    second = float(int(now))
    if window and window[-1][0] == second:
        window[-1] = (second, window[-1][1] + nbytes)
    else:
        window.append((second, nbytes))
