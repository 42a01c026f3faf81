"""Tool calls and structured output through the official `openai` and `ollama`
packages, against 2 real node processes serving a tiny Qwen2.5-shaped model trained to
call tools (Qwen2.5's tokenizer and chat template; helpers.make_tool_model): a call, a
tool's result, the final answer, streamed and not; parallel calls; a required call
valid against its schema; JSON schemas for the reply."""

import json

import pytest

from compushare.app.api.auth import TOKEN_FILE
from helpers import WEATHER_TOOL, Processes, tool_conversations

# The module's tests share one pair of nodes, on one worker.
pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("tool_nodes")]

ADD_TOOL = {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                     "b": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["a", "b"], "additionalProperties": False}}}
REPLY_SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12}, "sky": {"enum": ["sunny", "cloudy", "rainy"]},
    "hours": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 23}, "maxItems": 3},
    "wind": {"type": "object", "properties": {"knots": {"type": "integer", "minimum": 0, "maximum": 60}},
             "required": ["knots"], "additionalProperties": False}},
    "required": ["city", "sky", "hours", "wind"], "additionalProperties": False}
ASKED, PARALLEL, ANSWERED = tool_conversations()


@pytest.fixture(scope="module")
def node(tool_model, tmp_path_factory):
    processes = Processes(tmp_path_factory.mktemp("tool-nodes"))
    try:
        _, first = processes.node("a", tool_model, "0:2", alias="toolie",
                                  extra=["--api-port", "0", "--ad-period", "1"])
        processes.node("b", tool_model, "2:4", alias="toolie", bootstrap=first["addrs"][:1],
                       extra=["--api-port", "0", "--ad-period", "1"])
        yield first, (processes.root / "a" / TOKEN_FILE).read_text().strip()
    finally:
        processes.close()


def _openai(node):
    from openai import OpenAI

    state, token = node
    return OpenAI(base_url=f"{state['api']}/v1", api_key=token, timeout=120, max_retries=0)


def _streamed_message(stream) -> tuple[str, list[dict], str]:
    """Content, calls and finish reason of an OpenAI stream, put together as clients do."""
    content, calls, reason = "", {}, None
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for call in delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"id": None, "name": "", "arguments": ""})
                entry["id"] = call.id or entry["id"]
                entry["name"] += (call.function.name or "") if call.function else ""
                entry["arguments"] += (call.function.arguments or "") if call.function else ""
            reason = choice.finish_reason or reason
    return content, [calls[i] for i in sorted(calls)], reason


def test_openai_tools_round_trip_streamed_and_not(node):
    client = _openai(node)
    ask = {"model": "toolie", "messages": ASKED[0], "tools": [WEATHER_TOOL], "temperature": 0, "max_tokens": 60}
    reply = client.chat.completions.create(**ask)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})

    content, calls, reason = _streamed_message(client.chat.completions.create(**ask, stream=True))
    assert (content, reason) == ("", "tool_calls")
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert calls[0]["id"].startswith("call_")

    # The next turn: the call as the reply gave it, the tool's result, the final answer.
    turn = ASKED[0] + [choice.message.model_dump(exclude_none=True),
                       {"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"}]
    final = client.chat.completions.create(**dict(ask, messages=turn))
    assert final.choices[0].message.content == ANSWERED[1] and final.choices[0].finish_reason == "stop"
    assert not final.choices[0].message.tool_calls
    content, calls, reason = _streamed_message(client.chat.completions.create(**dict(ask, messages=turn),
                                                                              stream=True))
    assert (content, calls, reason) == (ANSWERED[1], [], "stop")

    # Two cities: two calls in one reply, streamed and not.
    both = dict(ask, messages=PARALLEL[0])
    calls = client.chat.completions.create(**both).choices[0].message.tool_calls
    assert [json.loads(c.function.arguments)["city"] for c in calls] == ["Paris", "Rome"]
    assert len({c.id for c in calls}) == 2
    _, streamed, reason = _streamed_message(client.chat.completions.create(**both, stream=True))
    assert [json.loads(c["arguments"])["city"] for c in streamed] == ["Paris", "Rome"] and reason == "tool_calls"

    # tool_choice "none": no call, whatever the model was taught.
    plain = client.chat.completions.create(**dict(ask, tool_choice="none", max_tokens=8))
    assert not plain.choices[0].message.tool_calls and plain.choices[0].finish_reason in ("stop", "length")


