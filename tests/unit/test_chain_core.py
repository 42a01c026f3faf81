"""pipeline/client/chain_core.py, the consumer chain's pure core: replay and catch-up
plans, failover, blame, receipts, links; and a stateful test running it against a
simulated swarm under random failures, whose outputs must equal a failure-free run's.

The simulated servers are exact: a block keeps a running hash of every token it has
seen (its "KV cache"), so a server whose history was replayed wrongly (a step
missing, out of order) answers differently from then on. The low bits of each
output also encode how the tokens were chunked, as a real server's rounding does:
a replay with other chunk sizes changes them (bit-identity is lost), a spot check's
batched catch-up changes them too but stays far within the tolerance."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch
from hypothesis import HealthCheck, Phase, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from compushare.errors import HopFailed, HopUnavailable, RouteError
from compushare.net.records import ServerRecord
from compushare.pipeline.client import chain_rebuild
from compushare.pipeline.client.chain_core import ChainCore
from compushare.pipeline.client.chain_events import (
    EFFECTS, REQUESTS, Abort, Answered, Close, Done, Failed, FileReport, FindRoute, FindVerifier, Forgive, HopReply,
    HopStepRequest, Link, OpenSession, Penalise, RouteFound, SendReceipt, SendSteps, SessionOpened, VerifierFound,
)
from compushare.pipeline.client.chain_plan import catch_up_plan, group_steps, replay_plan
from compushare.pipeline.client.routing import Hop

BLOCKS = 4
MOD = 2_147_483_647
MUL = 48_271


def make_hop(peer: str, start: int, end: int, held: tuple[int, int] | None = None) -> Hop:
    lo, hi = held or (start, end)
    return Hop(ServerRecord(peer, "m", lo, hi, "float32", (), math.inf, 0), start, end)


def tensor(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64).view(1, len(values), 1)


# -- the simulated swarm ---------------------------------------------------------------

class Cache:
    """A session's state on blocks start..end-1: per block a running hash and the
    number of chunks it ran."""

    def __init__(self, start: int, end: int) -> None:
        self.blocks = range(start, end)
        self.hashes = {b: 0 for b in self.blocks}
        self.chunks = {b: 0 for b in self.blocks}
        self.position = 0

    def run(self, values: list[float], chunks: tuple[int, ...], last_only: bool) -> list[list[float]]:
        out, offset = [], 0
        for size in chunks:
            chunk = []
            for value in values[offset:offset + size]:
                x = math.floor(value)
                code = round((value - x) * 16)
                for b in self.blocks:
                    x = self.hashes[b] = (self.hashes[b] * MUL + x + b + 1) % MOD
                    code = (code * 3 + self.chunks[b] * 5 + size + b) % 16
                chunk.append(x + code / 16)
            for b in self.blocks:
                self.chunks[b] += 1
            out.append(chunk)
            offset += size
        self.position += len(values)
        return out[-1:] if last_only else out


@dataclasses.dataclass
class Server:
    peer_id: str
    start: int
    end: int
    liar: float = 0.0  # when set, every output is scaled by 1 + liar
    dead: bool = False


class Swarm:
    """Servers, a planner and a synchronous driver for the core's actions."""

    def __init__(self, rng: random.Random, servers: list[Server]) -> None:
        self.rng = rng
        self.servers = {s.peer_id: s for s in servers}
        self.caches: dict = {}  # HopSession -> Cache
        self.fail_next: dict = {}  # HopSession -> error code for its next request
        self.open_failures = 0  # the next this many opens fail
        self.replay_failure: int | None = None  # the next replay fails after this many requests
        self.penalties: list[Penalise] = []
        self.reports: list[FileReport] = []
        self.routes_found = 0

    def plan(self, start: int, end: int) -> list[Hop]:
        route, position = [], start
        while position < end:
            fits = [s for s in self.servers.values() if s.start <= position < s.end and not s.dead and not s.liar]
            if not fits:
                raise RouteError(f"nobody serves block {position}")
            server = self.rng.choice(sorted(fits, key=lambda s: s.peer_id))
            route.append(make_hop(server.peer_id, position, min(server.end, end), (server.start, server.end)))
            position = route[-1].end
        return route

    def drive(self, core: ChainCore, actions: list) -> None:
        while True:
            requests = [a for a in actions if isinstance(a, REQUESTS)]
            for action in actions:
                assert isinstance(action, REQUESTS + EFFECTS)
                if isinstance(action, Penalise):
                    self.penalties.append(action)
                elif isinstance(action, FileReport):
                    self.reports.append(action)
                elif isinstance(action, (Abort, Close)):
                    self.caches.pop(action.session, None)
            if not requests:
                return
            actions = self.answer(core, requests)

    def answer(self, core: ChainCore, requests: list) -> list:
        """Perform `requests` and feed the core their answers: its next actions."""
        return core.feed([self.perform(r) for r in requests])

    def perform(self, request):
        if isinstance(request, OpenSession):
            server = self.servers[request.session.peer_id]
            if self.open_failures or server.dead:
                self.open_failures = max(0, self.open_failures - 1)
                return Failed(HopUnavailable(server.peer_id, "busy", "no room"))
            self.caches[request.session] = Cache(*request.session.span)
            return SessionOpened()
        if isinstance(request, SendSteps):
            return self.send(request)
        if isinstance(request, FindRoute):
            self.routes_found = 0 if request.fresh else self.routes_found + 1
            if self.routes_found > 30:
                raise RouteError(f"blocks {request.start}:{request.end} stayed uncovered")
            return RouteFound(tuple(self.plan(request.start, request.end)))
        if isinstance(request, FindVerifier):
            fits = sorted((s for s in self.servers.values() if s.start <= request.start and request.end <= s.end
                           and not s.dead and s.peer_id not in request.exclude), key=lambda s: s.peer_id)
            server = self.rng.choice(fits) if fits else None
            return VerifierFound(server and make_hop(server.peer_id, request.start, request.end,
                                                     (server.start, server.end)))
        assert isinstance(request, (Link, SendReceipt))
        return Done()

    def send(self, request: SendSteps):
        session = request.session
        server, cache = self.servers[session.peer_id], self.caches.get(session)
        replay = cache is not None and cache.position == 0 and self.replay_failure is not None
        replies, parts = [], []
        for index, step in enumerate(request.requests):
            code = self.fail_next.pop(session, None) or ("connection_lost" if server.dead or cache is None else None)
            if replay and index == min(self.replay_failure, len(request.requests) - 1):
                code, self.replay_failure = "timeout", None
            if code is None and step.position != cache.position:
                code = "out_of_order"
            if code is not None:
                self.caches.pop(session, None)
                return Failed(HopFailed(session.peer_id, code, "simulated"), answered=index)
            values = [v for payload in step.inputs for v in payload.flatten().tolist()]
            assert sum(step.chunks) == len(values)
            chunks = [[v * (1 + server.liar) for v in c] for c in cache.run(values, step.chunks, step.last_only)]
            output = tensor([v for c in chunks for v in c])
            replies.append(HopReply(output))
            if not step.last_only:  # one part per chunk, or per original step (splits), as chain.py cuts them
                parts.extend(torch.split(output, list(step.splits or step.chunks), dim=1))
        return Answered(tuple(replies), tuple(parts))


