"""Weight formats through the swarm: per format, greedy tokens through 3 node
processes equal one process computing in the same format (fp32: test_pipeline.py);
a server that names another format than the model id's is refused."""

import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair

from compushare.karma.record import karma_validators
from compushare.model.catalog import import_path
from compushare.net.peer import open_swarm_host
from compushare.errors import HopUnavailable
from compushare.pipeline.client.consumer import Consumer, RunRequest, run_prompt
from compushare.pipeline.client.planner import SwarmPlanner
from compushare.pipeline.client.discovery import discover_servers
from compushare.errors import WRONG_FORMAT
from compushare.pipeline.client.hop import open_hop
from compushare.pipeline.client.routing import Hop
from compushare.pipeline.client.sampling import SamplingParams
from compushare.proofs.inference import TOLERANCES, FailureReport
from helpers import liar_and_honest, local_greedy

PROMPTS = [[1, 17, 42, 99, 3], [1, 200, 201, 202, 203, 204, 205, 206, 207]]
TOKENS = 24


@pytest.mark.parametrize("fmt", ["bf16", "int8", "q4", "q4/g32"])
async def test_three_processes_equal_one_process_in_the_same_format(processes, tiny_model, tmp_path, fmt):
    client = import_path(tiny_model, tmp_path / "client", alias="tiny", fmt=fmt)
    assert client.format.label == {"q4": "q4/g64"}.get(fmt, fmt)
    _, first = processes.node("a", tiny_model, "0:1", fmt=fmt)
    boot = first["addrs"][:1]
    states = [first] + [processes.node(name, tiny_model, blocks, bootstrap=boot, fmt=fmt)[1]
                        for name, blocks in (("b", "1:3"), ("c", "3:4"))]
    assert {s["model_id"] for s in states} == {client.model_id}  # the format is part of the id
    for prompt in PROMPTS:
        outcome = await run_prompt(tmp_path / "client", tuple(boot), RunRequest(
            model="tiny", prompt=prompt, params=SamplingParams(max_new_tokens=TOKENS, stop_at_eos=False)))
        assert outcome.tokens == local_greedy(client.path, prompt, TOKENS)
        assert [(h.start, h.end) for h in outcome.route] == [(0, 1), (1, 3), (3, 4)]
        assert {h.record.fmt for h in outcome.route} == {client.format.label}


async def test_a_server_naming_another_format_is_refused(processes, tiny_model, tmp_path):
    """The liar serves the model's real weights but says q4/g64 in its record, its ad
    and its sessions' Opened reply: the route leaves it out, and a session opened on
    it anyway is refused; the answer is the honest servers'."""
    _, first = processes.node("a", tiny_model, "0:1")
    boot = first["addrs"][:1]
    _, liar = processes.node("liar", tiny_model, "1:3", bootstrap=boot, extra=["--debug-claim-format", "q4/g64"])
    for name, blocks in (("b", "1:3"), ("c", "3:4")):
        processes.node(name, tiny_model, blocks, bootstrap=boot)
    import_path(tiny_model, tmp_path / "client", alias="tiny")
    async with open_swarm_host(create_new_key_pair(), server=False, validators=karma_validators(),
                               listen=["/ip4/127.0.0.1/tcp/0"], bootstrap=boot) as swarm:
        with trio.fail_after(60):
            while True:  # every server's record is in the DHT
                records = await discover_servers(swarm.dht, first["model_id"], 4)
                if len({r.peer_id for r in records}) == 4:
                    break
                await trio.sleep(0.5)
        lying = next(r for r in records if r.peer_id == liar["peer_id"])
        assert lying.fmt == "q4/g64" and {r.fmt for r in records if r is not lying} == {""}  # fp32: unsaid
        for _ in range(5):
            route = await SwarmPlanner(swarm.host, swarm.dht, first["model_id"], 4, fmt="fp32").first_route()
            assert liar["peer_id"] not in {h.peer_id for h in route}
        with pytest.raises(HopUnavailable) as refused:
            with trio.fail_after(30):
                await open_hop(swarm.host, Hop(lying, 1, 3), first["model_id"], 64, 64, fmt="fp32")
        assert refused.value.code == WRONG_FORMAT and "q4/g64" in str(refused.value)
    outcome = await run_prompt(tmp_path / "client", tuple(boot), RunRequest(
        model="tiny", prompt=PROMPTS[0], params=SamplingParams(max_new_tokens=TOKENS, stop_at_eos=False)))
    assert liar["peer_id"] not in {h.peer_id for h in outcome.route}
    assert outcome.tokens == local_greedy(tmp_path / "client" / "models" / first["model_id"], PROMPTS[0], TOKENS)


async def test_spot_checks_compare_like_formats(processes, tiny_model, tmp_path):
    """A q4 swarm, every step spot-checked: honest q4 servers agree within q4's
    tolerance (no false alarm), a server adding 5% noise is caught, and its failure
    report names the format as its compute mode."""
    client = import_path(tiny_model, tmp_path / "client", alias="tiny", fmt="q4")
    _, boot, noisy, honest = liar_and_honest(processes, tiny_model, fmt="q4")
    async with Consumer.connect(tmp_path / "client", tuple(boot), "tiny", text_prompts=False,
                                spot_check_rate=1.0) as consumer:
        request = RunRequest(model="tiny", prompt=PROMPTS[0], params=SamplingParams(max_new_tokens=TOKENS,
                                                                                  stop_at_eos=False))
        with trio.fail_after(90):
            outcome = await consumer.generate(request)
        assert [(f.reason, f.peer_id) for f in outcome.failovers] == [("mismatch", noisy["peer_id"])]
        assert honest["peer_id"] in {h.peer_id for h in outcome.route}
        assert outcome.tokens == local_greedy(client.path, PROMPTS[0], TOKENS)
    [report_file] = list((tmp_path / "client" / "reports").iterdir())
    report = FailureReport.from_wire(report_file.read_bytes())
    report.check()
    assert report.mode == "q4/g64" and report.tolerance == TOLERANCES["q4/g64"]
