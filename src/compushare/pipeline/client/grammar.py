"""Constrained decoding: a grammar's mask over the vocabulary, applied to the logits
before sampling, so that only tokens keeping the output valid can be chosen.

The consumer holds the LM head and samples, so the mask is the consumer's alone: no
provider knows a grammar is in use. The grammar engine is llguidance (docs/api.md,
"Structured outputs", says why): a JSON schema or a Lark grammar (special tokens such
as <tool_call> by name) compiles lazily, in milliseconds; each mask costs about a
tenth of a millisecond at a 49k vocabulary (docs/performance.md); and its matcher
rolls back, which a speculative verify pass needs (generate.py).
"""

from __future__ import annotations

import numpy as np
import torch

from ...errors import UsageError

# Whitespace inside generated JSON: none but the one space after ":" and "," (as
# Python's json.dumps writes it). A grammar that allowed any whitespace would let a
# small model fill its token budget with newlines; a schema's "x-guidance" may differ.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_tokenizer(tokenizer, vocab_size: int, eos_ids: frozenset[int]):
    """llguidance's view of a Hugging Face fast tokenizer, `vocab_size` the LM head's
    rows (a model's vocabulary may be padded beyond its tokenizer's). About a second
    for a large vocabulary: a consumer builds it once."""
    import llguidance.hf  # noqa: PLC0415  (a consumer without grammars never loads it)

    eos = sorted(eos_ids) or None
    try:
        return llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
    except ValueError as exc:  # a slow tokenizer, or one larger than the head
        raise UsageError(f"this model's tokenizer cannot be used for structured output: {exc}") from None


def json_schema_grammar(schema: dict) -> str:
    """The grammar of the JSON documents `schema` describes."""
    from llguidance import LLMatcher  # noqa: PLC0415

    return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_STYLE)


def lark_grammar(lark: str) -> str:
    from llguidance import LLMatcher  # noqa: PLC0415

    return LLMatcher.grammar_from_lark(lark)


def check_grammar(grammar: str, tokenizer) -> None:
    """Raise UsageError with llguidance's message when `grammar` cannot be compiled."""
    from llguidance import LLMatcher  # noqa: PLC0415

    failed, messages = LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
    if failed:
        raise UsageError(f"the schema or grammar cannot be enforced: {messages[0]}")


class Constraint:
    """One generation's grammar state: the mask of what may come next, the tokens
    taken so far (a verify pass tries drafts and takes them back)."""

    def __init__(self, tokenizer, grammar: str) -> None:
        from llguidance import LLMatcher  # noqa: PLC0415

        self.vocab_size = tokenizer.vocab_size
        self.matcher = LLMatcher(tokenizer, grammar, log_level=0)
        self._fail_if_broken()

    def mask_(self, logits: torch.Tensor) -> torch.Tensor:
        """Set the logits of every token the grammar forbids next to -inf, in place
        (`logits` one row; columns past the grammar's vocabulary are forbidden too)."""
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(bits, bitorder="little")[:logits.shape[-1]].astype(bool)
        self._fail_if_broken()
        forbidden = torch.from_numpy(~allowed)
        if forbidden.shape[-1] < logits.shape[-1]:
            forbidden = torch.nn.functional.pad(forbidden, (0, logits.shape[-1] - forbidden.shape[-1]), value=True)
        with torch.inference_mode():  # the head's logits are inference tensors
            return logits.masked_fill_(forbidden, float("-inf"))

    def take(self, token: int) -> None:
        """Advance past a token the mask allowed."""
        if not self.matcher.consume_token(token):
            self._fail_if_broken()
            raise AssertionError(f"token {token} was not allowed by the grammar")

    def try_take(self, token: int) -> bool:
        """Advance past `token` if the grammar allows it (a draft); whether it did."""
        return self.matcher.try_consume_tokens([token]) == 1

    def take_back(self, count: int) -> None:
        if count and not self.matcher.rollback(count):
            self._fail_if_broken()

    @property
    def finished(self) -> bool:
        """Nothing more can be generated (the end-of-sequence token was taken, or the
        grammar allows nothing after what came)."""
        return self.matcher.is_stopped()

    @property
    def complete(self) -> bool:
        """What came so far is a whole sentence of the grammar (the output is valid)."""
        return self.matcher.is_accepting() or self.matcher.is_stopped()

    def _fail_if_broken(self) -> None:
        if self.matcher.is_error():
            raise UsageError(f"the grammar failed: {self.matcher.get_error()}")


def drafts_allowed(rows: torch.Tensor, drafts: list[int], constraint: Constraint) -> list[int]:
    """Mask a verify pass's rows [k+1, vocab] in place, row i with the grammar's state
    after drafts[:i]; the drafts up to the first one the grammar forbids (the rows past
    it are not looked at: that draft is rejected whatever the model says). The
    constraint's state is left where it was."""
    kept = 0
    for index in range(len(drafts) + 1):
        if constraint.finished:  # an end-of-sequence draft was taken: nothing after it is emitted
            break
        constraint.mask_(rows[index])
        if index == len(drafts) or not constraint.try_take(drafts[index]):
            break
        kept += 1
    constraint.take_back(kept)
    return drafts[:kept]