def pool(liars: int = 2) -> list[Server]:
    spans = {"a": (0, 4), "b": (0, 4), "c": (0, 4), "d": (0, 2), "e": (0, 2), "f": (2, 4), "g": (2, 4),
             "h": (0, 1), "i": (1, 2), "j": (2, 3), "k": (3, 4), "l": (1, 3)}
    servers = [Server(name, *span) for name, span in spans.items()]
    return servers + [Server(f"liar{n}", 0, 4, liar=0.5 * (n + 1)) for n in range(liars)]


# -- plans -----------------------------------------------------------------------------

def test_group_steps_packs_up_to_the_limit_and_a_long_step_alone():
    assert group_steps([3, 1, 1, 5, 1], limit=5) == [(0, 3), (3, 4), (4, 5)]
    assert group_steps([9, 1], limit=5) == [(0, 1), (1, 2)]
    assert group_steps([], limit=5) == []


def test_replay_plan_keeps_each_step_a_chunk_from_position_zero():
    steps = ["s0", "s1", "s2", "s3"]
    plan = replay_plan(steps, [5, 1, 1, 1], limit=6)
    assert plan == (HopStepRequest(0, ("s0", "s1"), (5, 1)), HopStepRequest(6, ("s2", "s3"), (1, 1)))
    assert replay_plan([], []) == ()


