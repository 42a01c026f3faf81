"""What a request asks of its reply's shape, sans I/O: a JSON schema (OpenAI's
`response_format`, Ollama's `format`, `run --json-schema`), tools and how they may be
called. `Shape` is what the parsers of requests.py keep; engine.py turns it into the
grammar the consumer enforces (pipeline/client/grammar.py) and the calls parsed back
(tools.py)."""

from __future__ import annotations

import dataclasses

from ...errors import UsageError
from .tools import Tool, ToolChoice, parse_tool_choice, parse_tools

ANY_OBJECT = {"type": "object"}  # json_object, Ollama's "json": an object, as both document


@dataclasses.dataclass(frozen=True)
class Shape:
    schema: dict | None = None  # the reply is one JSON document valid against it
    tools: tuple[Tool, ...] = ()
    choice: ToolChoice = ToolChoice("none")
    parallel: bool = True  # several calls in one reply
    param: str = "response_format"  # the field a grammar error is blamed on

    @property
    def calls(self) -> bool:
        """Whether the reply may hold tool calls (then it is parsed for them)."""
        return bool(self.tools) and self.choice.mode != "none"


class BadField(UsageError):
    """A request field with a wrong value: a 400 naming the field (OpenAI's `param`)."""

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(message)
        self.param = param


def openai_response_format(value: object) -> dict | None:
    """OpenAI's response_format: {"type": "text"}, {"type": "json_object"} or
    {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return ANY_OBJECT
    if kind == "json_schema" and isinstance(value, dict) and isinstance(value.get("json_schema"), dict):
        schema = value["json_schema"].get("schema", ANY_OBJECT)
        if isinstance(schema, dict):
            return schema
    raise BadField("response_format", "'response_format' must be {\"type\": \"text\"}, {\"type\": "
                                        "\"json_object\"} or {\"type\": \"json_schema\", \"json_schema\": {\"name\": "
                                        "..., \"schema\": {...}}}")


def ollama_format(value: object) -> dict | None:
    """Ollama's format: "json" or a JSON schema."""
    if value in (None, ""):
        return None
    if value == "json":
        return ANY_OBJECT
    if isinstance(value, dict):
        return value
    raise BadField("format", "'format' must be \"json\" or a JSON schema object")


def openai_shape(body: dict) -> Shape:
    schema = openai_response_format(body.get("response_format"))
    try:
        tools = parse_tools(body.get("tools"))
        choice = parse_tool_choice(body.get("tool_choice"), tools)
    except UsageError as exc:
        raise BadField("tool_choice" if "tool_choice" in str(exc) else "tools", str(exc)) from None
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise BadField("parallel_tool_calls", "'parallel_tool_calls' must be a boolean")
    shape = Shape(schema, tools, choice, parallel)
    return _one_grammar(shape, "response_format")


def ollama_shape(body: dict, chat: bool) -> Shape:
    schema = ollama_format(body.get("format"))
    try:
        tools = parse_tools(body.get("tools")) if chat else ()
    except UsageError as exc:
        raise BadField("tools", str(exc)) from None
    return _one_grammar(Shape(schema, tools, parse_tool_choice(None, tools), True, "format"), "format")


def _one_grammar(shape: Shape, param: str) -> Shape:
    """A schema for the reply and tools the model may call would be two grammars for
    one reply: refused, unless the tools are not to be called."""
    if shape.schema is not None and shape.calls:
        raise BadField(param, f"'{param}' cannot be combined with tools the model may call (tool_choice \"none\" "
                                "leaves the tools out)")
    return shape
