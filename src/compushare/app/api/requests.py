"""What the generation endpoints accept, sans I/O: every request field of OpenAI's
chat and text completions and of Ollama's chat and generate, each accepted, ignored
(with the reason) or refused, as data (FIELDS, which docs/api.md shows and a test
holds to this code), and the parsers that turn a JSON body into one `Generation`.

A bad value, or a refused field set to anything but its neutral value, raises
BadField naming the field, before any model is loaded or any peer asked. Fields not
in the table are refused by the OpenAI endpoints (as OpenAI does) and ignored by the
Ollama ones (as Ollama does).
"""

from __future__ import annotations

import dataclasses
import math

from ...pipeline.client.sampling import MAX_TOP_LOGPROBS, SamplingParams
from ...pipeline.client.stops import MAX_STOP_CHARS, MAX_STOPS
from .structured import BadField, Shape, ollama_shape, openai_shape

MAX_NEW_TOKENS = 4096
DEFAULT_NEW_TOKENS = 256  # OpenAI endpoints without max_tokens
MAX_LEGACY_LOGPROBS = 5  # /v1/completions' integer `logprobs`
OLLAMA_TEMPERATURE, OLLAMA_TOP_P = 0.8, 0.9  # Ollama's defaults, for clients that rely on them
OLLAMA_DEFAULT_TAG = ":latest"  # Ollama's clients add it to a bare name; CompuShare's names have no tags


@dataclasses.dataclass(frozen=True)
class Field:
    name: str
    handling: str  # "accepted", "ignored" or "refused"
    note: str  # what it does; why it is ignored; which values are refused


def _table(*rows: tuple[str, str, str]) -> tuple[Field, ...]:
    return tuple(Field(*row) for row in rows)


