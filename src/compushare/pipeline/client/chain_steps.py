"""A step through the consumer's chain hop by hop, sans I/O: the hops told their
neighbours (links), each hop sent the step (with a spot check when one is due, or
every hop at once when it goes direct), its answer taken, and the receipts due at
the end. Functions of the chain core (chain_core.py)."""

from __future__ import annotations

import dataclasses
from typing import Any

from . import chain_checks, chain_direct, chain_rebuild, chain_standby
from .chain_events import Failed, HopSession, HopStepRequest, Link, Phase, SendReceipt, SendSteps, count_answered
from .chain_plan import Verifier
from .chain_state import ChainState


@dataclasses.dataclass
class HopAsked:
    """The step sent to one hop (no check): its answer awaited."""

    hop: HopSession


@dataclasses.dataclass
class Linking:
    """Hops told their neighbours: whether each took its link awaited."""

    links: list[Link]


def link_then_step(core: ChainState) -> None:
    links = changed_links(core) if core.push else []
    if links:
        core.request(links, Phase.LINKING, Linking(links))
    else:
        enter_hop(core)


def changed_links(core: ChainState) -> list[Link]:
    """The hops whose neighbours changed since they were last told (opened, failed over)."""
    links = []
    for index, session in enumerate(core.hops):
        upstream = core.hops[index - 1].peer_id if index > 0 else None
        downstream = core.hops[index + 1] if index + 1 < len(core.hops) else None
        if session.linked != (upstream, downstream):
            session.linked = (upstream, downstream)  # also when refused: pushes only save time
            links.append(Link(session, upstream, downstream))
    return links


def linked(core: ChainState, linking: Linking, events: list) -> None:
    for link, event in zip(linking.links, events):
        link.session.link_ok = event.ok
    enter_hop(core)


def enter_hop(core: ChainState) -> None:
    """The step at its next hop: sent (checked, direct or not), failed over, or done."""
    step = core.step
    if step.index >= len(core.hops):
        return finish_step(core)
    session = core.hops[step.index]
    if session in step.failed:  # it failed in this step's direct attempt
        return chain_rebuild.fail_over(core, step.failed.pop(session))
    if step.index == 0 and chain_direct.direct_ok(core, step):
        return chain_direct.send_direct(core)
    due = step.due[step.index] if step.due is not None else chain_checks.check_due(core, session)
    if due:
        chain_checks.start_check(core, session)
    else:
        send_hop(core, None)


def send_hop(core: ChainState, verifier: Verifier | None) -> None:
    """Send the step to the current hop (and to `verifier`, a spot check)."""
    step = core.step
    session = core.hops[step.index]
    chain_standby.feed_current(core, session)
    primary = SendSteps(session, (HopStepRequest(core.position, (step.hidden,), (step.tokens,),
                                                 rollback=session in core.rollback),))
    if verifier is None:
        return core.request([primary], Phase.STEPPING, HopAsked(session), side=True)
    core.checks += 1
    check = SendSteps(verifier.session, chain_checks.catch_up(core, session.span, verifier.fed))
    core.request([primary, check], Phase.STEPPING_CHECKED, chain_checks.CheckedStep(session, verifier), side=True)


def hop_answered(core: ChainState, asked: HopAsked, events: list) -> None:
    [event] = events
    count_answered(asked.hop, event)
    if isinstance(event, Failed):
        return chain_rebuild.fail_over(core, event.error)
    hop_done(core, event.replies[0].output)


def hop_done(core: ChainState, output: Any) -> None:
    """The current hop's answer is taken: on to the next hop."""
    step = core.step
    session = core.hops[step.index]
    core.rollback.discard(session)
    core.history.at(session.hop.start).append(step.hidden)
    step.index += 1
    step.hidden = output
    enter_hop(core)


def finish_step(core: ChainState) -> None:
    step = core.step
    core.history.append(step.tokens)
    core.position += step.tokens
    core.output = step.hidden
    due = [session for session in core.live() if session.answered >= core.receipt_steps]
    if not due:
        return
    for session in due:
        session.answered = 0
    core.request([SendReceipt(session) for session in due], Phase.RECEIPTS)


def receipted(core: ChainState, operation: None, events: list) -> None:
    """The receipts are sent: the step is over."""
