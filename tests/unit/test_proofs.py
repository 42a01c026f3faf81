"""proofs/inference.py: signed step statements, the rewindable input chain, failure reports
that anyone can check, that frame no one, and that no input can turn into anything
but PeerMisbehaved."""

from __future__ import annotations

import dataclasses
import hashlib
import os

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.secp256k1 import create_new_key_pair as create_secp256k1_key_pair
from libp2p.peer.id import ID

from compushare.errors import PeerMisbehaved
from compushare.proofs.fields import MAX_REPORT_BYTES
from compushare.proofs.inference import (DEFAULT_TOLERANCE, GENESIS, REPORT_FORMAT, TOLERANCES, FailureReport,
                                         InputChain, Statement, StepClaim, step_digest, token_digests, tolerance,
                                         tolerance_between)
from helpers import signed_claim

KEYS = [create_new_key_pair(bytes([i]) * 32) for i in range(3)]
PEERS = [ID.from_pubkey(kp.public_key).to_base58() for kp in KEYS]
MODEL, START, END, POSITION, TOKENS = "model-x", 2, 5, 7, 2
PREFIX = hashlib.sha256(b"the chain of the session's inputs before this step").digest()
INPUT = hashlib.sha256(b"this step's input").digest()
OUTPUT = hashlib.sha256(b"the step's output").digest()
STEP = Statement("fp32", MODEL, START, END, POSITION, TOKENS, PREFIX, INPUT, OUTPUT)


# ---------------------------------------------------------------- sign / verify


def test_sign_verify_round_trip():
    signature = STEP.sign(KEYS[0])
    assert STEP.verify(PEERS[0], signature)
    assert not STEP.verify(PEERS[1], signature)  # another peer did not sign it


@pytest.mark.parametrize(("field", "other"), [
    ("mode", "int8"), ("model_id", "model-y"), ("start", START + 1), ("end", END + 1), ("position", POSITION + 1),
    ("tokens", TOKENS + 1), ("prefix", GENESIS), ("input_digest", OUTPUT), ("output_digest", INPUT),
    ("runtime", "ggml/0.25.3:1f2e3d4c"), ("forwards", OUTPUT),
])
def test_any_changed_field_fails_verification(field, other):
    signature = STEP.sign(KEYS[0])
    assert not dataclasses.replace(STEP, **{field: other}).verify(PEERS[0], signature)


def test_fields_do_not_run_together():
    """The statement is structured, not concatenated: (2, 15) and (21, 5) differ."""
    signature = dataclasses.replace(STEP, start=2, end=15).sign(KEYS[0])
    assert not dataclasses.replace(STEP, start=21, end=5).verify(PEERS[0], signature)


@pytest.mark.parametrize("peer", [
    "", "not a peer id", "0OIl", PEERS[0][:-3], PEERS[0] + "x",
    ID(b"\x12\x20" + bytes(32)).to_base58(),  # a sha256 peer id: no public key inside
    ID.from_pubkey(create_secp256k1_key_pair().public_key).to_base58(),  # signed with another key type
], ids=["empty", "words", "not-base58", "cut", "extended", "sha256-id", "secp256k1"])  # stable: xdist compares ids
def test_garbage_peer_id_is_not_valid_and_does_not_raise(peer):
    assert STEP.verify(peer, STEP.sign(KEYS[0])) is False


@pytest.mark.parametrize("signature", [b"", b"\x00" * 64, b"\xff" * 63, b"\x01" * 65, os.urandom(64), "text", None],
                         ids=["empty", "zeros", "short", "long", "random", "text", "none"])
def test_garbage_signature_is_not_valid_and_does_not_raise(signature):
    assert STEP.verify(PEERS[0], signature) is False


# ---------------------------------------------------------------- digests and the input chain


def test_a_row_digest_names_its_dtype_and_its_rows():
    data = np.arange(8, dtype="<f4").tobytes()
    assert step_digest("float32", data, 2) != step_digest("float16", data, 2)  # same bytes, other dtype
    assert step_digest("float32", data, 2) != step_digest("float32", data, 1)  # same bytes, other shape
    assert step_digest("float32", data, 2) != step_digest("float32", data[:16], 1)
    with pytest.raises(ValueError):
        token_digests("float32", data, 3)


