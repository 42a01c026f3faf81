"""What membership costs one node at scale, from measured unit costs and the protocol's
real parameters. Pure, no I/O.

bench/scale.py measures `UnitCosts` on a real swarm at two sizes and prints this
model's projection beside what it measured; `table` projects them to 100-10,000 nodes
and 1-20 models. Every formula the model uses is here; what is not measured or read
from the code is said to be assumed.

Swarm (`Swarm`): N nodes, m models, a share f of nodes provide, every node follows t
topics (each provider publishes, each consumer listens), spread evenly over the models:
  subscribers per topic S = N·t/m, providers per topic P = f·S.
Period (ad_intake.ad_period, gossip.stretch_period): a provider counts the providers of
its model in its view, which holds at most MAX_PEERS ads shared by its t topics:
  n = min(P, MAX_PEERS/t), period = max(base, min(cap, n / TARGET_ADS_PER_S)).
  Publications wait period·U(0.9, 1.1): the period on average. `cap_s` asks "what if
  MAX_STRETCHED_PERIOD_S were raised" (MAX_AD_TTL_S = 3× it follows it in ads.py).
New ads a member hears per topic: A = P / period, so P/base below 5 providers, 1/s up
  to cap·1 providers, then P/cap (linear); a cap over MAX_PEERS/1 = 4,096 s would leave
  the view's bound to stop the stretch: A = P/4096 past 4,096 providers.
Per node and second, over its t topics:
  copies = A·t·copies_per_ad, new ads = A·t, messages = copies + control,
  control = t·h·c: h = 1 - exp(-A·GOSSIP_WINDOW·HEARTBEAT_S), the share of heartbeats
    whose gossip window holds a message (py-libp2p sends IHAVE only then); c =
    control_per_s (measured), plus ihave(T) - ihave(T_bench) when the bench says how
    many topic peers its nodes had (`bench_topic_peers`; flat past GOSSIP_LAZY + D
    topic peers, see IHAVE); else c is flat.
  cpu share = idle + copies·cpu_copy + new·cpu_new_ad + control·cpu_control
  bytes received = copies·bytes_per_ad + control·bytes_per_control
IHAVE (py-libp2p 0.8.1 gossip_heartbeat as gossip.py runs it, revision 23): each
  heartbeat, per topic with traffic, a node sends IHAVE to min(M, GOSSIP_LAZY) of its
  M connected topic peers outside its mesh, and by symmetry receives as many. (py-libp2p's
  own rule, max(6, ⌊M/4⌋), grew with the connections, so with N: gossip.py pins it.)
  T = connected topic peers = min(S-1, max(min(D, S-1), C·(S-1)/(N-1))), M = T - min(D, T),
  with C connections: assumed min(N-1, 300) (DHT look-ups and gossip dial peers, and
  nothing closes a connection below py-libp2p's cap of 300). IHAVE is flat once a node
  has GOSSIP_LAZY topic peers outside its mesh.
Gossip hops: the depth of a tree whose root sends to D mesh peers and every other node
  to D-1 new ones (py-libp2p skips the forwarder and the origin): the least h with
  1 + D·((D-1)^h - 1)/(D-2) >= S, at least 1 (a perfect tree; stragglers of a random
  mesh may take one hop more).
DHT look-up rounds r (py-libp2p 0.8.1 find_closest_peers_network: ALPHA = 10 queries a
  round, k = 20, stops at a round that finds no closer peer): 1 when N <= k, else
  ceil(log_k(N/k)) + 1: a k-bucket reply narrows the distance by about log2 k bits and
  one round confirms (log2(N/k) + 1, a bit per round, is Kademlia's worst case). Every
  `compushare node` runs its DHT as a server (app/node.py): the DHT has N members.
Discovery: from a new provider serving to a consumer's planner holding it (the
  `quantile` of the refresh phase; gossip and DHT times at their typical):
  ad path: hops·hop_s. DHT path: the provider's put_value then provide (announce.py),
    each a look-up and a store: 2(r+1)·rtt, then a whole refresh reads it.
  A refresh (planner.refresh) takes R = (r+1 [providers: look-up, ask] + 1 [records,
    asked of known peers] + 1 [view pull] + 1 [pings])·rtt, and r+1 more when the peers
    asked directly (the table's k closest and the connections) likely hold no copy of
    the record: E = (2k + C)·k/N copies expected among them, a miss when e^-E > 1 - q.
  Refreshes start wait_s after the last one ended: cycle = wait_s + R. An ad is read at
  a refresh's end, a DHT record at its start, so
    discover = min(hops·hop_s, 2(r+1)·rtt + R) + q·cycle.
  wait_s: REFRESH_S (5 s) in the background loop; WANTED_S (1 s) once a standby or a
  verifier found nobody; a consumer waiting for its first route looks again every
  RETRY_S (0.5 s) (the code's first_route/plan loop, not WANTED_S).
View pull (apart from the per-node figures: a consumer while it generates): every
  refresh asks up to VIEW_SAMPLE connected peers, those on the topic first, for the
  model's ads (learn_views); the min(T, VIEW_SAMPLE) peers on
  the topic answer min(n, MAX_VIEW_ADS/t) each (the reply is the first MAX_VIEW_ADS of
  the peer's whole view, then filtered): pulled = min(T, VIEW_SAMPLE)·that / cycle ads
  a second, costed
  as duplicate copies (a digest look-up each: assumed).

Left out: a provider's own publications (one signature a period); upload (forwarding
sends about what is received); DHT and connection upkeep (in cpu_s_idle, measured at
the bench's size); the dashboard's directory pulls; transfer time (a 1 MB view reply
takes longer than one rtt); IHAVE bytes growing with the ids in the window once A
passes the target; a node on several topics counts an ad heard on two as new on each
(the second is a cache hit: an over-estimate); control packed into one RPC per peer
across topics (counted per topic: an over-estimate); a new provider's first ads, sent
before its view is full, at the base period (transient).
"""

