"""One participant of a DiLoCo run: the loop of rounds and what it serves meanwhile.

A round: H inner steps from the outer weights (in a worker thread), then the
round's group forms (diloco/rounds.py), averages the pseudo-gradients
(diloco/allreduce.py) and every member applies the same outer Nesterov step. A
member left out of the group, or whose all-reduce fails, applies its own
pseudo-gradient (INTELLECT-1's fallback); one whose outer weights turn out to differ
from the leader's fetches the run's state like a joiner. After each outer step the
new outer state is seeded (diloco/weights.py), karma receipts are exchanged, and the
round's checks start (diloco/checks.py).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from pathlib import Path

import torch
import trio
from libp2p.crypto.keys import KeyPair

from ..config import TRAIN_STATE_FILE
from ..proofs.diloco import DilocoFailureReport
from ..errors import PeerMisbehaved
from ..karma.receipts import Receipt, parse_receipt, sign_receipt
from ..karma.service import KarmaService
from ..model.store import ModelStore
from ..torrent.service import Torrent
from . import messages
from .allreduce import AllReduce, Attempt, OwnerSlot
from .checks import Checker
from .corpus import Corpus
from .group import owners, participants_key, session_of
from .inner import OuterOptimizer, build_model, eval_loss, flat_params, train_round
from .rounds import Rounds
from .run import RunRecord
from .sync import fetch_flat, fetch_state
from .weights import KEEP_ROUNDS, store_flat, weights_digest

log = logging.getLogger(__name__)



@dataclasses.dataclass(frozen=True)
class Faults:
    """A misbehaving participant, for tests and the bench only."""
    noise: float = 0.0  # sends Gaussian noise of this many times its pseudo-gradient's norm instead


@dataclasses.dataclass
class Published:
    round: int
    base: bytes
    weights: str
    momentum: str
    members: list[str]


class Participant:
    def __init__(self, run: RunRecord, swarm, key_pair: KeyPair, corpus: Corpus, data_dir: Path, *,
                 faults: Faults = Faults()) -> None:
        if corpus.digest != run.recipe.corpus:
            raise PeerMisbehaved(f"the corpus given hashes to {corpus.digest[:12]}, the run's is "
                                 f"{run.recipe.corpus[:12]}")
        self.run, self.swarm, self.key_pair, self.corpus, self.data_dir = run, swarm, key_pair, corpus, data_dir
        self.host, self.dht, self.faults = swarm.host, swarm.dht, faults
        self.me = self.host.get_id().to_string()
        self.excluded: set[str] = set()
        self.addrs: dict[str, list] = {}
        self.averaging = AllReduce(self.host, key_pair, self.addrs, method=run.aggregator, wait_s=run.part_wait_s,
                                   dht=self.dht)
        self.rounds = Rounds(self.host, self.dht, run, self.excluded, self.addrs)
        self.torrent = Torrent(self.host, self.dht, data_dir, only=set())
        self.karma = KarmaService(self.host, self.dht, key_pair, data_dir)
        self.checker = Checker(self.rounds, corpus, key_pair, lambda: self.members, self.exclude)
        self.model = build_model(run.recipe)
        self.outer = OuterOptimizer(run.recipe, flat_params(self.model).numel())
        self.weights = flat_params(self.model)
        self.round = 0
        self.published: Published | None = None
        self._seeded: list[Published] = []  # earlier rounds' outer state, still seeded
        self.members: set[str] = set()
        self.round_started = time.monotonic()
        self.stats = {"rounds": 0, "averaged": 0, "alone": 0, "sent_bytes": 0, "joined_at": None, "loss": None,
                      "eval_loss": None, "receipts": 0, "reports": 0, "resyncs": 0}

    # -- the loop ------------------------------------------------------------------------

    async def take_part(self, *, join: bool, rounds: int | None = None) -> None:
        """Rounds until the run's last (or `rounds` of them): from the run's start, or
        (join) from the state the participants seed now."""
        zero = False
        if join:
            await self.sync()
            # Round 0's weights are the recipe's own: a peer there from the start trains it.
            self.stats["joined_at"], zero = self.round, self.round > 0
        else:
            self.weights = await self.initial_weights()
            await self.publish([self.me])
        last = self.run.recipe.rounds if rounds is None else min(self.run.recipe.rounds, self.round + rounds)
        if self.round == 0:
            await trio.sleep(max(0.0, self.run.start - time.time()))  # the run's schedule
        while self.round < last:
            zero = await self.one_round(zero)
        self.write_state(finished=True)

    async def one_round(self, zero: bool) -> bool:
        """One round; True if the next must contribute zero (this peer just resynced)."""
        recipe, started_at = self.run.recipe, self.round
        self.round_started = time.monotonic()
        base = weights_digest(self.weights)
        start_weights = self.weights.clone()
        if zero:
            pseudo, tokens, loss = torch.zeros_like(self.weights), 0, None
        else:
            result = await trio.to_thread.run_sync(lambda: train_round(
                recipe, self.corpus, start_weights, run_id=self.run.run_id, peer=self.me, round=started_at,
                model=self.model))
            pseudo, tokens, loss = result.pseudo_grad, result.tokens, result.loss
            if not torch.isfinite(pseudo).all():  # diverged: nothing of it is worth averaging
                log.warning("round %d: the inner steps diverged; contributing nothing", started_at)
                pseudo, tokens = torch.zeros_like(self.weights), 0
            if self.faults.noise:
                pseudo = torch.randn_like(pseudo) * (self.faults.noise * float(pseudo.norm()) / pseudo.numel() ** .5)
        expected = (self.members or await self._participants()) - self.excluded
        formed = await self.rounds.form(started_at, base, expected)
        if formed.resync:
            await self.sync(formed.leader)
            self.stats["resyncs"] += 1
            return True
        average = None
        if formed.members is not None and len(formed.members) >= 2:
            outcome = await self.averaging.run(Attempt(self.run.run_id, started_at, 0, tuple(formed.members), base),
                                               pseudo, tokens)
            self.stats["sent_bytes"] += outcome.sent_bytes
            average = outcome.average
            if average is not None:
                self.members = set(outcome.attempt.members)
                await self._keep_receipts(outcome.receipts)
                self.checker.schedule(started_at, start_weights, outcome.attempt, outcome.slot)
        if average is None and zero:
            log.info("round %d: left out of the group; fetching the next round's state", started_at)
            await self.sync()
            return True
        if average is None:
            log.info("round %d: averaged with nobody; applying its own pseudo-gradient", started_at)
            self.stats["alone"] += 1
            average = pseudo
        else:
            self.stats["averaged"] += 1
        self.weights = await trio.to_thread.run_sync(self.outer.step, self.weights, average)
        self.round = started_at + 1
        self.averaging.forget_before(self.round - 1)
        self.stats.update(rounds=self.stats["rounds"] + 1, loss=loss)
        await self.publish(sorted(self.members or {self.me}))
        return False

    async def _participants(self) -> set[str]:
        return await self.rounds.providers(participants_key(self.run.run_id)) | {self.me}

    # -- outer state: published for joiners, fetched by them --------------------------------

    async def publish(self, members: list[str]) -> None:
        store = ModelStore(self.data_dir)
        weights = await trio.to_thread.run_sync(store_flat, store, self.run.recipe, self.weights, self.model)
        momentum = await trio.to_thread.run_sync(store_flat, store, self.run.recipe, self.outer.state(), self.model)
        previous = self.published
        self.published = Published(self.round, weights_digest(self.weights), weights.model_id, momentum.model_id,
                                   members)
        for model_id in (weights.model_id, momentum.model_id):
            self.torrent.library.only.add(model_id)
        self.torrent.changed.set()
        self.torrent.changed = trio.Event()
        self._forget_old(previous)
        self.write_state()

    def _forget_old(self, previous: Published | None) -> None:
        """Seed the last KEEP_ROUNDS rounds' outer state; delete older ones (not the run's init)."""
        if previous is not None:
            self._seeded.append(previous)
        while len(self._seeded) > KEEP_ROUNDS:
            old = self._seeded.pop(0)
            current = {self.published.weights, self.published.momentum} if self.published is not None else set()
            kept = current | {p.weights for p in self._seeded} | {p.momentum for p in self._seeded} | {self.run.init}
            for model_id in {old.weights, old.momentum} - kept:
                self.torrent.library.forget(model_id)

    async def initial_weights(self) -> torch.Tensor:
        """W_0: the run's init model (held here or fetched from its seeders), or the
        recipe's seeded initialisation."""
        if not self.run.init:
            return flat_params(build_model(self.run.recipe))
        return await self.fetch_flat(self.run.init)

    async def fetch_flat(self, model_id: str) -> torch.Tensor:
        """The flat weights of a stored model of the run's shape: held here, or fetched."""
        return await fetch_flat(self.torrent, model_id, self.run.recipe, self.model)

    def state_reply(self) -> dict | None:
        p = self.published
        if p is None:
            return None
        return messages.state_reply(self.run.run_id, p.round, p.base, p.weights, p.momentum, p.members,
                                    sorted(self.excluded))

    async def sync(self, prefer: str | None = None) -> None:
        """Take the outer state most of the participants asked seed now."""
        round_, weights, momentum, members, excluded = await fetch_state(self.rounds, self.fetch_flat, self.round,
                                                                          prefer)
        if round_ == 0 and self.run.init and weights_digest(weights) != weights_digest(await self.initial_weights()):
            raise PeerMisbehaved("round 0's weights are not the run's init model")
        self.excluded.update(excluded)
        self.weights, self.round = weights, round_
        self.outer.load_state(momentum)
        self.members = (set(members) | {self.me}) - self.excluded  # whom its first round waits for
        await self.publish([self.me])

    # -- karma ---------------------------------------------------------------------------------

    def receipt_for(self, peer: str, slot: OwnerSlot, tokens: int) -> bytes:
        """The receipt this owner signs for `peer`'s round: one per round per peer, by
        the owner of the part after the peer's own."""
        members = owners(slot.attempt.members)
        if tokens <= 0 or peer == self.me or members[(members.index(peer) + 1) % len(members)] != self.me:
            return b""
        wall_ms = (time.monotonic() - self.round_started) * 1000.0
        receipt = Receipt(server=peer, consumer=self.me, model_id=self.run.run_id, start=0,
                          end=self.run.recipe.model["num_hidden_layers"],
                          session=session_of(self.run.run_id, slot.attempt.round, peer), seq=0, tokens=tokens,
                          compute_ms=wall_ms, wall_ms=wall_ms, time=time.time())
        return sign_receipt(receipt, self.key_pair.private_key)

    async def _keep_receipts(self, receipts: list[tuple[str, bytes]]) -> None:
        for owner, wire_ in receipts:
            try:
                receipt = parse_receipt(wire_, countersigned=False)
                if receipt.server != self.me or receipt.consumer != owner or receipt.model_id != self.run.run_id:
                    raise PeerMisbehaved("a receipt for another peer or run")
                await self.karma.receipts.accept(wire_, receipt)
                self.stats["receipts"] += 1
            except PeerMisbehaved as exc:
                log.info("a round receipt from %s refused: %s", owner[:12], exc)

    async def take_report(self, sender: str, report_wire: object) -> dict:
        return await self.checker.take_report(sender, report_wire)

    def exclude(self, peer: str, report: DilocoFailureReport | None) -> None:
        """Leave `peer` out of every later round; keep `report`, the evidence against it
        (served with this peer's karma), if there is one."""
        self.excluded.add(peer)
        self.members.discard(peer)
        if report is not None and self.karma.keep_report(report):
            self.stats["reports"] += 1
        self.write_state()

    # -- status ----------------------------------------------------------------------------------

    def write_state(self, *, finished: bool = False) -> None:
        state = {"pid": os.getpid(), "peer_id": self.me, "run": self.run.run_id, "name": self.run.name,
                 "round": self.round, "rounds": self.run.recipe.rounds, "members": sorted(self.members),
                 "excluded": sorted(self.excluded), "finished": finished, "time": time.time(),
                 "base": self.published.base.hex() if self.published else None,
                 "weights": self.published.weights if self.published else None, **self.stats}
        path = self.data_dir / TRAIN_STATE_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state))
        os.replace(tmp, path)

    async def evaluate(self) -> float:
        loss = await trio.to_thread.run_sync(lambda: eval_loss(self.run.recipe, self.corpus, self.weights,
                                                               model=self.model))
        self.stats["eval_loss"] = loss
        self.write_state(finished=self.round >= self.run.recipe.rounds)
        return loss

