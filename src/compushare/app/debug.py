"""Fault injection, for the tests that need a misbehaving node: one that computes
slowly (every step, or some steps that then answer late while the node stays
responsive), lies, forges its pushes or names another weight format. Production config
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
    # "FIRST:COUNT:SECONDS": the server's steps FIRST..FIRST+COUNT-1 (counted from 0 over
    # all its sessions, prefills included) each wait SECONDS before computing; so do its
    # private `project` requests FIRST..FIRST+COUNT-1 (counted apart, the same way).
    slow_steps: str = ""

    def __post_init__(self) -> None:
        if not (1.0 <= self.slowdown <= 10_000):
            raise UsageError("--debug-slowdown must be within 1..10000")
        if not (0.0 <= self.noise <= 10.0):
            raise UsageError("--debug-noise must be within 0..10")
        if self.slow_steps:
            self.slow_steps_plan()

    def slow_steps_plan(self) -> tuple[int, int, float] | None:
        """--debug-slow-steps as (first, count, seconds); None without it."""
        if not self.slow_steps:
            return None
        try:
            first, count, seconds = self.slow_steps.split(":")
            plan = int(first), int(count), float(seconds)
        except ValueError:
            raise UsageError("--debug-slow-steps is FIRST:COUNT:SECONDS, e.g. 10:2:3.5") from None
        if plan[0] < 0 or plan[1] < 0 or not 0 <= plan[2] <= 600:
            raise UsageError("--debug-slow-steps: FIRST and COUNT at least 0, SECONDS within 0..600")
        return plan

    @classmethod
    def from_flags(cls, **flags) -> FaultInjection:
        """From the --debug-* flags given (None: not given, the default)."""
        return cls(**{name: value for name, value in flags.items() if value is not None})