def test_openai_required_calls_are_valid_against_their_schema(node):
    import jsonschema

    client = _openai(node)
    question = [{"role": "user", "content": "What is 2 plus 3?"}]  # never taught: the grammar decides
    for choice in ({"type": "function", "function": {"name": "add"}}, "required"):
        for stream in (False, True):
            ask = dict(model="toolie", messages=question, tools=[WEATHER_TOOL, ADD_TOOL], tool_choice=choice,
                       temperature=0, max_tokens=120, parallel_tool_calls=False)
            if stream:
                _, calls, reason = _streamed_message(client.chat.completions.create(**ask, stream=True))
            else:
                reply = client.chat.completions.create(**ask).choices[0]
                calls = [{"name": c.function.name, "arguments": c.function.arguments}
                         for c in reply.message.tool_calls]
                reason = reply.finish_reason
            assert reason == "tool_calls" and len(calls) == 1, (choice, stream)
            tool = ADD_TOOL if calls[0]["name"] == "add" else WEATHER_TOOL
            assert choice == "required" or calls[0]["name"] == "add"
            jsonschema.validate(json.loads(calls[0]["arguments"]), tool["function"]["parameters"])


def test_openai_response_format_json_schema_and_json_object(node):
    import jsonschema

    client = _openai(node)
    for prompt in ("Weather in Paris?", "Describe Rome.", "Hello"):
        for stream in (False, True):
            ask = dict(model="toolie", messages=[{"role": "user", "content": prompt}], temperature=0,
                       max_tokens=150, response_format={"type": "json_schema", "json_schema": {
                           "name": "weather", "schema": REPLY_SCHEMA, "strict": True}})
            if stream:
                text, _, reason = _streamed_message(client.chat.completions.create(**ask, stream=True))
            else:
                reply = client.chat.completions.create(**ask).choices[0]
                text, reason = reply.message.content, reply.finish_reason
            assert reason == "stop", (prompt, text)
            jsonschema.validate(json.loads(text), REPLY_SCHEMA)
    anything = client.chat.completions.create(model="toolie", messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=150, response_format={"type": "json_object"}, seed=1,
                                              temperature=1.0)
    assert anything.choices[0].finish_reason in ("stop", "length")
    if anything.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(anything.choices[0].message.content), dict)


def test_bad_schemas_and_tools_are_refused_with_the_field_named(node):
    import openai

    client = _openai(node)
    question = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="toolie", messages=question, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}})
    assert refused.value.body["param"] == "response_format"
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="toolie", messages=question, tools=[WEATHER_TOOL],
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
    assert refused.value.body["param"] == "tool_choice"


