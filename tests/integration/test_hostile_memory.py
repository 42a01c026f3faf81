"""Memory a hostile peer can make a node hold, measured on a real node process (its
VmRSS) attacked from a host with a fresh identity in this process (tools/hostile/window.py):

- 128 MiB written past a stream's receive window, after the node stopped reading
  it: the stream is reset at the first frame past the credit and the node keeps
  nothing; with COMPUSHARE_DISABLE_DEFENCES=yamux_window the node buffers it all.
- 200 view streams answered and kept open, each given a window of data the node
  never reads: beyond MAX_ANSWERED_STREAMS per connection the oldest are reset;
  with stream_caps off all are parked.
- 300 streams that never finish multistream negotiation, with 200 KiB each:
  beyond MAX_INBOUND_STREAMS they are refused, the rest end at py-libp2p's
  negotiation deadline (10 s).

The node answers a view request afterwards every time."""

from __future__ import annotations

import collections
import contextlib
import time

import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.stream_muxer.yamux.yamux import DEFAULT_WINDOW_SIZE

from compushare.defences import ENV as DEFENCES_ENV
from compushare.net import libp2p_patches
from compushare.net.dial import dial
from compushare.net.gossip import fetch_view
from compushare.net.host import open_host
from compushare.net.view import SwarmView
from helpers import vm_rss_mb
from hostile.window import overrun, park_half_open, park_unnegotiated, resets_in

MIB = 1 << 20
PAST = 128 * MIB  # sent beyond the window in one overrun
KEPT_LIMIT_MB = 30.0  # node RSS growth allowed with the defences on (measured: see the report in the commit)
HALF_OPEN = 200
STEP_TIMEOUT_S = 40.0
NEGOTIATION_DEADLINE_S = 10.0  # py-libp2p's, for an inbound stream's protocol negotiation



def start_node(processes, tiny_model, monkeypatch, disabled: str | None) -> tuple[int, dict]:
    """One node serving the tiny model, with defence `disabled` off in its process only."""
    if disabled:
        monkeypatch.setenv(DEFENCES_ENV, disabled)
    try:
        proc, state = processes.node("a", tiny_model, "0:4")
    finally:
        monkeypatch.delenv(DEFENCES_ENV, raising=False)
    return proc.pid, state


async def settled_rss(pid: int, host, peer) -> float:
    """The node's RSS once it has handled everything sent so far: a view request on a
    new stream is answered only after the frames before it on the connection."""
    with trio.fail_after(STEP_TIMEOUT_S):
        await fetch_view(host, peer, SwarmView())
    await trio.sleep(0.5)
    return vm_rss_mb(pid)


@pytest.mark.parametrize("defence", ["on", "off"])
async def test_writing_past_the_receive_window(defence, processes, tiny_model, monkeypatch):
    pid, state = start_node(processes, tiny_model, monkeypatch, None if defence == "on" else "yamux_window")
    counts: collections.Counter = collections.Counter()
    async with open_host(create_new_key_pair(), []) as host:
        info = await dial(host, state["peer_id"], state["addrs"], timeout=10)
        # A small overrun first: the code paths and buffers of one attack are warm.
        with trio.fail_after(STEP_TIMEOUT_S):
            await overrun(host, info.peer_id, counts, past=4 * MIB, stop_at_reset=False)
        before = await settled_rss(pid, host, info.peer_id)
        began = time.monotonic()
        with trio.fail_after(STEP_TIMEOUT_S):
            reset = await overrun(host, info.peer_id, counts, past=PAST, stop_at_reset=False)
        if defence == "on":
            after = await settled_rss(pid, host, info.peer_id)  # also: the node still answers
        else:  # the node is still taking it in after our writes return
            with trio.move_on_after(STEP_TIMEOUT_S):
                while (after := vm_rss_mb(pid)) - before < 0.9 * PAST / MIB:
                    await trio.sleep(0.2)
            with trio.fail_after(STEP_TIMEOUT_S):
                await fetch_view(host, info.peer_id, SwarmView())
    growth = after - before
    print(f"defence {defence}: RSS {before:.0f} -> {after:.0f} MB (+{growth:.1f}) after {PAST // MIB} MiB past the "
          f"window in {time.monotonic() - began:.1f} s; reset {reset}; {dict(counts)}")
    assert counts["window_overruns"] == 2
    if defence == "on":
        assert reset and counts["window_resets_seen"] == 2
        assert growth < KEPT_LIMIT_MB
    else:
        assert not reset and counts["window_resets_seen"] == 0
        assert growth > 0.9 * PAST / MIB  # all of it buffered: the attack works without the defence


