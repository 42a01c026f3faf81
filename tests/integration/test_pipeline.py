"""Greedy tokens through 3 separate node processes equal single-process transformers."""

import pytest

from compushare.pipeline.consumer import RunRequest, run_prompt
from compushare.pipeline.sampling import SamplingParams
from compushare.model.catalog import import_path
from helpers import reference_greedy

PROMPTS = [[1, 17, 42, 99, 3], [1, 200, 201, 202, 203, 204, 205, 206, 207], [1, 7]]


@pytest.fixture
def tiny_swarm(processes, tiny_model):
    _, first = processes.node("a", tiny_model, "0:1")
    boot = first["addrs"][:1]
    states = [first]
    for name, blocks in (("b", "1:3"), ("c", "3:4")):
        states.append(processes.node(name, tiny_model, blocks, bootstrap=boot)[1])
    return boot, states


async def test_three_processes_match_transformers_greedy(tiny_swarm, tiny_model, tmp_path):
    boot, states = tiny_swarm
    client_dir = tmp_path / "client"
    import_path(tiny_model, client_dir, alias="tiny")
    for prompt in PROMPTS:
        expected = reference_greedy(tiny_model, prompt, 32)
        outcome = await run_prompt(
            client_dir, tuple(boot),
            RunRequest(model="tiny", prompt=prompt, params=SamplingParams(max_new_tokens=32, stop_at_eos=False)),
        )
        assert outcome.tokens == expected
        assert [(h.start, h.end) for h in outcome.route] == [(0, 1), (1, 3), (3, 4)]
        assert {h.peer_id for h in outcome.route} == {s["peer_id"] for s in states}
