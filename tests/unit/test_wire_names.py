"""The wire's names live in compushare/wire.py alone, and protocol.md documents exactly
those: its protocol headings, gossip topic, DHT keys and error-code tables against
the constants, both ways."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from compushare import wire

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
SPEC = (ROOT / "protocol.md").read_text()


def section(title_start: str) -> str:
    """protocol.md's text from the heading starting with `title_start` to the next of its level."""
    match = re.search(rf"^(#+) {re.escape(title_start)}.*$", SPEC, re.M)
    assert match, title_start
    rest = SPEC[match.end():]
    end = re.search(rf"^#{{1,{len(match.group(1))}}} ", rest, re.M)
    return rest[:end.start()] if end else rest


def test_every_stream_protocol_has_its_section_and_no_other_is_documented():
    documented = set(re.findall(r"^## `(/compushare/[^`]+)`", SPEC, re.M))
    assert documented == set(wire.PROTOCOLS)
    assert re.search(rf"^### `{re.escape(wire.AD_TOPIC_PREFIX)}<model_id>`", SPEC, re.M)
    assert wire.AD_TOPIC_V1 in section(f"`{wire.AD_TOPIC_PREFIX}")


def test_dht_namespaces_and_provider_keys_are_documented():
    assert set(re.findall(r"key `/(cs\w+)/", SPEC)) == {wire.SERVER_RECORDS, wire.KARMA_RECORDS, wire.RUN_RECORDS}
    assert set(re.findall(r'sha256\("(compushare/\w+/v\d+/)"', SPEC)) == set(wire.PROVIDER_KEYS)


def codes_of(table: str) -> set[str]:
    """The codes in the first column of a markdown table's rows."""
    codes = set()
    for row in re.findall(r"^\| (`[^|]+`) \|", table, re.M):
        codes |= set(re.findall(r"`(\w+)`", row))
    return codes


def test_the_infer_error_table_is_the_codes_servers_send():
    table = section("`/compushare/infer/")
    table = table[table.index("Error reply:"):]
    assert codes_of(table) == set(wire.FRAME_ERRORS) | set(wire.INFER_ERRORS) | set(wire.ADAPTER_ERRORS)


def test_the_pieces_error_and_reject_codes():
    pieces = section("`/compushare/pieces/")
    error_row = re.search(r"^\| `error` \|.*$", pieces, re.M).group(0)
    reject_row = re.search(r"^\| `reject` \|.*$", pieces, re.M).group(0)
    assert set(re.findall(r"`(\w+)`", error_row.split("then the seeder closes")[1])) == set(wire.PIECES_ERRORS)
    assert set(re.findall(r"`(\w+)`", reject_row.split("`code`")[1].split(" | ")[0])) == set(wire.PIECES_REJECTS)


def test_the_private_error_codes():
    private = section("`/compushare/private/")
    paragraph = private[private.index("Any request may be answered"):]
    paragraph = paragraph[:paragraph.index("\n\n")]
    assert set(re.findall(r"`(\w+)`", paragraph)) - {"type", "code", "message"} == set(wire.PRIVATE_ERRORS)


def test_no_module_spells_a_wire_name_of_its_own():
    """Protocol ids, the topic and DHT key prefixes are written in wire.py only."""
    spelled = re.compile(r"[\"'](?:/compushare/\w+/\d|compushare/\w+/v\d+/|/?cs(?:server|karma)[\"'/])")
    found = [f"{path.relative_to(ROOT)}:{number}" for path in sorted((ROOT / "src").rglob("*.py"))
             if path.name != "wire.py"
             for number, line in enumerate(path.read_text().splitlines(), 1) if spelled.search(line)]
    assert found == []


def test_the_train_error_table_is_the_codes_servers_send():
    table = section("`/compushare/train/")
    table = table[table.index("Error reply:"):]
    table = table[:table.index("### ")]
    assert codes_of(table) == set(wire.FRAME_ERRORS) | set(wire.TRAIN_ERRORS)


def test_the_diloco_error_table_is_the_codes_participants_send():
    table = section("`/compushare/diloco/")
    table = table[table.index("Error reply:"):]
    assert codes_of(table) == {wire.BAD_FRAME, wire.FRAME_TOO_LARGE} | set(wire.DILOCO_ERRORS)
