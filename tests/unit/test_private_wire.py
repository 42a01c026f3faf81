"""pipeline/private_wire.py: the decoders of /compushare/private/2.1.0 take any
message a peer can send (any msgpack map, valid ones mutated) and raise only
PrivateProtocolError (decode_projected also PrivateRemoteError, for an error
reply), or return what a valid message holds; valid messages round-trip."""

from __future__ import annotations

import copy
import hashlib
import math
import re

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from compushare.errors import PeerMisbehaved
from compushare.he.groups import GROUPS
from compushare.pipeline.private_wire import (KEYS_CHUNK, MAX_CIPHERTEXT_BYTES, MAX_CTS_PER_REQUEST, MAX_KEYS_BYTES,
                                              MAX_TOKENS_PER_REQUEST, MAX_WAIT_S, Open, PrivateProtocolError,
                                              PrivateRemoteError, Project, decode_keys_chunk, decode_open,
                                              decode_project, decode_projected, decode_wait, error, wait)

pytestmark = pytest.mark.unit

DIGEST = hashlib.sha256(b"keys").hexdigest()
FIELDS = ["type", "model_id", "start", "end", "params", "keys_digest", "keys_size", "data", "layer", "group", "tokens",
          "cts", "compute_s", "code", "message", "s"]
TYPES = ["open", "keys", "project", "projected", "error", "opened", "keys_ok", "wait", "busy"]

# What msgpack can carry (ints within 64 bits, as the wire allows), edge cases included.
INTS = st.one_of(st.integers(-3, 70000), st.integers(-(2**63), 2**64 - 1), st.sampled_from([0, 1, 2**16, 2**16 + 1]))
scalars = st.one_of(st.none(), st.booleans(), INTS, st.floats(), st.text(max_size=70), st.binary(max_size=40),
                    st.sampled_from(TYPES + sorted(GROUPS) + [DIGEST, DIGEST.upper(), "ckks-8192-60-40-60"]))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.text(max_size=8), inner, max_size=3)),
                      max_leaves=12)
messages = st.dictionaries(st.one_of(st.sampled_from(FIELDS), st.text(max_size=6)), values, max_size=8)
any_input = st.one_of(messages, values)

VALID_OPEN = Open("ab" * 32, 0, 4, "ckks-8192-60-40-60", DIGEST, 1 << 20).to_wire()
VALID_PROJECT = Project(2, "qkv", 3, (b"\x5e\xa1" + bytes(30), b"x" * 100)).to_wire()
VALID_KEYS = {"type": "keys", "data": b"k" * 1000}
VALID_PROJECTED = {"type": "projected", "cts": [[b"a" * 10, b"b"], [b"c"]], "compute_s": 0.25}


def wire(message):
    """Through msgpack as a frame carries it (lists stay lists, bytes stay bytes)."""
    return msgpack.unpackb(msgpack.packb(message, use_bin_type=True), raw=False, strict_map_key=False)


def check_open(message) -> None:
    try:
        opened = decode_open(message)
    except PrivateProtocolError:
        return
    assert isinstance(opened, Open)
    assert isinstance(opened.model_id, str) and 0 < len(opened.model_id) <= 128
    assert isinstance(opened.params, str) and 0 < len(opened.params) <= 64
    assert re.fullmatch("[0-9a-f]{64}", opened.keys_digest)
    for name in ("start", "end", "keys_size"):
        assert type(getattr(opened, name)) is int
    assert 0 <= opened.start < opened.end <= 1 << 16 and 1 <= opened.keys_size <= MAX_KEYS_BYTES


def check_project(message) -> None:
    try:
        request = decode_project(message)
    except PrivateProtocolError:
        return
    assert isinstance(request, Project) and request.group in GROUPS and type(request.layer) is int
    assert 0 <= request.layer <= 1 << 16 and 1 <= len(request.cts) <= MAX_CTS_PER_REQUEST
    assert type(request.tokens) is int and 1 <= request.tokens <= MAX_TOKENS_PER_REQUEST
    assert all(isinstance(c, bytes) and 0 < len(c) <= MAX_CIPHERTEXT_BYTES for c in request.cts)


