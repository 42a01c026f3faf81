"""`compushare chat` at a terminal (pexpect) through a real node process serving
the tiny model (given a word-level tokenizer, so that chat has text): /private on,
a private turn that shows its route and answers what transformers answers, /stats,
/private off and a plaintext follow-up; the same private question through the
node's OpenAI-compatible API (the `openai` package, `private` as an extra field);
then `compushare status` shows the node's private sessions and that its ad offers
them."""

import json
import os
import subprocess
import sys

import pytest

from compushare.app.api.engine import messages_to_ids
from compushare.model.catalog import import_path
from helpers import chat_at_a_terminal, reference_greedy

pytestmark = pytest.mark.integration

EOS = 2
MAX_TOKENS = 6


def _expected_reply(model_dir, messages) -> str:
    """What greedy decoding in one process answers, as chat shows it."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    tokens = reference_greedy(model_dir, messages_to_ids(tokenizer, messages), MAX_TOKENS)
    if EOS in tokens:
        tokens = tokens[:tokens.index(EOS) + 1]
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    assert text, "the tiny model answers nothing to this question: pick another"
    return text


def test_chat_private_turn_then_plaintext_turn_and_status(processes, worded_model, tmp_path):
    _, node = processes.node("a", worded_model, "0:4", extra=["--api-port", "0"])
    client = tmp_path / "client"
    import_path(worded_model, client, alias="tiny")
    question, follow_up = "w5 w6 w7 w8", "w9 w10"
    first = _expected_reply(worded_model, [{"role": "user", "content": question}])
    second = _expected_reply(worded_model, [{"role": "user", "content": question},
                                            {"role": "assistant", "content": first},
                                            {"role": "user", "content": follow_up}])
    env = dict(os.environ, COMPUSHARE_HOME=str(tmp_path / "home"))
    with chat_at_a_terminal(client, node["addrs"][0], "--model", "tiny", "--max-tokens", str(MAX_TOKENS),
                            "--spot-check", "0", home=tmp_path / "home", dimensions=(50, 250)) as child:
        child.sendline("/private")
        child.expect_exact("private mode: off")
        child.expect_exact(">>> ")
        child.sendline("/private on")
        child.expect_exact("private mode: on")
        child.expect_exact("seconds per token")
        child.expect_exact(">>> ")
        child.sendline(question)
        child.expect_exact(question)  # the terminal's echo
        child.expect_exact("[private turn: private turns are much slower: expect seconds per token]")
        child.expect_exact(f"hop 1: {node['peer_id']} layers 0:4: q, k, v, o, gate, up, down projections encrypted")
        child.expect_exact("4 of 4 layers x 7 projections encrypted; none in plaintext")
        child.expect_exact(first)  # what transformers answers: CKKS noise changed no token
        child.expect_exact(">>> ")
        child.sendline("/stats")
        child.expect(r"private: [1-9]\d* encrypted projections")
        child.expect_exact(">>> ")
        child.sendline("/private off")
        child.expect_exact("private mode: off")
        child.expect_exact(">>> ")
        child.sendline(follow_up)
        child.expect_exact(follow_up)
        child.expect_exact(second)  # a follow-up: the private turn is part of the conversation
        child.expect_exact(">>> ")
        assert "private turn" not in child.before
        child.sendline("/stats")
        child.expect_exact("route (1 hops)")
        child.expect_exact(">>> ")
        assert "private:" not in child.before  # the plaintext turn's stats

    from openai import OpenAI

    from compushare.app.api.auth import TOKEN_FILE

    api = OpenAI(base_url=f"{node['api']}/v1", api_key=(processes.root / "a" / TOKEN_FILE).read_text().strip(),
                 timeout=120, max_retries=0)
    reply = api.chat.completions.create(model="tiny", max_tokens=MAX_TOKENS, temperature=0,
                                        messages=[{"role": "user", "content": question}], extra_body={"private": True})
    assert reply.choices[0].message.content == first
    report = reply.model_extra["compushare"]
    assert report["private"] is True and report["encrypted_layers"] == report["num_layers"] == 4
    assert report["route"] == [{"peer_id": node["peer_id"], "layers": [0, 4],
                                "encrypted": ["q", "k", "v", "o", "gate", "up", "down"]}]
    assert report["stats"]["projections"] > 0

    status = subprocess.run([sys.executable, "-m", "compushare", "status", "--json", "--data-dir",
                             str(processes.root / "a")], capture_output=True, text=True, timeout=60, env=env)
    assert status.returncode == 0, status.stderr
    status = json.loads(status.stdout)
    private = status["this_node"]["daemon"]["private"]
    assert private["sessions"] >= 2 and private["requests"] > 0  # chat's and the API's
    assert sum(private["refused"].values()) == 0
    (peer,) = [p for p in status["peers"] if p["peer_id"] == node["peer_id"]]
    assert peer["private"] is True
