"""Generations for the daemon's HTTP clients: one Consumer per model, built on the
node's own host and DHT (no second identity), its head and tokenizer loaded once
(fetched from the swarm's seeders when the node holds only its span)."""

from __future__ import annotations

import dataclasses
import logging
import re
import time
from collections.abc import Callable
from pathlib import Path

import trio

from ...errors import UsageError
from ...model.catalog import resolve_model
from ...spans import load_head
from ...model.store import ModelStore, is_model_id
from ...model.tokenizer import load_tokenizer
from ...net.view import SwarmView, coverage
from ...pipeline.client.consumer import Consumer, RunOutcome, RunRequest
from ...pipeline.client.produced import Piece
from ...pipeline.client.routing import Hop
from ...pipeline.client.spotcheck import DEFAULT_RATE
from ...pipeline.client.grammar import json_schema_grammar
from .requests import BadField, Generation
from .structured import Shape
from .tools import CallFormat, Tool, call_format, check_tool_request, template_messages, tools_grammar

log = logging.getLogger(__name__)

ADAPTERS_DIR = "adapters"  # in the data dir: the adapters API requests may name
ADAPTER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")  # a file's name there: never a path
ROLES = ("system", "developer", "user", "assistant", "tool")  # developer: OpenAI's newer name for system
MAX_MESSAGES = 256


def messages_to_ids(tokenizer, messages: object, tools: tuple[Tool, ...] = ()) -> list[int]:
    """The model's chat template over OpenAI-style messages, with the `tools` offered
    (raises UsageError)."""
    if not isinstance(messages, list) or not 1 <= len(messages) <= MAX_MESSAGES:
        raise UsageError(f"'messages' must be a list of 1..{MAX_MESSAGES} messages")
    clean = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        if isinstance(content, list):  # content parts: only text ones can be read by this model
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise UsageError("only text content parts are supported")
            content = "".join(p["text"] for p in content)
        if content is None and calls and message.get("role") == "assistant":
            content = ""  # a reply that only called tools
        if not isinstance(message, dict) or message.get("role") not in ROLES or not isinstance(content, str):
            raise UsageError(f"each message needs a 'role' in {ROLES} and a string 'content'")
        role = "system" if message["role"] == "developer" else message["role"]
        entry = {"role": role, "content": content}
        if calls:
            if not isinstance(calls, list) or role != "assistant":
                raise UsageError("'tool_calls' must be a list, on assistant messages")
            entry["tool_calls"] = calls
        for key in ("tool_call_id", "name", "tool_name"):
            if role == "tool" and isinstance(message.get(key), str):
                entry[key] = message[key]
        clean.append(entry)
    clean = template_messages(clean)
    if tokenizer.chat_template:
        extra = {"tools": [tool.spec for tool in tools]} if tools else {}
        encoded = tokenizer.apply_chat_template(clean, add_generation_prompt=True, tokenize=True, return_dict=True,
                                                **extra)
        return list(encoded["input_ids"])
    if any(m["role"] == "tool" or "tool_calls" in m for m in clean):
        raise UsageError("this model has no chat template: it cannot read tool calls or their results")
    return tokenizer.encode("\n".join(f"{m['role']}: {m['content']}" for m in clean) + "\nassistant:")


def adapter_path(data_dir: Path, name: str) -> Path:
    """The adapter an API request names: `<data dir>/adapters/NAME` (a PEFT directory)
    or `.../NAME.safetensors`. Only names, never paths: a request reads nothing else."""
    folder = data_dir / ADAPTERS_DIR
    if ADAPTER_NAME.match(name) and ".." not in name:
        for path in (folder / name, folder / f"{name}.safetensors"):
            if (path.is_file() and path.suffix == ".safetensors") or path.is_dir():
                return path
    raise BadField("adapter", f"unknown adapter {name[:64]!r}: this node's adapters are the PEFT directories and "
                              f".safetensors files in {folder}")


def adapters_for(data_dir: Path, model_id: str) -> list[str]:
    """The names of the adapters in the data dir's folder made for `model_id`."""
    from ...model import adapter_file  # noqa: PLC0415  (safetensors headers only)

    folder = data_dir / ADAPTERS_DIR
    names = []
    for path in sorted(folder.iterdir()) if folder.is_dir() else []:
        name = path.name.removesuffix(".safetensors")
        if not ADAPTER_NAME.match(path.name) or not (path.is_dir() or path.suffix == ".safetensors"):
            continue
        try:
            made_for = adapter_file.model_id_of(path)
        except Exception:  # unreadable: not offered
            continue
        if made_for in (None, model_id):
            names.append(name)
    return names


@dataclasses.dataclass(frozen=True)
class Prepared:
    """A generation made ready: the model's consumer, the prompt's tokens, the adapter,
    the grammar the reply follows and the format its tool calls come in."""

    consumer: Consumer
    model: str  # the name the request used (echoed in replies)
    prompt: list[int]
    adapter: Path | None = None
    grammar: str | None = None
    calls: CallFormat | None = None  # the reply is parsed for tool calls in this format


