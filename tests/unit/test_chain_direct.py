"""Direct return in the consumer chain's pure core (chain_core.py): one batch of
requests per step, answers taken while their signed proofs link up, and every way
a direct step can fall back to hop-by-hop relaying; and `rewind` (speculation)."""

from __future__ import annotations

import math

import numpy as np
import torch
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID

from compushare.errors import HopFailed
from compushare.net.records import ServerRecord
from compushare.pipeline.client.chain_core import ChainCore
from compushare.pipeline.client.chain_events import (
    EFFECTS, REQUESTS, Answered, Close, Done, Failed, FindRoute, FindVerifier, HopReply, HopStepRequest, Link,
    OpenSession, RouteFound, SendSteps, SessionOpened, VerifierFound,
)
from compushare.pipeline.client.chain_plan import Verifier, replay_plan
from compushare.pipeline.client.routing import Hop
from compushare.pipeline.messages import Proof
from compushare.proofs.inference import DEFAULT_MODE, GENESIS, Statement, step_digest

MODEL = "m"
KEYS = [create_new_key_pair(bytes([i + 1]) * 32) for i in range(4)]
PEERS = [ID.from_pubkey(k.public_key).to_base58() for k in KEYS]
SPANS = [(0, 1), (1, 3), (3, 4)]


def hop(index: int, span=None) -> Hop:
    start, end = span or SPANS[index]
    return Hop(ServerRecord(PEERS[index], MODEL, start, end, "float32", (), math.inf, 0), start, end)


def tensor(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32).view(1, len(values), 1)


def data(t: torch.Tensor) -> bytes:
    return t.numpy().astype("<f4").tobytes()


def digest(t: torch.Tensor) -> bytes:
    return step_digest("float32", data(t), t.shape[1])


def reply(index: int, position: int, inp: torch.Tensor, out: torch.Tensor, *, sent: bool = False,
          signed_input: bytes | None = None, signed_output: bytes | None = None) -> Answered:
    """Hop `index`'s answer: `out` computed from `inp`, proved as a server signs it."""
    start, end = SPANS[index]
    tokens = inp.shape[1]
    in_digest = signed_input if signed_input is not None else digest(inp)
    out_digest = signed_output if signed_output is not None else digest(out)
    statement = Statement(DEFAULT_MODE, MODEL, start, end, position, tokens, GENESIS, in_digest, out_digest)
    proof = Proof(position, tokens, DEFAULT_MODE, GENESIS, in_digest, out_digest, statement.sign(KEYS[index]))
    return Answered((HopReply(out, data(out), "float32", proof, digest(inp) if sent else b""),), (out,))


def linked_core(**options) -> ChainCore:
    core = ChainCore(can_fail_over=True, push=True, direct=True, model_id=MODEL, direct_max_tokens=64,
                     clock=lambda: 1000.0, **options)
    core.open([hop(i) for i in range(3)])
    core.feed([SessionOpened()] * 3)
    return core


def requests_of(actions):
    return [a for a in actions if isinstance(a, REQUESTS)]


def start_direct(core: ChainCore, x: torch.Tensor) -> list[SendSteps]:
    actions = core.start_step(x, x.shape[1])
    if any(isinstance(a, Link) for a in actions):
        actions = core.feed([Done(True)] * len(requests_of(actions)))
    batch = requests_of(actions)
    assert [type(r) for r in batch] == [SendSteps] * 3
    return batch


def test_a_direct_step_is_one_batch_and_its_linked_proofs_are_taken():
    core = linked_core()
    x = tensor([1.0, 2.0])
    y, z, w = x + 1, x + 2, x + 3
    batch = start_direct(core, x)
    first, second, third = (r.requests[0] for r in batch)
    assert first == HopStepRequest(0, (x,), (2,))
    assert second == third == HopStepRequest(0, (), (2,), from_upstream=True)
    actions = core.feed([reply(0, 0, x, y, sent=True), reply(1, 0, y, z), reply(2, 0, z, w)])
    assert requests_of(actions) == [] and core.idle
    assert core.output is not None and torch.equal(core.output, w) and core.position == 2
    assert core.direct_steps == 1 and core.chain_breaks == 0
    assert {b: [t.tolist() for t in v] for b, v in core.history.inputs.items()} == {
        0: [x.tolist()], 1: [y.tolist()], 3: [z.tolist()]}


