"""Model names through the swarm: a consumer and a node that do not hold a name learn
from the servers' signed ads which model id it names, then fetch what they need by id."""

from compushare.model.catalog import import_path
from compushare.model.store import ModelStore
from compushare.pipeline.client.consumer import RunRequest, run_prompt
from compushare.pipeline.client.sampling import SamplingParams
from helpers import local_greedy

PROMPT = [1, 17, 42, 99, 3]
NAME = "tiny-chat@q4"


async def test_a_name_not_held_here_is_resolved_through_the_swarm(processes, tiny_model, tmp_path):
    _, first = processes.node("a", tiny_model, "0:2", alias=NAME, fmt="q4")
    boot = first["addrs"][:1]
    # This node holds nothing: it learns the id of NAME from the ads, then the manifest
    # and its span's pieces from the swarm.
    _, second = processes.node("b", None, "2:4", alias=NAME, bootstrap=boot)
    assert second["model_id"] == first["model_id"]
    assert ModelStore(processes.root / "b").aliases() == {NAME: first["model_id"]}
    client = tmp_path / "client"  # empty: neither the name nor the model is here
    outcome = await run_prompt(client, tuple(boot), RunRequest(
        model=NAME, prompt=PROMPT, params=SamplingParams(max_new_tokens=16, stop_at_eos=False)))
    held = ModelStore(client).get(first["model_id"])
    assert held.format.label == "q4/g64"
    assert ModelStore(client).aliases() == {}  # the swarm's answer is used, not kept: a later run asks again
    assert held.holds(head=True) and not held.held_blocks()  # the head and tokenizer only
    assert [(h.start, h.end) for h in outcome.route] == [(0, 2), (2, 4)]
    whole = import_path(tiny_model, tmp_path / "local", alias=NAME, fmt="q4")
    assert whole.model_id == first["model_id"]  # the quantizer is deterministic
    assert outcome.tokens == local_greedy(whole.path, PROMPT, 16)
