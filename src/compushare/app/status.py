"""`compushare status`: the swarm as the ads describe it, and this node's part in it;
`compushare karma`: one peer's karma.

A short-lived client with a throwaway identity (so it never collides with a node
running on the same data dir) joins through the local node if one runs, else the
bootstrap peers, and asks the peers it reaches for their views. Every ad is
re-checked against its own signer, so a relaying peer cannot invent members.
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

import trio
from libp2p.crypto.ed25519 import create_new_key_pair

from .api.client import call as control_call
from ..config import STATE_FILE, TRAIN_DIR, TRAIN_STATE_FILE
from ..errors import SwarmUnreachable
from ..model.store import ModelStore
from ..net.gossip import learn_views
from ..net.peer import open_swarm_host
from ..net.view import SwarmView, coverage
from ..karma.record import karma_validators
from ..karma.service import KarmaReport, karma_of
from .swarm import is_our_node
from rich.markup import escape
from rich.table import Table

JOIN_TIMEOUT_S = 15.0
VIEW_WAIT_S = 30.0  # for a first answer with a view
VIEW_RETRY_S = 0.5
KARMA_TIMEOUT_S = 10.0
MAX_KARMA_LOOKUPS = 64
MAX_FIXED = 12  # status's columns that never wrap (peer text in them folds past this)


def local_node(data_dir: Path) -> dict | None:
    """The state of a node running on this data dir, if one is."""
    path = data_dir / STATE_FILE
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) and is_our_node(state.get("pid", -1)) else None


def roles_of(state: dict | None) -> list[str]:
    if state is None:
        return ["consumer"]
    span = f"{state.get('start')}:{state.get('end')}"
    mode = f"{state.get('state', 'serving')}, {state.get('placement', 'fixed')} placement"
    provider = f"provider of blocks {span} ({mode})"
    return ["consumer", provider]


def summarize(view: SwarmView, data_dir: Path, local: dict | None, *, now: float, asked: int) -> dict:
    peers = []
    for ad in view.live(now):
        peers.append({
            "peer_id": ad.peer_id,
            "addrs": list(ad.addrs),
            "version": ad.version,
            "hardware": ad.hardware.to_wire(),
            "age_s": round(max(0.0, now - ad.sent), 1),
            "serving": [s.to_wire() for s in ad.serving],
            "private": any(s.private_rate > 0 for s in ad.serving),  # serves encrypted (private) sessions
            "reach": ad.reach,  # its own AutoNAT's verdict: public, private (behind NAT) or unknown
            "relay": ad.relay,  # relays for NAT'd peers
        })
    store = ModelStore(data_dir)
    models = {}
    for model_id in sorted(view.models(now)):
        servers = [(ad, s) for ad, s in view.servers(model_id, now)]
        stored = store.get(model_id)
        num_blocks = stored.num_blocks if stored else max(s.end for _, s in servers)
        ready = [(ad, s) for ad, s in servers if s.state == "serving"]
        counts = coverage(ready, num_blocks)
        models[model_id] = {
            "name": next((a for a, i in store.aliases().items() if i == model_id), None),
            "num_blocks": num_blocks,
            "coverage": counts,
            "loading": coverage([(ad, s) for ad, s in servers if s.state == "loading"], num_blocks),
            "holes": [b for b, c in enumerate(counts) if c == 0],
        }
    return {
        "time": now,
        "peers_asked": asked,
        "peers": peers,
        "models": models,
        "this_node": {"roles": roles_of(local), "state": local},
    }


async def gather_status(data_dir: Path, bootstrap: tuple[str, ...]) -> dict:
    local = local_node(data_dir)
    if local is not None:
        bootstrap = tuple(local["addrs"][:1]) + tuple(bootstrap)
    view = SwarmView()
    scores: dict[str, float] = {}
    async with open_swarm_host(create_new_key_pair(), server=False, validators=karma_validators(),
                               bootstrap=bootstrap, join=False) as swarm:
        host, dht = swarm.host, swarm.dht
        with trio.fail_after(JOIN_TIMEOUT_S):
            await swarm.join()
        # A busy node (loading a span, say) can miss one request's deadline: ask again
        # until one answers, rather than report an empty swarm.
        answered = 0
        with trio.move_on_after(VIEW_WAIT_S):
            while not (answered := await learn_views(host, view)):
                await trio.sleep(VIEW_RETRY_S)
        if not answered:
            raise SwarmUnreachable(f"no peer answered with its view of the swarm within {VIEW_WAIT_S:.0f} s")
        asked = len(host.get_network().connections)
        peers = [ad.peer_id for ad in view.live(time.time())][:MAX_KARMA_LOOKUPS]

        async def one(peer: str) -> None:
            with contextlib.suppress(Exception):  # unknown, shown as such
                scores[peer] = (await karma_of(host, dht, peer)).score

        with trio.move_on_after(KARMA_TIMEOUT_S):  # what is not checked by then shows as unknown
            async with trio.open_nursery() as nursery:
                for peer in peers:
                    nursery.start_soon(one, peer)
    status = summarize(view, data_dir, local, now=time.time(), asked=asked)
    status["training"] = training_summary(data_dir)
    for peer in status["peers"]:
        peer["karma"] = scores.get(peer["peer_id"])
    if local is not None and local.get("api"):  # the daemon's own figures, through its control API
        with contextlib.suppress(Exception):
            status["this_node"]["daemon"] = await trio.to_thread.run_sync(
                control_call, data_dir, local["api"], "/control/status")
    return status


async def read_karma(bootstrap: tuple[str, ...], peer_id: str, timeout_s: float = 30.0) -> KarmaReport:
    """`compushare karma`: join through `bootstrap` with a throwaway identity (a node
    may be running on this data dir) and compute `peer_id`'s karma."""
    async with open_swarm_host(create_new_key_pair(), server=False, validators=karma_validators(),
                               bootstrap=bootstrap, join=False) as swarm:
        with trio.fail_after(timeout_s):
            await swarm.join()
            return await karma_of(swarm.host, swarm.dht, peer_id)