def check_keys(message) -> None:
    try:
        data = decode_keys_chunk(message)
    except PrivateProtocolError:
        return
    assert isinstance(data, bytes) and 0 < len(data) <= KEYS_CHUNK


def check_projected(message, groups: int) -> None:
    try:
        cts, compute_s = decode_projected(message, groups)
    except (PrivateProtocolError, PrivateRemoteError):
        return
    assert isinstance(cts, list) and len(cts) == groups
    assert all(isinstance(out, list) and out and all(isinstance(c, bytes) and len(c) <= MAX_CIPHERTEXT_BYTES
                                                     for c in out) for out in cts)
    assert isinstance(compute_s, float)


def check_all(message) -> None:
    check_open(message)
    check_project(message)
    check_keys(message)
    for tokens in (0, 1, 2):
        check_projected(message, tokens)


@settings(max_examples=400, derandomize=True)
@given(any_input)
def test_arbitrary_messages_raise_only_protocol_errors(message):
    check_all(message)


@settings(max_examples=200, derandomize=True)
@given(messages.map(lambda m: {**m, "type": m.get("type", "x")}), st.sampled_from(TYPES))
def test_arbitrary_fields_under_each_type(message, kind):
    message["type"] = kind
    check_all(message)


def mutate(data, message: dict) -> dict:
    """Replace, delete or add top-level fields, or change an element of a list field."""
    message = copy.deepcopy(message)
    for _ in range(data.draw(st.integers(1, 3))):
        op = data.draw(st.sampled_from(["replace", "delete", "add", "element"]))
        key = data.draw(st.sampled_from(sorted(message) or ["type"]))
        if op == "replace":
            message[key] = data.draw(values)
        elif op == "delete":
            message.pop(key, None)
        elif op == "add":
            message[data.draw(st.sampled_from(FIELDS))] = data.draw(values)
        elif isinstance(message.get(key), list) and message[key]:
            index = data.draw(st.integers(0, len(message[key]) - 1))
            message[key][index] = data.draw(values)
    return message


@settings(max_examples=300, derandomize=True)
@given(st.data(), st.sampled_from([VALID_OPEN, VALID_PROJECT, VALID_KEYS, VALID_PROJECTED]))
def test_mutated_valid_messages_raise_only_protocol_errors(data, valid):
    check_all(mutate(data, valid))


def test_unhashable_fields_are_protocol_errors():
    """A list or map where a string belongs (msgpack delivers them as list and dict)."""
    for group in ([1], {"a": 1}, ["qkv"]):
        with pytest.raises(PrivateProtocolError):
            decode_project({**VALID_PROJECT, "group": group})
    for value in ([1], {"a": 1}):
        for field in ("model_id", "params", "keys_digest", "start", "end", "keys_size"):
            with pytest.raises(PrivateProtocolError):
                decode_open({**VALID_OPEN, field: value})
        with pytest.raises((PrivateProtocolError, PrivateRemoteError)):
            decode_projected({**VALID_PROJECTED, "type": value}, 2)


# ----------------------------------------------------------------- valid messages round-trip


@settings(max_examples=200, derandomize=True)
@given(model_id=st.text(min_size=1, max_size=128), start=st.integers(0, (1 << 16) - 1), span=st.integers(1, 64),
       params=st.text(min_size=1, max_size=64), digest=st.binary(min_size=1, max_size=8),
       keys_size=st.integers(1, MAX_KEYS_BYTES))
def test_open_round_trips(model_id, start, span, params, digest, keys_size):
    end = min(start + span, 1 << 16)
    opened = Open(model_id, start, end, params, hashlib.sha256(digest).hexdigest(), keys_size)
    assert decode_open(wire(opened.to_wire())) == opened


@settings(max_examples=200, derandomize=True)
@given(layer=st.integers(0, 1 << 16), group=st.sampled_from(sorted(GROUPS)),
       tokens=st.integers(1, MAX_TOKENS_PER_REQUEST),
       cts=st.lists(st.binary(min_size=1, max_size=64), min_size=1, max_size=MAX_CTS_PER_REQUEST))
def test_project_round_trips(layer, group, tokens, cts):
    request = Project(layer, group, tokens, tuple(cts))
    assert decode_project(wire(request.to_wire())) == request


