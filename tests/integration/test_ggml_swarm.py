"""ggml spans among node processes: spot checks catch a lying ggml server (one that
lies by less than the format's tolerance too: two servers of one ggml build computing
the same forwards answer bit for bit), a chain that mixes ggml and torch spans of
one GGUF model passes them, and mixtures of experts' chains pass them bit for bit."""

import json
from pathlib import Path

import pytest
import trio

from compushare.model.catalog import import_path
from compushare.pipeline.client.consumer import Consumer, RunRequest
from compushare.pipeline.client.sampling import SamplingParams
from compushare.proofs.inference import TOLERANCES, FailureReport
from gguf_files import Q4_K_M, write_tiny_llama
from helpers import liar_and_honest, local_greedy

PROMPT = [1, 17, 42, 99, 3]
TOKENS = 16


@pytest.fixture
def tiny_gguf(tmp_path, monkeypatch):
    monkeypatch.setenv("COMPUSHARE_CACHE", str(tmp_path / "cache"))
    return write_tiny_llama(tmp_path / "tiny-q4_k_m.gguf", Q4_K_M)


def _request() -> RunRequest:
    return RunRequest(model="tiny", prompt=PROMPT, speculate=False,
                      params=SamplingParams(max_new_tokens=TOKENS, stop_at_eos=False))


async def test_a_lying_ggml_server_is_caught_and_reported(processes, tiny_gguf, tmp_path):
    client = import_path(tiny_gguf, tmp_path / "client", alias="tiny")
    _, boot, noisy, honest = liar_and_honest(processes, tiny_gguf)
    async with Consumer.connect(tmp_path / "client", tuple(boot), "tiny", text_prompts=False,
                                spot_check_rate=1.0) as consumer:
        with trio.fail_after(90):
            outcome = await consumer.generate(_request())
    assert [(f.reason, f.peer_id) for f in outcome.failovers] == [("mismatch", noisy["peer_id"])]
    assert honest["peer_id"] in {h.peer_id for h in outcome.route}
    assert outcome.tokens == local_greedy(client.path, PROMPT, TOKENS)  # the honest ggml answer, token for token
    assert {h.record.fmt for h in outcome.route} == {"gguf"}
    [report_file] = list((tmp_path / "client" / "reports").iterdir())
    report = FailureReport.from_wire(report_file.read_bytes())
    report.check()
    assert report.accused.peer_id == noisy["peer_id"] and report.mode == "gguf"
    assert report.tolerance == 0.0  # one build (this machine's) computing the same forwards
    assert report.accused.runtime == report.witness.runtime and report.witness.runtime.startswith("ggml/")


async def test_a_ggml_server_lying_within_the_formats_tolerance_is_caught_bit_for_bit(processes, tiny_gguf,
                                                                                     tmp_path):
    """B's noise moves its outputs by about 1e-4, fifty times less than the gguf
    format's 2e-2 (and well within rounding across CPUs): only a bit-for-bit check
    catches it, and one is due, since C computes each checked step in the same forwards
    as B (the prompt in one forward, then one token at a time)."""
    client = import_path(tiny_gguf, tmp_path / "client", alias="tiny")
    _, boot, noisy, honest = liar_and_honest(processes, tiny_gguf, noise=1e-4)
    async with Consumer.connect(tmp_path / "client", tuple(boot), "tiny", text_prompts=False,
                                spot_check_rate=1.0) as consumer:
        with trio.fail_after(90):
            outcome = await consumer.generate(_request())
    assert [(f.reason, f.peer_id) for f in outcome.failovers] == [("mismatch", noisy["peer_id"])]
    assert outcome.tokens == local_greedy(client.path, PROMPT, TOKENS)
    [report] = [FailureReport.from_wire(f.read_bytes()) for f in (tmp_path / "client" / "reports").iterdir()]
    report.check()
    assert report.accused.peer_id == noisy["peer_id"] and report.tolerance == 0.0
    assert 0 < report.error() < TOLERANCES["gguf"] / 10


