"""A Q4_K_M-style GGUF file (Q4_K projections, Q6_K v / down / LM head, Q8_0
embedding, F32 norms), imported with `compushare models import` as it comes and
served by 3 node processes: greedy tokens equal one process serving the same store."""

import json
import subprocess
import sys

from compushare.pipeline.client.consumer import RunRequest, run_prompt
from compushare.pipeline.client.sampling import SamplingParams
from gguf_files import Q4_K_M, write_tiny_llama
from helpers import local_greedy

PROMPTS = [[1, 17, 42, 99, 3], [1, 200, 201, 202, 203, 204, 205, 206, 207]]
TOKENS = 16


async def test_a_mixed_gguf_through_three_processes_equals_one(processes, tmp_path, monkeypatch):
    monkeypatch.setenv("COMPUSHARE_CACHE", str(tmp_path / "cache"))
    path = write_tiny_llama(tmp_path / "tiny-q4_k_m.gguf", Q4_K_M)
    client = tmp_path / "client"
    imported = subprocess.run([sys.executable, "-m", "compushare", "models", "import", str(path), "--name", "tiny",
                               "--json", "--data-dir", str(client)], capture_output=True, text=True, timeout=120)
    assert imported.returncode == 0, imported.stderr[-2000:]
    model = json.loads(imported.stdout.splitlines()[-1])
    assert model["format"] == "gguf" and model["num_blocks"] == 4
    _, first = processes.node("a", path, "0:1")
    boot = first["addrs"][:1]
    states = [first] + [processes.node(name, path, blocks, bootstrap=boot)[1]
                        for name, blocks in (("b", "1:3"), ("c", "3:4"))]
    assert {s["model_id"] for s in states} == {model["model_id"]}  # one file, one id, CLI or API
    model_dir = client / "models" / model["model_id"]
    for prompt in PROMPTS:
        outcome = await run_prompt(client, tuple(boot), RunRequest(
            model="tiny", prompt=prompt, params=SamplingParams(max_new_tokens=TOKENS, stop_at_eos=False),
            # One token a step, as one process decodes: on ggml a verify pass of several
            # tokens takes other kernels (several rows at once) and may round differently.
            speculate=False))
        assert outcome.tokens == local_greedy(model_dir, prompt, TOKENS)
        assert [(h.start, h.end) for h in outcome.route] == [(0, 1), (1, 3), (3, 4)]
        assert {h.record.fmt for h in outcome.route} == {"gguf"}
