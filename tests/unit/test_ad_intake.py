"""net/ad_intake.py: ad topics per model, the stretched period, the early drops and
the bounded caches of checked ads (issue 40)."""

from __future__ import annotations

import time

import pytest
from hypothesis import given
from hypothesis import strategies as st
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID

from compushare.errors import PeerMisbehaved
from compushare.hardware import Hardware
from compushare.net import ad_intake
from compushare.net.ad_intake import (TARGET_ADS_PER_S, AdIntake, ad_period, ad_topic, model_of_topic,
                                      served_models)
from compushare.net.ads import MAX_AD_BYTES, MAX_AD_TTL_S, MAX_STRETCHED_PERIOD_S, Serving, ad_ttl, make_ad

HW = Hardware(cpu_cores=2, ram_mb=24000, ram_free_mb=20000, gpu=None, gpu_mb=0)
MODEL_A, MODEL_B = "ab" * 32, "cd" * 32


def _ad(models=(MODEL_A,), *, key=None, now=None, ttl_s=15.0):
    key = key or create_new_key_pair()
    peer = ID.from_pubkey(key.public_key).to_base58()
    spans = [Serving(m, 0, 2, "float32", free_tokens=10, load=0.0, block_rate=1.0) for m in models]
    return make_ad(key, peer, [], HW, spans, "0.1.0", now=now, ttl_s=ttl_s)


def test_a_topic_names_its_model_and_nothing_else_is_a_model_topic():
    assert model_of_topic(ad_topic(MODEL_A)) == MODEL_A
    for other in ("/compushare/ads/1", ad_topic("AB" * 32), ad_topic("ab" * 31), "/x/" + MODEL_A):
        assert model_of_topic(other) is None


def test_the_period_is_the_base_until_the_topic_outgrows_the_target():
    assert (TARGET_ADS_PER_S, MAX_STRETCHED_PERIOD_S) == (1.0, 600.0)  # revision 23: 1 ad/s up to 600 providers
    assert ad_period(1) == ad_period(5) == 5.0  # 5 providers at 1 ad/s: the base
    assert (ad_period(6), ad_period(40), ad_period(600)) == (6.0, 40.0, 600.0)
    assert ad_period(601) == ad_period(10_000) == MAX_STRETCHED_PERIOD_S
    assert ad_period(0, 2.0) == 2.0
    with pytest.raises(ValueError):
        ad_period(3, 0.0)


@given(st.integers(1, 100_000), st.floats(1.0, 20.0))
def test_a_topic_member_hears_a_bounded_rate_and_ads_outlive_their_period(providers, base):
    period = ad_period(providers, base)
    assert base <= period <= max(base, MAX_STRETCHED_PERIOD_S)
    rate = providers / period  # ads per second on the topic
    assert rate <= max(TARGET_ADS_PER_S, providers / MAX_STRETCHED_PERIOD_S) + 1e-9
    if providers <= TARGET_ADS_PER_S * MAX_STRETCHED_PERIOD_S and period > base:
        assert rate == pytest.approx(TARGET_ADS_PER_S)
    assert ad_ttl(period) == 3 * period <= MAX_AD_TTL_S


def test_early_drops_cost_no_check():
    intake = AdIntake()
    intake.followed.add(MODEL_A)
    topic = ad_topic(MODEL_A)
    assert intake.early_drop(MAX_AD_BYTES + 1, [topic], b"p", 0.0) == "oversized"
    assert intake.early_drop(100, [], b"p", 0.0) == "not on exactly one topic"
    assert intake.early_drop(100, [topic, topic], b"p", 0.0) == "not on exactly one topic"
    assert intake.early_drop(100, [ad_topic(MODEL_B)], b"p", 0.0) == "a topic not followed"
    assert intake.early_drop(100, ["/compushare/ads/1"], b"p", 0.0) == "a topic not followed"
    assert intake.early_drop(100, [topic], b"p", 0.0) is None
    intake.accepted(b"p", topic, 10.0)
    assert intake.early_drop(100, [topic], b"p", 10.2) == "too fast"
    assert intake.early_drop(100, [topic], b"q", 10.2) is None  # another sender
    assert intake.early_drop(100, [topic], b"p", 10.6) is None
    assert intake.counts["early: too fast"] == 1
    assert intake.heard == {"other": 4, topic: 5}


def test_a_checked_ad_costs_a_hash_the_next_time(monkeypatch):
    calls = []
    decode = ad_intake.decode_ad
    monkeypatch.setattr(ad_intake, "decode_ad", lambda raw, sender: calls.append(raw) or decode(raw, sender=sender))
    intake, ad = AdIntake(), _ad((MODEL_A, MODEL_B))
    now = time.time()
    for topic in (ad_topic(MODEL_A), ad_topic(MODEL_B), None):
        assert intake.check(ad.raw, sender=ad.peer_id, now=now, topic=topic).seq == ad.seq
    assert intake.check(ad.raw, sender=None, now=now).peer_id == ad.peer_id  # relayed in a view reply
    assert len(calls) == 1 and intake.counts["cached"] == 3
    with pytest.raises(PeerMisbehaved, match="sent by"):  # a cached ad still names its sender
        intake.check(ad.raw, sender=_ad().peer_id, now=now)
    with pytest.raises(PeerMisbehaved, match="expired"):  # and freshness is checked every time
        intake.check(ad.raw, sender=None, now=now + 60)


def test_an_ad_on_another_models_topic_is_refused():
    intake, ad = AdIntake(), _ad((MODEL_A,))
    with pytest.raises(PeerMisbehaved, match="does not serve"):
        intake.check(ad.raw, sender=ad.peer_id, now=time.time(), topic=ad_topic(MODEL_B))
    with pytest.raises(PeerMisbehaved, match="does not serve"):
        intake.check(ad.raw, sender=ad.peer_id, now=time.time(), topic="/compushare/ads/1")


def test_a_bad_ad_is_refused_again_without_a_second_check(monkeypatch):
    intake, ad, stranger = AdIntake(), _ad(), _ad().peer_id
    with pytest.raises(PeerMisbehaved):
        intake.check(ad.raw, sender=stranger, now=time.time())
    monkeypatch.setattr(ad_intake, "decode_ad", lambda raw, sender: pytest.fail("checked twice"))
    with pytest.raises(PeerMisbehaved):
        intake.check(ad.raw, sender=stranger, now=time.time())
    assert intake.counts["refused again"] == 1


def test_the_caches_are_bounded():
    intake = AdIntake(max_verified=3, max_refused=2, max_senders=4)
    now = time.time()
    ads = [_ad() for _ in range(5)]
    for ad in ads:
        intake.check(ad.raw, sender=None, now=now)
        with pytest.raises(PeerMisbehaved):
            intake.check(ad.raw + b"x", sender=None, now=now)
    for i in range(10):
        intake.accepted(bytes([i]), ad_topic(MODEL_A), 0.0)
    assert intake.cache_sizes() == {"verified": 3, "refused": 2, "senders": 4}


def test_a_long_stretched_lifetime_is_valid_and_a_longer_one_is_not():
    intake = AdIntake()
    now = time.time()
    assert intake.check(_ad(ttl_s=MAX_AD_TTL_S, now=now).raw, sender=None, now=now)
    with pytest.raises(PeerMisbehaved, match="lifetime"):
        intake.check(_ad(ttl_s=MAX_AD_TTL_S + 1, now=now).raw, sender=None, now=now)


def test_an_ad_is_published_on_each_model_it_serves_once():
    assert served_models(_ad((MODEL_B, MODEL_A, MODEL_B))) == [MODEL_B, MODEL_A]
    assert served_models(_ad(())) == []
