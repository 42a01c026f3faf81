"""Fair sharing of a server: the KV budget (kv_share.py, SessionTable's reclaim) and
compute (scheduler.py, and Compute's turns under trio)."""

from __future__ import annotations

import collections
import threading

import pytest
import torch
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from compushare.pipeline.server.compute import Compute
from compushare.pipeline.server.scheduler import PIECE_TOKENS, SHORT_LEAD, SHORT_TOKENS, FairScheduler, pieces
from compushare.pipeline.server.session import Rejected, SessionTable, State

BUDGET = 8192


def table(**overrides) -> SessionTable:
    return SessionTable(**(dict(budget_tokens=BUDGET, max_session_tokens=4096, max_step_tokens=2048,
                                idle_timeout_s=120.0) | overrides))


def sid(i: int) -> bytes:
    return i.to_bytes(16, "big")


def busy(fn, *args, **kwargs) -> str:
    with pytest.raises(Rejected) as caught:
        fn(*args, **kwargs)
    assert caught.value.code == "busy"
    return caught.value.message


# ---------------------------------------------------------------- the KV budget


def test_a_hog_holding_the_whole_budget_loses_a_session_to_a_newcomer():
    """The attack found: one peer reserves the whole budget with two sessions and
    keeps them alive cheaply. A second peer's ask reclaims the hog's least recently
    used session, however recently the hog touched the other."""
    t = table()
    t.open(sid(1), 0, 1, 4096, now=0, owner="hog")
    t.open(sid(2), 0, 1, 4096, now=1, owner="hog")
    t.truncate(sid(1), 0, now=5)  # kept alive: sid(2) is now the least recently used
    t.open(sid(3), 0, 1, 512, now=6, owner="newcomer")
    assert sid(2) not in t and sid(1) in t and sid(3) in t
    assert [s.session_id for s in t.take_reclaimed()] == [sid(2)] and t.take_reclaimed() == []
    # The hog, now at its share of 4096, cannot take the room back by asking again.
    assert "fair share" in busy(t.open, sid(4), 0, 1, 4000, now=7, owner="hog")
    t.open(sid(5), 0, 1, 3584, now=8, owner="hog" + "-other-identity")  # what is free can still be used


def test_a_crowd_of_tiny_sessions_fills_the_budget_not_the_table():
    """8 identities x 32 one-token sessions took all 256 places of the session table
    while holding 256 of 8,192 tokens: every newcomer got busy. Each session holds
    at least budget / max_sessions, so the crowd fills the budget first, and a
    newcomer within its share reclaims from it."""
    t = table()
    for peer in range(8):
        for i in range(32):
            t.open(sid(peer * 32 + i), 0, 1, 1, now=peer * 32 + i, owner=f"sybil{peer}")
    assert len(t) == 256 and t.free_tokens == 0 and t.available_to_newcomer() > 0
    t.open(sid(1000), 0, 1, 100, now=300, owner="honest")
    assert sid(1000) in t and len(t.take_reclaimed()) == 4  # 100 tokens' worth of 32-token reserves


def test_an_ask_over_the_askers_share_is_busy_and_reclaims_nothing():
    t = table(max_session_tokens=8192)
    t.open(sid(1), 0, 1, 8192 - 100, now=0, owner="a")
    assert "fair share of 4096" in busy(t.open, sid(2), 0, 1, 4097, now=1, owner="b")
    assert sid(1) in t and t.take_reclaimed() == []


def test_idle_sessions_go_before_busy_ones_and_busy_ones_go_too():
    """A hog that keeps every session mid-step (a prefill always queued) is not
    protected by it: its idle sessions go first, then busy ones (their step stops
    at its next piece)."""
    t = table()
    for i in (1, 2, 3):
        t.open(sid(i), 0, 1, 2730, now=i, owner="hog")
    for i in (1, 2):
        t.begin_step(sid(i), 0, 1, now=10 + i)
    t.open(sid(4), 0, 1, 100, now=20, owner="newcomer")
    assert sid(3) not in t  # the idle one, though the most recently opened
    t.open(sid(5), 0, 1, 2700, now=21, owner="newcomer")  # 2,632 free: one busy session goes
    [lost] = [s for s in t.take_reclaimed() if s.session_id == sid(1)]
    assert lost.reclaimed and lost.state is State.CLOSED and sid(2) in t
    t.end_step(lost, 1, now=22, ok=False)  # the driver's late report of its stopped step


def test_the_most_over_peer_loses_first_and_no_one_is_cut_below_its_share():
    t = table()
    t.open(sid(1), 0, 1, 4000, now=0, owner="big")
    t.open(sid(2), 0, 1, 1000, now=1, owner="big")
    t.open(sid(3), 0, 1, 3000, now=2, owner="mid")
    t.open(sid(4), 0, 1, 2000, now=3, owner="new")  # share 8192 // 3 = 2730: big (5000) is over, mid (3000) too
    assert [s.session_id for s in t.take_reclaimed()] == [sid(1)]  # big's LRU session
    assert t.fair_share("new") == 2730


