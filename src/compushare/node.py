"""Node.run(): the one nursery that owns every task of a provider node."""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import signal
import time

import torch
import trio

from . import __version__
from .config import STATE_FILE, NodeConfig
from .errors import SwarmUnreachable, UsageError
from .hardware import available_ram_mb, detect_hardware
from .model.catalog import DEFAULT_MODEL, resolve_model
from .model.selfbench import cached_block_rate, measure_block_rate
from .net.ads import ad_ttl, make_ad
from .net.dht import connect_bootstrap, open_dht, sync_routing_table
from .net.gossip import Gossip, fetch_view
from .net.host import full_addrs, open_host
from .net.identity import load_or_create_identity
from .net.view import SwarmView
from .pipeline.announce import announce_loop
from .pipeline.protocol import INFER_PROTOCOL
from .pipeline.provider import Provider, blocks_for_budget
from .pipeline.server import InferenceServer

log = logging.getLogger(__name__)

ROUTING_SYNC_PERIOD_S = 2.0
BOOTSTRAP_RETRY_S = (0.5, 5.0)  # first and longest wait between attempts (doubling)
# py-libp2p caps ADD_PROVIDER at 10 per 10 s per peer; a node announcing a span of
# 30 blocks sends 31. Every CompuShare node raises the cap for its peers.
PROVIDER_RATE_MAX = 200


class Node:
    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        self.view = SwarmView()
        self.provider: Provider | None = None
        self._state: dict = {}

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        config = self.config
        torch.set_num_threads(config.torch_threads)
        model = resolve_model(config.model or DEFAULT_MODEL, config.data_dir)
        span = config.blocks
        if span is not None and span.end > model.num_blocks:
            raise UsageError(f"--blocks {span} exceeds the model's {model.num_blocks} blocks")
        hardware = detect_hardware()
        length = blocks_for_budget(model, max_blocks=config.max_blocks, memory_budget_mb=config.memory_budget_mb,
                                   free_mb=hardware.ram_free_mb)
        provider = self.provider = Provider(
            model,
            lambda runner: InferenceServer(runner, model.model_id, config.limits, block_rate=provider.block_rate),
            block_rate=0.0, slowdown=config.slowdown,
        )
        key_pair = load_or_create_identity(config.data_dir)
        async with open_host(key_pair, config.listen) as host, open_dht(host, server=True) as dht:
            dht._provider_rate_max = PROVIDER_RATE_MAX
            me = host.get_id().to_string()

            last_seq = 0

            def make_our_ad():
                nonlocal last_seq
                last_seq = max(last_seq + 1, time.time_ns())
                now_hardware = dataclasses.replace(hardware, ram_free_mb=available_ram_mb(hardware))
                return make_ad(key_pair, me, full_addrs(host), now_hardware, provider.serving(), __version__,
                               ttl_s=ad_ttl(config.ad_period_s), seq=last_seq)

            gossip = Gossip(host, self.view, make_our_ad, period_s=config.ad_period_s)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._stop_on_signal, nursery.cancel_scope)
                await nursery.start(gossip.run)  # before dialling: pubsub learns peers from connections
                if config.bootstrap:
                    await self._join(host, dht)
                nursery.start_soon(self._routing_sync_loop, host, dht)
                await self._self_benchmark(provider)
                if span is None:
                    # The random warm-up starts after the benchmark: nodes started together
                    # (and slowed alike) then choose one after another, each seeing the
                    # claims published before it.
                    await self._learn_swarm(host)
                    span = await provider.choose_first_span(
                        self.view, me, length, config.ad_period_s if config.bootstrap else 0.0)
                self._state = {
                    "pid": os.getpid(),
                    "peer_id": me,
                    "addrs": full_addrs(host),
                    "model_id": model.model_id,
                    "num_blocks": model.num_blocks,
                    "max_blocks": length,
                    "placement": "fixed" if config.blocks is not None else "automatic",
                    "block_rate": provider.block_rate,
                    "started": time.time(),
                }

                def on_change() -> None:
                    gossip.publish_soon()
                    if provider.server is not None:
                        self._write_state(provider)

                provider.on_change = on_change
                await provider.serve(span)
                server = provider.server
                host.set_stream_handler(INFER_PROTOCOL, server.rpc_infer)
                nursery.start_soon(server.expire_loop)
                await nursery.start(announce_loop, host, dht, key_pair, provider, config.record_ttl_s)
                if config.blocks is None:
                    nursery.start_soon(provider.rebalance_loop, self.view, me, config.ad_period_s)
                state = self._write_state(provider)
                log.info("serving blocks %s of %s as %s on %s", span, model.model_id[:12], me,
                         ", ".join(state["addrs"]))
                task_status.started(state)
                try:
                    await trio.sleep_forever()
                finally:
                    (config.data_dir / STATE_FILE).unlink(missing_ok=True)

    async def _self_benchmark(self, provider: Provider) -> None:
        config, model = self.config, provider.model
        if config.slowdown != 1.0:  # an emulated slow node must not poison the cache
            measure = functools.partial(measure_block_rate, model.path, threads=config.torch_threads,
                                        slowdown=config.slowdown)
        else:
            measure = functools.partial(cached_block_rate, model, config.data_dir, threads=config.torch_threads)
        provider.block_rate = await trio.to_thread.run_sync(measure)
        log.info("self-benchmark: %.0f decode steps/s through one block of %s", provider.block_rate,
                 model.model_id[:12])

    async def _learn_swarm(self, host) -> None:
        """Ask the peers we are connected to for their views: a newcomer sees the whole
        swarm at once instead of after an ad period."""
        async with trio.open_nursery() as nursery:
            for peer in list(host.get_network().connections):
                nursery.start_soon(self._fetch_view_quietly, host, peer)

    async def _fetch_view_quietly(self, host, peer) -> None:
        try:
            await fetch_view(host, peer, self.view)
        except Exception as exc:  # an old or hostile peer: its view is optional
            log.debug("no view from %s: %s", peer, exc)

    async def _join(self, host, dht) -> None:
        """Dial the bootstrap peers; keep retrying (a swarm may come up in any order)."""
        wait, longest = BOOTSTRAP_RETRY_S
        while True:
            try:
                await connect_bootstrap(host, dht, self.config.bootstrap)
                return
            except SwarmUnreachable as exc:
                log.warning("%s; retrying in %.1fs", exc, wait)
                await trio.sleep(wait)
                wait = min(2 * wait, longest)

    async def _routing_sync_loop(self, host, dht) -> None:
        while True:
            await sync_routing_table(host, dht)
            await trio.sleep(ROUTING_SYNC_PERIOD_S)

    async def _stop_on_signal(self, scope: trio.CancelScope) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                log.info("received %s: stopping", signal.Signals(signum).name)
                scope.cancel()
                return

    def _write_state(self, provider: Provider) -> dict:
        """`<data dir>/node.json`: what `swarm`, `status` and tests read about this node."""
        span = provider.span
        state = dict(self._state, start=span.start, end=span.end, state=provider.state, moves=provider.moves,
                     parameters=provider.server.runner.parameter_count() if provider.server else 0)
        path = self.config.data_dir / STATE_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=2))
        os.replace(tmp, path)
        return state
