"""Tool calls, sans I/O: the tools a request offers, checked; the call format a model's
chat template teaches it; the grammar that makes a call valid against its function's
schema (tool_choice "required" or a named function); and the model's reply parsed
back into calls, whole or as it streams.

Two formats, each the one its models were trained on and their templates show:
- "hermes" (Qwen2.5, Qwen3, Hermes): calls as
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, after any text,
  several in a row for parallel calls;
- "llama3" (Llama 3.1 to 3.3): the whole reply one JSON object
  `{"name": ..., "parameters": {...}}`.
A template that shows neither takes no tools: a request offering some is refused.
"""

from __future__ import annotations

import dataclasses
import json
import re
import secrets

from ...errors import UsageError
from ...pipeline.client.grammar import JSON_STYLE

MAX_TOOLS = 128
NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # OpenAI's rule for function names
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"


@dataclasses.dataclass(frozen=True)
class Tool:
    name: str
    parameters: dict  # a JSON schema of the arguments object
    spec: dict  # as the request gave it, for the chat template


@dataclasses.dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object's text, as OpenAI's API carries it

    def openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}

    def ollama(self, index: int) -> dict:
        return {"function": {"index": index, "name": self.name, "arguments": json.loads(self.arguments)}}


def call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def parse_tools(value: object, param: str = "tools") -> tuple[Tool, ...]:
    """OpenAI's (and Ollama's) `tools`: [{"type": "function", "function": {"name",
    "description", "parameters"}}], checked."""
    if value is None or value == []:
        return ()
    if not isinstance(value, list) or len(value) > MAX_TOOLS:
        raise UsageError(f"'{param}' must be a list of up to {MAX_TOOLS} tools")
    tools: dict[str, Tool] = {}
    for spec in value:
        function = spec.get("function") if isinstance(spec, dict) and spec.get("type", "function") == "function" \
            else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) \
                or not NAME.match(function["name"]):
            raise UsageError(f"each of '{param}' must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}} "
                             "with a name of letters, digits, _ . - (up to 64)")
        parameters = function.get("parameters")
        if parameters is None:
            parameters = {"type": "object", "properties": {}}
        if not isinstance(parameters, dict):
            raise UsageError(f"the parameters of tool {function['name']!r} must be a JSON schema object")
        if function["name"] in tools:
            raise UsageError(f"two tools are named {function['name']!r}")
        tools[function["name"]] = Tool(function["name"], parameters, {"type": "function", "function": function})
    return tuple(tools.values())


@dataclasses.dataclass(frozen=True)
class ToolChoice:
    mode: str  # "none", "auto" or "required" (a named function is "required" of one tool)
    name: str | None = None


def parse_tool_choice(value: object, tools: tuple[Tool, ...]) -> ToolChoice:
    if value is None:
        return ToolChoice("auto" if tools else "none")
    if value in ("none", "auto", "required"):
        choice = ToolChoice(str(value))
    elif isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("function"), dict) \
            and isinstance(value["function"].get("name"), str):
        choice = ToolChoice("required", value["function"]["name"])
        if choice.name not in {tool.name for tool in tools}:
            raise UsageError(f"tool_choice names {choice.name!r}, which is not among the tools")
    else:
        raise UsageError("'tool_choice' must be \"none\", \"auto\", \"required\" or "
                         "{\"type\": \"function\", \"function\": {\"name\": ...}}")
    if choice.mode != "none" and not tools:
        raise UsageError(f"tool_choice {value!r} needs 'tools'")
    return choice


def _call_schema(tool: Tool, arguments_key: str) -> dict:
    return {"type": "object", "properties": {"name": {"const": tool.name}, arguments_key: tool.parameters},
            "required": ["name", arguments_key], "additionalProperties": False}


class CallFormat:
    """How one family of models writes tool calls (the module's docstring)."""

    name = ""
    arguments_key = "arguments"

    def calls_grammar(self, tools: tuple[Tool, ...], parallel: bool) -> str:
        raise NotImplementedError

    def parse(self, text: str, tools: tuple[Tool, ...]) -> tuple[str, list[ToolCall]]:
        """A whole reply: its text, and its calls (none where it holds no call, or a
        malformed one: then the text is returned as it is)."""
        raise NotImplementedError

    def calls_schema(self, tools: tuple[Tool, ...]) -> dict:
        schemas = [_call_schema(tool, self.arguments_key) for tool in tools]
        schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
        return dict(schema, **{"x-guidance": JSON_STYLE})

    def _call(self, body: str, tools: tuple[Tool, ...]) -> ToolCall | None:
        try:
            value = json.loads(body)
        except ValueError:
            return None
        names = {tool.name for tool in tools}
        arguments = value.get(self.arguments_key, value.get("arguments")) if isinstance(value, dict) else None
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return None
        if not isinstance(value, dict) or value.get("name") not in names or not isinstance(arguments, dict):
            return None
        return ToolCall(call_id(), value["name"], json.dumps(arguments, ensure_ascii=False))


