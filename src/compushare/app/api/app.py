"""The ASGI app: OpenAI's chat API (the subset tools use) and the control API.

Every route needs `Authorization: Bearer <token>` (OpenAI clients send their
api_key so). Errors have OpenAI's shape: {"error": {"message", "type", "param",
"code"}}. Streaming replies are server-sent events of `chat.completion.chunk`
objects, then `data: [DONE]`.

CompuShare extension: `"private": true` in a chat completion request runs it in
private mode (providers see only CKKS ciphertexts; much slower); the reply (the
last chunk, when streaming) then has a `compushare` object saying which stages ran
encrypted on which peer (engine.private_report).
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import trio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from ...errors import CompushareError, ModelUnavailable, RouteError, SwarmUnreachable, UsageError
from ...pipeline.client.sampling import SamplingParams
from .auth import bearer_ok
from .dashboard import DASHBOARD_HTML
from .engine import ChatEngine, private_report

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 1 << 20
MAX_NEW_TOKENS = 4096
DEFAULT_NEW_TOKENS = 256


def error(status: int, message: str, kind: str = "invalid_request_error", code: str | None = None,
          param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status)


def _failure(exc: BaseException) -> JSONResponse:
    """A generation's failure, as OpenAI-style JSON with a fitting status."""
    if isinstance(exc, ModelUnavailable):
        return error(404, str(exc), code="model_not_found", param="model")
    if isinstance(exc, UsageError):
        return error(400, str(exc))
    if isinstance(exc, (RouteError, SwarmUnreachable)):
        return error(503, f"the swarm cannot serve this model now: {exc}", "server_error", "unavailable")
    if isinstance(exc, CompushareError):
        return error(502, str(exc), "server_error", "swarm_error")
    log.exception("chat completion failed", exc_info=exc)
    return error(500, "internal error (see the node's log)", "server_error")


