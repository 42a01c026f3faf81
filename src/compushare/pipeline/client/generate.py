"""The consumer's generation loop: embeddings and LM head local, blocks remote."""

from __future__ import annotations

import time
from collections.abc import Callable

import trio

from ...model.head import ConsumerHead
from .chain import InferenceChain
from .sampling import Sampler, SamplingParams


# The LM head runs on the event loop when the last token's took this long or less (as
# a server's short decode steps do, server/compute.py): every server of the chain is
# waiting for this token then, the loop has nothing else to do, and a worker thread
# costs its hand-off and a share of the GIL with the loop's network code. A bigger
# head (a large vocabulary on a slow machine) stays in a worker thread.
HEAD_INLINE_MAX_S = 0.05


async def generate(chain: InferenceChain, head: ConsumerHead, prompt_ids: list[int], params: SamplingParams,
                   *, eos_ids: frozenset[int] = frozenset(), max_step_tokens: int = 2048,
                   on_token: Callable[[int], None] | None = None) -> list[int]:
    if not prompt_ids:
        raise ValueError("empty prompt")
    sampler = Sampler(params)
    hidden = None
    for offset in range(0, len(prompt_ids), max_step_tokens):  # chunked prefill
        chunk = prompt_ids[offset:offset + max_step_tokens]
        hidden = await chain.step(head.embed_tokens(chunk))
    produced: list[int] = []
    head_s = None  # how long the LM head and sampling took for the last token

    def next_token(h) -> tuple[int, float]:
        began = time.perf_counter()
        return sampler.choose(head.logits(h)), time.perf_counter() - began

    while True:
        if head_s is not None and head_s <= HEAD_INLINE_MAX_S:
            token, head_s = next_token(hidden)
        else:
            token, head_s = await trio.to_thread.run_sync(next_token, hidden)
        produced.append(token)
        if on_token is not None:
            on_token(token)
        if (params.stop_at_eos and token in eos_ids) or len(produced) >= params.max_new_tokens:
            return produced
        hidden = await chain.step(head.embed_tokens([token]))