def test_a_fast_replay_plan_runs_each_request_as_one_chunk_cut_back_per_step():
    steps = ["s0", "s1", "s2", "s3"]
    assert replay_plan(steps, [5, 1, 1, 1], limit=6, fast=True) == (
        HopStepRequest(0, ("s0", "s1"), (6,), splits=(5, 1)), HopStepRequest(6, ("s2", "s3"), (2,), splits=(1, 1)))
    # a step that kept 2 of the 4 tokens it computed still ends its request; the next rolls back
    assert replay_plan(["a", "b", "c", "d"], [3, 2, 1, 1], computed=[3, 4, 1, 1], fast=True) == (
        HopStepRequest(0, ("a", "b"), (7,), splits=(3, 4)),
        HopStepRequest(5, ("c", "d"), (2,), rollback=True, splits=(1, 1)))


def test_catch_up_plan_batches_the_missed_steps_and_ends_with_this_one():
    seen = ["s0", "s1", "s2", "s3"]
    # fed 1 of 4 steps (sizes 5, 1, 1, 1): from position 5, the missed steps then this one
    assert catch_up_plan(seen, [5, 1, 1, 1], 1, "now", 2) == (
        HopStepRequest(5, ("s1", "s2", "s3", "now"), (3, 2), last_only=True),)
    # a small limit: the first groups whole, the last one split off
    assert catch_up_plan(seen, [5, 1, 1, 1], 1, "now", 2, limit=2) == (
        HopStepRequest(5, ("s1", "s2"), (2,), last_only=True), HopStepRequest(7, ("s3",), (1,), last_only=True),
        HopStepRequest(8, ("now",), (2,), last_only=True))
    assert catch_up_plan(seen, [5, 1, 1, 1], 4, "now", 1) == (HopStepRequest(8, ("now",), (1,), last_only=True),)


# -- the core, event by event ----------------------------------------------------------

def requests_of(actions):
    return [a for a in actions if isinstance(a, REQUESTS)]


def effects_of(actions):
    return [a for a in actions if isinstance(a, EFFECTS)]


def opened_core(hops: list[Hop], **options) -> ChainCore:
    core = ChainCore(can_fail_over=options.pop("can_fail_over", True), push=options.pop("push", False),
                     clock=lambda: 1000.0, **options)
    actions = core.open(hops)
    assert [a.session.hop for a in actions if isinstance(a, OpenSession)] == hops
    assert requests_of(core.feed([SessionOpened()] * len(hops))) == []
    assert core.idle and [s.hop for s in core.hops] == hops
    return core


def answer(*outputs, parts=None) -> Answered:
    return Answered(tuple(HopReply(o) for o in outputs), tuple(parts if parts is not None else outputs))


def run_step(core: ChainCore, hidden, outputs: list) -> list:
    """A step every hop answers (no checks): its actions, the last batch's effects."""
    actions = core.start_step(hidden, hidden.shape[1])
    for output in outputs:
        [request] = requests_of(actions)
        assert isinstance(request, SendSteps) and request.requests[0].position == core.position
        actions = core.feed([answer(output)])
    return actions


def test_a_step_goes_through_every_hop_and_keeps_the_history():
    hops = [make_hop("a", 0, 2), make_hop("b", 2, 4)]
    core = opened_core(hops)
    x, y, z = tensor([1.0, 2.0]), tensor([3.0, 4.0]), tensor([5.0, 6.0])
    run_step(core, x, [y, z])
    assert core.idle and core.output is z and core.position == 2
    assert core.history.sizes == [2] and core.history.inputs == {0: [x], 2: [y]}


