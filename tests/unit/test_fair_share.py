"""Fair sharing of a server: the KV budget (kv_share.py, SessionTable's reclaim) and
compute (scheduler.py, and Compute's turns under trio)."""

from __future__ import annotations

import collections

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from compushare.pipeline.server.compute import Compute
from compushare.pipeline.server.scheduler import PIECE_TOKENS, SHORT_TOKENS, FairScheduler, pieces
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


def test_an_ask_over_the_askers_share_is_busy_and_reclaims_nothing():
    t = table(max_session_tokens=8192)
    t.open(sid(1), 0, 1, 8192 - 100, now=0, owner="a")
    assert "fair share of 4096" in busy(t.open, sid(2), 0, 1, 4097, now=1, owner="b")
    assert sid(1) in t and t.take_reclaimed() == []


def test_sessions_mid_step_are_never_reclaimed():
    t = table()
    for i in (1, 2):
        t.open(sid(i), 0, 1, 4096, now=i, owner="hog")
        t.begin_step(sid(i), 0, 1, now=i)
    assert "to reclaim" in busy(t.open, sid(3), 0, 1, 100, now=3, owner="newcomer")
    t.end_step(t.get(sid(1)), 1, now=4, ok=True)
    t.open(sid(3), 0, 1, 100, now=5, owner="newcomer")
    assert sid(1) not in t and sid(2) in t and t.get(sid(2)).state is State.STEPPING


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
        held = collections.Counter()
        for s in t._sessions.values():
            held[s.owner] += s.max_tokens
        share = BUDGET // len(set(held) | {owner})
        over = sum(s.max_tokens for s in t._sessions.values() if s.owner != owner and held[s.owner] > share)
        try:
            t.open(sid(i), 0, 1, tokens, now=i, owner=owner)
        except Rejected as exc:
            assert exc.code == "busy"
            assert held[owner] + tokens > share or t.free_tokens + over < tokens
        assert t.reserved_tokens <= BUDGET
        for lost in t.take_reclaimed():
            assert lost.owner != owner and held[lost.owner] > share


# ---------------------------------------------------------------- pieces and the scheduler


def test_pieces_cut_chunks_at_the_protocols_size():
    assert pieces([1024]) == [PIECE_TOKENS] * 16
    assert pieces([70, 1, 64]) == [64, 6, 1, 64]
    assert pieces([1024], fair=False) == [1024]


@given(st.lists(st.integers(1, 3000), min_size=1, max_size=8))
def test_pieces_depend_on_the_request_alone_and_cover_it(chunks):
    cut = pieces(chunks)
    assert sum(cut) == sum(chunks) and max(cut) <= PIECE_TOKENS and cut == pieces(list(chunks))


def test_a_decode_step_goes_before_a_queue_of_prefill_pieces():
    s = FairScheduler(1)
    running = s.submit("hog", PIECE_TOKENS)
    assert s.grant() == [running]
    queued = [s.submit("hog", PIECE_TOKENS) for _ in range(15)]
    decode = s.submit("user", 1)
    assert s.grant() == []  # the slot is taken
    s.done(running)
    assert s.grant() == [decode]
    s.done(decode)
    assert s.grant() == [queued[0]]


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

    release = trio.Event()
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(piece, "hog", 64, release)
            await trio.testing.wait_all_tasks_blocked()
            for _ in range(3):
                nursery.start_soon(piece, "hog", 64)
            await trio.testing.wait_all_tasks_blocked()
            quitter = trio.CancelScope()

            async def quits():
                with quitter:
                    await piece("quitter", 1)

            nursery.start_soon(quits)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(piece, "user", 1)
            await trio.testing.wait_all_tasks_blocked()
            quitter.cancel()  # it leaves while waiting, ahead of the user
            await trio.testing.wait_all_tasks_blocked()
            release.set()
    assert order == ["hog", "user", "hog", "hog", "hog"]
    assert compute.scheduler.running == 0 and len(compute.scheduler) == 0