_EXTENSIONS = (
    ("private", "accepted", "CompuShare: true runs every remote layer on CKKS ciphertexts (much slower)"),
    ("standby", "accepted", "CompuShare: true keeps a standby replica per span, fed every step"),
    ("fast_replay", "accepted", "CompuShare: true replays a failover's history in few forwards (within tolerance)"),
    ("adapter", "accepted", "CompuShare: a LoRA adapter's name in the data dir's adapters/ folder"),
    ("route", "accepted", "CompuShare: true adds the route (hops, spans, peers) and timings to the reply"),
)
_OPENAI_COMMON = (
    ("model", "accepted", "a name as `compushare models` shows it, or a model id; default: the node's model"),
    ("stream", "accepted", "server-sent events of chunks, then [DONE]"),
    ("stream_options", "accepted", "include_usage: a last chunk with usage; only with stream"),
    ("max_tokens", "accepted", f"1..{MAX_NEW_TOKENS}; default {DEFAULT_NEW_TOKENS}"),
    ("temperature", "accepted", "0..2; default 0 (greedy, reproducible)"),
    ("top_p", "accepted", "0..1; default 1"),
    ("seed", "accepted", "an integer: the same seed, prompt and route give the same sample"),
    ("stop", "accepted", f"a string or up to {MAX_STOPS} strings of up to {MAX_STOP_CHARS} characters; "
                         "found across token boundaries, never returned"),
    ("n", "refused", "anything but 1: one choice per request"),
    ("user", "ignored", "no accounts: every request comes with the node's own token"),
    ("frequency_penalty", "refused", "anything but 0: no penalties are applied"),
    ("presence_penalty", "refused", "anything but 0: no penalties are applied"),
    ("logit_bias", "refused", "anything but empty: logits are not biased"),
)
_TOOLS = (
    ("tools", "accepted", "functions the model may call, shown to it by its chat template (Qwen2.5/Qwen3/Hermes "
                          "<tool_call> or Llama 3.x JSON); calls come back as tool_calls"),
    ("tool_choice", "accepted", "\"auto\" (default with tools), \"none\", \"required\" or a named function: "
                                "the last two enforced by a grammar, valid against the parameters' schema"),
    ("parallel_tool_calls", "accepted", "default true: several calls in one reply; false: one"),
    ("functions", "refused", "anything but empty: the deprecated form of tools"),
    ("function_call", "refused", "anything but \"none\": the deprecated form of tool_choice"),
)
OPENAI_CHAT = _table(
    *_OPENAI_COMMON,
    ("messages", "accepted", "system/developer, user, assistant (with tool_calls) and tool messages; text content "
                             "or text parts"),
    ("max_completion_tokens", "accepted", "the same as max_tokens (it wins when both are given)"),
    ("logprobs", "accepted", "true: each token's log-probability under the model (temperature 1)"),
    ("top_logprobs", "accepted", f"0..{MAX_TOP_LOGPROBS} likeliest tokens per position; needs logprobs"),
    ("response_format", "accepted", "json_object, or json_schema (strict or not): a grammar makes the reply valid "
                                    "JSON, against the schema"),
    *_TOOLS,
    ("modalities", "refused", "anything but [\"text\"]: text only"),
    ("audio", "refused", "any value: text only"),
    ("prediction", "refused", "any value: drafts come from the prompt (speculative decoding) already"),
    ("web_search_options", "refused", "any value: no web search"),
    ("reasoning_effort", "ignored", "the models served do not take it"),
    ("verbosity", "ignored", "the models served do not take it"),
    ("store", "ignored", "nothing is stored"),
    ("metadata", "ignored", "nothing is stored"),
    ("service_tier", "ignored", "one tier: the swarm"),
    ("prompt_cache_key", "ignored", "prompts are not cached across requests"),
    ("safety_identifier", "ignored", "no accounts"),
    *_EXTENSIONS,
)
OPENAI_COMPLETIONS = _table(
    *_OPENAI_COMMON,
    ("prompt", "accepted", "a string, or token ids; one prompt per request (a list of one is fine)"),
    ("logprobs", "accepted", f"0..{MAX_LEGACY_LOGPROBS}: tokens, their log-probabilities and that many "
                             "alternatives"),
    ("echo", "refused", "true: the prompt is not repeated in the reply"),
    ("suffix", "refused", "anything but empty: no fill-in-the-middle"),
    ("best_of", "refused", "anything but 1: one choice per request"),
    *_EXTENSIONS,
)
_OLLAMA_COMMON = (
    ("model", "accepted", "a name as `compushare models` shows it (\":latest\" dropped), or a model id"),
    ("stream", "accepted", "default true: NDJSON objects, the last with done: true and the counts"),
    ("options", "accepted", "see the options table"),
    ("format", "accepted", "\"json\" (an object) or a JSON schema: a grammar makes the reply valid against it"),
    ("keep_alive", "ignored", "a model stays ready while the node runs"),
    ("think", "refused", "true (or a level): the models served do not think aloud"),
    ("logprobs", "accepted", "true: each token's log-probability"),
    ("top_logprobs", "accepted", f"0..{MAX_TOP_LOGPROBS} likeliest tokens per position"),
    *_EXTENSIONS,
)
OLLAMA_CHAT = _table(
    *_OLLAMA_COMMON,
    ("messages", "accepted", "system, user, assistant (with tool_calls) and tool messages (text; no images)"),
    ("tools", "accepted", "functions the model may call (as OpenAI's tools); calls come back as message.tool_calls"),
)
OLLAMA_GENERATE = _table(
    *_OLLAMA_COMMON,
    ("prompt", "accepted", "the text, put through the model's chat template unless raw"),
    ("system", "accepted", "a system message before the prompt"),
    ("raw", "accepted", "true: the prompt is sent as it is, without the template"),
    ("suffix", "refused", "anything but empty: no fill-in-the-middle"),
    ("template", "refused", "anything but empty: the model's own chat template is used"),
    ("context", "refused", "anything but empty: send the conversation with /api/chat instead"),
    ("images", "refused", "anything but empty: text only"),
    ("width", "refused", "any value: no image generation"),
    ("height", "refused", "any value: no image generation"),
    ("steps", "refused", "any value: no image generation"),
)
_IGNORED_OPTION = "sampling here is temperature and top-p only"
_IGNORED_RUNTIME = "the providers' runtimes choose this themselves"
OLLAMA_OPTIONS = _table(
    ("temperature", "accepted", f"0..2; default {OLLAMA_TEMPERATURE}"),
    ("top_p", "accepted", f"0..1; default {OLLAMA_TOP_P}"),
    ("num_predict", "accepted", f"1..{MAX_NEW_TOKENS}, or -1 / -2 for up to {MAX_NEW_TOKENS}; the default"),
    ("stop", "accepted", f"up to {MAX_STOPS} strings, found across token boundaries, never returned"),
    ("seed", "accepted", "an integer: the same seed, prompt and route give the same sample"),
    *((name, "ignored", _IGNORED_OPTION) for name in (
        "top_k", "min_p", "typical_p", "tfs_z", "repeat_last_n", "repeat_penalty", "presence_penalty",
        "frequency_penalty", "penalize_newline", "mirostat", "mirostat_tau", "mirostat_eta")),
    ("num_ctx", "ignored", "the context is the model's own length"),
    ("num_keep", "ignored", "the context is never shifted"),
    *((name, "ignored", _IGNORED_RUNTIME) for name in (
        "num_batch", "num_gpu", "main_gpu", "num_thread", "numa", "low_vram", "f16_kv", "vocab_only", "use_mmap",
        "use_mlock")),
)
FIELDS: dict[str, tuple[Field, ...]] = {
    "POST /v1/chat/completions": OPENAI_CHAT,
    "POST /v1/completions": OPENAI_COMPLETIONS,
    "POST /api/chat": OLLAMA_CHAT,
    "POST /api/generate": OLLAMA_GENERATE,
    "options (Ollama)": OLLAMA_OPTIONS,
}

