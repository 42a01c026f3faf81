"""pipeline/messages.py: every /compushare/infer message survives to_wire -> msgpack ->
decode unchanged, and every malformed field is refused with the code and message
the error reply carries."""

from __future__ import annotations

import os

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID

from compushare.errors import FrameError, PeerMisbehaved
from compushare.net.codec import decode_payload, encode_frame
from compushare.net.tensors import WIRE_DTYPES, decode_tensor, encode_tensor
from compushare.pipeline import messages as m
from compushare.pipeline.message_parts import MAX_ADDRS

SESSION = os.urandom(16)
PEER = ID.from_pubkey(create_new_key_pair().public_key).to_base58()

sessions = st.binary(min_size=16, max_size=16)
naturals = st.integers(0, 2**40)
peers = st.sampled_from([PEER, ID.from_pubkey(create_new_key_pair().public_key).to_base58()])


@st.composite
def tensors(draw) -> m.WireTensor:
    dtype = draw(st.sampled_from(sorted(WIRE_DTYPES)))
    tokens, hidden = draw(st.integers(1, 4)), draw(st.integers(1, 8))
    size = tokens * hidden * WIRE_DTYPES[dtype][1].itemsize
    return m.WireTensor(dtype, (1, tokens, hidden), draw(st.binary(min_size=size, max_size=size)))


@st.composite
def steps(draw) -> m.StepRequest:
    hidden = draw(tensors())
    chunks = None
    if draw(st.booleans()):
        cuts = sorted(draw(st.sets(st.integers(1, hidden.tokens - 1), max_size=3))) if hidden.tokens > 1 else []
        bounds = [0, *cuts, hidden.tokens]
        chunks = tuple(b - a for a, b in zip(bounds, bounds[1:]))
    return m.StepRequest(draw(sessions), draw(naturals), hidden, chunks, draw(st.booleans()))


downstreams = st.builds(m.Downstream, peers, st.lists(st.text(max_size=40), max_size=MAX_ADDRS).map(tuple),
                        sessions)
requests = st.one_of(
    st.builds(m.OpenRequest, sessions, st.one_of(st.none(), st.text(max_size=70)), naturals, naturals, naturals),
    steps(),
    st.builds(m.PushRequest, sessions, naturals, tensors()),
    st.builds(m.LinkRequest, sessions, st.one_of(st.none(), peers), st.one_of(st.none(), downstreams)),
    st.builds(m.TruncateRequest, sessions, naturals),
    st.builds(m.ReceiptRequest, sessions, st.binary(max_size=64)),
    st.builds(m.CloseRequest, sessions),
)
digests = st.binary(min_size=32, max_size=32)
proofs = st.builds(m.Proof, naturals, naturals, st.sampled_from(["fp32", "int8"]), digests, digests, digests,
                   st.binary(max_size=64))
replies = st.one_of(
    st.builds(m.Opened, sessions, naturals),
    st.builds(m.Result, sessions, naturals, tensors(), st.floats(0, 1e6), st.one_of(st.none(), proofs)),
    st.builds(m.Linked, sessions),
    st.builds(m.Truncated, sessions, naturals),
    st.builds(m.Receipted, sessions, st.binary(max_size=64)),
    st.builds(m.Closed, sessions),
    st.builds(m.ErrorReply, st.text(max_size=20), st.text(min_size=1, max_size=40), st.one_of(st.none(), sessions),
              st.one_of(st.none(), st.floats(0, 10))),
)


def over_the_wire(message) -> dict:
    """What the peer's decoder gets: the map packed into a frame and unpacked."""
    frame = encode_frame(message.to_wire())
    return decode_payload(frame[4:])


def refusal(message: dict) -> tuple[str, str]:
    with pytest.raises(FrameError) as caught:
        m.decode_request(message)
    return caught.value.code, caught.value.message


# ---------------------------------------------------------------- round trips


@settings(max_examples=300)
@given(requests)
def test_every_request_round_trips(request):
    assert m.decode_request(over_the_wire(request)) == request


@settings(max_examples=300)
@given(replies)
def test_every_reply_round_trips(reply):
    assert m.decode_reply(over_the_wire(reply)) == reply


@settings(max_examples=200)
@given(steps(), st.floats(0, 1e6), st.one_of(st.none(), proofs))
def test_a_result_answering_its_step_round_trips(step, compute_ms, proof):
    hidden = m.WireTensor(step.hidden.dtype, (1, step.reply_tokens, step.hidden.shape[2]), b"x")
    result = m.Result(step.session, step.position, hidden, compute_ms, proof)
    assert m.decode_reply(over_the_wire(result), step) == result