@given(st.lists(st.integers(1, 5), min_size=1, max_size=6), st.lists(st.integers(1, 5), min_size=1, max_size=6))
def test_the_chain_is_independent_of_chunking(first, second):
    """A replayed history sent in other chunks has the same chain at every position."""
    rows = [os.urandom(16) for _ in range(max(sum(first), sum(second)))]
    chains = []
    for sizes in (first, second):
        chain, at = InputChain(), 0
        for size in sizes:
            if at + size > len(rows):
                break
            chain.extend(token_digests("float32", b"".join(rows[at:at + size]), size))
            at += size
        chains.append(chain)
    common = min(len(c) for c in chains)
    for position in range(common + 1):
        assert chains[0].at(position) == chains[1].at(position)


@given(st.integers(1, 12), st.data())
def test_a_truncated_chain_equals_a_chain_that_never_held_the_rest(tokens, data):
    """A rollback cuts the chain back: proofs go on after speculation's truncates."""
    rows = [os.urandom(8) for _ in range(tokens)]
    cut = data.draw(st.integers(0, tokens))
    chain = InputChain()
    chain.extend(token_digests("float16", b"".join(rows), tokens))
    chain.truncate(cut)
    other = os.urandom(8)
    chain.extend(token_digests("float16", other, 1))
    fresh = InputChain()
    fresh.extend(token_digests("float16", b"".join(rows[:cut] + [other]), cut + 1))
    assert len(chain) == len(fresh) == cut + 1
    assert chain.at(cut + 1) == fresh.at(cut + 1) and chain.digest(cut, 1) == fresh.digest(cut, 1)
    with pytest.raises(ValueError):
        chain.truncate(cut + 2)


def test_the_empty_chain_is_the_genesis():
    assert InputChain().at(0) == GENESIS and len(InputChain()) == 0 and InputChain().forwards(0) == GENESIS


def fed(steps: list[tuple[int, ...]], rows: list[bytes], cut: int | None = None) -> InputChain:
    """A chain fed `steps` (each step's forwards) of `rows`, cut back to `cut` after the first."""
    chain, at = InputChain(), 0
    for index, forwards in enumerate(steps):
        n = sum(forwards)
        chain.extend(token_digests("float32", b"".join(rows[at:at + n]), n), forwards)
        at += n
        if index == 0 and cut is not None:
            chain.truncate(cut)
            at = cut
    return chain


@given(st.lists(st.integers(1, 4), min_size=1, max_size=5), st.lists(st.integers(1, 4), min_size=1, max_size=5))
def test_the_forwards_chain_names_how_the_rows_were_computed(first, second):
    """The same rows computed in other forwards: the input chain is the same, the
    forwards chain differs (where their sizes differ), and equals for equal ones."""
    rows = [os.urandom(16) for _ in range(max(sum(first), sum(second)))]
    if sum(first) != sum(second):
        return
    a, b = fed([tuple(first)], rows), fed([tuple(second)], rows)
    assert a.at(len(a)) == b.at(len(b))
    assert (a.forwards(len(a)) == b.forwards(len(b))) == (first == second)
    assert a.forwards(len(a)) == fed([tuple(first)], rows).forwards(len(a))


def test_the_forwards_chain_after_a_rollback_into_a_forward():
    """Rows kept of a forward cut back were computed among more: not the same as a
    forward of just those rows; the same history again gives the same chain."""
    rows = [os.urandom(16) for _ in range(6)]
    rolled = fed([(4,), (1,)], rows, cut=2)  # 4 drafted, 2 kept, then 1
    assert rolled.at(3) == fed([(2,), (1,)], rows).at(3)
    assert rolled.forwards(3) != fed([(2,), (1,)], rows).forwards(3)
    assert rolled.forwards(3) == fed([(4,), (1,)], rows, cut=2).forwards(3)
    at_boundary = fed([(2, 2), (1,)], rows, cut=2)  # cut at a forward's end: as if never computed
    assert at_boundary.forwards(3) == fed([(2,), (1,)], rows).forwards(3)
    with pytest.raises(ValueError, match="no forward ends"):
        fed([(4,)], rows).forwards(2)
    with pytest.raises(ValueError, match="do not cover"):
        InputChain().extend(token_digests("float32", b"".join(rows[:2]), 2), (1,))


