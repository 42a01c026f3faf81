"""Run records, group formation's public functions and the diloco wire messages."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID

from compushare.diloco import group, messages
from compushare.diloco.recipe import Recipe
from compushare.diloco.run import make_run, parse_run, run_key, run_validators
from compushare.errors import PeerMisbehaved

pytestmark = pytest.mark.unit

CORPUS = "ab" * 32


def _peer() -> str:
    return ID.from_pubkey(create_new_key_pair().public_key).to_base58()


def test_a_run_record_is_named_by_its_hash_and_checks_out_anywhere():
    key_pair = create_new_key_pair()
    run, value = make_run(Recipe.default_small(CORPUS), key_pair, name="tiny", check_rate=0.5)
    again = parse_run(run_key(run.run_id), value)
    assert again == run and run.starter == ID.from_pubkey(key_pair.public_key).to_base58()
    assert run.recipe == Recipe.default_small(CORPUS)
    run_validators()["csrun"].validate(run_key(run.run_id), value)
    other, other_value = make_run(Recipe.default_small(CORPUS), key_pair, name="other")
    with pytest.raises(PeerMisbehaved):  # a record under another run's key
        parse_run(run_key(run.run_id), other_value)
    tampered = bytearray(value)
    tampered[-5] ^= 1
    with pytest.raises(PeerMisbehaved):
        parse_run(run_key(run.run_id), bytes(tampered))


@pytest.mark.parametrize("change", [{"aggregator": "median"}, {"gather_s": 0.0}, {"check_rate": 1.5},
                                    {"max_group": 1}, {"max_group": 99}, {"name": "x" * 65}, {"init": "not-an-id"},
                                    {"start_in_s": -5.0}, {"start_in_s": 2e5}])
def test_a_run_record_out_of_range_is_refused(change):
    with pytest.raises(PeerMisbehaved):
        make_run(Recipe.default_small(CORPUS), create_new_key_pair(), **{"name": "r", **change})


@settings(max_examples=150, deadline=None)
@given(st.binary(max_size=2000))
def test_run_record_parser_refuses_junk_with_peer_misbehaved_only(junk):
    from compushare.diloco.run import run_id_of

    with pytest.raises(PeerMisbehaved):
        parse_run(run_key(run_id_of(junk)), junk)


def test_every_peer_picks_the_same_leader_owners_and_checks():
    peers = [_peer() for _ in range(6)]
    run_id = "cd" * 32
    assert group.leader(run_id, 3, peers) == group.leader(run_id, 3, list(reversed(peers)))
    leaders = {group.leader(run_id, r, peers) for r in range(40)}
    assert len(leaders) > 1  # the role rotates with the round
    assert group.owners(peers) == sorted(peers)
    assert group.group_digest(run_id, 1, 0, peers) == group.group_digest(run_id, 1, 0, reversed(peers))
    assert group.group_digest(run_id, 1, 0, peers) != group.group_digest(run_id, 1, 1, peers)
    assert group.round_key(run_id, 1) != group.round_key(run_id, 2)


def test_checks_are_a_derangement_kept_at_the_rate():
    peers = [_peer() for _ in range(5)]
    all_pairs = group.checks("ef" * 32, 7, peers, 1.0)
    assert sorted(c for c, _ in all_pairs) == sorted(peers) and sorted(t for _, t in all_pairs) == sorted(peers)
    assert all(c != t for c, t in all_pairs)
    assert group.checks("ef" * 32, 7, peers, 0.0) == []
    kept = sum(len(group.checks("ef" * 32, r, peers, 0.25)) for r in range(400))
    assert 0.2 * 400 * 5 < kept < 0.3 * 400 * 5
    assert group.checks("ef" * 32, 7, peers[:1], 1.0) == []


def test_messages_round_trip_and_refuse_bad_fields():
    run_id, base = "01" * 32, bytes(32)
    assert messages.parse_join(messages.join_request(run_id, 4, base)) == (run_id, 4, base)
    state = messages.state_reply(run_id, 4, base, "a" * 64, "b" * 64, ["y", "x"], ["z"])
    assert messages.parse_state_reply(state) == (4, base, "a" * 64, "b" * 64) and state["members"] == ["x", "y"]
    for bad in ({"run": "zz", "round": 1, "base": base}, {"run": run_id, "round": -1, "base": base},
                {"run": run_id, "round": 1, "base": b"short"}, {"run": run_id, "round": True, "base": base}):
        with pytest.raises(PeerMisbehaved):
            messages.parse_join({"type": "join", **bad})
    part = messages.part_request(run_id, 1, 0, ["b", "a"], {}, b"sig", {})
    assert messages.parse_part(part)[3] == ["a", "b"]
    for bad_members in ([], ["a", "a"], ["b", "a"], ["x"] * 17, [1]):
        with pytest.raises(PeerMisbehaved):
            messages.parse_part(dict(part, members=bad_members))
    with pytest.raises(PeerMisbehaved):
        messages.parse_part(dict(part, attempt=9))


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from(["type", "run", "round", "base", "attempt", "members", "contribution",
                                        "sig", "part", "weights", "momentum"]),
                       st.one_of(st.integers(), st.binary(max_size=40), st.text(max_size=70),
                                 st.lists(st.text(max_size=5), max_size=3), st.none())))
def test_message_parsers_raise_peer_misbehaved_only(message):
    for parse in (messages.parse_join, messages.parse_part, messages.parse_state_reply):
        try:
            parse(message)
        except PeerMisbehaved:
            pass


def test_a_recipe_in_a_run_survives_msgpack():
    recipe = dataclasses.replace(Recipe.default_small(CORPUS), steps=7)
    assert Recipe.from_wire(msgpack.unpackb(msgpack.packb(recipe.to_wire()), raw=False)) == recipe