# A refused field may be sent with its neutral value (clients often send defaults).
_NEUTRAL: dict[str, tuple[object, ...]] = {
    "n": (1,), "best_of": (1,), "frequency_penalty": (0, 0.0), "presence_penalty": (0, 0.0), "logit_bias": ({},),
    "functions": ([],), "function_call": ("none",), "modalities": (["text"],), "echo": (False,), "suffix": ("",),
    "think": (False,), "template": ("",), "context": ([],), "images": ([],),
}


@dataclasses.dataclass(frozen=True)
class Generation:
    """One generation request, checked."""

    api: str  # a key of FIELDS
    model: str | None
    params: SamplingParams
    messages: list | None = None  # chat endpoints (checked against the template later)
    prompt: str | list[int] | None = None  # completion endpoints
    system: str | None = None  # Ollama generate
    raw: bool = False  # Ollama generate: the prompt without the template
    stop: tuple[str, ...] = ()
    logprobs: int | None = None  # None: not asked; else how many alternatives per token
    stream: bool = False
    include_usage: bool = False
    private: bool = False
    standby: bool = False
    fast_replay: bool = False
    adapter: str | None = None
    route: bool = False
    shape: Shape = Shape()  # a JSON schema, tools (structured.py)


def _number(body: dict, name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value) \
            or not low <= value <= high:
        raise BadField(name, f"'{name}' must be a number within {low:g}..{high:g}")
    return float(value)


