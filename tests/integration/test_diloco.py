"""DiLoCo participants over real libp2p hosts (in one process, a tiny model): an
all-reduce that loses a member, a joiner, a cheater caught by a re-run check."""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
import pytest
import torch
import trio
from libp2p.crypto.ed25519 import create_new_key_pair

from compushare.diloco.allreduce import DILOCO_PROTOCOL, Attempt
from compushare.diloco.corpus import Corpus
from compushare.diloco.participant import Faults, Participant
from compushare.diloco.parts import bounds
from compushare.diloco.quant import error_bound, quantize
from compushare.diloco.recipe import Recipe
from compushare.diloco.run import make_run, run_validators
from compushare.diloco.service import diloco_handler
from compushare.diloco.weights import KEEP_ROUNDS, weights_digest
from compushare.model.store import ModelStore
from compushare.proofs.diloco import DilocoFailureReport
from compushare.karma.record import karma_validators
from compushare.karma.service import KARMA_PROTOCOL
from compushare.net.dial import dial
from compushare.net.host import full_addrs
from compushare.proofs.reports import parse_report
from compushare.net.peer import open_swarm_host
from compushare.torrent.protocol import PIECES_PROTOCOL

pytestmark = pytest.mark.integration

POLL_S = 0.05

TINY = {"vocab_size": 256, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 32, "rope_theta": 10000.0,
        "rms_norm_eps": 1e-5, "initializer_range": 0.02, "tie_word_embeddings": True}


@pytest.fixture(scope="module")
def corpus() -> Corpus:
    rng = np.random.default_rng(0)
    words = [bytes(rng.integers(97, 123, size=rng.integers(2, 8))) for _ in range(300)]
    return Corpus.from_bytes(b" ".join(words[i] for i in rng.integers(0, 300, size=40_000)), eval_bytes=4096)


def _run(corpus: Corpus, *, rounds: int = 3, steps: int = 3, check_rate: float = 0.0, wait_s: float = 6.0):
    recipe = dataclasses.replace(Recipe.default_small(corpus.digest), model=TINY, seq_len=16, batch=2, steps=steps,
                                 rounds=rounds)
    run, _value = make_run(recipe, create_new_key_pair(), name="test", gather_s=wait_s, part_wait_s=wait_s,
                           check_rate=check_rate)
    return run


class Peers:
    """Participants, each on its own host (all in this process), the first the others' bootstrap."""

    def __init__(self, nursery: trio.Nursery, tmp_path, run, corpus: Corpus) -> None:
        self.nursery, self.tmp_path, self.run, self.corpus = nursery, tmp_path, run, corpus
        self.boot: list[str] = []
        self.scopes: list[trio.CancelScope] = []

    async def add(self, faults: Faults = Faults()) -> Participant:
        index = len(self.scopes)
        participant, scope = await self.nursery.start(self._serve, index, faults)
        self.scopes.append(scope)
        if not self.boot:
            self.boot = full_addrs(participant.host)
        return participant

    async def _serve(self, index: int, faults: Faults, *, task_status) -> None:
        data_dir = self.tmp_path / f"p{index}"
        data_dir.mkdir()
        key_pair = create_new_key_pair()
        async with open_swarm_host(key_pair, server=True, validators=karma_validators() | run_validators(),
                                   listen=["/ip4/127.0.0.1/tcp/0"], bootstrap=self.boot, join=bool(self.boot)) as swarm:
            participant = Participant(self.run, swarm, key_pair, self.corpus, data_dir, faults=faults)
            swarm.host.set_stream_handler(DILOCO_PROTOCOL, diloco_handler(participant))
            swarm.host.set_stream_handler(PIECES_PROTOCOL, participant.torrent.seeder.handle)
            swarm.host.set_stream_handler(KARMA_PROTOCOL, participant.karma.handle)
            with trio.CancelScope() as scope:
                async with trio.open_nursery() as nursery:
                    participant.checker.nursery = nursery
                    nursery.start_soon(participant.torrent.announce_loop)
                    nursery.start_soon(_provide_participation, swarm.dht, self.run.run_id)
                    task_status.started((participant, scope))
                    await trio.sleep_forever()

    def kill(self, participant: Participant, peers: list[Participant]) -> None:
        self.scopes[peers.index(participant)].cancel()


