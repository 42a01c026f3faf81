"""`compushare finetune`: a LoRA adapter trained through the swarm, from a data file.

Joins the swarm as a consumer (the model's head and tokenizer here), reads the
data (model/train_data.py), holds out a tenth for evaluation, and runs optimizer
steps through SwarmTrainer. Every `checkpoint_every` steps, and at the end, the
run is checkpointed beside the output (`OUT.ckpt/`): a killed run started again
with the same command resumes from its last checkpoint, on the very batches it
would have had (the data order is a function of the seed and the step).
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ...errors import UsageError
from ...model import adapter_file
from ...model.arch import load_config
from ...model.lora import DEFAULT_TARGETS, Adapter, LoraSpec
from ...model.train_data import Example, batches, load_examples, split_examples
from ...model.training_state import OptimizerSettings, TrainingState
from .consumer import Consumer, ProgressHooks
from .planner import SwarmPlanner
from .spotcheck import DEFAULT_RATE
from .swarm_trainer import StepStats, SwarmTrainer


@dataclasses.dataclass(frozen=True)
class FinetuneRequest:
    model: str
    data: Path
    out: Path
    steps: int = 100
    rank: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] = DEFAULT_TARGETS
    batch_size: int = 4  # sequences per microbatch
    accumulate: int = 2  # microbatches per optimizer step
    seq_len: int = 128
    lr: float = 2e-4
    seed: int = 0
    spot_check_rate: float = DEFAULT_RATE
    checkpoint_every: int = 10
    evaluate: bool = True

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "accumulate", "seq_len", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise UsageError(f"--{name.replace('_', '-')} must be at least 1")
        if not self.lr > 0:
            raise UsageError("--lr must be positive")

    def run_settings(self, model_id: str) -> dict:
        """What a checkpoint must match to be resumed by this run."""
        return {"model_id": model_id, "data": str(Path(self.data).resolve()), "rank": self.rank,
                "alpha": self.alpha, "targets": sorted(self.targets), "batch_size": self.batch_size,
                "accumulate": self.accumulate, "seq_len": self.seq_len, "lr": self.lr, "seed": self.seed}


@dataclasses.dataclass
class FinetuneOutcome:
    out: Path
    steps: int
    resumed_from: int
    eval_loss_before: float | None
    eval_loss_after: float | None
    train_tokens: int
    seconds: float
    failovers: int
    checks: int
    reports: int
    route: list[tuple[str, int, int]]


def checkpoint_dir(out: Path) -> Path:
    return Path(out).with_name(Path(out).name + ".ckpt")


def step_batches(examples: list[Example], step: int, batch_size: int, accumulate: int, seed: int
                 ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The microbatches of optimizer step `step`: the examples in an order shuffled
    afresh each epoch by (seed, epoch), taken in turn. A function of its arguments
    alone, so a resumed run sees the batches the killed one would have."""
    per_step, n = batch_size * accumulate, len(examples)
    chosen = []
    for k in range(step * per_step, (step + 1) * per_step):
        epoch, offset = divmod(k, n)
        order = list(range(n))
        random.Random(f"{seed}/{epoch}").shuffle(order)
        chosen.append(examples[order[offset]])
    return [batches(chosen[i:i + batch_size], batch_size)[0] for i in range(0, per_step, batch_size)]


async def finetune(data_dir: Path, bootstrap: tuple[str, ...], request: FinetuneRequest, *,
                   on_step: Callable[[StepStats, int], None] = lambda _s, _n: None,
                   on_status: Callable[[str], None] = lambda _m: None) -> FinetuneOutcome:
    began = time.perf_counter()
    # The model's obtaining (converted, or its head fetched) told step by step: the steps' own bar is up.
    async with Consumer.connect(data_dir, bootstrap, request.model, hooks=ProgressHooks(on_stage=on_status)) \
            as consumer:
        model = consumer.model
        config = load_config(model.path)
        examples = load_examples(request.data, consumer.tokenizer, request.seq_len)
        train, held = split_examples(examples, seed=request.seed)
        on_status(f"{len(train)} training and {len(held)} evaluation examples from {request.data}")
        settings = OptimizerSettings(lr=request.lr)
        extra = request.run_settings(model.model_id)
        ckpt = checkpoint_dir(request.out)
        state = TrainingState.resume(ckpt, settings, extra=extra, base_model=request.model)
        resumed_from = 0 if state is None else state.step
        if state is None:
            spec = LoraSpec(request.rank, request.alpha, request.targets)
            fresh = Adapter.initialised(spec, config, range(config.num_hidden_layers), seed=request.seed,
                                        model_id=model.model_id)
            state = TrainingState(fresh, settings, base_model=request.model)
        else:
            on_status(f"resuming from the checkpoint at step {resumed_from}")
        planner = SwarmPlanner(consumer.host, consumer.dht, model.model_id, model.num_blocks,
                               penalties=consumer.penalties, view=consumer.view, karma=consumer.karma,
                               fmt=model.format.label)
        trainer = SwarmTrainer(consumer.host, planner, model.model_id, consumer.head, state,
                               spot_check_rate=request.spot_check_rate, on_report=consumer._keep_report)
        await trainer.open()
        try:
            held_batches = batches(held, request.batch_size)
            before = await trainer.evaluate(held_batches) if request.evaluate and resumed_from == 0 else None
            tokens = 0
            for step in range(state.step, request.steps):
                stats = await trainer.step(step_batches(train, step, request.batch_size, request.accumulate,
                                                        request.seed))
                tokens += stats.tokens
                on_step(stats, request.steps)
                if state.step % request.checkpoint_every == 0 or state.step == request.steps:
                    state.save(ckpt, extra)
            after = await trainer.evaluate(held_batches) if request.evaluate else None
        finally:
            await trainer.close()
        adapter_file.save(state.adapter(), request.out, base_model=request.model)
        return FinetuneOutcome(Path(request.out), state.step, resumed_from, before, after, tokens,
                               time.perf_counter() - began, trainer.failovers, trainer.checks, len(trainer.reports),
                               trainer.route)
