"""Fault injection, for the tests that need a misbehaving node: one that computes
slowly, lies, forges its pushes or names another weight format. Production config
(config.NodeConfig) carries none of it: `compushare node`'s hidden --debug-* flags
are read into one FaultInjection, which Node hands to the parts it affects."""

from __future__ import annotations

import dataclasses

from ..errors import UsageError


@dataclasses.dataclass(frozen=True)
class FaultInjection:
    slowdown: float = 1.0  # compute takes this many times as long
    noise: float = 0.0  # outputs get Gaussian noise of this relative scale (a lying server)
    forge_push: bool = False  # pushes carry other bytes than the signed output
    claim_format: str = ""  # name this weight format in records, ads and sessions, not the model's

    def __post_init__(self) -> None:
        if not (1.0 <= self.slowdown <= 10_000):
            raise UsageError("--debug-slowdown must be within 1..10000")
        if not (0.0 <= self.noise <= 10.0):
            raise UsageError("--debug-noise must be within 0..10")

    @classmethod
    def from_flags(cls, **flags) -> FaultInjection:
        """From the --debug-* flags given (None: not given, the default)."""
        return cls(**{name: value for name, value in flags.items() if value is not None})