class Hermes(CallFormat):
    name = "hermes"

    def calls_grammar(self, tools: tuple[Tool, ...], parallel: bool) -> str:
        from ...pipeline.client.grammar import lark_grammar  # noqa: PLC0415

        repeat = ' ("\\n" call)*' if parallel else ""
        return lark_grammar(f"start: call{repeat}\n"
                            f'call: {HERMES_OPEN} "\\n" body "\\n" {HERMES_CLOSE}\n'
                            f"body: %json {json.dumps(self.calls_schema(tools))}\n")

    def parse(self, text: str, tools: tuple[Tool, ...]) -> tuple[str, list[ToolCall]]:
        start = text.find(HERMES_OPEN)
        if start < 0:
            return text, []
        rest = text[start:]
        blocks = list(re.finditer(r"\s*<tool_call>(.*?)</tool_call>\s*", rest, re.DOTALL))
        if "".join(block.group(0) for block in blocks) != rest:
            return text, []  # an unfinished call, or text between calls
        calls = [call for block in blocks if (call := self._call(block.group(1), tools)) is not None]
        if len(calls) != len(blocks):  # a malformed call
            return text, []
        return text[:start].rstrip(), calls


class Llama3(CallFormat):
    name = "llama3"
    arguments_key = "parameters"

    def calls_grammar(self, tools: tuple[Tool, ...], parallel: bool) -> str:
        from ...pipeline.client.grammar import json_schema_grammar  # noqa: PLC0415

        return json_schema_grammar(self.calls_schema(tools))  # one call per reply: Llama 3's templates show one

    def parse(self, text: str, tools: tuple[Tool, ...]) -> tuple[str, list[ToolCall]]:
        stripped = text.strip()
        if not stripped.startswith("{"):
            return text, []
        call = self._call(stripped, tools)
        return (text, []) if call is None else ("", [call])


def call_format(chat_template: str | None) -> CallFormat | None:
    """The call format a chat template teaches its model; None: it takes no tools."""
    if not chat_template or "tools" not in chat_template:
        return None
    if HERMES_OPEN in chat_template:
        return Hermes()
    if "<|python_tag|>" in chat_template or "ipython" in chat_template:
        return Llama3()
    return None


