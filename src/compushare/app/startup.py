"""The parts of a node's start-up (node.py composes them in its phases) that need no
Node: the model it was asked for, its ad, the self-benchmark, the memory its span
lives in and the first span."""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable

import psutil
import torch
import trio

from .. import __version__
from ..config import NodeConfig, Span
from ..errors import ModelUnavailable, UsageError
from ..hardware import Accelerator, Hardware, available_ram_mb, compute_memory, cuda_accelerator
from ..model.catalog import CATALOG, resolve_model, split_name
from ..model.selfbench import cached_block_rate, measure_block_rate
from ..spans import GGML, runtime_for
from ..spans.ggml.load import random_ggml_span
from ..model.store import ModelStore, StoredModel, is_model_id
from ..net.ads import ad_ttl, make_ad
from ..net.gossip import learn_views
from ..net.host import advertised_addrs
from ..net.view import SwarmView
from ..pipeline.client.consumer import name_from_swarm, peer_ids_of
from ..pipeline.server.provider import Provider, block_cost, blocks_for_budget, check_fixed_span, weights_budget_mb
from ..pipeline.server.training import TrainingServer
from ..wire import TRAIN as TRAIN_PROTOCOL
from .api.app import Control, build_app
from .api.auth import load_or_create_token
from .api.engine import ChatEngine

log = logging.getLogger(__name__)

MB = 1024 * 1024
NAME_WAIT_S = 15.0  # for a server in the swarm to name the model this node was asked for
NAME_RETRY_S = 0.5


def held_model(config: NodeConfig, name: str, *, on_stage: Callable[[str], None] = lambda _stage: None,
               progress: Callable[[int, int], None] | None = None) -> StoredModel | None:
    """The model `name` from the store or the catalog (converted first: `on_stage` and
    `progress` follow it); None when the swarm must say.

    A model id this node has never seen comes from the swarm: first its manifest,
    then the pieces of whatever span the node takes. So does a name neither held
    here nor in the catalog: the swarm says which id it names (pipeline/client/names.py)."""
    held = ModelStore(config.data_dir).get(name)
    # (With no bootstrap peer there is no swarm to ask: the catalog's error says what to do.)
    ask_swarm = held is None and (is_model_id(name) or (split_name(name)[0] not in CATALOG
                                                        and bool(config.bootstrap)))
    return None if ask_swarm else held or resolve_model(name, config.data_dir, on_stage=on_stage, progress=progress)


def check_span(span: Span | None, model: StoredModel | None) -> None:
    """A fixed span (--blocks) must lie within the model."""
    if model is not None and span is not None and span.end > model.num_blocks:
        raise UsageError(f"--blocks {span} exceeds the model's {model.num_blocks} blocks")


async def model_id_from_swarm(host, dht, config: NodeConfig, name: str) -> str:
    """The model id `name` stands for: itself, or the one a server in the swarm names."""
    if is_model_id(name):
        return name
    # Nodes started together: the server that names it may not have
    # sent its first ad yet. Ask again for a while before giving up.
    chosen = None
    with trio.move_on_after(NAME_WAIT_S):
        while (chosen := await name_from_swarm(host, dht, name, trusted=peer_ids_of(config.bootstrap))) is None:
            await trio.sleep(NAME_RETRY_S)
    if chosen is None:
        raise ModelUnavailable(f"unknown model {name!r}: not held here, not in the catalog, and "
                               f"served by no server in the swarm within {NAME_WAIT_S:.0f} s; "
                               "import it with `compushare models import PATH --name NAME`")
    return chosen.model_id


def ad_maker(key_pair, me: str, host, hardware: Hardware, config: NodeConfig, node) -> Callable:
    """This node's capability ad, made afresh (a rising seq) whenever gossip sends one;
    `node` (node.Node) says what it serves and how it is reached. Its lifetime follows
    the period gossip publishes at now (stretched on a crowded topic)."""
    last_seq = 0

    def period_now() -> float:
        return node.gossip.period_now if node.gossip is not None else config.ad_period_s

    def make_our_ad():
        nonlocal last_seq
        last_seq = max(last_seq + 1, time.time_ns())
        now_hardware = dataclasses.replace(hardware, ram_free_mb=available_ram_mb(hardware))
        serving = node.provider.serving() if node.provider is not None else []
        return make_ad(key_pair, me, advertised_addrs(host), now_hardware, serving, __version__,
                       ttl_s=ad_ttl(period_now()), seq=last_seq, reach=node.traversal.status,
                       relay=node.traversal.offers_relay())

    return make_our_ad


async def self_benchmark(provider: Provider, config: NodeConfig, slowdown: float, device: str) -> None:
    model = provider.model
    runtime = runtime_for(model.path, provider.runtime, device)  # the span's runtime is the one measured
    random_span = functools.partial(random_ggml_span, threads=config.torch_threads) if runtime == GGML else None
    measure = functools.partial(measure_block_rate, threads=config.torch_threads, device=device,
                                random_span=random_span)
    if slowdown != 1.0:  # an emulated slow node must not poison the cache
        measure = functools.partial(measure, model.path, slowdown=slowdown)
    else:
        measure = functools.partial(cached_block_rate, model, config.data_dir, threads=config.torch_threads,
                                    device=device, runtime=runtime, measure=functools.partial(measure))
    provider.block_rate = await trio.to_thread.run_sync(measure)
    log.info("self-benchmark: %.0f decode steps/s through one block of %s", provider.block_rate,
             model.model_id[:12])


