"""/compushare/infer/1.5.0 — see protocol.md for the full description."""

INFER_PROTOCOL = "/compushare/infer/1.5.0"
SESSION_ID_BYTES = 16

# Error codes carried in {"type": "error", "code": ...} replies.
BUSY = "busy"
UNKNOWN_SESSION = "unknown_session"
OUT_OF_ORDER = "out_of_order"
SESSION_EXISTS = "session_exists"
BAD_REQUEST = "bad_request"
WRONG_MODEL = "wrong_model"
BAD_SPAN = "bad_span"
TOO_LONG = "too_long"
INTERNAL = "internal"
RATE_LIMITED = "rate_limited"
BAD_RECEIPT = "bad_receipt"
NO_INPUT = "no_input"  # a step from_upstream whose push did not come within its wait

MAX_WAIT_MS = 10_000  # the longest a step from_upstream may wait for its push
PUSH_MAX_BYTES = 1 << 20  # bigger outputs (a long prefill) are not pushed: steps that big are relayed


def error(code: str, message: str, session: bytes | None = None) -> dict:
    reply = {"type": "error", "code": code, "message": message}
    if session is not None:
        reply["session"] = session
    return reply