def test_wire_forms_are_those_of_protocol_md():
    hidden = encode_tensor(torch.ones(1, 2, 4))
    step = m.StepRequest(SESSION, 3, m.WireTensor.from_wire(hidden), (1, 1), True)
    assert step.to_wire() == {"type": "step", "session": SESSION, "position": 3, "hidden": hidden,
                              "chunks": [1, 1], "last_only": True}
    assert m.StepRequest(SESSION, 3, step.hidden).to_wire() == {"type": "step", "session": SESSION, "position": 3,
                                                                "hidden": hidden}
    assert step.sizes == [1, 1] and step.reply_tokens == 1
    assert m.StepRequest(SESSION, 3, step.hidden).sizes == [2]
    link = m.LinkRequest(SESSION, None, m.Downstream(PEER, ("/ip4/1.2.3.4/tcp/5",), SESSION))
    assert link.to_wire() == {"type": "link", "session": SESSION, "upstream": None,
                              "downstream": {"peer": PEER, "addrs": ["/ip4/1.2.3.4/tcp/5"], "session": SESSION}}
    result = m.Result(SESSION, 3, step.hidden, 1.5)
    assert result.to_wire() == {"type": "result", "session": SESSION, "position": 3, "hidden": hidden,
                                "compute_ms": 1.5}  # no proof: no key
    assert m.ErrorReply("busy", "full").to_wire() == {"type": "error", "code": "busy", "message": "full"}
    assert m.ErrorReply("rate_limited", "slow down", retry_after_s=0.5).to_wire() == {
        "type": "error", "code": "rate_limited", "message": "slow down", "retry_after_s": 0.5}
    assert m.ErrorReply("x", "y", SESSION).to_wire()["session"] == SESSION


# ---------------------------------------------------------------- requests refused


def step_wire(**fields) -> dict:
    return {"type": "step", "session": SESSION, "position": 0, "hidden": encode_tensor(torch.ones(1, 5, 4))} | fields


@pytest.mark.parametrize("session", [None, b"", b"x" * 15, b"x" * 17, "x" * 16, 16, [1] * 16])
def test_the_session_id_comes_first(session):
    for kind in ("open", "step", "close", "bogus"):
        assert refusal({"type": kind, "session": session}) == ("bad_request", "'session' must be 16 bytes")
    assert m.echo_session({"type": "close", "session": session}) == (session if isinstance(session, bytes) else None)


def test_an_unknown_type_is_a_bad_request():
    assert refusal({"type": "bogus", "session": SESSION}) == ("bad_request", "unknown message type 'bogus'")
    assert refusal({"type": "opened", "session": SESSION}) == ("bad_request", "unknown message type 'opened'")
    assert refusal({"session": SESSION}) == ("bad_request", "unknown message type None")
    assert refusal([1, 2])[0] == "bad_frame"


@pytest.mark.parametrize("value", [None, -1, True, False, 1.0, "3", b"3", [3]])
def test_integer_fields_are_non_negative_integers(value):
    opening = {"type": "open", "session": SESSION, "model": "m", "start": 0, "end": 2, "max_tokens": 8}
    for name in ("start", "end", "max_tokens"):
        assert refusal(opening | {name: value}) == ("bad_request", f"{name!r} must be a non-negative integer")
    for kind in ("step", "push", "truncate"):
        assert refusal(step_wire(type=kind, position=value)) == (
            "bad_request", "'position' must be a non-negative integer")


def test_a_model_that_is_not_text_is_just_another_model():
    opening = {"type": "open", "session": SESSION, "start": 0, "end": 2, "max_tokens": 8}
    assert m.decode_request(opening).model is None
    assert m.decode_request(opening | {"model": b"m"}).model is None
    assert m.decode_request(opening | {"model": "m"}).model == "m"


@pytest.mark.parametrize("hidden, code, words", [
    (None, "bad_tensor", "exactly dtype, shape, data"),
    ({"dtype": "float32", "shape": [1, 1, 4]}, "bad_tensor", "exactly dtype, shape, data"),
    ({"dtype": "float64", "shape": [1, 1, 4], "data": bytes(32)}, "bad_dtype", "float64"),
    ({"dtype": "float32", "shape": [1, 4], "data": bytes(16)}, "bad_shape", "3 integers"),
    ({"dtype": "float32", "shape": [1, True, 4], "data": bytes(16)}, "bad_shape", "3 integers"),
    ({"dtype": "float32", "shape": (1, 1, 4), "data": bytes(16)}, "bad_shape", "3 integers"),
    ({"dtype": "float32", "shape": [1, 1, 4], "data": "x" * 16}, "bad_tensor", "bytes"),
])
def test_hidden_states_must_be_tensors_on_the_wire(hidden, code, words):
    for kind in ("step", "push"):
        got = refusal(step_wire(type=kind, hidden=hidden))
        assert got[0] == code and words in got[1]
        # the very words decode_tensor uses for them
        with pytest.raises(FrameError) as caught:
            decode_tensor(hidden, hidden_size=4, max_tokens=8)
        assert (caught.value.code, caught.value.message) == got


