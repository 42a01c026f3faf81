"""A LoRA adapter through 3 node processes: every server applies the consumer's
adapter to its sessions, so a greedy generation equals the same adapter applied in
one process, relayed, with direct return and with standby replicas; an adapter made
for another model is refused before anything is sent."""

import os
import signal
from pathlib import Path

import pytest
import trio

from compushare.errors import UsageError
from compushare.model import adapter_file
from compushare.model.arch import load_config
from compushare.model.catalog import import_path
from compushare.pipeline.client.consumer import Consumer, RunRequest, run_prompt
from compushare.pipeline.client.sampling import SamplingParams
from helpers import local_adapted_greedy, local_greedy, random_adapter

PROMPT = [1, 17, 42, 99, 3]
NEW = 32


def swarm(processes, model):
    _, first = processes.node("a", model, "0:1")
    boot = first["addrs"][:1]
    processes.nodes([("b", "1:3"), ("c", "3:4")], model, bootstrap=boot)
    return boot


def request(adapter_path, **mode) -> RunRequest:
    return RunRequest(model="tiny", prompt=PROMPT, adapter=adapter_path,
                      params=SamplingParams(max_new_tokens=NEW, stop_at_eos=False), **mode)


async def generate(client_dir, boot, adapter_path, **mode):
    return await run_prompt(client_dir, tuple(boot), request(adapter_path, **mode), spot_check_rate=0.0)


def saved_adapter(tiny_model, client_dir, tmp_path):
    model_id = import_path(tiny_model, client_dir, alias="tiny").model_id
    adapter = random_adapter(load_config(tiny_model), seed=11, model_id=model_id)
    return adapter, adapter_file.save(adapter, tmp_path / "adapter.safetensors", base_model="tiny")


async def test_an_adapter_through_the_swarm_gives_its_local_greedy_tokens(processes, tiny_model, other_tiny_model,
                                                                           tmp_path):
    boot = swarm(processes, tiny_model)
    client_dir = tmp_path / "client"
    adapter, path = saved_adapter(tiny_model, client_dir, tmp_path)
    expected = local_adapted_greedy(tiny_model, adapter, PROMPT, NEW)
    assert expected != local_greedy(tiny_model, PROMPT, NEW)  # the adapter changes the answer
    modes = {"relay": dict(direct=False, speculate=False), "direct": dict(direct=True, speculate=True)}
    for name, mode in modes.items():
        outcome = await generate(client_dir, boot, path, **mode)
        assert outcome.tokens == expected, name
        assert [(h.start, h.end) for h in outcome.route] == [(0, 1), (1, 3), (3, 4)]
        assert outcome.chain_breaks == 0, name  # the servers' proofs name the adapter, and link up
        if mode["direct"]:
            assert outcome.direct_steps > 0, name
    # One made for another model (its id in the file) is refused before any session opens.
    other_id = import_path(other_tiny_model, tmp_path / "other", alias="other").model_id
    other = adapter_file.save(random_adapter(load_config(other_tiny_model), seed=12, model_id=other_id),
                              tmp_path / "other-adapter")
    with pytest.raises(BaseException) as refused:  # out of the client's nurseries: in an exception group
        await generate(client_dir, boot, other, direct=True, speculate=False)
    (error,) = leaves(refused.value)
    assert isinstance(error, UsageError) and "an adapter only applies to its own model" in str(error), error


async def test_an_adapter_on_ggml_spans_gives_its_one_process_tokens_on_ggml(processes, tmp_path):
    """Two nodes serving a Llama GGUF on ggml (its q / k rows permuted for ggml's rotary
    layout, and so the adapter's B rows) apply the adapter: greedy tokens through them
    equal one process's on ggml with the same adapter."""
    gguf = Path(__file__).resolve().parents[1] / "data" / "gguf" / "tiny-llama-f32.gguf"
    _, first = processes.node("a", gguf, "0:1", fmt="gguf")
    boot = first["addrs"][:1]
    processes.node("b", gguf, "1:2", fmt="gguf", bootstrap=boot)
    client_dir = tmp_path / "client"
    stored = import_path(gguf, client_dir, alias="tiny", fmt="gguf")
    adapter = random_adapter(load_config(stored.path), range(2), seed=11, model_id=stored.model_id,
                             targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
    path = adapter_file.save(adapter, tmp_path / "adapter.safetensors", base_model="tiny")
    expected = local_adapted_greedy(stored.path, adapter, PROMPT, NEW, layers=2, ggml=True)
    assert expected != local_adapted_greedy(stored.path, None, PROMPT, NEW, layers=2, ggml=True)
    outcome = await generate(client_dir, boot, path, direct=False, speculate=False)
    assert outcome.tokens == expected
    assert [(h.start, h.end) for h in outcome.route] == [(0, 1), (1, 2)] and outcome.chain_breaks == 0


def leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in leaves(inner)]
    return [exc]


@pytest.mark.serial  # a killed server's failover is timed
async def test_spot_checks_and_a_standby_takeover_apply_the_adapter(processes, tiny_model, tmp_path):
    """A serves 0:2, B and C both 2:4: spot checks of 2:4 (the other replica, opened
    with the same adapter) agree with the hop, and with a standby on, killing the
    route's 2:4 server mid-generation hands over to the standby without a token
    changing."""
    _, first = processes.node("a", tiny_model, "0:2")
    boot = first["addrs"][:1]
    states = dict(zip("bc", processes.nodes([("b", "2:4"), ("c", "2:4")], tiny_model, bootstrap=boot)))
    client_dir = tmp_path / "client"
    adapter, path = saved_adapter(tiny_model, client_dir, tmp_path)
    expected = local_adapted_greedy(tiny_model, adapter, PROMPT, NEW)
    async with Consumer.connect(client_dir, tuple(boot), "tiny", text_prompts=False,
                                spot_check_rate=0.5) as consumer:
        with trio.fail_after(60):
            await all_serving(consumer, 3)
            checked = await consumer.generate(request(path, direct=False, speculate=False))
        assert checked.tokens == expected
        assert checked.checks > 0 and not checked.reports and not checked.failovers
        consumer.spot_check_rate, route, tokens, killed = 0.0, [], [], {}

        def on_token(token: int) -> None:
            tokens.append(token)
            if len(tokens) == 10 and not killed:  # mid-generation: the next step goes to a dead server
                victim = next(h.peer_id for h in route[0] if h.start == 2)
                killed["pid"] = next(s["pid"] for s in states.values() if s["peer_id"] == victim)
                os.kill(killed["pid"], signal.SIGKILL)

        with trio.fail_after(60):
            outcome = await consumer.generate(request(path, direct=True, speculate=False, standby=True),
                                              on_route=route.append, on_token=on_token)
    assert outcome.tokens == expected
    assert killed and len(outcome.failovers) == 1 and outcome.standby_takeovers == 1


async def all_serving(consumer, servers: int) -> None:
    """Until the consumer's view has every server's ad saying it serves."""
    from compushare.pipeline.client.planner import SwarmPlanner

    planner = SwarmPlanner(consumer.host, consumer.dht, consumer.model.model_id, consumer.model.num_blocks,
                           view=consumer.view)
    while len(planner.records) != servers or planner.unreachable:
        await planner.refresh()
        await trio.sleep(0.5)
