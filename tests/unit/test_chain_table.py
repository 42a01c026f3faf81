"""The chain core's transition table (chain_core.TRANSITIONS): every (phase, event
kind) pair it lists is reached, and events that do not answer what the core waits
for (another kind, too few, none pending) are refused with UnexpectedEvents,
changing nothing: the right answers are still taken, and the outputs still equal a
failure-free run's."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from compushare.pipeline.client.chain_core import TRANSITIONS, ChainCore, UnexpectedEvents
from compushare.pipeline.client.chain_events import (
    Answered, Done, Kind, Phase, RouteFound, SessionOpened, VerifierFound, kind_of,
)
from test_chain_core import BLOCKS, Cache, Swarm, make_hop, pool, tensor
from test_chain_direct import linked_core, reply, start_direct, tensor as tensor32

# One answer of each kind, none of them what the core waits for when fed out of turn.
SAMPLE = {Kind.OPENED: SessionOpened(), Kind.ANSWERED: Answered(()), Kind.ROUTE_FOUND: RouteFound(()),
          Kind.VERIFIER_FOUND: VerifierFound(None), Kind.DONE: Done()}

TAKEN: set[tuple[Phase, Kind]] = set()  # over every run of the stateful test: answers taken
REFUSED: set[Phase] = set()  # ... and the phases where wrong ones were refused


def wrong_batches(requests: list, events: list) -> list[list]:
    """Batches that do not answer `requests` (whose answers are `events`): each
    other kind of answer, and the right answers but the last."""
    kind = kind_of(requests, events)
    batches = [[sample] * len(requests) for other, sample in SAMPLE.items() if other is not kind]
    return batches + [events[:-1]]


class RefusingSwarm(Swarm):
    """The simulated swarm, feeding wrong batches before the right one now and then."""

    def __init__(self, rng: random.Random, servers: list, wrong_rate: float) -> None:
        super().__init__(rng, servers)
        self.wrong_rate = wrong_rate

    def answer(self, core: ChainCore, requests: list) -> list:
        events = [self.perform(r) for r in requests]
        phase = core.phase
        TAKEN.add((phase, kind_of(requests, events)))
        if self.rng.random() < self.wrong_rate:
            wrong = self.rng.choice(wrong_batches(requests, events))
            with pytest.raises(UnexpectedEvents, match=phase.value):
                core.feed(wrong)
            assert core.phase is phase and not core.idle
            REFUSED.add(phase)
        return core.feed(events)


FAULTS = ["a hop fails", "a side session fails", "opens fail", "a replay fails", "a server dies"]


class TableRun(RuleBasedStateMachine):
    """A generation with spot checks (lying verifiers among the servers), or standbys;
    links and failures; wrong answers fed in between."""

    @initialize(seed=st.integers(0, 2**16), rate=st.sampled_from([0.0, 0.5, 1.0]), standby=st.booleans(),
                push=st.booleans(), first=st.integers(1, 500))
    def open_chain(self, seed, rate, standby, push, first):
        # A standby's answers are never checked: no liar among them.
        self.swarm = RefusingSwarm(random.Random(seed), pool(liars=0 if standby else 2), wrong_rate=0.2)
        self.core = ChainCore(can_fail_over=True, spot_check_rate=rate, rng=random.Random(seed + 1),
                              receipt_steps=3, replay_max_tokens=5, standby=standby, push=push)
        self.reference = Cache(0, BLOCKS)
        self.deaths = 0
        self.last = first
        self.swarm.drive(self.core, self.core.open(self.swarm.plan(0, BLOCKS)))

    @rule(tokens=st.integers(1, 4),
          faults=st.lists(st.tuples(st.sampled_from(FAULTS), st.integers(0, 7)), max_size=3))
    def step(self, tokens, faults):
        for fault, n in faults:
            self.inject(fault, n)
        values = [float((self.last + 7 * i) % 100_003) for i in range(tokens)]
        self.swarm.drive(self.core, self.core.start_step(tensor(values), tokens))
        [expected] = self.reference.run(values, (tokens,), last_only=False)
        assert torch.equal(self.core.output, tensor(expected)), "the output differs from a failure-free run's"
        self.last = math.floor(expected[-1])

    def inject(self, fault: str, n: int) -> None:
        swarm, core = self.swarm, self.core
        hop = core.hops[n % len(core.hops)]
        side = [v.session for v in (*core.verifiers.values(), *core.standbys.values())]
        if fault == "a hop fails":
            swarm.fail_next[hop] = ["timeout", "connection_lost", "closed", "internal"][n % 4]
        elif fault == "a side session fails" and side:
            swarm.fail_next[side[n % len(side)]] = "timeout"
        elif fault == "opens fail":
            swarm.open_failures = min(5, swarm.open_failures + n % 3 + 1)
        elif fault == "a replay fails":
            swarm.replay_failure = n % 3
        elif fault == "a server dies" and self.deaths < 2:
            swarm.servers[hop.peer_id].dead = True
            self.deaths += 1

    @invariant()
    def idle_between_steps(self):
        assert self.core.idle and self.core.phase is Phase.IDLE
        with pytest.raises(UnexpectedEvents, match="no request pending"):
            self.core.feed([Done()])


SETTINGS = settings(max_examples=120, stateful_step_count=25, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))


def test_wrong_answers_are_refused_and_every_listed_transition_is_taken():
    TAKEN.clear()
    REFUSED.clear()
    run_state_machine_as_test(TableRun, settings=SETTINGS)
    TAKEN.add(direct_step_pair())
    assert sorted(set(TRANSITIONS) - TAKEN, key=str) == [], "listed transitions never taken"
    assert TAKEN <= set(TRANSITIONS)
    assert REFUSED == {phase for phase, _ in TRANSITIONS}, "phases never fed a wrong answer"


def direct_step_pair() -> tuple[Phase, Kind]:
    """A direct step (the simulated swarm has no proofs: test_chain_direct's core)."""
    core = linked_core()
    x, y, z, w = (tensor32([value]) for value in (1.0, 2.0, 3.0, 4.0))
    batch = start_direct(core, x)
    events = [reply(0, 0, x, y, sent=True), reply(1, 0, y, z), reply(2, 0, z, w)]
    pair = core.phase, kind_of(batch, events)
    with pytest.raises(UnexpectedEvents, match="stepping directly"):
        core.feed([RouteFound((make_hop("a", 0, 4),))] * 3)
    REFUSED.add(core.phase)
    core.feed(events)
    assert core.idle and core.output is w
    return pair
