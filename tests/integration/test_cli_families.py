"""A family other than Llama from the command line, as a user would: `compushare
models import` of a tiny Gemma 3 checkpoint with its tokenizer, a node serving it,
two more fetching their blocks from the swarm by id, and `compushare run` through
the three answering what one process answers; and `models import` refusing, before
storing anything, a model no node could serve."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from compushare.model.families import FAMILIES
from helpers import local_greedy
from tiny_families import add_word_tokenizer, make_tiny_family

PROMPT = "w17 w42 w99 w30 w200 w7 w8"
MOE_GGUF = Path(__file__).resolve().parents[1] / "data" / "gguf" / "tiny-qwen3_moe-f32.gguf"
MOE_PROMPT = "the quick brown fox jumps over"  # words of the corpus its tokenizer was trained on
TOKENS = 8
EOS = 2


def cli(*args: str, home) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "compushare", *args], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, COMPUSHARE_HOME=str(home)))


def test_import_a_gemma3_checkpoint_and_run_it_through_three_nodes(processes, tmp_path):
    from transformers import PreTrainedTokenizerFast

    source = add_word_tokenizer(make_tiny_family("gemma3", tmp_path / "gemma3"))
    imported = cli("models", "import", str(source), "--name", "g3", "--json", "--data-dir",
                   str(processes.root / "a"), home=tmp_path / "home")
    assert imported.returncode == 0, imported.stderr
    model_id = json.loads(imported.stdout)["model_id"]
    _, first = processes.node("a", None, "0:2", alias="g3")  # serves what `models import` stored
    boot = first["addrs"][:1]
    for name, blocks in (("b", "2:3"), ("c", "3:4")):  # other machines: their blocks come through the swarm
        processes.node(name, None, blocks, alias=model_id, bootstrap=boot)
    ran = cli("run", "--model", model_id, "--data-dir", str(tmp_path / "client"), "--bootstrap", boot[0],
              "--no-chat-template", "--max-tokens", str(TOKENS), "--verbose", PROMPT, home=tmp_path / "home")
    assert ran.returncode == 0, ran.stderr
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(source))
    expected = local_greedy(source, tokenizer.encode(PROMPT), TOKENS)
    if EOS in expected:
        expected = expected[:expected.index(EOS)]
    text = tokenizer.decode(expected, skip_special_tokens=True)
    assert len(expected) > 2 and text in ran.stdout, (text, ran.stdout)
    assert "3 hops" in ran.stderr  # the route: 0:2, 2:3, 3:4


def test_models_import_refuses_an_unservable_architecture(tmp_path):
    source = make_tiny_family("qwen3", tmp_path / "other")
    config = json.loads((source / "config.json").read_text())
    config.update(architectures=["FalconForCausalLM"], model_type="falcon")
    (source / "config.json").write_text(json.dumps(config))
    refused = cli("models", "import", str(source), "--name", "f", "--data-dir", str(tmp_path / "data"),
                  home=tmp_path / "home")
    assert refused.returncode == 2
    message = " ".join(refused.stderr.split())  # rich wraps long lines
    assert "no node could serve it: unsupported architecture FalconForCausalLM" in message
    assert all(family.title in message for family in FAMILIES.values())
    listed = cli("models", "list", "--json", "--data-dir", str(tmp_path / "data"), home=tmp_path / "home")
    assert json.loads(listed.stdout) == []


def test_import_a_moe_gguf_bring_a_swarm_up_and_run_it(tmp_path):
    """A mixture of experts as a user meets one: `models import` of a GGUF file (the tiny
    Qwen3-MoE llama.cpp's converter wrote), `swarm up` of 3 nodes serving it on ggml (the
    others fetch their blocks from the first by name), `run` through them answering what
    one process computes (ggml spans, one token a step as `--no-speculate` asks)."""
    from compushare.model.store import ModelStore

    home = tmp_path / "home"
    imported = cli("models", "import", str(MOE_GGUF), "--name", "moe", "--json", home=home)
    assert imported.returncode == 0, imported.stderr
    up = cli("swarm", "up", "--nodes", "3", "--model", "moe", home=home)
    try:
        assert up.returncode == 0, up.stderr
        assert up.stderr.count("blocks") == 3
        ran = cli("run", "--model", "moe", "--no-chat-template", "--no-speculate", "--max-tokens", str(TOKENS),
                  "--verbose", MOE_PROMPT, home=home)
    finally:
        down = cli("swarm", "down", home=home)
    assert down.returncode == 0 and "stopped 3 nodes" in down.stderr, down.stderr
    assert ran.returncode == 0, ran.stderr
    assert "3 hops" in ran.stderr
    from transformers import AutoTokenizer

    stored = ModelStore(home).get("moe")
    tokenizer = AutoTokenizer.from_pretrained(str(stored.path))
    expected = local_greedy(stored.path, tokenizer.encode(MOE_PROMPT, add_special_tokens=False), TOKENS)
    if EOS in expected:
        expected = expected[:expected.index(EOS)]
    text = tokenizer.decode(expected, skip_special_tokens=True)
    assert len(expected) > 2 and text in ran.stdout, (text, ran.stdout)
