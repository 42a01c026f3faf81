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
        messages_to_ids(Words(), [{"role": "robot", "content": "x"}])
    with pytest.raises(UsageError, match="no chat template"):  # a tool's result needs a template to be read
        messages_to_ids(Words(), [{"role": "tool", "content": "x"}])


# -- the CompuShare extension "private" ------------------------------------------------

@pytest.mark.parametrize("value", ['"yes"', "1", "0", "[]", "{}", '"true"'])
def test_private_must_be_a_boolean(client, value):
    body = '{"messages": [{"role": "user", "content": "hi"}], "private": ' + value + "}"
    error = _error(client.post("/v1/chat/completions", content=body.encode(), headers=AUTH), 400)
    assert error["param"] == "private" and "'private' must be a boolean" in error["message"]
    assert error["type"] == "invalid_request_error"


class FakeModel:
    num_blocks = 4


class WordTokenizer:
    """Token i reads " w{i}"; a text's words are its tokens' ids."""

    chat_template = None
    eos_token_id = 0

    def __len__(self) -> int:
        return 1000

    def decode(self, ids, skip_special_tokens=True):
        return "".join(f" w{i}" for i in ids)

    def encode(self, text, add_special_tokens=False):
        return [len(word) for word in text.split()]


ROUTE_PEERS = (("12D3KooWAlpha", 0, 3), ("12D3KooWBeta", 3, 4))


class FakeConsumer:
    """Generates tokens 7, 9, 11, ... through the real Produced (stop sequences,
    log-probabilities, finish reasons), on a fixed two-hop route."""

    model = FakeModel()
    tokenizer = WordTokenizer()

    def __init__(self) -> None:
        from compushare.net.view import SwarmView

        self.requests = []
        self.view = SwarmView()

    def load_adapter(self, path):
        return path

    async def generate(self, request, *, on_piece=lambda _p: None, on_route=lambda _r: None):
        from compushare.net.records import ServerRecord
        from compushare.pipeline.client.consumer import RunOutcome
        from compushare.pipeline.client.produced import Produced
        from compushare.pipeline.client.routing import Hop
        from compushare.pipeline.client.sampling import TokenLogprob

        self.requests.append(request)
        route = [Hop(ServerRecord(peer, "ab" * 32, start, end, "float32", ("/ip4/127.0.0.1/tcp/1",), 2e9, 1),
                     start, end) for peer, start, end in ROUTE_PEERS]
        on_route(route)
        produced = Produced(self.tokenizer, lambda _t: None, lambda _t: None, stops=request.stop, on_piece=on_piece)
        for token in range(7, 7 + 2 * request.params.max_new_tokens, 2):
            if request.logprobs is not None:
                produced.score([TokenLogprob(token, -0.25, ((token, -0.25), (1, -2.0))[:request.logprobs])])
            produced.add(token)
            if produced.stopped():
                break
        produced.finish()
        stats = {"projections": 56, "keys_sent": 2, "bytes_sent": 10} if request.private else None
        return RunOutcome(tokens=produced.tokens, text=produced.text(), route=route, first_token_s=1.0,
                          decode_tok_s=0.5, private=stats, logprobs=produced.logprobs,
                          finish_reason=produced.finish_reason(request.params.max_new_tokens))


class FakeEngine(ChatEngine):
    """The real ChatEngine (it builds the RunRequest) on a consumer that records it."""

    def __init__(self) -> None:
        super().__init__(None, None, None, torrent=None, default_model="tiny")
        self.the_consumer = FakeConsumer()

    def models(self):
        return [("tiny", "ab" * 32)]

    async def consumer(self, name):
        if name not in ("tiny", "ab" * 32):
            from compushare.errors import ModelUnavailable

            raise ModelUnavailable(f"unknown model {name!r}")
        return self.the_consumer


@pytest.fixture
def fake():
    engine = FakeEngine()
    with TestClient(build_app(engine, "secret-token", Toggle()), backend="trio") as test_client:
        yield engine, test_client


