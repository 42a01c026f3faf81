"""Tokens equal llama.cpp's: greedy decoding through node processes serving ggml spans
gives, token for token, what llama.cpp itself gave on the same file and prompt ids
(tests/data/gguf/llamacpp_tokens.json, recorded by tools/llamacpp_tokens.py with
bench/llamacpp_ref.py's build: llama.cpp's defaults on CPU, flash attention on).

SmolLM2's GGUF through a swarm of 3 nodes; each family's fixture through a node per
block span (2 for the 2-layer files, 3 for Gemma 3's 6 and the mixtures of experts' 4). One token a step, as
llama.cpp decodes: a verify pass of several tokens takes ggml's several-row kernels.
Every family's fixture is here (Phi-3's since its vocabulary has the "<|endoftext|>"
llama.cpp's loader looks up in a Phi-3: tools/family_ggufs.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from compushare.app.swarm import swarm_down, swarm_up
from compushare.model.catalog import import_path
from compushare.pipeline.client.consumer import RunRequest, run_prompt
from compushare.pipeline.client.sampling import SamplingParams

pytestmark = pytest.mark.slow

DATA = Path(__file__).resolve().parents[1] / "data" / "gguf"
RECORDED = json.loads((DATA / "llamacpp_tokens.json").read_text())
FIXTURES = sorted(name for name in RECORDED["files"] if (DATA / name).exists())
SPANS = {2: ("0:1", "1:2"), 4: ("0:1", "1:3", "3:4"), 6: ("0:2", "2:4", "4:6")}
TINY_LAYERS = 4  # tests/tiny_families.py's, where a fixture's overrides keep it (the mixtures of experts)


def _request(model: str, prompt: list[int]) -> RunRequest:
    return RunRequest(model=model, prompt=prompt, params=SamplingParams(max_new_tokens=RECORDED["tokens"],
                                                                        stop_at_eos=False), speculate=False)


@pytest.mark.parametrize("name", FIXTURES)
async def test_each_familys_fixture_through_ggml_nodes_gives_llamacpps_tokens(processes, tmp_path, monkeypatch,
                                                                            name):
    monkeypatch.setenv("COMPUSHARE_CACHE", str(tmp_path / "cache"))
    expected = RECORDED["files"][name]
    layers = json.loads((DATA / "fixtures.json").read_text())["files"][name]["overrides"].get("num_hidden_layers",
                                                                                            TINY_LAYERS)
    spans = SPANS[layers]
    _, first = processes.node("n0", DATA / name, spans[0], alias="fixture")
    boot = first["addrs"][:1]
    for i, span in enumerate(spans[1:], start=1):
        processes.node(f"n{i}", DATA / name, span, alias="fixture", bootstrap=boot)
    client = tmp_path / "client"
    import_path(DATA / name, client, alias="fixture")
    outcome = await run_prompt(client, tuple(boot), _request("fixture", expected["prompt"]))
    assert [(h.start, h.end) for h in outcome.route] == [tuple(map(int, s.split(":"))) for s in spans]
    assert outcome.tokens == expected["tokens"]


async def test_smollm2_gguf_through_three_ggml_nodes_gives_llamacpps_tokens(tmp_path):
    (name,) = [n for n in RECORDED["files"] if n.startswith("SmolLM2")]
    expected = RECORDED["files"][name]
    home, client = tmp_path / "swarm", tmp_path / "client"
    try:
        swarm = swarm_up(home, 3, "smollm2-135m@gguf")
        outcome = await run_prompt(client, tuple(swarm["bootstrap"]), _request("smollm2-135m@gguf",
                                                                               expected["prompt"]))
    finally:
        swarm_down(home)
    assert len({(h.start, h.end) for h in outcome.route}) == 3
    assert outcome.tokens == expected["tokens"]