def test_the_ollama_client_calls_tools_and_follows_a_format(node):
    import jsonschema
    import ollama

    state, token = node
    client = ollama.Client(host=state["api"], headers={"Authorization": f"Bearer {token}"}, timeout=120)
    assert "tools" in client.show("toolie").capabilities
    options = {"temperature": 0, "num_predict": 60}
    reply = client.chat(model="toolie", messages=ASKED[0], tools=[WEATHER_TOOL], options=options)
    [call] = reply.message.tool_calls
    assert (call.function.name, dict(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    parts = list(client.chat(model="toolie", messages=ASKED[0], tools=[WEATHER_TOOL], options=options,
                             stream=True))
    streamed = [c for p in parts for c in (p.message.tool_calls or [])]
    assert [(c.function.name, dict(c.function.arguments)) for c in streamed] == [("get_weather", {"city": "Paris"})]
    assert parts[-1].done

    turn = ASKED[0] + [{"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "18 C, sunny", "tool_name": "get_weather"}]
    final = client.chat(model="toolie", messages=turn, tools=[WEATHER_TOOL], options=options)
    assert final.message.content == ANSWERED[1] and not final.message.tool_calls

    for stream in (False, True):
        shaped = client.chat(model="toolie", messages=[{"role": "user", "content": "Weather in Rome?"}],
                             format=REPLY_SCHEMA, options=dict(options, num_predict=150), stream=stream)
        text = "".join(p.message.content for p in shaped) if stream else shaped.message.content
        jsonschema.validate(json.loads(text), REPLY_SCHEMA)
    generated = client.generate(model="toolie", prompt="Say hi", format="json", options=dict(options, num_predict=150))
    assert isinstance(json.loads(generated.response), dict)


def test_run_json_schema_prints_a_valid_document(node, tool_model, tmp_path):
    """`compushare run --json-schema FILE`: the streamed answer is valid against it; a
    file that is no schema is refused before anything runs."""
    import os
    import subprocess
    import sys

    import jsonschema

    from compushare.model.catalog import import_path

    state, _ = node
    client = tmp_path / "client"
    import_path(tool_model, client, alias="toolie")
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(REPLY_SCHEMA))
    command = [sys.executable, "-m", "compushare", "run", "--model", "toolie", "--data-dir", str(client),
               "--bootstrap", state["addrs"][0], "--max-tokens", "150"]
    env = dict(os.environ, COMPUSHARE_HOME=str(tmp_path / "home"))
    out = subprocess.run(command + ["--json-schema", str(schema), "Weather in Oslo?"], capture_output=True,
                         text=True, timeout=180, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    jsonschema.validate(json.loads(out.stdout), REPLY_SCHEMA)
    schema.write_text("[1, 2]")
    refused = subprocess.run(command + ["--json-schema", str(schema), "hi"], capture_output=True, text=True,
                             timeout=180, env=env)
    assert refused.returncode == 2 and "JSON schema is an object" in refused.stderr


def test_the_chat_page_shows_tool_calls_and_json_replies(node):
    """In Chromium: tools set in the page's settings, the model's call shown as
    name(arguments), the next message sent as the tool's result, the model's answer;
    then a JSON schema reply, shown indented. Screenshot: tests/artifacts/chat_tools.png."""
    import shutil
    from pathlib import Path

    import jsonschema
    from playwright.sync_api import sync_playwright

    state, token = node
    artifacts = Path(__file__).resolve().parents[1] / "artifacts"
    artifacts.mkdir(exist_ok=True)
    last = "#messages .msg.assistant:last-child"

    def fill(page, selector: str, value: str) -> None:
        page.eval_on_selector(selector, """(e, v) => { e.value = v; e.dispatchEvent(new Event("input"));
                                                       e.dispatchEvent(new Event("change")); }""", value)

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=shutil.which("chromium"), args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.set_default_timeout(60_000)
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(f"{state['api']}/chat#token={token}")
            page.wait_for_function("[...document.querySelectorAll('#model option')].some(o => o.value == 'toolie')")
            page.select_option("#model", "toolie")
            fill(page, "#temperature", "0")
            fill(page, "#tools", json.dumps([WEATHER_TOOL]))
            page.fill("#prompt", ASKED[0][0]["content"])
            page.press("#prompt", "Enter")
            page.wait_for_selector(f"{last}[data-state=done] .tool-calls .call")
            call = page.text_content(f"{last} .tool-calls")
            placeholder = page.get_attribute("#prompt", "placeholder")
            page.fill("#prompt", "18 C, sunny")
            page.press("#prompt", "Enter")
            page.wait_for_function(f"document.querySelector('{last}') && "
                                   f"document.querySelector('{last}').dataset.state == 'done' && "
                                   "document.querySelectorAll('#messages .msg').length == 4")
            answer = page.text_content(f"{last} .content")
            roles = page.eval_on_selector_all("#messages .msg", "ms => ms.map(m => m.className)")
            fill(page, "#tools", "")
            fill(page, "#reply-format", "json_schema")
            fill(page, "#schema", json.dumps(REPLY_SCHEMA))
            page.click("#new-chat")
            page.fill("#prompt", "Weather in Rome?")
            page.press("#prompt", "Enter")
            page.wait_for_selector(f"{last}[data-state=done]")
            shaped = page.text_content(f"{last} .content")
            page.screenshot(path=str(artifacts / "chat_tools.png"), full_page=True)
        finally:
            browser.close()
    assert call == 'calls get_weather({ "city": "Paris" })', call
    assert "get_weather" in placeholder
    assert answer == ANSWERED[1] and roles == ["msg user", "msg assistant", "msg tool", "msg assistant"]
    assert shaped.startswith("{\n  ") and errors == []  # indented
    jsonschema.validate(json.loads(shaped), REPLY_SCHEMA)