from __future__ import annotations

import dataclasses
import math

from .ad_intake import GOSSIP_LAZY, HEARTBEAT_S, MAX_VIEW_ADS, MESH_DEGREE, ad_period
from .ads import AD_PERIOD_S, MAX_STRETCHED_PERIOD_S
from .view import MAX_PEERS, VIEW_SAMPLE

# py-libp2p 0.8.1's (tests/unit/test_scale_model.py holds them to the library).
GOSSIP_WINDOW = 3  # heartbeats of message ids an IHAVE carries (GossipSub's gossip_window)
MAX_CONNECTIONS = 300  # ConnectionConfig.max_connections: no dial or accept past it
DHT_K = 20  # BUCKET_SIZE: replies, replicas
# SwarmPlanner's (pipeline/client/planner.py, a layer above net; the test holds them equal).
REFRESH_S, WANTED_S, RETRY_S = 5.0, 1.0, 0.5
P95 = 0.95


@dataclasses.dataclass(frozen=True)
class UnitCosts:
    """Measured by the bench; all per node."""

    cpu_s_per_copy: float  # take in one copy of an ad message (RPC decode, seen-cache, early drop)
    cpu_s_per_new_ad: float  # more for a new ad: pubsub signature, ad check, view offer, forwarding
    cpu_s_per_control: float  # per control message received (IHAVE/IWANT/GRAFT/PRUNE)
    cpu_s_idle: float  # per second with no ads at all (heartbeat, DHT upkeep, timers)
    bytes_per_ad: float  # wire bytes of one ad message copy
    bytes_per_control: float
    copies_per_ad: float  # copies of each new ad a topic member receives (GossipSub duplicates)
    control_per_s: float  # control messages received per second per followed topic with traffic
    hop_s: float  # one gossip hop's latency
    dht_rtt_s: float  # one DHT request/response
    # Connected peers on the topic the bench's nodes had when control_per_s was measured
    # (len(pubsub.peer_topics[topic])): 0, not measured, takes control flat.
    bench_topic_peers: float = 0.0

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise ValueError(f"unit cost {field.name} must be a finite number >= 0, not {value!r}")


