"""The ASGI app (Starlette): OpenAI's API (openai_routes.py), Ollama's (ollama_routes.py),
the control API, the dashboard and the chat page.

Every data route needs `Authorization: Bearer <token>` (OpenAI's clients send their
api_key so, Ollama's OLLAMA_API_KEY). The pages (/dashboard, /chat) hold no data and
need none: their scripts take the token from the URL's fragment, which a browser
never sends. With `ollama_open` (config `api_ollama_open`, off by default) the
Ollama routes also answer requests without a token, from 127.0.0.1 only, for the
clients that cannot send one: docs/security.md says what that exposes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from . import ollama_routes
from .auth import bearer_ok
from .dashboard import DASHBOARD_HTML
from .engine import ChatEngine
from .openai_routes import complete, error

STATIC_DIR = Path(__file__).parent / "static"  # the chat page's files, shipped in the package
LOOPBACK = ("127.0.0.1", "::1")


class Control(Protocol):
    """What the daemon offers its control API (node.py implements it)."""

    def status(self) -> dict: ...
    def dashboard(self) -> dict: ...
    def pause(self) -> bool: ...
    def resume(self) -> bool: ...


def _unauthorized(request: Request) -> Response:
    if request.url.path.startswith("/api/"):
        return JSONResponse({"error": "missing or wrong API key: send the node's token (api.token in its data "
                                      "dir) as Authorization: Bearer, e.g. OLLAMA_API_KEY"}, 401)
    return error(401, "missing or wrong API key: use the token in the node's data dir (api.token)",
                 code="invalid_api_key")


async def _models(request: Request):
    engine = request.app.state.engine
    data = [{"id": name, "object": "model", "created": 0, "owned_by": "compushare", "model_id": model_id}
            for name, model_id in engine.models()]
    return JSONResponse({"object": "list", "data": data})


async def _control_models(request: Request):
    engine = request.app.state.engine
    return JSONResponse({"default": engine.default_model, "models": engine.swarm_models()})


async def _control_status(request: Request):
    return JSONResponse(request.app.state.control.status())


async def _control_dashboard(request: Request):
    return JSONResponse(request.app.state.control.dashboard())


async def _control_pause(request: Request):
    control = request.app.state.control
    changed = control.pause() if request.url.path.endswith("/pause") else control.resume()
    return JSONResponse({"changed": changed, "state": control.status().get("state")})


async def _dashboard_page(request: Request):
    return HTMLResponse(DASHBOARD_HTML)


async def _chat_page(request: Request):
    return FileResponse(STATIC_DIR / "chat.html", media_type="text/html; charset=utf-8")


async def _static(request: Request):
    name = request.path_params["name"]
    path = STATIC_DIR / name
    if "/" in name or name.startswith(".") or not path.is_file():
        return error(404, f"no file {name[:64]!r}", code="not_found")
    return FileResponse(path)


async def _root(request: Request):
    return Response("CompuShare is running (OpenAI API at /v1, Ollama API at /api, chat page at /chat)\n",
                    media_type="text/plain")


async def _not_found(request: Request, exc):
    if request.url.path.startswith("/api/"):
        return JSONResponse({"error": f"no route {request.url.path}"}, 404)
    return error(404, f"no route {request.url.path}", code="not_found")


def build_app(engine: ChatEngine, token: str, control: Control, *, ollama_open: bool = False) -> Starlette:
    def guarded(handler, *, open_locally: bool = False, with_engine: bool = False):
        """`handler` for requests with the node's token; a 401 for others (except,
        with `open_locally`, requests from this machine)."""
        async def route(request: Request):
            local = open_locally and request.client is not None and request.client.host in LOOPBACK
            if not local and not bearer_ok(request.headers.get("authorization"), token):
                return _unauthorized(request)
            return await (handler(engine, request) if with_engine else handler(request))

        return route

    def ollama(handler):
        return guarded(handler, open_locally=ollama_open, with_engine=True)

    app = Starlette(routes=[
        Route("/v1/models", guarded(_models)),
        Route("/v1/chat/completions", guarded(complete, with_engine=True), methods=["POST"]),
        Route("/v1/completions", guarded(complete, with_engine=True), methods=["POST"]),
        Route("/api/version", ollama(ollama_routes.version)),
        Route("/api/tags", ollama(ollama_routes.tags)),
        Route("/api/ps", ollama(ollama_routes.running)),
        Route("/api/show", ollama(ollama_routes.show), methods=["POST"]),
        Route("/api/chat", ollama(ollama_routes.generate), methods=["POST"]),
        Route("/api/generate", ollama(ollama_routes.generate), methods=["POST"]),
        Route("/control/status", guarded(_control_status)),
        Route("/control/dashboard", guarded(_control_dashboard)),
        Route("/control/models", guarded(_control_models)),
        Route("/control/pause", guarded(_control_pause), methods=["POST"]),
        Route("/control/resume", guarded(_control_pause), methods=["POST"]),
        Route("/dashboard", _dashboard_page),
        Route("/chat", _chat_page),
        Route("/static/{name}", _static),
        Route("/", _root, methods=["GET", "HEAD"]),
    ], exception_handlers={404: _not_found})
    app.state.engine, app.state.control = engine, control
    return app
