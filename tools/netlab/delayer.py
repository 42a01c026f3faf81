"""Delay, jitter and loss in user space, for kernels without netem.

Run inside a host's namespace, whose INPUT chain sends packets to an NFQUEUE:

    python delayer.py DELAY_MS JITTER_MS LOSS_PCT QUEUE

Each packet is held until its release time and then accepted; jittered packets
leave in arrival order (a packet never overtakes the one before it), as netem does
with a rate. Prints "ready" once bound, so whoever starts it knows when the lab
delays. Stops on SIGTERM. Stdlib only, besides netfilterqueue (which compiles
against libnetfilter-queue).
"""

from __future__ import annotations

import heapq
import random
import select
import signal
import sys
import time
from collections.abc import Callable


class Schedule:
    """When each packet leaves: pure, so its ordering and loss are tested directly."""

    def __init__(self, delay_s: float, jitter_s: float = 0.0, loss: float = 0.0,
                 rng: random.Random | None = None) -> None:
        self.delay_s, self.jitter_s, self.loss = delay_s, jitter_s, loss
        self._rng = rng or random.Random()
        self._last = 0.0
        self._held: list[tuple[float, int, object]] = []
        self._count = 0

    def arrive(self, packet: object, now: float) -> bool:
        """Hold a packet; False if it is lost (the caller drops it)."""
        if self.loss and self._rng.random() < self.loss:
            return False
        wait = max(0.0, self._rng.gauss(self.delay_s, self.jitter_s)) if self.jitter_s else self.delay_s
        release = max(now + wait, self._last)  # in order: never before the previous packet
        self._last = release
        self._count += 1
        heapq.heappush(self._held, (release, self._count, packet))
        return True

    def due(self, now: float) -> list[object]:
        """The packets whose time has come, in order."""
        out = []
        while self._held and self._held[0][0] <= now:
            out.append(heapq.heappop(self._held)[2])
        return out

    def next_wait(self, now: float, idle: float = 1.0) -> float:
        return max(0.0, self._held[0][0] - now) if self._held else idle


def serve(schedule: Schedule, queue: int, clock: Callable[[], float] = time.monotonic) -> None:
    from netfilterqueue import NetfilterQueue

    nfq = NetfilterQueue()

    def on_packet(packet) -> None:
        if not schedule.arrive(packet, clock()):
            packet.drop()

    nfq.bind(queue, on_packet, max_len=20000)
    signal.signal(signal.SIGTERM, _exit)
    print("ready", flush=True)
    try:
        fd = nfq.get_fd()
        while True:
            for packet in schedule.due(clock()):
                packet.accept()
            readable, _, _ = select.select([fd], [], [], schedule.next_wait(clock()))
            if readable:
                nfq.run(block=False)
    finally:
        nfq.unbind()


def _exit(*_) -> None:
    raise SystemExit(0)  # out of select at once; held packets are dropped with the lab


def main(argv: list[str]) -> int:
    if len(argv) != 4:
        print(__doc__, file=sys.stderr)
        return 2
    delay_ms, jitter_ms, loss_pct, queue = float(argv[0]), float(argv[1]), float(argv[2]), int(argv[3])
    serve(Schedule(delay_ms / 1000, jitter_ms / 1000, loss_pct / 100), queue)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
