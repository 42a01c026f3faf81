"""A node's provider role: which span it serves, loading it, and moving it.

With `--blocks` the span is fixed. Without it the node listens to the swarm for a
moment, takes the window where the swarm is weakest (pipeline/placement.py), and
then re-checks every few ad periods: when a departed node left a hole that this
node can fill without opening another, it moves. Before moving it waits a random
delay and re-checks, so nodes that saw the same hole do not all rush into it.
"""

from __future__ import annotations

import functools
import logging
import random
import time
from collections.abc import Awaitable, Callable

import trio

from ...config import Span
from ...errors import UsageError
from ...spans import GGML, TORCH, SpanCompute, load_span, runtime_for
from ...model.store import StoredModel
from ...net.ads import Serving
from ...net.records import MODEL_NAME
from ...net.tensors import TORCH_TO_WIRE
from ...net.view import SwarmView
from .placement import better_span, block_strength, choose_span, holes_outside, span_length
from .inference import InferenceServer

log = logging.getLogger(__name__)

MB = 1024 * 1024
# A node's default budget: this share of the memory free at start. Half of the RAM
# (the machine's owner keeps working beside it); most of a CUDA device, which holds
# nothing else of ours (its context is outside the free figure) but the forward's
# activations and workspace.
DEFAULT_SHARE = {"cpu": 0.5, "cuda": 0.8}


def kv_bytes_per_token(model: StoredModel, runtime: str = TORCH) -> int:
    """KV cache bytes one token takes in one block: keys and values, float32 on torch
    (bfloat16 for a bf16 model: a span's cache is in its compute dtype, whatever its
    weights'), float16 on ggml (llama.cpp's default cache type)."""
    config = model.manifest.config
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    return 2 * kv_heads * head_dim * (2 if runtime == GGML or model.format.name == "bf16" else 4)


def held_block_bytes(model: StoredModel, runtime: str = TORCH) -> int:
    """One block's weights as `runtime` holds them: torch's kernels' bytes, or on ggml
    the file's own (a Q4_K_M block: 1.45x less)."""
    return model.stored_block_bytes if runtime == GGML else model.block_bytes


def block_cost(model: StoredModel, kv_tokens: int, runtime: str = TORCH) -> int:
    """What holding one block costs on `runtime`: its weights as held (scales included)
    plus the KV cache of `kv_tokens` tokens (the server's whole KV budget) in it."""
    return held_block_bytes(model, runtime) + kv_tokens * kv_bytes_per_token(model, runtime)


def blocks_for_budget(model: StoredModel, *, max_blocks: int | None, memory_budget_mb: int | None,
                      free_mb: int, kv_tokens: int = 0, held_mb: int = 0, device: str = "cpu",
                      runtime: str = TORCH) -> int:
    """How many blocks this node may hold: --max-blocks, and what its memory budget
    (default: half the RAM free at start) fits, weights and KV budget together. A
    4-bit model's block costs ~7x less than an fp32 one's, so a node holds more.

    A budget given is the node's memory in all: what the process holds before its
    span loads (`held_mb`: interpreter, torch, libp2p, ~0.4 GB) comes off it first, so
    a node told 2 GB stays near 2 GB (bench/big_model.py measures peak RSS against
    it). The default is a share of the RAM still free, so nothing comes off that."""
    budget_mb = weights_budget_mb(memory_budget_mb, free_mb, held_mb, device)
    cost = block_cost(model, kv_tokens, runtime)
    fit = budget_mb * MB // cost if cost > 0 else model.num_blocks
    limit = model.num_blocks if max_blocks is None else max_blocks
    return span_length(model.num_blocks, min(limit, fit))


def weights_budget_mb(memory_budget_mb: int | None, free_mb: int, held_mb: int, device: str = "cpu") -> int:
    """What a node's budget leaves for its span's weights and KV cache (see blocks_for_budget):
    on a node serving on CUDA, every figure is the device's memory."""
    if memory_budget_mb is not None:
        return max(0, memory_budget_mb - held_mb)
    return int(free_mb * DEFAULT_SHARE[device])


