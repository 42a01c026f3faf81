"""Direct return, sans I/O: a step sent to every hop at once, each server taking its
input from its upstream's push; the answers taken in chain order while their signed
proofs link up (chain_plan.proof_links), the rest of the step relayed hop by hop.
Functions of the chain core (chain_core.py)."""

from __future__ import annotations

import dataclasses
import logging

from .. import protocol
from . import chain_checks, chain_standby
from .chain_events import Answered, Failed, HopSession, HopStepRequest, Phase, SendSteps, count_answered
from .chain_plan import proof_links
from .chain_state import ChainState, ChainStep

log = logging.getLogger(__name__)


@dataclasses.dataclass
class DirectStep:
    """The step sent to every hop of the route at once: their answers awaited."""

    hops: list[HopSession]


def direct_ok(core: ChainState, step: ChainStep) -> bool:
    """Whether this step goes straight through the chain: every hop took its link,
    the step is small enough to push, and no hop is spot-checked this step (a
    checked step is relayed, its check beside it)."""
    if not (core.direct and len(core.hops) > 1 and step.tokens <= core.direct_max_tokens
            and all(session.link_ok for session in core.hops)):
        return False
    step.due = [chain_checks.check_due(core, session) for session in core.hops]
    if any(step.due):
        core.checked_relays += 1
        return False
    return True


def send_direct(core: ChainState) -> None:
    """Every hop's request at once: the first carries the input, the others take
    theirs from their upstream's push; each answers with its output and proof."""
    step = core.step
    core.direct_steps += 1
    chain_standby.feed_current(core, core.hops[0])
    first = HopStepRequest(core.position, (step.hidden,), (step.tokens,), rollback=core.hops[0] in core.rollback)
    requests = [SendSteps(core.hops[0], (first,))]
    requests += [SendSteps(session, (HopStepRequest(core.position, (), (step.tokens,),
                                                    rollback=session in core.rollback, from_upstream=True),))
                 for session in core.hops[1:]]
    core.request(requests, Phase.STEPPING_DIRECTLY, DirectStep(list(core.hops)), side=True)


def direct_answered(core: ChainState, direct: DirectStep, events: list) -> None:
    """Take the hops' answers in chain order while each one's proof links to the
    previous one's; from the first that failed, did not get its push or does not
    link, the step goes on hop by hop from the consumer's copy (a failed hop is
    failed over). Hops after that point that answered anyway computed from an input
    not taken: they are cut back."""
    hops, step = direct.hops, core.step
    for session, event in zip(hops, events):
        count_answered(session, event)
    stop = take_linked(core, hops, events)
    for session, event in zip(hops[stop:], events[stop:]):
        if isinstance(event, Answered):
            core.rollback.add(session)
        elif event.error.code != protocol.NO_INPUT:
            step.failed[session] = event.error  # fails over when the step reaches it
    step.due = None
    core.enter_hop()


def take_linked(core: ChainState, hops: list[HopSession], events: list) -> int:
    """Take the answers while they link up, as hops done; the index of the first
    hop not taken."""
    step = core.step
    for index, (session, event) in enumerate(zip(hops, events)):
        if isinstance(event, Failed):
            return index
        reply = event.replies[0]
        expected = reply.input_digest if index == 0 else step.last_reply.proof.output_digest
        problem = proof_links(reply, expected, core.proof_model(session.hop), session.hop, core.position, step.tokens,
                              core.mode)
        if problem is not None:
            core.chain_breaks += 1
            log.warning("direct step %d: %s; relaying it from the previous server's signed output, and "
                        "this chain's steps from now on", core.position, problem)
            core.rollback.add(session)
            session.link_ok = False  # who of the two lied is not known: neither link is trusted again
            return index
        step.last_reply = reply
        core.rollback.discard(session)
        core.history.at(session.hop.start).append(step.hidden)
        step.index += 1
        step.hidden = reply.output
    return len(hops)