def test_keys_chunks_and_products_round_trip():
    assert decode_keys_chunk(wire({"type": "keys", "data": b"x" * KEYS_CHUNK})) == b"x" * KEYS_CHUNK
    big = [[b"y" * MAX_CIPHERTEXT_BYTES] * 2] * 3
    assert decode_projected(wire({"type": "projected", "cts": big, "compute_s": 1.5}), 3) == (big, 1.5)
    assert decode_projected({"type": "projected", "cts": [[b"z"]], "compute_s": 2}, 1) == ([[b"z"]], 2.0)
    assert decode_projected({"type": "projected", "cts": [[b"z"]], "compute_s": "1"}, 1)[1] == 0.0
    assert math.isnan(decode_projected({"type": "projected", "cts": [[b"z"]], "compute_s": math.nan}, 1)[1])


def test_the_bounds_are_enforced():
    with pytest.raises(PrivateProtocolError):
        decode_keys_chunk({"type": "keys", "data": b"x" * (KEYS_CHUNK + 1)})
    with pytest.raises(PrivateProtocolError):
        decode_keys_chunk({"type": "keys", "data": b""})
    with pytest.raises(PrivateProtocolError):
        decode_project({**VALID_PROJECT, "cts": [b"c"] * (MAX_CTS_PER_REQUEST + 1)})
    with pytest.raises(PrivateProtocolError):
        decode_project({**VALID_PROJECT, "tokens": MAX_TOKENS_PER_REQUEST + 1})
    with pytest.raises(PrivateProtocolError):
        decode_project({**VALID_PROJECT, "tokens": 0})
    with pytest.raises(PrivateProtocolError):
        decode_project({**VALID_PROJECT, "cts": [b"c" * (MAX_CIPHERTEXT_BYTES + 1)]})
    with pytest.raises(PrivateProtocolError):
        decode_project({**VALID_PROJECT, "cts": [b""]})
    with pytest.raises(PrivateProtocolError):
        decode_project({**VALID_PROJECT, "layer": True})  # a bool is no layer
    with pytest.raises(PrivateProtocolError):
        decode_open({**VALID_OPEN, "end": VALID_OPEN["start"]})  # an empty span
    with pytest.raises(PrivateProtocolError):
        decode_open({**VALID_OPEN, "keys_digest": DIGEST.upper()})
    with pytest.raises(PrivateProtocolError):
        decode_open({**VALID_OPEN, "keys_size": MAX_KEYS_BYTES + 1})
    with pytest.raises(PrivateProtocolError):
        decode_projected({**VALID_PROJECTED, "cts": [[b"a" * (MAX_CIPHERTEXT_BYTES + 1)], [b"c"]]}, 2)
    with pytest.raises(PrivateProtocolError):
        decode_projected({**VALID_PROJECTED, "cts": [[], [b"c"]]}, 2)  # a group without outputs
    with pytest.raises(PrivateProtocolError):
        decode_projected(VALID_PROJECTED, 3)  # not the plan's groups


def test_an_error_reply_is_a_remote_error():
    with pytest.raises(PrivateRemoteError) as raised:
        decode_projected(error("bad_ciphertext", "x" * 2000), 1)
    assert raised.value.code == "bad_ciphertext" and len(str(raised.value)) < 600
    assert issubclass(PrivateProtocolError, PeerMisbehaved)


@settings(max_examples=300, deadline=None)
@given(any_input)
def test_decode_wait_takes_any_input(message):
    try:
        seconds = decode_wait(message)
    except PrivateProtocolError:
        return
    assert isinstance(seconds, float) and 1.0 <= seconds <= MAX_WAIT_S


@pytest.mark.parametrize("seconds", [1, 1.5, 60, MAX_WAIT_S])
def test_a_wait_round_trips(seconds):
    assert decode_wait(wire(wait(seconds))) == float(seconds)


@pytest.mark.parametrize("s", [0, 0.5, MAX_WAIT_S + 1, math.inf, math.nan, -5, True, "60", None, [60]])
def test_a_wait_outside_its_bounds_is_refused(s):
    with pytest.raises(PrivateProtocolError):
        decode_wait({"type": "wait", "s": s})
