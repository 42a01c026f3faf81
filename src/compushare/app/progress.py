"""Progress of long work (fetching, importing, converting, quantizing) on stderr: a
rich bar (bytes, rate, time left) on a terminal, plain lines otherwise (logs, pipes:
one line per tenth).

A `Progress` hands the code doing the work two callbacks, the model layer's and the
torrent's own: `stage(description)` names a step as it starts (a line of its own),
`update(done, total)` follows its bytes. A bar shows only while bytes move (from the
first update of a step to its last byte), so that nothing else on the terminal, a
streamed answer say, ever runs beside a live display. Both callbacks may be called
from worker threads."""

from __future__ import annotations

import threading
import time

from rich.console import Console
from rich.markup import escape

from .cli_common import err

PLAIN_STEPS = 10  # plain lines: one per tenth


def _size(count: float) -> str:
    if count < 1e6:
        return f"{count / 1e3:.1f} kB"
    return f"{count / 1e6:.1f} MB" if count < 1e9 else f"{count / 1e9:.2f} GB"


def plain_line(description: str, done: int, total: int, seconds: float) -> str:
    """"fetching x: 40% (12.0 of 30.0 MB, 4.0 MB/s, 5 s left)"."""
    rate = done / seconds if seconds > 0 else 0.0
    left = f", {(total - done) / rate:.0f} s left" if 0 < rate and done < total else ""
    speed = f", {_size(rate)}/s" if rate > 0 else ""
    return f"{description}: {100 * done // max(total, 1)}% ({_size(done)} of {_size(total)}{speed}{left})"


class Progress:
    """Progress bars or lines for one command; `enabled=False` (--json) shows nothing,
    its callbacks still safe to hand on. A context manager: leaving it ends any bar."""

    def __init__(self, description: str = "", *, console: Console | None = None, enabled: bool = True) -> None:
        self.console = console or err
        self.enabled = enabled
        self.description = description
        self._lock = threading.RLock()
        self._bar = None  # rich.progress.Progress while a step's bytes move, on a terminal
        self._task = None
        self._began = time.monotonic()
        self._shown = 0  # plain lines: the last tenth printed

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            if self._bar is not None:
                self._bar.stop()
                self._bar = self._task = None

    def stage(self, description: str) -> None:
        """A new step: a line saying so; what follows counts afresh."""
        with self._lock:
            self.close()
            self.description, self._began, self._shown = description, time.monotonic(), 0
            if self.enabled:
                self.console.print(f"{description} ...", highlight=False, markup=False)

    def update(self, done: int, total: int) -> None:
        """`done` of `total` bytes of the current step (a total of 0: nothing to do)."""
        if not self.enabled or total <= 0:
            return
        with self._lock:
            if self.console.is_terminal:
                self._bar_update(done, total)
                return
            tenth = PLAIN_STEPS * min(done, total) // total
            if tenth > self._shown:
                self._shown = tenth
                self.console.print(plain_line(self.description or "working", done, total,
                                              time.monotonic() - self._began), highlight=False, markup=False)

    def for_step(self, description: str):
        """update(), after naming a step by its first call: for work whose caller has no stage."""
        started = []

        def progress(done: int, total: int) -> None:
            if not started:
                started.append(True)
                self.stage(description)
            self.update(done, total)

        return progress

    def _bar_update(self, done: int, total: int) -> None:
        if self._bar is None:
            if done >= total:
                return
            from rich.progress import (BarColumn, DownloadColumn, Progress as Bar, TextColumn, TimeRemainingColumn,
                                       TransferSpeedColumn)

            self._bar = Bar(TextColumn("[bold]{task.description}"), BarColumn(), DownloadColumn(),
                            TransferSpeedColumn(), TimeRemainingColumn(), console=self.console)
            self._task = self._bar.add_task(escape(self.description or "working"), total=total)
            self._bar.start()
        self._bar.update(self._task, completed=done, total=total)
        if done >= total:
            self.close()
