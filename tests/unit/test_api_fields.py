"""Every request field of the generation endpoints does what the table says
(app/api/requests.FIELDS: accepted, ignored or refused), the table in docs/api.md is
that table, and each bad value is a 400 naming its field before anything runs."""

import re
from pathlib import Path

import pytest
from hypothesis import given, strategies as st

from compushare.app.api import requests as api
from compushare.app.api.requests import FIELDS, BadField

pytestmark = pytest.mark.unit

DOCS = Path(__file__).resolve().parents[2] / "docs" / "api.md"
PARSERS = {"POST /v1/chat/completions": api.openai_chat, "POST /v1/completions": api.openai_completion,
           "POST /api/chat": api.ollama_chat, "POST /api/generate": api.ollama_generate}
MESSAGES = [{"role": "user", "content": "hi"}]
BASE = {"POST /v1/chat/completions": {"messages": MESSAGES}, "POST /v1/completions": {"prompt": "w5"},
        "POST /api/chat": {"model": "tiny", "messages": MESSAGES}, "POST /api/generate": {"model": "tiny",
                                                                                        "prompt": "w5"}}
# A value each accepted field takes, with the fields it needs beside it.
ACCEPTED = {
    "model": ("tiny", {}), "stream": (True, {}), "stream_options": ({"include_usage": True}, {"stream": True}),
    "max_tokens": (7, {}), "max_completion_tokens": (7, {}), "temperature": (0.5, {}), "top_p": (0.9, {}),
    "seed": (3, {}), "stop": (["\n"], {}), "messages": (MESSAGES, {}), "prompt": ("w6", {}),
    "logprobs": (True, {}), "top_logprobs": (2, {"logprobs": True}), "options": ({"temperature": 0}, {}),
    "system": ("be brief", {}), "raw": (True, {}), "private": (True, {}), "standby": (True, {}),
    "fast_replay": (True, {}), "adapter": ("style", {}), "route": (True, {}),
    "response_format": ({"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}}, {}),
    "format": ({"type": "object"}, {}), "tools": ([{"type": "function", "function": {"name": "f"}}], {}),
    "tool_choice": ("required", {"tools": [{"type": "function", "function": {"name": "f"}}]}),
    "parallel_tool_calls": (False, {}),
}
# A bad value of each accepted field that shapes the reply, refused naming the field.
BAD_SHAPES = {"response_format": {"type": "yaml"}, "format": "xml", "tools": [{"type": "function"}],
              "tool_choice": "sometimes", "parallel_tool_calls": "yes"}
REFUSED = {"n": 2, "best_of": 3, "echo": True, "suffix": "end", "frequency_penalty": 0.5, "presence_penalty": 1,
           "logit_bias": {"5": 1}, "functions": [{"name": "f"}], "function_call": "auto", "modalities": ["audio"],
           "audio": {"voice": "x"}, "prediction": {"type": "content"}, "web_search_options": {}, "think": True, "template": "{{ .Prompt }}", "context": [1, 2], "images": ["aGk="], "width": 64,
           "height": 64, "steps": 4}


def _fields(api_name: str):
    return [f for f in FIELDS[api_name]]


@pytest.mark.parametrize("api_name", sorted(PARSERS))
def test_each_field_does_what_the_table_says(api_name):
    parse, base = PARSERS[api_name], BASE[api_name]
    plain = parse(dict(base))
    for field in _fields(api_name):
        if field.handling == "accepted":
            value, companions = ACCEPTED[field.name]
            if api_name == "POST /v1/completions" and field.name == "logprobs":
                value = 2  # the legacy endpoint's integer
            parse(dict(base, **companions, **{field.name: value}))
            if field.name in BAD_SHAPES:
                with pytest.raises(BadField) as refused:
                    parse(dict(base, **{field.name: BAD_SHAPES[field.name]}))
                assert refused.value.param == field.name, (field.name, refused.value.param)
        elif field.handling == "ignored":
            assert parse(dict(base, **{field.name: "anything"})) == plain, field.name
        else:
            with pytest.raises(BadField) as refused:
                parse(dict(base, **{field.name: REFUSED[field.name]}))
            assert refused.value.param == field.name and field.name in str(refused.value)
            neutral = api._NEUTRAL.get(field.name)
            if neutral:  # clients often send the neutral value: fine
                parse(dict(base, **{field.name: neutral[0]}))


def test_options_do_what_the_table_says():
    for field in FIELDS["options (Ollama)"]:
        body = dict(BASE["POST /api/chat"], options={field.name: ACCEPTED.get(field.name, ("x", {}))[0]
                                                     if field.name != "num_predict" else 5})
        if field.handling == "ignored":
            assert api.ollama_chat(body) == api.ollama_chat(BASE["POST /api/chat"]), field.name
        else:
            api.ollama_chat(body)


def test_a_schema_and_tools_the_model_may_call_are_refused_together():
    schema = {"type": "json_object"}
    tools = [{"type": "function", "function": {"name": "f"}}]
    with pytest.raises(BadField, match="cannot be combined") as refused:
        api.openai_chat(dict(BASE["POST /v1/chat/completions"], response_format=schema, tools=tools))
    assert refused.value.param == "response_format"
    shaped = api.openai_chat(dict(BASE["POST /v1/chat/completions"], response_format=schema, tools=tools,
                                  tool_choice="none"))
    assert shaped.shape.schema == {"type": "object"} and not shaped.shape.calls
    with pytest.raises(BadField):
        api.ollama_chat(dict(BASE["POST /api/chat"], format="json", tools=tools))


def test_unknown_fields_are_refused_by_openai_and_ignored_by_ollama():
    with pytest.raises(BadField) as refused:
        api.openai_chat(dict(BASE["POST /v1/chat/completions"], bogus=1))
    assert refused.value.param == "bogus"
    assert api.ollama_chat(dict(BASE["POST /api/chat"], bogus=1)) == api.ollama_chat(BASE["POST /api/chat"])


def test_the_values_each_endpoint_takes():
    chat = api.openai_chat({"messages": MESSAGES, "max_completion_tokens": 9, "max_tokens": 3, "stop": "END",
                            "seed": 4, "logprobs": True, "top_logprobs": 2, "stream": True,
                            "stream_options": {"include_usage": True}, "route": True, "standby": True})
    assert chat.params.max_new_tokens == 9 and chat.stop == ("END",) and chat.params.seed == 4
    assert chat.logprobs == 2 and chat.include_usage and chat.route and chat.standby and not chat.private
    assert api.openai_chat({"messages": MESSAGES, "logprobs": True}).logprobs == 0
    assert api.openai_chat({"messages": MESSAGES}).logprobs is None
    assert api.openai_completion({"prompt": ["one prompt"]}).prompt == "one prompt"
    assert api.openai_completion({"prompt": [[5, 6]], "logprobs": 0}).prompt == [5, 6]
    ollama = api.ollama_generate({"model": "m", "prompt": "p", "options": {"num_predict": -1, "stop": ["x"],
                                                                             "temperature": 0}})
    assert ollama.params.max_new_tokens == api.MAX_NEW_TOKENS and ollama.stop == ("x",) and ollama.stream
    assert ollama.params.temperature == 0
    defaults = api.ollama_chat({"model": "m", "messages": MESSAGES})
    assert (defaults.params.temperature, defaults.params.top_p) == (api.OLLAMA_TEMPERATURE, api.OLLAMA_TOP_P)


@pytest.mark.parametrize("api_name, body, param", [
    ("POST /v1/chat/completions", {"messages": MESSAGES, "max_tokens": 0}, "max_tokens"),
    ("POST /v1/chat/completions", {"messages": MESSAGES, "max_tokens": True}, "max_tokens"),
    ("POST /v1/chat/completions", {"messages": MESSAGES, "temperature": float("nan")}, "temperature"),
    ("POST /v1/chat/completions", {"messages": MESSAGES, "top_p": 2}, "top_p"),
    ("POST /v1/chat/completions", {"messages": MESSAGES, "stop": ["a"] * 5}, "stop"),
    ("POST /v1/chat/completions", {"messages": MESSAGES, "stop": [""]}, "stop"),
    ("POST /v1/chat/completions", {"messages": MESSAGES, "stop": "x" * 300}, "stop"),
    ("POST /v1/chat/completions", {"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs"),
    ("POST /v1/chat/completions", {"messages": MESSAGES, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("POST /v1/chat/completions", {"messages": MESSAGES, "stream_options": {"include_usage": True}},
     "stream_options"),
    ("POST /v1/chat/completions", {"messages": "hi"}, "messages"),
    ("POST /v1/chat/completions", {"messages": MESSAGES, "seed": 1.5}, "seed"),
    ("POST /v1/chat/completions", {"messages": MESSAGES, "private": "yes"}, "private"),
    ("POST /v1/completions", {"prompt": ["a", "b"]}, "prompt"),
    ("POST /v1/completions", {"prompt": ""}, "prompt"),
    ("POST /v1/completions", {"prompt": [5, -1]}, "prompt"),
    ("POST /v1/completions", {"prompt": "x", "logprobs": 6}, "logprobs"),
    ("POST /api/chat", {"messages": MESSAGES}, "model"),
    ("POST /api/chat", {"model": "m", "messages": [{"role": "user", "content": "x", "images": ["aGk="]}]},
     "messages"),
    ("POST /api/chat", {"model": "m", "messages": MESSAGES, "options": {"num_predict": 0}}, "options.num_predict"),
    ("POST /api/chat", {"model": "m", "messages": MESSAGES, "options": {"temperature": -1}},
     "options.temperature"),
    ("POST /api/chat", {"model": "m", "messages": MESSAGES, "options": []}, "options"),
    ("POST /api/generate", {"model": "m", "prompt": 5}, "prompt"),
])
def test_bad_values_name_their_field(api_name, body, param):
    with pytest.raises(BadField) as bad:
        PARSERS[api_name](body)
    assert bad.value.param == param and param.split(".")[-1] in str(bad.value)


@given(st.dictionaries(st.sampled_from(sorted({f.name for fields in FIELDS.values() for f in fields})),
                       st.one_of(st.none(), st.booleans(), st.integers(-5, 10**20), st.floats(), st.text(max_size=5),
                                 st.lists(st.integers(-2, 5), max_size=3)), max_size=6))
def test_any_body_parses_or_names_a_field(body):
    """Whatever a client sends: a Generation, or a BadField (never another error)."""
    for parse in PARSERS.values():
        try:
            parse(body)
        except BadField:
            pass


def _doc_tables() -> dict[str, list[tuple[str, str, str]]]:
    """docs/api.md's field tables: a `### <endpoint>` heading, then `| field | handling | note |` rows."""
    tables: dict[str, list[tuple[str, str, str]]] = {}
    current = None
    for line in DOCS.read_text().splitlines():
        heading = re.match(r"^### (.+)$", line)
        if heading:
            current = heading.group(1).strip().strip("`")
            continue
        row = re.match(r"^\| `([^`]+)` \| (accepted|ignored|refused) \| (.+) \|$", line)
        if row and current is not None:
            tables.setdefault(current, []).append((row.group(1), row.group(2), row.group(3).replace("\\|", "|")))
    return tables


def test_docs_api_md_holds_exactly_the_code_table():
    tables = _doc_tables()
    assert set(tables) == set(FIELDS), "docs/api.md needs one table per endpoint of requests.FIELDS"
    for endpoint, fields in FIELDS.items():
        assert tables[endpoint] == [(f.name, f.handling, f.note) for f in fields], endpoint