@dataclasses.dataclass(frozen=True)
class Swarm:
    nodes: int
    models: int = 1
    provider_fraction: float = 1.0  # the rest consume: they follow topics but do not publish
    topics_per_node: int = 1  # topics each node follows
    connections: int | None = None  # a node's connections; None: min(nodes - 1, MAX_CONNECTIONS)

    def __post_init__(self) -> None:
        if not (isinstance(self.nodes, int) and self.nodes >= 1):
            raise ValueError(f"a swarm needs nodes >= 1, not {self.nodes!r}")
        if not (isinstance(self.models, int) and self.models >= 1):
            raise ValueError(f"a swarm needs models >= 1, not {self.models!r}")
        if not (isinstance(self.provider_fraction, int | float) and 0 < self.provider_fraction <= 1):
            raise ValueError(f"provider_fraction must be in (0, 1], not {self.provider_fraction!r}")
        if not (isinstance(self.topics_per_node, int) and 1 <= self.topics_per_node <= self.models):
            raise ValueError(f"topics_per_node must be 1..models ({self.models}), not {self.topics_per_node!r}")
        if self.connections is not None and not (isinstance(self.connections, int) and self.connections >= 0):
            raise ValueError(f"connections must be >= 0 or None, not {self.connections!r}")

    @property
    def links(self) -> int:
        """A node's connections: the given number, else the assumed one."""
        return min(self.nodes - 1, MAX_CONNECTIONS) if self.connections is None else self.connections

    @property
    def topic_size(self) -> float:
        return self.nodes * self.topics_per_node / self.models

    @property
    def providers(self) -> float:
        return self.topic_size * self.provider_fraction


@dataclasses.dataclass(frozen=True)
class Projection:
    nodes: int
    models: int
    topic_size: float
    providers_per_topic: float
    period_s: float  # each provider's stretched ad period
    ads_per_s_per_topic: float  # new ads a topic member hears per second
    msgs_per_node_s: float  # ad copies + control messages received per node per second
    cpu_share: float  # fraction of one core per node
    bytes_per_node_s: float  # received bandwidth
    gossip_hops: float
    discover_s: float  # new provider serving -> in a consumer's planner, at `quantile` of the refresh phase
    dht_hops: float  # rounds of one DHT look-up
    cap_s: float = MAX_STRETCHED_PERIOD_S
    control_per_s: float = 0.0  # control messages received per node per second (in msgs_per_node_s)
    topic_peers: float = 0.0  # connected peers on one topic (T)
    ihave_per_s: float = 0.0  # IHAVE per second per topic with traffic (GOSSIP_LAZY at most)
    discover_via: str = "ads"  # the faster path: "ads" or "dht"
    refresh_s: float = 0.0  # one planner refresh (R)
    pull_bytes_s: float = 0.0  # a generating consumer's view pulls, bytes/s (not in bytes_per_node_s)
    pull_cpu_share: float = 0.0  # and their CPU (not in cpu_share)


def counted_providers(providers: float, topics: int = 1) -> float:
    """The providers of one model a node can count: its view holds MAX_PEERS ads in all."""
    return min(providers, MAX_PEERS / topics)


def stretched_period(providers: float, *, topics: int = 1, cap_s: float = MAX_STRETCHED_PERIOD_S,
                     base_s: float = AD_PERIOD_S) -> float:
    """A provider's period on a topic of `providers` (net/ad_intake.ad_period, on what its view counts)."""
    return ad_period(counted_providers(providers, topics), base_s, cap_s=cap_s)