def check_fixed_span(model: StoredModel, span: Span, *, memory_budget_mb: int | None, held_mb: int,
                     kv_tokens: int, runtime: str = TORCH) -> None:
    """A span given with --blocks must fit a budget given with it: refuse before loading
    (a node that swaps or is killed by the OOM killer serves nobody)."""
    if memory_budget_mb is None:
        return
    need = len(span) * block_cost(model, kv_tokens, runtime)
    have = weights_budget_mb(memory_budget_mb, 0, held_mb) * MB
    if need > have:
        fit = have // block_cost(model, kv_tokens, runtime)
        raise UsageError(f"blocks {span} need {need / MB:.0f} MB (weights and a {kv_tokens}-token KV budget), "
                         f"but the {memory_budget_mb} MB memory budget leaves {have / MB:.0f} MB after the "
                         f"{held_mb} MB this process holds: at most {fit} blocks fit")


def memory_state(model: StoredModel, span: Span | None, budget_mb: int, kv_tokens: int,
                 private_budget: Callable[[tuple[int, int]], int], device: str = "cpu",
                 runtime: str = TORCH) -> dict:
    """What this node's span holds against its memory budget (node.json, `status`);
    `device`: where it lives ("cpu", or Hardware.gpu's text of its CUDA device)."""
    blocks = len(span) if span is not None else 0
    return {"budget_mb": budget_mb, "format": model.format.label, "blocks": blocks, "device": device,
            "weights_mb": round(held_block_bytes(model, runtime) * blocks / MB, 1),
            "kv_mb": round(kv_tokens * kv_bytes_per_token(model, runtime) * blocks / MB, 1), "kv_tokens": kv_tokens,
            "private_mb": round(private_budget((span.start, span.end)) / MB, 1) if span is not None else 0.0}


