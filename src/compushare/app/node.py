"""Node.run(): the one nursery that owns every task of a provider node."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import sys
import time
from collections.abc import Callable

import psutil
import torch
import trio

from .. import __version__, defences
from ..config import LISTEN_FILE, PID_FILE, STATE_FILE, NodeConfig, Span
from ..errors import ModelUnavailable, UsageError
from ..gc_policy import startup_done
from ..hardware import available_ram_mb, compute_memory, cuda_accelerator, detect_hardware, resolve_device
from .api.app import build_app
from .api.auth import TOKEN_FILE, load_or_create_token
from .api.engine import ChatEngine
from .api.server import serve_api
from .debug import FaultInjection
from ..karma.record import karma_validators
from ..karma.rules import base_score
from ..karma.service import KARMA_PROTOCOL, KarmaBook, KarmaService
from ..model.catalog import CATALOG, DEFAULT_MODEL, resolve_model, split_name
from ..model.store import ModelStore, is_model_id
from ..model.selfbench import cached_block_rate, measure_block_rate
from ..net.ads import ad_ttl, make_ad
from ..net.dht import routing_sync_loop
from ..net.gossip import Gossip, learn_views
from ..net.host import advertised_addrs, full_addrs
from ..net.identity import load_or_create_identity
from ..net.peer import open_swarm_host
from ..net.records import MAX_ADDRS
from ..net.traversal import Traversal
from ..net.view import MAX_PEERS, SwarmView, relay_candidates
from ..pipeline.client.consumer import name_from_swarm, peer_ids_of
from ..pipeline.server.announce import announce_loop
from ..he.ckks import DEFAULT_PARAMETERS
from ..pipeline.private_wire import PRIVATE_PROTOCOL
from ..pipeline.protocol import INFER_PROTOCOL
from ..pipeline.server.private import PrivateServer
from ..pipeline.server.private_worker import HEWorker
from ..pipeline.server.provider import (Provider, block_cost, blocks_for_budget, check_fixed_span, memory_state,
                                        weights_budget_mb)
from ..pipeline.server.inference import InferenceServer
from ..runtime import stop_on_signal, write_json, write_state
from .status import summarize
from ..torrent.service import Torrent

log = logging.getLogger(__name__)

MB = 1024 * 1024

COMPUTE_SWITCH_INTERVAL_S = 50e-6  # CPython's default is 5 ms
# The dashboard's karma of peers: a peer new in view is checked within KARMA_TICK_S
# (KarmaBook says who is due: rechecks and retries are slower); a round takes at most KARMA_ROUND_S.
KARMA_TICK_S = 5.0
KARMA_ROUND_S = 30.0
KARMA_NEWCOMERS = 32  # newcomers (no evidence yet) checked per round
NET_STATE_PERIOD_S = 2.0
NAME_WAIT_S = 15.0  # for a server in the swarm to name the model this node was asked for
NAME_RETRY_S = 0.5


class Node:
    def __init__(self, config: NodeConfig, faults: FaultInjection = FaultInjection()) -> None:
        self.config = config
        self.faults = faults  # tests' misbehaving nodes only (debug.py)
        self.view = SwarmView()
        self.provider: Provider | None = None
        self.private: PrivateServer | None = None  # /compushare/private, when config.private
        self.torrent: Torrent | None = None
        self.karma: KarmaService | None = None
        self.karma_book = KarmaBook()  # the karma of peers in view, checked in the background
        self.traversal: Traversal | None = None  # reachability, relays, hole punching (net/traversal.py)
        self.downloads: dict[str, dict] = {}  # span weights being fetched: blocks, done, total bytes
        self.fetched: list[dict] = []  # downloads of span weights (node.json shows them)
        self._memory: Callable[[], dict] | None = None  # what the span holds against the memory budget
        self.device = "cpu"  # where the span computes (config.device resolved when the node starts)
        self._state: dict = {}
        self._last_state: dict = {}

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        pid_file = self.config.data_dir / PID_FILE
        self.config.data_dir.mkdir(parents=True, exist_ok=True)
        pid_file.write_text(f"{os.getpid()}\n")  # `compushare stop` and `node --detach` read it
        try:
            await self._run(task_status=task_status)
        finally:
            with contextlib.suppress(OSError, ValueError):  # only our own: a newer node may have replaced it
                if int(pid_file.read_text()) == os.getpid():
                    pid_file.unlink()

    async def _run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        config = self.config
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
        name = config.model or DEFAULT_MODEL
        # A model id this node has never seen comes from the swarm: first its manifest,
        # then the pieces of whatever span the node takes. So does a name neither held
        # here nor in the catalog: the swarm says which id it names (pipeline/client/names.py).
        held = ModelStore(config.data_dir).get(name)
        # (With no bootstrap peer there is no swarm to ask: the catalog's error says what to do.)
        ask_swarm = held is None and (is_model_id(name) or (split_name(name)[0] not in CATALOG
                                                            and bool(config.bootstrap)))
        model = None if ask_swarm else held or resolve_model(name, config.data_dir)
        self._check_span(model)
        hardware = detect_hardware()
        device = self.device = resolve_device(config.device, torch.cuda.is_available())
        key_pair = load_or_create_identity(config.data_dir)
        async with open_swarm_host(key_pair, server=True, validators=karma_validators(), listen=config.listen,
                                   bootstrap=config.bootstrap, join=False) as swarm:
            host, dht = swarm.host, swarm.dht
            me = host.get_id().to_string()
            torrent = self.torrent = Torrent(host, dht, config.data_dir, self.view)
            torrent.start_seeding()
            karma = self.karma = KarmaService(host, dht, key_pair, config.data_dir)
            host.set_stream_handler(KARMA_PROTOCOL, karma.handle)

            last_seq = 0

            def make_our_ad():
                nonlocal last_seq
                last_seq = max(last_seq + 1, time.time_ns())
                now_hardware = dataclasses.replace(hardware, ram_free_mb=available_ram_mb(hardware))
                serving = self.provider.serving() if self.provider is not None else []
                return make_ad(key_pair, me, advertised_addrs(host), now_hardware, serving, __version__,
                               ttl_s=ad_ttl(config.ad_period_s), seq=last_seq, reach=self.traversal.status,
                               relay=self.traversal.offers_relay())

            gossip = Gossip(host, self.view, make_our_ad, period_s=config.ad_period_s)

            def net_changed() -> None:
                # Reachability or relays changed: peers must learn the new addresses now
                # (ad at once, server record at once), not at their next refresh.
                gossip.publish_soon()
                if self.provider is not None:
                    self.provider.notify_change()

            traversal = self.traversal = Traversal(
                host, serve=True, relay=config.relay, quotas=config.relay_quotas,
                relay_candidates=lambda: relay_candidates(self.view, me, time.time()),
                own_addrs=lambda: full_addrs(host), max_addrs=MAX_ADDRS, on_change=net_changed, dht=dht,
                punch=config.hole_punch)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(stop_on_signal, nursery.cancel_scope)
                await nursery.start(traversal.run)
                await nursery.start(gossip.run)  # before dialling: pubsub learns peers from connections
                await swarm.join(retry=True)
                # Dialable and seeding from here on: `swarm up` starts the other nodes now,
                # so they fetch their spans while this one loads its own.
                write_json(config.data_dir / LISTEN_FILE, {"pid": os.getpid(), "peer_id": me,
                                                           "addrs": advertised_addrs(host)})
                nursery.start_soon(routing_sync_loop, host, dht)
                nursery.start_soon(karma.publish_loop)
                nursery.start_soon(karma.provide_reports_loop)
                nursery.start_soon(self._karma_watch_loop, host, dht)
                api_url = None
                if config.api_port >= 0:
                    engine = ChatEngine(host, dht, config.data_dir, torrent=torrent, default_model=name)
                    app = build_app(engine, load_or_create_token(config.data_dir), self)
                    api_url = await nursery.start(serve_api, app, config.api_port)
                    log.info("local API (OpenAI-compatible, token in %s) on %s", config.data_dir / TOKEN_FILE,
                             api_url)
                if model is None:
                    await learn_views(host, self.view)  # a newcomer sees the swarm at once
                    model_id = name
                    if not is_model_id(name):
                        # Nodes started together: the server that names it may not have
                        # sent its first ad yet. Ask again for a while before giving up.
                        chosen = None
                        with trio.move_on_after(NAME_WAIT_S):
                            while (chosen := await name_from_swarm(host, dht, name,
                                                                   trusted=peer_ids_of(config.bootstrap))) is None:
                                await trio.sleep(NAME_RETRY_S)
                        if chosen is None:
                            raise ModelUnavailable(f"unknown model {name!r}: not held here, not in the catalog, and "
                                                   f"served by no server in the swarm within {NAME_WAIT_S:.0f} s; "
                                                   "import it with `compushare models import PATH --name NAME`")
                        model_id = chosen.model_id
                    model = await torrent.obtain_manifest(model_id)
                    if model_id != name:
                        ModelStore(config.data_dir).set_alias(name, model_id)
                    self._check_span(model)
                provider = self.provider = Provider(
                    model,
                    lambda runner: InferenceServer(runner, model.model_id, config.limits, key_pair=key_pair,
                                                   block_rate=provider.block_rate, noise=self.faults.noise,
                                                   karma=karma.receipts),
                    block_rate=0.0, slowdown=self.faults.slowdown, prepare=self._fetch_span,
                    name="" if is_model_id(name) else name, claimed_format=self.faults.claim_format,
                    device=device,
                )
                await self._self_benchmark(provider)
                # Measured after the self-benchmark: transformers is imported by then, and
                # its random blocks are freed (malloc_policy returns large buffers at once).
                held_mb = round(psutil.Process().memory_info().rss / MB)
                # A span on CUDA lives in the device's memory: the budget, what is free and
                # what this process holds there (its allocator's, the benchmark's blocks
                # given back) are the device's; private mode's pre-encoding stays in RAM.
                accelerator = None
                span_free_mb, span_held_mb = hardware.ram_free_mb, held_mb
                if device == "cuda":
                    torch.cuda.empty_cache()
                    accelerator = cuda_accelerator(torch.cuda.current_device())
                    span_free_mb = compute_memory(device, hardware, accelerator)[1]
                    span_held_mb = round(torch.cuda.memory_reserved() / MB)
                    log.info("serving on %s: %d of %d MB free", accelerator.label, accelerator.free_mb,
                             accelerator.total_mb)
                kv_tokens = config.limits.kv_budget_tokens
                length = blocks_for_budget(model, max_blocks=config.max_blocks,
                                           memory_budget_mb=config.memory_budget_mb, free_mb=span_free_mb,
                                           kv_tokens=kv_tokens, held_mb=span_held_mb, device=device)
                span = config.blocks
                if span is not None:
                    check_fixed_span(model, span, memory_budget_mb=config.memory_budget_mb, held_mb=span_held_mb,
                                     kv_tokens=kv_tokens)
                if span is None:
                    # The random warm-up starts after the benchmark: nodes started together
                    # (and slowed alike) then choose one after another, each seeing the
                    # claims published before it.
                    await learn_views(host, self.view)  # a newcomer sees the swarm at once
                    span = await provider.choose_first_span(
                        self.view, me, length, config.ad_period_s if config.bootstrap else 0.0)
                self._state = {
                    "pid": os.getpid(),
                    "peer_id": me,
                    "addrs": advertised_addrs(host),
                    "model_id": model.model_id,
                    "num_blocks": model.num_blocks,
                    "max_blocks": length,
                    "placement": "fixed" if config.blocks is not None else "automatic",
                    "block_rate": provider.block_rate,
                    "device": accelerator.label if accelerator is not None else "cpu",
                    "started": time.time(),
                    "api": api_url,
                }

                def on_change() -> None:
                    gossip.publish_soon()
                    if provider.server is not None:
                        self._write_state(provider)

                provider.on_change = on_change
                await provider.serve(span)
                server = provider.server
                server.enable_push(host, nursery, forge=self.faults.forge_push)
                host.set_stream_handler(INFER_PROTOCOL, server.rpc_infer)
                budget_mb = weights_budget_mb(config.memory_budget_mb, span_free_mb, span_held_mb, device)
                cost = block_cost(model, config.limits.kv_budget_tokens)

                def private_budget(span: tuple[int, int]) -> int:
                    # What the span's weights (in their format) and KV budget leave of the
                    # node's memory budget: private mode's pre-encoded weights get that.
                    # A span on CUDA takes none of the RAM: they get the RAM's default share.
                    if device == "cuda":
                        return weights_budget_mb(None, hardware.ram_free_mb, held_mb) * MB
                    return max(0, budget_mb * MB - cost * (span[1] - span[0]))

                where = accelerator.label if accelerator is not None else "cpu"
                self._memory = lambda: memory_state(model, provider.span, budget_mb, config.limits.kv_budget_tokens,
                                                    private_budget, where) | {"held_mb": span_held_mb,
                                                                              "given_mb": config.memory_budget_mb}
                if config.private:
                    worker = HEWorker(model.path, params=DEFAULT_PARAMETERS, preencode=config.private_preencode,
                                      budget_bytes=private_budget, noise=self.faults.noise)
                    self.private = PrivateServer(provider, worker)
                    provider.private_rate = self.private.rate
                    host.set_stream_handler(PRIVATE_PROTOCOL, self.private.handler)
                nursery.start_soon(server.expire_loop)
                await nursery.start(announce_loop, host, dht, key_pair, provider, config.record_ttl_s)
                # Seed records after the serving records: py-libp2p serves at most 12
                # inbound DHT streams per node, and a burst of both at start-up can
                # have some ADD_PROVIDERs silently dropped.
                nursery.start_soon(torrent.announce_loop)
                if config.blocks is None:
                    nursery.start_soon(provider.rebalance_loop, self.view, me, config.ad_period_s)
                state = self._write_state(provider)
                nursery.start_soon(self._net_state_loop, provider)
                startup_done()  # the span's weights and modules live as long as the node
                log.info("serving blocks %s of %s as %s on %s", span, model.model_id[:12], me,
                         ", ".join(state["addrs"]))
                task_status.started(state)
                try:
                    await trio.sleep_forever()
                finally:
                    (config.data_dir / STATE_FILE).unlink(missing_ok=True)
                    if self.private is not None:
                        with trio.CancelScope(shield=True):
                            await self.private.worker.aclose()

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

    def _check_span(self, model) -> None:
        span = self.config.blocks
        if model is not None and span is not None and span.end > model.num_blocks:
            raise UsageError(f"--blocks {span} exceeds the model's {model.num_blocks} blocks")

    async def _fetch_span(self, span: Span) -> None:
        """Fetch the weights of `span` from the swarm's seeders if this node lacks them."""
        model = self.provider.model
        if model.holds(blocks=(span.start, span.end)):
            return
        logged = [-1]

        key = str(span)

        def progress(done: int, total: int) -> None:
            self.downloads[key] = {"blocks": [span.start, span.end], "done": done, "total": total,
                                   "finished": False}
            tenth = 10 * done // max(1, total)
            if tenth != logged[0]:
                logged[0] = tenth
                log.info("fetching blocks %s: %d/%d MB", span, done // 10**6, total // 10**6)

        try:
            result = await self.torrent.fetch(model.model_id, blocks=(span.start, span.end), progress=progress)
        finally:
            self.downloads.pop(key, None)
        self.fetched.append({"blocks": [span.start, span.end], "bytes": result.bytes, "seconds": result.seconds,
                             "bytes_from": result.bytes_from, "banned": result.banned})
        log.info("fetched blocks %s: %.1f MB in %.1fs from %d seeders", span, result.bytes / 1e6,
                 result.seconds, len(result.bytes_from))

    async def _self_benchmark(self, provider: Provider) -> None:
        config, model, slowdown = self.config, provider.model, self.faults.slowdown
        if slowdown != 1.0:  # an emulated slow node must not poison the cache
            measure = functools.partial(measure_block_rate, model.path, threads=config.torch_threads,
                                        slowdown=slowdown, device=self.device)
        else:
            measure = functools.partial(cached_block_rate, model, config.data_dir, threads=config.torch_threads,
                                        device=self.device)
        provider.block_rate = await trio.to_thread.run_sync(measure)
        log.info("self-benchmark: %.0f decode steps/s through one block of %s", provider.block_rate,
                 model.model_id[:12])

    # -- the control API (api/app.Control) ----------------------------------------------

    def status(self) -> dict:
        """The node's state and its own ledger's karma (before any failure reports
        against it, which others hold)."""
        status = dict(self._last_state)
        if self.karma is not None:
            tally = self.karma.receipts.tally()
            status["karma"] = {"score": base_score(tally.compute_ms), "compute_ms": tally.compute_ms,
                               "receipts": len(self.karma.receipts.ledger), "counted": tally.counted}
        server = self.provider.server if self.provider is not None else None
        status["tokens_served"] = server.tokens_served if server is not None else 0
        status["sessions"] = len(server.sessions) if server is not None else 0  # open now
        status["throughput"] = server.throughput() if server is not None else 0.0
        status["pushed_steps"] = server.speculation_hits if server is not None else 0  # started by a push
        # Decode steps of several sessions computed as one forward (and how many forwards).
        status["batched_steps"] = server.compute.batched_steps if server is not None else 0
        status["batches"] = server.compute.batches if server is not None else 0
        if self.provider is not None:
            status["state"] = self.provider.state
        status["private"] = self.private.stats() if self.private is not None else None
        if self.traversal is not None:
            status["net"] = self.traversal.stats()
            status["addrs"] = self.traversal.addrs()
        return status

    def dashboard(self) -> dict:
        """Everything the dashboard shows: this node, the swarm as its ads tell it
        (with each peer's karma as checked in the background), downloads."""
        summary = summarize(self.view, self.config.data_dir, self._last_state or None, now=time.time(), asked=0)
        for peer in summary["peers"]:
            peer["karma"] = self.karma_book.known(peer["peer_id"])
        downloads = [dict(d, finished=True, done=d["bytes"], total=d["bytes"]) for d in self.fetched]
        return {"node": self.status(), "peers": summary["peers"], "models": summary["models"],
                "downloads": downloads + list(self.downloads.values())}

    def pause(self) -> bool:
        return self.provider is not None and self.provider.pause()

    def resume(self) -> bool:
        return self.provider is not None and self.provider.resume()

    async def _karma_watch_loop(self, host, dht) -> None:
        """Check the karma of the peers in view, for the dashboard (and `status`), and
        tell the view who has verified karma (evidence: net/view.py). Each round checks
        the peers with evidence and a few newcomers: every newcomer of a Sybil flood
        would cost a DHT look-up."""
        while True:
            view = self.view
            limit = view.counts()["evidenced"] + KARMA_NEWCOMERS if view.policy else MAX_PEERS
            peers = [ad.peer_id for ad in view.ranked(time.time(), limit)]
            await self.karma_book.refresh(host, dht, peers, timeout_s=KARMA_ROUND_S)
            # Above a newcomer's 1.0: verified compute served, not yet outweighed by reports.
            view.note_karma([p for p in peers if (self.karma_book.known(p) or 0.0) > 1.0], time.time())
            await trio.sleep(KARMA_TICK_S)

    def _write_state(self, provider: Provider) -> dict:
        span = provider.span
        state = dict(self._state, start=span.start, end=span.end, state=provider.state, moves=provider.moves,
                     fetched=self.fetched,
                     parameters=provider.server.runner.parameter_count() if provider.server else 0,
                     format=provider.format_label, memory=self._memory() if self._memory is not None else None)
        if self.traversal is not None:  # reachability and relays change while it runs
            state.update(addrs=self.traversal.addrs(), net=self.traversal.stats())
        write_state(self.config.data_dir, state)
        self._last_state = state
        return state