def _integer(body: dict, name: str, low: int, high: int, default: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise BadField(name, f"'{name}' must be an integer within {low}..{high}")
    return value


def _flag(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadField(name, f"'{name}' must be a boolean (true or false), not {type(value).__name__}")
    return value


def _string(body: dict, name: str, default: str | None = None) -> str | None:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, str):
        raise BadField(name, f"'{name}' must be a string")
    return value


def _stops(value: object, name: str = "stop") -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or len(stops) > MAX_STOPS or not all(
            isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stops):
        raise BadField(name, f"'{name}' must be a string or a list of up to {MAX_STOPS} non-empty strings of up "
                             f"to {MAX_STOP_CHARS} characters")
    return tuple(stops)


def _screen(body: object, api: str, *, unknown_refused: bool) -> dict:
    """The body as a dict whose refused fields hold only neutral values."""
    if not isinstance(body, dict):
        raise BadField(None, "the request body must be a JSON object")
    known = {f.name: f for f in FIELDS[api]}
    for name, value in body.items():
        field = known.get(name)
        if field is None:
            if unknown_refused:
                raise BadField(name, f"unrecognized request argument: '{name}' (docs/api.md lists the fields)")
        elif field.handling == "refused" and value is not None and value not in _NEUTRAL.get(name, ()):
            raise BadField(name, f"'{name}' is not supported: {field.note}")
    return body


def _extensions(body: dict) -> dict:
    adapter = body.get("adapter")
    if adapter is not None and not isinstance(adapter, str):
        raise BadField("adapter", "'adapter' must be the name of an adapter in this node's adapters folder")
    return {"private": _flag(body, "private"), "standby": _flag(body, "standby"),
            "fast_replay": _flag(body, "fast_replay"), "adapter": adapter, "route": _flag(body, "route")}


def _openai_common(body: dict, limit_name: str = "max_tokens") -> dict:
    model = _string(body, "model")
    limit = _integer(body, limit_name, 1, MAX_NEW_TOKENS) or _integer(body, "max_tokens", 1, MAX_NEW_TOKENS) \
        or DEFAULT_NEW_TOKENS
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    params = SamplingParams(temperature=_number(body, "temperature", 0.0, 0.0, 2.0), top_p=max(top_p, 1e-6),
                            seed=_integer(body, "seed", -2**63, 2**64 - 1), max_new_tokens=limit)
    stream = _flag(body, "stream")
    options = body.get("stream_options")
    if options is not None and (not stream or not isinstance(options, dict)
                                or set(options) - {"include_usage", "include_obfuscation"}):
        raise BadField("stream_options", "'stream_options' is an object {\"include_usage\": bool}, only with "
                                         "\"stream\": true")
    include_usage = _flag(options or {}, "include_usage")
    return {"model": model, "params": params, "stop": _stops(body.get("stop")), "stream": stream,
            "include_usage": include_usage, **_extensions(body)}


def openai_chat(body: object) -> Generation:
    api = "POST /v1/chat/completions"
    body = _screen(body, api, unknown_refused=True)
    logprobs = _flag(body, "logprobs")
    top = _integer(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if top is not None and not logprobs:
        raise BadField("top_logprobs", "'top_logprobs' needs \"logprobs\": true")
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise BadField("messages", "'messages' must be a list of messages")
    return Generation(api=api, messages=messages, logprobs=(top or 0) if logprobs else None,
                      shape=openai_shape(body), **_openai_common(body, "max_completion_tokens"))


def openai_completion(body: object) -> Generation:
    api = "POST /v1/completions"
    body = _screen(body, api, unknown_refused=True)
    return Generation(api=api, prompt=_one_prompt(body.get("prompt")),
                      logprobs=_integer(body, "logprobs", 0, MAX_LEGACY_LOGPROBS), **_openai_common(body))


def _one_prompt(prompt: object) -> str | list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                   for t in prompt):
        return prompt
    raise BadField("prompt", "'prompt' must be one non-empty string or one list of token ids (one prompt per "
                             "request)")


def _ollama_options(options: object) -> tuple[SamplingParams, tuple[str, ...]]:
    if options is None:
        options = {}
    if not isinstance(options, dict):
        raise BadField("options", "'options' must be an object")
    try:
        limit = _integer(options, "num_predict", -2, MAX_NEW_TOKENS, -1)
        if limit == 0:
            raise BadField("num_predict", f"'num_predict' must be 1..{MAX_NEW_TOKENS}, or -1 or -2 (up to "
                                          f"{MAX_NEW_TOKENS})")
        params = SamplingParams(
            temperature=_number(options, "temperature", OLLAMA_TEMPERATURE, 0.0, 2.0),
            top_p=max(_number(options, "top_p", OLLAMA_TOP_P, 0.0, 1.0), 1e-6),
            seed=_integer(options, "seed", -2**63, 2**64 - 1),
            max_new_tokens=MAX_NEW_TOKENS if limit is None or limit < 1 else limit)
        return params, _stops(options.get("stop"))
    except BadField as exc:  # named as Ollama's clients see them
        raise BadField(f"options.{exc.param}", str(exc).replace(f"'{exc.param}'", f"'options.{exc.param}'")) \
            from None


def _ollama_common(body: dict) -> dict:
    params, stops = _ollama_options(body.get("options"))
    logprobs = _flag(body, "logprobs")
    top = _integer(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    model = _string(body, "model")
    if not model:
        raise BadField("model", "'model' is required")
    return {"model": model.removesuffix(OLLAMA_DEFAULT_TAG), "params": params, "stop": stops,
            "stream": _flag(body, "stream", True),
            "logprobs": (top or 0) if logprobs else None, **_extensions(body)}


def ollama_chat(body: object) -> Generation:
    api = "POST /api/chat"
    body = _screen(body, api, unknown_refused=False)
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise BadField("messages", "'messages' must be a list of messages")
    for message in messages:
        if isinstance(message, dict) and message.get("images"):
            raise BadField("messages", "messages carry text only: no images")
    kept = ("role", "content", "tool_calls", "tool_name")
    clean = [{k: m[k] for k in kept if k in m} if isinstance(m, dict) else m for m in messages]
    return Generation(api=api, messages=clean, shape=ollama_shape(body, chat=True), **_ollama_common(body))


def ollama_generate(body: object) -> Generation:
    api = "POST /api/generate"
    body = _screen(body, api, unknown_refused=False)
    prompt = _string(body, "prompt", "")
    system = _string(body, "system")
    return Generation(api=api, prompt=prompt, system=system, raw=_flag(body, "raw"),
                      shape=ollama_shape(body, chat=False), **_ollama_common(body))