def prompt_of(tokenizer, gen: Generation) -> list[int]:
    """The prompt's tokens: chat messages through the template (with the tools the
    model may call); a completion's text as it is; Ollama's generate through the
    template (with its system message) unless raw."""
    if gen.messages is not None:
        return messages_to_ids(tokenizer, gen.messages, gen.shape.tools if gen.shape.calls else ())
    if isinstance(gen.prompt, list):
        if max(gen.prompt) >= len(tokenizer):
            raise BadField("prompt", f"token ids must be below the vocabulary's {len(tokenizer)}")
        return list(gen.prompt)
    if gen.raw or gen.api == "POST /v1/completions":
        return list(tokenizer.encode(gen.prompt or "", add_special_tokens=False)) or [tokenizer.eos_token_id or 0]
    system = [{"role": "system", "content": gen.system}] if gen.system else []
    return messages_to_ids(tokenizer, system + [{"role": "user", "content": gen.prompt or ""}])


def describe_hops(route: list[Hop], view: SwarmView, *, private: bool) -> list[dict]:
    """The route as the chat page and the `route` extension show it: who runs which
    blocks, on what, reached how."""
    now = time.time()
    hops = []
    for hop in route:
        ad = view.get(hop.peer_id, now)
        hardware = "?"
        if ad is not None:
            hw = ad.hardware
            gpu = f", {hw.gpu} {hw.gpu_mb} MB" if hw.gpu else ""
            hardware = f"{hw.cpu_cores} cpu, {hw.ram_mb // 1024} GiB{gpu}"
        hops.append({"peer_id": hop.peer_id, "start": hop.start, "end": hop.end, "private": private,
                     "hardware": hardware, "reach": ad.reach if ad is not None else "unknown",
                     "relayed": all("/p2p-circuit" in a for a in hop.record.addrs) and bool(hop.record.addrs)})
    return hops


class ChatEngine:
    def __init__(self, host, dht, data_dir: Path, *, torrent, default_model: str,
                 spot_check_rate: float = DEFAULT_RATE, view: SwarmView | None = None,
                 follow: Callable[[str], None] | None = None,
                 picture: Callable[[], SwarmView] | None = None) -> None:
        self.host, self.dht, self.data_dir, self.torrent = host, dht, data_dir, torrent
        self.follow = follow  # joins a model's ad topic (net/gossip.Gossip.follow)
        # The swarm beyond the models the node follows, for the model picker (net/directory.py).
        self.picture = picture if picture is not None else (lambda: self.view)
        self.default_model = default_model
        self.view = view if view is not None else SwarmView()  # the node's own, fed by gossip
        self.spot_check_rate = spot_check_rate
        self._consumers: dict[str, Consumer] = {}
        self._lock = trio.Lock()

    def models(self) -> list[tuple[str, str]]:
        """(name, model id) of every model stored here, aliases first."""
        store = ModelStore(self.data_dir)
        named = sorted(store.aliases().items())
        ids = {model_id for _, model_id in named}
        return named + [(m.model_id, m.model_id) for _, m in store.list() if m.model_id not in ids]

    def loaded(self) -> set[str]:
        """The ids of the models whose consumers are ready here."""
        return set(self._consumers)

    def swarm_models(self) -> list[dict]:
        """Every model stored here or served in the swarm (as the node's ads, and its
        neighbours' views, tell it), for the chat page's picker (/control/models)."""
        now, view = time.time(), self.picture()
        store = ModelStore(self.data_dir)
        listed: dict[str, dict] = {}
        for name, model_id in self.models():
            stored = store.get(model_id)
            entry = listed.setdefault(model_id, {
                "name": name, "id": model_id, "names": [], "stored": True, "served": False, "complete": False,
                "num_blocks": stored.num_blocks if stored else 0, "private": False,
                "adapters": adapters_for(self.data_dir, model_id)})
            entry["names"].append(name)
        for model_id in sorted(view.models(now)):
            servers = view.servers(model_id, now)
            named = next((s.name for _, s in servers if s.name), None)
            entry = listed.setdefault(model_id, {
                "name": named or model_id, "id": model_id, "names": [named] if named else [], "stored": False,
                "served": True, "complete": False, "num_blocks": max(s.end for _, s in servers), "private": False,
                "adapters": adapters_for(self.data_dir, model_id)})
            ready = [(ad, s) for ad, s in servers if s.state == "serving"]
            entry["served"] = bool(ready)
            entry["complete"] = bool(ready) and min(coverage(ready, entry["num_blocks"])) > 0
            entry["private"] = any(s.private_rate > 0 for _, s in ready)
        return list(listed.values())

    async def consumer(self, name: str) -> Consumer:
        async with self._lock:  # one load per model, however many requests wait for it
            if is_model_id(name) and ModelStore(self.data_dir).get(name) is None and self.torrent is not None:
                log.info("fetching the head and tokenizer of %s from the swarm for the API", name[:12])
                await self.torrent.fetch(name, head=True)  # a model only the swarm serves
            model = await trio.to_thread.run_sync(lambda: resolve_model(name, self.data_dir))
            consumer = self._consumers.get(model.model_id)
            if consumer is not None:
                return consumer
            if not model.holds(head=True):
                log.info("fetching the head and tokenizer of %s for the API", model.model_id[:12])
                await self.torrent.fetch(model.model_id, head=True)

            def load():
                return load_tokenizer(model), load_head(model.path)

            tokenizer, head = await trio.to_thread.run_sync(load)
            consumer = Consumer(self.host, self.dht, self.data_dir, model, tokenizer, head,
                                spot_check_rate=self.spot_check_rate, follow=self.follow)
            self._consumers[model.model_id] = consumer
            return consumer

    async def prepare(self, gen: Generation) -> Prepared:
        """The model's consumer, the prompt's tokens and the adapter's file, checked
        against the model (raises before any generation)."""
        name = gen.model or self.default_model
        consumer = await self.consumer(name)
        shape = gen.shape
        calls = call_format(consumer.tokenizer.chat_template) if shape.calls else None
        try:
            check_tool_request(calls, shape.tools, shape.choice)
        except UsageError as exc:
            raise BadField("tools", str(exc)) from None
        prompt = prompt_of(consumer.tokenizer, gen)
        path = None if gen.adapter is None else adapter_path(self.data_dir, gen.adapter)
        if path is not None:
            await trio.to_thread.run_sync(consumer.load_adapter, path)
        grammar = await self._grammar(consumer, shape, calls)
        return Prepared(consumer, name, prompt, path, grammar, calls)

    @staticmethod
    async def _grammar(consumer: Consumer, shape: Shape, calls: CallFormat | None) -> str | None:
        """The grammar the reply must follow, checked against the model's tokenizer."""
        param = "tools" if calls is not None else shape.param
        try:
            if calls is not None:
                grammar = tools_grammar(calls, shape.tools, shape.choice, shape.parallel)
            else:
                grammar = None if shape.schema is None else json_schema_grammar(shape.schema)
            if grammar is not None:
                await consumer.check_grammar(grammar)
        except (UsageError, ValueError) as exc:
            raise BadField(param, str(exc)) from None
        return grammar

    async def run(self, prepared: Prepared, gen: Generation, on_piece: Callable[[Piece], None] = lambda _p: None,
                  on_route: Callable[[list[Hop]], None] = lambda _r: None) -> RunOutcome:
        request = RunRequest(model=prepared.model, prompt=prepared.prompt, params=gen.params, chat_template=False,
                             private=gen.private, standby=gen.standby, fast_replay=gen.fast_replay,
                             adapter=prepared.adapter, stop=gen.stop,
                             logprobs=gen.logprobs, grammar=prepared.grammar)
        return await prepared.consumer.generate(request, on_piece=on_piece, on_route=on_route)