# ---------------------------------------------------------------- failure reports


def claim(index: int, output: np.ndarray, *, dtype: str = "float32", signer: int | None = None,
          input_digest: bytes = INPUT, prefix: bytes = PREFIX, runtime: str = "", forwards: bytes = GENESIS,
          mode: str = "fp32") -> StepClaim:
    """Peer `index`'s signed claim (signed by `signer`'s key if given: a forgery)."""
    data = output.astype("<f4" if dtype == "float32" else "<f2").tobytes()
    key = KEYS[index if signer is None else signer]
    return signed_claim(key, data, model=MODEL, start=START, end=END, position=POSITION, tokens=TOKENS,
                        input_digest=input_digest, prefix=prefix, dtype=dtype, peer=PEERS[index], runtime=runtime,
                        forwards=forwards, mode=mode)


TRUE = np.random.default_rng(0).standard_normal(TOKENS * 64).astype(np.float32)
WRONG = TRUE * np.float32(1.05)  # 5% off: far beyond the tolerance
ROUNDED = TRUE * np.float32(1 + 1e-6)  # float rounding: within it
ULP = np.nextafter(TRUE, np.float32(np.inf))  # one ulp apart


def report(accused: StepClaim, witness: StepClaim, **overrides) -> FailureReport:
    return dataclasses.replace(FailureReport("fp32", MODEL, START, END, POSITION, TOKENS, PREFIX, INPUT, accused,
                                             witness), **overrides)


def test_report_of_two_conflicting_signed_claims_checks_and_round_trips():
    r = report(claim(0, WRONG), claim(1, TRUE))
    r.check()
    assert r.error() == pytest.approx(0.05, rel=1e-4) and r.tolerance == DEFAULT_TOLERANCE == TOLERANCES["fp32"]
    wire = r.to_wire()
    back = FailureReport.from_wire(wire)
    assert back == r and back.to_wire() == wire and back.digest == r.digest
    back.check()
    assert np.array_equal(back.accused.array(), WRONG)


def test_float16_claims_check_too():
    report(claim(0, WRONG, dtype="float16"), claim(1, TRUE, dtype="float16")).check()


def test_forged_signature_is_rejected():
    """A reporter cannot frame a peer with a claim it signed itself."""
    with pytest.raises(PeerMisbehaved, match="not signed"):
        report(claim(0, WRONG, signer=2), claim(1, TRUE)).check()
    with pytest.raises(PeerMisbehaved, match="not signed"):
        report(claim(0, WRONG), claim(1, TRUE, signer=2)).check()


def test_a_tampered_output_is_rejected():
    honest = claim(1, TRUE)
    tampered = dataclasses.replace(honest, output=WRONG.tobytes())
    with pytest.raises(PeerMisbehaved, match="not signed"):
        report(claim(0, TRUE), tampered).check()


def test_byte_identical_outputs_relabelled_with_another_dtype_are_rejected():
    """The first forgery found: the accused's honest float32 output, relabelled
    float16, "differs" from the witness's identical bytes. The dtype is signed."""
    accused, witness = claim(0, TRUE), claim(1, TRUE)
    relabelled = dataclasses.replace(accused, dtype="float16")
    forged = report(relabelled, witness, tokens=TOKENS)
    assert forged.error() > DEFAULT_TOLERANCE  # what the reporter hoped to exploit
    with pytest.raises(PeerMisbehaved, match="not signed"):
        forged.check()


def test_a_report_cannot_choose_its_tolerance():
    """The second forgery: outputs one ulp apart with a tolerance of 1e-12. A report
    has no tolerance field; the protocol's, per mode, decides."""
    r = report(claim(0, ULP), claim(1, TRUE))
    assert 0 < r.error() < 1e-6
    with pytest.raises(PeerMisbehaved, match="agree within the tolerance"):
        r.check()
    body = msgpack.unpackb(r.to_wire(), raw=False)
    body["tolerance"] = 1e-12
    with pytest.raises(PeerMisbehaved, match="malformed"):
        FailureReport.from_wire(msgpack.packb(body, use_bin_type=True))


