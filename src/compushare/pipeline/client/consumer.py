"""The consumer: join the swarm for a model (its head and tokenizer here, or fetched),
then generate through chains the planner finds; `run_prompt` for one generation."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable
from pathlib import Path

import trio
from libp2p.peer.id import ID

from ...errors import ModelUnavailable, SwarmUnreachable, UsageError
from ...karma.ledger import ReportStore
from ...karma.record import karma_validators
from ...karma.service import KarmaBook, submit_report
from ...model import adapter_file
from ...model.arch import load_config
from ...model.catalog import CATALOG, resolve_model, split_name
from ...model.head import ConsumerHead
from ...spans import load_head
from ...model.lora import Adapter
from ...model.store import ModelStore, is_model_id
from ...model.tokenizer import encode_prompt, eos_ids_of, load_tokenizer
from ...net.identity import load_or_create_identity
from ...net.peer import open_swarm_host
from ...net.traversal import client_traversal
from ...net.view import SwarmView
from ...proofs.reports import Report
from ...torrent.service import Torrent
from .chain import Failover, open_chain
from .discovery import name_from_swarm, peer_ids_of
from .generate import GenerateStats, Scoring, generate
from .grammar import Constraint, check_grammar, grammar_tokenizer
from .planner import SwarmPlanner
from .produced import Piece, Produced
from .routing import Hop
from .sampling import SamplingParams, TokenLogprob
from .speculative import MAX_DRAFT
from .spotcheck import DEFAULT_RATE as DEFAULT_SPOT_CHECK_RATE, Penalties

log = logging.getLogger(__name__)

PRIVATE_STEP_TOKENS = 256  # a private prefill goes in steps of this many tokens, each pipelined over the hops
REPORT_SUBMIT_TIMEOUT_S = 5.0
REPORT_SUBMIT_ATTEMPTS = 3  # a second after the first failure, two after the second
JOIN_ATTEMPTS = 3  # a dial that timed out on a busy machine is not yet an unreachable swarm


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
    # A failover without a standby replays the history in few forwards: exact within the
    # format's tolerance, not bit-identical (pipeline/client/chain_plan.replay_plan).
    fast_replay: bool = False
    adapter: Path | None = None  # a LoRA adapter (PEFT directory or .safetensors) every server applies
    stop: tuple[str, ...] = ()  # the reply ends before the first of these (produced.py)
    logprobs: int | None = None  # each token's log-probability, with this many likeliest alternatives
    grammar: str | None = None  # llguidance's grammar the output must follow (grammar.py)


@dataclasses.dataclass
class RunOutcome:
    tokens: list[int]
    text: str
    route: list[Hop]
    first_token_s: float  # from the call to the first token
    decode_tok_s: float
    failovers: list[Failover] = dataclasses.field(default_factory=list)
    reports: list[Report] = dataclasses.field(default_factory=list)
    checks: int = 0  # spot checks made
    exact_checks: int = 0  # ... that passed bit for bit (one exact build computing the same forwards)
    private: dict | None = None  # private mode: PrivateStats.as_dict() (where the time went, bytes, keys)
    direct_steps: int = 0  # steps that went straight through the chain (direct return)
    chain_breaks: int = 0  # ... whose proofs did not link up (relayed instead)
    checked_relays: int = 0  # steps relayed (not direct) because a hop's spot check was due
    standby_takeovers: int = 0  # failovers a standby replica took over (no history replayed)
    passes: int = 0  # steps through the chain after the prompt
    drafted: int = 0  # speculation: drafted tokens verified
    accepted: int = 0  # ... and kept
    finish_reason: str = "stop"  # "length" when max_new_tokens cut it
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)  # when asked (RunRequest.logprobs)


def _quiet(*_args) -> None:
    pass


@dataclasses.dataclass(frozen=True)
class ProgressHooks:
    """Where a consumer tells how obtaining its model goes (a converted or fetched
    model takes a while): `on_stage` names a step as it starts, `progress(bytes,
    total)` follows it."""

    on_stage: Callable[[str], None] = _quiet
    progress: Callable[[int, int], None] = _quiet


def prompt_ids_of(tokenizer, request: RunRequest) -> list[int]:
    return encode_prompt(tokenizer, request.prompt, request.chat_template)


class LocalParts:
    """What a consumer needs of its model here: the store's entry, its tokenizer and its
    head. A model known by its id (or an alias) whose head is not here comes from the
    swarm's seeders; a name neither held here nor the catalog's (whose ids this node
    derives itself) is asked of the swarm (discovery.name_from_swarm), and the answer
    is used, not kept: a later run asks again."""

    def __init__(self, data_dir: Path, name: str, text_prompts: bool, hooks: ProgressHooks = ProgressHooks()) -> None:
        self.data_dir, self.name, self.text_prompts, self.hooks = data_dir, name, text_prompts, hooks
        self.wanted = name  # what to load: the name, or the id the swarm names for it
        self.model = self.tokenizer = self.head = None
        self.error: Exception | None = None
        self.stored = ModelStore(data_dir).get(name)
        self.by_name = self.stored is None and not is_model_id(name) and split_name(name)[0] not in CATALOG
        self.from_swarm = (self.stored is None and is_model_id(name)) or (
            self.stored is not None and not self.stored.holds(head=True))

    def load(self) -> None:
        # Errors are kept until both overlapping steps are done, so the report does not
        # depend on which ends first: a local problem first, then "no swarm".
        try:
            self.model = resolve_model(self.wanted, self.data_dir, on_stage=self.hooks.on_stage,
                                       progress=self.hooks.progress)
            self.tokenizer = load_tokenizer(self.model) if self.text_prompts else None
            self.head = load_head(self.model.path)
            self.error = None
        except Exception as exc:
            self.error = exc

    async def obtain(self, swarm, bootstrap: tuple[str, ...]) -> None:
        """Join the swarm while the local parts load (both take seconds), then get from
        the swarm what is not here."""
        unreachable: SwarmUnreachable | None = None
        loading = not self.from_swarm and not self.by_name
        async with trio.open_nursery() as nursery:
            if loading:
                nursery.start_soon(trio.to_thread.run_sync, self.load)
            try:
                await swarm.join(attempts=JOIN_ATTEMPTS)
            except SwarmUnreachable as exc:
                unreachable = exc
        if unreachable is not None and loading and self.error is None:
            # The dials ran alongside this machine's own loading (importing and
            # hashing a model's files, say), which can starve them past their
            # timeout: once more, now that it is done.
            try:
                await swarm.join()
                unreachable = None
            except SwarmUnreachable as exc:
                unreachable = exc
        if unreachable is not None and self.by_name:  # no swarm to ask: a local problem is reported first
            await trio.to_thread.run_sync(self.load)
        if self.error is not None:
            raise self.error
        if unreachable is not None:
            raise unreachable
        if self.by_name:
            await self._by_name(swarm.host, swarm.dht, bootstrap)
        if self.from_swarm:
            await self._fetch_head(swarm.host, swarm.dht, self.stored.model_id if self.stored else self.name)
            await trio.to_thread.run_sync(self.load)
            if self.error is not None:
                raise self.error

    async def _by_name(self, host, dht, bootstrap: tuple[str, ...]) -> None:
        unnamed: ModelUnavailable | None = None
        try:
            chosen = await name_from_swarm(host, dht, self.name, trusted=peer_ids_of(bootstrap))
        except ModelUnavailable as exc:  # named, but by no provider with evidence
            chosen, unnamed = None, exc
        if chosen is not None:
            await self._fetch_head(host, dht, chosen.model_id)
            self.wanted = chosen.model_id
        await trio.to_thread.run_sync(self.load)
        if self.error is not None:
            raise unnamed if unnamed is not None and isinstance(self.error, ModelUnavailable) else self.error

    async def _fetch_head(self, host, dht, model_id: str) -> None:
        self.hooks.on_stage(f"fetching the head of {model_id[:12]} from the swarm")
        await Torrent(host, dht, self.data_dir).fetch(model_id, head=True, progress=self.hooks.progress)


def private_fetch(model) -> dict | None:
    """What a private-mode consumer must fetch for every layer's norms, as Torrent.fetch's
    arguments; None when held. The norms file (NORMS_FILE, a meta file: it comes with the
    head) where the manifest names one, else every block (a model laid out before it)."""
    blocks = (0, model.num_blocks)
    if model.manifest.norms_file is not None:
        held = model.manifest.norms_file in model.held_files() or model.holds(blocks=blocks)
        return None if held else {"head": True}
    return None if model.holds(blocks=blocks) else {"blocks": blocks}


def outcome_of(chain, produced: Produced, began: float, stats: GenerateStats, request: RunRequest,
               constraint: Constraint | None = None) -> RunOutcome:
    times, private = produced.times, request.private
    finish_reason = produced.finish_reason(request.params.max_new_tokens)
    if constraint is not None and not constraint.complete:
        finish_reason = "length"  # ended inside an unfinished structure (a stop sequence, the limit)
    decode_s = times[-1] - times[0] if len(times) > 1 else 0.0
    core = None if private else chain.core
    return RunOutcome(
        tokens=produced.tokens,
        text=produced.text(),
        route=chain.route,
        first_token_s=times[0] - began,
        decode_tok_s=(len(times) - 1) / decode_s if decode_s > 0 else 0.0,
        failovers=list(chain.failovers),
        reports=list(chain.reports),
        checks=chain.checks,
        private=dict(chain.stats.as_dict(), check_failures=list(chain.check_failures)) if private else None,
        direct_steps=0 if core is None else core.direct_steps,
        chain_breaks=0 if core is None else core.chain_breaks,
        checked_relays=0 if core is None else core.checked_relays,
        exact_checks=0 if core is None else core.exact_checks,
        standby_takeovers=0 if core is None else core.standby_takeovers,
        passes=stats.passes, drafted=stats.drafted, accepted=stats.accepted,
        finish_reason=finish_reason, logprobs=produced.logprobs,
    )


def output_hooks(request: RunRequest, produced: Produced, constraint: Constraint | None) -> dict:
    """generate()'s hooks for what `request` asks of the output: stop sequences,
    log-probabilities, a grammar."""
    scoring = None if request.logprobs is None else Scoring(request.logprobs, produced.score)
    return {"until": produced.stopped if request.stop else None, "scoring": scoring, "constraint": constraint}


class Consumer:
    """A client of the swarm for one model: joined once, then any number of generations."""

    def __init__(self, host, dht, data_dir: Path, model, tokenizer, head: ConsumerHead, *,
                 spot_check_rate: float = DEFAULT_SPOT_CHECK_RATE, hooks: ProgressHooks = ProgressHooks(),
                 follow: Callable[[str], None] | None = None) -> None:
        self.host, self.dht, self.data_dir, self.hooks = host, dht, data_dir, hooks
        self.follow = follow  # in a node: joins the model's ad topic when a route is first planned
        self.model, self.tokenizer, self.head = model, tokenizer, head
        self.eos = eos_ids_of(tokenizer, model.path)
        self.spot_check_rate = spot_check_rate
        self.penalties = Penalties()  # shared by every generation of this consumer
        self.view = SwarmView()
        self.karma = KarmaBook()  # shared too: scores are rechecked at most once a minute
        self.reports: list[Report] = []
        self._private: dict | None = None  # private mode's keys and local layers, made on first use
        self._grammar_tokenizer = None  # llguidance's view of the tokenizer, made on first use

    @classmethod
    @contextlib.asynccontextmanager
    async def connect(cls, data_dir: Path, bootstrap: tuple[str, ...], model_name: str, *,
                      text_prompts: bool = True, spot_check_rate: float = DEFAULT_SPOT_CHECK_RATE,
                      listen: tuple[str, ...] = (), hooks: ProgressHooks = ProgressHooks()):
        parts = LocalParts(data_dir, model_name, text_prompts, hooks)
        key_pair = load_or_create_identity(data_dir)
        async with open_swarm_host(key_pair, server=False, validators=karma_validators(),
                                   listen=list(listen) or ["/ip4/127.0.0.1/tcp/0"], bootstrap=bootstrap,
                                   join=False) as swarm, client_traversal(swarm.host):
            await parts.obtain(swarm, bootstrap)
            yield cls(swarm.host, swarm.dht, data_dir, parts.model, parts.tokenizer, parts.head,
                      spot_check_rate=spot_check_rate, hooks=hooks)

    async def generate(self, request: RunRequest, *, on_text: Callable[[str], None] = lambda _t: None,
                       on_route: Callable[[list[Hop]], None] = lambda _r: None,
                       on_token: Callable[[int], None] = lambda _t: None,
                       on_piece: Callable[[Piece], None] = lambda _p: None) -> RunOutcome:
        began = time.perf_counter()
        model, tokenizer = self.model, self.tokenizer
        adapter = None if request.adapter is None else self.load_adapter(request.adapter, private=request.private)
        prompt_ids = prompt_ids_of(tokenizer, request)
        produced = Produced(tokenizer, on_token, on_text, stops=request.stop, on_piece=on_piece)
        constraint = None if request.grammar is None else await self.constraint(request.grammar)
        max_tokens = len(prompt_ids) + request.params.max_new_tokens + MAX_DRAFT
        stats = GenerateStats()
        planner = SwarmPlanner(self.host, self.dht, model.model_id, model.num_blocks, needed_tokens=max_tokens,
                               penalties=self.penalties, view=self.view, karma=self.karma, private=request.private,
                               fmt=model.format.label, follow=self.follow)
        if request.private:
            await self._prepare_private()
        route = await planner.first_route()
        on_route(route)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(planner.refresh_loop)  # candidates stay fresh for failovers
            nursery.start_soon(planner.karma_loop)
            if request.private:
                chain = await self._generate_private(route, planner, prompt_ids, request, produced, constraint,
                                                     nursery)
            else:
                async with open_chain(self.host, route, model.model_id, max_tokens=max_tokens,
                                      hidden_size=model.hidden_size, planner=planner,
                                      spot_check_rate=self.spot_check_rate, direct=request.direct,
                                      standby=request.standby, fmt=model.format.label, adapter=adapter,
                                      fast_replay=request.fast_replay) as chain:
                    await generate(chain, self.head, prompt_ids, request.params, eos_ids=self.eos,
                                   on_token=produced.add, speculate=request.speculate, stats=stats,
                                   **output_hooks(request, produced, constraint))
            nursery.cancel_scope.cancel()
        produced.finish()
        if chain.route != route:
            on_route(chain.route)
        for report in chain.reports:
            await self._keep_report(report)
        return outcome_of(chain, produced, began, stats, request, constraint)

    async def grammar_tokenizer(self):
        """llguidance's view of this model's tokenizer (built once, off the event loop)."""
        if self._grammar_tokenizer is None:
            # The LM head's rows: a model's vocabulary may be padded beyond its tokenizer's.
            vocab = max(int(self.model.manifest.config.get("vocab_size") or 0), len(self.tokenizer))
            self._grammar_tokenizer = await trio.to_thread.run_sync(grammar_tokenizer, self.tokenizer, vocab,
                                                                    self.eos)
        return self._grammar_tokenizer

    async def check_grammar(self, grammar: str) -> None:
        """Raise UsageError where `grammar` cannot be enforced (before anything is sent)."""
        check_grammar(grammar, await self.grammar_tokenizer())

    async def constraint(self, grammar: str) -> Constraint:
        tokenizer = await self.grammar_tokenizer()
        return await trio.to_thread.run_sync(Constraint, tokenizer, grammar)

    def load_adapter(self, path: Path, *, private: bool = False) -> Adapter:
        """The LoRA adapter at `path`, refused (UsageError) unless made for this model
        and fitting it: before anything is sent."""
        if private:
            raise UsageError("LoRA adapters are not applied in private mode (its providers compute "
                             "projections only)")
        return adapter_file.load(path, model_id=self.model.model_id, config=load_config(self.model.path))

    async def _generate_private(self, route: list[Hop], planner: SwarmPlanner, prompt_ids: list[int],
                                request: RunRequest, produced: Produced, constraint: Constraint | None,
                                nursery: trio.Nursery):
        from .private_chain import PrivateChain  # noqa: PLC0415  (transformers' layers: seconds)

        chain = PrivateChain(self.host, route, self.model.model_id, self._private["layers"],
                             self._private["secret"], self._private["keys"], planner=planner,
                             spot_check_rate=self.spot_check_rate)
        try:
            await chain.open()
            nursery.start_soon(chain.keep_alive)  # its hops wait while the others compute; cancelled with `nursery`
            await generate(chain, self.head, prompt_ids, request.params, eos_ids=self.eos,
                           on_token=produced.add, max_step_tokens=PRIVATE_STEP_TOKENS,
                           **output_hooks(request, produced, constraint))
        finally:
            await chain.close()
        return chain

    async def _prepare_private(self) -> None:
        """What private mode needs here, made once per consumer: every layer's norms
        (private_fetch: the model's norms file, else every block, from the swarm if this
        node lacks them), the CKKS secret key and the Galois keys for the rotations the
        model's products use."""
        if self._private is not None:
            return
        model = self.model
        wanted = private_fetch(model)
        if wanted is not None:
            what = "its norms file" if "head" in wanted else "every block (a manifest without a norms file)"
            log.info("private mode: fetching %s of %s", what, model.model_id[:12])
            self.hooks.on_stage(f"fetching {what} of {model.model_id[:12]} (private mode's norms)")
            await Torrent(self.host, self.dht, self.data_dir).fetch(model.model_id, progress=self.hooks.progress,
                                                                    **wanted)

        def build() -> dict:
            from ...he.ckks import SecretContext  # noqa: PLC0415
            from ...he.groups import required_steps  # noqa: PLC0415
            from ...model.private_layers import PrivateLayers  # noqa: PLC0415

            secret = SecretContext()
            layers = PrivateLayers.load(model.path, project=None)
            keys = secret.galois_keys(required_steps(layers.config, secret.slots))
            return {"secret": secret, "layers": layers, "keys": keys}

        self._private = await trio.to_thread.run_sync(build)

    async def _keep_report(self, report: Report) -> None:
        """Keep a failure report in the data dir (a node running there serves it) and
        hand it to its witness, a server that stays up after this client is gone and
        makes it findable (karma/service.py): the accused's karma readers apply it."""
        self.reports.append(report)
        ReportStore(self.data_dir).add(report)
        witness = report.witness.peer_id
        for attempt in range(1, REPORT_SUBMIT_ATTEMPTS + 1):
            # Dialled again where the connection went (a verifier's session closed, a
            # loaded node dropped it: CI stop 60's run 32), at the addresses known for it.
            known: tuple[str, ...] = ()
            with contextlib.suppress(Exception):  # PeerStoreError: never heard of it
                known = tuple(str(a) for a in self.host.get_peerstore().addrs(ID.from_base58(witness)))
            try:
                with trio.fail_after(REPORT_SUBMIT_TIMEOUT_S):
                    await submit_report(self.host, witness, report, known)
                return
            except Exception as exc:  # the report stays here; the witness may be gone
                log.warning("could not hand failure report %s to %s (try %d of %d): %s", report.digest[:12],
                            witness, attempt, REPORT_SUBMIT_ATTEMPTS, exc)
                if attempt < REPORT_SUBMIT_ATTEMPTS:
                    await trio.sleep(attempt)


async def run_prompt(data_dir: Path, bootstrap: tuple[str, ...], request: RunRequest, *,
                     on_text: Callable[[str], None] = lambda _t: None,
                     on_route: Callable[[list[Hop]], None] = lambda _r: None,
                     spot_check_rate: float = DEFAULT_SPOT_CHECK_RATE, listen: tuple[str, ...] = (),
                     hooks: ProgressHooks = ProgressHooks()) -> RunOutcome:
    """One generation by a short-lived client; `hooks` follow the model's obtaining."""
    async with Consumer.connect(data_dir, bootstrap, request.model, text_prompts=not isinstance(request.prompt, list),
                                spot_check_rate=spot_check_rate, listen=listen, hooks=hooks) as consumer:
        return await consumer.generate(request, on_text=on_text, on_route=on_route)
