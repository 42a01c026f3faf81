"""A short-lived consumer: join the swarm, find a chain through the DHT, generate."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import random
import time
from collections.abc import Callable
from pathlib import Path

import trio

from ...errors import ModelUnavailable, RouteError, SwarmUnreachable, UsageError
from ...karma.ledger import ReportStore
from ...karma.record import karma_validators
from ...karma.service import KarmaBook, submit_report
from ...model.catalog import CATALOG, resolve_model, split_name
from ...model.store import ModelStore, is_model_id
from ...model.head import ConsumerHead
from ...torrent.service import Torrent
from ...net.gossip import learn_views
from ...net.identity import load_or_create_identity
from ...net.peer import open_swarm_host
from ...net.records import ServerRecord
from ...net.traversal import client_traversal
from ...net.view import SwarmView
from .chain import Failover, open_chain
from .detokenize import IncrementalDetokenizer
from .discovery import discover_servers
from .generate import GenerateStats, generate
from .speculative import MAX_DRAFT
from .measure import measure_servers
from .names import NameCandidate, choose_candidate, name_candidates
from .routing import Hop, Measure, plan_route
from ...proofs import FailureReport
from .sampling import SamplingParams
from .spotcheck import DEFAULT_RATE as DEFAULT_SPOT_CHECK_RATE, Penalties

log = logging.getLogger(__name__)

DISCOVERY_ATTEMPTS = 4
DISCOVERY_RETRY_S = 1.5
PRIVATE_STEP_TOKENS = 16  # a private prefill goes in chunks of 16 tokens (private_wire.MAX_TOKENS_PER_REQUEST)
DISCOVERY_WAIT_S = 6.0  # a swarm that is still settling: wait this long for a full route
REPORT_SUBMIT_TIMEOUT_S = 5.0
KARMA_LOOKUP_S = 10.0  # one round of karma look-ups (in the background)
MAX_NAME_PROVIDERS = 64  # karma looked up for at most this many providers of a name


@dataclasses.dataclass(frozen=True)
class RunRequest:
    model: str
    prompt: str | list[int]  # text, or token ids (used as-is, no template)
    params: SamplingParams = SamplingParams()
    chat_template: bool = True
    private: bool = False  # every remote activation encrypted (CKKS): pipeline/client/private_chain.py
    direct: bool = True  # hidden states go server to server, the last server's back (else each via the consumer)
    speculate: bool = True  # verify drafted tokens in one pass (pipeline/client/speculative.py)
    standby: bool = False  # keep a standby replica per span, fed every step (pipeline/client/chain_standby.py)


@dataclasses.dataclass
class RunOutcome:
    tokens: list[int]
    text: str
    route: list[Hop]
    first_token_s: float  # from the call to the first token
    decode_tok_s: float
    failovers: list[Failover] = dataclasses.field(default_factory=list)
    reports: list[FailureReport] = dataclasses.field(default_factory=list)
    checks: int = 0  # spot checks made
    private: dict | None = None  # private mode: PrivateStats.as_dict() (where the time went, bytes, keys)
    direct_steps: int = 0  # steps that went straight through the chain (direct return)
    chain_breaks: int = 0  # ... whose proofs did not link up (relayed instead)
    checked_relays: int = 0  # steps relayed (not direct) because a hop's spot check was due
    standby_takeovers: int = 0  # failovers a standby replica took over (no history replayed)
    passes: int = 0  # steps through the chain after the prompt
    drafted: int = 0  # speculation: drafted tokens verified
    accepted: int = 0  # ... and kept


def prompt_ids_of(tokenizer, request: RunRequest) -> list[int]:
    if isinstance(request.prompt, list):
        return list(request.prompt)
    if request.chat_template and tokenizer.chat_template:
        encoded = tokenizer.apply_chat_template(
            [{"role": "user", "content": request.prompt}], add_generation_prompt=True, tokenize=True,
            return_dict=True,
        )
        return list(encoded["input_ids"])
    return tokenizer.encode(request.prompt)


# What AutoTokenizer resolves these to is transformers' generic fast tokenizer: loading
# that class directly skips AutoTokenizer's class tables and what they import (the
# modeling stack, torch._dynamo), seconds before a `run`'s first token.
GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _tokenizer_class(model_path: Path) -> str | None:
    try:
        return json.loads((model_path / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None  # AutoTokenizer reports what is wrong


def load_tokenizer(model):
    try:
        if _tokenizer_class(model.path) in GENERIC_TOKENIZER_CLASSES:
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast.from_pretrained(str(model.path))
        from transformers import AutoTokenizer

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
                     exclude: frozenset[str] = frozenset(), view: SwarmView | None = None,
                     fmt: str | None = None) -> list[Hop]:
    """Look up servers, measure them (pings, ads) and plan the fastest chain,
    retrying briefly while a swarm settles. With `fmt`, servers whose records name
    another weight format are left out."""
    view = SwarmView() if view is None else view

    async def attempt() -> list[Hop]:
        records = in_format(await discover_servers(dht, model_id, num_blocks), fmt)
        measures, unreachable = await measure_servers(host, records, view)
        return plan_route(records, num_blocks, now=time.time(), measures=measures,
                          needed_tokens=needed_tokens, exclude=exclude | unreachable)

    for _ in range(DISCOVERY_ATTEMPTS - 1):
        try:
            return await attempt()
        except RouteError:
            await trio.sleep(DISCOVERY_RETRY_S)
    return await attempt()


def peer_ids_of(addrs) -> list[str]:
    """The peer ids named by `/p2p/<id>` multiaddrs."""
    return [addr.rsplit("/p2p/", 1)[1] for addr in addrs if "/p2p/" in addr]


async def name_from_swarm(host, dht, name: str, *, trusted: list[str] = ()) -> NameCandidate | None:
    """The model id the swarm serves under `name`, counting only providers with
    evidence (pipeline/client/names.py): the `trusted` peers (the bootstrap peers the
    user gave: a connection anyone can open is no evidence) and providers whose karma
    is above a newcomer's (looked up for at most MAX_NAME_PROVIDERS of them, chosen at
    random so ground ids cannot crowd others out). None when no server names it at all;
    an error when some do but none has evidence."""
    view = SwarmView()
    view.set_self(host.get_id().to_string())
    await learn_views(host, view)
    now = time.time()
    view.note_connected(trusted, now)
    providers = sorted({ad.peer_id for ad in view.live(now) for s in ad.serving if s.name == name})
    if not providers:
        return None
    karma = KarmaBook()
    sample = random.sample(providers, min(len(providers), MAX_NAME_PROVIDERS))
    with trio.move_on_after(KARMA_LOOKUP_S):
        await karma.refresh(host, dht, sample, timeout_s=KARMA_LOOKUP_S)
    view.note_karma([p for p in providers if (karma.known(p) or 0.0) > 1.0], time.time())
    candidates = name_candidates(view, name, time.time())
    chosen = choose_candidate(name, candidates)
    if len(candidates) > 1:
        log.warning("%d models are served as %r: using %s. Others: %s", len(candidates), name, chosen.describe(),
                    "; ".join(c.describe() for c in candidates[1:4]))
    else:
        log.info("%r is %s", name, chosen.describe())
    return chosen


def in_format(records: list[ServerRecord], fmt: str | None) -> list[ServerRecord]:
    """The records naming `fmt` (the model id's weight format): a chain never mixes
    formats. A record naming none is fp32's (older nodes', and fp32 servers leave it
    unsaid); the session's Opened reply is checked too (pipeline/client/hop.open_hop)."""
    if fmt is None:
        return records
    dropped = [r for r in records if (r.fmt or "fp32") != fmt]
    if dropped:
        log.warning("left out %d server(s) whose records name another weight format than %s: %s", len(dropped), fmt,
                    ", ".join(f"{r.peer_id[-8:]} ({r.fmt})" for r in dropped[:4]))
    return [r for r in records if (r.fmt or "fp32") == fmt]