@dataclasses.dataclass(frozen=True)
class SpanMemory:
    """The memory a span lives in: the device's on CUDA (its allocator's share held),
    the RAM's otherwise; private mode's pre-encoding stays in RAM."""

    device: str
    accelerator: Accelerator | None
    free_mb: int
    held_mb: int  # what this process holds there now
    ram_free_mb: int
    ram_held_mb: int

    @property
    def where(self) -> str:
        return self.accelerator.label if self.accelerator is not None else "cpu"

    def weights_budget_mb(self, memory_budget_mb: int | None) -> int:
        return weights_budget_mb(memory_budget_mb, self.free_mb, self.held_mb, self.device)

    def private_budget(self, memory_budget_mb: int | None, cost: int) -> Callable[[tuple[int, int]], int]:
        """What a span's weights (in their format) and KV budget, at `cost` a block, leave
        of the node's memory budget: private mode's pre-encoded weights get that. A span
        on CUDA takes none of the RAM: they get the RAM's default share."""
        budget_mb = self.weights_budget_mb(memory_budget_mb)

        def private_budget(span: tuple[int, int]) -> int:
            if self.device == "cuda":
                return weights_budget_mb(None, self.ram_free_mb, self.ram_held_mb) * MB
            return max(0, budget_mb * MB - cost * (span[1] - span[0]))

        return private_budget


def span_memory(device: str, hardware: Hardware) -> SpanMemory:
    """Measured after the self-benchmark: transformers is imported by then, and its
    random blocks are freed (malloc_policy returns large buffers at once)."""
    held_mb = round(psutil.Process().memory_info().rss / MB)
    if device != "cuda":
        return SpanMemory(device, None, hardware.ram_free_mb, held_mb, hardware.ram_free_mb, held_mb)
    torch.cuda.empty_cache()  # the benchmark's blocks given back
    accelerator = cuda_accelerator(torch.cuda.current_device())
    free_mb = compute_memory(device, hardware, accelerator)[1]
    log.info("serving on %s: %d of %d MB free", accelerator.label, accelerator.free_mb, accelerator.total_mb)
    return SpanMemory(device, accelerator, free_mb, round(torch.cuda.memory_reserved() / MB), hardware.ram_free_mb,
                      held_mb)


async def first_span(provider: Provider, config: NodeConfig, memory: SpanMemory, host, view: SwarmView,
                     me: str) -> tuple[Span, int]:
    """The span to serve first (fixed, or chosen where the swarm is weakest) and the
    most blocks the memory budget allows."""
    model, kv_tokens = provider.model, config.limits.kv_budget_tokens
    length = blocks_for_budget(model, max_blocks=config.max_blocks, memory_budget_mb=config.memory_budget_mb,
                               free_mb=memory.free_mb, kv_tokens=kv_tokens, held_mb=memory.held_mb,
                               device=memory.device, runtime=provider.span_runtime)
    span = config.blocks
    if span is not None:
        check_fixed_span(model, span, memory_budget_mb=config.memory_budget_mb, held_mb=memory.held_mb,
                         kv_tokens=kv_tokens, runtime=provider.span_runtime)
        return span, length
    # The random warm-up starts after the benchmark: nodes started together
    # (and slowed alike) then choose one after another, each seeing the
    # claims published before it.
    await learn_views(host, view, model.model_id)  # a newcomer sees the model's servers at once
    return await provider.choose_first_span(view, me, length, config.ad_period_s if config.bootstrap else 0.0), length


def serve_training(host, provider: Provider, config: NodeConfig, memory: SpanMemory) -> TrainingServer:
    """Training (/compushare/train) beside the span's inference server: its activations
    in what the span's weights and KV budget leave of the memory budget, at most
    train_memory_mb."""
    left = memory.private_budget(config.memory_budget_mb, block_cost(provider.model, config.limits.kv_budget_tokens,
                                                                     provider.span_runtime))
    span = provider.span
    training = TrainingServer(provider.server, memory_bytes=min(config.limits.train_memory_mb * 2**20,
                                                                left((span.start, span.end))))
    host.set_stream_handler(TRAIN_PROTOCOL, training.rpc_train)
    return training


def api_app(node, name: str, control: Control):
    """The node's local HTTP API: generations on the node's own host, DHT and view of
    the swarm, behind the token in its data dir."""
    config = node.config
    engine = ChatEngine(node.swarm.host, node.swarm.dht, config.data_dir, torrent=node.torrent, default_model=name,
                        view=node.view, follow=node.gossip.follow if node.gossip is not None else None,
                        picture=node.directory.picture if node.directory is not None else None)
    return build_app(engine, load_or_create_token(config.data_dir), control, ollama_open=config.api_ollama_open)
