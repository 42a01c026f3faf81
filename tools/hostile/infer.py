"""An inference hog: holds as much of a server's KV budget as it is given and keeps
the server computing 1,024-token prefills, back to back, on several streams.

Each stream opens a session as large as the server grants (4,096 tokens, else
smaller), then loops: a `prefill_tokens`-token step at position 0, a truncate
back to 0. A reclaimed session is simply opened again. `counts` tallies what
happened (prefills answered, sessions opened, busy and other refusals).
"""

from __future__ import annotations

import collections
import os

import numpy as np
import trio

from compushare.net.codec import DEFAULT_MAX_FRAME
from compushare.net.dial import dial
from compushare.net.framing import FramedStream
from compushare.pipeline import protocol
from compushare.pipeline.messages import OpenRequest, StepRequest, TruncateRequest, WireTensor

SESSION_SIZES = (2048, 1100)  # what it asks for, largest first (4 streams x 2,048: the whole default budget)
REPLY_TIMEOUT_S = 120.0


async def hog(host, peer_id: str, addrs: list[str], model_id: str, hidden_size: int, blocks: tuple[int, int], *,
              streams: int = 4, prefill_tokens: int = 1024, counts: collections.Counter | None = None) -> None:
    """Attack until cancelled."""
    counts = collections.Counter() if counts is None else counts
    rng = np.random.default_rng(int.from_bytes(os.urandom(4), "big"))
    hidden = WireTensor("float32", (1, prefill_tokens, hidden_size),
                        rng.standard_normal((1, prefill_tokens, hidden_size), dtype=np.float32).tobytes())
    info = await dial(host, peer_id, addrs, timeout=10)
    async with trio.open_nursery() as nursery:
        for _ in range(streams):
            stream = await host.new_stream(info.peer_id, [protocol.INFER_PROTOCOL])
            nursery.start_soon(_one_stream, FramedStream(stream, DEFAULT_MAX_FRAME), model_id, blocks, hidden,
                               counts)


async def attack(host, state: dict, model_id: str, counts: collections.Counter, *, hidden_size: int = 576) -> None:
    """The hog against the span a node's state says it serves (bench/hostile.py's
    common signature; hidden_size is SmolLM2-135M's)."""
    await hog(host, state["peer_id"], state["addrs"], model_id, hidden_size, (state["start"], state["end"]),
              counts=counts)


async def _ask(framed: FramedStream, message) -> dict:
    await framed.send(message.to_wire())
    with trio.fail_after(REPLY_TIMEOUT_S):
        reply = await framed.receive()
    if reply is None:
        raise EOFError("the server closed the stream")
    return reply


async def _one_stream(framed: FramedStream, model_id: str, blocks: tuple[int, int], hidden: WireTensor,
                      counts: collections.Counter) -> None:
    session = None
    while True:
        if session is None:
            for size in SESSION_SIZES:
                candidate = os.urandom(protocol.SESSION_ID_BYTES)
                reply = await _ask(framed, OpenRequest(candidate, model_id, blocks[0], blocks[1], size))
                if reply["type"] == "opened":
                    session = candidate
                    counts["sessions_opened"] += 1
                    break
                counts[f"open_{reply.get('code', reply['type'])}"] += 1
            else:
                await trio.sleep(0.2)  # everything refused: try again soon
                continue
        reply = await _ask(framed, StepRequest(session, 0, hidden))
        if reply["type"] != "result":
            counts[f"prefill_{reply.get('code', reply['type'])}"] += 1
            if reply.get("code") == protocol.UNKNOWN_SESSION:
                counts["sessions_reclaimed"] += 1
            session = None
            continue
        counts["prefills"] += 1
        reply = await _ask(framed, TruncateRequest(session, 0))
        if reply["type"] != "truncated":
            session = None
