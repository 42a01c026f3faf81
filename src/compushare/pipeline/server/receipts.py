"""The receipt audit: a server countersigns a consumer's receipt for a session only
if it tells the truth about it. Pure (signature checks, no I/O)."""

from __future__ import annotations

from ...errors import PeerMisbehaved
from ...karma.receipts import Receipt, parse_receipt
from ...karma.rules import CLOCK_SKEW_S
from .. import protocol
from .session import Rejected, Session


def check_receipt(wire: bytes, session: Session, *, peer: str, server: str, model_id: str, now: float) -> Receipt:
    """The receipt `peer` sent for `session`, if this server (`server`, serving
    `model_id`) may countersign it at unix time `now`: sent by the consumer that opened
    the session and signed by it, naming this server, that consumer, the model, the
    session's span, id and next seq; never more tokens or compute than this server ran
    since the last receipt, never more compute than the consumer's wall time.
    Otherwise Rejected("bad_receipt")."""
    if peer != session.owner:
        raise Rejected(protocol.BAD_RECEIPT, "only the consumer that opened a session may receipt it")
    try:
        receipt = parse_receipt(wire, countersigned=False)
    except PeerMisbehaved as exc:
        raise Rejected(protocol.BAD_RECEIPT, str(exc)) from None
    expected = {"server": server, "consumer": peer, "model_id": model_id, "start": session.start,
                "end": session.end, "session": session.session_id, "seq": session.receipt_seq}
    for name, value in expected.items():
        if getattr(receipt, name) != value:
            raise Rejected(protocol.BAD_RECEIPT, f"receipt {name} is {getattr(receipt, name)!r}, expected {value!r}")
    if receipt.tokens > session.unreceipted_tokens:
        raise Rejected(protocol.BAD_RECEIPT, f"receipt claims {receipt.tokens} tokens; "
                                             f"{session.unreceipted_tokens} ran since the last one")
    if receipt.compute_ms > session.unreceipted_ms * (1 + 1e-9) + 1e-6:
        raise Rejected(protocol.BAD_RECEIPT, f"receipt claims {receipt.compute_ms:.1f} ms of compute; "
                                             f"{session.unreceipted_ms:.1f} ms ran since the last one")
    if receipt.compute_ms > receipt.wall_ms:
        raise Rejected(protocol.BAD_RECEIPT, "receipt compute time exceeds the consumer's wall time")
    if abs(receipt.time - now) > CLOCK_SKEW_S:
        raise Rejected(protocol.BAD_RECEIPT, "receipt time is too far from this server's clock")
    return receipt
