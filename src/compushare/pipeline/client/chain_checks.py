"""Spot checks, sans I/O: which steps a second server of the same blocks recomputes,
how that verifier is found and kept up to date, and, when the two disagree, the
third opinion, the verdict (chain_plan.judge), the report and who is penalised.
Functions of the chain core (chain_core.py)."""

from __future__ import annotations

import dataclasses
import logging

from ...errors import MISMATCH, HopFailed
from ...proofs.inference import relative_error
from . import chain_rebuild
from .chain_events import (
    Answered, Close, Failed, FileReport, FindVerifier, HopReply, HopSession, OpenSession, Phase, SendSteps, Span,
    count_answered,
)
from .chain_plan import Verifier, catch_up_plan, judge
from .chain_state import ChainState
from .spotcheck import SpotCheckSchedule

log = logging.getLogger(__name__)


@dataclasses.dataclass
class VerifierSearch:
    """A verifier being found for `hop`'s step."""

    hop: HopSession


@dataclasses.dataclass
class VerifierOpening:
    """`session` being opened to verify `hop`'s step."""

    hop: HopSession
    session: HopSession


@dataclasses.dataclass
class CheckedStep:
    """The step sent to `hop` and to its verifier: both answers awaited."""

    hop: HopSession
    verifier: Verifier


@dataclasses.dataclass
class Dispute:
    """A spot check that disagreed, awaiting a third opinion."""

    span: Span
    hop: HopSession
    verifier: Verifier
    primary: HopReply
    check: HopReply
    error: float
    tolerance: float  # what the two were held to (none for one exact build and forwards)


@dataclasses.dataclass
class Arbitration:
    """`session` being opened for a third opinion on the dispute, then asked for it."""

    dispute: Dispute
    session: HopSession


def check_due(core: ChainState, session: HopSession) -> bool:
    """Whether this step of `session` is to be checked (draws from its span's
    schedule: once per step and hop)."""
    if not (core.can_fail_over and core.spot_check_rate > 0):
        return False
    span = session.span
    schedule = core.schedules.get(span)
    if schedule is None:
        schedule = core.schedules[span] = SpotCheckSchedule(core.spot_check_rate, core.rng)
    return schedule.should_check()


def start_check(core: ChainState, session: HopSession) -> None:
    """Begin checking this step of `session`: a verifier is being found, or the
    step is sent to both."""
    span = session.span
    verifier = core.verifiers.get(span)
    if verifier is not None and verifier.session.peer_id != session.peer_id:
        return core.send_hop(verifier)
    exclude = frozenset({session.peer_id} | {h.peer_id for h in core.hops})
    core.request([FindVerifier(*span, exclude)], Phase.FINDING_VERIFIER, VerifierSearch(session))


def verifier_found(core: ChainState, search: VerifierSearch, events: list) -> None:
    [event] = events
    if event.hop is None:
        return core.send_hop(None)
    session = HopSession(event.hop)
    core.request([OpenSession(session)], Phase.OPENING_VERIFIER, VerifierOpening(search.hop, session))


def verifier_opened(core: ChainState, opening: VerifierOpening, events: list) -> None:
    [event] = events
    span, session = opening.hop.span, opening.session
    if isinstance(event, Failed):
        log.info("no spot check for blocks %d:%d now: %s", *span, event.error)
        core.penalise(event.error)
        return core.send_hop(None)
    core.forgive(session)
    old = core.verifiers.get(span)
    if old is not None:
        core.effect(Close(old.session))
    verifier = core.verifiers[span] = Verifier(session)
    core.send_hop(verifier)


def catch_up(core: ChainState, span: Span, fed: int):
    """The requests bringing a verifier that has seen `fed` steps up to this step,
    then computing it."""
    step = core.step
    return catch_up_plan(core.history.kept(span[0]), core.history.sizes, fed, step.hidden, step.tokens,
                         core.replay_max_tokens)


