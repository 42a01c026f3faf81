"""app/api/tools.py: tool specs checked, call formats read from chat templates, replies
parsed into calls whole and as they stream (any split of the text gives the same)."""

import json

import pytest
from hypothesis import given, settings, strategies as st

from compushare.app.api.tools import (CallStream, Hermes, Llama3, call_format, parse_tool_choice, parse_tools,
                                      template_messages)
from compushare.errors import UsageError

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}}, "required": ["city"]}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {
    "a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
TOOLS = parse_tools([WEATHER, ADD])
QWEN_REPLY = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
              '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": {"c": 2}}}\n</tool_call>')


def test_tools_are_checked():
    assert [t.name for t in TOOLS] == ["get_weather", "add"]
    assert parse_tools(None) == () and parse_tools([]) == ()
    for bad in ("x", [{"type": "function"}], [{"type": "function", "function": {"name": "a b"}}],
                [WEATHER, WEATHER], [{"type": "function", "function": {"name": "f", "parameters": 3}}]):
        with pytest.raises(UsageError):
            parse_tools(bad)
    assert parse_tool_choice(None, TOOLS).mode == "auto" and parse_tool_choice(None, ()).mode == "none"
    named = parse_tool_choice({"type": "function", "function": {"name": "add"}}, TOOLS)
    assert (named.mode, named.name) == ("required", "add")
    for bad in ("sometimes", {"type": "function", "function": {"name": "nope"}}):
        with pytest.raises(UsageError):
            parse_tool_choice(bad, TOOLS)
    with pytest.raises(UsageError, match="needs 'tools'"):
        parse_tool_choice("required", ())


def test_formats_come_from_the_templates():
    from pathlib import Path

    data = Path(__file__).resolve().parent.parent / "data" / "tokenizers"
    assert isinstance(call_format((data / "qwen2.5" / "chat_template.jinja").read_text()), Hermes)
    assert isinstance(call_format((data / "llama3.1.jinja").read_text()), Llama3)
    assert call_format("{% for m in messages %}{{ m.content }}{% endfor %}") is None and call_format(None) is None


def test_a_qwen_reply_parses_into_text_and_calls():
    content, calls = Hermes().parse(QWEN_REPLY, TOOLS)
    assert content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}),
                                                                  ("add", {"a": 1, "b": {"c": 2}})]
    assert len({c.id for c in calls}) == 2
    for text in ("no call here", QWEN_REPLY[:-5], QWEN_REPLY.replace("get_weather", "unknown"),
                 '<tool_call>\n{"name": "add", "arguments": 3}\n</tool_call>'):
        assert Hermes().parse(text, TOOLS) == (text, [])


def test_a_llama_reply_is_a_call_only_if_all_of_it_is_one():
    content, calls = Llama3().parse(' {"name": "add", "parameters": {"a": 1, "b": 2}}', TOOLS)
    assert content == "" and calls[0].name == "add" and json.loads(calls[0].arguments) == {"a": 1, "b": 2}
    assert Llama3().parse('{"name": "add"', TOOLS) == ('{"name": "add"', [])
    assert Llama3().parse("It is sunny.", TOOLS) == ("It is sunny.", [])


def _streamed(fmt, pieces):
    stream, content, calls = CallStream(fmt, TOOLS), "", {}
    events = [e for piece in pieces for e in stream.feed(piece)]
    last, whole_content, whole_calls = stream.finish()
    for event in events + last:
        if event[0] == "content":
            content += event[1]
        elif event[0] == "call":
            calls[event[1]] = [event[2].name, event[2].id, ""]
        else:
            calls[event[1]][2] += event[2]
    assert content == whole_content
    assert [(c.name, c.id, c.arguments) for c in whole_calls] == [tuple(v) for v in calls.values()]
    return content, [(name, json.loads(arguments)) for name, _, arguments in calls.values()]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, len(QWEN_REPLY)), max_size=12))
def test_any_split_of_a_streamed_reply_gives_the_same_calls(cuts):
    bounds = [0, *sorted(cuts), len(QWEN_REPLY)]
    pieces = [QWEN_REPLY[a:b] for a, b in zip(bounds, bounds[1:])]
    content, calls = _streamed(Hermes(), pieces)
    assert content.rstrip() == "Let me look."
    assert calls == [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": {"c": 2}})]


def test_streamed_text_without_calls_is_all_content():
    assert _streamed(Hermes(), ["Hello <tool", "_ca", "t> there"]) == ("Hello <tool_cat> there", [])
    assert _streamed(Hermes(), ["Hello <tool_c"]) == ("Hello <tool_c", [])
    assert _streamed(Llama3(), ['{"name": "add", ', '"parameters": {"a": 1, "b": 2}}']) == (
        "", [("add", {"a": 1, "b": 2})])
    stream = CallStream(Llama3(), TOOLS)
    assert stream.feed(" It") == [("content", " It")] and stream.feed(" is {") == [("content", " is {")]
    assert stream.finish() == ([], " It is {", [])
    assert _streamed(Llama3(), ['{"name": "add"', " oops"]) == ('{"name": "add" oops', [])


def test_template_messages_turn_argument_strings_into_objects():
    messages = [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}]}]
    assert template_messages(messages)[0]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    with pytest.raises(UsageError):
        template_messages([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}])
