"""The local HTTP API's edges, without a swarm: the token, OpenAI-shaped errors for
bad requests, the model list and the control status. (Generations through a real
swarm: tests/slow/test_smollm2.py, with the official `openai` package.)"""

import pytest
from starlette.testclient import TestClient

from compushare.app.api.app import build_app
from compushare.app.api.auth import TOKEN_FILE, bearer_ok, load_or_create_token
from compushare.app.api.engine import ChatEngine
from compushare.model.catalog import import_path

AUTH = {"authorization": "Bearer secret-token"}


class Toggle:
    """A control with a state to pause and resume (the node's is tested end to end)."""

    def __init__(self) -> None:
        self.state = "serving"

    def status(self) -> dict:
        return {"peer_id": "me", "state": self.state, "karma": {"score": 1.0}}

    def dashboard(self) -> dict:
        return {"node": self.status(), "peers": [], "models": {}, "downloads": []}

    def pause(self) -> bool:
        changed, self.state = self.state == "serving", "paused"
        return changed

    def resume(self) -> bool:
        changed, self.state = self.state == "paused", "serving"
        return changed


@pytest.fixture
def client(tmp_path, tiny_model):
    import_path(tiny_model, tmp_path, alias="tiny")
    engine = ChatEngine(None, None, tmp_path, torrent=None, default_model="tiny")  # never generates here
    app = build_app(engine, "secret-token", Toggle())
    with TestClient(app, backend="trio") as test_client:
        yield test_client


def _error(response, status):
    assert response.status_code == status
    body = response.json()["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["message"]
    return body


def test_every_route_needs_the_token(client):
    for method, path in [("get", "/v1/models"), ("post", "/v1/chat/completions"), ("get", "/control/status"),
                         ("get", "/control/dashboard"), ("post", "/control/pause"), ("post", "/control/resume")]:
        assert _error(getattr(client, method)(path), 401)["code"] == "invalid_api_key"
        assert _error(getattr(client, method)(path, headers={"authorization": "Bearer nope"}), 401)
    assert not bearer_ok("Basic secret-token", "secret-token") and bearer_ok("Bearer secret-token", "secret-token")


def test_models_and_status(client):
    models = client.get("/v1/models", headers=AUTH).json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["tiny"]
    assert client.get("/control/status", headers=AUTH).json()["karma"] == {"score": 1.0}
    assert client.post("/control/pause", headers=AUTH).json() == {"changed": True, "state": "paused"}
    assert client.post("/control/pause", headers=AUTH).json() == {"changed": False, "state": "paused"}
    assert client.post("/control/resume", headers=AUTH).json() == {"changed": True, "state": "serving"}
    page = client.get("/dashboard")  # the page holds no data: no token needed for it
    assert page.status_code == 200 and "/control/dashboard" in page.text and "textContent" in page.text
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


@pytest.mark.parametrize("stream", [False, True])
def test_unknown_model_is_a_404_streaming_or_not(client, stream):
    """Checked before any reply starts: the official client raises NotFoundError."""
    response = client.post("/v1/chat/completions", headers=AUTH, json={
        "model": "no-such-model", "stream": stream, "messages": [{"role": "user", "content": "hi"}]})
    assert _error(response, 404)["code"] == "model_not_found"


def test_messages_accept_text_parts_and_the_developer_role():
    from compushare.app.api.engine import messages_to_ids
    from compushare.errors import UsageError

    class Words:  # a tokenizer without a chat template: the plain transcript is encoded
        chat_template = None

        def encode(self, text):
            return text.split()

    ids = messages_to_ids(Words(), [{"role": "developer", "content": "be brief"},
                                    {"role": "user", "content": [{"type": "text", "text": "hi"},
                                                                 {"type": "text", "text": " there"}]}])
    assert ids == ["system:", "be", "brief", "user:", "hi", "there", "assistant:"]
    with pytest.raises(UsageError, match="text content"):
        messages_to_ids(Words(), [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])
    with pytest.raises(UsageError, match="role"):
        messages_to_ids(Words(), [{"role": "tool", "content": "x"}])
