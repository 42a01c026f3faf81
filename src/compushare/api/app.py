"""The ASGI app: OpenAI's chat API (the subset tools use) and the control API.

Every route needs `Authorization: Bearer <token>` (OpenAI clients send their
api_key so). Errors have OpenAI's shape: {"error": {"message", "type", "param",
"code"}}. Streaming replies are server-sent events of `chat.completion.chunk`
objects, then `data: [DONE]`.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from typing import Protocol

import trio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, StreamingResponse
from starlette.routing import Route

from ..errors import CompushareError, ModelUnavailable, RouteError, SwarmUnreachable, UsageError
from ..pipeline.sampling import SamplingParams
from .auth import bearer_ok
from .dashboard import DASHBOARD_HTML
from .engine import ChatEngine

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


def build_app(engine: ChatEngine, token: str, control: Control) -> Starlette:
    def authorized(request: Request) -> JSONResponse | None:
        if bearer_ok(request.headers.get("authorization"), token):
            return None
        return error(401, "missing or wrong API key: use the token in the node's data dir (api.token)",
                     code="invalid_api_key")

    async def read_json(request: Request) -> dict:
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

    async def models(request: Request):
        if (denied := authorized(request)) is not None:
            return denied
        data = [{"id": name, "object": "model", "created": 0, "owned_by": "compushare", "model_id": model_id}
                for name, model_id in engine.models()]
        return JSONResponse({"object": "list", "data": data})

    async def control_status(request: Request):
        if (denied := authorized(request)) is not None:
            return denied
        return JSONResponse(control.status())

    async def control_dashboard(request: Request):
        if (denied := authorized(request)) is not None:
            return denied
        return JSONResponse(control.dashboard())

    async def control_pause(request: Request):
        if (denied := authorized(request)) is not None:
            return denied
        changed = control.pause() if request.url.path.endswith("/pause") else control.resume()
        return JSONResponse({"changed": changed, "state": control.status().get("state")})

    async def dashboard_page(request: Request):
        # The page itself holds no data; its script asks /control/dashboard with the
        # token from the URL's fragment (never sent to a server, never in a log).
        return HTMLResponse(DASHBOARD_HTML)

    async def chat_completions(request: Request):
        if (denied := authorized(request)) is not None:
            return denied
        try:
            body = await read_json(request)
            model = body.get("model") or engine.default_model
            if not isinstance(model, str):
                raise UsageError("'model' must be a string")
            params = _params(body)
            messages = body.get("messages")
        except UsageError as exc:
            return error(400, str(exc))
        ident, created = f"chatcmpl-{secrets.token_hex(12)}", int(time.time())

        def finish(outcome) -> str:
            return "length" if len(outcome.tokens) >= params.max_new_tokens else "stop"

        if not body.get("stream"):
            try:
                outcome, prompt_tokens = await engine.chat(model, messages, params)
            except Exception as exc:
                return _failure(exc)
            return JSONResponse({
                "id": ident, "object": "chat.completion", "created": created, "model": model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": outcome.text},
                             "finish_reason": finish(outcome)}],
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(outcome.tokens),
                          "total_tokens": prompt_tokens + len(outcome.tokens)},
            })

        # Room for every token: a slow reader must not make the generation's callback block.
        send, receive = trio.open_memory_channel[tuple[str, object]](MAX_NEW_TOKENS + 2)

        def chunk(delta: dict, reason: str | None = None) -> str:
            return "data: " + json.dumps({"id": ident, "object": "chat.completion.chunk", "created": created,
                                          "model": model, "choices": [{"index": 0, "delta": delta,
                                                                       "finish_reason": reason}]}) + "\n\n"

        async def produce() -> None:
            async with send:
                try:
                    outcome, _ = await engine.chat(model, messages, params,
                                                   on_text=lambda text: send.send_nowait(("text", text)))
                    await send.send(("done", outcome))
                except Exception as exc:  # reported in the stream: the status line is sent already
                    await send.send(("error", exc))

        async def events():
            yield chunk({"role": "assistant", "content": ""})
            async with trio.open_nursery() as nursery:
                nursery.start_soon(produce)
                async with receive:
                    async for kind, value in receive:
                        if kind == "text":
                            yield chunk({"content": value})
                        elif kind == "done":
                            yield chunk({}, finish(value))
                        else:
                            payload = json.loads(_failure(value).body)
                            yield "data: " + json.dumps(payload) + "\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def not_found(request: Request, exc):
        return error(404, f"no route {request.url.path}", code="not_found")

    return Starlette(routes=[
        Route("/v1/models", models),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/control/status", control_status),
        Route("/control/dashboard", control_dashboard),
        Route("/control/pause", control_pause, methods=["POST"]),
        Route("/control/resume", control_pause, methods=["POST"]),
        Route("/dashboard", dashboard_page),
    ], exception_handlers={404: not_found})
