"""The inference protocol (wire.INFER; protocol.md describes it in full): its error codes and limits."""

# The protocol id and the error codes carried in {"type": "error", "code": ...} replies
# are wire names (compushare/wire.py), named here as the pipeline has always named them.
from ..wire import (  # noqa: F401
    BAD_RECEIPT, BAD_REQUEST, BAD_SPAN, BUSY, INTERNAL, NO_INPUT, OUT_OF_ORDER, RATE_LIMITED, SESSION_EXISTS,
    TOO_LONG, UNKNOWN_SESSION, WRONG_MODEL,
)
from ..wire import INFER as INFER_PROTOCOL  # noqa: F401

SESSION_ID_BYTES = 16

MAX_WAIT_MS = 10_000  # the longest a step from_upstream may wait for its push
PUSH_MAX_BYTES = 1 << 20  # bigger outputs (a long prefill) are not pushed: steps that big are relayed


def error(code: str, message: str, session: bytes | None = None) -> dict:
    reply = {"type": "error", "code": code, "message": message}
    if session is not None:
        reply["session"] = session
    return reply
