"""Private mode's waits follow the work (protocol 2.1.0): real node processes, a
private chain of 3 providers whose last one is slow (--debug-slow-steps: two of its
requests take 40 s each, more than a 1-token request's 35 s of allowed silence).

While it works, the first hop waits 80 s and more for its next request, past the 60 s
a provider waits unannounced: the consumer's `wait` keeps its session, the slow
provider's `busy` keeps the consumer waiting on it. No session is closed, no
provider is failed over or penalised, and the tokens equal plaintext's. (A session
whose consumer truly went quiet is closed: tests/unit/test_private_session_waits.py, on a
virtual clock.)
"""

from __future__ import annotations

import time

import pytest

from compushare.app.api.client import call
from compushare.model.catalog import import_path
from compushare.pipeline.client.consumer import Consumer, RunRequest
from compushare.pipeline.client.sampling import SamplingParams
from compushare.pipeline.server.private import IDLE_TIMEOUT_S
from helpers import reference_greedy

pytestmark = pytest.mark.integration

SLOW_S = 40.0  # each of the slow provider's two slow requests
SLOW_FROM = 4  # its requests 0..3 are the prefill's (one layer, 4 groups); 4 and 5 the first decode step's


def private_stats(processes, name: str, state: dict) -> dict:
    return call(processes.root / name, state["api"], "/control/status")["private"]


async def test_a_slow_downstream_hop_closes_no_session_and_penalises_no_one(processes, tiny_model, tmp_path):
    a = processes.nodes([("a", "0:2")], tiny_model)[0]
    boot = a["addrs"][:1]
    b, c = processes.nodes([("b", "2:3")], tiny_model, bootstrap=boot) + processes.nodes(
        [("c", "3:4")], tiny_model, bootstrap=boot, extra=["--debug-slow-steps", f"{SLOW_FROM}:2:{SLOW_S}"])
    client = tmp_path / "client"
    import_path(tiny_model, client, alias="tiny")
    prompt, new = [1, 9, 8, 7, 6], 4
    async with Consumer.connect(client, tuple(boot), "tiny", text_prompts=False, spot_check_rate=0.0) as consumer:
        began = time.monotonic()
        outcome = await consumer.generate(RunRequest(model="tiny", prompt=prompt, private=True,
                                                     params=SamplingParams(max_new_tokens=new, stop_at_eos=False)))
        took = time.monotonic() - began
        penalised = consumer.penalties.excluded(time.monotonic())
    # Hop a waited for b and the slow c at least 2 x SLOW_S: past its unannounced limit.
    assert took > 2 * SLOW_S > IDLE_TIMEOUT_S
    assert outcome.tokens == reference_greedy(tiny_model, prompt, new)
    assert [h.peer_id for h in outcome.route] == [a["peer_id"], b["peer_id"], c["peer_id"]]
    assert outcome.failovers == [] and not penalised
    assert outcome.private["reopened"] == 0
    for name, state in (("a", a), ("b", b), ("c", c)):
        stats = private_stats(processes, name, state)
        assert stats["sessions"] == 1, (name, stats)  # opened once, never closed and opened again
        assert stats["refused"] == {}, (name, stats)

