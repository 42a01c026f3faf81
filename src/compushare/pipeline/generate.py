"""The consumer's generation loop: embeddings and LM head local, blocks remote."""

from __future__ import annotations

from collections.abc import Callable

import trio

from ..model.head import ConsumerHead
from .client import InferenceChain
from .sampling import Sampler, SamplingParams


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
    while True:
        token = await trio.to_thread.run_sync(lambda h=hidden: sampler.choose(head.logits(h)))
        produced.append(token)
        if on_token is not None:
            on_token(token)
        if (params.stop_at_eos and token in eos_ids) or len(produced) >= params.max_new_tokens:
            return produced
        hidden = await chain.step(head.embed_tokens([token]))
