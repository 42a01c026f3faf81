"""torrent/picker.py: random first, rarest first, strict endgame, hash-failure bans."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from compushare.torrent.picker import Picker, Received


def make(n: int, seed: int = 0, **kwargs) -> Picker:
    return Picker(range(n), rng=random.Random(seed), **kwargs)


def fresh(picker: Picker, peer) -> set[int]:
    """What `pick` may choose without duplicating: held by the peer, missing, asked of
    nobody, not sent corrupted by this peer before, and not one it timed out on while
    another peer holds it."""
    state = picker.peers[peer]
    others = [s for p, s in picker.peers.items() if p != peer]
    return {i for i in state.has & picker.missing
            if i not in picker.requested and peer not in picker.bad_from.get(i, ())
            and (i not in state.slow or not any(i in s.has for s in others))}


def assert_rarest(picker: Picker, chosen, pool) -> None:
    """No piece left out of `chosen` is rarer than one put in."""
    left = set(pool) - set(chosen)
    if chosen and left:
        assert max(picker.availability[i] for i in chosen) <= min(picker.availability[i] for i in left)


# ---------------------------------------------------------------- random first, then rarest


def first_pick(seed: int, random_first: int) -> int:
    picker = make(20, seed, depth=1, random_first=random_first)
    picker.add_peer("a", range(20))
    picker.add_peer("b", range(1, 20))  # piece 0 is the rarest, piece 1 the next rarest
    picker.add_peer("c", range(2, 20))
    [index] = picker.pick("a")
    return index


def test_first_picks_are_random_not_rarest():
    firsts = [first_pick(seed, random_first=4) for seed in range(30)]
    assert len(set(firsts)) > 5
    assert firsts.count(0) < 10
    assert {first_pick(seed, random_first=0) for seed in range(30)} == {0}  # the control: rarest at once


@pytest.mark.parametrize("seed", range(5))
def test_after_random_first_picks_are_rarest(seed):
    rng = random.Random(seed)
    picker = make(60, seed, depth=4, random_first=4)
    picker.add_peer("me", range(60))
    for k in range(6):  # densities 0.1 … 0.85: availabilities spread over 1 … 7
        picker.add_peer(k, {i for i in range(60) if rng.random() < 0.1 + 0.15 * k})
    while not picker.done:
        pool = fresh(picker, "me")
        chosen = picker.pick("me")
        assert chosen
        if picker.completed >= picker.random_first:
            assert_rarest(picker, chosen, pool)
        for index in chosen:
            assert picker.received("me", index, valid=True).accepted
    assert picker.completed == 60


# ---------------------------------------------------------------- depth and eligibility


def test_pick_fills_the_pipeline_and_no_more():
    picker = make(10, depth=3)
    picker.add_peer("a", range(10))
    first = picker.pick("a")
    assert len(first) == 3 and picker.inflight("a") == set(first)
    assert picker.pick("a") == []
    picker.received("a", first[0], valid=True)
    second = picker.pick("a")
    assert len(second) == 1 and not set(second) & set(first)
    assert picker.pick("nobody") == []


@given(wanted=st.sets(st.integers(0, 29)), has=st.sets(st.integers(0, 35)), depth=st.integers(1, 6),
       random_first=st.integers(0, 3), seed=st.integers(0, 2**16), rounds=st.integers(1, 4))
def test_pick_returns_only_eligible_pieces_within_depth(wanted, has, depth, random_first, seed, rounds):
    picker = Picker(wanted, depth=depth, random_first=random_first, rng=random.Random(seed))
    picker.add_peer("a", has)
    for _ in range(rounds):
        before = picker.inflight("a")
        eligible = has & picker.missing - before  # pieces held, not yet ours, not yet asked for
        chosen = picker.pick("a")
        assert len(chosen) == len(set(chosen)) == min(depth - len(before), len(eligible))
        assert set(chosen) <= eligible
        if chosen:
            assert picker.received("a", chosen[0], valid=True).accepted


# ---------------------------------------------------------------- strict endgame


def test_no_duplicates_while_some_piece_is_unrequested():
    rng = random.Random(1)
    picker = make(40, 1, depth=4, random_first=2)
    peers = [f"p{k}" for k in range(6)]
    picker.add_peer(peers[0], range(40))
    for peer in peers[1:]:
        picker.add_peer(peer, {i for i in range(40) if rng.random() < 0.25})  # soon idle
    while not all(i in picker.requested for i in picker.missing):
        peer = rng.choice(peers)
        picker.pick(peer)
        if picker.inflight(peer) and rng.random() < 0.5:
            picker.received(peer, rng.choice(sorted(picker.inflight(peer))), valid=True)
        assert all(len(holders) == 1 for holders in picker.requested.values())


def test_idle_peer_waits_for_the_last_piece_to_be_requested():
    picker = make(4, depth=4, random_first=0)
    picker.add_peer("a", [0, 1])
    picker.add_peer("b", range(4))
    picker.add_peer("c", [0, 1])
    assert sorted(picker.pick("a")) == [0, 1]
    assert picker.pick("c") == []  # idle with nothing fresh, but pieces 2 and 3 are unrequested
    assert sorted(picker.pick("b")) == [2, 3]
    assert sorted(picker.pick("c")) == [0, 1]


def test_endgame_duplicates_then_first_copy_wins():
    picker = make(6, depth=4, random_first=0, max_duplicates=2)
    for peer in "abcd":
        picker.add_peer(peer, range(6))
    a, b, c = picker.pick("a"), picker.pick("b"), picker.pick("c")  # fair shares of 6 / 4
    assert len(a) == len(b) == len(c) == 2 and len(set(a + b + c)) == 6
    assert all(len(h) == 1 for h in picker.requested.values())
    assert picker.pick("a") == []  # free slots, but only an idle peer may duplicate
    assert len(picker.pick("d")) == 4  # idle and everything requested: endgame
    for peer in "efg":
        picker.add_peer(peer, range(6))
    assert len(picker.pick("e")) == 4 and len(picker.pick("f")) == 4  # 6 × (1 + 2) = 18 requests
    assert picker.pick("g") == []
    assert all(len(h) == 3 for h in picker.requested.values())

    index = a[0]
    holders = set(picker.requested[index])
    won = picker.received("a", index, valid=True)
    assert won.accepted and not won.banned
    assert won.cancel == {peer: [index] for peer in holders - {"a"}}
    assert index not in picker.missing and index not in picker.requested
    assert all(index not in picker.inflight(peer) for peer in holders)
    late = picker.received(next(iter(holders - {"a"})), index, valid=True)
    assert not late.accepted and late.cancel == {}


@pytest.mark.parametrize("max_duplicates, expected", [(0, 0), (1, 3)])
def test_max_duplicates_bounds_the_endgame(max_duplicates, expected):
    picker = make(3, depth=4, random_first=0, max_duplicates=max_duplicates)
    picker.add_peer("a", range(3))
    assert len(picker.pick("a")) == 3
    picker.add_peer("b", range(3))
    picker.add_peer("c", range(3))
    assert len(picker.pick("b")) == expected
    assert picker.pick("c") == []


def test_fair_share_leaves_work_for_other_seeders():
    picker = make(6, depth=8, random_first=0)
    for peer in "abc":
        picker.add_peer(peer, range(6))
    assert [len(picker.pick(peer)) for peer in "abc"] == [2, 2, 2]
    picker.remove_peer("c")
    assert [len(picker.pick(peer)) for peer in "ab"] == [1, 1]  # c's pieces, split between a and b


# ---------------------------------------------------------------- hash failures


def test_bad_piece_is_asked_again_but_never_of_its_sender():
    picker = make(4, depth=4, random_first=0)
    picker.add_peer("bad", range(4))
    first = picker.pick("bad")
    index = first[0]
    failed = picker.received("bad", index, valid=False)
    assert not failed.accepted and not failed.banned and failed.cancel == {}
    assert index in picker.missing and index not in picker.requested
    assert picker.peers["bad"].depth == 2 and picker.failures("bad") == 1
    assert picker.pick("bad") == []  # 3 in flight, depth 2
    for other in first[1:]:
        assert picker.received("bad", other, valid=True).accepted
    assert picker.peers["bad"].depth == 4  # earned back one slot per good piece
    assert picker.pick("bad") == []  # the only missing piece is one it sent bad
    assert picker.unavailable() == {index}
    picker.add_peer("good", [index])
    assert picker.unavailable() == set()
    assert picker.pick("good") == [index]
    assert picker.received("good", index, valid=True).accepted and picker.done


def test_banned_after_max_failures():
    picker = make(10, depth=4, random_first=0, max_failures=3)
    picker.add_peer("bad", range(10))
    picker.add_peer("good", range(5))
    sent = picker.pick("bad")
    results = [picker.received("bad", index, valid=False) for index in sent[:3]]
    assert [r.banned for r in results] == [False, False, True]
    assert not any(r.accepted for r in results)
    assert "bad" not in picker.peers and "bad" in picker.banned
    assert all("bad" not in holders for holders in picker.requested.values())
    assert sent[3] not in picker.requested  # its last request is free for someone else
    assert all(picker.availability[i] == (1 if i < 5 else 0) for i in range(10))
    assert picker.unavailable() == set(range(5, 10))
    assert picker.add_peer("bad", range(10)) is False and "bad" not in picker.peers
    assert picker.received("bad", sent[3], valid=False) == Received(False, {})  # a dead connection's echo
    again = picker.pick("good")
    assert set(again) <= set(range(5)) and len(again) == 4


# ---------------------------------------------------------------- rejections, timeouts


def test_rejected_not_held_forgets_the_piece():
    picker = make(3, depth=4, random_first=0)
    picker.add_peer("a", range(3))
    assert sorted(picker.pick("a")) == [0, 1, 2]
    picker.rejected("a", 1, not_held=True)
    assert 1 not in picker.peers["a"].has and picker.availability[1] == 0
    assert 1 not in picker.requested and picker.peers["a"].depth == 4
    assert picker.pick("a") == [] and picker.unavailable() == {1}
    picker.rejected("a", 1, not_held=True)  # again: nothing left to forget
    assert picker.availability[1] == 0


def test_rejected_otherwise_shrinks_the_pipeline():
    picker = make(10, depth=4, random_first=0)
    picker.add_peer("a", range(10))
    sent = picker.pick("a")
    picker.rejected("a", sent[0])
    assert picker.peers["a"].depth == 3 and sent[0] not in picker.requested
    assert sent[0] in picker.peers["a"].has
    assert picker.pick("a") == []  # 3 still in flight, depth 3
    for index in sent[1:]:
        picker.rejected("a", index)
    assert picker.peers["a"].depth == 1  # never below one
    assert len(picker.pick("a")) == 1


def test_timeout_drops_to_one_and_releases_the_piece():
    picker = make(1, depth=4, random_first=0, max_duplicates=0)
    picker.add_peer("slow", [0])
    picker.add_peer("other", [0])
    assert picker.pick("slow") == [0] and picker.pick("other") == []
    picker.timed_out("slow", 0)
    assert picker.peers["slow"].depth == 1 and 0 not in picker.requested
    assert picker.pick("other") == [0]


def test_good_deliveries_grow_depth_one_at_a_time():
    picker = make(20, depth=4, random_first=0)
    picker.add_peer("a", range(20))
    picker.timed_out("a", picker.pick("a")[0])
    assert picker.peers["a"].depth == 1
    for depth in (2, 3, 4, 4):  # never above the configured depth
        assert picker.received("a", min(picker.inflight("a")), valid=True).accepted
        assert picker.peers["a"].depth == depth
        free = depth - len(picker.inflight("a"))
        assert len(picker.pick("a")) == max(0, free)


# ---------------------------------------------------------------- leaving peers, unavailable


def test_remove_peer_releases_requests_and_availability():
    picker = make(10, depth=4, random_first=0)
    picker.add_peer("a", range(5))
    picker.add_peer("b", range(3, 8))
    assert picker.unavailable() == {8, 9}
    sent = picker.pick("a")
    picker.remove_peer("a")
    assert picker.inflight("a") == set() and not set(sent) & set(picker.requested)
    assert [picker.availability[i] for i in range(10)] == [0, 0, 0, 1, 1, 1, 1, 1, 0, 0]
    assert picker.unavailable() == {0, 1, 2, 8, 9}
    picker.peer_has("b", 9)
    picker.peer_has("b", 9)  # said twice, counted once
    picker.peer_has("zed", 8)  # unknown peers are ignored
    assert picker.availability[9] == 1 and picker.availability[8] == 0
    assert picker.unavailable() == {0, 1, 2, 8}
    picker.remove_peer("a")  # a second time, and an unknown peer: no-ops
    picker.remove_peer("zed")
    assert picker.add_peer("a", [0]) is True  # leaving is not being banned
    b = picker.pick("b")
    picker.received("b", b[0], valid=False)
    assert b[0] in picker.unavailable()  # only a bad sender has it


def test_a_valid_piece_arriving_unasked_is_kept():
    """A request that timed out and then arrived, or a piece sent unasked: it matched its
    hash, so it counts (and requests for it elsewhere are cancelled)."""
    picker = make(4, depth=1, random_first=0)
    picker.add_peer("a", range(4))
    picker.add_peer("b", range(4))
    [asked] = picker.pick("a")
    picker.timed_out("a", asked)
    assert picker.pick("b") == [asked]  # a slow peer's piece goes to the other first
    result = picker.received("a", asked, valid=True)
    assert result == Received(True, {"b": [asked]})
    assert asked not in picker.missing and picker.completed == 1
    assert picker.received("b", asked, valid=True) == Received(False, {})  # the late copy


# ---------------------------------------------------------------- random event sequences

PIECES = 30  # wanted; peers also hold a few pieces beyond, which must never be picked
HONEST = ["p0", "p1", "p2", "p3", "p4"]
HOSTILE = ["h0", "h1"]  # always send corrupted data
ALL = frozenset(range(PIECES + 3))
SEEDERS = st.sets(st.sampled_from(sorted(ALL)), max_size=6).map(ALL.difference)  # most pieces: downloads finish
BITFIELDS = st.one_of(st.sets(st.sampled_from(sorted(ALL))), SEEDERS)


class PickerMachine(RuleBasedStateMachine):
    @initialize(depth=st.integers(1, 5), random_first=st.integers(0, 4), max_failures=st.integers(1, 3),
                max_duplicates=st.integers(0, 2), seed=st.integers(0, 2**16),
                seeders=st.lists(SEEDERS, min_size=2, max_size=3))
    def start(self, depth, random_first, max_failures, max_duplicates, seed, seeders):
        self.picker = Picker(range(PIECES), depth=depth, random_first=random_first, max_failures=max_failures,
                             max_duplicates=max_duplicates, rng=random.Random(seed))
        self.accepted: Counter[int] = Counter()
        for peer, has in zip(HONEST, seeders):
            self.picker.add_peer(peer, has)

    def connected(self, data):
        return data.draw(st.sampled_from(sorted(self.picker.peers)))

    def index_for(self, data, peer):
        inflight = sorted(self.picker.inflight(peer))
        any_index = st.integers(0, PIECES + 2)
        return data.draw(st.one_of(st.sampled_from(inflight), any_index) if inflight else any_index)

    @rule(peer=st.sampled_from(HONEST + HOSTILE), has=BITFIELDS)
    def add_peer(self, peer, has):
        expected = peer not in self.picker.banned and peer not in self.picker.peers
        assert self.picker.add_peer(peer, has) is expected
        if expected:
            assert self.picker.peers[peer].has == has

    @precondition(lambda self: self.picker.peers)
    @rule(data=st.data(), index=st.integers(0, PIECES + 2))
    def peer_has(self, data, index):
        peer = self.connected(data)
        self.picker.peer_has(peer, index)
        assert index in self.picker.peers[peer].has

    @precondition(lambda self: self.picker.peers)
    @rule(data=st.data())
    def pick(self, data):
        self.check_pick(self.connected(data))

    @precondition(lambda self: self.picker.peers)
    @rule(data=st.data(), corrupt=st.integers(0, 9))
    def received(self, data, corrupt):
        peer = self.connected(data)
        self.check_received(peer, self.index_for(data, peer), valid=peer in HONEST and corrupt > 0)

    @rule()
    def pick_all(self):
        for peer in sorted(self.picker.peers):
            self.check_pick(peer)

    @rule(rounds=st.integers(1, 4), slow=st.sets(st.sampled_from(HONEST + HOSTILE)))
    def download(self, rounds, slow):
        """Rounds of asking for all that can be asked, then the peers not `slow` delivering:
        the slow ones keep the last pieces in flight while the rest go idle, as in an endgame."""
        for _ in range(rounds):
            for _ in range(PIECES):
                before = sum(len(h) for h in self.picker.requested.values())
                self.pick_all()
                if sum(len(h) for h in self.picker.requested.values()) == before:
                    break
            for peer in sorted(self.picker.peers.keys() - slow):
                for index in sorted(self.picker.inflight(peer)):
                    if peer in self.picker.peers:  # not banned meanwhile
                        self.check_received(peer, index, valid=peer in HONEST)

    def check_pick(self, peer):
        picker = self.picker
        state = picker.peers[peer]
        inflight = set(state.inflight)
        pool = fresh(picker, peer)
        holders = {i: len(h) for i, h in picker.requested.items()}
        copyable = {i for i in state.has & picker.missing - inflight - pool
                    if i in holders and peer not in picker.bad_from.get(i, ()) and holders[i] <= picker.max_duplicates}
        all_requested = all(i in picker.requested for i in picker.missing)
        slots = max(0, state.depth - len(inflight))
        useful = sum(1 for s in picker.peers.values() if s.has & picker.missing)
        share = max(1, math.ceil(len(picker.missing) / max(1, useful))) - len(inflight)

        chosen = picker.pick(peer)
        assert len(chosen) == len(set(chosen)) <= slots
        assert set(chosen) <= state.has & picker.missing and not set(chosen) & inflight
        assert all(peer not in picker.bad_from.get(i, ()) for i in chosen)
        new = [i for i in chosen if i not in holders]
        duplicates = [i for i in chosen if i in holders]
        assert len(new) == max(0, min(slots, share, len(pool)))
        if new or inflight or not all_requested:
            assert not duplicates  # strict endgame: only an idle peer, only once all is requested
        else:
            assert set(duplicates) <= copyable and len(duplicates) == min(slots, len(copyable))
        if picker.completed >= picker.random_first:
            assert_rarest(picker, new, pool)
        assert picker.inflight(peer) == inflight | set(chosen)

    def check_received(self, peer, index, valid):
        picker = self.picker
        wanted = index in picker.missing
        holders = set(picker.requested.get(index, ()))
        failures = picker.failures(peer)

        result = picker.received(peer, index, valid)
        assert index not in picker.inflight(peer)
        if valid:
            assert not result.banned
            assert result.accepted == wanted
        else:
            assert not result.accepted and peer in picker.bad_from[index]
            assert result.banned == (failures + 1 >= picker.max_failures)
            assert (peer in picker.banned) == result.banned
            if not result.banned:
                assert picker.failures(peer) == failures + 1
        if result.accepted:
            self.accepted[index] += 1
            assert result.cancel == {other: [index] for other in holders - {peer}}
            assert index not in picker.missing and index not in picker.requested
        else:
            assert result.cancel == {} and (index in picker.missing) == wanted

    @precondition(lambda self: self.picker.peers)
    @rule(data=st.data(), not_held=st.booleans())
    def rejected(self, data, not_held):
        peer = self.connected(data)
        index = self.index_for(data, peer)
        depth = self.picker.peers[peer].depth
        self.picker.rejected(peer, index, not_held=not_held)
        state = self.picker.peers[peer]
        assert index not in state.inflight
        if not_held:
            assert index not in state.has and state.depth == depth
        else:
            assert state.depth == max(1, depth - 1)

    @precondition(lambda self: self.picker.peers)
    @rule(data=st.data())
    def timed_out(self, data):
        peer = self.connected(data)
        index = self.index_for(data, peer)
        self.picker.timed_out(peer, index)
        assert index not in self.picker.inflight(peer) and self.picker.peers[peer].depth == 1

    @rule(peer=st.sampled_from(HONEST + HOSTILE))
    def remove_peer(self, peer):
        self.picker.remove_peer(peer)
        assert peer not in self.picker.peers

    @invariant()
    def requests_match_pipelines(self):
        picker = self.picker
        for index, holders in picker.requested.items():
            assert holders
            assert holders == {peer for peer, s in picker.peers.items() if index in s.inflight}
            assert len(holders) <= 1 + picker.max_duplicates
        for peer, state in picker.peers.items():
            assert state.inflight <= state.has & picker.missing
            assert state.inflight <= picker.requested.keys()
            assert all(peer not in picker.bad_from.get(i, ()) for i in state.inflight)
            assert len(state.inflight) <= picker.depth and 1 <= state.depth <= picker.depth

    @invariant()
    def availability_counts_connected_peers(self):
        picker = self.picker
        for index in set(range(PIECES + 3)) | set(picker.availability):
            assert picker.availability[index] == sum(index in s.has for s in picker.peers.values())

    @invariant()
    def progress_is_consistent(self):
        picker = self.picker
        assert not picker.banned & picker.peers.keys()
        assert picker.done == (not picker.missing)
        assert all(n == 1 for n in self.accepted.values())
        assert picker.missing == set(range(PIECES)) - set(self.accepted)
        assert picker.completed == len(self.accepted)
        assert picker.unavailable() <= picker.missing - picker.requested.keys()


PickerMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=60, deadline=None)
TestPickerMachine = PickerMachine.TestCase


# ---------------------------------------------------------------- a whole download

N = 200


def download(seed: int, holdings: dict, hostile) -> tuple[Picker, Counter, Counter, int]:
    """Pick for every peer, deliver one outstanding request at a time in random order;
    half the cancels arrive too late, so the losing copy is still delivered."""
    rng = random.Random(seed)
    picker = make(N, seed)
    for peer, has in holdings.items():
        assert picker.add_peer(peer, has)
    outstanding: list[tuple] = []
    accepted, share = Counter(), Counter()
    hostile_deliveries = 0
    for _ in range(20 * N):
        if picker.done:
            break
        for peer in list(picker.peers):
            outstanding += [(peer, index) for index in picker.pick(peer)]
        assert outstanding, "stalled"
        peer, index = outstanding.pop(rng.randrange(len(outstanding)))
        hostile_deliveries += peer == hostile
        result = picker.received(peer, index, valid=peer != hostile)
        if result.accepted:
            accepted[index] += 1
            share[peer] += 1
        for other, indexes in result.cancel.items():
            if rng.random() < 0.5:
                outstanding = [(p, i) for p, i in outstanding if p != other or i not in indexes]
        if result.banned:
            outstanding = [(p, i) for p, i in outstanding if p != peer]
    return picker, accepted, share, hostile_deliveries


@pytest.mark.parametrize("seed", range(3))
def test_download_with_a_hostile_peer_overlapping_holders(seed):
    rng = random.Random(seed)
    holdings = {"a": set(range(140)), "b": set(range(60, N)), "c": {i for i in range(N) if rng.random() < 0.6},
                "evil": {i for i in range(N) if rng.random() < 0.5}}
    picker, accepted, share, hostile_deliveries = download(seed, holdings, "evil")
    assert picker.done and accepted == Counter(range(N))
    assert "evil" in picker.banned and "evil" not in picker.peers and hostile_deliveries == 3
    assert share["evil"] == 0 and sum(share.values()) == N


@pytest.mark.parametrize("seed", range(3))
def test_download_shares_load_among_full_seeders(seed):
    holdings = {"a": set(range(N)), "b": set(range(N)), "c": set(range(N)), "evil": set(range(N))}
    picker, accepted, share, hostile_deliveries = download(seed, holdings, "evil")
    assert picker.done and accepted == Counter(range(N))
    assert "evil" in picker.banned and hostile_deliveries == 3
    assert all(share[peer] > 0.15 * N for peer in "abc"), share


def test_reconnecting_does_not_shed_strikes():
    """A hostile peer that drops and rejoins before its third bad piece is still banned."""
    picker = Picker(range(100), max_failures=3, rng=random.Random(0))
    bad_pieces = 0
    for _ in range(10):
        if not picker.add_peer("evil", range(100)):
            break
        for index in picker.pick("evil")[:2]:
            bad_pieces += 1
            if picker.received("evil", index, valid=False).banned:
                break
        picker.remove_peer("evil")
    assert "evil" in picker.banned and bad_pieces == 3
