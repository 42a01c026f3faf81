"""The official `ollama` and `openai` Python packages, unchanged, against a real node
process (the tiny model with a word-level tokenizer, 2 node processes): Ollama's
list, show, chat (streamed and not), generate with `stop`, log-probabilities;
OpenAI's `stop`, `logprobs`, `stream_options` and /v1/completions. Every reply is
held to what greedy decoding in one process answers."""

import pytest

from compushare.app.api.auth import TOKEN_FILE
from compushare.app.api.engine import messages_to_ids
from helpers import reference_greedy

pytestmark = pytest.mark.integration

EOS = 2
NEW = 8
QUESTION = "w5 w6 w7 w8"


def _greedy_text(model_dir, prompt_ids) -> tuple[str, list[int]]:
    """What greedy decoding in one process answers (up to EOS), and its tokens."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    tokens = reference_greedy(model_dir, prompt_ids, NEW)
    if EOS in tokens:
        tokens = tokens[:tokens.index(EOS) + 1]
    return tokenizer.decode(tokens, skip_special_tokens=True), tokens


@pytest.fixture
def node(processes, worded_model):
    _, first = processes.node("a", worded_model, "0:2", extra=["--api-port", "0", "--ad-period", "1"])
    _, second = processes.node("b", worded_model, "2:4", bootstrap=first["addrs"][:1],
                               extra=["--api-port", "0", "--ad-period", "1"])
    token = (processes.root / "a" / TOKEN_FILE).read_text().strip()
    return first, token


def _chat_ids(model_dir, messages):
    from transformers import PreTrainedTokenizerFast

    return messages_to_ids(PreTrainedTokenizerFast.from_pretrained(str(model_dir)), messages)


def test_the_official_ollama_client_lists_shows_chats_and_generates_with_stop(node, worded_model):
    import ollama

    state, token = node
    client = ollama.Client(host=state["api"], headers={"Authorization": f"Bearer {token}"}, timeout=120)
    listed = client.list()
    assert "tiny" in [m.model for m in listed.models]
    entry = next(m for m in listed.models if m.model == "tiny")
    assert entry.details.family == "llama" and entry.size > 0 and len(entry.digest) == 64
    shown = client.show("tiny")
    assert shown.modelinfo["llama.block_count"] == 4 and shown.details.family == "llama"
    assert client.ps().models == [] or all(m.model for m in client.ps().models)

    messages = [{"role": "user", "content": QUESTION}]
    expected, tokens = _greedy_text(worded_model, _chat_ids(worded_model, messages))
    options = {"temperature": 0, "num_predict": NEW}
    reply = client.chat(model="tiny", messages=messages, options=options)
    assert reply.message.content == expected and reply.done and reply.eval_count == len(tokens)
    assert reply.done_reason == ("stop" if EOS in tokens else "length") and reply.prompt_eval_count > 0
    parts = list(client.chat(model="tiny", messages=messages, options=options, stream=True))
    assert "".join(p.message.content for p in parts) == expected and len(parts) >= 3
    assert parts[-1].done and not any(p.done for p in parts[:-1])

    # generate: the prompt through the template; `stop` a word the reply holds, split
    # from its neighbours by the tokenizer's spaces: the reply ends just before it.
    words = expected.split()
    assert len(words) >= 3, "the tiny model answers too little to this question: pick another"
    stopped = client.generate(model="tiny", prompt=QUESTION, options=dict(options, stop=[" " + words[2]]))
    assert stopped.response == " ".join(words[:2]) and stopped.done_reason == "stop"
    scored = client.chat(model="tiny", messages=messages, options=options, logprobs=True, top_logprobs=2)
    assert len(scored.logprobs) == len(tokens)
    assert all(p.top_logprobs[0].token == p.token and p.logprob <= 0 for p in scored.logprobs)

    with pytest.raises(ollama.ResponseError) as refused:
        client.chat(model="tiny", messages=messages, format="json")
    # A word-level tokenizer has no bytes to build JSON from: a clear 400, before any peer is asked.
    assert refused.value.status_code == 400 and "cannot be used for structured output" in refused.value.error
    with pytest.raises(ollama.ResponseError) as unknown:
        client.chat(model="no-such-model", messages=messages)
    assert unknown.value.status_code == 404
    with pytest.raises(ollama.ResponseError) as unauthorized:
        ollama.Client(host=state["api"], headers={"Authorization": "Bearer wrong"}).list()
    assert unauthorized.value.status_code == 401
    version = client._client.get("/api/version")  # the package has no call for it; its clients ask
    assert version.status_code == 200 and version.json()["version"]


def test_the_official_openai_client_uses_stop_logprobs_usage_and_completions(node, worded_model):
    from openai import BadRequestError, OpenAI

    state, token = node
    client = OpenAI(base_url=f"{state['api']}/v1", api_key=token, timeout=120, max_retries=0)
    messages = [{"role": "user", "content": QUESTION}]
    expected, tokens = _greedy_text(worded_model, _chat_ids(worded_model, messages))
    words = expected.split()
    assert len(words) >= 3

    cut = client.chat.completions.create(model="tiny", messages=messages, max_tokens=NEW, stop=[" " + words[2]])
    assert cut.choices[0].message.content == " ".join(words[:2]) and cut.choices[0].finish_reason == "stop"

    scored = client.chat.completions.create(model="tiny", messages=messages, max_tokens=NEW, logprobs=True,
                                            top_logprobs=3)
    content = scored.choices[0].logprobs.content
    assert scored.choices[0].message.content == expected and len(content) == scored.usage.completion_tokens
    assert all(len(c.top_logprobs) == 3 and c.top_logprobs[0].token == c.token for c in content)
    assert [c.token for c in content if c.token != "</s>"] == words

    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=NEW, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(tokens)
    assert all(c.usage is None for c in chunks[:-1])

    prompt = "w9 w10 w11"
    text_expected, text_tokens = _greedy_text(worded_model, [9, 10, 11])
    completion = client.completions.create(model="tiny", prompt=prompt, max_tokens=NEW, logprobs=2)
    assert completion.choices[0].text == text_expected
    assert len(completion.choices[0].logprobs.tokens) == len(text_tokens)
    streamed = client.completions.create(model="tiny", prompt=prompt, max_tokens=NEW, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == text_expected

    with pytest.raises(BadRequestError) as many:
        client.chat.completions.create(model="tiny", messages=messages, n=2)
    assert many.value.body["param"] == "n"
    with pytest.raises(BadRequestError) as unknown_field:
        client.chat.completions.create(model="tiny", messages=messages, extra_body={"bogus": 1})
    assert unknown_field.value.body["param"] == "bogus"


def test_run_stops_before_a_stop_sequence(node, worded_model, tmp_path):
    """`compushare run --stop`: the streamed answer ends just before the sequence."""
    import os
    import subprocess
    import sys

    from compushare.model.catalog import import_path

    state, _ = node
    client = tmp_path / "client"
    import_path(worded_model, client, alias="tiny")
    expected, _ = _greedy_text(worded_model, [9, 10, 11])
    words = expected.split()
    assert len(words) >= 3
    out = subprocess.run([sys.executable, "-m", "compushare", "run", "--model", "tiny", "--data-dir", str(client),
                          "--bootstrap", state["addrs"][0], "--max-tokens", str(NEW), "--no-chat-template",
                          "--stop", " " + words[2], "--stop", "never-there", "w9 w10 w11"],
                         capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, COMPUSHARE_HOME=str(tmp_path / "home")))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == " ".join(words[:2])
