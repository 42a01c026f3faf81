"""`compushare finetune`: train a LoRA adapter through the swarm (pipeline/client/finetune.py)."""

from __future__ import annotations

import time
from pathlib import Path

import typer

from ..config import resolve_data_dir
from ..model.lora import DEFAULT_TARGETS, TARGET_MODULES
from .cli_common import BOOTSTRAP, DATA_DIR, SWARM_HOME, bootstrap_for, err, run_or_exit, setup_logging


def finetune(
    data: Path = typer.Option(..., help="Training data: plain text, or JSONL with a prompt and a response per line."),
    out: Path = typer.Option(Path("adapter.safetensors"), help="Where the adapter goes: a .safetensors file, or a "
                                                               "directory (PEFT's layout). Checkpoints go to OUT.ckpt/; "
                                                               "the same command resumes from them."),
    model: str = typer.Option("smollm2-135m", help="Model name or id."),
    steps: int = typer.Option(100, min=1, help="Optimizer steps."),
    rank: int = typer.Option(8, min=1, help="LoRA rank."),
    alpha: float = typer.Option(16.0, help="LoRA alpha (the update is scaled by alpha / rank)."),
    targets: str = typer.Option(",".join(DEFAULT_TARGETS), help=f"Projections adapted, comma-separated, among "
                                                                 f"{', '.join(sorted(TARGET_MODULES))}."),
    batch_size: int = typer.Option(4, min=1, help="Sequences per microbatch."),
    accumulate: int = typer.Option(2, min=1, help="Microbatches per optimizer step (they run pipelined)."),
    seq_len: int = typer.Option(128, min=2, help="Tokens per sequence."),
    lr: float = typer.Option(2e-4, help="AdamW's learning rate."),
    seed: int = typer.Option(0, help="Seeds the adapter's initialisation, the evaluation split and the data order."),
    spot_check: float = typer.Option(0.05, min=0.0, max=1.0, help="Share of forwards and backwards also computed "
                                                                  "by a second server of the span."),
    checkpoint_every: int = typer.Option(10, min=1, help="Steps between checkpoints."),
    evaluate: bool = typer.Option(True, "--eval/--no-eval", help="Loss on the held-out tenth before and after."),
    data_dir: Path = DATA_DIR,
    bootstrap: list[str] = BOOTSTRAP,
    swarm_home: Path = SWARM_HOME,
    log_level: str = typer.Option("warning"),
) -> None:
    """Fine-tune MODEL on DATA: a LoRA adapter trained through the swarm's frozen spans
    (your data and adapter stay here), then usable with run/chat/the API's --adapter."""
    import trio

    from ..pipeline.client.finetune import FinetuneRequest, finetune as run_finetune

    setup_logging(log_level)
    home = resolve_data_dir(data_dir)

    def main_finetune():
        request = FinetuneRequest(model=model, data=data, out=out, steps=steps, rank=rank, alpha=alpha,
                                  targets=tuple(t.strip() for t in targets.split(",") if t.strip()),
                                  batch_size=batch_size, accumulate=accumulate, seq_len=seq_len, lr=lr, seed=seed,
                                  spot_check_rate=spot_check, checkpoint_every=checkpoint_every, evaluate=evaluate)
        boot = bootstrap_for(home, bootstrap, swarm_home)
        with StepProgress(steps) as progress:
            outcome = trio.run(lambda: run_finetune(home, boot, request, on_step=progress.update,
                                                    on_status=progress.say))
        if outcome.eval_loss_before is not None and outcome.eval_loss_after is not None:
            err.print(f"held-out loss {outcome.eval_loss_before:.4f} -> {outcome.eval_loss_after:.4f}",
                      highlight=False)
        err.print(f"{outcome.steps} steps, {outcome.train_tokens} tokens in {outcome.seconds:.0f}s; "
                  f"{outcome.failovers} failovers, {outcome.checks} spot checks, {outcome.reports} failure "
                  f"reports; adapter written to {outcome.out}", highlight=False)

    run_or_exit(main_finetune)


class StepProgress:
    """Step, loss, tokens/s and time left: a rich progress bar on a terminal, a line
    per step otherwise (logs, pipes)."""

    def __init__(self, steps: int) -> None:
        self.steps, self.began, self.tokens = steps, time.monotonic(), 0
        self.bar = None
        if err.is_terminal:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.bar = Progress(TextColumn("step"), MofNCompleteColumn(), BarColumn(),
                                TextColumn("loss {task.fields[loss]}  {task.fields[rate]} tok/s"),
                                TimeRemainingColumn(), console=err)
            self.task = self.bar.add_task("finetune", total=steps, loss="-", rate="-")

    def __enter__(self) -> StepProgress:
        if self.bar is not None:
            self.bar.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.stop()

    def say(self, message: str) -> None:
        err.print(message, highlight=False)

    def update(self, stats, steps: int) -> None:
        self.tokens += stats.tokens
        rate = stats.tokens / stats.seconds if stats.seconds > 0 else 0.0
        if self.bar is not None:
            self.bar.update(self.task, completed=stats.step, loss=f"{stats.loss:.4f}", rate=f"{rate:.0f}")
            return
        left = (time.monotonic() - self.began) / max(stats.step, 1) * (steps - stats.step)
        extra = f", {stats.failovers} failovers" if stats.failovers else ""
        err.print(f"step {stats.step}/{steps}: loss {stats.loss:.4f}, {rate:.0f} tok/s, {left:.0f}s left{extra}",
                  highlight=False)
