"""Private mode on a model wider than CKKS's 4,096 slots: Qwen2.5-0.5B's shapes
(hidden 896, 14 heads and 2 KV heads of 64, intermediate 4,864, q/k/v biases;
3 of its 24 layers, random weights) through 3 provider processes, each running
its products on 2 HE worker processes. Its down projection reads 4,864 columns,
2,432 complex slots: the decode plan takes them in one ciphertext, the prompt plan
splits them in chunks (he/plan.py)."""

from __future__ import annotations

import pytest
import trio

from compushare.he.plan import plans
from compushare.model.catalog import import_path
from compushare.pipeline.client.consumer import RunRequest, run_prompt
from compushare.pipeline.client.sampling import SamplingParams
from helpers import reference_greedy
from tiny_families import make_tiny_family

pytestmark = [pytest.mark.integration, pytest.mark.slow]

QWEN05 = dict(hidden_size=896, intermediate_size=4864, num_attention_heads=14, num_key_value_heads=2, head_dim=64,
              num_hidden_layers=3, initializer_range=0.02)
PROMPT = [1, 17, 42, 99, 3, 200, 7, 64, 65, 66, 67, 68, 69, 70]  # more than a prompt plan's tokens a ciphertext
NEW = 5


async def test_a_qwen05_shaped_model_generates_privately_equal_to_plaintext(processes, tmp_path):
    source = make_tiny_family("qwen2", tmp_path / "qwen05", **QWEN05)
    assert max(p.chunks for p in plans(896, 4864, 4096)) >= 2  # down: 896 rows of 4,864 columns
    for name in ("a", "b", "c"):
        (processes.root / name).mkdir(parents=True, exist_ok=True)
        (processes.root / name / "config.toml").write_text("[limits]\ncompute_threads = 2\n")
    states = processes.nodes([("a", "0:1")], source, alias="qwen05")
    boot = states[0]["addrs"][:1]
    states += processes.nodes([("b", "1:2"), ("c", "2:3")], source, alias="qwen05", bootstrap=boot)
    client = tmp_path / "client"
    import_path(source, client, alias="qwen05")
    with trio.fail_after(600):
        outcome = await run_prompt(client, tuple(boot), RunRequest(
            model="qwen05", prompt=PROMPT, private=True, params=SamplingParams(max_new_tokens=NEW, stop_at_eos=False)),
            spot_check_rate=0.0)
    assert outcome.tokens == reference_greedy(source, PROMPT, NEW)
    assert [(h.start, h.end) for h in outcome.route] == [(0, 1), (1, 2), (2, 3)]
    assert outcome.private["projections"] == 7 * 3 * (len(PROMPT) + NEW - 1)  # every projection encrypted
    for name in ("a", "b", "c"):
        assert "HE workers (2) hold blocks" in (processes.root / name / "node.log").read_text()