def test_a_server_whose_signed_input_is_not_the_previous_signed_output_breaks_the_chain():
    """b signs an input other than a's signed output (a pushed other bytes, or b lies):
    b's step is relayed from a's signed output with a rollback, c's answer (from b's
    unchecked output) is cut back too, and the chain stops going direct."""
    core = linked_core()
    x = tensor([1.0])
    y, z, w = x + 1, x + 2, x + 3
    start_direct(core, x)
    forged = digest(y + 0.5)
    actions = core.feed([reply(0, 0, x, y, sent=True), reply(1, 0, y + 0.5, z, signed_input=forged),
                         reply(2, 0, z, w)])
    assert core.chain_breaks == 1
    [relay] = requests_of(actions)
    b, c = core.hops[1], core.hops[2]
    assert relay.session is b and relay.requests[0] == HopStepRequest(0, (y,), (1,), rollback=True)
    [relay] = requests_of(core.feed([reply(1, 0, y, z, sent=True)]))
    assert relay.session is c and relay.requests[0] == HopStepRequest(0, (z,), (1,), rollback=True)
    core.feed([reply(2, 0, z, w, sent=True)])
    assert core.idle and torch.equal(core.output, w) and not core.rollback
    # the next step goes hop by hop
    actions = core.start_step(tensor([5.0]), 1)
    assert [r.session for r in requests_of(actions)] == [core.hops[0]]


def test_returned_bytes_must_be_the_signed_ones():
    core = linked_core()
    x = tensor([1.0])
    y, z, w = x + 1, x + 2, x + 3
    start_direct(core, x)
    actions = core.feed([reply(0, 0, x, y, sent=True), reply(1, 0, y, z),
                         reply(2, 0, z, w, signed_output=digest(w + 1))])
    [relay] = requests_of(actions)
    assert relay.session is core.hops[2] and relay.requests[0].rollback and core.chain_breaks == 1


def test_a_hop_without_its_push_is_relayed_and_a_dead_one_failed_over():
    core = linked_core()
    x = tensor([1.0])
    y, z = x + 1, x + 2
    start_direct(core, x)
    no_input = Failed(HopFailed(PEERS[1], "no_input", "no push"))
    actions = core.feed([reply(0, 0, x, y, sent=True), no_input, no_input])
    [relay] = requests_of(actions)
    assert relay.session is core.hops[1] and relay.requests[0] == HopStepRequest(0, (y,), (1,))
    [relay] = requests_of(core.feed([reply(1, 0, y, z, sent=True)]))
    assert relay.session is core.hops[2] and not relay.requests[0].rollback  # its cache never moved

    core = linked_core()
    start_direct(core, x)
    dead = Failed(HopFailed(PEERS[1], "connection_lost", "gone"))
    actions = core.feed([reply(0, 0, x, y, sent=True), dead, reply(2, 0, z, z + 1)])
    assert requests_of(actions) == [FindRoute(1, 3, fresh=True)]  # b failed over with a's output
    c = core.hops[2]
    assert c in core.rollback  # it answered from a push of b's: cut back by its next step
    actions = core.feed([RouteFound((hop(3, (1, 3)),))])
    [opening] = requests_of(actions)
    assert isinstance(opening, OpenSession)
    [replay] = requests_of(core.feed([SessionOpened()]))
    assert replay.requests == (HopStepRequest(0, (y,), (1,)),)
    [relay] = requests_of(core.feed([Answered((HopReply(z),), (z,))]))
    assert relay.session is c and relay.requests[0] == HopStepRequest(0, (z,), (1,), rollback=True)
    core.feed([reply(2, 0, z, z + 3, sent=True)])
    assert core.idle and torch.equal(core.output, z + 3) and core.failovers[0].peer_id == PEERS[1]


def test_steps_too_big_to_push_are_relayed():
    core = linked_core()
    actions = core.start_step(tensor([1.0] * 65), 65)
    actions = core.feed([Done(True)] * 3)
    [request] = requests_of(actions)
    assert request.session is core.hops[0] and not request.requests[0].from_upstream


def test_a_refused_link_keeps_the_chain_hop_by_hop():
    core = linked_core()
    actions = core.start_step(tensor([1.0]), 1)
    actions = core.feed([Done(True), Done(False), Done(True)])
    assert [r.session for r in requests_of(actions)] == [core.hops[0]]


