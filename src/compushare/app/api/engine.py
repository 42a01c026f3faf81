"""Generations for the daemon's HTTP clients: one Consumer per model, built on the
node's own host and DHT (no second identity), its head and tokenizer loaded once
(fetched from the swarm's seeders when the node holds only its span)."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from pathlib import Path

import trio

from ...errors import UsageError
from ...model.catalog import resolve_model
from ...model.head import ConsumerHead
from ...model.store import ModelStore
from ...model.tokenizer import load_tokenizer
from ...pipeline.client.consumer import Consumer, RunOutcome, RunRequest
from ...pipeline.client.sampling import SamplingParams
from ...pipeline.client.spotcheck import DEFAULT_RATE

log = logging.getLogger(__name__)

ADAPTERS_DIR = "adapters"  # in the data dir: the adapters API requests may name
ADAPTER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")  # a file's name there: never a path
ROLES = ("system", "developer", "user", "assistant")  # developer: OpenAI's newer name for system
MAX_MESSAGES = 256


def messages_to_ids(tokenizer, messages: object) -> list[int]:
    """The model's chat template over OpenAI-style messages (raises UsageError)."""
    if not isinstance(messages, list) or not 1 <= len(messages) <= MAX_MESSAGES:
        raise UsageError(f"'messages' must be a list of 1..{MAX_MESSAGES} messages")
    clean = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):  # content parts: only text ones can be read by this model
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise UsageError("only text content parts are supported")
            content = "".join(p["text"] for p in content)
        if not isinstance(message, dict) or message.get("role") not in ROLES or not isinstance(content, str):
            raise UsageError(f"each message needs a 'role' in {ROLES} and a string 'content'")
        role = "system" if message["role"] == "developer" else message["role"]
        clean.append({"role": role, "content": content})
    if tokenizer.chat_template:
        encoded = tokenizer.apply_chat_template(clean, add_generation_prompt=True, tokenize=True, return_dict=True)
        return list(encoded["input_ids"])
    return tokenizer.encode("\n".join(f"{m['role']}: {m['content']}" for m in clean) + "\nassistant:")


def adapter_path(data_dir: Path, name: str) -> Path:
    """The adapter an API request names: `<data dir>/adapters/NAME` (a PEFT directory)
    or `.../NAME.safetensors`. Only names, never paths: a request reads nothing else."""
    folder = data_dir / ADAPTERS_DIR
    if ADAPTER_NAME.match(name) and ".." not in name:
        for path in (folder / name, folder / f"{name}.safetensors"):
            if (path.is_file() and path.suffix == ".safetensors") or path.is_dir():
                return path
    raise UsageError(f"unknown adapter {name[:64]!r}: this node's adapters are the PEFT directories and "
                     f".safetensors files in {folder}")


class ChatEngine:
    def __init__(self, host, dht, data_dir: Path, *, torrent, default_model: str,
                 spot_check_rate: float = DEFAULT_RATE) -> None:
        self.host, self.dht, self.data_dir, self.torrent = host, dht, data_dir, torrent
        self.default_model = default_model
        self.spot_check_rate = spot_check_rate
        self._consumers: dict[str, Consumer] = {}
        self._lock = trio.Lock()

    def models(self) -> list[tuple[str, str]]:
        """(name, model id) of every model stored here, aliases first."""
        store = ModelStore(self.data_dir)
        named = sorted(store.aliases().items())
        ids = {model_id for _, model_id in named}
        return named + [(m.model_id, m.model_id) for _, m in store.list() if m.model_id not in ids]

    async def consumer(self, name: str) -> Consumer:
        async with self._lock:  # one load per model, however many requests wait for it
            model = await trio.to_thread.run_sync(lambda: resolve_model(name, self.data_dir))
            consumer = self._consumers.get(model.model_id)
            if consumer is not None:
                return consumer
            if not model.holds(head=True):
                log.info("fetching the head and tokenizer of %s for the API", model.model_id[:12])
                await self.torrent.fetch(model.model_id, head=True)

            def load():
                return load_tokenizer(model), ConsumerHead.load(model.path)

            tokenizer, head = await trio.to_thread.run_sync(load)
            consumer = Consumer(self.host, self.dht, self.data_dir, model, tokenizer, head,
                                spot_check_rate=self.spot_check_rate)
            self._consumers[model.model_id] = consumer
            return consumer

    async def prepare(self, name: str, messages: object,
                      adapter: str | None = None) -> tuple[Consumer, list[int], Path | None]:
        """The model's consumer, the prompt's tokens and the adapter's file, checked
        against the model (raises before any generation)."""
        consumer = await self.consumer(name)
        prompt = messages_to_ids(consumer.tokenizer, messages)
        path = None if adapter is None else adapter_path(self.data_dir, adapter)
        if path is not None:
            await trio.to_thread.run_sync(consumer.load_adapter, path)
        return consumer, prompt, path

    async def run(self, consumer: Consumer, name: str, prompt: list[int], params: SamplingParams,
                  on_text: Callable[[str], None] = lambda _t: None, *, private: bool = False,
                  adapter: Path | None = None) -> RunOutcome:
        return await consumer.generate(RunRequest(model=name, prompt=prompt, params=params, chat_template=False,
                                                  private=private, adapter=adapter), on_text=on_text)


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
