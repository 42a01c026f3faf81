"""Lossless speculative decoding, sans I/O: drafts, their verification, and how many
to draft. Pure (torch tensors in, token ids out); generate.py runs the passes.

A pass sends the last token and k drafted tokens through the chain as one step;
the LM head gives the model's distribution after each of them. `accept` keeps the
drafts the model agrees with and adds one token of its own, so every pass yields
between 1 and k+1 tokens, and the servers' KV caches are then cut back to what was
kept (InferenceChain.rewind).

- Greedy: a draft is kept while it is the model's argmax: the output is the one
  greedy decoding gives (up to the verify pass's k+1-token forward rounding
  differently from k+1 one-token forwards: docs/performance.md says how often).
- Sampling: standard speculative sampling (Leviathan et al. 2023; Chen et al.
  2023). Draft d, drawn from q, is kept with probability min(1, p(d)/q(d)); the
  first one rejected is replaced by a token drawn from norm(max(0, p - q)); if all
  are kept, one more is drawn from p. Every emitted token is then distributed
  exactly as the model's p (temperature and top-p applied), whatever q is. The
  n-gram drafter proposes one token with certainty (q is a point mass).
"""

from __future__ import annotations

import dataclasses

import torch

MAX_NGRAM = 3  # the longest context suffix looked up
MAX_DRAFT = 8  # drafted tokens per pass at most


class NgramDrafter:
    """Prompt-lookup drafting: the tokens that followed the latest earlier occurrence
    of the context's last n tokens (n = MAX_NGRAM down to 1). Code edits, quotes and
    rewrites repeat their input, so this drafts well there and costs nothing.
    An index of every n-gram's latest end keeps a look-up O(MAX_NGRAM)."""

    def __init__(self, context: list[int] | None = None) -> None:
        self.context: list[int] = []
        self._ends: dict[tuple[int, ...], int] = {}  # n-gram -> where its latest occurrence ends
        self.extend(context or [])

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            # Index the n-grams ending at the old end first: the current suffix is never
            # its own match.
            end = len(self.context)
            for n in range(1, min(MAX_NGRAM, end) + 1):
                self._ends[tuple(self.context[end - n:end])] = end
            self.context.append(token)

    def truncate(self, length: int) -> None:
        """Forget tokens past `length` (rebuilds the index: rare, after a rewind of the
        consumer's own context, not of drafts, which are never added)."""
        if length < len(self.context):
            kept = self.context[:length]
            self.context, self._ends = [], {}
            self.extend(kept)

    def draft(self, k: int) -> list[int]:
        if k <= 0:
            return []
        end = len(self.context)
        for n in range(min(MAX_NGRAM, end), 0, -1):
            found = self._ends.get(tuple(self.context[end - n:]))
            if found is not None:
                return self.context[found:found + k]
        return []


def accept_greedy(logits: torch.Tensor, drafts: list[int]) -> tuple[list[int], int]:
    """`logits` [k+1, vocab]: the model's after the last token and after each draft.
    The tokens this pass emits (kept drafts, then the model's own), and how many
    drafts were kept."""
    choices = torch.argmax(logits, dim=-1).tolist()
    kept = 0
    while kept < len(drafts) and drafts[kept] == choices[kept]:
        kept += 1
    return drafts[:kept] + [choices[kept]], kept


def accept_sampled(probs: torch.Tensor, drafts: list[int], generator: torch.Generator,
                   draft_probs: torch.Tensor | None = None) -> tuple[list[int], int]:
    """Speculative sampling. `probs` [k+1, vocab]: the model's distributions (already
    warped by temperature and top-p); `draft_probs` [k, vocab] the drafter's (None:
    each draft was proposed with certainty). Returns the emitted tokens and how many
    drafts were kept."""
    out: list[int] = []
    for i, draft in enumerate(drafts):
        p = probs[i]
        q_d = 1.0 if draft_probs is None else float(draft_probs[i, draft])
        u = float(torch.rand((), generator=generator, dtype=torch.float64))
        if q_d > 0 and u < min(1.0, float(p[draft]) / q_d):
            out.append(draft)
            continue
        if draft_probs is None:
            residual = p.clone()
            residual[draft] = 0.0
        else:
            residual = torch.clamp(p - draft_probs[i], min=0.0)
        total = residual.sum()
        if not total > 0:  # p is q: nothing left to correct with (rejection had probability 0)
            residual, total = p, p.sum()
        out.append(int(torch.multinomial(residual / total, 1, generator=generator)))
        return out, i
    out.append(int(torch.multinomial(probs[len(drafts)], 1, generator=generator)))
    return out, len(drafts)


@dataclasses.dataclass
class DraftLength:
    """How many tokens to draft: the k maximising expected tokens per second of a
    pass, from the live acceptance rate α (per drafted token, as an EWMA) and the
    measured cost of a pass: base + k × per_token. A pass yields (1 - α^(k+1)) /
    (1 - α) tokens on average. When drafting does not pay (freeform text: α low,
    or no n-gram match) k is 0 and a pass is a plain decode step."""

    max_draft: int = MAX_DRAFT
    alpha: float = 0.6  # prior: about what n-gram drafts on repetitive text earn
    base_s: float = 0.0  # a one-token pass (0: not measured yet)
    per_token_s: float = 0.0  # each drafted token more (measured from multi-token passes)
    ewma: float = 0.3
    probe_every: int = 16  # passes without drafting, drafts at hand, before trying 2 again (α may have risen)
    drafted: int = 0
    kept: int = 0
    _idle: int = 0

    def observe(self, drafted: int, kept: int, seconds: float) -> None:
        self.drafted += drafted
        self.kept += kept
        if drafted == 0:
            self.base_s = seconds if self.base_s <= 0 else (1 - self.ewma) * self.base_s + self.ewma * seconds
            return
        tried = kept + 1 if kept < drafted else drafted  # drafts the model looked at before one failed
        self.alpha = (1 - self.ewma) * self.alpha + self.ewma * (kept / tried)
        if self.base_s > 0:
            sample = max(0.0, (seconds - self.base_s) / drafted)
            old = self.per_token_s
            self.per_token_s = sample if old <= 0 else (1 - self.ewma) * old + self.ewma * sample

    def choose(self, available: int) -> int:
        """The draft length for the next pass, `available` drafts at hand at most."""
        limit = min(self.max_draft, available)
        if limit <= 0:
            return 0
        base = self.base_s if self.base_s > 0 else 1.0
        per_token = self.per_token_s if self.per_token_s > 0 else 0.1 * base  # prior until measured
        alpha = min(self.alpha, 0.999)
        best, best_rate = 0, 1.0 / base
        for k in range(1, limit + 1):
            rate = (1 - alpha ** (k + 1)) / (1 - alpha) / (base + k * per_token)
            if rate > best_rate * 1.02:  # a longer draft must be worth its risk
                best, best_rate = k, rate
        if best == 0:
            self._idle += 1
            if self._idle >= self.probe_every:
                self._idle = 0
                return min(2, limit)
        else:
            self._idle = 0
        return best