def test_rewind_cuts_the_history_and_every_session_back():
    core = ChainCore(can_fail_over=True, push=False, clock=lambda: 1000.0)
    core.open([hop(0, (0, 4))])
    core.feed([SessionOpened()])
    steps = [tensor([1.0, 2.0, 3.0]), tensor([4.0]), tensor([5.0, 6.0, 7.0, 8.0])]
    for x in steps:
        core.start_step(x, x.shape[1])
        core.feed([Answered((HopReply(x),), (x,))])
    session = core.hops[0]
    core.verifiers[(0, 4)] = Verifier(session=type(session)(hop(1, (0, 4))), fed=3)
    actions = core.rewind(5)  # keeps 1 of the last step's 4 tokens
    assert [type(a) for a in actions] == [Close] and (0, 4) not in core.verifiers
    assert all(isinstance(a, EFFECTS) for a in actions)
    assert core.position == 5 and core.history.sizes == [3, 1, 1] and core.history.computed == [3, 1, 4]
    assert core.history.at(0)[2] is steps[2]  # kept as computed: a replay computes it the same way
    assert [t.tolist() for t in core.history.kept(0)] == [steps[0].tolist(), steps[1].tolist(),
                                                          tensor([5.0]).tolist()]
    assert session in core.rollback
    actions = core.rewind(3)  # whole steps dropped
    assert core.history.sizes == core.history.computed == [3] and len(core.history.at(0)) == 1
    [request] = requests_of(core.start_step(tensor([9.0]), 1))
    assert request.requests[0] == HopStepRequest(3, (tensor([9.0]),), (1,), rollback=True)
    core.feed([Answered((HopReply(tensor([9.0])),), (tensor([9.0]),))])
    assert not core.rollback and core.position == 4
    np.testing.assert_array_equal(core.output.numpy(), tensor([9.0]).numpy())


def test_a_replay_computes_cut_steps_as_they_were_then_rolls_back():
    """Steps of 3, 4 (2 kept: drafts rejected) and 1 tokens: the replay sends the
    4-token step whole, ends the request there, and the next one rolls back to the
    kept position first; the same for a standby's feed from a later step."""
    a, b, c = tensor([1.0] * 3), tensor([2.0] * 4), tensor([3.0])
    plan = replay_plan([a, b, c], [3, 2, 1], computed=[3, 4, 1])
    assert plan == (HopStepRequest(0, (a, b), (3, 4)), HopStepRequest(5, (c,), (1,), rollback=True))
    assert replay_plan([b, c], [2, 1], computed=[4, 1], position=3, rollback=True, last_only=True) == (
        HopStepRequest(3, (b,), (4,), last_only=True, rollback=True),
        HopStepRequest(5, (c,), (1,), last_only=True, rollback=True))


def test_a_standby_is_fed_each_step_beside_the_hop_and_dropped_when_it_fails():
    """A standby for the one span is opened before the first step and fed each step
    as computed, beside the hop's request (last rows only); a standby whose feed
    fails is dropped, and the failover replays on a replacement."""
    core = ChainCore(can_fail_over=True, push=False, standby=True, clock=lambda: 1000.0)
    core.open([hop(0, (0, 4))])
    core.feed([SessionOpened()])
    x1, x2, x3 = tensor([1.0, 2.0]), tensor([3.0]), tensor([4.0])
    actions = core.start_step(x1, 2)
    [find] = requests_of(actions)
    assert isinstance(find, FindVerifier) and find.exclude == frozenset({PEERS[0]})
    [opening] = requests_of(core.feed([VerifierFound(hop(1, (0, 4)))]))
    standby = opening.session
    step, feed = requests_of(core.feed([SessionOpened()]))
    assert step.session is core.hops[0] and feed.session is standby
    assert feed.requests == (HopStepRequest(0, (x1,), (2,), last_only=True, rollback=True),)
    core.feed([Answered((HopReply(x1 + 1),), (x1 + 1,)), Answered((HopReply(x1[:, -1:]),), ())])
    assert core.standbys[(0, 4)].fed == 1
    step, feed = requests_of(core.start_step(x2, 1))
    assert feed.requests == (HopStepRequest(2, (x2,), (1,), last_only=True, rollback=True),)
    core.feed([Answered((HopReply(x2 + 1),), (x2 + 1,)), Answered((HopReply(x2 + 1),), ())])
    core.start_step(x3, 1)  # the hop dies, and the standby's feed fails too
    actions = core.feed([Failed(HopFailed(PEERS[0], "connection_lost", "gone")),
                         Failed(HopFailed(PEERS[1], "timeout", "slow"))])
    assert FindRoute(0, 4, fresh=True) in requests_of(actions)
    assert core.standbys == {}