def test_a_mode_without_a_tolerance_is_rejected():
    with pytest.raises(PeerMisbehaved, match="no tolerance"):
        report(claim(0, WRONG), claim(1, TRUE), mode="exact").check()


def test_both_claims_from_the_same_peer_are_rejected():
    with pytest.raises(PeerMisbehaved, match="two different servers"):
        report(claim(0, WRONG), claim(0, TRUE)).check()


@pytest.mark.parametrize("output", [TRUE, ROUNDED, ULP])
def test_agreeing_outputs_are_nothing_to_report(output):
    with pytest.raises(PeerMisbehaved, match="agree within the tolerance"):
        report(claim(0, output), claim(1, TRUE)).check()


def test_bfloat16_outputs_are_rejected():
    accused = claim(0, WRONG)
    bf16 = StepClaim(accused.peer_id, "bfloat16", accused.output, accused.signature)
    with pytest.raises(PeerMisbehaved, match="bfloat16"):
        report(bf16, claim(1, TRUE)).check()
    with pytest.raises(PeerMisbehaved):
        report(claim(1, TRUE), bf16).check()
    assert report(bf16, claim(1, TRUE)).error() == float("inf")


def test_unknown_dtype_and_ragged_output_are_rejected():
    accused = claim(0, WRONG)
    with pytest.raises(PeerMisbehaved, match="dtype"):
        report(dataclasses.replace(accused, dtype="int8"), claim(1, TRUE)).check()
    with pytest.raises(PeerMisbehaved, match="whole number"):
        report(dataclasses.replace(accused, output=accused.output + b"\x00"), claim(1, TRUE)).check()


def test_outputs_of_different_shapes_are_not_answers_to_one_step():
    """Each server signed its own output, but one signed fewer values per row: that
    is not a disagreement about one step that a tolerance can judge."""
    short = np.concatenate([TRUE.reshape(TOKENS, -1)[:, :32]]).ravel()
    with pytest.raises(PeerMisbehaved, match="different shapes"):
        report(claim(0, short), claim(1, TRUE)).check()


def test_input_or_prefix_other_than_the_signed_ones_is_rejected():
    """Claims about different histories do not conflict: the report must name the
    prefix and input both servers signed."""
    other = hashlib.sha256(b"another history").digest()
    for field in ("input_digest", "prefix"):
        with pytest.raises(PeerMisbehaved, match="not signed"):
            report(claim(0, WRONG), claim(1, TRUE), **{field: other}).check()
    with pytest.raises(PeerMisbehaved, match="not signed"):  # each signed a different history
        report(claim(0, WRONG, prefix=other), claim(1, TRUE)).check()


@pytest.mark.parametrize(("field", "changed"), [("model_id", "model-y"), ("start", START - 1), ("end", END + 1),
                                               ("position", POSITION + 1), ("tokens", 1)])
def test_report_fields_other_than_the_signed_ones_are_rejected(field, changed):
    with pytest.raises(PeerMisbehaved, match="not signed"):
        report(claim(0, WRONG), claim(1, TRUE), **{field: changed}).check()


# Every field of a report's wire form, and a value to change it to of the same type.
def _changed(value, draw):
    if isinstance(value, bool) or value is None:
        return not value
    if isinstance(value, int):
        return value + draw(st.sampled_from([-1, 1, 2]))
    if isinstance(value, bytes):
        index = draw(st.integers(0, max(0, len(value) - 1)))
        return value[:index] + bytes([value[index] ^ draw(st.integers(1, 255))]) + value[index + 1:] if value \
            else b"\x00"
    if isinstance(value, str):
        return draw(st.sampled_from([value + "x", value[:-1], "float16" if value == "float32" else "float32",
                                     PEERS[2]]).filter(lambda v: v != value))
    raise AssertionError(value)


