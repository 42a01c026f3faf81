"""A consumer's join while it loads its own parts: dials that time out while the
machine is busy loading are tried again once the load is done, before the swarm is
called unreachable."""

from __future__ import annotations

import threading

import pytest
import trio

from compushare.errors import SwarmUnreachable
from compushare.net import peer
from compushare.net.peer import SwarmHost
from compushare.pipeline.client import consumer
from compushare.pipeline.client.consumer import LocalParts


def _parts(tmp_path, monkeypatch, *, fails: Exception | None = None) -> LocalParts:
    parts = LocalParts(tmp_path, "smollm2-135m", True)
    parts.dials_done = threading.Event()

    def load() -> None:  # outlasts the first round of dials, as a real import and hashing can
        assert parts.dials_done.wait(30)
        parts.model, parts.error = "model", fails

    monkeypatch.setattr(parts, "load", load)
    return parts


def _bootstrap(monkeypatch, parts: LocalParts, *, answers_after_load: bool) -> list[bool]:
    tries: list[bool] = []  # whether the load was done at each attempt

    async def connect(host, dht, addrs) -> int:
        tries.append(parts.model is not None)
        if len(tries) == consumer.JOIN_ATTEMPTS:
            parts.dials_done.set()
        if parts.model is not None and answers_after_load:
            return 1
        raise SwarmUnreachable("none of 1 bootstrap peers answered")

    monkeypatch.setattr(peer, "connect_bootstrap", connect)
    monkeypatch.setattr(peer, "BOOTSTRAP_RETRY_S", (0.01, 0.01))
    return tries


async def test_dials_starved_by_the_load_are_tried_again_once_it_is_done(tmp_path, monkeypatch):
    parts = _parts(tmp_path, monkeypatch)
    tries = _bootstrap(monkeypatch, parts, answers_after_load=True)
    with trio.fail_after(30):
        await parts.obtain(SwarmHost(None, None, ("/ip4/127.0.0.1/tcp/1",)), ())
    assert tries == [False] * consumer.JOIN_ATTEMPTS + [True]


async def test_a_swarm_that_never_answers_is_unreachable_after_the_last_try(tmp_path, monkeypatch):
    parts = _parts(tmp_path, monkeypatch)
    tries = _bootstrap(monkeypatch, parts, answers_after_load=False)
    with trio.fail_after(30), pytest.raises(SwarmUnreachable):
        await parts.obtain(SwarmHost(None, None, ("/ip4/127.0.0.1/tcp/1",)), ())
    assert tries == [False] * consumer.JOIN_ATTEMPTS + [True]


async def test_a_local_problem_is_reported_before_the_swarm_and_not_retried(tmp_path, monkeypatch):
    parts = _parts(tmp_path, monkeypatch, fails=ValueError("no such file"))
    tries = _bootstrap(monkeypatch, parts, answers_after_load=True)
    with trio.fail_after(30), pytest.raises(ValueError, match="no such file"):
        await parts.obtain(SwarmHost(None, None, ("/ip4/127.0.0.1/tcp/1",)), ())
    assert tries == [False] * consumer.JOIN_ATTEMPTS