def records_from_ads(view: SwarmView, model_id: str, now: float) -> list[tuple[ServerRecord, Measure]]:
    """Server records made from live capability ads (each signed by its server) of
    peers serving a span of `model_id`, with what the ads say of their speed and
    room: a second way to learn of servers."""
    found = []
    for ad in view.live(now):
        for serving in ad.serving_of(model_id):
            if serving.state == "serving" and ad.addrs:
                record = ServerRecord(peer_id=ad.peer_id, model_id=model_id, start=serving.start,
                                      end=serving.end, dtype=serving.dtype, addrs=ad.addrs,
                                      expires=ad.expires, seq=0, fmt=serving.fmt)
                found.append((record, Measure(block_rate=serving.block_rate, load=serving.load,
                                              free_tokens=serving.free_tokens)))
    return found


class SwarmPlanner:
    """Where a consumer's chains find servers: the model's server records and their
    measurements, refreshed in the background so that a failover plans at once
    instead of waiting on the DHT, and the peers this consumer avoids."""

    REFRESH_S = 5.0
    RETRY_S = 0.5

    def __init__(self, host, dht, model_id: str, num_blocks: int, *, needed_tokens: int = 0,
                 penalties: Penalties | None = None, view: SwarmView | None = None,
                 karma: KarmaBook | None = None, private: bool = False, fmt: str | None = None) -> None:
        self.host, self.dht = host, dht
        self.fmt = fmt  # the model's weight format: records naming another are left out
        # Private mode: only servers whose live ad offers encrypted products, rated by
        # that (much slower) rate.
        self.private = private
        self.model_id, self.num_blocks = model_id, num_blocks
        self.needed_tokens = needed_tokens
        self.penalties = penalties or Penalties()
        self.view = SwarmView() if view is None else view
        self.karma = KarmaBook() if karma is None else karma
        self.records: list = []
        self.measures: dict = {}
        self.unreachable: set[str] = set()

    async def refresh(self) -> None:
        """Look the servers up again. What a look-up misses is not forgotten: while
        servers restart, the DHT may briefly hold none of a span's records (they
        lived on nodes that went down), and a failover must still have candidates.
        Servers whose capability ads say they serve the model count too."""
        now = time.time()
        known = {r.peer_id: r for r in self.records if r.is_live(now)}
        for record in await discover_servers(self.dht, self.model_id, self.num_blocks):
            if record.peer_id not in known or record.seq >= known[record.peer_id].seq:
                known[record.peer_id] = record
        # A restarted server listens on new addresses; its live ad (at most 15 s old,
        # signed by it) has them before its next DHT record does.
        await learn_views(self.host, self.view)
        records = []
        for record in known.values():
            ad = self.view.get(record.peer_id, now)
            if ad is not None:
                serving = ad.serving_of(self.model_id)
                if serving and not any(s.state == "serving" for s in serving):
                    continue  # paused or moving, says its live ad: it would refuse a session
                if ad.addrs and set(ad.addrs) != set(record.addrs):
                    record = dataclasses.replace(record, addrs=ad.addrs)
            records.append(record)
        measures, unreachable = await measure_servers(self.host, records, self.view, learn=False)
        for record, measure in records_from_ads(self.view, self.model_id, time.time()):
            if record.peer_id not in known:
                records.append(record)
                measures[record.peer_id] = measure
        measures = {peer: dataclasses.replace(m, karma=self.karma.get(peer)) for peer, m in measures.items()}
        if self.private:
            records, measures = self._private_only(records, measures, time.time())
        self.records, self.measures, self.unreachable = in_format(records, self.fmt), measures, unreachable

    def _private_only(self, records, measures, now):
        kept, rated = [], {}
        for record in records:
            ad = self.view.get(record.peer_id, now)
            rates = [s.private_rate for s in (ad.serving_of(self.model_id) if ad is not None else [])
                     if s.start <= record.start and record.end <= s.end and s.private_rate > 0]
            if rates:
                kept.append(record)
                rated[record.peer_id] = dataclasses.replace(measures.get(record.peer_id, Measure()),
                                                            block_rate=max(rates))
        return kept, rated

    async def karma_loop(self) -> None:
        """Keep the candidates' karma checked, in the background: it only breaks ties
        between routes, so no plan ever waits for it (the first one may not have it)."""
        while True:
            await self.karma.refresh(self.host, self.dht, [r.peer_id for r in self.records],
                                     timeout_s=KARMA_LOOKUP_S)
            await trio.sleep(self.REFRESH_S)

    async def refresh_loop(self) -> None:
        while True:
            await trio.sleep(self.REFRESH_S)
            try:
                await self.refresh()
            except Exception as exc:  # a failed refresh keeps the last candidates
                log.info("refreshing the candidate servers failed: %s", exc)

    def _exclude(self) -> frozenset[str]:
        return self.penalties.excluded(time.monotonic()) | frozenset(self.unreachable)

    def plan_now(self, start: int = 0, end: int | None = None) -> list[Hop]:
        def plan(exclude: frozenset[str]) -> list[Hop]:
            return plan_route(self.records, self.num_blocks, now=time.time(), measures=self.measures,
                              needed_tokens=self.needed_tokens, exclude=exclude, start=start, end=end)

        try:
            return plan(self._exclude())
        except RouteError:
            if not self.unreachable:
                raise
        # "Unreachable" may be stale (a missed ping, an ad from before a server was
        # ready): better to try such a server than to have no route at all.
        return plan(self.penalties.excluded(time.monotonic()))

    async def plan(self, start: int, end: int, *, deadline: float) -> list[Hop]:
        while True:
            try:
                return self.plan_now(start, end)
            except RouteError as exc:
                if trio.current_time() >= deadline:
                    raise
                log.info("no route through blocks %d:%d yet (%s; avoiding %s, unreachable %s); looking again",
                         start, end, exc, sorted(p[-8:] for p in self.penalties.excluded(time.monotonic())),
                         sorted(p[-8:] for p in self.unreachable))
            with trio.move_on_at(deadline):
                await trio.sleep(self.RETRY_S)
                try:
                    await self.refresh()
                except Exception as exc:  # plan with what is known; the deadline bounds the wait
                    log.info("refreshing the candidate servers failed: %s", exc)

    def verifier(self, start: int, end: int, exclude: set[str]) -> Hop | None:
        now, excluded = time.time(), self._exclude() | exclude
        holders = [r for r in self.records if r.start <= start and end <= r.end and r.is_live(now)
                   and r.peer_id not in excluded]
        if not holders:
            return None

        def rtt(record) -> float:
            measure = self.measures.get(record.peer_id)
            return measure.rtt_s if measure is not None and measure.rtt_s is not None else 1.0

        return Hop(min(holders, key=lambda r: (rtt(r), r.peer_id)), start, end)


