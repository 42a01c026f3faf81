"""torrent/manifest.py and torrent/protocol.py: manifests and piece messages from anywhere
are checked, never trusted; a bad one is a FrameError, never a crash."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from compushare.errors import FrameError
from compushare.model.layout import lay_out
from compushare.model.manifest import MIN_PIECE_SIZE, NORMS_FILE, auto_piece_size, parse
from compushare.torrent.protocol import decode_bitfield, encode_bitfield, parse_reply, parse_request


@pytest.fixture(scope="module")
def manifest(tiny_model, tmp_path_factory):
    return lay_out(tiny_model, tmp_path_factory.mktemp("laid") / "m")


def _norms(doc: dict) -> dict:
    [entry] = [f for f in doc["files"] if f["name"] == NORMS_FILE]
    return entry


def reencode(doc: dict) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def test_round_trip_and_id(manifest):
    again = parse(manifest.raw, expected_id=manifest.model_id)
    assert again.model_id == manifest.model_id
    assert [p.sha256 for p in again.pieces] == [p.sha256 for p in manifest.pieces]
    with pytest.raises(FrameError, match="does not hash"):
        parse(manifest.raw, expected_id="0" * 64)


def test_a_manifest_without_a_norms_file_still_parses(manifest):
    """Manifests laid out before the norms file (layout version 2) keep their ids and
    parse: a private consumer fetches every block for them instead (consumer.private_fetch)."""
    doc = json.loads(manifest.raw)
    doc["files"] = [f for f in doc["files"] if f["name"] != NORMS_FILE]
    old = parse(reencode(doc))
    assert old.norms_file is None and manifest.norms_file is not None
    assert old.tensors() == manifest.tensors()  # the norms file's copies are not counted twice


def test_auto_piece_size():
    assert auto_piece_size(1) == MIN_PIECE_SIZE
    assert auto_piece_size(541_613_416) == 1 << 20  # SmolLM2 fp32
    assert auto_piece_size(140 * 10**9) == 4 << 20  # capped


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.update(format="other/1"), "format"),
    (lambda d: d.update(piece_size=3 * 16384), "power of two"),
    (lambda d: d.update(piece_size=1024), "piece_size"),
    (lambda d: d["files"][1].update(name="../evil"), "name"),
    (lambda d: d["files"][1].update(name="manifest.json"), "name"),  # would overwrite the store's own
    (lambda d: d["files"][1].update(name="config.json"), "name"),
    (lambda d: d["files"][2].update(name=d["files"][1]["name"]), "name"),
    (lambda d: d["files"][1].update(block=99), "block"),
    (lambda d: d["files"][2].update(block=d["files"][1]["block"]), "two files"),
    (lambda d: d["files"].pop(2), "without a file"),
    (lambda d: d["files"][1]["pieces"].pop(), "pieces"),
    (lambda d: d["files"][1]["pieces"].__setitem__(0, "XYZ"), "hex"),
    (lambda d: d["files"][1].update(size=-1), "size"),
    (lambda d: d["files"][0].update(role="block"), "block"),
    (lambda d: d["files"][1].update(role="weird"), "role"),
    (lambda d: d["files"].append(dict(d["files"][0], name="head2.safetensors")), "head"),
    (lambda d: d["config"].update(num_hidden_layers="4"), "num_hidden_layers"),
    (lambda d: next(iter(d["files"][1]["tensors"].values())).update(offsets=[10, 5]), "ends before"),
    (lambda d: next(iter(d["files"][1]["tensors"].values())).update(offsets=[0, 10**9]), "offset"),
    (lambda d: next(iter(d["files"][1]["tensors"].values())).update(dtype="F8"), "dtype"),
    (lambda d: d.update(extra=1), "keys"),
    # The norms file (model/layout.py) holds copies of block tensors, and only it of the meta files holds tensors.
    (lambda d: next(iter(_norms(d)["tensors"].values())).update(shape=[3]), "not a block tensor"),
    (lambda d: _norms(d)["tensors"].update(x={"dtype": "F32", "shape": [1], "offsets": [0, 4]}), "not a block"),
    (lambda d: _norms(d).update(name="other.safetensors"), "only norms.safetensors"),
])
def test_bad_manifests_are_rejected(manifest, edit, message):
    doc = json.loads(manifest.raw)
    edit(doc)
    with pytest.raises(FrameError, match=message):
        parse(reencode(doc))


def test_not_json_and_oversized_are_rejected():
    with pytest.raises(FrameError):
        parse(b"\xff\xfe not json")
    with pytest.raises(FrameError, match="at most"):
        parse(b" " * (9 * 1024 * 1024))


@given(st.data())
def test_mutated_manifests_raise_frame_error_or_parse(manifest, data):
    """Flip, cut or splice bytes anywhere: parse either accepts a well-formed manifest
    or raises FrameError - nothing else escapes."""
    raw = bytearray(manifest.raw)
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["flip", "cut", "insert"]))
        at = data.draw(st.integers(0, len(raw) - 1))
        if op == "flip":
            raw[at] = data.draw(st.integers(0, 255))
        elif op == "cut":
            del raw[at:at + data.draw(st.integers(1, 64))]
        else:
            raw[at:at] = data.draw(st.binary(min_size=1, max_size=16))
        if not raw:
            raw = bytearray(b"{")
    try:
        parsed = parse(bytes(raw))
    except FrameError:
        return
    assert len(parsed.pieces) == sum(len(f.pieces) for f in parsed.files)


# ---------------------------------------------------------------- protocol messages


@given(st.integers(0, 300).flatmap(lambda n: st.tuples(st.just(n), st.sets(st.integers(0, max(0, n - 1))))))
def test_bitfield_round_trip(case):
    n, have = case
    have = {i for i in have if i < n}
    assert decode_bitfield(encode_bitfield(have, n), n) == have


def test_bitfield_rejects_wrong_length_and_spare_bits():
    with pytest.raises(FrameError):
        decode_bitfield(b"\x00", 9)
    with pytest.raises(FrameError, match="spare"):
        decode_bitfield(b"\x01", 7)


MESSAGES = st.dictionaries(
    st.sampled_from(["type", "model", "index", "data", "code", "pieces", "have", "message", "x"]),
    st.one_of(st.none(), st.integers(-5, 10**6), st.text(max_size=70), st.binary(max_size=40), st.booleans(),
              st.lists(st.integers(), max_size=3)),
)


@given(MESSAGES, st.one_of(st.none(), st.integers(0, 100)))
def test_any_message_parses_or_raises_frame_error(message, num_pieces):
    message = dict(message, type=message.get("type") if isinstance(message.get("type"), str) else "request")
    for parser in (parse_request, parse_reply):
        try:
            kind, _value = parser(message, num_pieces)
        except FrameError:
            continue
        assert kind in {"hello", "manifest", "request", "cancel", "error", "bitfield", "have", "piece", "reject"}


def test_requests_are_checked_against_the_piece_count():
    assert parse_request({"type": "hello", "model": "ab" * 32}, None) == ("hello", "ab" * 32)
    assert parse_request({"type": "request", "index": 9}, 10) == ("request", 9)
    for bad in ({"type": "request", "index": 10}, {"type": "request", "index": -1},
                {"type": "request", "index": True}, {"type": "cancel"}, {"type": "hello", "model": "AB" * 32},
                {"type": "request", "index": 1, "more": 2}):
        with pytest.raises(FrameError):
            parse_request(bad, 10)
    with pytest.raises(FrameError, match="before hello"):
        parse_request({"type": "request", "index": 1}, None)


def test_replies_are_checked():
    assert parse_reply({"type": "piece", "index": 1, "data": b"x"}, 2) == ("piece", (1, b"x"))
    assert parse_reply({"type": "reject", "index": 0, "code": "not_held"}, 2) == ("reject", (0, "not_held"))
    for bad in ({"type": "piece", "index": 2, "data": b"x"}, {"type": "piece", "index": 0, "data": "str"},
                {"type": "reject", "index": 0, "code": "why"}, {"type": "bitfield", "pieces": 3, "have": b""},
                {"type": "have", "index": 5}, {"type": "surprise"}):
        with pytest.raises(FrameError):
            parse_reply(bad, 2)
    with pytest.raises(FrameError, match="piece count"):
        parse_reply({"type": "bitfield", "pieces": 3, "have": b"\x00"}, 2)


def test_manifest_module_needs_no_torch():
    import subprocess
    import sys

    code = "import sys, compushare.model.manifest, compushare.torrent.protocol; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=Path(__file__).parent)
    assert out.stdout.strip() == "False", out.stderr


@given(st.integers(0, 2**32), st.binary(max_size=70000))
def test_piece_frame_is_what_the_codec_would_make(index, data):
    from compushare.net.codec import encode_frame
    from compushare.torrent.protocol import piece_frame

    assert piece_frame(index, data) == encode_frame({"type": "piece", "index": index, "data": data})


@given(st.integers(0, 2**32), st.binary(max_size=70000))
def test_a_piece_frame_is_its_head_then_the_data(index, data):
    from compushare.torrent.protocol import piece_frame, piece_frame_head

    assert piece_frame_head(index, len(data)) + data == piece_frame(index, data)
