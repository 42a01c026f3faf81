"""The cyclic garbage collector around start-up.

Start-up builds a heap of objects that live as long as the process: torch,
transformers and py-libp2p's modules, hundreds of thousands of tracked objects.
CPython's collector walks every one of them in each full collection: several full
collections during start-up (CPU spent in front of a `run`'s first token) and
long pauses later that land in the middle of a decode step or a download
(docs/performance.md has the figures). So a process collects nothing while it
starts, then freezes what start-up built (gc.freeze: later collections skip it)
and collects as usual from there on. Call `startup_done` again after loading a
model: its modules and parameters live as long as the process too.
"""

from __future__ import annotations

import gc


def pause_during_startup() -> None:
    gc.disable()


def startup_done() -> None:
    gc.freeze()
    gc.enable()
