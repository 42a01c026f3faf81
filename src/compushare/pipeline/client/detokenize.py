"""Streaming detokenization: text for each new token as soon as it is printable."""

from __future__ import annotations


class IncrementalDetokenizer:
    """Decodes only the current line, so the cost per token is O(line), not O(answer);
    holds back output while a multi-byte character is incomplete."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self._line_start = 0
        self._shown = ""

    def push(self, token: int) -> str:
        self.tokens.append(token)
        text = self.tokenizer.decode(self.tokens[self._line_start:], skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return ""
        new = text[len(self._shown):] if len(text) > len(self._shown) else ""
        self._shown = text
        if text.endswith("\n"):
            self._line_start, self._shown = len(self.tokens), ""
        return new