VALID = report(claim(0, WRONG), claim(1, TRUE))
FIELDS = [(k,) for k, v in msgpack.unpackb(VALID.to_wire(), raw=False).items() if not isinstance(v, dict)] + \
    [(who, k) for who in ("accused", "witness") for k in ("peer", "dtype", "output", "sig", "rt", "forwards")]


@settings(max_examples=300)
@given(st.sampled_from(FIELDS), st.data())
def test_every_single_field_change_to_a_valid_report_is_rejected(path, data):
    """Whatever one field of a kept report is changed to (same type, other value),
    the report no longer checks: everything its verdict rests on is signed."""
    body = msgpack.unpackb(VALID.to_wire(), raw=False)
    target = body
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = _changed(target[path[-1]], data.draw)
    with pytest.raises(PeerMisbehaved):
        FailureReport.from_wire(msgpack.packb(body, use_bin_type=True)).check()


GGML, OTHER_GGML, TORCH = "ggml/0.25.3:1f2e3d4c", "ggml/0.25.3:99aa0b1c", "torch/2.13.0"
FORWARDS = hashlib.sha256(b"the forwards chain").digest()


@pytest.mark.parametrize(("accused", "witness", "allowed"), [
    ((GGML, FORWARDS), (GGML, FORWARDS), 0.0),
    ((GGML, FORWARDS), (GGML, GENESIS), 2e-2),  # a verifier caught up in other forwards
    ((GGML, FORWARDS), (OTHER_GGML, FORWARDS), 2e-2),  # another CPU's kernels
    ((TORCH, FORWARDS), (TORCH, FORWARDS), 2e-2),  # torch names no kernels
    ((GGML, FORWARDS), (TORCH, FORWARDS), 6e-2),  # a mixed chain: ACROSS_RUNTIMES
    ((TORCH, FORWARDS), ("", FORWARDS), 2e-2),  # a claim naming no runtime: the mode's
])
def test_one_exact_build_in_the_same_forwards_has_no_tolerance(accused, witness, allowed):
    """One ulp apart is a failure between two claims of one ggml build computed in the
    same forwards, and rounding for any other pair (the gguf format's tolerance, or
    the wider one between two runtimes)."""
    (rt_a, f_a), (rt_w, f_w) = accused, witness
    exact = allowed == 0.0
    r = dataclasses.replace(report(claim(0, ULP, runtime=rt_a, forwards=f_a, mode="gguf"),
                                   claim(1, TRUE, runtime=rt_w, forwards=f_w, mode="gguf")), mode="gguf")
    assert r.tolerance == allowed == tolerance_between("gguf", END - START, accused, witness)
    assert tolerance_between("gguf", 30, (GGML, FORWARDS), (TORCH, FORWARDS)) == pytest.approx(0.12)
    assert tolerance_between("gguf", 30, (TORCH, FORWARDS), (TORCH, FORWARDS)) == tolerance("gguf", 30)
    if exact:
        r.check()
        assert FailureReport.from_wire(r.to_wire()) == r
    else:
        with pytest.raises(PeerMisbehaved, match="within the tolerance"):
            r.check()
    relabelled = dataclasses.replace(r, witness=dataclasses.replace(r.witness, runtime=rt_a, forwards=f_a))
    if relabelled != r:  # a reporter cannot make two claims exact: the runtime and forwards are signed
        with pytest.raises(PeerMisbehaved, match="not signed"):
            relabelled.check()


def test_swapping_accused_and_witness_still_proves_only_a_disagreement():
    """Not a single-field change: both claims stay signed, so the swapped report
    checks too (a report proves two servers disagree; karma counts one per witness)."""
    report(claim(1, TRUE), claim(0, WRONG)).check()


# ---------------------------------------------------------------- from_wire on anything


def good_body() -> dict:
    return msgpack.unpackb(report(claim(0, WRONG), claim(1, TRUE)).to_wire(), raw=False)


def pack(body) -> bytes:
    return msgpack.packb(body, use_bin_type=True)


def with_(body: dict, path: tuple, value) -> dict:
    target = body
    for key in path[:-1]:
        target = target[key]
    if value is _DELETE:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return body