def test_with_fair_shares_off_the_hog_keeps_everything():
    """The defence switched off (tests only): the attack works again."""
    t = table(fair=False)
    t.open(sid(1), 0, 1, 4096, now=0, owner="hog")
    t.open(sid(2), 0, 1, 4096, now=1, owner="hog")
    assert "KV budget full" in busy(t.open, sid(3), 0, 1, 1, now=2, owner="newcomer")


@settings(max_examples=300)
@given(st.lists(st.tuples(st.sampled_from("abcd"), st.integers(1, 4096)), max_size=30))
def test_whatever_peers_ask_a_peer_within_its_share_is_served_when_others_are_over_theirs(asks):
    """Max-min: after any sequence of asks (none mid-step), an ask that keeps its
    peer within its share is refused only if even reclaiming every session of
    peers over their share would not make room; and the budget is never exceeded."""
    t = table()
    for i, (owner, tokens) in enumerate(asks):
        # What the table counts: every session holds at least its minimum reserve.
        held = collections.Counter()
        for s in t._sessions.values():
            held[s.owner] += s.reserved
        share = BUDGET // len(set(held) | {owner})
        over = sum(s.reserved for s in t._sessions.values() if s.owner != owner and held[s.owner] > share)
        asked = max(tokens, t.min_reserved)
        try:
            t.open(sid(i), 0, 1, tokens, now=i, owner=owner)
        except Rejected as exc:
            assert exc.code == "busy"
            assert held[owner] + asked > share or t.free_tokens + over < asked
        assert t.reserved_tokens <= BUDGET
        for lost in t.take_reclaimed():
            assert lost.owner != owner and held[lost.owner] > share


# ---------------------------------------------------------------- pieces and the scheduler


def test_pieces_cut_chunks_at_the_protocols_size():
    assert PIECE_TOKENS == 128
    assert pieces([1024]) == [128] * 8
    assert pieces([300, 1, 128]) == [128, 128, 44, 1, 128]
    assert pieces([1024], fair=False) == [1024]


@given(st.lists(st.integers(1, 3000), min_size=1, max_size=8))
def test_pieces_depend_on_the_request_alone_and_cover_it(chunks):
    cut = pieces(chunks)
    assert sum(cut) == sum(chunks) and max(cut) <= PIECE_TOKENS and cut == pieces(list(chunks))


def test_a_decode_step_preempts_a_prefill_piece_and_skips_the_queue():
    s = FairScheduler(1)
    running = s.submit("hog", PIECE_TOKENS)
    assert s.grant() == [running] and not s.preempting
    queued = [s.submit("hog", PIECE_TOKENS) for _ in range(7)]
    decode = s.submit("user", 1)
    assert s.grant() == [decode] and s.preempting  # beside the running piece, which pauses
    other = s.submit("user2", 1)
    assert s.grant() == []  # one short piece at a time per slot
    s.done(decode)
    assert s.grant() == [other]
    s.done(other)
    assert not s.preempting and s.grant() == []  # the long piece still holds the slot
    s.done(running)
    assert s.grant() == [queued[0]]


@settings(max_examples=50, deadline=None)
@given(st.integers(1, SHORT_TOKENS), st.integers(0, 3))
def test_short_pieces_back_to_back_cannot_hold_a_long_piece_forever(size, other_peers):
    """Decode-first has a bound: a peer (or several) sending short pieces back to back,
    one always waiting, lets another peer's prefill piece run, and stop being paused,
    within SHORT_LEAD tokens of its fair-queueing time."""
    s = FairScheduler(1)
    peers = ["spam", *(f"decoder{i}" for i in range(other_peers))]
    shorts = {peer: s.submit(peer, size) for peer in peers}
    long = s.submit("prefill", PIECE_TOKENS)
    granted_shorts = 0
    for _ in range(10_000):
        for ticket in s.grant():
            if ticket is long:
                break
            assert ticket.preempts
        else:  # the shorts that ran end, and their peers send the next at once
            for peer, ticket in list(shorts.items()):
                if ticket.granted:
                    s.done(ticket)
                    granted_shorts += 1
                    shorts[peer] = s.submit(peer, size)
            continue
        break
    assert long.granted and granted_shorts * size <= (SHORT_LEAD + PIECE_TOKENS) * len(peers)
    for ticket in s.grant():  # while the long piece runs, only shorts within the lead preempt it
        assert ticket.preempts and ticket.start_tag <= long.start_tag + SHORT_LEAD


def test_without_fairness_pieces_go_in_arrival_order():
    s = FairScheduler(1, fair=False)
    first = s.submit("hog", 1024)
    s.grant()
    second = s.submit("hog", 1024)
    decode = s.submit("user", 1)
    s.done(first)
    assert s.grant() == [second]
    s.done(second)
    assert s.grant() == [decode]