def test_a_standby_that_kept_up_takes_over():
    """The standby computed this very step beside the hop that failed: it is rolled
    back to the step's position and computes it again, the only request."""
    core = ChainCore(can_fail_over=True, push=False, standby=True, clock=lambda: 1000.0)
    core.open([hop(0, (0, 4))])
    core.feed([SessionOpened()])
    x1, x2, x3 = tensor([1.0, 2.0]), tensor([3.0]), tensor([4.0])
    core.start_step(x1, 2)
    core.feed([VerifierFound(hop(1, (0, 4)))])
    core.feed([SessionOpened()])
    core.feed([Answered((HopReply(x1 + 1),), (x1 + 1,)), Answered((HopReply(x1[:, -1:]),), ())])
    core.start_step(x2, 1)
    core.feed([Answered((HopReply(x2 + 1),), (x2 + 1,)), Answered((HopReply(x2 + 1),), ())])
    standby = core.standbys[(0, 4)].session
    core.start_step(x3, 1)
    actions = core.feed([Failed(HopFailed(PEERS[0], "connection_lost", "gone")), Answered((HopReply(x3 + 1),), ())])
    [takeover] = requests_of(actions)
    assert takeover.session is standby
    assert takeover.requests == (HopStepRequest(3, (x3,), (1,), rollback=True),)
    core.feed([Answered((HopReply(x3 + 1),), (x3 + 1,))])
    assert core.idle and core.hops == [standby] and core.standby_takeovers == 1
    assert torch.equal(core.output, x3 + 1) and core.failovers[0].replacements == (PEERS[1],)
    assert core.history.sizes == [2, 1, 1]


def test_a_proof_in_another_compute_mode_does_not_link():
    """Step proofs must sign the model's weight format: a server signing a laxer mode
    (here int8's tolerance on an fp32 model) could never be reported against an honest
    witness's fp32 proof, so its answer does not link and the step is relayed."""
    from compushare.pipeline.client.chain_plan import proof_links

    x, out = tensor([1.0]), tensor([2.0])
    (honest,) = reply(0, 0, x, out).replies
    assert proof_links(honest, digest(x), MODEL, hop(0), 0, 1, DEFAULT_MODE) is None
    assert "compute mode 'fp32', not the model's 'int8'" in proof_links(honest, digest(x), MODEL, hop(0), 0, 1, "int8")
    statement = Statement("int8", MODEL, 0, 1, 0, 1, GENESIS, digest(x), digest(out))
    lax = HopReply(out, data(out), "float32", Proof(0, 1, "int8", GENESIS, digest(x), digest(out),
                                                 statement.sign(KEYS[0])), b"")
    assert "not the model's 'fp32'" in proof_links(lax, digest(x), MODEL, hop(0), 0, 1, DEFAULT_MODE)


def test_a_standby_is_looked_for_again_at_once_after_a_takeover_and_then_every_few_steps():
    """After a takeover the span has no standby: the next step looks for one (the
    failed server and the new primary excluded); while none is found it looks again
    every STANDBY_RETRY_STEPS steps, and the one found is fed the whole history, as
    computed, beside the step."""
    from compushare.pipeline.client.chain_standby import STANDBY_RETRY_STEPS

    core = ChainCore(can_fail_over=True, push=False, standby=True, clock=lambda: 1000.0)
    core.open([hop(0, (0, 4))])
    core.feed([SessionOpened()])
    x = [tensor([float(i)]) for i in range(12)]
    core.start_step(x[0], 1)
    core.feed([VerifierFound(hop(1, (0, 4)))])
    core.feed([SessionOpened()])
    core.feed([Answered((HopReply(x[0] + 1),), (x[0] + 1,)), Answered((HopReply(x[0] + 1),), ())])
    core.start_step(x[1], 1)
    core.feed([Failed(HopFailed(PEERS[0], "connection_lost", "gone")), Answered((HopReply(x[1] + 1),), ())])
    core.feed([Answered((HopReply(x[1] + 1),), (x[1] + 1,))])
    assert core.hops[0].peer_id == PEERS[1] and core.standbys == {}
    looked = []
    for i in range(2, 2 + 2 * STANDBY_RETRY_STEPS):
        actions = core.start_step(x[i], 1)
        requests = requests_of(actions)
        if isinstance(requests[0], FindVerifier):  # nobody yet (the failed server is penalised)
            assert requests[0].exclude == frozenset({PEERS[1]})
            looked.append(i)
            requests = requests_of(core.feed([VerifierFound(None)]))
        [step] = requests
        core.feed([Answered((HopReply(x[i] + 1),), (x[i] + 1,))])
    assert looked == [2, 2 + STANDBY_RETRY_STEPS]
    # a third server serves the span again: found at the next look, fed everything
    i = 2 + 2 * STANDBY_RETRY_STEPS
    [find] = requests_of(core.start_step(x[i], 1))
    [opening] = requests_of(core.feed([VerifierFound(hop(2, (0, 4)))]))
    step, feed = requests_of(core.feed([SessionOpened()]))
    assert feed.session is opening.session and feed.requests == replay_plan(
        core.history.at(0), core.history.sizes, last_only=True, rollback=True)
    core.feed([Answered((HopReply(x[i] + 1),), (x[i] + 1,)), Answered((HopReply(x[i - 1] + 1),), ())])
    assert core.standbys[(0, 4)].fed == i and core.standbys[(0, 4)].session is opening.session
