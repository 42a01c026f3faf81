"""`compushare chat` without a swarm: the REPL's commands and state, and that a
private turn asks for a private generation and shows its route. (Through real
node processes and a terminal: tests/integration/test_chat.py; with SmolLM2:
tests/slow/test_smollm2.py.)"""

import io

import pytest
import trio

from compushare.app import chat
from compushare.app.chat import HELP, Conversation, SwarmThread
from compushare.errors import UsageError
from compushare.net.records import ServerRecord
from compushare.pipeline.client.consumer import RunOutcome
from compushare.pipeline.client.routing import Hop


def _hop(peer: str, start: int, end: int) -> Hop:
    return Hop(ServerRecord(peer, "ab" * 32, start, end, "float32", ("/ip4/127.0.0.1/tcp/1",), 2e9, 1), start, end)


ROUTE = [_hop("12D3KooWAlpha", 0, 2), _hop("12D3KooWBeta", 2, 4)]
STATS = {"encrypt_s": 1.0, "decrypt_s": 0.5, "roundtrip_s": 3.0, "provider_s": 2.0, "local_s": 0.2, "products": 16,
         "projections": 28, "bytes_sent": 2_000_000, "bytes_received": 4_000_000, "keys_bytes": 9_000_000,
         "keys_sent": 2}


def test_private_command_toggles_the_mode_and_says_it_is_slow():
    conversation = Conversation("tiny")
    assert not conversation.private
    assert conversation.command("/private") == "private mode: off (providers compute on plaintext activations)"
    shown = conversation.command("/private on")
    assert conversation.private and "private mode: on" in shown and "seconds per token" in shown
    assert "private mode: on" in conversation.command("/private")  # alone: shows, changes nothing
    assert conversation.private
    conversation.command("/model other")  # a new conversation keeps the mode
    assert conversation.private
    assert "off" in conversation.command("/private   off  ") and not conversation.private
    for wrong in ("/private yes", "/private 1", "/private on off"):
        with pytest.raises(UsageError, match="on or off"):
            conversation.command(wrong)
    assert not conversation.private
    assert "/private on|off" in HELP and "seconds per token" in HELP


def test_stats_of_a_private_reply_show_where_its_time_went():
    conversation = Conversation("tiny")
    conversation.last = RunOutcome(tokens=[5, 6], text="w5 w6", route=ROUTE, first_token_s=4.0, decode_tok_s=0.3,
                                   private=STATS)
    shown = conversation.stats()
    assert "route (2 hops)" in shown and "12D3KooWBeta blocks 2:4" in shown
    assert "private: 28 encrypted projections; 2.0 MB sent, 4.0 MB received" in shown
    conversation.last = RunOutcome(tokens=[5], text="w5", route=ROUTE, first_token_s=0.1, decode_tok_s=0.0)
    assert "private:" not in conversation.stats()


class Words:
    """A tokenizer without a chat template (the plain transcript is encoded)."""

    chat_template = None

    def encode(self, text):
        return [len(word) for word in text.split()]


class RecordingConsumer:
    tokenizer = Words()

    def __init__(self) -> None:
        self.requests = []

    async def generate(self, request, *, on_text, on_route):
        self.requests.append(request)
        on_route(ROUTE)
        on_text("hi")
        return RunOutcome(tokens=[7], text="hi", route=ROUTE, first_token_s=0.1, decode_tok_s=0.0,
                          private=STATS if request.private else None)


@pytest.mark.parametrize("private", [False, True])
async def test_swarm_thread_asks_for_a_private_generation_when_the_mode_is_on(tmp_path, private):
    swarm = SwarmThread(tmp_path, (), 0.0)
    swarm._lock = trio.Lock()
    consumer = swarm._consumers["tiny"] = RecordingConsumer()
    routes = []
    outcome = await swarm._generate("tiny", [{"role": "user", "content": "hello there"}], Conversation("tiny").params(),
                                    private, lambda _t: None, routes.append)
    (request,) = consumer.requests
    assert request.private is private and request.chat_template is False
    assert request.prompt == Words().encode("user: hello there\nassistant:")
    assert routes == [ROUTE] and (outcome.private is not None) is private


class FakeSwarm:
    """SwarmThread's interface, answering at once."""

    def __init__(self, *_args) -> None:
        self.asked: list[bool] = []

    def start(self, model: str) -> None:
        pass

    def generate(self, conversation, on_text, on_route):
        self.asked.append(conversation.private)
        on_route(ROUTE)
        on_text("fine")
        return RunOutcome(tokens=[1], text="fine", route=ROUTE, first_token_s=0.1, decode_tok_s=0.0,
                          private=STATS if conversation.private else None)

    def close(self) -> None:
        pass


def test_repl_shows_the_route_of_private_turns_only(tmp_path, monkeypatch):
    swarms = []
    monkeypatch.setattr(chat, "SwarmThread", lambda *args: swarms.append(FakeSwarm()) or swarms[-1])
    lines = iter(["hello", "/private on", "secret question", "/private off", "bye"])

    def fake_input(_prompt):
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr("builtins.input", fake_input)
    out, err = io.StringIO(), io.StringIO()
    assert chat.repl(tmp_path, (), "tiny", temperature=0.0, max_tokens=8, spot_check_rate=0.0, out=out,
                     err=err) == 0
    assert swarms[0].asked == [False, True, False]
    shown = err.getvalue()
    assert shown.count("[private turn: private turns are much slower: expect seconds per token]") == 1
    assert shown.count("private mode: this machine keeps the prompt") == 1  # describe_private_route, once
    assert "hop 1: 12D3KooWAlpha layers 0:2: q, k, v, o, gate, up, down projections encrypted" in shown
    assert "hop 2: 12D3KooWBeta layers 2:4" in shown
    assert "4 of 4 layers x 7 projections encrypted; none in plaintext" in shown
    assert "private mode: on" in out.getvalue() and out.getvalue().count("fine") == 3


def test_repl_started_private_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(chat, "SwarmThread", FakeSwarm)
    monkeypatch.setattr("builtins.input", lambda _p: (_ for _ in ()).throw(EOFError))
    err = io.StringIO()
    assert chat.repl(tmp_path, (), "tiny", temperature=0.0, max_tokens=8, spot_check_rate=0.0, private=True,
                     out=io.StringIO(), err=err) == 0
    assert "private mode: on" in err.getvalue() and "seconds per token" in err.getvalue()
