"""net/relay_quota.py: every quota kind refuses past its limit, per peer and in total,
and the ledger's accounts stay consistent under any sequence of operations."""

from __future__ import annotations

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from compushare.config import RelayQuotas
from compushare.net.relay_quota import KINDS, Refusal, RelayLedger


def ledger(**quotas) -> RelayLedger:
    return RelayLedger(RelayQuotas(**quotas))


def test_reservations_refuse_past_the_total_but_renew_ones_own():
    led = ledger(reservations=2, reservation_ttl_s=100)
    assert led.reserve("a", 0.0) == 100.0 and led.reserve("b", 0.0) == 100.0
    refused = led.reserve("c", 1.0)
    assert isinstance(refused, Refusal) and refused.kind == "reservation"
    assert led.reserve("a", 50.0) == 150.0  # a renewal is never refused
    assert led.reserve("c", 101.0) == 201.0  # b's slot lapsed at 100
    assert led.refusals["reservation"] == 1


def test_circuits_need_a_reservation_and_refuse_past_per_peer_and_total():
    led = ledger(circuits_per_peer=2, circuits=3)
    assert led.open("src", "dst", 0.0).kind == "no_reservation"
    assert led.refusals["circuit"] == 0  # no quota was involved
    for peer in ("d1", "d2"):
        led.reserve(peer, 0.0)
    c1, c2 = led.open("s", "d1", 0.0), led.open("s", "d1", 0.0)
    assert isinstance(c1, int) and isinstance(c2, int)
    per_peer = led.open("t", "d1", 0.0)
    assert per_peer.kind == "circuit" and "d1" in per_peer.reason
    c3 = led.open("t", "d2", 0.0)
    assert isinstance(c3, int)
    assert led.open("u", "d2", 0.0).reason.startswith("all 3 circuits")
    led.close(c1)
    assert isinstance(led.open("u", "d2", 0.0), int)


def test_bytes_refuse_per_circuit_per_peer_and_in_total_within_a_window():
    led = ledger(circuit_bytes=100, peer_bytes=150, total_bytes=250, window_s=10)
    for peer in ("d1", "d2", "d3"):
        led.reserve(peer, 0.0)
    c = led.open("s", "d1", 0.0)
    assert led.carry(c, 100, 0.0) is None
    assert led.carry(c, 1, 0.0).reason == "circuit moved its 100 bytes"
    c2 = led.open("s2", "d1", 0.0)
    assert led.carry(c2, 60, 1.0).kind == "bytes"  # d1 would be at 160 of 150 in this window
    c3 = led.open("s3", "d2", 0.0)
    assert led.carry(c3, 100, 1.0) is None
    c4 = led.open("s4", "d3", 0.0)
    assert led.carry(c4, 60, 1.0).reason.startswith("this relay moved its 250")
    assert led.carry(c2, 1, 11.0).kind == "bytes"  # a refused circuit stays refused...
    assert led.refusals["bytes"] == 3  # ...and is counted once
    c5 = led.open("s5", "d1", 11.0)
    assert led.carry(c5, 60, 11.0) is None  # the window moved on
    assert led.relayed_bytes == 260 and led.refusals["bytes"] == 3


def test_a_circuit_is_refused_past_its_duration():
    led = ledger(circuit_duration_s=30)
    led.reserve("d", 0.0)
    c = led.open("s", "d", 5.0)
    assert led.deadline(c) == 35.0
    assert led.carry(c, 10, 34.0) is None
    assert led.carry(c, 0, 35.0).kind == "duration"


def test_quotas_must_be_positive():
    with pytest.raises(ValueError):
        RelayQuotas(circuits=0)


class LedgerMachine(RuleBasedStateMachine):
    """Whatever happens, open circuits never exceed their quotas and the per-peer
    counts add up to the open circuits."""

    def __init__(self):
        super().__init__()
        self.led = ledger(reservations=3, circuits=4, circuits_per_peer=2, circuit_bytes=500, peer_bytes=800,
                          total_bytes=1500, window_s=20, circuit_duration_s=15, reservation_ttl_s=40)
        self.now = 0.0
        self.open_ids: list[int] = []

    @rule(dt=st.floats(0, 5))
    def tick(self, dt):
        self.now += dt

    @rule(peer=st.sampled_from("abcde"))
    def reserve(self, peer):
        self.led.reserve(peer, self.now)

    @rule(src=st.sampled_from("abcde"), dst=st.sampled_from("abcde"))
    def open(self, src, dst):
        got = self.led.open(src, dst, self.now)
        if isinstance(got, int):
            self.open_ids.append(got)

    @precondition(lambda self: self.open_ids)
    @rule(i=st.integers(0, 100), n=st.integers(0, 300))
    def carry(self, i, n):
        self.led.carry(self.open_ids[i % len(self.open_ids)], n, self.now)

    @precondition(lambda self: self.open_ids)
    @rule(i=st.integers(0, 100))
    def close(self, i):
        self.led.close(self.open_ids.pop(i % len(self.open_ids)))

    @invariant()
    def within_quotas(self):
        q = self.led.quotas
        assert len(self.led.circuits) <= q.circuits
        assert all(n <= q.circuits_per_peer for n in self.led._per_peer_circuits.values())
        ends = sum(2 for _ in self.led.circuits)
        assert sum(self.led._per_peer_circuits.values()) == ends
        assert all(c.moved <= q.circuit_bytes for c in self.led._circuits.values())
        assert self.led._total_sum <= q.total_bytes
        assert set(self.led.stats()["refusals"]) == set(KINDS)


TestLedgerMachine = LedgerMachine.TestCase
