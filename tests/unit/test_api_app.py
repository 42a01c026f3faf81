"""The local HTTP API's edges, without a swarm: the token, OpenAI-shaped errors for
bad requests, the model list and the control status. (Generations through a real
swarm: tests/slow/test_smollm2.py, with the official `openai` package.)"""

import pytest
from starlette.testclient import TestClient

from compushare.api.app import build_app
from compushare.api.auth import TOKEN_FILE, bearer_ok, load_or_create_token
from compushare.api.engine import ChatEngine
from compushare.model.catalog import import_path

AUTH = {"authorization": "Bearer secret-token"}


@pytest.fixture
def client(tmp_path, tiny_model):
    import_path(tiny_model, tmp_path, alias="tiny")
    engine = ChatEngine(None, None, tmp_path, torrent=None, default_model="tiny")  # never generates here
    app = build_app(engine, "secret-token", lambda: {"peer_id": "me", "karma": {"score": 1.0}})
    with TestClient(app, backend="trio") as test_client:
        yield test_client


def _error(response, status):
    assert response.status_code == status
    body = response.json()["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["message"]
    return body


def test_every_route_needs_the_token(client):
    for method, path in [("get", "/v1/models"), ("post", "/v1/chat/completions"), ("get", "/control/status")]:
        assert _error(getattr(client, method)(path), 401)["code"] == "invalid_api_key"
        assert _error(getattr(client, method)(path, headers={"authorization": "Bearer nope"}), 401)
    assert not bearer_ok("Basic secret-token", "secret-token") and bearer_ok("Bearer secret-token", "secret-token")


def test_models_and_status(client):
    models = client.get("/v1/models", headers=AUTH).json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["tiny"]
    assert client.get("/control/status", headers=AUTH).json() == {"peer_id": "me", "karma": {"score": 1.0}}
    assert _error(client.get("/v1/nothing", headers=AUTH), 404)["code"] == "not_found"


@pytest.mark.parametrize("body, words", [
    (b"not json", "not JSON"),
    (b"[1, 2]", "JSON object"),
    (b'{"messages": [], "max_tokens": 0}', "max_tokens"),
    (b'{"messages": [], "temperature": 9}', "temperature"),
    (b'{"messages": [], "seed": "x"}', "seed"),
    (b'{"model": 5, "messages": []}', "model"),
])
def test_bad_requests_get_openai_shaped_errors(client, body, words):
    response = client.post("/v1/chat/completions", content=body, headers=AUTH)
    assert words in _error(response, 400)["message"]


def test_token_is_made_once_and_private(tmp_path):
    token = load_or_create_token(tmp_path)
    assert len(token) >= 32 and load_or_create_token(tmp_path) == token
    assert (tmp_path / TOKEN_FILE).stat().st_mode & 0o077 == 0
