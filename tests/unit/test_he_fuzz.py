"""Malformed and forged CKKS objects get HEError, never a crash or another exception.

In process, hypothesis feeds arbitrary bytes (bare, and behind a well-formed SEAL
header so SEAL's own parser sees them) to check_header, Context.ciphertext_from and
Context.galois_keys_from. Out of process, tests/he_fuzz_cases.py runs thousands of
mutations of valid ciphertexts and Galois keys (bit flips, truncations, extensions,
header and field edits, random bodies, zstd bombs, type confusion): a SEAL crash
there fails this test with the case that crashed, instead of killing pytest.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from compushare.he.ckks import SEAL_HEADER, SEAL_MAGIC, Context, HEError, SecretContext, check_header

pytestmark = pytest.mark.unit

CASES = Path(__file__).resolve().parent.parent / "he_fuzz_cases.py"
FUZZ_CASES = 5000


@pytest.fixture(scope="module")
def provider() -> Context:
    return Context()


@pytest.fixture(scope="module")
def minor() -> int:
    """SEAL's minor version, as the bundled SEAL writes it."""
    return SEAL_HEADER.unpack_from(SecretContext().encrypt(np.zeros(4096)))[3]


def with_header(body: bytes, compression: int, minor: int) -> bytes:
    return SEAL_HEADER.pack(SEAL_MAGIC, SEAL_HEADER.size, 4, minor, compression, 0, SEAL_HEADER.size + len(body)) + body


@settings(max_examples=300, derandomize=True)
@given(st.binary(max_size=200), st.integers(0, 1 << 20))
def test_check_header_raises_only_heerror(data, max_size):
    try:
        check_header(data, max_size=max_size, what="x")
    except HEError:
        return
    magic, header_size, major, _, compression, _, size = SEAL_HEADER.unpack_from(data)
    assert (magic, header_size, major) == (SEAL_MAGIC, 16, 4) and compression in (0, 1, 2)
    assert size == len(data) <= max_size


@pytest.mark.parametrize("value", [None, 7, "a SEAL object", [1, 2], {"a": 1}, 3.5, b"", bytearray(3)])
def test_non_bytes_are_heerrors(provider, value):
    with pytest.raises(HEError):
        check_header(value, max_size=100, what="x")
    with pytest.raises(HEError):
        provider.ciphertext_from(value)
    with pytest.raises(HEError):
        provider.galois_keys_from(value, frozenset({1}))


@settings(max_examples=300, derandomize=True)
@given(st.binary(max_size=300))
def test_arbitrary_bytes_are_heerrors(provider, data):
    for load in (provider.ciphertext_from, lambda d: provider.ciphertext_from(d, output=True),
                 lambda d: provider.galois_keys_from(d, frozenset({1}))):
        with pytest.raises(HEError):
            load(data)


@settings(max_examples=300, derandomize=True)
@given(st.one_of(st.binary(max_size=400), st.binary(min_size=56, max_size=120).map(lambda b: b + bytes(2000))),
       st.sampled_from([0, 1, 2]))
def test_arbitrary_bodies_behind_a_valid_header_are_heerrors(provider, minor, body, compression):
    """The header passes check_header, so SEAL parses the body (uncompressed, zlib or
    zstd): whatever it finds, the loaders raise HEError."""
    data = with_header(body, compression, minor)
    check_header(data, max_size=1 << 20, what="x")
    for load in (provider.ciphertext_from, lambda d: provider.ciphertext_from(d, output=True),
                 lambda d: provider.galois_keys_from(d, frozenset({1}))):
        with pytest.raises(HEError):
            load(data)


def test_thousands_of_mutated_ciphertexts_and_keys_in_a_subprocess():
    proc = subprocess.run([sys.executable, str(CASES), "--seed", "0", "--cases", str(FUZZ_CASES)],
                          capture_output=True, text=True, timeout=300)
    last = proc.stderr.strip().splitlines()[-5:]
    assert proc.returncode == 0, f"the fuzz process died (code {proc.returncode}); last cases:\n" + "\n".join(last)
    report = json.loads(proc.stdout)
    assert report["cases"] == FUZZ_CASES >= 1000
    counted = sum(n for outcomes in report["outcomes"].values() for n in outcomes.values())
    assert counted == FUZZ_CASES
    assert report["unexpected"] == [], "\n".join(report["unexpected"][:20])  # raised something but HEError
    assert report["invalid"] == [], "\n".join(report["invalid"][:20])  # accepted, yet not usable
    assert report["accepted_must_reject"] == [], "\n".join(report["accepted_must_reject"][:20])
    # Every target saw both outcomes (the mutations reach past the header checks), and
    # every kind of mutation ran.
    assert set(report["outcomes"]) == {"ct", "ct_raw", "out", "keys", "keys_raw"}
    for target, outcomes in report["outcomes"].items():
        assert outcomes.get("rejected", 0) > 0 and outcomes.get("accepted", 0) > 0, (target, outcomes)
    kinds = {kind.split(":")[0] for kind in report["by_mutation"]}
    assert kinds >= {"bitflip_any", "bitflip_body", "bytes_body", "truncate", "extend", "header_field",
                     "random_body", "splice", "bomb", "confusion", "raw_field", "transparent"}
    # zstd bombs (4 bytes inflating to 128 KiB, tens of thousands of them) were not inflated.
    assert report["max_rss_mb"] < 1024
