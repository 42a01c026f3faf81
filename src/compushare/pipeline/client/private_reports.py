"""Private mode's proofs on the consumer's side: every `projected` reply's signature
is checked as it comes (a reply without a valid one is a bad reply), and a private
spot check's mismatch becomes a PrivateFailureReport (proofs/private.py) against the
provider found wrong, witnessed by the other, as chain_plan.build_report does for a
plaintext check's verdict."""

from __future__ import annotations

import dataclasses
import logging

from ...errors import PeerMisbehaved
from ...proofs.private import PrivateClaim, PrivateFailureReport, PrivateStatement
from ..private_wire import PrivateProtocolError

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Signed:
    """A reply's statement and its provider's signed claim of it."""

    statement: PrivateStatement
    claim: PrivateClaim


def signed_reply(peer_id: str, session: tuple[str, str, str], layer: int, group: str, tokens: int,
                 cts: list[bytes], outs: list[list[bytes]], sig: object) -> Signed:
    """The claim of `peer_id`'s reply `outs` to the `tokens` tokens of `cts`, in a
    session opened with `session` (model id, parameter set, keys digest);
    PrivateProtocolError unless `sig` is its signature of that statement."""
    model_id, params, keys_digest = session
    statement = PrivateStatement.of(model_id, params, keys_digest, layer, group, tokens, cts, outs)
    try:
        return Signed(statement, statement.claim(peer_id, sig))
    except PeerMisbehaved as exc:
        raise PrivateProtocolError(str(exc)) from None


def mismatch_report(ours: Signed, theirs: Signed, *, ours_wrong: bool) -> list[PrivateFailureReport]:
    """The report of a mismatch between the route's provider (`ours`) and the
    verifier (`theirs`): against the route's when `ours_wrong`, else the verifier;
    none (logged) when the two claims do not make one."""
    accused, witness = (ours, theirs) if ours_wrong else (theirs, ours)
    common = dataclasses.replace(ours.statement, output_digest=b"")
    try:
        if common != dataclasses.replace(theirs.statement, output_digest=b""):
            raise PeerMisbehaved("the two answers are not of the same request")
        report = PrivateFailureReport.of(common, accused.claim, witness.claim)
        report.check()
    except PeerMisbehaved as exc:
        log.warning("private mismatch on layer %d without a checkable report: %s", common.layer, exc)
        return []
    log.warning("private failure report %s: %s disagrees with %s on layer %d %s", report.digest[:12],
                accused.claim.peer_id, witness.claim.peer_id, common.layer, common.group)
    return [report]