class Provider:
    def __init__(self, model: StoredModel, server_factory: Callable[[SpanCompute], InferenceServer], *,
                 block_rate: float, slowdown: float = 1.0, rng: random.Random | None = None,
                 prepare: Callable[[Span], Awaitable[None]] | None = None, name: str = "",
                 claimed_format: str = "", device: str = "cpu", runtime: str = "auto", threads: int = 1) -> None:
        self.model = model
        self.device = device  # where spans compute: "cpu" or "cuda" (model/blocks.py)
        # What computes them (spans/__init__.py): "auto" is ggml for a GGUF model on CPU.
        self.runtime, self.threads = runtime, threads
        self.span_runtime = runtime_for(model.path, runtime, device)  # "auto" resolved: what budgets count
        self.name = name  # what the node calls the model ("smollm2-135m@q4"): ads carry it for name look-ups
        self.claimed_format = claimed_format  # fault injection (tests): a format other than the model's
        # Runs before a span loads: fetches the span's weights from the swarm if missing.
        self.prepare = prepare
        self.server_factory = server_factory
        self.block_rate = block_rate  # self-benchmark; the server refines it from served steps
        self.slowdown = slowdown
        self.rng = rng or random.Random()
        self.span: Span | None = None
        self.state = "idle"
        self.server: InferenceServer | None = None
        self.moves = 0
        self.changed = trio.Event()  # set (then replaced) on every change of span or state
        # The node publishes a fresh ad and rewrites its state file on every change,
        # so a claim ("loading" a span) is seen by others before the weights load.
        self.on_change: Callable[[], None] = lambda: None
        # Encrypted layer-steps/s this node offers for private sessions (0: none); the
        # node sets it when it serves /compushare/private.
        self.private_rate: Callable[[], float] = lambda: 0.0

    def notify_change(self) -> None:
        """Span, state or addresses changed: wake the waiters, tell the node (ad, state file)."""
        self.changed.set()
        self.changed = trio.Event()
        self.on_change()

    def span_throughput(self) -> float:
        """Tokens/s through the whole span (the server record's figure), 0 if unknown."""
        server = self.server
        rate = server.block_rate if server is not None and server.block_rate > 0 else self.block_rate
        return rate / len(self.span) if self.span is not None and rate > 0 else 0.0

    @property
    def dtype(self) -> str:
        """The dtype the span computes in (and answers in, for a float32 request)."""
        return TORCH_TO_WIRE[self.server.runner.dtype] if self.server is not None else "float32"

    def serving(self) -> list[Serving]:
        """This node's entry for its capability ad."""
        if self.span is None:
            return []
        server = self.server
        live = server is not None and self.state == "serving"
        return [Serving(
            model_id=self.model.model_id,
            start=self.span.start,
            end=self.span.end,
            dtype=self.dtype,
            free_tokens=max(0, server.sessions.available_to_newcomer()) if live else 0,
            load=server.load() if live else 0.0,
            block_rate=(server.block_rate if live and server.block_rate > 0 else self.block_rate),
            state=self.state,
            private_rate=self.private_rate() if live else 0.0,
            fmt=self.advertised_format,
            name=self.name if MODEL_NAME.fullmatch(self.name) else "",
            runtime=server.runner.build if server is not None else "",
        )]

    @property
    def advertised_format(self) -> str:
        """What ads and records say of the format: fp32 unsaid, as older nodes say it
        (they know no `fmt` field, and a consumer takes an unsaid one as fp32)."""
        return "" if self.format_label == "fp32" else self.format_label

    @property
    def format_label(self) -> str:
        """The model's weight format, as its manifest names it (model/formats.py)."""
        return self.claimed_format or self.model.format.label

    async def serve(self, span: Span) -> None:
        """Load `span` in a worker thread and switch the server over to it. If a move's
        load fails, the node stays on its old span (and says so)."""
        previous, previous_state = self.span, self.state
        self.span, self.state = span, "loading"
        if self.server is not None:
            self.server.moving = True  # no new sessions on a span about to go
        self.notify_change()
        log.info("loading blocks %s of %s", span, self.model.model_id[:12])
        try:
            if self.prepare is not None:
                await self.prepare(span)
            runner = await trio.to_thread.run_sync(functools.partial(
                load_span, self.model.path, span.start, span.end, runtime=self.runtime, device=self.device,
                threads=self.threads))
            runner.format_label = self.format_label
        except Exception:
            if self.server is None:
                raise  # nothing to fall back on: the node cannot start
            log.exception("loading blocks %s failed; staying on %s", span, previous)
            self.span, self.state = previous, previous_state
            self.server.moving = False
            self.notify_change()
            return
        runner.slowdown = self.slowdown
        if self.server is None:
            self.server = self.server_factory(runner)
        else:
            dropped = self.server.replace_runner(runner)
            self.moves += 1
            log.info("moved from blocks %s to %s (%d open sessions dropped)", previous, span, dropped)
        self.state = "paused" if self.server.paused else "serving"  # a pause asked for during the load holds
        self.notify_change()

    def pause(self) -> bool:
        """Stop contributing: no new sessions (open ones go on), the ad says "paused",
        the DHT record is no longer refreshed and lapses. During a load (a move) the
        pause takes effect when it ends. False if paused already or nothing serves."""
        return self._set_paused(True)

    def resume(self) -> bool:
        return self._set_paused(False)

    def _set_paused(self, paused: bool) -> bool:
        if self.server is None or self.server.paused == paused:
            return False
        self.server.paused = paused
        if self.state in ("serving", "paused"):  # loading: serve() applies it at the end
            self.state = "paused" if paused else "serving"
            self.notify_change()
        return True

    def _strength_without_me(self, view: SwarmView, me: str) -> list[float]:
        # A paused server covers nothing: others should fill what only it holds.
        servers = [(ad, s) for ad, s in view.servers(self.model.model_id, time.time()) if s.state != "paused"]
        return block_strength(servers, self.model.num_blocks, exclude=me, unknown_rate=self.block_rate or 1.0)

    async def choose_first_span(self, view: SwarmView, me: str, length: int, warmup_s: float) -> Span:
        """Listen to the swarm for `warmup_s` (randomised, so nodes started together
        decide one after another and see each other's choice), then pick."""
        await trio.sleep(warmup_s * self.rng.uniform(0.5, 1.5))  # 0 for the first node of a swarm
        span = choose_span(self._strength_without_me(view, me), length, self.rng)
        log.info("placement: chose blocks %s (max %d blocks)", span, length)
        return span

    def _target(self, view: SwarmView, me: str) -> Span | None:
        strength = self._strength_without_me(view, me)
        target = better_span(strength, self.span, self.block_rate, self.rng)
        if target is not None and not holes_outside(strength, self.span) and self.server is not None \
                and len(self.server.sessions):
            return None  # a mere rebalance waits for the sessions here to end; a hole does not
        return target

    async def rebalance_loop(self, view: SwarmView, me: str, period_s: float) -> None:
        while True:
            await trio.sleep(period_s * self.rng.uniform(1.0, 2.0))
            if self.state != "serving" or self.span is None:
                continue
            if self._target(view, me) is None:
                continue
            # Others may have seen the same hole: give them a chance to move first.
            await trio.sleep(period_s * self.rng.uniform(0.0, 2.0))
            if self.state != "serving":  # paused meanwhile
                continue
            target = self._target(view, me)
            if target is not None:
                log.info("placement: blocks %s are better served elsewhere; moving to %s", self.span, target)
                await self.serve(target)

