"""Ollama's API on the node's API port: /api/version, /api/tags, /api/show, /api/ps,
/api/chat and /api/generate (NDJSON lines when streaming, the default; one object
otherwise), with the models as CompuShare names them. Errors are Ollama's
{"error": "..."} with a fitting status. Ollama's clients (and the official `ollama`
Python package) work unchanged, sending the node's token as `Authorization: Bearer`
(OLLAMA_API_KEY), or without one where the node's `api_ollama_open` allows it.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import time

import trio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ... import __version__
from ...errors import ModelUnavailable
from ...model.catalog import resolve_model
from ...pipeline.client.consumer import RunOutcome
from ...pipeline.client.produced import Piece
from ...pipeline.client.sampling import TokenLogprob
from .engine import ChatEngine, Prepared, reply_extension, token_text
from .openai_routes import failure, read_json
from .requests import OLLAMA_DEFAULT_TAG, BadField, Generation, ollama_chat, ollama_generate
from .streaming import answer
from .tools import CallStream, ToolCall, call_format


def ollama_error(exc: BaseException) -> JSONResponse:
    """OpenAI's failure() status and message, in Ollama's shape."""
    response = failure(exc)
    return JSONResponse({"error": json.loads(response.body)["error"]["message"]}, response.status_code)


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat().replace("+00:00", "Z")


def parameter_count(config: dict) -> int:
    """A decoder's parameters from its configuration (embeddings, attention, MLP, head)."""
    hidden, layers = int(config["hidden_size"]), int(config["num_hidden_layers"])
    heads = int(config.get("num_attention_heads", 1))
    head_dim = int(config.get("head_dim") or hidden // heads)
    kv = int(config.get("num_key_value_heads") or heads)
    embed = int(config.get("vocab_size", 0)) * hidden
    attention = hidden * head_dim * (2 * heads + 2 * kv)
    mlp = 3 * hidden * int(config.get("intermediate_size", 4 * hidden))
    return embed * (1 if config.get("tie_word_embeddings") else 2) + layers * (attention + mlp)


def _details(model) -> dict:
    """Ollama's `details` of a stored model."""
    family = str(model.manifest.config.get("model_type", ""))
    return {"parent_model": "", "format": model.format.label, "family": family, "families": [family],
            "parameter_size": _size_label(parameter_count(model.manifest.config)),
            "quantization_level": model.format.label.upper()}


def _size_label(count: int) -> str:
    return f"{count / 1e9:.1f}B" if count >= 1e9 else f"{count / 1e6:.0f}M" if count else ""


class OllamaReply:
    def __init__(self, engine: ChatEngine, prepared: Prepared, gen: Generation) -> None:
        self.engine, self.prepared, self.gen = engine, prepared, gen
        self.chat = gen.messages is not None
        self.began = time.perf_counter_ns()

    def run(self, on_piece=lambda _p: None):
        return self.engine.run(self.prepared, self.gen, on_piece)

    def logprobs(self, scored: list[TokenLogprob]) -> dict:
        if self.gen.logprobs is None:
            return {}
        tokenizer = self.prepared.consumer.tokenizer
        return {"logprobs": [{"token": token_text(tokenizer, s.token), "logprob": s.logprob,
                              "top_logprobs": [{"token": token_text(tokenizer, t), "logprob": lp}
                                               for t, lp in s.top]} for s in scored]}

    def message(self, text: str, scored: list[TokenLogprob], done: bool, calls: list[ToolCall] = (),
                first_call: int = 0) -> dict:
        body: dict = {"model": self.prepared.model, "created_at": _now()}
        if self.chat:
            body["message"] = {"role": "assistant", "content": text}
            if calls:
                body["message"]["tool_calls"] = [call.ollama(first_call + i) for i, call in enumerate(calls)]
        else:
            body["response"] = text
        return {**body, "done": done, **self.logprobs(scored)}

    def body(self, outcome: RunOutcome) -> dict:
        """The whole reply, not streamed."""
        text, calls = outcome.text, []
        if self.prepared.calls is not None:
            text, calls = self.prepared.calls.parse(outcome.text, self.gen.shape.tools)
        return self.final(outcome, text, outcome.logprobs, calls)

    def final(self, outcome: RunOutcome, text: str, scored: list[TokenLogprob], calls: list[ToolCall] = ()) -> dict:
        total = time.perf_counter_ns() - self.began
        first = int(outcome.first_token_s * 1e9)
        body = dict(self.message(text, scored, True, calls),
                    done_reason=outcome.finish_reason, total_duration=total, load_duration=0,
                    prompt_eval_count=len(self.prepared.prompt), prompt_eval_duration=first,
                    eval_count=len(outcome.tokens), eval_duration=max(0, total - first))
        return body | reply_extension(self.prepared, self.gen, outcome)

    async def produce(self, to_client: trio.MemorySendChannel[bytes]) -> None:
        stream = None if self.prepared.calls is None else CallStream(self.prepared.calls, self.gen.shape.tools)
        sent = 0  # calls handed out: Ollama streams each call whole, once complete

        def send(events: list[tuple], scored: list[TokenLogprob]) -> None:
            nonlocal sent
            text = "".join(event[1] for event in events if event[0] == "content")
            calls = stream.calls[sent:] if stream is not None else []
            if text or calls or scored:
                to_client.send_nowait(_line(self.message(text, scored, False, calls, sent)))
            sent += len(calls)

        def on_piece(piece: Piece) -> None:
            scored = [piece.logprob] if piece.logprob else []
            if stream is not None:
                send(stream.feed(piece.text), scored)
            elif piece.text or piece.logprob is not None:
                to_client.send_nowait(_line(self.message(piece.text, scored, False)))

        try:
            outcome = await self.run(on_piece)
            if stream is not None:
                send(stream.finish()[0], [])
            to_client.send_nowait(_line(self.final(outcome, "", [])))
        except Exception as exc:  # the status line is sent already: the error goes in the stream
            to_client.send_nowait(ollama_error(exc).body + b"\n")


def _line(obj: dict) -> bytes:
    return (json.dumps(obj) + "\n").encode()


async def generate(engine: ChatEngine, request: Request) -> Response:
    """POST /api/chat and /api/generate."""
    parse = ollama_chat if request.url.path.endswith("/chat") else ollama_generate
    try:
        gen = parse(await read_json(request))
        if gen.messages == [] or (gen.messages is None and not gen.prompt):
            # Ollama's way to load a model: an empty request answers done at once.
            await engine.consumer(gen.model or engine.default_model)
            return JSONResponse(dict(_loaded(gen), done_reason="load"))
        reply = OllamaReply(engine, await engine.prepare(gen), gen)
    except Exception as exc:
        return ollama_error(exc)
    return await answer(request, reply, stream=gen.stream, media_type="application/x-ndjson", fail=ollama_error)


def _loaded(gen: Generation) -> dict:
    """The answer to a request with nothing to generate (Ollama's "load the model")."""
    body: dict = {"model": gen.model, "created_at": _now(), "done": True}
    if gen.messages is not None:
        body["message"] = {"role": "assistant", "content": ""}
    else:
        body["response"] = ""
    return body


def _listed(engine: ChatEngine) -> list[dict]:
    models = []
    for name, model_id in engine.models():
        model = resolve_model(model_id, engine.data_dir, obtain=False)
        modified = datetime.datetime.fromtimestamp(model.path.stat().st_mtime, datetime.UTC)
        size = model.manifest.total_bytes
        models.append({"name": name, "model": name, "modified_at": modified.isoformat(), "size": size,
                       "digest": model_id, "details": _details(model)})
    return models


async def tags(engine: ChatEngine, request: Request) -> Response:
    return JSONResponse({"models": await trio.to_thread.run_sync(_listed, engine)})


async def show(engine: ChatEngine, request: Request) -> Response:
    try:
        body = await read_json(request)
        name = body.get("model") or body.get("name") if isinstance(body, dict) else None
        if not isinstance(name, str) or not name:
            raise BadField("model", "'model' is required")
        name = name.removesuffix(OLLAMA_DEFAULT_TAG)
        model = await trio.to_thread.run_sync(lambda: resolve_model(name, engine.data_dir, obtain=False))
    except ModelUnavailable as exc:
        return JSONResponse({"error": f"model '{name}' not found: {exc}"}, 404)
    except Exception as exc:
        return ollama_error(exc)
    config = model.manifest.config
    arch = str(config.get("model_type", ""))
    info = {"general.architecture": arch, "general.parameter_count": parameter_count(config),
            f"{arch}.block_count": model.num_blocks, f"{arch}.embedding_length": config["hidden_size"],
            f"{arch}.context_length": config.get("max_position_embeddings", 0), "compushare.model_id": model.model_id}
    template = ""
    with contextlib.suppress(OSError, ValueError):
        template = json.loads((model.path / "tokenizer_config.json").read_text()).get("chat_template") or ""
    with contextlib.suppress(OSError):  # transformers 5 keeps it in a file of its own
        template = template or (model.path / "chat_template.jinja").read_text()
    return JSONResponse({"modelfile": f"# served by CompuShare: model {model.model_id}\n", "parameters": "",
                         "template": template if isinstance(template, str) else "", "details": _details(model),
                         "model_info": info, "capabilities": _capabilities(template),
                         "modified_at": _now()})


def _capabilities(template: object) -> list[str]:
    """Ollama's capabilities of a model: "tools" where its template shows tool calls."""
    return ["completion"] + (["tools"] if isinstance(template, str) and call_format(template) else [])


async def version(engine: ChatEngine, request: Request) -> Response:
    return JSONResponse({"version": __version__})


async def running(engine: ChatEngine, request: Request) -> Response:
    """/api/ps: the models this node's API has loaded (their heads and tokenizers)."""
    models = [{"name": name, "model": name, "digest": model_id, "size": 0, "size_vram": 0,
               "expires_at": "0001-01-01T00:00:00Z", "details": {}}
              for name, model_id in engine.models() if model_id in engine.loaded()]
    return JSONResponse({"models": models})