class BadField(UsageError):
    """A request field with a wrong value: a 400 naming the field (OpenAI's `param`)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def _private(body: dict) -> bool:
    """The CompuShare extension `private` (absent or null: false)."""
    value = body.get("private")
    if value is None:
        return False
    if not isinstance(value, bool):
        raise BadField("private", f"'private' must be a boolean (true or false), not {type(value).__name__} "
                                  f"{json.dumps(value)[:40]}")
    return value


def _adapter(body: dict) -> str | None:
    """The CompuShare extension `adapter`: the name of an adapter in the node's
    adapters folder (engine.adapter_path), or absent / null."""
    value = body.get("adapter")
    if value is not None and not isinstance(value, str):
        raise BadField("adapter", "'adapter' must be the name of an adapter in this node's adapters folder")
    return value


def _params(body: dict) -> SamplingParams:
    def number(name: str, default: float, low: float, high: float) -> float:
        value = body.get(name, default)
        if value is None:
            return default
        if not isinstance(value, int | float) or isinstance(value, bool) or not low <= value <= high:
            raise UsageError(f"'{name}' must be a number within {low}..{high}")
        return float(value)

    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    if limit is None:
        limit = DEFAULT_NEW_TOKENS
    if not isinstance(limit, int) or isinstance(limit, bool) or not 1 <= limit <= MAX_NEW_TOKENS:
        raise UsageError(f"'max_tokens' must be an integer within 1..{MAX_NEW_TOKENS}")
    seed = body.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise UsageError("'seed' must be an integer")
    top_p = number("top_p", 1.0, 0.0, 1.0)
    return SamplingParams(temperature=number("temperature", 0.0, 0.0, 2.0), top_p=top_p if top_p > 0 else 1e-6,
                          seed=seed, max_new_tokens=limit)


class Control(Protocol):
    """What the daemon offers its control API (node.py implements it)."""

    def status(self) -> dict: ...
    def dashboard(self) -> dict: ...
    def pause(self) -> bool: ...
    def resume(self) -> bool: ...


class _Raw(Response):
    """A response that is a plain ASGI callable (it sends its own messages)."""

    def __init__(self, app) -> None:
        self._app = app

    async def __call__(self, scope, receive, send) -> None:
        await self._app(scope, receive, send)


async def _cancel_on_disconnect(receive, scope: trio.CancelScope) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()


async def until_disconnect(receive, work):
    """Run `work`; None if the client disconnected first (then `work` is cancelled)."""
    result = None
    async with trio.open_nursery() as nursery:
        async def run() -> None:
            nonlocal result
            result = await work
            nursery.cancel_scope.cancel()

        nursery.start_soon(run)
        nursery.start_soon(_cancel_on_disconnect, receive, nursery.cancel_scope)
    return result


async def _read_json(request: Request) -> dict:
    raw = await request.body()
    if len(raw) > MAX_BODY_BYTES:
        raise UsageError(f"request body over {MAX_BODY_BYTES} bytes")
    try:
        body = json.loads(raw)
    except ValueError:
        raise UsageError("the request body is not JSON") from None
    if not isinstance(body, dict):
        raise UsageError("the request body must be a JSON object")
    return body


class _Completion:
    """One chat completion, prepared (its model found, its prompt tokenized): run to
    one JSON reply or streamed as server-sent events."""

    def __init__(self, engine: ChatEngine, consumer, prompt: list[int], model: str, params: SamplingParams,
                 private: bool, created: int, adapter: Path | None = None) -> None:
        self.engine, self.consumer, self.prompt, self.model = engine, consumer, prompt, model
        self.params, self.private, self.created, self.adapter = params, private, created, adapter
        self.ident = f"chatcmpl-{secrets.token_hex(12)}"

    def run(self, on_text: Callable[[str], None] = lambda _t: None):
        return self.engine.run(self.consumer, self.model, self.prompt, self.params, on_text, private=self.private,
                               adapter=self.adapter)

    def finish(self, outcome) -> str:
        return "length" if len(outcome.tokens) >= self.params.max_new_tokens else "stop"

    def extension(self, outcome) -> dict:  # CompuShare's own fields of a reply: only for private requests
        return {"compushare": private_report(outcome, self.consumer.model.num_blocks)} if self.private else {}

    def reply(self, outcome) -> dict:
        return {
            "id": self.ident, "object": "chat.completion", "created": self.created, "model": self.model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": outcome.text},
                         "finish_reason": self.finish(outcome)}],
            "usage": {"prompt_tokens": len(self.prompt), "completion_tokens": len(outcome.tokens),
                      "total_tokens": len(self.prompt) + len(outcome.tokens)},
            **self.extension(outcome),
        }

    def chunk(self, delta: dict, reason: str | None = None, extra: dict | None = None) -> bytes:
        return ("data: " + json.dumps({"id": self.ident, "object": "chat.completion.chunk", "created": self.created,
                                       "model": self.model, "choices": [{"index": 0, "delta": delta,
                                                                         "finish_reason": reason}],
                                       **(extra or {})}) + "\n\n").encode()

    async def _produce(self, to_client: trio.MemorySendChannel[bytes]) -> None:
        async with to_client:
            to_client.send_nowait(self.chunk({"role": "assistant", "content": ""}))
            try:
                outcome = await self.run(on_text=lambda text: to_client.send_nowait(self.chunk({"content": text})))
                to_client.send_nowait(self.chunk({}, self.finish(outcome), self.extension(outcome)))
            except Exception as exc:  # the status line is sent already: the error goes in the stream
                to_client.send_nowait(("data: " + _failure(exc).body.decode() + "\n\n").encode())
            to_client.send_nowait(b"data: [DONE]\n\n")

    async def stream(self, scope, receive, send) -> None:
        """Server-sent events as the tokens come. The generation, the sender and a
        watcher for the client's disconnect share one nursery: a client that leaves
        ends the generation (and closes its sessions), never the other way round."""
        # Room for every token: a slow reader must not make the generation's callback block.
        to_client, pending = trio.open_memory_channel[bytes](MAX_NEW_TOKENS + 4)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream; charset=utf-8"),
                                (b"cache-control", b"no-cache")]})
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_cancel_on_disconnect, receive, nursery.cancel_scope)
            nursery.start_soon(self._produce, to_client)
            try:
                async with pending:
                    async for data in pending:
                        await send({"type": "http.response.body", "body": data, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            except Exception as exc:  # the client went away mid-send (Hypercorn's error types vary)
                log.debug("stream ended early: %r", exc)
            nursery.cancel_scope.cancel()  # the watcher


async def chat_completions(engine: ChatEngine, request: Request) -> Response:
    try:
        body = await _read_json(request)
        model = body.get("model") or engine.default_model
        if not isinstance(model, str):
            raise UsageError("'model' must be a string")
        params = _params(body)
        private = _private(body)
        adapter = _adapter(body)
        messages = body.get("messages")
    except UsageError as exc:
        return error(400, str(exc), param=getattr(exc, "param", None))
    created = int(time.time())
    try:  # before any reply: a bad model or bad messages get their proper status, streaming or not
        consumer, prompt, adapter_file = await engine.prepare(model, messages, adapter)
    except Exception as exc:
        return _failure(exc)
    completion = _Completion(engine, consumer, prompt, model, params, private, created, adapter_file)
    if body.get("stream"):
        return _Raw(completion.stream)
    try:
        outcome = await until_disconnect(request.receive, completion.run())
    except Exception as exc:
        return _failure(exc)
    if outcome is None:  # the client left: nothing to answer
        return Response(status_code=499)
    return JSONResponse(completion.reply(outcome))


def build_app(engine: ChatEngine, token: str, control: Control) -> Starlette:
    def guarded(handler):
        """`handler` for requests with the node's token; a 401 for others."""
        async def route(request: Request):
            if not bearer_ok(request.headers.get("authorization"), token):
                return error(401, "missing or wrong API key: use the token in the node's data dir (api.token)",
                             code="invalid_api_key")
            return await handler(request)

        return route

    async def models(request: Request):
        data = [{"id": name, "object": "model", "created": 0, "owned_by": "compushare", "model_id": model_id}
                for name, model_id in engine.models()]
        return JSONResponse({"object": "list", "data": data})

    async def control_status(request: Request):
        return JSONResponse(control.status())

    async def control_dashboard(request: Request):
        return JSONResponse(control.dashboard())

    async def control_pause(request: Request):
        changed = control.pause() if request.url.path.endswith("/pause") else control.resume()
        return JSONResponse({"changed": changed, "state": control.status().get("state")})

    async def completions(request: Request):
        return await chat_completions(engine, request)

    async def dashboard_page(request: Request):
        # The page itself holds no data; its script asks /control/dashboard with the
        # token from the URL's fragment (never sent to a server, never in a log).
        return HTMLResponse(DASHBOARD_HTML)

    async def not_found(request: Request, exc):
        return error(404, f"no route {request.url.path}", code="not_found")

    return Starlette(routes=[
        Route("/v1/models", guarded(models)),
        Route("/v1/chat/completions", guarded(completions), methods=["POST"]),
        Route("/control/status", guarded(control_status)),
        Route("/control/dashboard", guarded(control_dashboard)),
        Route("/control/pause", guarded(control_pause), methods=["POST"]),
        Route("/control/resume", guarded(control_pause), methods=["POST"]),
        Route("/dashboard", dashboard_page),
    ], exception_handlers={404: not_found})
