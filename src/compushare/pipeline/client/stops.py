"""Stop sequences over streamed text, sans I/O: text is released as it comes, except
a tail that could still begin a stop sequence, and the stream ends at the first stop
found, whichever token boundaries it spans ("\\n\\nUser:" may arrive as three tokens,
or inside one with text after it).

A released piece never contains a stop, and nothing after the first stop is ever
released: what a client sees is exactly the text up to (not including) the stop.
The generation ends with the first piece after which some stop is complete, cut at
the earliest stop in the text so far; a longer stop that would have completed later
never does (nothing later is generated).
"""

from __future__ import annotations

MAX_STOPS = 4  # OpenAI's limit; Ollama's clients send a handful too
MAX_STOP_CHARS = 256


class StopText:
    def __init__(self, stops: tuple[str, ...] = ()) -> None:
        self.stops = tuple(s for s in stops if s)
        self.stopped = False
        self.released = ""  # all text handed out so far
        self._held = ""  # a tail that may begin a stop

    def feed(self, text: str) -> str:
        """Take new text; the part that can be handed out now ("" once stopped)."""
        if self.stopped:
            return ""
        pending = self._held + text
        cut = min((i for i in (pending.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped, self._held = True, ""
            return self._release(pending[:cut])
        hold = self._longest_start(pending)
        self._held = pending[len(pending) - hold:] if hold else ""
        return self._release(pending[:len(pending) - hold])

    def flush(self) -> str:
        """The held tail, at the end of a generation that did not stop on a sequence."""
        held, self._held = self._held, ""
        return "" if self.stopped else self._release(held)

    def _longest_start(self, text: str) -> int:
        """The length of the longest suffix of `text` that is a proper prefix of a stop."""
        best = 0
        for stop in self.stops:
            for length in range(min(len(stop) - 1, len(text)), best, -1):
                if stop.startswith(text[len(text) - length:]):
                    best = length
                    break
        return best

    def _release(self, text: str) -> str:
        self.released += text
        return text