_DELETE = object()
BAD_FIELDS = [
    (("format",), "compushare/failure-report/v0"), (("format",), _DELETE), (("model",), 3),
    (("start",), True), (("start",), "2"), (("start",), -1), (("end",), START), (("position",), -1),
    (("tokens",), 0), (("tokens",), 1.0), (("input_digest",), INPUT[:31]), (("input_digest",), INPUT.hex()),
    (("prefix",), PREFIX[:31]), (("prefix",), None), (("mode",), 1), (("mode",), _DELETE), (("tolerance",), 1e-3),
    (("accused",), None), (("accused",), [1, 2]), (("witness", "peer"), b"x"), (("witness", "extra"), 1),
    (("witness", "output"), "text"), (("witness", "sig"), _DELETE), (("accused", "dtype"), None),
    (("accused", "rt"), 1), (("accused", "rt"), "ggml/" + "9" * 44), (("witness", "rt"), _DELETE),
    (("witness", "forwards"), GENESIS[:31]), (("accused", "forwards"), None),
]


@pytest.mark.parametrize(("path", "value"), BAD_FIELDS)
def test_from_wire_rejects_malformed_fields(path, value):
    with pytest.raises(PeerMisbehaved):
        FailureReport.from_wire(pack(with_(good_body(), path, value)))


@pytest.mark.parametrize("data", [
    b"", b"\xc1", b"\x92\x01\x02", pack([]), pack(None), pack("text"), pack({1: 2}), pack({"format": REPORT_FORMAT}),
    pack(good_body())[:-1], pack(good_body()) + b"\x00", "a str, not bytes", None, bytes(MAX_REPORT_BYTES + 1),
])
def test_from_wire_rejects_garbage(data):
    with pytest.raises(PeerMisbehaved):
        FailureReport.from_wire(data)


def test_from_wire_accepts_bytearray():
    assert FailureReport.from_wire(bytearray(pack(good_body()))) == FailureReport.from_wire(pack(good_body()))


def parse(data):
    """from_wire's contract: a report or PeerMisbehaved, never anything else."""
    try:
        FailureReport.from_wire(data)
    except PeerMisbehaved:
        pass


@given(st.binary(max_size=512))
def test_from_wire_on_any_bytes_raises_only_peer_misbehaved(data):
    parse(data)


msgpack_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(), st.text(max_size=8),
              st.binary(max_size=40), st.sampled_from([REPORT_FORMAT, INPUT, PEERS[0], "float32", "bfloat16"])),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12,
)
paths = st.sampled_from([("format",), ("model",), ("start",), ("end",), ("position",), ("tokens",),
                         ("input_digest",), ("prefix",), ("mode",), ("accused",), ("witness",)]
                        + [(who, key) for who in ("accused", "witness") for key in ("peer", "dtype", "output", "sig")])


@given(st.dictionaries(st.text(max_size=12), msgpack_values, max_size=12))
def test_from_wire_on_any_map_raises_only_peer_misbehaved(body):
    parse(pack(body))


@given(st.lists(st.tuples(paths, st.one_of(msgpack_values, st.just(_DELETE))), min_size=1, max_size=4))
def test_from_wire_on_a_mangled_report_raises_only_peer_misbehaved(changes):
    """Near-valid reports reach every check, not just the first."""
    body = good_body()
    for path, value in changes:
        try:
            with_(body, path, value)
        except (KeyError, TypeError):
            continue  # a claim already replaced by a non-map, or a key already deleted
    parse(pack(body))


def test_the_tolerance_grows_with_the_span_for_rounding_formats():
    """bf16 / int8 / q4 round activations before every product: the difference two
    honest kernels make grows with depth (protocol.md's table), fp32's does not."""
    from compushare.proofs.inference import tolerance

    assert tolerance("fp32", 1) == tolerance("fp32", 30) == 1e-3
    assert tolerance("q4/g64", 2) == tolerance("q4/g64", 10) == 2e-2
    assert tolerance("q4/g64", 30) == pytest.approx(6e-2) and tolerance("int8", 15) == pytest.approx(3e-2)
    with pytest.raises(KeyError):
        tolerance("q4/g48", 3)