class Consumer:
    """A client of the swarm for one model: joined once, then any number of generations."""

    def __init__(self, host, dht, data_dir: Path, model, tokenizer, head: ConsumerHead, *,
                 spot_check_rate: float = DEFAULT_SPOT_CHECK_RATE) -> None:
        self.host, self.dht, self.data_dir = host, dht, data_dir
        self.model, self.tokenizer, self.head = model, tokenizer, head
        self.eos = eos_ids_of(tokenizer, model.path)
        self.spot_check_rate = spot_check_rate
        self.penalties = Penalties()  # shared by every generation of this consumer
        self.view = SwarmView()
        self.karma = KarmaBook()  # shared too: scores are rechecked at most once a minute
        self.reports: list[FailureReport] = []
        self._private: dict | None = None  # private mode's keys and local layers, made on first use

    @classmethod
    @contextlib.asynccontextmanager
    async def connect(cls, data_dir: Path, bootstrap: tuple[str, ...], model_name: str, *,
                      text_prompts: bool = True, spot_check_rate: float = DEFAULT_SPOT_CHECK_RATE,
                      listen: tuple[str, ...] = ()):
        loaded: dict = {}
        wanted = [model_name]  # what to load: the name, or the id the swarm names for it

        def load_local_parts() -> None:
            # Errors are kept until both overlapping steps are done, so the report does
            # not depend on which ends first: a local problem first, then "no swarm".
            try:
                model = resolve_model(wanted[0], data_dir)
                loaded["model"] = model
                loaded["tokenizer"] = load_tokenizer(model) if text_prompts else None
                loaded["head"] = ConsumerHead.load(model.path)
            except Exception as exc:
                loaded["error"] = exc

        # A model known by its id (or an alias) whose head and tokenizer are not here: they
        # come from the swarm's seeders. A name neither held here nor the catalog's (whose
        # ids this node derives itself) is asked of the swarm (pipeline/client/names.py);
        # the answer is used, not kept: a later run asks again.
        store = ModelStore(data_dir)
        stored = store.get(model_name)
        by_name = stored is None and not is_model_id(model_name) and split_name(model_name)[0] not in CATALOG
        from_swarm = (stored is None and is_model_id(model_name)) or (stored is not None
                                                                      and not stored.holds(head=True))
        key_pair = load_or_create_identity(data_dir)
        async with open_swarm_host(key_pair, server=False, validators=karma_validators(),
                                   listen=list(listen) or ["/ip4/127.0.0.1/tcp/0"], bootstrap=bootstrap,
                                   join=False) as swarm, client_traversal(swarm.host):
            host, dht = swarm.host, swarm.dht
            # Joining the swarm and loading the local parts overlap: both take seconds.
            unreachable: SwarmUnreachable | None = None
            async with trio.open_nursery() as nursery:
                if not from_swarm and not by_name:
                    nursery.start_soon(trio.to_thread.run_sync, load_local_parts)
                try:
                    await swarm.join()
                except SwarmUnreachable as exc:
                    unreachable = exc
            if unreachable is not None and by_name:  # no swarm to ask: a local problem is reported first
                await trio.to_thread.run_sync(load_local_parts)
            if "error" in loaded:
                raise loaded["error"]
            if unreachable is not None:
                raise unreachable
            if by_name:
                unnamed: ModelUnavailable | None = None
                try:
                    chosen = await name_from_swarm(host, dht, model_name, trusted=peer_ids_of(bootstrap))
                except ModelUnavailable as exc:  # named, but by no provider with evidence
                    chosen, unnamed = None, exc
                if chosen is not None:
                    await Torrent(host, dht, data_dir).fetch(chosen.model_id, head=True)
                    wanted[0] = chosen.model_id
                await trio.to_thread.run_sync(load_local_parts)
                if "error" in loaded:
                    raise unnamed if unnamed is not None and isinstance(loaded["error"], ModelUnavailable) \
                        else loaded["error"]
            if from_swarm:
                await Torrent(host, dht, data_dir).fetch(stored.model_id if stored else model_name, head=True)
                await trio.to_thread.run_sync(load_local_parts)
                if "error" in loaded:
                    raise loaded["error"]
            yield cls(host, dht, data_dir, loaded["model"], loaded["tokenizer"], loaded["head"],
                      spot_check_rate=spot_check_rate)

    async def generate(self, request: RunRequest, *, on_text: Callable[[str], None] = lambda _t: None,
                       on_route: Callable[[list[Hop]], None] = lambda _r: None,
                       on_token: Callable[[int], None] = lambda _t: None) -> RunOutcome:
        began = time.perf_counter()
        model, tokenizer = self.model, self.tokenizer
        prompt_ids = prompt_ids_of(tokenizer, request)
        produced: list[int] = []
        times: list[float] = []
        detokenizer = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None

        def token_out(token: int) -> None:
            times.append(time.perf_counter())
            produced.append(token)
            on_token(token)
            if detokenizer is not None:
                text = detokenizer.push(token)
                if text:
                    on_text(text)

        max_tokens = len(prompt_ids) + request.params.max_new_tokens + MAX_DRAFT
        stats = GenerateStats()
        planner = SwarmPlanner(self.host, self.dht, model.model_id, model.num_blocks, needed_tokens=max_tokens,
                               penalties=self.penalties, view=self.view, karma=self.karma, private=request.private,
                               fmt=model.format.label)
        if request.private:
            await self._prepare_private()
        await planner.refresh()
        route = await planner.plan(0, model.num_blocks, deadline=trio.current_time() + DISCOVERY_WAIT_S)
        on_route(route)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(planner.refresh_loop)  # candidates stay fresh for failovers
            nursery.start_soon(planner.karma_loop)
            if request.private:
                from .private_chain import PrivateChain  # noqa: PLC0415  (transformers' layers: seconds)

                chain = PrivateChain(self.host, route, model.model_id, self._private["layers"],
                                     self._private["secret"], self._private["keys"], planner=planner,
                                     spot_check_rate=self.spot_check_rate)
                try:
                    await chain.open()
                    await generate(chain, self.head, prompt_ids, request.params, eos_ids=self.eos,
                                   on_token=token_out, max_step_tokens=PRIVATE_STEP_TOKENS)
                finally:
                    await chain.close()
            else:
                async with open_chain(self.host, route, model.model_id, max_tokens=max_tokens,
                                      hidden_size=model.hidden_size, planner=planner,
                                      spot_check_rate=self.spot_check_rate, direct=request.direct,
                                      standby=request.standby, fmt=model.format.label) as chain:
                    await generate(chain, self.head, prompt_ids, request.params, eos_ids=self.eos,
                                   on_token=token_out, speculate=request.speculate, stats=stats)
            nursery.cancel_scope.cancel()
        if chain.route != route:
            on_route(chain.route)
        for report in chain.reports:
            await self._keep_report(report)
        decode_s = times[-1] - times[0] if len(times) > 1 else 0.0
        return RunOutcome(
            tokens=produced,
            text=tokenizer.decode(produced, skip_special_tokens=True) if tokenizer is not None else "",
            route=chain.route,
            first_token_s=times[0] - began,
            decode_tok_s=(len(times) - 1) / decode_s if decode_s > 0 else 0.0,
            failovers=list(chain.failovers),
            reports=list(chain.reports),
            checks=chain.checks,
            private=dict(chain.stats.as_dict(), check_failures=list(chain.check_failures)) if request.private
            else None,
            direct_steps=0 if request.private else chain.core.direct_steps,
            chain_breaks=0 if request.private else chain.core.chain_breaks,
            checked_relays=0 if request.private else chain.core.checked_relays,
            standby_takeovers=0 if request.private else chain.core.standby_takeovers,
            passes=stats.passes, drafted=stats.drafted, accepted=stats.accepted,
        )

    async def _prepare_private(self) -> None:
        """What private mode needs here, made once per consumer: every layer's norms
        (fetched from the swarm with the blocks if this node lacks them), the CKKS
        secret key and the Galois keys for the rotations the model's products use."""
        if self._private is not None:
            return
        model = self.model
        if not model.holds(blocks=(0, model.num_blocks)):
            await Torrent(self.host, self.dht, self.data_dir).fetch(model.model_id, blocks=(0, model.num_blocks))

        def build() -> dict:
            from ...he.ckks import SecretContext  # noqa: PLC0415
            from ...he.groups import required_steps  # noqa: PLC0415
            from ...model.private_layers import PrivateLayers  # noqa: PLC0415

            secret = SecretContext()
            layers = PrivateLayers.load(model.path, project=None)
            keys = secret.galois_keys(required_steps(layers.config, secret.slots))
            return {"secret": secret, "layers": layers, "keys": keys}

        self._private = await trio.to_thread.run_sync(build)

    async def _keep_report(self, report: FailureReport) -> None:
        """Keep a failure report in the data dir (a node running there serves it) and
        hand it to its witness, a server that stays up after this client is gone and
        makes it findable (karma/service.py): the accused's karma readers apply it."""
        self.reports.append(report)
        ReportStore(self.data_dir).add(report)
        try:
            with trio.fail_after(REPORT_SUBMIT_TIMEOUT_S):
                await submit_report(self.host, report.witness.peer_id, report)
        except Exception as exc:  # the report stays here; the witness may be gone
            log.warning("could not hand failure report %s to %s: %s", report.digest[:12], report.witness.peer_id,
                        exc)


async def run_prompt(data_dir: Path, bootstrap: tuple[str, ...], request: RunRequest, *,
                     on_text: Callable[[str], None] = lambda _t: None,
                     on_route: Callable[[list[Hop]], None] = lambda _r: None,
                     spot_check_rate: float = DEFAULT_SPOT_CHECK_RATE, listen: tuple[str, ...] = ()) -> RunOutcome:
    """One generation by a short-lived client."""
    async with Consumer.connect(data_dir, bootstrap, request.model, text_prompts=not isinstance(request.prompt, list),
                                spot_check_rate=spot_check_rate, listen=listen) as consumer:
        return await consumer.generate(request, on_text=on_text, on_route=on_route)