async def test_two_honest_ggml_servers_of_one_build_pass_every_check_bit_for_bit(processes, tiny_gguf, tmp_path):
    """No false alarm from holding one build to bit-equality: every step of 2:4 checked
    (the verifier fed each one in the primary's forwards), every check exact."""
    import_path(tiny_gguf, tmp_path / "client", alias="tiny")
    _, first = processes.node("a", tiny_gguf, "0:2")
    boot = first["addrs"][:1]
    b, c = (processes.node(name, tiny_gguf, "2:4", bootstrap=boot, wait=False)[0] for name in "bc")
    processes.ready("b", b), processes.ready("c", c)
    async with Consumer.connect(tmp_path / "client", tuple(boot), "tiny", text_prompts=False,
                                spot_check_rate=1.0) as consumer:
        with trio.fail_after(90):
            outcome = await consumer.generate(_request())
    assert outcome.failovers == [] and outcome.reports == []
    assert outcome.checks >= TOKENS - 1 and outcome.exact_checks == outcome.checks


async def test_a_chain_mixing_ggml_and_torch_spans_passes_its_spot_checks(processes, tiny_gguf, tmp_path):
    """0:2 on ggml; 2:4 on a torch node and on a ggml node: every step of 2:4 is
    checked, torch's answer against ggml's, within the gguf format's tolerance."""
    import_path(tiny_gguf, tmp_path / "client", alias="tiny")
    _, first = processes.node("a", tiny_gguf, "0:2")
    boot = first["addrs"][:1]
    torch_node = processes.node("b", tiny_gguf, "2:4", bootstrap=boot, extra=["--runtime", "torch"], wait=False)[0]
    ggml_node = processes.node("c", tiny_gguf, "2:4", bootstrap=boot, extra=["--runtime", "ggml"], wait=False)[0]
    b, c = processes.ready("b", torch_node), processes.ready("c", ggml_node)
    async with Consumer.connect(tmp_path / "client", tuple(boot), "tiny", text_prompts=False,
                                spot_check_rate=1.0) as consumer:
        with trio.fail_after(90):
            outcome = await consumer.generate(_request())
    assert outcome.failovers == [] and outcome.reports == []
    assert len(outcome.tokens) == TOKENS
    assert outcome.exact_checks == 0  # torch against ggml: the format's tolerance
    assert {h.peer_id for h in outcome.route} & {b["peer_id"], c["peer_id"]}
    assert not (tmp_path / "client" / "reports").exists() or not list((tmp_path / "client" / "reports").iterdir())


MOE_FIXTURES = Path(__file__).resolve().parents[1] / "data" / "gguf"
RECORDED = json.loads((MOE_FIXTURES / "llamacpp_tokens.json").read_text())["files"]


@pytest.mark.parametrize("name", ["tiny-qwen3_moe-f32.gguf", "tiny-gpt_oss-f32.gguf"])
async def test_a_moe_chain_with_a_replica_gives_llamacpps_tokens_checked_bit_for_bit(processes, tmp_path,
                                                                                     monkeypatch, name):
    """A mixture of experts on ggml spans: 0:2 and two servers of 2:4. Every step of 2:4
    checked by the other server, bit for bit (one build, the same forwards), and the
    tokens llama.cpp's own. Then as users run one: speculation (verify passes of several
    tokens), a standby fed every step, half the steps checked, the rest straight through,
    every check passing."""
    monkeypatch.setenv("COMPUSHARE_CACHE", str(tmp_path / "cache"))
    path = MOE_FIXTURES / name
    import_path(path, tmp_path / "client", alias="moe")
    _, first = processes.node("a", path, "0:2", alias="moe")
    boot = first["addrs"][:1]
    b, c = (processes.node(node, path, "2:4", alias="moe", bootstrap=boot, wait=False)[0] for node in "bc")
    processes.ready("b", b), processes.ready("c", c)
    expected = RECORDED[name]
    for speculate, rate in ((False, 1.0), (True, 0.5)):
        async with Consumer.connect(tmp_path / "client", tuple(boot), "moe", text_prompts=False,
                                    spot_check_rate=rate) as consumer:
            with trio.fail_after(120):
                outcome = await consumer.generate(RunRequest(
                    model="moe", prompt=expected["prompt"], speculate=speculate, standby=speculate,
                    params=SamplingParams(max_new_tokens=TOKENS, stop_at_eos=False)))
        assert outcome.failovers == [] and outcome.reports == [] and outcome.checks > 0
        assert [(h.start, h.end) for h in outcome.route] == [(0, 2), (2, 4)]
        assert len(outcome.tokens) == TOKENS
        if not speculate:
            assert outcome.exact_checks == outcome.checks  # one build, the same forwards
            assert outcome.tokens == expected["tokens"][:TOKENS]
