"""A training participant's process: one libp2p host, one nursery owning every task.

`compushare train start` makes the run's signed record, puts it in the DHT and takes
part from round 0; `compushare train join RUN` reads the record from the DHT and takes
part from the state the participants seed now. The host serves
`/compushare/diloco` (diloco/service.py), torrent pieces (the outer state) and karma
(receipts of its rounds, reports it witnessed), and provides the run's participants
key while it takes part.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

import trio

from ..config import LISTEN_FILE
from ..errors import ModelUnavailable
from ..karma.record import karma_validators
from ..karma.service import KARMA_PROTOCOL
from ..net.dht import get_value_fresh, routing_sync_loop
from ..net.host import advertised_addrs
from ..net.identity import load_or_create_identity
from ..net.peer import open_swarm_host
from ..runtime import stop_on_signal, write_json
from ..torrent.protocol import PIECES_PROTOCOL
from .allreduce import DILOCO_PROTOCOL
from .corpus import Corpus
from .group import participants_key
from .participant import Faults, Participant
from .recipe import Recipe
from .run import RunRecord, make_run, parse_run, run_key, run_validators
from .service import diloco_handler

log = logging.getLogger(__name__)

PROVIDE_S = 60.0  # the participants key is re-provided this often
RECORD_ATTEMPTS = 10


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    data_dir: Path  # identity, stored outer state, karma, diloco.json
    corpus: Path
    bootstrap: tuple[str, ...] = ()
    listen: tuple[str, ...] = ("/ip4/127.0.0.1/tcp/0",)
    rounds: int | None = None  # leave after this many rounds (None: until the run's last)
    faults: Faults = Faults()
    threads: int = 1  # torch threads (a re-run check agrees best on as many as the round it re-runs)


@dataclasses.dataclass(frozen=True)
class NewRun:
    recipe: Recipe
    name: str
    settings: dict  # make_run's keywords: aggregator, gather_s, part_wait_s, check_rate, max_group


async def take_part(config: TrainConfig, *, run_id: str | None = None, new: NewRun | None = None,
                    task_status=trio.TASK_STATUS_IGNORED) -> dict:
    """Take part in run `run_id`, or start `new`; return the participant's final state."""
    import torch

    config.data_dir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(config.threads)
    corpus = await trio.to_thread.run_sync(Corpus.load, config.corpus)
    key_pair = load_or_create_identity(config.data_dir)
    async with open_swarm_host(key_pair, server=True, validators=karma_validators() | run_validators(),
                               listen=config.listen, bootstrap=config.bootstrap, join=False) as swarm:
        if config.bootstrap:
            await swarm.join(attempts=None)
        host, dht = swarm.host, swarm.dht
        write_json(config.data_dir / LISTEN_FILE, {"pid": os.getpid(), "peer_id": host.get_id().to_string(),
                                                   "addrs": advertised_addrs(host)})
        if new is not None:
            run, value = make_run(new.recipe, key_pair, name=new.name, **new.settings)
            with trio.move_on_after(30):
                await dht.put_value(run_key(run.run_id), value)
            log.info("started run %s (%s)", run.run_id, run.name)
        else:
            assert run_id is not None
            run = await _run_record(dht, run_id)
            log.info("read run %s (%s) from the DHT", run.run_id[:12], run.name)
        participant = Participant(run, swarm, key_pair, corpus, config.data_dir, faults=config.faults)
        host.set_stream_handler(DILOCO_PROTOCOL, diloco_handler(participant))
        host.set_stream_handler(PIECES_PROTOCOL, participant.torrent.seeder.handle)
        host.set_stream_handler(KARMA_PROTOCOL, participant.karma.handle)
        async with trio.open_nursery() as nursery:
            participant.checker.nursery = nursery
            nursery.start_soon(stop_on_signal, nursery.cancel_scope)
            nursery.start_soon(routing_sync_loop, host, dht)
            nursery.start_soon(participant.karma.publish_loop)
            nursery.start_soon(participant.karma.provide_reports_loop)
            nursery.start_soon(participant.torrent.announce_loop)
            nursery.start_soon(_provide_loop, dht, participants_key(run.run_id))
            task_status.started(run)
            await participant.take_part(join=new is None, rounds=config.rounds)
            await participant.evaluate()
            nursery.cancel_scope.cancel()
        return dict(participant.stats, round=participant.round, run=run.run_id)


async def _run_record(dht, run_id: str) -> RunRecord:
    key = run_key(run_id)
    for _ in range(RECORD_ATTEMPTS):
        record = await get_value_fresh(dht, key, lambda value: parse_run(key, value), newest=lambda r: 0)
        if record is not None:
            return record
        await trio.sleep(2.0)
    raise ModelUnavailable(f"no run record {run_id[:12]} in the DHT (is the run's starter reachable?)")


async def _provide_loop(dht, key: str) -> None:
    while True:
        with trio.move_on_after(30):
            await dht.provide(key)
        await trio.sleep(PROVIDE_S)
