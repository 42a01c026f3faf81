"""net/scale_model.py: membership cost per node at scale, from measured unit costs and
the protocol's own parameters (held here to the code and the library they come from)."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from compushare.net import ad_intake, gossip, scale_model
from compushare.net.ad_intake import ad_period
from compushare.net.ads import AD_PERIOD_S, MAX_STRETCHED_PERIOD_S
from compushare.net.scale_model import (Swarm, UnitCosts, dht_rounds, fit_idle_cpu, format_table, gossip_hops,
                                        ihave_per_s, project, refresh_s, table)
from compushare.net.view import MAX_PEERS

COSTS = UnitCosts(cpu_s_per_copy=150e-6, cpu_s_per_new_ad=900e-6, cpu_s_per_control=80e-6, cpu_s_idle=0.002,
                  bytes_per_ad=900, bytes_per_control=120, copies_per_ad=4, control_per_s=3, hop_s=0.02,
                  dht_rtt_s=0.01)
TARGET = ad_intake.TARGET_ADS_PER_S
caps = st.sampled_from([MAX_STRETCHED_PERIOD_S, 600.0, 3600.0, 1e6])


# ---------------------------------------------------------------- the parameters are the code's

def test_the_protocol_parameters_are_the_codes_and_the_librarys():
    from libp2p.kad_dht.common import BUCKET_SIZE
    from libp2p.network.config import ConnectionConfig

    from compushare.pipeline.client.planner import SwarmPlanner

    degree = gossip.MESH_DEGREE[0]
    router = gossip.make_router()  # as every node runs it (test_gossip_topics: its heartbeat)
    assert router.mcache.window_size == scale_model.GOSSIP_WINDOW
    for topic_peers in range(0, 400):  # IHAVE goes to this many of the non-mesh topic peers
        outside = topic_peers - min(degree, topic_peers)
        sent = min(outside, router._get_adaptive_gossip_peers_count("t", outside))
        assert ihave_per_s(topic_peers) == sent / gossip.HEARTBEAT_S
    assert ConnectionConfig().max_connections == scale_model.MAX_CONNECTIONS
    assert BUCKET_SIZE == scale_model.DHT_K
    assert (SwarmPlanner.REFRESH_S, SwarmPlanner.WANTED_S, SwarmPlanner.RETRY_S) == (
        scale_model.REFRESH_S, scale_model.WANTED_S, scale_model.RETRY_S)
    # gossip.py runs GossipSub with the pure cores' constants, moved out of it unchanged
    assert (gossip.HEARTBEAT_S, gossip.MESH_DEGREE, gossip.MAX_VIEW_ADS) == (1, (6, 4, 12), 1024)
    assert gossip.MESH_DEGREE is ad_intake.MESH_DEGREE


# ---------------------------------------------------------------- the period and the ad rate

@given(st.integers(1, 10**6), caps, st.integers(1, 4))
def test_the_period_is_ad_intakes_on_what_the_view_can_count(nodes, cap, topics):
    p = project(Swarm(nodes, models=4, topics_per_node=topics), COSTS, cap_s=cap)
    providers = nodes * topics / 4
    assert p.providers_per_topic == providers
    assert p.period_s == ad_period(min(providers, MAX_PEERS / topics), cap_s=cap)
    if providers <= MAX_PEERS / topics:
        assert p.period_s == ad_period(providers, cap_s=cap)
    assert p.ads_per_s_per_topic == pytest.approx(providers / p.period_s)


@given(st.integers(1, 100_000), caps)
def test_the_period_agrees_with_ad_period_for_every_provider_count(providers, cap):
    p = project(Swarm(providers), COSTS, cap_s=cap)
    if providers <= MAX_PEERS:
        assert p.period_s == ad_period(providers, cap_s=cap)


@given(st.integers(1, 20), st.data())
def test_messages_stay_flat_while_the_stretch_holds_the_target(models, data):
    low, high = AD_PERIOD_S * TARGET, MAX_STRETCHED_PERIOD_S * TARGET  # 5 and 600 providers a topic
    nodes = data.draw(st.integers(math.ceil(low * models), math.floor(high * models)))
    p, q = project(Swarm(nodes, models), COSTS), project(Swarm(math.ceil(low * models), models), COSTS)
    assert p.ads_per_s_per_topic == pytest.approx(TARGET)
    for name in ("msgs_per_node_s", "cpu_share", "bytes_per_node_s", "control_per_s"):
        assert getattr(p, name) == pytest.approx(getattr(q, name), rel=1e-12), name


def test_the_cap_is_reached_at_600_providers():
    assert (TARGET, MAX_STRETCHED_PERIOD_S) == (1.0, 600.0)  # revision 23
    p = project(Swarm(600), COSTS)
    assert (p.period_s, p.ads_per_s_per_topic) == (600, 1)


@given(st.integers(601, 10**6))  # past 600 s × 1 ad/s
def test_past_the_cap_the_rate_grows_linearly(nodes):
    p, q = project(Swarm(nodes), COSTS), project(Swarm(nodes + 1), COSTS)
    assert p.period_s == MAX_STRETCHED_PERIOD_S == 600
    assert p.ads_per_s_per_topic == pytest.approx(nodes / MAX_STRETCHED_PERIOD_S)
    assert q.msgs_per_node_s > p.msgs_per_node_s and q.cpu_share > p.cpu_share


@given(st.integers(1, 10**6), st.integers(1, 3))
def test_past_max_peers_the_view_stops_the_stretch(providers, topics):
    # A cap no view can reach: the stretch ends where the view stops counting.
    p = project(Swarm(providers * 3, models=3, topics_per_node=topics), COSTS, cap_s=1e9)
    bound = MAX_PEERS / topics
    assert p.providers_per_topic == providers * topics
    if p.providers_per_topic >= bound:
        assert p.period_s == bound / TARGET
        assert p.ads_per_s_per_topic == pytest.approx(p.providers_per_topic * TARGET / bound)
    elif p.providers_per_topic >= AD_PERIOD_S * TARGET:
        assert p.ads_per_s_per_topic == pytest.approx(TARGET)


# ---------------------------------------------------------------- monotone, bounded

costs_st = st.builds(UnitCosts, *[st.floats(0, 1e-2)] * 4, st.floats(0, 5000), st.floats(0, 500), st.floats(1, 12),
                     st.floats(0, 100), st.floats(0, 0.5), st.floats(0, 0.5), bench_topic_peers=st.floats(0, 300))


@given(st.integers(1, 10**5), st.integers(1, 30), st.integers(1, 30), st.floats(0.01, 1.0), costs_st, caps)
def test_more_models_never_raise_a_nodes_cost(nodes, m1, m2, fraction, costs, cap):
    few, many = sorted((m1, m2))
    p, q = (project(Swarm(nodes, m, fraction), costs, cap_s=cap) for m in (few, many))
    for name in ("msgs_per_node_s", "cpu_share", "bytes_per_node_s", "control_per_s", "discover_s", "pull_bytes_s"):
        assert getattr(q, name) <= getattr(p, name) * (1 + 1e-12) + 1e-15, name


@given(st.integers(2, 10**7), st.integers(1, 20), costs_st, st.sampled_from([0.5, 1.0, 5.0]))
def test_discovery_grows_at_most_logarithmically(nodes, models, costs, wait):
    hop, rtt, q = costs.hop_s, costs.dht_rtt_s, scale_model.P95
    d = project(Swarm(nodes, models), costs, wait_s=wait)
    # hops <= 2 + log_5 n, look-up rounds <= 2 + log_20 n, a refresh <= 2 rounds + 7 rtt
    bound = 2 * hop + q * (wait + 11 * rtt) + math.log(nodes) * (hop / math.log(5) + 2 * q * rtt / math.log(20))
    assert d.discover_s <= bound + 1e-12
    assert project(Swarm(nodes + 1, models), costs, wait_s=wait).discover_s >= d.discover_s - 1e-12


def test_hops_and_rounds():
    assert [gossip_hops(s) for s in (1, 7, 8, 37, 38, 187, 188)] == [1, 1, 2, 2, 3, 3, 4]
    assert [dht_rounds(n) for n in (1, 20, 21, 400, 401, 8000, 8001)] == [1, 1, 2, 2, 3, 3, 4]


# ---------------------------------------------------------------- by hand

def test_a_hand_computed_example():
    p = project(Swarm(1000, models=5, provider_fraction=0.5), COSTS)
    # 200 subscribers, 100 providers a topic: period 100/1 = 100 s, 1 new ad/s, 4 copies
    assert (p.topic_size, p.providers_per_topic, p.period_s, p.ads_per_s_per_topic) == (200, 100, 100, 1)
    control = 3 * (1 - math.exp(-1 * 3 * 1))  # IHAVE only on heartbeats with ids in the 3-s window
    assert p.control_per_s == control
    assert p.msgs_per_node_s == 4 + control
    assert p.cpu_share == pytest.approx(0.002 + 4 * 150e-6 + 1 * 900e-6 + control * 80e-6, rel=1e-15)
    assert p.bytes_per_node_s == pytest.approx(4 * 900 + control * 120, rel=1e-15)
    # tree 1+6+30+150 = 187 < 200: 4 hops; 1000/20 = 50 -> ceil(log_20 50) + 1 = 3 rounds
    assert (p.gossip_hops, p.dht_hops) == (4, 3)
    # 300 connections: (40 + 300)·20/1000 = 6.8 copies among the peers asked: no fallback
    assert p.refresh_s == pytest.approx(7 * 0.01)
    assert p.discover_via == "ads"  # 4 hops·0.02 = 0.08 s < 2·(3+1)·0.01 + 0.07 = 0.15 s
    assert p.discover_s == pytest.approx(4 * 0.02 + 0.95 * (5 + 0.07))
    topic_peers = 300 * 199 / 999  # 59.8: 53.8 outside the mesh
    assert p.topic_peers == pytest.approx(topic_peers)
    assert p.ihave_per_s == 6  # GOSSIP_LAZY, not floor(53.8 / 4) = 13 as py-libp2p's own rule
    # a pull asks 8 of the ~60 topic peers, 100 ads each, every 5.07 s
    assert p.pull_bytes_s == pytest.approx(8 * 100 / 5.07 * 900)
    assert p.pull_cpu_share == pytest.approx(8 * 100 / 5.07 * 150e-6)
    # 10,000 nodes: 0.68 copies expected among the peers asked, a look-up follows
    assert refresh_s(Swarm(10_000), 0.01) == pytest.approx((4 + 4 + 5) * 0.01)


def test_ihave_is_flat_past_a_mesh_and_gossip_lazy_topic_peers():
    # D = 6 topic peers in the mesh, IHAVE to at most 6 of the rest: flat from 12 on
    assert [ihave_per_s(t) for t in (0, 6, 7, 11, 12, 49, 300, 10**6)] == [0, 0, 1, 5, 6, 6, 6, 6]
    measured = dataclasses.replace(COSTS, bench_topic_peers=49)  # a 50-node bench, one model
    small, big = project(Swarm(50), measured), project(Swarm(10_000), measured)
    assert small.control_per_s == pytest.approx(project(Swarm(50), COSTS).control_per_s)
    assert (small.topic_peers, big.topic_peers) == (49, 300)
    assert (small.ihave_per_s, big.ihave_per_s) == (6, 6)
    # 10,000 nodes: the bench's control rate, scaled only by the share of heartbeats with traffic
    with_traffic = 1 - math.exp(-big.ads_per_s_per_topic * 3)  # 10,000/600 ads/s
    assert big.control_per_s == pytest.approx(with_traffic * 3)
    assert project(Swarm(10_000, connections=49), measured).control_per_s == pytest.approx(big.control_per_s)
    # a bench whose nodes had fewer topic peers than that sent fewer IHAVE: the projection adds the rest
    few = dataclasses.replace(COSTS, bench_topic_peers=9)  # 3 outside the mesh: 3 IHAVE/s
    assert project(Swarm(10_000), few).control_per_s == pytest.approx(with_traffic * (3 + 6 - 3))


def test_the_idle_cpu_is_the_residual_of_a_measurement():
    swarm = Swarm(200, models=2)
    measured = project(swarm, COSTS).cpu_share
    assert fit_idle_cpu(measured, swarm, dataclasses.replace(COSTS, cpu_s_idle=0.5)) == pytest.approx(0.002)
    with pytest.raises(ValueError, match="exceed the measured"):
        fit_idle_cpu(0.001, swarm, COSTS)


def test_a_table_has_a_row_per_pair_and_prints():
    rows = table(COSTS, cap_s=600.0)
    assert [(r.nodes, r.models) for r in rows] == [(n, m) for n in (100, 1000, 10000) for m in (1, 5, 20)]
    assert all(r.cap_s == 600.0 for r in rows)
    text = format_table(rows).splitlines()
    assert len(text) == 10 and text[0].split()[:3] == ["nodes", "mod", "cap"]


@pytest.mark.parametrize("make, message", [
    (lambda: Swarm(0), "nodes >= 1"),
    (lambda: Swarm(10, models=0), "models >= 1"),
    (lambda: Swarm(10, provider_fraction=0.0), "provider_fraction"),
    (lambda: Swarm(10, provider_fraction=1.5), "provider_fraction"),
    (lambda: Swarm(10, models=2, topics_per_node=3), "topics_per_node"),
    (lambda: Swarm(10, connections=-1), "connections"),
    (lambda: dataclasses.replace(COSTS, cpu_s_per_copy=-1e-6), "cpu_s_per_copy"),
    (lambda: dataclasses.replace(COSTS, hop_s=math.nan), "hop_s"),
    (lambda: project(Swarm(10), COSTS, cap_s=0.0), "cap_s"),
    (lambda: project(Swarm(10), COSTS, wait_s=-1.0), "wait_s"),
    (lambda: project(Swarm(10), COSTS, quantile=1.0), "quantile"),
])
def test_bad_input_is_refused_with_a_reason(make, message):
    with pytest.raises(ValueError, match=message):
        make()
