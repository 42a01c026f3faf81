"""Node.run(): the one nursery that owns every task of a provider node.

Start-up runs in phases, each a method of Node: identity (hardware, device, key),
store (the model asked for), host (seeding, karma, gossip, reachability), DHT (join
and the loops that keep it fresh), services (the HTTP API, the span, private mode)
and announce (the records that bring consumers); startup.py holds their parts that
need no Node."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Callable

import torch
import trio

from .. import defences
from ..config import LISTEN_FILE, PID_FILE, STATE_FILE, NodeConfig, Span
from ..gc_policy import startup_done
from ..hardware import detect_hardware, resolve_device
from .api.auth import TOKEN_FILE
from .api.server import serve_api
from .debug import FaultInjection
from .history import History, Sample, count_reaches
from .progress import Progress
from ..karma.record import karma_validators
from ..karma.rules import base_score
from ..karma.service import KARMA_PROTOCOL, KarmaBook, KarmaService
from ..model.catalog import DEFAULT_MODEL
from ..model.store import ModelStore, StoredModel, is_model_id
from ..net.dht import find_model_providers, routing_sync_loop
from ..net.directory import Directory
from ..net.gossip import Gossip, learn_views
from ..net.host import advertised_addrs, full_addrs
from ..net.identity import load_or_create_identity
from ..net.peer import open_swarm_host
from ..net.records import MAX_ADDRS
from ..net.traversal import Traversal
from ..net.view import MAX_PEERS, SwarmView, relay_candidates
from ..pipeline.server.announce import announce_loop
from ..he.ckks import DEFAULT_PARAMETERS
from ..pipeline.protocol import INFER_PROTOCOL
from ..pipeline.server.private import PrivateServer
from ..pipeline.server.private_pool import HEWorker
from ..pipeline.server.provider import Provider, block_cost, memory_state
from ..pipeline.server.inference import InferenceServer
from ..pipeline.server.training import TrainingServer
from ..runtime import stop_on_signal, write_json, write_state
from .startup import (SpanMemory, ad_maker, api_app, check_span, first_span, held_model, model_id_from_swarm,
                      self_benchmark, serve_training, span_memory)
from .status import summarize, training_summary
from ..torrent.service import Torrent

log = logging.getLogger(__name__)

COMPUTE_SWITCH_INTERVAL_S = 50e-6  # CPython's default is 5 ms
# The dashboard's karma of peers: a peer new in view is checked within KARMA_TICK_S
# (KarmaBook says who is due: rechecks and retries are slower); a round takes at most KARMA_ROUND_S.
KARMA_TICK_S = 5.0
KARMA_ROUND_S = 30.0
KARMA_NEWCOMERS = 32  # newcomers (no evidence yet) checked per round
NET_STATE_PERIOD_S = 2.0


def tune_process(config: NodeConfig) -> None:
    if defences.disabled_now():
        log.warning("DEFENCES SWITCHED OFF (tests only): %s", ", ".join(defences.disabled_now()))
    torch.set_num_threads(config.torch_threads)
    # Prefills and long steps run in worker threads beside this loop (short decode
    # steps run on it: pipeline/server/compute.Compute.runs_inline). Every torch op lets go of the
    # GIL; at CPython's default 5 ms switch interval the loop, once it has the GIL,
    # keeps it for its whole burst of network work (py-libp2p is pure Python) while
    # the forward waits. A short interval interleaves the two: the loop runs while
    # the forward is inside an op (bench/compute_beside_loop.py).
    sys.setswitchinterval(COMPUTE_SWITCH_INTERVAL_S)


class Node:
    def __init__(self, config: NodeConfig, faults: FaultInjection = FaultInjection(),
                 progress: Progress | None = None) -> None:
        self.config = config
        self.faults = faults  # tests' misbehaving nodes only (debug.py)
        self.progress = progress or Progress()  # the model's conversion, the span's fetching (stderr)
        self.view = SwarmView()
        self.swarm, self.key_pair = None, None  # the libp2p host and its DHT (net/peer.py), once open
        self.me = ""  # this node's peer id
        self.gossip: Gossip | None = None
        self.directory: Directory | None = None
        self.provider: Provider | None = None
        self.private: PrivateServer | None = None  # /compushare/private, when config.private
        self.training: TrainingServer | None = None  # /compushare/train, once a span is served
        self.torrent: Torrent | None = None
        self.karma: KarmaService | None = None
        self.karma_book = KarmaBook()  # the karma of peers in view, checked in the background
        self.traversal: Traversal | None = None  # reachability, relays, hole punching (net/traversal.py)
        self.downloads: dict[str, dict] = {}  # span weights being fetched: blocks, done, total bytes
        self.fetched: list[dict] = []  # downloads of span weights (node.json shows them)
        self._memory: Callable[[], dict] | None = None  # what the span holds against the memory budget
        self.hardware, self.device = None, "cpu"  # device: where the span computes (config.device, resolved)
        self._state: dict = {}
        self.last_state: dict = {}  # node.json as last written

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        pid_file = self.config.data_dir / PID_FILE
        self.config.data_dir.mkdir(parents=True, exist_ok=True)
        pid_file.write_text(f"{os.getpid()}\n")  # `compushare stop` and `node --detach` read it
        try:
            await self._run(task_status=task_status)
        finally:
            self.progress.close()
            with contextlib.suppress(OSError, ValueError):  # only our own: a newer node may have replaced it
                if int(pid_file.read_text()) == os.getpid():
                    pid_file.unlink()

    async def _run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        config = self.config
        tune_process(config)
        name = config.model or DEFAULT_MODEL
        model = held_model(config, name, on_stage=self.progress.stage,  # store (None: the swarm says, once joined)
                           progress=self.progress.update)
        check_span(config.blocks, model)
        self._identify()
        async with open_swarm_host(self.key_pair, server=True, validators=karma_validators(), listen=config.listen,
                                   bootstrap=config.bootstrap, join=False) as swarm:
            self._open_host(swarm)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(stop_on_signal, nursery.cancel_scope)
                await self._join_dht(nursery)
                api_url = await self._serve_api(nursery, name)
                if model is None:
                    model = await self._model_from_swarm(name)
                provider = await self._serve_span(nursery, model, name, api_url)
                state = await self._announce(nursery, provider)
                task_status.started(state)
                try:
                    await trio.sleep_forever()
                finally:
                    await self._stopped()

    # -- the phases of start-up -----------------------------------------------------------

    def _identify(self) -> None:
        """Identity: the hardware, where the span computes, and the node's key."""
        self.hardware = detect_hardware()
        self.device = resolve_device(self.config.device, torch.cuda.is_available())
        self.key_pair = load_or_create_identity(self.config.data_dir)

    def _open_host(self, swarm) -> None:
        """Host: the services on it before it joins: seeding, karma, ads, reachability."""
        config, host, dht = self.config, swarm.host, swarm.dht
        self.swarm, self.me = swarm, host.get_id().to_string()
        self.torrent = Torrent(host, dht, config.data_dir, self.view)
        self.torrent.start_seeding()
        self.karma = KarmaService(host, dht, self.key_pair, config.data_dir)
        host.set_stream_handler(KARMA_PROTOCOL, self.karma.handle)
        make_our_ad = ad_maker(self.key_pair, self.me, host, self.hardware, config, self)
        self.gossip = Gossip(host, self.view, make_our_ad, period_s=config.ad_period_s,
                             find_providers=lambda model_id: find_model_providers(dht, model_id))
        self.directory = Directory(host, self.view)  # the models it does not follow, for its UI
        self.traversal = Traversal(
            host, serve=True, relay=config.relay, quotas=config.relay_quotas, punch=config.hole_punch,
            relay_candidates=lambda: relay_candidates(self.view, self.me, time.time()),
            own_addrs=lambda: full_addrs(host), max_addrs=MAX_ADDRS, on_change=self._net_changed, dht=dht)

    def _net_changed(self) -> None:
        # Reachability or relays changed: peers must learn the new addresses now
        # (ad at once, server record at once), not at their next refresh.
        self.gossip.publish_soon()
        if self.provider is not None:
            self.provider.notify_change()

    async def _join_dht(self, nursery: trio.Nursery) -> None:
        """DHT: reachable, gossiping and joined; the loops that keep routing and karma fresh."""
        host, dht = self.swarm.host, self.swarm.dht
        await nursery.start(self.traversal.run)
        await nursery.start(self.gossip.run)  # before dialling: pubsub learns peers from connections
        await self.swarm.join(attempts=None)
        # Dialable and seeding from here on: `swarm up` starts the others now, to fetch their spans meanwhile.
        write_json(self.config.data_dir / LISTEN_FILE, {"pid": os.getpid(), "peer_id": self.me,
                                                        "addrs": advertised_addrs(host)})
        nursery.start_soon(routing_sync_loop, host, dht)
        nursery.start_soon(self.karma.publish_loop)
        nursery.start_soon(self.karma.provide_reports_loop)
        nursery.start_soon(karma_watch_loop, self.view, self.karma_book, host, dht)
        nursery.start_soon(self.directory.run)

    async def _serve_api(self, nursery: trio.Nursery, name: str) -> str | None:
        """Services: the local HTTP API (None: switched off)."""
        config = self.config
        if config.api_port < 0:
            return None
        api_url = await nursery.start(serve_api, api_app(self, name, NodeControl(self, nursery)), config.api_port)
        log.info("local API (OpenAI-compatible, token in %s) on %s", config.data_dir / TOKEN_FILE, api_url)
        return api_url

    async def _model_from_swarm(self, name: str) -> StoredModel:
        """Store: the manifest of the model `name` stands for, from the swarm."""
        await learn_views(self.swarm.host, self.view)  # a newcomer sees the swarm at once
        model_id = await model_id_from_swarm(self.swarm.host, self.swarm.dht, self.config, name)
        model = await self.torrent.obtain_manifest(model_id)
        if model_id != name:
            ModelStore(self.config.data_dir).set_alias(name, model_id)
        check_span(self.config.blocks, model)
        return model

    async def _serve_span(self, nursery: trio.Nursery, model: StoredModel, name: str,
                          api_url: str | None) -> Provider:
        """Services: benchmark, then load and serve the first span the memory allows."""
        config, host = self.config, self.swarm.host
        provider = self.provider = Provider(
            model, self._inference_server, block_rate=0.0, slowdown=self.faults.slowdown, prepare=self._fetch_span,
            name="" if is_model_id(name) else name, claimed_format=self.faults.claim_format, device=self.device,
            runtime=config.runtime, threads=config.torch_threads)
        await self_benchmark(provider, config, self.faults.slowdown, self.device)
        memory = span_memory(self.device, self.hardware)
        self.gossip.follow(model.model_id)  # its servers' ads, heard while the first span is chosen
        span, length = await first_span(provider, config, memory, host, self.view, self.me)
        self._state = {"pid": os.getpid(), "peer_id": self.me, "addrs": advertised_addrs(host),
                       "model_id": model.model_id, "model_name": name, "num_blocks": model.num_blocks,
                       "max_blocks": length, "placement": "fixed" if config.blocks is not None else "automatic",
                       "block_rate": provider.block_rate, "device": memory.where, "started": time.time(),
                       "api": api_url}
        provider.on_change = self._provider_changed
        await provider.serve(span)
        provider.server.enable_push(host, nursery, forge=self.faults.forge_push)
        host.set_stream_handler(INFER_PROTOCOL, provider.server.rpc_infer)
        self._serve_private(provider, memory)
        self.training = serve_training(host, provider, config, memory)
        return provider

    def _inference_server(self, runner) -> InferenceServer:
        provider = self.provider
        return InferenceServer(runner, provider.model.model_id, self.config.limits, key_pair=self.key_pair,
                               block_rate=provider.block_rate, noise=self.faults.noise, karma=self.karma.receipts,
                               slow_steps=self.faults.slow_steps_plan())

    def _provider_changed(self) -> None:
        self.gossip.publish_soon()
        if self.provider.server is not None:
            self._write_state(self.provider)

    def _serve_private(self, provider: Provider, memory: SpanMemory) -> None:
        """Services: private mode, its pre-encoded weights in what the span leaves of the budget."""
        config, model, kv_tokens = self.config, provider.model, self.config.limits.kv_budget_tokens
        runtime, budget_mb = provider.span_runtime, memory.weights_budget_mb(config.memory_budget_mb)
        private_budget = memory.private_budget(config.memory_budget_mb, block_cost(model, kv_tokens, runtime))
        self._memory = lambda: memory_state(model, provider.span, budget_mb, kv_tokens, private_budget,
                                            memory.where, runtime) | {"held_mb": memory.held_mb,
                                                                      "given_mb": config.memory_budget_mb}
        if not config.private:
            return
        worker = HEWorker(model.path, params=DEFAULT_PARAMETERS, preencode=config.private_preencode,
                          workers=config.limits.compute_threads, budget_bytes=private_budget, noise=self.faults.noise)
        self.private = PrivateServer(provider, worker, self.key_pair, slow_steps=self.faults.slow_steps_plan())
        provider.private_rate = self.private.rate
        self.private.serve_on(self.swarm.host)

    async def _announce(self, nursery: trio.Nursery, provider: Provider) -> dict:
        """Announce: the span's server and seed records, rebalancing, node.json."""
        config, host, dht = self.config, self.swarm.host, self.swarm.dht
        nursery.start_soon(provider.server.expire_loop)
        await nursery.start(announce_loop, host, dht, self.key_pair, provider, config.record_ttl_s)
        # Seed records after the serving records: py-libp2p serves at most 12
        # inbound DHT streams per node, and a burst of both at start-up can
        # have some ADD_PROVIDERs silently dropped.
        nursery.start_soon(self.torrent.announce_loop)
        if config.blocks is None:
            nursery.start_soon(provider.rebalance_loop, self.view, self.me, config.ad_period_s)
        state = self._write_state(provider)
        nursery.start_soon(self._net_state_loop, provider)
        startup_done()  # the span's weights and modules live as long as the node
        log.info("serving blocks %s of %s as %s on %s", provider.span, provider.model.model_id[:12], self.me,
                 ", ".join(state["addrs"]))
        return state

    async def _stopped(self) -> None:
        (self.config.data_dir / STATE_FILE).unlink(missing_ok=True)
        if self.private is not None:
            with trio.CancelScope(shield=True):
                await self.private.worker.aclose()

    # -- while it runs ------------------------------------------------------------------------

    async def _net_state_loop(self, provider: Provider) -> None:
        """node.json follows the node's reachability, relays and relaying (tests and
        `swarm` read it) within NET_STATE_PERIOD_S."""
        last = None
        while True:
            await trio.sleep(NET_STATE_PERIOD_S)
            now = (self.traversal.addrs(), self.traversal.stats())
            if now != last and provider.server is not None:
                self._write_state(provider)
                last = now

    async def _fetch_span(self, span: Span) -> None:
        """Fetch the weights of `span` from the swarm's seeders if this node lacks them."""
        model = self.provider.model
        if model.holds(blocks=(span.start, span.end)):
            return
        key = str(span)
        self.progress.stage(f"fetching blocks {span} of {model.model_id[:12]} from the swarm")

        def progress(done: int, total: int) -> None:
            self.downloads[key] = {"blocks": [span.start, span.end], "done": done, "total": total,
                                   "finished": False}
            self.progress.update(done, total)

        try:
            result = await self.torrent.fetch(model.model_id, blocks=(span.start, span.end), progress=progress)
        finally:
            self.downloads.pop(key, None)
        self.fetched.append({"blocks": [span.start, span.end], "bytes": result.bytes, "seconds": result.seconds,
                             "bytes_from": result.bytes_from, "banned": result.banned})
        log.info("fetched blocks %s: %.1f MB in %.1fs from %d seeders", span, result.bytes / 1e6,
                 result.seconds, len(result.bytes_from))

    def _write_state(self, provider: Provider) -> dict:
        span = provider.span
        state = dict(self._state, start=span.start, end=span.end, state=provider.state, moves=provider.moves,
                     fetched=self.fetched,
                     parameters=provider.server.runner.parameter_count() if provider.server else 0,
                     format=provider.format_label, memory=self._memory() if self._memory is not None else None)
        if self.traversal is not None:  # reachability and relays change while it runs
            state.update(addrs=self.traversal.addrs(), net=self.traversal.stats())
        write_state(self.config.data_dir, state)
        self.last_state = state
        return state