def training_summary(data_dir: Path) -> dict | None:
    """The training run of this data dir's participant (`compushare train`), if any:
    its state file and a line saying where it stands."""
    try:
        state = json.loads((Path(data_dir) / TRAIN_DIR / TRAIN_STATE_FILE).read_text())
        return {"state": state, "line": train_line(state)}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def train_line(state: dict) -> str:
    loss = f"{state['loss']:.4f}" if state.get("loss") is not None else "-"
    return (f"run {state['run'][:12]} ({state['name']}): round {state['round']} of {state['rounds']}"
            f"{' (finished)' if state.get('finished') else ''}, loss {loss}, {len(state['members'])} members, "
            f"{state['averaged']} rounds averaged, {state['alone']} alone, {len(state['excluded'])} excluded, "
            f"{state['sent_bytes'] / 1e6:.1f} MB sent")


def ready_line(state: dict) -> str:
    """What a node serves, once it does (node.json's `state`): the line `node` prints."""
    model_id, name = state["model_id"], state.get("model_name")
    model = f"{name} ({model_id[:12]})" if name and name != model_id else model_id[:12]
    api = state.get("api")
    where = (f"API {api} (dashboard {api}/dashboard, chat {api}/chat; token in the data dir)" if api
             else "API off")
    return (f"ready: serving {model} blocks {state['start']}:{state['end']} of {state['num_blocks']} in "
            f"{state.get('format', '?')}; {where}; peer {state['peer_id']}")


def private_line(stats: dict | None) -> str:
    """This node's private sessions (node.status()["private"]: PrivateServer.stats())."""
    if stats is None:
        return "private sessions: not served (node --no-private)"
    refused = sum(stats.get("refused", {}).values())
    return (f"private sessions: served ({stats['sessions']} so far, {stats['requests']} encrypted requests), "
            f"{stats['compute_s']:.1f} s of HE compute, {refused} refused, {stats['worker_restarts']} worker "
            f"restarts, {stats['held_mb']:.1f} MB held")


def memory_line(memory: dict) -> str:
    """What this node's span holds against its memory budget, in one line."""
    on = f" on {memory['device']}" if memory.get("device", "cpu") != "cpu" else ""
    return (f"memory{on}: {memory['blocks']} blocks in {memory['format']}: weights {memory['weights_mb']:.0f} MB, "
            f"KV up to {memory['kv_mb']:.0f} MB ({memory['kv_tokens']} tokens), private pre-encoding up to "
            f"{memory['private_mb']:.0f} MB, of a {memory['budget_mb']} MB budget")


def net_line(net: dict) -> str:
    """This node's reachability, relays held and relaying, in one line."""
    reach = net.get("reachability", "unknown")
    line = {"public": "publicly reachable", "private": "behind NAT",
            "unknown": "reachability not known yet"}.get(reach, reach)
    if net.get("relays"):
        line += f", reachable through {len(net['relays'])} relays"
    relay = net.get("relay")
    if net.get("relay_offered") and relay:
        refused = sum(relay.get("refusals", {}).values())
        line += (f"; relays for {relay.get('reservations', 0)} peers, {relay.get('circuits_open', 0)} circuits open, "
                 f"{relay.get('relayed_bytes', 0) / 1e6:.1f} MB relayed, {refused} refusals over quota")
    return line