def test_without_a_planner_the_first_failure_is_raised():
    core = opened_core([make_hop("a", 0, 4)], can_fail_over=False)
    core.start_step(tensor([1.0]), 1)
    with pytest.raises(HopFailed, match="simulated"):
        core.feed([Failed(HopFailed("a", "timeout", "simulated"))])


def test_a_failed_hop_is_replaced_by_a_split_route_with_its_history_replayed():
    hops = [make_hop("a", 0, 2), make_hop("b", 2, 4)]
    core = opened_core(hops, replay_max_tokens=3)
    steps = [tensor([1.0, 2.0]), tensor([3.0]), tensor([4.0])]
    mids = [tensor([10.0, 20.0]), tensor([30.0]), tensor([40.0])]
    for step, mid in zip(steps[:2], mids[:2]):
        run_step(core, step, [mid, mid + 1])
    actions = core.start_step(steps[2], 1)
    actions = core.feed([answer(mids[2])])
    failure = HopFailed("b", "timeout", "b did not answer")
    actions = core.feed([Failed(failure)])
    assert effects_of(actions) == [Penalise("b", "fault"), Abort(core.retired[0])]
    assert requests_of(actions) == [FindRoute(2, 4, fresh=True)]
    assert core.failovers[0].peer_id == "b" and core.failovers[0].reason == "timeout"
    # c covers 2:3, d 3:4: each is opened and replayed in turn
    actions = core.feed([RouteFound((make_hop("c", 2, 3), make_hop("d", 3, 4)))])
    [open_c] = requests_of(actions)
    actions = core.feed([SessionOpened()])
    assert effects_of(actions) == [Forgive("c")]
    [replay] = requests_of(actions)
    assert replay.session is open_c.session
    assert replay.requests == (HopStepRequest(0, (mids[0], mids[1]), (2, 1)), HopStepRequest(3, (mids[2],), (1,)))
    c_out = [tensor([7.0, 7.0]), tensor([8.0]), tensor([9.0])]
    actions = core.feed([answer(torch.cat(c_out[:2], 1), c_out[2], parts=c_out)])
    [open_d] = requests_of(actions)
    [replay] = requests_of(core.feed([SessionOpened()]))
    assert replay.session is open_d.session and replay.requests[0].inputs == (c_out[0], c_out[1])
    final = [tensor([1.5, 1.5]), tensor([2.5]), tensor([3.5])]
    actions = core.feed([answer(torch.cat(final[:2], 1), final[2], parts=final)])
    assert requests_of(actions) == [] and core.idle
    assert core.output is final[2] and core.position == 4
    assert [s.peer_id for s in core.hops] == ["a", "c", "d"]
    assert core.history.inputs[3] == c_out and core.history.inputs[2] == mids
    assert core.failovers[0].replacements == ("c", "d") and core.failovers[0].recovered == 1000.0


def test_a_fast_replay_sends_the_kept_history_as_one_chunk_and_takes_the_last_rows():
    """With fast_replay, a replacement ending the span gets the kept tokens (rejected
    drafts cut off, no rollback) as one chunk and the step under way as its last,
    last rows only: one forward, nothing of the history sent back."""
    core = opened_core([make_hop("a", 0, 4)], fast_replay=True)
    x1, x2, x3 = tensor([1.0, 2.0]), tensor([3.0, 4.0, 5.0]), tensor([6.0])
    run_step(core, x1, [tensor([0.0, 0.0])])
    run_step(core, x2, [tensor([0.0, 0.0, 0.0])])
    core.rewind(3)  # the verify pass kept 1 of its 3 tokens
    core.start_step(x3, 1)
    core.feed([Failed(HopFailed("a", "closed", "gone"))])
    core.feed([RouteFound((make_hop("c", 0, 4),))])
    [replay] = requests_of(core.feed([SessionOpened()]))
    [request] = replay.requests
    assert (request.position, request.chunks, request.last_only, request.rollback) == (0, (3, 1), True, False)
    assert [t.tolist() for t in request.inputs] == [x1.tolist(), x2[:, :1].tolist(), x3.tolist()]
    out = tensor([9.0])
    assert requests_of(core.feed([answer(out, parts=())])) == [] and core.idle
    assert core.output is out and core.position == 4 and core.history.sizes == [2, 1, 1]