def checked(core: ChainState, checked: CheckedStep, events: list) -> None:
    session, verifier = checked.hop, checked.verifier
    primary, check = events
    span = session.span
    count_answered(session, primary)
    count_answered(verifier.session, check)
    if isinstance(check, Answered):
        verifier.fed = len(core.history.sizes) + 1
    if isinstance(primary, Failed):
        return chain_rebuild.fail_over(core, primary.error)
    if isinstance(check, Failed):
        log.info("spot check of blocks %d:%d skipped: %s", *span, check.error)
        drop_verifier(core, span, check.error)
        return core.hop_done(primary.replies[0].output)
    mine, theirs = primary.replies[0], check.replies[-1]
    error = relative_error(mine.output.numpy(), theirs.output.numpy())
    tolerance = core.tolerance_for(span, (mine.proof, theirs.proof))
    if error <= tolerance:
        core.exact_checks += tolerance == 0.0
        return core.hop_done(mine.output)
    # Two servers disagree. A third one, if there is one, says which is wrong: a
    # lying verifier must not get an honest server excluded.
    dispute = Dispute(span, session, verifier, mine, theirs, error, tolerance)
    exclude = frozenset({session.peer_id, verifier.session.peer_id} | {h.peer_id for h in core.hops})
    core.request([FindVerifier(*span, exclude)], Phase.FINDING_ARBITER, dispute)


def arbiter_found(core: ChainState, dispute: Dispute, events: list) -> None:
    [event] = events
    if event.hop is None:
        return verdict(core, dispute, None)
    session = HopSession(event.hop)
    core.request([OpenSession(session)], Phase.OPENING_ARBITER, Arbitration(dispute, session))


def arbiter_opened(core: ChainState, arbitration: Arbitration, events: list) -> None:
    [event] = events
    dispute, session = arbitration.dispute, arbitration.session
    if isinstance(event, Failed):
        log.info("no third opinion on blocks %d:%d: %s", *dispute.span, event.error)
        return verdict(core, dispute, None)
    core.forgive(session)
    core.request([SendSteps(session, catch_up(core, dispute.span, 0))], Phase.ARBITRATING, arbitration)


def arbitrated(core: ChainState, arbitration: Arbitration, events: list) -> None:
    [event] = events
    dispute = arbitration.dispute
    core.effect(Close(arbitration.session))
    if isinstance(event, Failed):
        log.info("no third opinion on blocks %d:%d: %s", *dispute.span, event.error)
        return verdict(core, dispute, None)
    verdict(core, dispute, event.replies[-1])


def verdict(core: ChainState, dispute: Dispute, arbiter: HopReply | None) -> None:
    """Judge the dispute (with the third opinion `arbiter`, if any): report and
    penalise the blamed, then the hop is done or failed over."""
    span, hop, verifier = dispute.span, dispute.hop, dispute.verifier
    # The third opinion was caught up in a batch: the format's tolerance (its runtime's
    # against each of theirs).
    third = None if arbiter is None else arbiter.proof
    blamed = judge(dispute.primary.output, dispute.check.output, None if arbiter is None else arbiter.output,
                   core.tolerance_for(span, (dispute.primary.proof, third)),
                   core.tolerance_for(span, (dispute.check.proof, third)))
    if blamed == "neither":
        # Both within the tolerance of the third opinion: their own difference, beyond
        # what they were held to, says only that one of them is off.
        log.warning("blocks %d:%d: %s and %s differ by %.2g (tolerance %g), both near a third server: "
                    "nobody blamed", *span, hop.peer_id, verifier.session.peer_id, dispute.error, dispute.tolerance)
        return core.hop_done(dispute.primary.output)
    tokens = core.step.tokens
    outvoted = HopFailed(verifier.session.peer_id, MISMATCH, "outvoted")
    if blamed == "verifier":
        core.effect(FileReport(verifier.session, hop, core.position, tokens, dispute.check, dispute.primary))
        drop_verifier(core, span, outvoted)
        log.warning("the spot check of blocks %d:%d by %s was wrong (a third server agrees with %s)",
                    *span, verifier.session.peer_id, hop.peer_id)
        return core.hop_done(dispute.primary.output)
    core.effect(FileReport(hop, verifier.session, core.position, tokens, dispute.primary, dispute.check))
    if blamed == "both":
        drop_verifier(core, span, outvoted)
    chain_rebuild.fail_over(core, HopFailed(
        hop.peer_id, MISMATCH,
        f"{hop.peer_id} (blocks {span[0]}:{span[1]}) answered step {core.position} {dispute.error:.2g} away "
        f"from {verifier.session.peer_id}'s answer (tolerance {dispute.tolerance:g}"
        f"{'' if arbiter is None else ', a third server agreeing'})"))


def drop_verifier(core: ChainState, span: Span, error: HopFailed) -> None:
    verifier = core.verifiers.pop(span, None)
    if verifier is not None:
        core.retired.append(verifier.session)
    core.penalise(error)
