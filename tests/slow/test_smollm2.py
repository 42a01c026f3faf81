"""The real SmolLM2-135M-Instruct through a 3-process local swarm."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from compushare.model.blocks import load_full_model

from compushare.model.catalog import resolve_model
from compushare.pipeline.client.consumer import RunRequest, run_prompt
from compushare.pipeline.client.sampling import SamplingParams
from helpers import chat_at_a_terminal, wait_until

# One worker runs the module's tests, so that they share one swarm (smol_swarm).
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("smol_swarm")]
QUESTION = "What is the capital of France?"


def _cli(*args):
    return [sys.executable, "-m", "compushare", *args]


async def test_smollm2_chat_matches_transformers(smol_swarm, tmp_path):
    home, swarm = smol_swarm
    client = tmp_path / "client"
    model = resolve_model("smollm2-135m", client)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model.path))
    ids = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True,
                                        tokenize=True, return_dict=True)["input_ids"]
    reference = load_full_model(model.path)
    with torch.inference_mode():
        expected = reference.generate(torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                                      eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    outcome = await run_prompt(client, tuple(swarm["bootstrap"]), RunRequest(
        model="smollm2-135m", prompt=QUESTION, params=SamplingParams(max_new_tokens=32, stop_at_eos=False)))
    assert outcome.tokens == expected
    assert "Paris" in outcome.text
    assert [(h.start, h.end) for h in outcome.route] == [(0, 10), (10, 20), (20, 30)]


SMOL_PROMPTS = [
    "Rewrite this function with `total` renamed to `acc`:\n\ndef add_all(values):\n    total = 0\n"
    "    for value in values:\n        total = total + value\n    return total\n",
    "Name three rivers of Europe.",
    "Why is the sky blue?",
]


async def test_smollm2_direct_and_speculation_match_transformers_greedy(smol_swarm, tmp_path):
    """Relaying, direct return, and direct return with speculation: 3 prompts x 64
    tokens each equal single-process greedy decoding. Speculation's verify passes run
    several tokens in one forward, which rounds differently from one-token steps
    (torch's kernels are not batch-invariant); these prompts have no near-tie that
    it flips."""
    home, swarm = smol_swarm
    model = resolve_model("smollm2-135m", tmp_path / "reference")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model.path))
    reference = load_full_model(model.path)
    modes = {"relay": dict(direct=False, speculate=False), "direct": dict(direct=True, speculate=False),
             "speculation": dict(direct=True, speculate=True)}
    accepted = 0
    references = {}
    for prompt in SMOL_PROMPTS:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            tokenize=True, return_dict=True)["input_ids"]
        with torch.inference_mode():
            expected = reference.generate(torch.tensor([ids]), max_new_tokens=64, min_new_tokens=64,
                                          do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
        for name, mode in modes.items():
            outcome = await run_prompt(tmp_path / name, tuple(swarm["bootstrap"]), RunRequest(
                model="smollm2-135m", prompt=prompt, params=SamplingParams(max_new_tokens=64, stop_at_eos=False),
                **mode))
            assert outcome.tokens == expected, (name, prompt)
            assert (outcome.direct_steps > 0) == mode["direct"]
            accepted += outcome.accepted
        references[prompt] = expected
    assert accepted > 0  # the rewrite prompt's drafts were kept
    # Batching: the 3 prompts at once, 3 consumers, 2 of each; the servers run the
    # decode steps that arrive together as one forward.
    import trio

    from compushare.app.api.client import call

    before = sum(call(Path(s["data_dir"]), s["api"], "/control/status")["batched_steps"] for s in swarm["nodes"])
    outcomes = {}

    async def one(index: int, prompt: str) -> None:
        outcomes[index] = await run_prompt(tmp_path / f"batch{index}", tuple(swarm["bootstrap"]), RunRequest(
            model="smollm2-135m", prompt=prompt, params=SamplingParams(max_new_tokens=64, stop_at_eos=False),
            speculate=False))

    async with trio.open_nursery() as nursery:
        for index, prompt in enumerate(SMOL_PROMPTS * 2):
            nursery.start_soon(one, index, prompt)
    for index, prompt in enumerate(SMOL_PROMPTS * 2):
        assert outcomes[index].tokens == references[prompt], prompt
    after = sum(call(Path(s["data_dir"]), s["api"], "/control/status")["batched_steps"] for s in swarm["nodes"])
    assert after > before


def test_smollm2_tokenizer_loads_as_autotokenizer_would(tmp_path):
    # A `run` loads the generic fast tokenizer class directly (AutoTokenizer's own
    # imports cost seconds): same class, same ids, same text as AutoTokenizer's.
    from transformers import AutoTokenizer

    from compushare.model.tokenizer import load_tokenizer

    model = resolve_model("smollm2-135m", tmp_path / "client")
    ours, reference = load_tokenizer(model), AutoTokenizer.from_pretrained(str(model.path))
    assert type(ours) is type(reference)
    for text in (QUESTION, "  spaces\tand\nnewlines ", "café naïve 東京 🙂", "<|im_start|>user\nhi<|im_end|>"):
        ids = reference.encode(text)
        assert ours.encode(text) == ids
        assert ours.decode(ids, skip_special_tokens=True) == reference.decode(ids, skip_special_tokens=True)
    chat = [{"role": "user", "content": QUESTION}]
    assert ours.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"] \
        == reference.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    assert (ours.eos_token_id, ours.bos_token_id) == (reference.eos_token_id, reference.bos_token_id)


def test_smollm2_nodes_hold_only_their_span(smol_swarm):
    home, swarm = smol_swarm
    for node in swarm["nodes"]:
        state = json.loads((home / os.path.basename(node["data_dir"]) / "node.json").read_text())
        # SmolLM2: 3,540,096 parameters per decoder layer; 10 layers per node.
        assert state["parameters"] == 10 * 3_540_096


def test_run_cli_streams_answer_with_route(smol_swarm, tmp_path):
    home, swarm = smol_swarm
    result = subprocess.run(
        _cli("run", "--verbose", "--home", str(tmp_path / "cli"), "--swarm-home", str(home), QUESTION),
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    for node in swarm["nodes"]:
        assert node["peer_id"] in result.stderr  # --verbose prints the route
    assert "blocks 0:10: ping" in result.stderr and "expected" in result.stderr


def test_streamed_text_equals_full_decode(tmp_path):
    from transformers import AutoTokenizer

    from compushare.pipeline.client.detokenize import IncrementalDetokenizer

    model = resolve_model("smollm2-135m", tmp_path / "client")
    tokenizer = AutoTokenizer.from_pretrained(str(model.path))
    text = "Hello world!\nThe capital of France is Paris.\n\n  Indented — ünïcödé ✓ 日本語 line\nend"
    ids = tokenizer.encode(text)
    detokenizer = IncrementalDetokenizer(tokenizer)
    pieces = [detokenizer.push(t) for t in ids]
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert sum(1 for p in pieces if p) > 10  # it really streams


def _openai_client(node: dict):
    from openai import OpenAI

    from compushare.app.api.auth import TOKEN_FILE

    token = (Path(node["data_dir"]) / TOKEN_FILE).read_text().strip()
    return OpenAI(base_url=f"{node['api']}/v1", api_key=token, timeout=120, max_retries=0)


def test_openai_package_chat_completions_streaming_and_not(smol_swarm):
    """The official `openai` package against a node's local API (real SmolLM2, the
    same 3-node swarm): a plain and a streamed chat completion, multi-turn."""
    from openai import AuthenticationError, NotFoundError

    home, swarm = smol_swarm
    node = swarm["nodes"][1]  # a node serving the middle blocks: it fetches the head from the swarm
    client = _openai_client(node)
    assert "smollm2-135m" in {m.id for m in client.models.list().data}

    reply = client.chat.completions.create(model="smollm2-135m", max_tokens=24, temperature=0,
                                           messages=[{"role": "user", "content": QUESTION}])
    text = reply.choices[0].message.content
    assert "Paris" in text and reply.choices[0].message.role == "assistant"
    assert reply.usage.completion_tokens <= 24 and reply.usage.prompt_tokens > 5
    assert reply.choices[0].finish_reason in ("stop", "length")

    stream = client.chat.completions.create(
        model="smollm2-135m", max_tokens=24, temperature=0, stream=True,
        messages=[{"role": "user", "content": QUESTION}, {"role": "assistant", "content": text},
                  {"role": "user", "content": "And of Italy?"}])
    pieces, reasons = [], []
    for chunk in stream:
        pieces.append(chunk.choices[0].delta.content or "")
        reasons.append(chunk.choices[0].finish_reason)
    assert len([p for p in pieces if p]) > 3  # streamed piece by piece
    assert "Rome" in "".join(pieces)
    assert reasons[-1] in ("stop", "length") and all(r is None for r in reasons[:-1])

    # Errors in OpenAI's shape, raised as the package's own exceptions.
    with pytest.raises(NotFoundError, match="unknown model"):
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}])
    from openai import OpenAI

    with pytest.raises(AuthenticationError):
        OpenAI(base_url=f"{node['api']}/v1", api_key="wrong", max_retries=0).models.list()


def test_stop_sequences_inside_bpe_tokens_through_openai_and_ollama(smol_swarm):
    """Stop sequences on real BPE text: one that begins and ends inside tokens cuts
    the reply exactly before it (streamed or not, OpenAI's client and Ollama's), and
    the log-probabilities' tokens spell the reply."""
    import ollama

    home, swarm = smol_swarm
    node = swarm["nodes"][0]
    client = _openai_client(node)
    messages = [{"role": "user", "content": QUESTION}]
    full = client.chat.completions.create(model="smollm2-135m", max_tokens=24, temperature=0, messages=messages,
                                          logprobs=True)
    text = full.choices[0].message.content
    assert "".join(t.token for t in full.choices[0].logprobs.content).startswith(text)
    start = text.index("Paris") + 2  # "ris" and what follows: a stop that starts mid-token
    stop = text[start:start + 6]
    expected = text[:text.index(stop)]
    cut = client.chat.completions.create(model="smollm2-135m", max_tokens=24, temperature=0, messages=messages,
                                         stop=stop)
    assert cut.choices[0].message.content == expected and cut.choices[0].finish_reason == "stop"
    streamed = client.chat.completions.create(model="smollm2-135m", max_tokens=24, temperature=0,
                                              messages=messages, stop=[stop], stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == expected

    token = _openai_client(node).api_key
    local = ollama.Client(host=node["api"], headers={"Authorization": f"Bearer {token}"}, timeout=120)
    parts = list(local.chat(model="smollm2-135m", messages=messages, stream=True,
                            options={"temperature": 0, "num_predict": 24, "stop": [stop]}))
    assert "".join(p.message.content for p in parts) == expected and parts[-1].done_reason == "stop"


def test_chat_repl_through_a_pty_two_turns_stats_ctrl_c_and_exit(smol_swarm, tmp_path):
    """`compushare chat` driven like a person at a terminal: a question, a follow-up
    that needs the first turn, /stats, a long reply stopped by Ctrl-C (the REPL
    stays), then /exit."""
    home, swarm = smol_swarm
    with chat_at_a_terminal(tmp_path / "chat", swarm["bootstrap"][0], "--max-tokens", "48",
                            home=tmp_path / "home") as child:
        child.sendline(QUESTION)
        child.expect("Paris")
        child.expect_exact(">>> ")
        child.sendline("And what is the capital of Italy?")  # answerable only as a follow-up
        child.expect("Rome")
        child.expect_exact(">>> ")
        child.sendline("/stats")
        child.expect(r"tok/s")
        child.expect(r"route \(3 hops\)")
        child.expect_exact(">>> ")
        child.sendline("/max 400")
        child.expect_exact(">>> ")
        story = "Write a very long story about a dragon who learns to cook."
        child.sendline(story)
        # The terminal echoes the line at once, maybe before the REPL has read it (a
        # Ctrl-C then only clears the input line): match the echo first, so that the
        # words matched next are the reply's own.
        child.expect_exact(story)
        child.expect(r"\w+ \w+ \w+")  # the reply has started streaming
        child.sendintr()  # Ctrl-C
        child.expect_exact("[reply cancelled]")
        child.expect_exact(">>> ")
        child.sendline("/stats")  # still alive, and the cancelled reply did not replace the last one
        child.expect(r"tok/s")
        child.expect_exact(">>> ")
    assert (tmp_path / "chat" / "chat_history").exists()  # readline history kept in the data dir


def test_openai_stream_abandoned_by_its_client_stops_the_generation(smol_swarm):
    """A client that hangs up mid-stream ends the generation: the swarm stops computing
    (every node's sessions close) long before the 400 tokens asked for."""
    import httpx

    from compushare.app.api.auth import TOKEN_FILE

    home, swarm = smol_swarm
    node, first = swarm["nodes"][1], swarm["nodes"][0]
    headers = {"Authorization": f"Bearer {(Path(node['data_dir']) / TOKEN_FILE).read_text().strip()}"}

    def status(of: dict) -> dict:
        token = (Path(of["data_dir"]) / TOKEN_FILE).read_text().strip()
        return httpx.get(f"{of['api']}/control/status", headers={"Authorization": f"Bearer {token}"},
                         timeout=10).json()

    at_start = status(first)["tokens_served"]
    body = {"model": "smollm2-135m", "stream": True, "max_tokens": 400, "temperature": 0,
            "messages": [{"role": "user", "content": "Write a very long story about a lighthouse."}]}
    with httpx.stream("POST", f"{node['api']}/v1/chat/completions", json=body, headers=headers,
                      timeout=120) as response:
        assert response.status_code == 200
        events = 0
        for line in response.iter_lines():
            events += line.startswith("data: ")
            if events >= 4:
                break  # then hang up
    # The disconnect reaches the node, which closes the reply's session on every server.
    wait_until(lambda: all(status(n)["sessions"] == 0 for n in swarm["nodes"]), "every session closed")
    after = status(first)["tokens_served"]
    # The prompt (~40 tokens with the template) and a few steps, not 400 tokens more.
    assert after - at_start < 150, after - at_start
    assert status(first)["tokens_served"] == after  # nothing more was computed for the abandoned reply


WEATHER_SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 30},
    "country": {"type": "string", "maxLength": 30},
    "sky": {"enum": ["sunny", "cloudy", "rainy", "snowy"]},
    "temperature": {"type": "object", "properties": {
        "value": {"type": "integer", "minimum": -60, "maximum": 60}, "unit": {"enum": ["C", "F"]}},
        "required": ["value", "unit"], "additionalProperties": False},
    "activities": {"type": "array", "items": {"type": "string", "maxLength": 30}, "minItems": 1, "maxItems": 3}},
    "required": ["city", "country", "sky", "temperature", "activities"], "additionalProperties": False}
