"""The consumer's generation loop: embeddings and LM head local, blocks remote."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import trio

from ...model.head import ConsumerHead
from .chain import InferenceChain
from .grammar import Constraint, drafts_allowed
from .sampling import Sampler, SamplingParams, TokenLogprob, logprobs_of
from .speculative import DraftLength, NgramDrafter, accept_greedy, accept_sampled


# The LM head runs on the event loop when the last token's took this long or less (as
# a server's short decode steps do, server/compute.py): every server of the chain is
# waiting for this token then, the loop has nothing else to do, and a worker thread
# costs its hand-off and a share of the GIL with the loop's network code. A bigger
# head (a large vocabulary on a slow machine) stays in a worker thread.
HEAD_INLINE_MAX_S = 0.05


@dataclasses.dataclass
class GenerateStats:
    """What a generation's speculation did (generate's `stats`)."""

    passes: int = 0  # steps through the chain after the prompt
    drafted: int = 0  # draft tokens sent for verification
    accepted: int = 0  # ... of which kept


class _Head:
    """The LM head on the event loop when its last call was short, else in a worker
    thread (HEAD_INLINE_MAX_S)."""

    def __init__(self, head: ConsumerHead) -> None:
        self.head = head
        self.last_s: float | None = None

    async def __call__(self, fn, *args):
        def timed():
            began = time.perf_counter()
            out = fn(*args)
            self.last_s = time.perf_counter() - began
            return out

        if self.last_s is not None and self.last_s <= HEAD_INLINE_MAX_S:
            return timed()
        return await trio.to_thread.run_sync(timed)


@dataclasses.dataclass(frozen=True)
class Scoring:
    """Log-probabilities of the produced tokens (and the `top` likeliest), handed to
    `emit` in token order, just before the tokens they score."""

    top: int
    emit: Callable[[list[TokenLogprob]], None]


class _Output:
    """The tokens handed out, and whether the generation is over (EOS, the length
    limit, or `until` saying so: a stop sequence seen in the text)."""

    def __init__(self, params: SamplingParams, eos_ids: frozenset[int], on_token: Callable[[int], None] | None,
                 until: Callable[[], bool] | None = None, constraint: Constraint | None = None):
        self.params, self.eos_ids, self.on_token, self.until = params, eos_ids, on_token, until
        self.constraint = constraint
        self.produced: list[int] = []

    def emit(self, token: int) -> bool:
        """Hand `token` out; whether the generation is over."""
        if self.constraint is not None:
            self.constraint.take(token)
        self.produced.append(token)
        if self.on_token is not None:
            self.on_token(token)
        return ((self.params.stop_at_eos and token in self.eos_ids) or len(self.produced) >= self.params.max_new_tokens
                or (self.until is not None and self.until())
                or (self.constraint is not None and self.constraint.finished))


async def generate(chain: InferenceChain, head: ConsumerHead, prompt_ids: list[int], params: SamplingParams,
                   *, eos_ids: frozenset[int] = frozenset(), max_step_tokens: int = 2048,
                   on_token: Callable[[int], None] | None = None, speculate: bool = False,
                   stats: GenerateStats | None = None, drafter=None, scoring: Scoring | None = None,
                   until: Callable[[], bool] | None = None, constraint: Constraint | None = None) -> list[int]:
    """Generate after `prompt_ids`. With `speculate` (a chain that can rewind), each
    pass verifies drafted tokens (speculative.py): the same tokens greedily, the same
    distribution when sampling, fewer passes where the text repeats itself. The
    drafter (`extend(tokens)`, `draft(k)`) is prompt lookup unless one is given.
    `until` is asked after each token whether to stop there. A `constraint` masks the
    logits before every choice, a verify pass's rows too (grammar.py)."""
    if not prompt_ids:
        raise ValueError("empty prompt")
    sampler = Sampler(params)
    stats = stats if stats is not None else GenerateStats()
    run_head = _Head(head)
    hidden = None
    for offset in range(0, len(prompt_ids), max_step_tokens):  # chunked prefill
        chunk = prompt_ids[offset:offset + max_step_tokens]
        hidden = await chain.step(head.embed_tokens(chunk))
    out = _Output(params, eos_ids, on_token, until, constraint)

    def pick(h) -> int:
        logits = head.logits(h)
        scored = logits.clone() if scoring is not None and constraint is not None else logits
        if constraint is not None:
            constraint.mask_(logits)
        token = sampler.choose(logits)
        if scoring is not None:  # the model's own log-probabilities, before the mask
            scoring.emit(logprobs_of(scored[None], [token], scoring.top))
        return token

    token = await run_head(pick, hidden)
    if out.emit(token):
        return out.produced
    if not speculate:
        while True:
            hidden = await chain.step(head.embed_tokens([token]))
            stats.passes += 1
            token = await run_head(pick, hidden)
            if out.emit(token):
                return out.produced
    drafter = NgramDrafter(prompt_ids) if drafter is None else drafter
    await _speculate(chain, head, run_head, sampler, drafter, out, token, len(prompt_ids), stats, scoring)
    return out.produced


async def _speculate(chain: InferenceChain, head: ConsumerHead, run_head: _Head, sampler: Sampler, drafter,
                     out: _Output, token: int, position: int, stats: GenerateStats,
                     scoring: Scoring | None = None) -> None:
    """Passes of `token` and its drafts until `out` says the generation is over;
    `position`: the tokens the chain holds."""
    sizer = DraftLength()
    while True:
        drafter.extend([token])
        room = out.params.max_new_tokens - len(out.produced) - 1  # drafts beyond it would be cut anyway
        drafts = drafter.draft(sizer.choose(room))
        began = time.perf_counter()
        hidden = await chain.step(head.embed_tokens([token] + drafts))

        def verify(h, drafts=drafts) -> tuple[list[int], int]:
            rows = head.logits_rows(h)
            scored = rows.clone() if scoring is not None and out.constraint is not None else rows
            # Drafts the grammar forbids are rejected: the rows are masked as the
            # one-token steps' logits would be, so the output is the same.
            allowed = drafts if out.constraint is None else drafts_allowed(rows, drafts, out.constraint)
            if sampler.greedy:
                emitted, kept = accept_greedy(rows, allowed)
            else:
                emitted, kept = accept_sampled(sampler.distribution(rows), allowed, sampler.generator)
            if scoring is not None:
                scoring.emit(logprobs_of(scored, emitted, scoring.top))
            return emitted, kept

        emitted, kept = await run_head(verify, hidden)
        sizer.observe(len(drafts), kept, time.perf_counter() - began)
        stats.passes += 1
        stats.drafted += len(drafts)
        stats.accepted += kept
        position += 1 + kept
        if kept < len(drafts):
            await chain.rewind(position)  # the servers drop the rejected drafts with their next step
        for index, token in enumerate(emitted):
            if out.emit(token):
                return
            if index < len(emitted) - 1:
                drafter.extend([token])