def test_a_replacement_failing_mid_replay_is_dropped_and_the_rest_replanned():
    core = opened_core([make_hop("a", 0, 4)])
    run_step(core, tensor([1.0]), [tensor([2.0])])
    core.start_step(tensor([3.0]), 1)
    core.feed([Failed(HopFailed("a", "closed", "gone"))])
    core.feed([RouteFound((make_hop("c", 0, 4),))])
    actions = core.feed([SessionOpened()])
    [replay] = requests_of(actions)
    actions = core.feed([Failed(HopFailed("c", "timeout", "slow"), answered=0)])
    assert effects_of(actions) == [Penalise("c", "fault"), Abort(replay.session)]
    assert requests_of(actions) == [FindRoute(0, 4, fresh=False)]  # the same failover's deadline
    assert replay.session in core.retired


def test_a_hop_that_cannot_be_opened_is_rebuilt_with_an_empty_history():
    hops = [make_hop("a", 0, 2), make_hop("b", 2, 4)]
    core = ChainCore(can_fail_over=True, push=False)
    core.open(hops)
    actions = core.feed([SessionOpened(), Failed(HopUnavailable("b", "busy", "full"))])
    assert effects_of(actions) == [Forgive("a"), Penalise("b", "fault")]
    assert requests_of(actions) == [FindRoute(2, 4, fresh=True)]
    core.feed([RouteFound((make_hop("c", 2, 4),))])
    assert requests_of(core.feed([SessionOpened()])) == [] and core.idle  # nothing to replay
    assert [s.peer_id for s in core.hops] == ["a", "c"]


def test_links_are_sent_when_the_neighbours_change():
    core = opened_core([make_hop("a", 0, 2), make_hop("b", 2, 4)], push=True)
    actions = core.start_step(tensor([1.0]), 1)
    a, b = core.hops
    assert actions == [Link(a, None, b), Link(b, "a", None)]
    actions = core.feed([Done(), Done()])
    core.feed([answer(tensor([2.0]))])
    core.feed([answer(tensor([3.0]))])
    actions = core.start_step(tensor([4.0]), 1)
    assert [type(r) for r in actions] == [SendSteps]  # nothing changed


def test_receipts_are_due_every_few_answered_requests_of_a_live_session():
    core = opened_core([make_hop("a", 0, 2), make_hop("b", 2, 4)], receipt_steps=3)
    for value in range(2):
        assert requests_of(run_step(core, tensor([float(value)]), [tensor([1.0]), tensor([2.0])])) == []
    actions = run_step(core, tensor([2.0]), [tensor([1.0]), tensor([2.0])])
    assert requests_of(actions) == [SendReceipt(s) for s in core.hops]
    assert requests_of(core.feed([Done(), Done()])) == [] and core.idle
    assert all(s.answered == 0 for s in core.hops)


# -- spot checks and blame ---------------------------------------------------------------

TRUE, WRONG, OTHER = tensor([1.0, 2.0]), tensor([1.5, 2.5]), tensor([9.0, 9.0])


def checked_step(core: ChainCore, primary, check, arbiter):
    """A step of a one-hop chain checked by v, disputed when the answers differ and
    arbitrated by w (`arbiter` None: nobody else serves the span)."""
    actions = core.start_step(tensor([0.0, 0.0]), 2)
    assert requests_of(actions) == [FindVerifier(0, 4, frozenset({"a"}))]
    [opening] = requests_of(core.feed([VerifierFound(make_hop("v", 0, 4))]))
    [step, check_request] = requests_of(core.feed([SessionOpened()]))
    assert check_request.session is opening.session and check_request.requests[-1].last_only
    actions = core.feed([answer(primary), answer(check)])
    if not requests_of(actions) or not isinstance(requests_of(actions)[0], FindVerifier):
        return actions
    assert requests_of(actions) == [FindVerifier(0, 4, frozenset({"a", "v"}))]
    if arbiter is None:
        return core.feed([VerifierFound(None)])
    [opened] = requests_of(core.feed([VerifierFound(make_hop("w", 0, 4))]))
    [third] = requests_of(core.feed([SessionOpened()]))
    assert third.session is opened.session and third.requests[0].position == 0  # the whole history
    return core.feed([answer(arbiter)])