def gossip_hops(topic_size: float, degree: int = MESH_DEGREE[0]) -> int:
    """Hops for an ad to reach `topic_size` members: root to `degree`, then `degree`-1 new each."""
    if degree < 3:
        raise ValueError(f"a mesh degree of {degree} does not fan out")
    hops, reached, front = 1, 1.0 + degree, float(degree)
    while reached < topic_size:
        front *= degree - 1
        reached += front
        hops += 1
    return hops


def dht_rounds(nodes: float, k: int = DHT_K) -> int:
    """Rounds of one py-libp2p look-up among `nodes` DHT servers (module docstring)."""
    if nodes <= k:
        return 1
    return math.ceil(math.log(nodes / k) / math.log(k) - 1e-9) + 1


def ihave_per_s(topic_peers: float, degree: int = MESH_DEGREE[0]) -> float:
    """IHAVE a node sends (and so receives) per second on a topic with traffic."""
    outside = max(topic_peers - min(degree, topic_peers), 0.0)
    return min(outside, GOSSIP_LAZY) / HEARTBEAT_S


def topic_peers(swarm: Swarm, degree: int = MESH_DEGREE[0]) -> float:
    """Connected peers on one topic: a random share of the connections, at least a mesh."""
    others = swarm.topic_size - 1
    if swarm.nodes <= 1 or others <= 0:
        return 0.0
    return min(others, max(min(degree, others), swarm.links * others / (swarm.nodes - 1)))


def refresh_s(swarm: Swarm, rtt_s: float, quantile: float = P95) -> float:
    """One planner refresh: provider look-up, record fetch, view pull, pings (docstring)."""
    rounds = dht_rounds(swarm.nodes)
    expected = min(DHT_K, (2 * DHT_K + swarm.links) * DHT_K / swarm.nodes)
    fallback = rounds + 1 if math.exp(-expected) > 1 - quantile else 0
    return (rounds + 4 + fallback) * rtt_s


def _control_per_topic(costs: UnitCosts, peers: float, ads_per_s: float) -> float:
    """Control messages per second one followed topic brings: measured, IHAVE scaled."""
    with_traffic = 1 - math.exp(-ads_per_s * GOSSIP_WINDOW * HEARTBEAT_S)
    per_s = costs.control_per_s
    if costs.bench_topic_peers > 0:
        per_s = max(0.0, per_s + ihave_per_s(peers) - ihave_per_s(costs.bench_topic_peers))
    return with_traffic * per_s


def _check(cap_s: float, wait_s: float, quantile: float) -> None:
    if not (math.isfinite(cap_s) and cap_s > 0):
        raise ValueError(f"cap_s must be a positive number of seconds, not {cap_s!r}")
    if not (math.isfinite(wait_s) and wait_s >= 0):
        raise ValueError(f"wait_s must be >= 0 seconds, not {wait_s!r}")
    if not 0 <= quantile < 1:
        raise ValueError(f"quantile must be in [0, 1), not {quantile!r}")