async def _provide_participation(dht, run_id: str) -> None:
    from compushare.diloco.group import participants_key

    with contextlib.suppress(Exception):
        await dht.provide(participants_key(run_id))
    await trio.sleep_forever()


@pytest.mark.parametrize("n", [2, 5, 8])
async def test_the_allreduce_over_hosts_gives_every_peer_the_mean_within_int8_rounding(tmp_path, corpus, n):
    torch.manual_seed(n)
    # Nobody fails here, so the owners' wait only bounds a slow machine.
    run = _run(corpus, wait_s=60.0)
    vectors = [torch.randn(3001) * (i + 1) for i in range(n)]
    outcomes: dict[int, object] = {}
    async with trio.open_nursery() as nursery:
        lab = Peers(nursery, tmp_path, run, corpus)
        peers = [await lab.add() for _ in range(n)]
        for p in peers:
            p.addrs.update({q.me: full_addrs(q.host) for q in peers if q is not p})
        # The members connected before the round, one pair at a time, as a run's have
        # been by its gathering: 8 hosts dialling each other all at once in one
        # process lost a part now and then (seen in 2 of 3 CI-like runs: an owner
        # waited out its 60 s and the round retried without it), which is a dial
        # race of its own, not this test's arithmetic.
        with trio.fail_after(120):
            for i, p in enumerate(peers):
                for q in peers[i + 1:]:
                    await dial(p.host, q.me, full_addrs(q.host), timeout=60)
        attempt = Attempt(run.run_id, 0, 0, tuple(sorted(p.me for p in peers)), bytes(32))

        async def average(i: int) -> None:
            outcomes[i] = await peers[i].averaging.run(attempt, vectors[i], tokens=1)

        with trio.fail_after(150):
            async with trio.open_nursery() as reduce:
                for i in range(n):
                    reduce.start_soon(average, i)
        nursery.cancel_scope.cancel()
    exact = torch.stack(vectors).mean(0)
    bound = _int8_bound(vectors, exact, n)
    assert all(o.attempt.attempt == 0 and o.average is not None for o in outcomes.values())
    assert bool(((outcomes[0].average - exact).abs() <= bound).all())
    assert all(torch.equal(o.average, outcomes[0].average) for o in outcomes.values())


async def test_a_peer_killed_mid_allreduce_leaves_the_others_the_mean_of_the_rest(tmp_path, corpus):
    torch.manual_seed(1)
    run = _run(corpus, wait_s=4.0)
    vectors = [torch.randn(5000) * (i + 1) for i in range(4)]
    outcomes: dict[int, object] = {}
    async with trio.open_nursery() as nursery:
        lab = Peers(nursery, tmp_path, run, corpus)
        peers = [await lab.add() for _ in range(4)]
        for p in peers:  # what group formation learns from the round's provider records
            p.addrs.update({q.me: full_addrs(q.host) for q in peers if q is not p})
        members = tuple(sorted(p.me for p in peers))
        attempt = Attempt(run.run_id, 0, 0, members, bytes(32))
        doomed = peers[3]
        open_slot = doomed.averaging.open_slot

        def slot_that_never_answers(*args):
            slot = open_slot(*args)
            slot.close = trio.sleep_forever  # it dies before it averages
            return slot

        doomed.averaging.open_slot = slot_that_never_answers

        doomed_scope = trio.CancelScope()

        async def average(i: int) -> None:
            with doomed_scope if i == 3 else contextlib.nullcontext():
                outcomes[i] = await peers[i].averaging.run(attempt, vectors[i], tokens=1)

        with trio.fail_after(60):
            async with trio.open_nursery() as reduce:
                for i in range(3):
                    reduce.start_soon(average, i)
                reduce.start_soon(average, 3)
                # The doomed member dies holding everyone's part of its slice, unanswered.
                while not doomed.averaging.slots:
                    await doomed.averaging.slot_added.wait()
                await next(iter(doomed.averaging.slots.values())).full.wait()
                doomed_scope.cancel()
                lab.kill(doomed, peers)
        nursery.cancel_scope.cancel()
    rest = [outcomes[i] for i in range(3)]
    assert all(o.average is not None and o.attempt.attempt == 1 for o in rest)
    assert all(set(o.attempt.members) == {p.me for p in peers[:3]} for o in rest)
    assert all(o.failed == () for o in rest)
    exact = torch.stack(vectors[:3]).mean(0)
    bound = _int8_bound(vectors[:3], exact, 3)
    assert bool(((rest[0].average - exact).abs() <= bound).all())
    assert all(torch.equal(o.average, rest[0].average) for o in rest)  # every member holds the same mean


