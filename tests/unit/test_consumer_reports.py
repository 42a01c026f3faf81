"""A consumer hands each failure report to its witness, dialling it again and
retrying where the connection went (CI stop 60: one try, and a report was lost to karma)."""

from __future__ import annotations

import types

import pytest
import trio

from compushare.pipeline.client import consumer as consumer_module
from compushare.pipeline.client.consumer import REPORT_SUBMIT_ATTEMPTS, Consumer

WITNESS = "12D3KooWMU2sjPgCU78thTRWcTtzfqG8BGMV1DiTH4Kk3evg5TRr"


class _Peerstore:
    def addrs(self, peer):
        assert peer.to_base58() == WITNESS
        return ["/ip4/127.0.0.1/tcp/4001"]


def _consumer(tmp_path):
    host = types.SimpleNamespace(get_peerstore=_Peerstore)
    return types.SimpleNamespace(host=host, data_dir=tmp_path, reports=[])


@pytest.fixture
def report(monkeypatch):
    monkeypatch.setattr(consumer_module, "ReportStore", lambda _dir: types.SimpleNamespace(add=lambda _r: None))
    return types.SimpleNamespace(witness=types.SimpleNamespace(peer_id=WITNESS), digest="ab" * 32)


@pytest.mark.parametrize("failures", [0, 2, REPORT_SUBMIT_ATTEMPTS])
async def test_a_report_is_handed_to_its_witness_retried_with_its_addresses(tmp_path, monkeypatch, report,
                                                                            autojump_clock, failures):
    calls = []

    async def submit(host, peer, sent, addrs=()):
        calls.append((peer, addrs, trio.current_time()))
        if len(calls) <= failures:
            raise ConnectionError("failed to open a stream to peer")
        return True

    monkeypatch.setattr(consumer_module, "submit_report", submit)
    me = _consumer(tmp_path)
    await Consumer._keep_report(me, report)  # never raises: the report stays kept here
    assert me.reports == [report]
    assert len(calls) == min(failures + 1, REPORT_SUBMIT_ATTEMPTS)
    assert all(peer == WITNESS and addrs == ("/ip4/127.0.0.1/tcp/4001",) for peer, addrs, _ in calls)
    waits = [b - a for (_, _, a), (_, _, b) in zip(calls, calls[1:])]
    assert waits == pytest.approx([1.0, 2.0][:len(waits)])
