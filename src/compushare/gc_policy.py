"""The cyclic garbage collector around start-up.

Start-up builds a heap of objects that live as long as the process: torch,
transformers and py-libp2p's modules, some 250,000 tracked objects. CPython's
collector walks every one of them in each full collection: about eight full
collections during start-up (a second of CPU on this project's 2-vCPU machines,
in front of a `run`'s first token) and 150-400 ms each later, pauses that land in
the middle of a decode step or a download. So a process collects nothing while it
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