@pytest.mark.parametrize("private", [None, False, True])
def test_private_reaches_the_run_request_and_the_reply_says_what_ran_encrypted(fake, private):
    engine, client = fake
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    if private is not None:
        body["private"] = private
    reply = client.post("/v1/chat/completions", json=body, headers=AUTH)
    assert reply.status_code == 200, reply.text
    reply = reply.json()
    (request,) = engine.the_consumer.requests
    assert request.private is bool(private) and request.prompt == [len("user:"), len("hi"), len("assistant:")]
    assert reply["choices"][0]["message"]["content"] == " w7 w9 w11 w13 w15 w17 w19 w21"
    if not private:
        assert "compushare" not in reply  # a plain reply stays exactly OpenAI's
        return
    ext = reply["compushare"]
    assert ext["private"] is True and ext["num_layers"] == 4 and ext["encrypted_layers"] == 4
    assert ext["route"] == [
        {"peer_id": "12D3KooWAlpha", "layers": [0, 3], "encrypted": ["q", "k", "v", "o", "gate", "up", "down"]},
        {"peer_id": "12D3KooWBeta", "layers": [3, 4], "encrypted": ["q", "k", "v", "o", "gate", "up", "down"]}]
    assert {"norms", "attention", "kv_cache", "lm_head"} <= set(ext["local"])
    assert ext["stats"] == {"projections": 56, "keys_sent": 2, "bytes_sent": 10}
    assert ext["summary"][-1] == "4 of 4 layers x 7 projections encrypted; none in plaintext"


