"""Bad input to a real node process gets a clear error reply; other sessions go on."""

import os

import pytest
import torch
import trio

from compushare.net.codec import LENGTH
from compushare.net.tensors import encode_tensor
from compushare.net.framing import FramedStream
from compushare.net.host import open_host, parse_peer_addr
from compushare.pipeline.protocol import INFER_PROTOCOL
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.network.stream.exceptions import StreamError

HIDDEN = 64
IDLE_TIMEOUT_S = 1.5


@pytest.fixture
def tiny_node(processes, tiny_model):
    extra = ["--kv-budget", "64", "--idle-timeout", str(IDLE_TIMEOUT_S)]
    _, state = processes.node("server", tiny_model, "0:4", extra=extra)
    return state


async def _connect(state):
    info = parse_peer_addr(state["addrs"][0])

    async def open_stream(host):
        stream = await host.new_stream(info.peer_id, [INFER_PROTOCOL])
        return FramedStream(stream, 1 << 26)

    return info, open_stream


async def _call(framed, message):
    with trio.fail_after(10):
        await framed.send(message)
        return await framed.receive()


def _open(session, max_tokens=16, model=None, state=None):
    return {"type": "open", "session": session, "model": model or state["model_id"], "start": 0, "end": 4,
            "max_tokens": max_tokens}


def _step(session, position, tokens=1, dtype=torch.float32):
    return {"type": "step", "session": session, "position": position,
            "hidden": encode_tensor(torch.randn(1, tokens, HIDDEN).to(dtype))}


class Honest:
    """A well-behaved session on its own stream, stepped between bad inputs."""

    def __init__(self, framed, state):
        self.framed, self.state, self.session, self.position = framed, state, os.urandom(16), 0

    async def open(self):
        assert (await _call(self.framed, _open(self.session, 32, state=self.state)))["type"] == "opened"

    async def step(self):
        reply = await _call(self.framed, _step(self.session, self.position))
        assert reply["type"] == "result", reply
        assert reply["position"] == self.position
        self.position += 1


async def test_bad_frames_get_error_replies_and_server_keeps_serving(tiny_node):
    info, open_stream = await _connect(tiny_node)
    async with open_host(create_new_key_pair(), ["/ip4/127.0.0.1/tcp/0"]) as host:
        await host.connect(info)
        honest = Honest(await open_stream(host), tiny_node)
        await honest.open()
        await honest.step()

        bad = await open_stream(host)
        session = os.urandom(16)
        assert (await _call(bad, _open(session, state=tiny_node)))["type"] == "opened"

        # dtype off the whitelist
        message = _step(session, 0)
        message["hidden"]["dtype"] = "float64"
        reply = await _call(bad, message)
        assert (reply["type"], reply["code"]) == ("error", "bad_dtype")
        await honest.step()

        # shape that disagrees with the byte length
        message = _step(session, 0, tokens=2)
        message["hidden"]["shape"] = [1, 3, HIDDEN]
        reply = await _call(bad, message)
        assert (reply["type"], reply["code"]) == ("error", "bad_shape")
        assert "bytes" in reply["message"]
        await honest.step()

        # step for an unknown session
        reply = await _call(bad, _step(os.urandom(16), 0))
        assert (reply["type"], reply["code"]) == ("error", "unknown_session")
        await honest.step()

        # out-of-order step: skips ahead, then a stale replay of position 0
        assert (await _call(bad, _step(session, 0)))["type"] == "result"
        reply = await _call(bad, _step(session, 5))
        assert (reply["type"], reply["code"]) == ("error", "out_of_order")
        reply = await _call(bad, _step(session, 0))
        assert (reply["type"], reply["code"]) == ("error", "out_of_order")
        assert (await _call(bad, _step(session, 1)))["type"] == "result"  # the right one still works
        await honest.step()

        # NaN is refused before it reaches torch
        message = _step(session, 2)
        message["hidden"] = encode_tensor(torch.full((1, 1, HIDDEN), float("nan")))
        reply = await _call(bad, message)
        assert (reply["type"], reply["code"]) == ("error", "non_finite")

        # garbage that is not msgpack
        with trio.fail_after(10):
            await bad.stream.write(LENGTH.pack(3) + b"\xc1\xc1\xc1")
            reply = await bad.receive()
        assert (reply["type"], reply["code"]) == ("error", "bad_frame")
        await honest.step()

        # oversized frame: a clear error, then that stream is closed
        huge = await open_stream(host)
        with trio.fail_after(10):
            await huge.stream.write(LENGTH.pack(1 << 30) + b"x" * 1024)
            reply = await huge.receive()
        assert (reply["type"], reply["code"]) == ("error", "frame_too_large")
        with pytest.raises((StreamError, trio.TooSlowError)):
            with trio.fail_after(5):
                for _ in range(3):
                    await huge.send(_step(session, 2))
                    if await huge.receive() is None:
                        raise StreamError("closed")
        await honest.step()
        assert honest.position == 7


async def test_full_kv_budget_is_busy_and_idle_session_expires(tiny_node):
    info, open_stream = await _connect(tiny_node)
    async with open_host(create_new_key_pair(), ["/ip4/127.0.0.1/tcp/0"]) as host:
        await host.connect(info)
        framed = await open_stream(host)
        first, opened_at = os.urandom(16), trio.current_time()
        assert (await _call(framed, _open(first, 48, state=tiny_node)))["type"] == "opened"
        reply = await _call(framed, _open(os.urandom(16), 32, state=tiny_node))
        assert (reply["type"], reply["code"]) == ("error", "busy")
        assert "KV budget" in reply["message"]

        # Idle for longer than --idle-timeout: the session and its cache are dropped,
        # which frees the budget: a new session is refused as busy until then (polled
        # without touching the first one, which a step would keep alive).
        second = os.urandom(16)
        with trio.fail_after(60):
            while (reply := await _call(framed, _open(second, 48, state=tiny_node)))["type"] != "opened":
                assert reply["code"] == "busy"
                await trio.sleep(0.1)
        assert trio.current_time() - opened_at >= IDLE_TIMEOUT_S - 0.1  # not before its time
        reply = await _call(framed, _step(first, 0))
        assert (reply["type"], reply["code"]) == ("error", "unknown_session")
        assert (await _call(framed, _step(second, 0)))["type"] == "result"


async def test_wrong_model_and_bad_span_rejected(tiny_node):
    info, open_stream = await _connect(tiny_node)
    async with open_host(create_new_key_pair(), ["/ip4/127.0.0.1/tcp/0"]) as host:
        await host.connect(info)
        framed = await open_stream(host)
        reply = await _call(framed, _open(os.urandom(16), model="f" * 64, state=tiny_node))
        assert reply["code"] == "wrong_model"
        message = _open(os.urandom(16), state=tiny_node) | {"end": 9}
        assert (await _call(framed, message))["code"] == "bad_span"
