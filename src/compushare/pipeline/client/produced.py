"""What a generation hands out as it goes: tokens with their times, their text as
soon as it is printable and cannot begin a stop sequence, their log-probabilities
when asked, and why it ended."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from .detokenize import IncrementalDetokenizer
from .sampling import TokenLogprob
from .stops import StopText


@dataclasses.dataclass(frozen=True)
class Piece:
    """One produced token, the text it released (often "", or text held back by an
    earlier token), and its log-probability when asked for. The last piece of a
    generation may have no token: text held back for a stop sequence that never came."""

    token: int | None
    text: str
    logprob: TokenLogprob | None = None


class Produced:
    def __init__(self, tokenizer, on_token: Callable[[int], None], on_text: Callable[[str], None], *,
                 stops: tuple[str, ...] = (), on_piece: Callable[[Piece], None] = lambda _p: None) -> None:
        self.tokens: list[int] = []
        self.times: list[float] = []
        self.logprobs: list[TokenLogprob] = []
        self.on_token, self.on_text, self.on_piece = on_token, on_text, on_piece
        self.detokenizer = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None
        self.tokenizer = tokenizer
        self.stop = StopText(stops)
        self._scored: list[TokenLogprob] = []  # scored, not yet handed out (a verify pass scores ahead)

    def score(self, scored: list[TokenLogprob]) -> None:
        self._scored.extend(scored)

    def add(self, token: int) -> None:
        self.times.append(time.perf_counter())
        self.tokens.append(token)
        logprob = self._scored.pop(0) if self._scored else None
        if logprob is not None:
            self.logprobs.append(logprob)
        self.on_token(token)
        text = self.stop.feed(self.detokenizer.push(token)) if self.detokenizer is not None else ""
        if text:
            self.on_text(text)
        self.on_piece(Piece(token, text, logprob))

    def stopped(self) -> bool:
        """Whether a stop sequence has been seen (the generation ends there)."""
        return self.stop.stopped

    def finish(self) -> str:
        """The text still held back by a possible stop that never came, handed out."""
        rest = self.stop.flush()
        if rest:
            self.on_text(rest)
            self.on_piece(Piece(None, rest))
        return rest

    def text(self) -> str:
        """The whole reply: up to the first stop sequence, if one came."""
        if self.tokenizer is None:
            return ""
        if self.stop.stops:
            return self.stop.released
        return self.tokenizer.decode(self.tokens, skip_special_tokens=True)

    def finish_reason(self, max_new_tokens: int) -> str:
        """OpenAI's: "length" when the limit cut the reply, else "stop" (EOS or a stop sequence)."""
        return "length" if len(self.tokens) >= max_new_tokens and not self.stop.stopped else "stop"