@pytest.mark.parametrize("caps", ["on", "off"])
async def test_half_open_view_streams_with_unread_data(caps, processes, tiny_model, monkeypatch):
    pid, state = start_node(processes, tiny_model, monkeypatch, None if caps == "on" else "stream_caps")
    counts: collections.Counter = collections.Counter()
    held: list = []
    async with open_host(create_new_key_pair(), []) as host:
        info = await dial(host, state["peer_id"], state["addrs"], timeout=10)
        before = await settled_rss(pid, host, info.peer_id)
        began = time.monotonic()
        try:
            with trio.fail_after(STEP_TIMEOUT_S):
                await park_half_open(host, info.peer_id, counts, HALF_OPEN, held)
            after = await settled_rss(pid, host, info.peer_id)  # also: the node still answers this peer
            reset = resets_in(held)
        finally:
            with trio.move_on_after(10):
                for stream in held:
                    with contextlib.suppress(Exception):
                        await stream.reset()
        took = time.monotonic() - began
    growth = after - before
    parked_mb = (counts["half_open_streams"] - reset) * DEFAULT_WINDOW_SIZE / MIB
    print(f"stream caps {caps}: {dict(counts)}, {reset} reset by the node, in {took:.1f} s; RSS {before:.0f} -> "
          f"{after:.0f} MB (+{growth:.1f}; {parked_mb:.0f} MB of windows parked)")
    if caps == "on":
        assert counts["half_open_streams"] - reset <= libp2p_patches.MAX_ANSWERED_STREAMS
        assert growth < KEPT_LIMIT_MB
    else:
        assert counts["half_open_streams"] == HALF_OPEN and not reset
        assert growth > 0.7 * HALF_OPEN * DEFAULT_WINDOW_SIZE / MIB  # parked: the caps are what bounds it


async def test_streams_that_never_finish_negotiation(processes, tiny_model, monkeypatch):
    """More streams than MAX_INBOUND_STREAMS, each with 200 KiB the node's
    negotiation never completes: those beyond the cap are refused at once, the rest
    end at the negotiation deadline, and the memory they held goes with them."""
    pid, state = start_node(processes, tiny_model, monkeypatch, None)
    counts: collections.Counter = collections.Counter()
    held: list = []
    streams = libp2p_patches.MAX_INBOUND_STREAMS + 44
    beyond = streams - libp2p_patches.MAX_INBOUND_STREAMS

    def refused() -> int:  # a refusal that came back before our write made the write fail
        return counts["unnegotiated_refused"] + resets_in(held)

    async with open_host(create_new_key_pair(), []) as host:
        info = await dial(host, state["peer_id"], state["addrs"], timeout=10)
        before = await settled_rss(pid, host, info.peer_id)
        first_opened = trio.current_time()
        with trio.fail_after(STEP_TIMEOUT_S):
            await park_unnegotiated(host, info.peer_id, counts, streams, held)
        # "At once": before the first stream's negotiation deadline could end any.
        with trio.move_on_at(first_opened + NEGOTIATION_DEADLINE_S - 1):
            while refused() < beyond:
                await trio.sleep(0.1)
        refused_at_once, peak = refused(), vm_rss_mb(pid)
        with trio.move_on_after(STEP_TIMEOUT_S):  # py-libp2p's inbound negotiation deadline: 10 s
            while resets_in(held) < len(held):
                await trio.sleep(0.5)
        after = await settled_rss(pid, host, info.peer_id)
    print(f"unnegotiated: {dict(counts)}; {refused_at_once} refused at once, {resets_in(held)} reset in all; "
          f"RSS {before:.0f} -> peak {peak:.0f} -> {after:.0f} MB")
    assert refused_at_once >= beyond
    assert resets_in(held) == len(held)
    assert peak - before < libp2p_patches.MAX_INBOUND_STREAMS * DEFAULT_WINDOW_SIZE / MIB + KEPT_LIMIT_MB
    assert after - before < KEPT_LIMIT_MB