@settings(max_examples=200)
@given(st.lists(st.integers(SHORT_TOKENS + 1, PIECE_TOKENS), min_size=2, max_size=4), st.integers(20, 60))
def test_backlogged_peers_share_compute_equally_by_tokens(sizes, rounds):
    """Peers that always have a piece waiting (each its own piece size) get
    tokens within one piece of each other, whatever their sizes."""
    s = FairScheduler(1)
    peers = [f"p{i}" for i in range(len(sizes))]
    waiting = {p: s.submit(p, n) for p, n in zip(peers, sizes)}
    served = collections.Counter()
    for _ in range(rounds * len(peers)):
        [ticket] = s.grant()
        served[ticket.peer] += ticket.tokens
        waiting[ticket.peer] = s.submit(ticket.peer, ticket.tokens)  # the next piece, before this one ends
        s.done(ticket)
    assert max(served.values()) - min(served.values()) <= 2 * PIECE_TOKENS


def test_a_waiter_that_leaves_gives_up_its_place():
    s = FairScheduler(1)
    running = s.submit("a", 10)
    s.grant()
    left = s.submit("b", 1)
    s.done(left)  # cancelled while waiting
    assert len(s) == 0
    s.done(running)
    assert s.grant() == [] and s.running == 0
    s.done(running)  # twice: nothing happens


async def test_compute_turns_under_trio_serve_the_decode_step_first():
    """The driver: pieces waiting in trio tasks are woken in the scheduler's order,
    and a cancelled waiter frees nothing it did not hold."""
    compute = Compute(1)
    order = []

    async def piece(peer: str, tokens: int, hold: trio.Event | None = None):
        async with compute.turn(peer, tokens):
            order.append(peer)
            if hold is not None:
                await hold.wait()

    release_long, release_short = trio.Event(), trio.Event()
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(piece, "hog", 64, release_long)
            await trio.testing.wait_all_tasks_blocked()
            for _ in range(3):
                nursery.start_soon(piece, "hog", 64)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(piece, "user", 1, release_short)  # preempts the running hog piece
            await trio.testing.wait_all_tasks_blocked()
            quitter = trio.CancelScope()

            async def quits():
                with quitter:
                    await piece("quitter", 1)

            nursery.start_soon(quits)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(piece, "user2", 1)
            await trio.testing.wait_all_tasks_blocked()
            quitter.cancel()  # it leaves while waiting, ahead of user2
            await trio.testing.wait_all_tasks_blocked()
            release_short.set()
            await trio.testing.wait_all_tasks_blocked()
            release_long.set()
    assert order == ["hog", "user", "user2", "hog", "hog", "hog"]
    assert compute.scheduler.running == 0 and len(compute.scheduler) == 0


async def test_a_decode_step_runs_between_two_layers_of_a_long_forward(tiny_model):
    """Preemption for real: a one-token step of another peer, sent while a long
    piece is being computed, runs between two of its layers (the long forward waits
    at a pause point), not after it; both outputs are what they are alone."""
    from compushare.model.blocks import SpanRunner

    runner = SpanRunner.load(tiny_model, 0, 4)
    events = []
    started, short_waiting = trio.Event(), threading.Event()
    token = trio.lowlevel.current_trio_token()
    # A layer's first operation is its input norm (model/lean.py): trace that.
    norms = {index: layer.input_layernorm for index, layer in runner.layers.items()}
    originals = {index: norm.forward for index, norm in norms.items()}
    for index, norm in norms.items():
        def traced(*args, _index=index, _forward=norm.forward, **kwargs):
            tokens = args[0].shape[1]
            events.append(("long" if tokens > 1 else "short", _index))
            if tokens > 1 and _index == 0:
                trio.from_thread.run_sync(started.set, trio_token=token)
                assert short_waiting.wait(timeout=30)  # the decode step arrives while layer 0 runs
            return _forward(*args, **kwargs)
        norm.forward = traced
    compute = Compute(1)
    long_in, short_in = torch.randn(1, 100, 64), torch.randn(1, 1, 64)
    results = {}

    async def run(name, hidden, peer):
        results[name], _ = await compute.run(runner, runner.new_cache(), hidden, 0, 0, 4, [hidden.shape[1]],
                                             peer=peer)

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run, "long", long_in, "hog")
            await started.wait()
            nursery.start_soon(run, "short", short_in, "user")
            await trio.testing.wait_all_tasks_blocked()  # it waits for the compute slot
            short_waiting.set()
    first_short = events.index(("short", 0))
    assert events[:first_short] == [("long", 0)]  # the decode step came right after the layer in progress
    assert events[first_short:first_short + 4] == [("short", i) for i in range(4)]
    for index, norm in norms.items():
        norm.forward = originals[index]
    for name, hidden in (("long", long_in), ("short", short_in)):
        alone = runner.forward(hidden, runner.new_cache(), 0)
        assert torch.equal(results[name], alone)