def test_private_streaming_reply_has_the_extension_in_its_last_chunk(fake):
    import json

    engine, client = fake
    response = client.post("/v1/chat/completions", headers=AUTH, json={
        "messages": [{"role": "user", "content": "hi"}], "stream": True, "private": True})
    assert response.status_code == 200
    events = [line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == " w7 w9" + "".join(
        f" w{i}" for i in range(11, 7 + 2 * 256, 2))
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert [c for c in chunks if "compushare" in c] == [chunks[-1]]
    assert [hop["layers"] for hop in chunks[-1]["compushare"]["route"]] == [[0, 3], [3, 4]]
    assert engine.the_consumer.requests[0].private is True


# -- the CompuShare extension "adapter" ------------------------------------------------

def test_an_adapter_is_named_in_the_adapters_folder_never_by_path(fake, tmp_path):
    """A request names an adapter in <data dir>/adapters (a PEFT directory or a
    .safetensors file): an unknown name, or anything path-like, is a 400."""
    engine, client = fake
    engine.data_dir = tmp_path
    (tmp_path / "adapters" / "style").mkdir(parents=True)
    (tmp_path / "adapters" / "terse.safetensors").write_bytes(b"")
    (tmp_path / "secret.safetensors").write_bytes(b"")
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    for name, found in (("style", "adapters/style"), ("terse", "adapters/terse.safetensors"),
                        ("terse.safetensors", "adapters/terse.safetensors")):
        assert client.post("/v1/chat/completions", json=body | {"adapter": name}, headers=AUTH).status_code == 200
        assert engine.the_consumer.requests[-1].adapter == tmp_path / found
    for name in ("nope", "../secret", "../secret.safetensors", str(tmp_path / "secret.safetensors"), ".", "..",
                 "adapters/style", ""):
        error = _error(client.post("/v1/chat/completions", json=body | {"adapter": name}, headers=AUTH), 400)
        assert "unknown adapter" in error["message"], name
    error = _error(client.post("/v1/chat/completions", json=body | {"adapter": 5}, headers=AUTH), 400)
    assert error["param"] == "adapter"
    client.post("/v1/chat/completions", json=body, headers=AUTH)
    assert engine.the_consumer.requests[-1].adapter is None


# -- stop, logprobs, usage, completions, the route: through the real Produced ----------

def _events(response) -> list:
    import json

    events = [line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_stop_cuts_the_reply_before_the_sequence_streaming_or_not(fake):
    _, client = fake
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stop": ["1 w1", "zzz"]}
    reply = client.post("/v1/chat/completions", json=body, headers=AUTH).json()
    assert reply["choices"][0]["message"]["content"] == " w7 w9 w1"  # " w11 w13": "1 w1" spans two tokens
    assert reply["choices"][0]["finish_reason"] == "stop" and reply["usage"]["completion_tokens"] == 4
    chunks = _events(client.post("/v1/chat/completions", json=body | {"stream": True}, headers=AUTH))
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == " w7 w9 w1"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_logprobs_and_usage_in_openai_shapes(fake):
    _, client = fake
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "logprobs": True, "top_logprobs": 2}
    reply = client.post("/v1/chat/completions", json=body, headers=AUTH).json()
    content = reply["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == [" w7", " w9", " w11"] and content[0]["logprob"] == -0.25
    assert content[0]["bytes"] == list(b" w7") and [t["token"] for t in content[0]["top_logprobs"]] == [" w7", " w1"]
    chunks = _events(client.post("/v1/chat/completions", headers=AUTH, json=body | {
        "stream": True, "stream_options": {"include_usage": True}}))
    scored = [c for c in chunks if c["choices"] and c["choices"][0]["logprobs"]]
    assert [c["choices"][0]["logprobs"]["content"][0]["token"] for c in scored] == [" w7", " w9", " w11"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
    assert all(c["usage"] is None for c in chunks[:-1])


def test_text_completions_legacy_shape(fake):
    engine, client = fake
    reply = client.post("/v1/completions", headers=AUTH, json={"prompt": "abc de", "max_tokens": 2, "logprobs": 1})
    assert reply.status_code == 200, reply.text
    reply = reply.json()
    assert reply["object"] == "text_completion" and reply["id"].startswith("cmpl-")
    assert engine.the_consumer.requests[-1].prompt == [3, 2]  # the text as it is: no template
    choice = reply["choices"][0]
    assert choice["text"] == " w7 w9" and choice["finish_reason"] == "length"
    assert choice["logprobs"] == {"tokens": [" w7", " w9"], "token_logprobs": [-0.25, -0.25],
                                  "top_logprobs": [{" w7": -0.25}, {" w9": -0.25}], "text_offset": [0, 3]}
    chunks = _events(client.post("/v1/completions", headers=AUTH, json={"prompt": [5, 6], "max_tokens": 2,
                                                                         "stream": True}))
    assert "".join(c["choices"][0]["text"] for c in chunks) == " w7 w9"
    assert engine.the_consumer.requests[-1].prompt == [5, 6]
    assert _error(client.post("/v1/completions", headers=AUTH, json={"prompt": [5, 5000]}), 400)["param"] == "prompt"


def test_the_route_extension_names_each_hop_streaming_and_not(fake):
    _, client = fake
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "route": True, "standby": True}
    reply = client.post("/v1/chat/completions", json=body, headers=AUTH).json()
    route = reply["compushare"]["route"]
    assert [(h["peer_id"], h["start"], h["end"], h["private"]) for h in route] == [
        ("12D3KooWAlpha", 0, 3, False), ("12D3KooWBeta", 3, 4, False)]
    assert route[0]["reach"] == "unknown" and route[0]["relayed"] is False
    assert reply["compushare"]["stats"]["tokens"] == 2 and reply["compushare"]["stats"]["first_token_s"] == 1.0
    chunks = _events(client.post("/v1/chat/completions", json=body | {"stream": True}, headers=AUTH))
    routed = [c for c in chunks if c["choices"] == []]
    assert len(routed) == 1 and [h["peer_id"] for h in routed[0]["compushare"]["route"]] == [
        "12D3KooWAlpha", "12D3KooWBeta"]
    assert chunks[-1]["compushare"]["stats"]["tokens"] == 2


def test_ollama_chat_and_generate_streamed_and_not(fake):
    import json

    engine, client = fake
    messages = [{"role": "user", "content": "hi"}]
    body = {"model": "tiny", "messages": messages, "stream": False, "options": {"num_predict": 3, "stop": [" w11"]}}
    reply = client.post("/api/chat", json=body, headers=AUTH).json()
    assert reply["message"] == {"role": "assistant", "content": " w7 w9"} and reply["done"] is True
    assert reply["done_reason"] == "stop" and reply["eval_count"] == 3 and reply["prompt_eval_count"] == 3
    lines = client.post("/api/chat", json=body | {"stream": None}, headers=AUTH).text.splitlines()  # default: stream
    parts = [json.loads(line) for line in lines]
    assert "".join(p["message"]["content"] for p in parts) == " w7 w9"
    assert [p["done"] for p in parts] == [False] * (len(parts) - 1) + [True]
    generated = client.post("/api/generate", headers=AUTH, json={
        "model": "tiny", "prompt": "hi", "system": "terse", "stream": False, "options": {"num_predict": 2}}).json()
    assert generated["response"] == " w7 w9" and generated["done_reason"] == "length"
    assert engine.the_consumer.requests[-1].prompt == [len("system:"), len("terse"), len("user:"), len("hi"),
                                                       len("assistant:")]
    raw = client.post("/api/generate", headers=AUTH, json={"model": "tiny", "prompt": "abc", "raw": True,
                                                           "stream": False, "options": {"num_predict": 1}})
    assert raw.json()["response"] == " w7" and engine.the_consumer.requests[-1].prompt == [3]
    loaded = client.post("/api/generate", headers=AUTH, json={"model": "tiny"}).json()
    assert loaded["done"] is True and loaded["done_reason"] == "load"
    refused = client.post("/api/chat", headers=AUTH, json=body | {"tools": [{"type": "function"}]})
    assert refused.status_code == 400 and "tools" in refused.json()["error"]


def test_ollama_models_and_the_open_setting(tmp_path, tiny_model):
    import_path(tiny_model, tmp_path, alias="tiny")
    engine = ChatEngine(None, None, tmp_path, torrent=None, default_model="tiny")
    for open_locally in (False, True):
        app = build_app(engine, "secret-token", Toggle(), ollama_open=open_locally)
        with TestClient(app, backend="trio", client=("127.0.0.1", 50000)) as local:
            tags = local.get("/api/tags")
            assert tags.status_code == (200 if open_locally else 401)
            assert local.get("/v1/models").status_code == 401  # OpenAI's routes always need the token
            tags = local.get("/api/tags", headers=AUTH).json()["models"]
            assert [m["name"] for m in tags] == ["tiny"] and tags[0]["details"]["family"] == "llama"
            shown = local.post("/api/show", headers=AUTH, json={"model": "tiny"}).json()
            assert shown["model_info"]["llama.block_count"] == 4
            assert local.post("/api/show", headers=AUTH, json={"model": "nope"}).status_code == 404
            assert local.get("/api/version", headers=AUTH).json()["version"]
        with TestClient(app, backend="trio", client=("10.0.0.5", 50000)) as remote:
            assert remote.get("/api/tags").status_code == 401  # never open to another machine


def test_control_models_lists_stored_models_with_their_adapters(tmp_path, tiny_model):
    import torch

    from compushare.model import adapter_file
    from compushare.model.lora import Adapter, LoraSpec

    stored = import_path(tiny_model, tmp_path, alias="tiny")
    (tmp_path / "adapters").mkdir()
    spec = LoraSpec(rank=2, alpha=4, targets=("q_proj",))
    tensors = {"model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(2, 64),
               "model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(64, 2)}
    adapter_file.save(Adapter(spec, tensors, stored.model_id), tmp_path / "adapters" / "mine.safetensors")
    adapter_file.save(Adapter(spec, tensors, "cd" * 32), tmp_path / "adapters" / "other.safetensors")
    engine = ChatEngine(None, None, tmp_path, torrent=None, default_model="tiny")
    with TestClient(build_app(engine, "secret-token", Toggle()), backend="trio") as client:
        listed = client.get("/control/models", headers=AUTH).json()
    assert listed["default"] == "tiny"
    (model,) = listed["models"]
    assert model["name"] == "tiny" and model["id"] == stored.model_id and model["stored"] is True
    assert model["adapters"] == ["mine"] and model["num_blocks"] == 4 and model["served"] is False


def test_static_files_are_only_the_packages(client):
    for name in ("..%2Fapp.py", ".hidden", "nope.js"):
        assert client.get(f"/static/{name}").status_code == 404
