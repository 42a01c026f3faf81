"""A short-lived consumer: join the swarm, find a chain through the DHT, generate."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path

import trio

from ..errors import HopUnavailable, RouteError, SwarmUnreachable, UsageError
from ..model.catalog import resolve_model
from ..model.store import ModelStore, is_model_id
from ..model.head import ConsumerHead
from ..net.dht import connect_bootstrap, open_dht
from ..torrent.service import Torrent
from ..net.host import open_host
from ..net.identity import load_or_create_identity
from ..net.view import SwarmView
from .client import open_chain
from .detokenize import IncrementalDetokenizer
from .discovery import discover_servers
from .generate import generate
from .measure import measure_servers
from .routing import Hop, plan_route
from .sampling import SamplingParams

log = logging.getLogger(__name__)

DISCOVERY_ATTEMPTS = 4
DISCOVERY_RETRY_S = 1.5
OPEN_ATTEMPTS = 3


@dataclasses.dataclass(frozen=True)
class RunRequest:
    model: str
    prompt: str | list[int]  # text, or token ids (used as-is, no template)
    params: SamplingParams = SamplingParams()
    chat_template: bool = True


@dataclasses.dataclass
class RunOutcome:
    tokens: list[int]
    text: str
    route: list[Hop]
    first_token_s: float  # from the call to the first token
    decode_tok_s: float


def _prompt_ids(tokenizer, request: RunRequest) -> list[int]:
    if isinstance(request.prompt, list):
        return list(request.prompt)
    if request.chat_template and tokenizer.chat_template:
        encoded = tokenizer.apply_chat_template(
            [{"role": "user", "content": request.prompt}], add_generation_prompt=True, tokenize=True,
            return_dict=True,
        )
        return list(encoded["input_ids"])
    return tokenizer.encode(request.prompt)


def _load_tokenizer(model):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model.path))
    except (OSError, ValueError) as exc:
        raise UsageError(f"model {model.model_id[:12]} has no usable tokenizer, so a text prompt cannot be "
                         f"encoded ({str(exc).splitlines()[0]})") from None


def eos_ids_of(tokenizer, model_path: Path) -> frozenset[int]:
    ids = set()
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen = model_path / "generation_config.json"
    if gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids.update([eos] if isinstance(eos, int) else eos or [])
    return frozenset(ids)


async def find_route(host, dht, model_id: str, num_blocks: int, *, needed_tokens: int = 0,
                     exclude: frozenset[str] = frozenset(), view: SwarmView | None = None) -> list[Hop]:
    """Look up servers, measure them (pings, ads) and plan the fastest chain,
    retrying briefly while a swarm settles."""
    view = SwarmView() if view is None else view

    async def attempt() -> list[Hop]:
        records = await discover_servers(dht, model_id, num_blocks)
        measures, unreachable = await measure_servers(host, records, view)
        return plan_route(records, num_blocks, now=time.time(), measures=measures,
                          needed_tokens=needed_tokens, exclude=exclude | unreachable)

    for _ in range(DISCOVERY_ATTEMPTS - 1):
        try:
            return await attempt()
        except RouteError:
            await trio.sleep(DISCOVERY_RETRY_S)
    return await attempt()


async def run_prompt(data_dir: Path, bootstrap: tuple[str, ...], request: RunRequest, *,
                     on_text: Callable[[str], None] = lambda _t: None,
                     on_route: Callable[[list[Hop]], None] = lambda _r: None) -> RunOutcome:
    began = time.perf_counter()
    loaded: dict = {}

    def load_local_parts() -> None:
        # Errors are kept until both overlapping steps are done, so the report does
        # not depend on which ends first: a local problem first, then "no swarm".
        try:
            model = resolve_model(request.model, data_dir)
            loaded["model"] = model
            loaded["tokenizer"] = None if isinstance(request.prompt, list) else _load_tokenizer(model)
            loaded["head"] = ConsumerHead.load(model.path)
        except Exception as exc:
            loaded["error"] = exc

    # A model known by its id (or an alias) whose head and tokenizer are not here: they
    # come from the swarm's seeders.
    stored = ModelStore(data_dir).get(request.model)
    from_swarm = (stored is None and is_model_id(request.model)) or (stored is not None
                                                                     and not stored.holds(head=True))
    key_pair = load_or_create_identity(data_dir)
    async with open_host(key_pair, ["/ip4/127.0.0.1/tcp/0"]) as host, open_dht(host, server=False) as dht:
        # Joining the swarm and loading the local parts overlap: both take seconds.
        unreachable: SwarmUnreachable | None = None
        async with trio.open_nursery() as nursery:
            if not from_swarm:
                nursery.start_soon(trio.to_thread.run_sync, load_local_parts)
            try:
                await connect_bootstrap(host, dht, bootstrap)
            except SwarmUnreachable as exc:
                unreachable = exc
        if "error" in loaded:
            raise loaded["error"]
        if unreachable is not None:
            raise unreachable
        if from_swarm:
            await Torrent(host, dht, data_dir).fetch(stored.model_id if stored else request.model, head=True)
            await trio.to_thread.run_sync(load_local_parts)
            if "error" in loaded:
                raise loaded["error"]
        model = loaded["model"]
        tokenizer, head = loaded["tokenizer"], loaded["head"]
        prompt_ids = _prompt_ids(tokenizer, request)
        eos = eos_ids_of(tokenizer, model.path)
        produced: list[int] = []
        times: list[float] = []
        detokenizer = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None

        def on_token(token: int) -> None:
            times.append(time.perf_counter())
            produced.append(token)
            if detokenizer is not None:
                text = detokenizer.push(token)
                if text:
                    on_text(text)

        max_tokens = len(prompt_ids) + request.params.max_new_tokens
        failed: set[str] = set()
        view = SwarmView()
        for attempt in range(OPEN_ATTEMPTS):
            route = await find_route(host, dht, model.model_id, model.num_blocks, needed_tokens=max_tokens,
                                     exclude=frozenset(failed), view=view)
            on_route(route)
            try:
                async with open_chain(host, route, model.model_id, max_tokens=max_tokens,
                                      hidden_size=model.hidden_size) as chain:
                    await generate(chain, head, prompt_ids, request.params, eos_ids=eos, on_token=on_token)
                break
            except HopUnavailable as exc:  # busy, gone or refusing: route around it
                if attempt == OPEN_ATTEMPTS - 1:
                    raise
                log.warning("%s; choosing another route", exc)
                failed.add(exc.peer_id)
    decode_s = times[-1] - times[0] if len(times) > 1 else 0.0
    return RunOutcome(
        tokens=produced,
        text=tokenizer.decode(produced, skip_special_tokens=True) if tokenizer is not None else "",
        route=route,
        first_token_s=times[0] - began,
        decode_tok_s=(len(times) - 1) / decode_s if decode_s > 0 else 0.0,
    )