def _int8_bound(vectors, exact, parts: int) -> torch.Tensor:
    """Element-wise: the contributions' int8 rounding (per slice, as sent) over their count,
    plus the average's own (a hair of slack for float32 sums)."""
    def per_slice(v):
        return torch.cat([error_bound(quantize(v[a:b])) for a, b in bounds(v.numel(), parts)])

    return sum(per_slice(v) for v in vectors) / len(vectors) + per_slice(exact) * 1.01 + 1e-5


async def _until(check) -> None:
    """Poll `check` until it holds: the test's trio.fail_after bounds the wait, so a slow
    machine only takes more polls."""
    while not check():
        await trio.sleep(POLL_S)


async def _take_part(participant: Participant, done: dict, *, join: bool = False) -> None:
    await participant.take_part(join=join)
    done[participant.me] = weights_digest(participant.weights)


async def test_a_joiner_receives_weights_equal_to_the_others(tmp_path, corpus):
    run = _run(corpus, rounds=6, steps=30)  # rounds long enough for a joiner to fetch the state within one
    done: dict[str, bytes] = {}
    with trio.fail_after(240):
        async with trio.open_nursery() as nursery:
            lab = Peers(nursery, tmp_path, run, corpus)
            first = [await lab.add() for _ in range(3)]
            async with trio.open_nursery() as training:
                training.start_soon(lambda: _take_part(first[0], done))
                for p in first[1:]:
                    training.start_soon(lambda p=p: _take_part(p, done, join=True))
                await _until(lambda: first[0].round >= 2)
                joiner = await lab.add()
                training.start_soon(lambda: _take_part(joiner, done, join=True))
            nursery.cancel_scope.cancel()
    assert joiner.stats["joined_at"] >= 1 and joiner.stats["averaged"] >= 1
    assert len(done) == 4 and len(set(done.values())) == 1  # one set of outer weights, the joiner's too
    assert all(p.round == 6 for p in first + [joiner])
    # Old rounds' outer state is deleted: the last rounds' weights and momentum stay, seeded.
    held = ModelStore(first[0].data_dir).list()
    assert 2 <= len(held) <= 2 * (KEEP_ROUNDS + 1)
    assert {first[0].published.weights, first[0].published.momentum} <= {m.model_id for _, m in held}


async def test_a_rerun_check_catches_a_peer_that_sends_noise(tmp_path, corpus):
    run = _run(corpus, rounds=4, check_rate=1.0)
    done: dict[str, bytes] = {}
    with trio.fail_after(240):
        async with trio.open_nursery() as nursery:
            lab = Peers(nursery, tmp_path, run, corpus)
            honest = [await lab.add() for _ in range(3)]
            cheater = await lab.add(Faults(noise=10.0))
            async with trio.open_nursery() as training:
                training.start_soon(lambda: _take_part(honest[0], done))
                for p in honest[1:] + [cheater]:
                    training.start_soon(lambda p=p: _take_part(p, done, join=True))
            # Reports still in flight are judged by re-running: wait for every honest verdict.
            await _until(lambda: all(cheater.me in p.excluded for p in honest))
            nursery.cancel_scope.cancel()
    assert all(cheater.me in p.excluded and cheater.me not in p.members for p in honest)
    assert not any(h.me in p.excluded for p in honest for h in honest)  # no honest peer is accused
    reports = [parse_report(r) for p in honest for r in p.karma.reports.against(cheater.me)]
    assert reports
    for report in reports:
        assert isinstance(report, DilocoFailureReport) and report.accused.peer_id == cheater.me
        report.check()
    assert len({done[p.me] for p in honest}) == 1
