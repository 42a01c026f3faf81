"""Greedy tokens through 3 separate node processes equal single-process transformers."""

import pytest

from compushare.app.api.client import call
from compushare.pipeline.client.consumer import RunRequest, run_prompt
from compushare.pipeline.client.sampling import SamplingParams
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
    # The 2nd and 3rd hops computed their decode steps from their upstream's pushes
    # (pipeline/server/push.py), and the answers above are still exactly the reference's.
    # A push sent before the reply nearly always beats the consumer's copy; the bound
    # leaves room for a loaded machine.
    pushed = [call(tmp_path / "nodes" / name, s["api"], "/control/status")["pushed_steps"]
              for name, s in zip("abc", states)]
    assert pushed[0] == 0 and min(pushed[1:]) >= len(PROMPTS) * 32 // 2, pushed