def _table(title: str, columns: tuple[tuple[str, bool], ...]) -> Table:
    """A table that fits 80 columns without cutting a word: short, known figures never
    wrap (`True`), the rest wrap at spaces (rich narrows the widest first), and a
    peer's own text (a GPU name, a version) folds rather than ends in an ellipsis."""
    table = Table(title=title, title_justify="left")
    for header, fixed in columns:
        table.add_column(header, no_wrap=fixed, overflow="fold", max_width=MAX_FIXED if fixed else None)
    return table


def peers_table(status: dict) -> Table:
    """Who the peers are: karma, reachability, hardware, version (a row per peer)."""
    table = _table(f"{len(status['peers'])} peers (views of {status['peers_asked']} asked)",
                   (("peer", True), ("karma", True), ("reach", False), ("hardware", False), ("version", True),
                    ("ad age", True)))
    for peer in status["peers"]:
        hw = peer["hardware"]
        gpu = f", {escape(hw['gpu'])} {hw['gpu_mb']} MB" if hw["gpu"] else ""
        table.add_row(peer["peer_id"][-12:], f"{peer['karma']:.2f}" if peer.get("karma") is not None else "?",
                      peer.get("reach", "unknown") + (", relays" if peer.get("relay") else ""),
                      f"{hw['cpu']} cpu, {hw['ram_mb'] // 1024} GiB{gpu}", escape(peer["version"]),
                      f"{peer['age_s']:.1f}s")
    return table


def spans_table(status: dict) -> Table:
    """What the peers serve: a row per span (model, format, blocks; state, load)."""
    table = _table("spans served", (("peer", True), ("serves", False), ("state", True), ("private", True),
                                    ("free KV", True), ("load", True), ("blocks/s", True)))
    for peer in status["peers"]:
        for s in peer["serving"]:
            table.add_row(peer["peer_id"][-12:], f"{s['model'][:8]} {escape(s.get('fmt', ''))} {s['start']}:{s['end']}",
                          s["state"], "yes" if s.get("priv", 0) > 0 else "no", str(s["free"]), f"{s['load']:.0%}",
                          f"{s['rate']:.0f}")
    return table


def render(status: dict, console) -> None:
    """Human-readable status with rich: peers, the spans they serve, then one bar
    per block per model; it fits 80 columns, wrapping at words. Text from ads
    (versions, GPU names) is a peer's: escaped, never markup."""
    roles = status["this_node"]["roles"]
    console.print(f"[bold]this node[/bold]: {', '.join(roles)}", soft_wrap=False)
    daemon = status["this_node"].get("daemon")
    if daemon:
        karma = daemon.get("karma", {})
        console.print(f"  karma {karma.get('score', 1.0):.3f} from its ledger ({karma.get('receipts', 0)} receipts, "
                      f"{karma.get('compute_ms', 0) / 1000:.1f} s of compute), {daemon.get('tokens_served', 0)} "
                      f"tokens served, API {daemon.get('api')}", highlight=False, soft_wrap=False)
        if "private" in daemon:
            console.print(f"  {private_line(daemon['private'])}", highlight=False, soft_wrap=False)
        if daemon.get("net"):
            console.print(f"  {net_line(daemon['net'])}", highlight=False, soft_wrap=False)
        if daemon.get("memory"):
            console.print(f"  {memory_line(daemon['memory'])}", highlight=False, soft_wrap=False)
    if status.get("training"):
        console.print(f"  training: {status['training']['line']}", highlight=False, soft_wrap=False)
    console.print(peers_table(status))
    console.print(spans_table(status))
    for model_id, model in status["models"].items():
        name = f" ({model['name']})" if model["name"] else ""
        console.print(f"[bold]coverage of {model_id[:12]}{name}[/bold]: servers per block")
        for block, count in enumerate(model["coverage"]):
            loading = model["loading"][block]
            bar = "█" * count + "░" * loading
            color = "red" if count == 0 else "yellow" if count == 1 else "green"
            extra = f" (+{loading} loading)" if loading else ""
            console.print(f"  {block:>4} [{color}]{bar or '·'}[/{color}] {count}{extra}", highlight=False,
                          soft_wrap=False)
        if model["holes"]:
            console.print(f"  [red]uncovered blocks: {', '.join(map(str, model['holes']))}[/red]", soft_wrap=False)