@pytest.mark.parametrize("primary, check, arbiter, accused, penalised, fails_over, verifier_kept", [
    (TRUE, TRUE, None, None, [], False, True),  # agreement: no third opinion asked
    (WRONG, TRUE, TRUE, "a", [Penalise("a", "mismatch")], True, True),
    (TRUE, WRONG, TRUE, "v", [Penalise("v", "mismatch")], False, False),  # a lying verifier is outvoted
    (WRONG, OTHER, TRUE, "a", [Penalise("v", "mismatch"), Penalise("a", "mismatch")], True, False),  # both
    (TRUE, WRONG, None, "a", [Penalise("a", "mismatch")], True, True),  # no third opinion: the checked hop
    (TRUE, WRONG, TRUE * (1 + 1e-7), "v", [Penalise("v", "mismatch")], False, False),
])
def test_blame(primary, check, arbiter, accused, penalised, fails_over, verifier_kept):
    core = opened_core([make_hop("a", 0, 4)], spot_check_rate=1.0)
    actions = checked_step(core, primary, check, arbiter)
    reports = [a for a in actions if isinstance(a, FileReport)]
    assert [r.accused.peer_id for r in reports] == ([accused] if accused else [])
    if reports:
        assert reports[0].witness.peer_id == ({"a", "v"} - {accused}).pop()
        assert (reports[0].position, reports[0].tokens) == (0, 2)
    assert [a for a in actions if isinstance(a, Penalise)] == penalised
    assert core.checks == 1
    if fails_over:
        assert requests_of(actions) == [FindRoute(0, 4, fresh=True)]
        assert [f.reason for f in core.failovers] == ["mismatch"]
    else:
        assert core.idle and core.output is primary and not core.failovers
    assert ("v" in {s.peer_id for s in core.live()}) == verifier_kept


def test_a_verifier_is_caught_up_on_the_steps_it_missed():
    core = opened_core([make_hop("a", 0, 4)], spot_check_rate=1.0)
    checked_step(core, TRUE, TRUE, None)
    verifier = core.verifiers[(0, 4)]
    assert verifier.fed == 1
    core.spot_check_rate = 0.0  # two unchecked steps
    missed = [tensor([1.0]), tensor([2.0])]
    for step in missed:
        run_step(core, step, [tensor([1.0])])
    core.spot_check_rate, core.schedules = 1.0, {}
    now = tensor([5.0])
    [step, check] = requests_of(core.start_step(now, 1))  # the verifier is kept: none looked for
    assert check.session is verifier.session
    # from position 2 (it saw the first step, 2 tokens): the two missed steps as one
    # chunk, this one as the last, only its output returned
    assert check.requests == (HopStepRequest(2, (missed[0], missed[1], now), (2, 1), last_only=True),)
    core.feed([answer(tensor([6.0])), answer(tensor([6.0]))])
    assert verifier.fed == 4 and core.checks == 2 and core.idle


# -- the stateful test -------------------------------------------------------------------

FAULTS = ["a hop fails", "a hop lies", "a verifier fails", "opens fail", "a replay fails", "a server dies"]


