"""A joiner's (or a diverged member's) way to the run's current outer state.

Ask up to STATE_ASKED participants (the run's DHT provider key) for the round and
its outer state's torrent ids; take the answer most of them give (the leader's, when
resyncing after a `wrong_round`); fetch both stored models through the torrent layer
(every piece hash-verified against its manifest); check that the weights hash to the
round's base digest before using them.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Awaitable, Callable

import torch
import trio

from ..errors import PeerMisbehaved
from ..torrent.service import Torrent
from . import messages
from .allreduce import ask
from .group import participants_key
from .recipe import Recipe
from .rounds import Rounds
from .weights import load_flat_from, weights_digest

log = logging.getLogger(__name__)

STATE_ASKED = 4
SYNC_TIMEOUT_S = 300.0
RETRY_S = 2.0


async def fetch_state(rounds: Rounds, fetch: Callable[[str], Awaitable[torch.Tensor]], at_least: int,
                      prefer: str | None = None) -> tuple[int, torch.Tensor, torch.Tensor, list[str], set[str]]:
    """(round, outer weights, outer momentum, members, excluded peers) as the run's
    participants hold them, from round `at_least` on, the weights read with `fetch`
    (a stored model's id to its flat weights): a peer is excluded when most of those
    giving the state taken exclude it (each of them re-ran the evidence against it,
    or trusted a majority in turn)."""
    with trio.fail_after(SYNC_TIMEOUT_S):
        while True:
            answers, exclusions = await _ask_state(rounds, prefer)
            log.info("the run's state from %d participants", len(answers))
            for (round_, base, weights_id, momentum_id, members), _votes in _ranked(answers, at_least):
                voters = [exclusions[p] for p, answer in answers.items() if answer[:2] == (round_, base)]
                try:
                    # Ready for that round before the download: its leader then waits for this peer.
                    await rounds.announce(round_)
                    weights = await fetch(weights_id)
                    if weights_digest(weights) != base:
                        raise PeerMisbehaved(f"the weights of round {round_} do not hash to its base digest")
                    momentum = await fetch(momentum_id)
                    log.info("synced to round %d of run %s", round_, rounds.run.run_id[:12])
                    if not (torch.isfinite(weights).all() and torch.isfinite(momentum).all()):
                        raise PeerMisbehaved(f"the state of round {round_} is not finite")
                    counts = collections.Counter(peer for listed in voters for peer in set(listed))
                    # One participant's word excludes nobody: it takes two, and most of those asked.
                    excluded = {peer for peer, n in counts.items() if n >= 2 and 2 * n > len(voters)}
                    return round_, weights, momentum, list(members), excluded
                except Exception as exc:
                    log.warning("the state of round %d: %s", round_, exc)
            await trio.sleep(RETRY_S)


async def _ask_state(rounds: Rounds, prefer: str | None) -> tuple[dict[str, tuple], dict[str, list]]:
    found = await rounds.providers(participants_key(rounds.run.run_id))
    peers = sorted(found - rounds.excluded - {rounds.me})
    peers = ([prefer] if prefer else []) + [p for p in peers if p != prefer][:STATE_ASKED]
    answers: dict[str, tuple] = {}
    exclusions: dict[str, list] = {}

    async def one(peer: str) -> None:
        try:
            reply = await ask(rounds.host, rounds.addrs, peer, messages.state_request(rounds.run.run_id), 15.0,
                              rounds.dht)
            answer = messages.parse_state_reply(reply) + (tuple(messages.members_field(reply)),)
            exclusions[peer] = messages.excluded_field(reply)
            answers[peer] = answer
        except Exception as exc:
            log.info("state from %s: %s", peer[:12], exc)

    async with trio.open_nursery() as nursery:
        for peer in peers:
            nursery.start_soon(one, peer)
    return answers, exclusions


def _ranked(answers: dict[str, tuple], at_least: int) -> list[tuple[tuple, int]]:
    """Answers by votes, then by round; none from before round `at_least` (a member
    resyncing never goes back). The peer that sent this one here (`prefer`) is asked,
    but its answer counts as one vote like any other."""
    votes = collections.Counter(a for a in answers.values() if a[0] >= at_least)
    return sorted(votes.items(), key=lambda item: (-item[1], -item[0][0]))


async def fetch_flat(torrent: Torrent, model_id: str, recipe: Recipe, model: torch.nn.Module) -> torch.Tensor:
    """The flat weights of a stored model of `recipe`'s shape (read through `model`):
    held here, or fetched."""
    torrent.library.only.add(model_id)  # seeded from here on
    stored = torrent.library.models.get(model_id)
    if stored is None or stored.missing_files(blocks=(0, stored.num_blocks), head=True):
        stored = await torrent.obtain_manifest(model_id, attempts=3, wait_s=2.0)
        await torrent.fetch(model_id, everything=True)
    return await trio.to_thread.run_sync(load_flat_from, stored, recipe, model)