tensor_values = st.one_of(st.none(), st.integers(-2, 5), st.text(max_size=4), st.binary(max_size=40),
                          st.lists(st.one_of(st.integers(-1, 5), st.booleans(), st.none()), max_size=4))


@settings(max_examples=400)
@given(st.dictionaries(st.sampled_from(["dtype", "shape", "data", "extra"]),
                       st.one_of(tensor_values, st.sampled_from(["float32", "float16", "bfloat16"])), max_size=4))
def test_tensor_structure_is_refused_exactly_as_decode_tensor_refuses_it(obj):
    """Whatever the structure check refuses, decode_tensor refuses with the same words
    (given the hidden size and token bound the shape asks for); whatever it accepts,
    decode_tensor does not refuse for its structure."""
    shape = obj.get("shape")
    fits = isinstance(shape, list) and len(shape) == 3 and shape[0] == 1 and isinstance(shape[1], int) \
        and shape[1] >= 1 and isinstance(shape[2], int) and not isinstance(shape[2], bool)
    hidden_size, max_tokens = (shape[2], shape[1]) if fits else (4, 8)
    try:
        wire = m.WireTensor.from_wire(obj)
    except FrameError as exc:
        if fits or exc.code != "bad_tensor" or "bytes" not in exc.message:  # data is looked at after the shape
            with pytest.raises(FrameError) as caught:
                decode_tensor(obj, hidden_size=hidden_size, max_tokens=max_tokens)
            assert (caught.value.code, caught.value.message) == (exc.code, exc.message)
        return
    assert wire.to_wire() == obj
    try:
        decode_tensor(obj, hidden_size=hidden_size, max_tokens=max_tokens)
    except FrameError as exc:
        assert exc.code in ("bad_shape", "non_finite")


@pytest.mark.parametrize("chunks", [[2, 2], [3, 3], [5, 0], [6, -1], [True, 4], [4, True], [], [5.0], "5", 5,
                                    {"a": 5}, [None]])
def test_chunks_must_be_positive_integers_summing_to_the_tokens(chunks):
    assert refusal(step_wire(chunks=chunks)) == ("bad_request", "'chunks' must be positive integers summing to 5")


def test_chunks_and_last_only():
    assert m.decode_request(step_wire()).chunks is None
    assert m.decode_request(step_wire(chunks=[5])).chunks == (5,)
    assert m.decode_request(step_wire(chunks=[3, 2])).sizes == [3, 2]
    for value, expected in [(True, True), ("yes", False), (1, False), (None, False), (False, False)]:
        assert m.decode_request(step_wire(last_only=value)).last_only is expected


def test_link_fields():
    link = {"type": "link", "session": SESSION, "upstream": None, "downstream": None}
    assert m.decode_request(link) == m.LinkRequest(SESSION, None, None)
    assert refusal(link | {"upstream": 5}) == ("bad_request", "'upstream' must be a peer id")
    assert refusal(link | {"upstream": "x" * 129}) == ("bad_request", "'upstream' must be a peer id")
    assert refusal(link | {"upstream": "not a peer id"}) == ("bad_request", "'upstream' is not a valid peer id")
    good = {"peer": PEER, "addrs": ["/ip4/1.2.3.4/tcp/5"], "session": SESSION}
    assert m.decode_request(link | {"downstream": good}).downstream == m.Downstream(PEER, ("/ip4/1.2.3.4/tcp/5",),
                                                                                   SESSION)
    assert refusal(link | {"downstream": [good]}) == ("bad_request", "'downstream' must be a map or nil")
    assert refusal(link | {"downstream": good | {"peer": "0OIl"}}) == (
        "bad_request", "'downstream.peer' is not a valid peer id")
    for addrs in ("x", ["a"] * 9, [5], ["a" * 257]):
        assert refusal(link | {"downstream": good | {"addrs": addrs}}) == (
            "bad_request", "'downstream.addrs' must be at most 8 multiaddr strings")
    for session in (None, b"x", "x" * 16):
        assert refusal(link | {"downstream": good | {"session": session}}) == (
            "bad_request", "'downstream.session' must be 16 bytes")


