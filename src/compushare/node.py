"""Node.run(): the one nursery that owns every task of a provider node."""

from __future__ import annotations

import json
import logging
import os
import signal
import time

import torch
import trio

from .config import NodeConfig
from .errors import SwarmUnreachable, UsageError
from .model.blocks import SpanRunner
from .model.catalog import DEFAULT_MODEL, resolve_model
from .net.dht import connect_bootstrap, open_dht, sync_routing_table
from .net.host import full_addrs, open_host
from .net.identity import load_or_create_identity
from .pipeline.announce import announce_loop
from .pipeline.protocol import INFER_PROTOCOL
from .pipeline.server import InferenceServer

log = logging.getLogger(__name__)

STATE_FILE = "node.json"
ROUTING_SYNC_PERIOD_S = 2.0
BOOTSTRAP_RETRY_S = 5.0
# py-libp2p caps ADD_PROVIDER at 10 per 10 s per peer; a node announcing a span of
# 30 blocks sends 31. Every CompuShare node raises the cap for its peers.
PROVIDER_RATE_MAX = 200


class Node:
    def __init__(self, config: NodeConfig) -> None:
        self.config = config

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        config = self.config
        torch.set_num_threads(config.torch_threads)
        model = resolve_model(config.model or DEFAULT_MODEL, config.data_dir)
        span = config.blocks
        if span is None:
            raise UsageError("--blocks START:END is required (automatic placement comes with the scheduler)")
        if span.end > model.num_blocks:
            raise UsageError(f"--blocks {span} exceeds the model's {model.num_blocks} blocks")
        runner = await trio.to_thread.run_sync(SpanRunner.load, model.path, span.start, span.end)
        server = InferenceServer(runner, model.model_id, config.limits)
        key_pair = load_or_create_identity(config.data_dir)
        async with open_host(key_pair, config.listen) as host, open_dht(host, server=True) as dht:
            dht._provider_rate_max = PROVIDER_RATE_MAX
            host.set_stream_handler(INFER_PROTOCOL, server.rpc_infer)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._stop_on_signal, nursery.cancel_scope)
                if config.bootstrap:
                    await self._join(host, dht)
                nursery.start_soon(server.expire_loop)
                nursery.start_soon(self._routing_sync_loop, host, dht)
                await nursery.start(
                    announce_loop, host, dht, key_pair, model.model_id, span.start, span.end,
                    model.dtype, config.record_ttl_s,
                )
                state = {
                    "pid": os.getpid(),
                    "peer_id": host.get_id().to_string(),
                    "addrs": full_addrs(host),
                    "model_id": model.model_id,
                    "start": span.start,
                    "end": span.end,
                    "parameters": runner.parameter_count(),
                    "started": time.time(),
                }
                self._write_state(state)
                log.info("serving blocks %s of %s as %s on %s", span, model.model_id[:12],
                         state["peer_id"], ", ".join(state["addrs"]))
                task_status.started(state)
                try:
                    await trio.sleep_forever()
                finally:
                    (config.data_dir / STATE_FILE).unlink(missing_ok=True)


    async def _join(self, host, dht) -> None:
        """Dial the bootstrap peers; keep retrying (a swarm may come up in any order)."""
        while True:
            try:
                await connect_bootstrap(host, dht, self.config.bootstrap)
                return
            except SwarmUnreachable as exc:
                log.warning("%s; retrying in %.0fs", exc, BOOTSTRAP_RETRY_S)
                await trio.sleep(BOOTSTRAP_RETRY_S)

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

    def _write_state(self, state: dict) -> None:
        path = self.config.data_dir / STATE_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=2))
        os.replace(tmp, path)
