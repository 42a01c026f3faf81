"""Every kind of failure report, read from anyone: karma's ledger, rules and service
take them through parse_report alone. Pure, no I/O."""

from __future__ import annotations

import msgpack

from .diloco import DILOCO_REPORT_FORMAT, DilocoFailureReport
from .fields import MAX_REPORT_BYTES
from .inference import REPORT_FORMAT, FailureReport
from .private import PRIVATE_REPORT_FORMAT, PrivateFailureReport
from .training import TRAIN_REPORT_FORMAT, TrainFailureReport

# What karma's readers, stores and witnesses take.
Report = FailureReport | TrainFailureReport | PrivateFailureReport | DilocoFailureReport
KINDS: dict[str, type[Report]] = {REPORT_FORMAT: FailureReport, TRAIN_REPORT_FORMAT: TrainFailureReport,
                                  PRIVATE_REPORT_FORMAT: PrivateFailureReport, DILOCO_REPORT_FORMAT: DilocoFailureReport}


def parse_report(data: bytes) -> Report:
    """Any kind of failure report, parsed (not checked: call check()); by its "format",
    and as a step failure report when it names none we know."""
    kind: type[Report] = FailureReport
    if isinstance(data, bytes | bytearray) and len(data) <= MAX_REPORT_BYTES:
        try:
            body = msgpack.unpackb(data, raw=False, strict_map_key=True)
        except Exception:
            body = None
        if isinstance(body, dict) and isinstance(body.get("format"), str):
            kind = KINDS.get(body["format"], FailureReport)
    return kind.from_wire(data)