@settings(max_examples=300)
@given(st.one_of(st.text(max_size=60), st.text(alphabet="123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
                                                          "0OIl \t\n", max_size=60)))
def test_peer_ids_are_accepted_exactly_as_libp2p_reads_them(text):
    try:
        ID.from_base58(text)
        libp2p_reads_it = True
    except Exception:
        libp2p_reads_it = False
    try:
        m.parse_peer(text, "upstream")
        ours = True
    except FrameError:
        ours = False
    assert ours == libp2p_reads_it


def test_a_receipt_must_be_bytes():
    receipt = {"type": "receipt", "session": SESSION, "receipt": b"signed"}
    assert m.decode_request(receipt) == m.ReceiptRequest(SESSION, b"signed")
    for value in (None, "signed", 5, [b"x"]):
        assert refusal(receipt | {"receipt": value}) == ("bad_receipt", "a receipt is at most 2048 bytes")


# ---------------------------------------------------------------- replies refused


def test_a_reply_must_answer_its_request():
    x = torch.ones(1, 3, 4)
    step = m.StepRequest(SESSION, 7, m.WireTensor.from_wire(encode_tensor(x)), (2, 1))
    result = {"type": "result", "session": SESSION, "position": 7, "hidden": encode_tensor(x), "compute_ms": 2}
    assert m.decode_reply(result, step).compute_ms == 2.0
    with pytest.raises(PeerMisbehaved, match="answered step 7 with opened"):
        m.decode_reply({"type": "opened", "session": SESSION, "free_tokens": 3}, step)
    with pytest.raises(PeerMisbehaved, match="answered step 7 with result"):
        m.decode_reply(result | {"position": 6}, step)
    with pytest.raises(PeerMisbehaved, match="returned 3 tokens for 1"):
        m.decode_reply(result, m.StepRequest(SESSION, 7, step.hidden, (2, 1), last_only=True))
    with pytest.raises(FrameError, match="bad_dtype"):
        m.decode_reply(result | {"hidden": {"dtype": "int8", "shape": [1, 3, 4], "data": b""}}, step)
    with pytest.raises(PeerMisbehaved, match="answered close with linked"):
        m.decode_reply({"type": "linked", "session": SESSION}, m.CloseRequest(SESSION))
    error = m.decode_reply({"type": "error", "code": "busy", "message": "full"}, step)  # always an answer
    assert error == m.ErrorReply("busy", "full")


def test_replies_are_read_as_leniently_as_the_consumer_always_read_them():
    error = m.decode_reply({"type": "error", "code": 5, "message": None, "retry_after_s": 1})
    assert error == m.ErrorReply("5", "None", None, 1.0)
    assert m.decode_reply({"type": "error", "retry_after_s": "soon"}).retry_after_s is None
    hidden = encode_tensor(torch.ones(1, 1, 4))
    result = m.decode_reply({"type": "result", "session": SESSION, "position": 0, "hidden": hidden,
                             "compute_ms": "fast", "proof": {"sig": b"x"}})
    assert result.compute_ms == 0.0 and result.proof is None


@pytest.mark.parametrize("reply", [
    None, [], {"type": 5}, {"type": "bogus", "session": SESSION}, {"type": "closed"},
    {"type": "closed", "session": b"short"}, {"type": "opened", "session": SESSION, "free_tokens": -1},
    {"type": "truncated", "session": SESSION, "position": "1"}, {"type": "receipted", "session": SESSION},
    {"type": "result", "session": SESSION, "position": True, "hidden": encode_tensor(torch.ones(1, 1, 4))},
    {"type": "result", "session": SESSION, "position": 0, "hidden": None},
])
def test_malformed_replies_are_misbehaviour(reply):
    with pytest.raises(PeerMisbehaved):
        m.decode_reply(reply)


@settings(max_examples=300)
@given(st.dictionaries(st.sampled_from(["type", "session", "position", "hidden", "chunks", "model", "start", "end",
                                        "max_tokens", "upstream", "downstream", "receipt", "last_only"]),
                       st.one_of(st.none(), st.booleans(), st.integers(-2, 20), st.binary(max_size=20),
                                 st.just(SESSION), st.text(max_size=10),
                                 st.sampled_from(["open", "step", "push", "link", "truncate", "receipt", "close"]),
                                 st.lists(st.integers(-1, 5), max_size=3)), max_size=8))
def test_any_map_decodes_or_is_refused_with_a_code(message):
    try:
        request = m.decode_request(message)
    except FrameError as exc:
        assert exc.code and exc.message
        return
    assert m.decode_request(msgpack.unpackb(msgpack.packb(request.to_wire(), use_bin_type=True), raw=False)) \
        == request