CITIES = ["Paris", "Rome", "Oslo", "Cairo", "Lima", "Tokyo", "Delhi", "Nairobi", "Madrid", "Berlin", "Quito",
          "Sydney", "Toronto", "Hanoi", "Dakar", "Vienna", "Lisbon", "Seoul", "Bogota", "Athens"]


def test_openai_json_schema_replies_are_valid_on_smollm2(smol_swarm):
    """response_format with a schema of nested objects, arrays and enums, through the
    official client: 20 prompts on the real SmolLM2, each reply valid against it."""
    import jsonschema

    _, swarm = smol_swarm
    client = _openai_client(swarm["nodes"][0])
    response_format = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER_SCHEMA,
                                                              "strict": True}}
    for city in CITIES:
        reply = client.chat.completions.create(
            model="smollm2-135m", temperature=0, max_tokens=256, response_format=response_format,
            messages=[{"role": "user", "content": f"Describe today's weather in {city} as JSON."}])
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", (city, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), WEATHER_SCHEMA)


async def test_the_grammar_with_speculation_on_and_off_gives_the_same_tokens(smol_swarm, tmp_path):
    """The mask on, temperature 0: speculation (drafts the grammar forbids rejected,
    the rest verified under the mask) gives the tokens one-token steps give."""
    import jsonschema

    from compushare.pipeline.client.grammar import json_schema_grammar

    _, swarm = smol_swarm
    grammar = json_schema_grammar(WEATHER_SCHEMA)
    example = {"city": "Paris", "country": "France", "sky": "sunny", "temperature": {"value": 21, "unit": "C"},
               "activities": ["walking", "reading"]}
    accepted = 0
    for prompt in (f"Copy this JSON exactly: {json.dumps(example)}", "Describe the weather in Rome as JSON.",
                   f"Here is Paris: {json.dumps(example)}. Now write the same for Lyon."):
        outcomes = {}
        for speculate in (False, True):
            outcomes[speculate] = await run_prompt(tmp_path / str(speculate), tuple(swarm["bootstrap"]), RunRequest(
                model="smollm2-135m", prompt=prompt, params=SamplingParams(max_new_tokens=200), grammar=grammar,
                speculate=speculate))
        assert outcomes[True].tokens == outcomes[False].tokens, prompt
        jsonschema.validate(json.loads(outcomes[True].text), WEATHER_SCHEMA)
        assert outcomes[True].finish_reason == "stop"
        accepted += outcomes[True].accepted
    assert accepted > 0  # drafts from the copied JSON were kept under the mask