class CallStream:
    """A reply parsed as it streams: `feed(text)` returns events, ("content", text),
    ("call", index, ToolCall with arguments "") and ("arguments", index, text), in
    OpenAI's streaming order; `finish()` the last ones, and the reply's content and
    calls (what the events add up to). Text that may begin a call is held back until
    it is known not to; text after the calls is not content (Qwen ends with a newline).
    A Llama 3 reply that begins with "{" is held whole (it is a call only if all of it
    is one); any other streams as text."""

    def __init__(self, fmt: CallFormat, tools: tuple[Tool, ...]) -> None:
        self.fmt, self.tools = fmt, tools
        self.text = ""  # everything fed
        self.content = ""  # the content handed out
        self.calls: list[ToolCall] = []  # the calls closed
        self._done = 0  # characters of `text` turned into events
        self._open: dict | None = None  # the call being read: where its body starts, what was sent

    def feed(self, piece: str) -> list[tuple]:
        self.text += piece
        if isinstance(self.fmt, Hermes):
            return self._hermes()
        if self.content or (self.text.strip() and not self.text.lstrip().startswith("{")):
            events = self._content(self.text[self._done:])  # not a call: streamed as text
            self._done = len(self.text)
            return events
        return []

    def finish(self) -> tuple[list[tuple], str, list[ToolCall]]:
        if isinstance(self.fmt, Llama3) and self.content:  # streamed as text already
            return self._content(self.text[self._done:]), self.content, []
        if isinstance(self.fmt, Llama3):
            self.content, self.calls = self.fmt.parse(self.text, self.tools)
            events: list[tuple] = [("content", self.content)] if self.content else []
            for index, call in enumerate(self.calls):
                events += [("call", index, dataclasses.replace(call, arguments="")),
                           ("arguments", index, call.arguments)]
            return events, self.content, self.calls
        events = []
        unsent = self._open is None or self._open["sent"] is None
        if not self.calls and unsent and self._done < len(self.text):  # held back, or a call never named
            self._open = None
            events = self._content(self.text[self._done:])
        return events, self.content, self.calls

    def _content(self, text: str) -> list[tuple]:
        if not text or self.calls or self._open is not None:
            return []
        self.content += text
        return [("content", text)]

    def _hermes(self) -> list[tuple]:
        events: list[tuple] = []
        while True:
            if self._open is None:
                start = self.text.find(HERMES_OPEN, self._done)
                if start < 0:
                    cut = len(self.text) - _partial_suffix(self.text, HERMES_OPEN, self._done)
                    events += self._content(self.text[self._done:cut])
                    self._done = max(self._done, cut)
                    return events
                events += self._content(self.text[self._done:start].rstrip())
                self._done, self._open = start, {"start": start + len(HERMES_OPEN), "sent": None}
            events += self._call_events()
            if self._open is not None:
                return events

    def _call_events(self) -> list[tuple]:
        """Events of the open call: its name once known, then its arguments as they come
        (holding back a tail of closing braces and spaces: one brace is the call's own)."""
        assert self._open is not None
        events: list[tuple] = []
        body_start, index = self._open["start"], len(self.calls)
        end = self.text.find(HERMES_CLOSE, body_start)
        body = self.text[body_start:end if end >= 0 else len(self.text)]
        head = re.match(r'\s*\{\s*"name"\s*:\s*"([^"]+)"\s*,\s*"arguments"\s*:\s*', body)
        if head and self._open["sent"] is None and head.group(1) in {t.name for t in self.tools}:
            call = ToolCall(call_id(), head.group(1), "")
            events.append(("call", index, call))
            self._open.update(sent=0, call=call, args=head.end())
        if self._open["sent"] is not None:
            arguments = body[self._open["args"]:]
            if end >= 0:  # the whole call: its arguments end before its own closing brace
                arguments = arguments.rstrip()[:-1].rstrip()
            else:  # neither a tail that may begin "</tool_call>" nor the braces before it
                arguments = arguments[:len(arguments) - _partial_suffix(arguments, HERMES_CLOSE, 0)]
                arguments = arguments.rstrip("} \t\r\n")
            if len(arguments) > self._open["sent"]:
                events.append(("arguments", index, arguments[self._open["sent"]:]))
                self._open["sent"] = len(arguments)
            if end >= 0:
                self.calls.append(dataclasses.replace(self._open["call"], arguments=arguments))
        if end >= 0:
            self._done, self._open = end + len(HERMES_CLOSE), None
        return events


def _partial_suffix(text: str, marker: str, start: int) -> int:
    """The length of the longest suffix of text[start:] that is a proper prefix of `marker`."""
    for length in range(min(len(marker) - 1, len(text) - start), 0, -1):
        if marker.startswith(text[len(text) - length:]):
            return length
    return 0


def check_tool_request(fmt: CallFormat | None, tools: tuple[Tool, ...], choice: ToolChoice) -> None:
    if tools and choice.mode != "none" and fmt is None:
        raise UsageError("this model's chat template shows no tool calls, so it cannot be offered tools "
                         "(docs/api.md, \"Tool calls\", lists the formats understood)")


def tools_grammar(fmt: CallFormat, tools: tuple[Tool, ...], choice: ToolChoice, parallel: bool) -> str | None:
    """The grammar a reply must follow: the calls' (one named function, or any tool)
    when a call is required, else none (the model chooses)."""
    if choice.mode != "required":
        return None
    chosen = tuple(t for t in tools if t.name == choice.name) if choice.name else tools
    return fmt.calls_grammar(chosen, parallel and choice.name is None)


def template_messages(messages: list) -> list:
    """Messages as chat templates read them: a tool call's arguments as an object
    (OpenAI sends a JSON string; templates write `arguments | tojson`)."""
    out = []
    for message in messages:
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        if calls:
            fixed = []
            for call in calls:
                function = call.get("function") if isinstance(call, dict) else None
                if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                    raise UsageError("each tool call of a message needs a function with a name")
                arguments = function.get("arguments", {})
                if isinstance(arguments, str):
                    try:
                        arguments = json.loads(arguments or "{}")
                    except ValueError:
                        raise UsageError(f"the arguments of tool call {function['name']!r} are not JSON") from None
                fixed.append(dict(call, function=dict(function, arguments=arguments)))
            message = dict(message, tool_calls=fixed)
        out.append(message)
    return out
