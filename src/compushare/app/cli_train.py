"""`compushare train start|join|status`: DiLoCo training runs (diloco/)."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from ..config import TRAIN_DIR, resolve_data_dir
from .cli_common import BOOTSTRAP, DATA_DIR, SWARM_HOME, bootstrap_for, command_app, err, out, run_or_exit, setup_logging

train_app = command_app("Train a model together: DiLoCo rounds averaged peer to peer.")

CORPUS = typer.Option(..., help="The run's training text (UTF-8; .gz read as gzip): every participant needs the "
                                "same bytes, checked against the run's corpus digest.")
ROUNDS = typer.Option(None, min=1, help="Leave after this many rounds (default: stay to the run's last).")
LISTEN = typer.Option(None, help="Listen multiaddr (repeatable; default: 127.0.0.1, any port).")
THREADS = typer.Option(1, min=1, help="Torch threads for training (every participant re-running another's "
                                       "round should use as many as it did: float sums then agree).")
DEBUG_NOISE = typer.Option(0.0, hidden=True, help="Fault injection: send Gaussian noise of this many times the "
                                                  "pseudo-gradient's norm instead of it (a cheater, for tests).")


def _train_dir(data_dir: Path | None) -> Path:
    """A participant's own identity and state, beside (not in) the node's."""
    return resolve_data_dir(data_dir) / TRAIN_DIR


def _config(data_dir: Path | None, corpus: Path, bootstrap: list[str] | None, swarm_home: Path | None,
            listen: list[str] | None, rounds: int | None, noise: float, threads: int, *, first: bool = False):
    from ..diloco.participant import Faults
    from ..diloco.train_node import TrainConfig
    from ..errors import SwarmUnreachable

    home = resolve_data_dir(data_dir)
    try:
        boot = bootstrap_for(home, bootstrap, swarm_home)
    except SwarmUnreachable:
        if not first:
            raise
        boot = ()  # the run's starter may be the swarm's first peer
    return TrainConfig(data_dir=_train_dir(data_dir), corpus=corpus, bootstrap=boot,
                       listen=tuple(listen or ("/ip4/127.0.0.1/tcp/0",)), rounds=rounds, faults=Faults(noise=noise),
                       threads=threads)


@train_app.command()
def start(
    corpus: Path = CORPUS,
    name: str = typer.Option("run", help="A label for the run (its id is the record's hash)."),
    steps: int = typer.Option(50, min=1, help="H: inner steps per round."),
    rounds: int = typer.Option(10, min=1, help="Rounds the run lasts."),
    batch: int = typer.Option(8, min=1, help="Sequences per inner step per participant."),
    seed: int = typer.Option(0, help="The public seed every minibatch derives from."),
    aggregator: str = typer.Option("centered_clip", help="mean or centered_clip (robust to a minority of bad "
                                                         "contributions)."),
    check_rate: float = typer.Option(0.25, min=0.0, max=1.0, help="Share of participants whose round another "
                                                                  "re-runs, each round."),
    gather_s: float = typer.Option(20.0, help="How long a round waits for its participants."),
    start_in: float = typer.Option(30.0, min=0.0, help="Seconds until round 0 begins (participants join before)."),
    init: str = typer.Option("", help="Start from these weights: a model id in this data dir's training store (an "
                                      "earlier run's outer weights, or a base model laid out there); default: the "
                                      "recipe's seeded initialisation."),
    data_dir: Path = DATA_DIR, bootstrap: list[str] = BOOTSTRAP, swarm_home: Path = SWARM_HOME,
    listen: list[str] = LISTEN,
    leave_after: int = ROUNDS, threads: int = THREADS, debug_noise: float = DEBUG_NOISE,
    log_level: str = typer.Option("info"),
) -> None:
    """Start a run of the small Llama model on CORPUS and take part in it; prints the run id."""
    import dataclasses

    import trio

    from ..diloco.corpus import Corpus
    from ..diloco.recipe import Recipe
    from ..diloco.train_node import NewRun

    setup_logging(log_level)

    def main_start():
        digest = Corpus.load(corpus).digest
        recipe = dataclasses.replace(Recipe.default_small(digest), steps=steps, rounds=rounds, batch=batch, seed=seed)
        new = NewRun(recipe, name, {"aggregator": aggregator, "check_rate": check_rate, "gather_s": gather_s,
                                    "part_wait_s": gather_s, "start_in_s": start_in, "init": init})
        config = _config(data_dir, corpus, bootstrap, swarm_home, listen, leave_after, debug_noise, threads,
                         first=True)

        async def go():
            async with trio.open_nursery() as nursery:
                run = await nursery.start(_announce, config, new)
                err.print(f"run {run.run_id}", highlight=False)

        trio.run(go)

    run_or_exit(main_start)


async def _announce(config, new, *, task_status):
    from ..diloco.train_node import take_part

    state = await take_part(config, new=new, task_status=task_status)
    _finished(state)


@train_app.command()
def join(
    run: str = typer.Argument(..., help="The run id (64 hex digits)."),
    corpus: Path = CORPUS,
    data_dir: Path = DATA_DIR, bootstrap: list[str] = BOOTSTRAP, swarm_home: Path = SWARM_HOME,
    listen: list[str] = LISTEN,
    leave_after: int = ROUNDS, threads: int = THREADS, debug_noise: float = DEBUG_NOISE,
    log_level: str = typer.Option("info"),
) -> None:
    """Take part in RUN from its current round (the outer weights come from its participants)."""
    import trio

    from ..diloco.train_node import take_part

    setup_logging(log_level)

    def main_join():
        config = _config(data_dir, corpus, bootstrap, swarm_home, listen, leave_after, debug_noise, threads)
        _finished(trio.run(lambda: take_part(config, run_id=run)))

    run_or_exit(main_join)


def _finished(state: dict) -> None:
    err.print(f"left run {state['run'][:12]} after round {state['round']}: {state['averaged']} rounds averaged, "
              f"{state['alone']} alone, eval loss {state['eval_loss']:.4f}", highlight=False)


@train_app.command("status")
def train_status(data_dir: Path = DATA_DIR,
                 as_json: bool = typer.Option(False, "--json", help="Print one JSON object.")) -> None:
    """This data dir's training run: round, loss, participants, exclusions."""
    from .status import training_summary

    summary = training_summary(resolve_data_dir(data_dir))
    if as_json:
        print(json.dumps(summary["state"] if summary else None, indent=2))
    else:
        out.print(summary["line"] if summary else "no training run on this data dir", highlight=False)