PRIVATE_PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")  # what a private hop computes, per layer
PRIVATE_LOCAL = ("prompt", "embeddings", "norms", "attention", "kv_cache", "lm_head")  # what never leaves


def private_report(outcome: RunOutcome, num_layers: int) -> dict:
    """The API's `compushare` extension of a private reply: which stages ran encrypted
    where (the same facts `run --private` prints: private_chain.describe_private_route)."""
    from ...pipeline.client.private_chain import describe_private_route  # noqa: PLC0415  (loaded by a private run)

    route = [{"peer_id": hop.peer_id, "layers": [hop.start, hop.end], "encrypted": list(PRIVATE_PROJECTIONS)}
             for hop in outcome.route]
    return {"private": True, "local": list(PRIVATE_LOCAL), "route": route,
            "encrypted_layers": sum(hop.end - hop.start for hop in outcome.route), "num_layers": num_layers,
            "summary": describe_private_route(outcome.route, num_layers), "stats": dict(outcome.private or {})}


def token_text(tokenizer, token: int) -> str:
    """One token's text as logprobs show it (a piece of a multi-byte character shows as U+FFFD)."""
    return tokenizer.decode([token], skip_special_tokens=False)


def run_stats(outcome: RunOutcome, prompt_tokens: int, private: bool) -> dict:
    """The `route` extension's figures of one generation."""
    return {"first_token_s": round(outcome.first_token_s, 4), "decode_tok_s": round(outcome.decode_tok_s, 3),
            "tokens": len(outcome.tokens), "prompt_tokens": prompt_tokens, "failovers": len(outcome.failovers),
            "standby_takeovers": outcome.standby_takeovers, "private": private}


def reply_extension(prepared: Prepared, gen: Generation, outcome: RunOutcome) -> dict:
    """CompuShare's fields of a reply, both APIs': what ran encrypted where (private
    requests), the route and its figures (`route`); {} for a plain request."""
    ext: dict = {}
    if gen.private:
        ext = private_report(outcome, prepared.consumer.model.num_blocks)
    if gen.route:
        hops = describe_hops(outcome.route, prepared.consumer.view, private=gen.private)
        for hop, private in zip(hops, ext.get("route", []), strict=False):
            hop.update(layers=private["layers"], encrypted=private["encrypted"])
        ext.update(route=hops, stats=run_stats(outcome, len(prepared.prompt), gen.private))
    return {"compushare": ext} if ext else {}