class ChainRun(RuleBasedStateMachine):
    """One generation through the simulated swarm, with failures injected between
    steps; every step's output and the chain's position must equal those of a
    failure-free run (one session through every block). In "faults" mode servers fail
    and spot checks (at any rate) may go to lying verifiers; in "liars" mode every step
    is checked and hops of the route start lying (a lying replacement's first answer
    is not checked, by design: the planner here gives only honest ones)."""

    @initialize(seed=st.integers(0, 2**16), mode=st.sampled_from(["faults", "liars"]),
                rate=st.sampled_from([0.0, 0.5, 1.0]), first=st.integers(1, 500), fast=st.booleans())
    def open_chain(self, seed, mode, rate, first, fast):
        self.mode, self.fast = mode, fast
        self.swarm = Swarm(random.Random(seed), pool())
        self.core = ChainCore(can_fail_over=True, spot_check_rate=1.0 if mode == "liars" else rate,
                              rng=random.Random(seed + 1), receipt_steps=4, replay_max_tokens=5,
                              fast_replay=fast)
        self.reference = Cache(0, BLOCKS)
        self.deaths = self.corruptions = 0
        self.last = first
        self.drive(self.core.open(self.swarm.plan(0, BLOCKS)))

    def drive(self, actions: list) -> None:
        try:
            self.swarm.drive(self.core, actions)
        except Exception as exc:  # a route that cannot be rebuilt, a plan the servers reject...
            raise AssertionError(f"the chain failed: {exc!r}") from exc

    @rule(tokens=st.integers(1, 4),
          faults=st.lists(st.tuples(st.sampled_from(FAULTS), st.integers(0, 7)), max_size=3))
    def step(self, tokens, faults):
        """Some failures are set up, then one step runs (a prefill chunk or a token)."""
        for fault, n in faults:
            self.inject(fault, n)
        values = [float((self.last + 7 * i) % 100_003) for i in range(tokens)]
        self.drive(self.core.start_step(tensor(values), tokens))
        [expected] = self.reference.run(values, (tokens,), last_only=False)
        if self.fast:  # within the tolerance: only the rounding (the low bits, how it was chunked) may differ
            assert torch.equal(self.core.output.floor(), tensor(expected).floor()), "the output is out of tolerance"
        else:
            assert torch.equal(self.core.output, tensor(expected)), "the output differs from a failure-free run's"
        assert self.core.position == self.reference.position
        self.last = math.floor(expected[-1])

    def inject(self, fault: str, n: int) -> None:
        swarm, hop = self.swarm, self.core.hops[n % len(self.core.hops)]
        if fault == "a hop fails":  # its next request: error reply, lost stream, deadline
            swarm.fail_next[hop] = ["timeout", "connection_lost", "closed", "internal"][n % 4]
        elif self.mode == "liars":
            if fault == "a hop lies" and self.corruptions < 3:  # found out by the next check (rate 1)
                self.corruptions += 1  # each lies its own way: two liars never agree
                swarm.servers[hop.peer_id].liar = 0.1 * self.corruptions + 0.05
        elif fault == "a verifier fails" and self.core.verifiers:
            verifiers = list(self.core.verifiers.values())
            swarm.fail_next[verifiers[n % len(verifiers)].session] = "timeout"
        elif fault == "opens fail":
            swarm.open_failures = min(5, swarm.open_failures + n % 3 + 1)
        elif fault == "a replay fails":  # the next fresh session, after this many requests
            swarm.replay_failure = n % 3
        elif fault == "a server dies" and self.deaths < 2:
            swarm.servers[hop.peer_id].dead = True
            self.deaths += 1

    @invariant()
    def every_hop_holds_the_whole_history(self):
        core = self.core
        assert core.idle
        ends = [s.hop.end for s in core.hops]
        assert [s.span for s in core.hops] == list(zip([0] + ends[:-1], ends)) and ends[-1] == BLOCKS
        for session in core.hops:
            assert self.swarm.caches[session].position == core.position
            assert len(core.history.at(session.hop.start)) == len(core.history.sizes)


SETTINGS = settings(max_examples=150, stateful_step_count=30, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))


def test_outputs_equal_a_failure_free_run_whatever_fails():
    run_state_machine_as_test(ChainRun, settings=SETTINGS)


def _drop_first_step(plan):
    return lambda steps, sizes, limit, computed, **options: plan(steps[1:], sizes[1:], limit, computed[1:], **options)


def _one_position_late(plan):
    return lambda *args, **options: tuple(dataclasses.replace(r, position=r.position + 1)
                                          for r in plan(*args, **options))


@pytest.mark.parametrize("mistake", [_drop_first_step, _one_position_late])
def test_the_stateful_check_catches_a_wrong_replay_plan(monkeypatch, mistake):
    monkeypatch.setattr(chain_rebuild, "replay_plan", mistake(chain_rebuild.replay_plan))
    with pytest.raises(AssertionError):
        run_state_machine_as_test(ChainRun, settings=settings(SETTINGS, max_examples=60, report_multiple_bugs=False,
                                                              phases=[Phase.generate]))