class NodeControl:
    """The control API (api/app.Control) of a running node: its state, the dashboard's
    view of the swarm and recent history (sampled by a task in `nursery`), pause and
    resume."""

    def __init__(self, node: Node, nursery: trio.Nursery | None = None) -> None:
        self.node = node
        self.history = History()
        if nursery is not None:
            nursery.start_soon(self.history_loop)

    def status(self) -> dict:
        """The node's state and its own ledger's karma (before any failure reports
        against it, which others hold)."""
        node = self.node
        status = dict(node.last_state)
        if node.karma is not None:
            tally = node.karma.receipts.tally()
            status["karma"] = {"score": base_score(tally.compute_ms), "compute_ms": tally.compute_ms,
                               "receipts": len(node.karma.receipts.ledger), "counted": tally.counted}
        server = node.provider.server if node.provider is not None else None
        status["tokens_served"] = server.tokens_served if server is not None else 0
        status["sessions"] = len(server.sessions) if server is not None else 0  # open now
        status["throughput"] = server.throughput() if server is not None else 0.0
        status["pushed_steps"] = server.push_hits if server is not None else 0  # started by a push
        # Decode steps of several sessions computed as one forward (and how many forwards).
        status["batched_steps"] = server.compute.batched_steps if server is not None else 0
        status["batches"] = server.compute.batches if server is not None else 0
        if node.provider is not None:
            status["state"] = node.provider.state
        status["private"] = node.private.stats() if node.private is not None else None
        if node.traversal is not None:
            status["net"] = node.traversal.stats()
            status["addrs"] = node.traversal.addrs()
        if node.gossip is not None:  # what it hears of ads, and at what cost (net/ad_intake.py)
            intake = node.gossip.intake
            status["ads"] = {"followed": sorted(intake.followed), "period_s": node.gossip.period_now,
                             "heard": dict(intake.heard), "checks": dict(intake.counts)}
        return status

    def dashboard(self) -> dict:
        """Everything the dashboard shows: this node, the swarm as its ads tell it
        (with each peer's karma as checked in the background), downloads."""
        node, now = self.node, time.time()
        summary = summarize(node.directory.picture(), node.config.data_dir, node.last_state or None, now=now, asked=0)
        for peer in summary["peers"]:
            peer["karma"] = node.karma_book.known(peer["peer_id"])
            peer["heard"] = node.view.get(peer["peer_id"], now) is not None  # else pulled for the UI only
        downloads = [dict(d, finished=True, done=d["bytes"], total=d["bytes"]) for d in node.fetched]
        return {"node": self.status(), "peers": summary["peers"], "models": summary["models"],
                "downloads": downloads + list(node.downloads.values()), "history": self.history.to_json(),
                "training": training_summary(node.config.data_dir)}

    def sample(self, now: float) -> Sample:
        """What the dashboard's charts follow, now: this node's served steps and tokens,
        its KV budget, and the peers it knows by their reachability."""
        node = self.node
        server = node.provider.server if node.provider is not None else None
        reaches = count_reaches([ad.reach for ad in node.directory.picture(look=False).live(now)
                                 if ad.peer_id != node.me])
        if server is None:
            return Sample(now, **reaches)
        return Sample(now, steps=server.steps_served, tokens=server.tokens_served, sessions=len(server.sessions),
                      kv_used=server.sessions.reserved_tokens, kv_total=server.sessions.budget_tokens, **reaches)

    async def history_loop(self) -> None:
        while True:
            self.history.add(self.sample(time.time()))
            await trio.sleep(self.history.period_s)

    def pause(self) -> bool:
        return self.node.provider is not None and self.node.provider.pause()

    def resume(self) -> bool:
        return self.node.provider is not None and self.node.provider.resume()


async def karma_watch_loop(view: SwarmView, karma_book: KarmaBook, host, dht) -> None:
    """Check the karma of the peers in view, for the dashboard (and `status`), and
    tell the view who has verified karma (evidence: net/view.py). Each round checks
    the peers with evidence and a few newcomers: every newcomer of a Sybil flood
    would cost a DHT look-up."""
    while True:
        limit = view.counts()["evidenced"] + KARMA_NEWCOMERS if view.policy else MAX_PEERS
        peers = [ad.peer_id for ad in view.ranked(time.time(), limit)]
        await karma_book.refresh(host, dht, peers, timeout_s=KARMA_ROUND_S)
        # Above a newcomer's 1.0: verified compute served, not yet outweighed by reports.
        view.note_karma([p for p in peers if (karma_book.known(p) or 0.0) > 1.0], time.time())
        await trio.sleep(KARMA_TICK_S)