def project(swarm: Swarm, costs: UnitCosts, *, cap_s: float = MAX_STRETCHED_PERIOD_S, wait_s: float = REFRESH_S,
            quantile: float = P95, base_s: float = AD_PERIOD_S) -> Projection:
    """Per-node membership cost of `swarm` (formulas: the module docstring)."""
    _check(cap_s, wait_s, quantile)
    t, providers = swarm.topics_per_node, swarm.providers
    period = stretched_period(providers, topics=t, cap_s=cap_s, base_s=base_s)
    ads = providers / period
    peers = topic_peers(swarm)
    new = ads * t
    copies = new * costs.copies_per_ad
    control = _control_per_topic(costs, peers, ads) * t
    cpu = costs.cpu_s_idle + copies * costs.cpu_s_per_copy + new * costs.cpu_s_per_new_ad \
        + control * costs.cpu_s_per_control
    hops, rounds = gossip_hops(swarm.topic_size), dht_rounds(swarm.nodes)
    refresh = refresh_s(swarm, costs.dht_rtt_s, quantile)
    ad_path, dht_path = hops * costs.hop_s, 2 * (rounds + 1) * costs.dht_rtt_s + refresh
    cycle = wait_s + refresh
    counted = counted_providers(providers, t)
    pulled = min(peers, VIEW_SAMPLE) * min(counted, MAX_VIEW_ADS / t) / cycle if cycle > 0 else 0.0
    return Projection(
        nodes=swarm.nodes, models=swarm.models, topic_size=swarm.topic_size, providers_per_topic=providers,
        period_s=period, ads_per_s_per_topic=ads, msgs_per_node_s=copies + control, cpu_share=cpu,
        bytes_per_node_s=copies * costs.bytes_per_ad + control * costs.bytes_per_control,
        gossip_hops=hops, discover_s=min(ad_path, dht_path) + quantile * cycle, dht_hops=rounds, cap_s=cap_s,
        control_per_s=control, topic_peers=peers, ihave_per_s=ihave_per_s(peers),
        discover_via="ads" if ad_path <= dht_path else "dht", refresh_s=refresh,
        pull_bytes_s=pulled * costs.bytes_per_ad, pull_cpu_share=pulled * costs.cpu_s_per_copy)


def table(costs: UnitCosts, nodes: tuple[int, ...] = (100, 1000, 10000), models: tuple[int, ...] = (1, 5, 20), *,
          provider_fraction: float = 1.0, topics_per_node: int = 1, connections: int | None = None,
          **kw: float) -> list[Projection]:
    """`project` over every (nodes, models) pair; `kw` goes to project (cap_s, wait_s, ...)."""
    return [project(Swarm(n, m, provider_fraction, topics_per_node, connections), costs, **kw)
            for n in nodes for m in models]


COLUMNS = (("nodes", "nodes", "{:.0f}"), ("models", "mod", "{:.0f}"), ("cap_s", "cap", "{:.0f}"),
           ("providers_per_topic", "prov/t", "{:.0f}"), ("period_s", "period", "{:.1f}"),
           ("ads_per_s_per_topic", "ads/s", "{:.2f}"), ("msgs_per_node_s", "msgs/s", "{:.1f}"),
           ("control_per_s", "ctl/s", "{:.1f}"), ("cpu_share", "cpu%", "{:.2%}"),
           ("bytes_per_node_s", "kB/s", "{:.1f}"), ("gossip_hops", "hops", "{:.0f}"),
           ("dht_hops", "dht", "{:.0f}"), ("discover_s", "disc_s", "{:.2f}"),
           ("discover_via", "via", "{}"), ("pull_bytes_s", "pullMB/s", "{:.2f}"))


def format_table(rows: list[Projection]) -> str:
    """The projections as a fixed-width text table (kB and MB are 1,000 and 10^6 bytes)."""
    scale = {"bytes_per_node_s": 1e-3, "pull_bytes_s": 1e-6}

    def cell(row: Projection, name: str, fmt: str) -> str:
        value = getattr(row, name)
        return fmt.format(value * scale[name] if name in scale else value)

    cells = [[title for _, title, _ in COLUMNS]] + [[cell(r, n, f) for n, _, f in COLUMNS] for r in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(line, widths, strict=True)) for line in cells)


def fit_idle_cpu(measured_cpu_share: float, swarm: Swarm, costs: UnitCosts, **kw: float) -> float:
    """cpu_s_idle as the residual of a measured per-node CPU share once the model's
    message costs (with `costs`' own idle ignored) are taken off."""
    busy = project(swarm, dataclasses.replace(costs, cpu_s_idle=0.0), **kw).cpu_share
    idle = measured_cpu_share - busy
    if not (math.isfinite(idle) and idle >= 0):
        raise ValueError(f"the message costs alone ({busy:.4f} of a core) exceed the measured "
                         f"{measured_cpu_share:.4f}: the unit costs are too high")
    return idle
