"""The same training in one process: the reference the swarm's is compared with
(tests, bench/finetune.py), and what `finetune --local` runs.

Every layer in one SpanRunner, one autograd graph per microbatch (no recompute:
this is how a machine that holds the whole model trains), the same loss at the
same head, the same gradient sums in microbatch order and the same optimizer
(model/training_state.py): so with the same data the two runs' losses agree within
float32 rounding.
"""

from __future__ import annotations

import time

import torch

from .lean import layers_forward
from .lora import Adapter
from .train_head import IGNORE, embed_batch, loss_and_grad, loss_sum
from .training_state import TrainingState


class LocalTrainer:
    def __init__(self, runner, head, state: TrainingState) -> None:
        self.runner, self.head, self.state = runner, head, state

    def _layers(self, hidden: torch.Tensor, adapter: Adapter) -> torch.Tensor:
        rows = hidden.shape[0]
        caches = [self.runner.new_cache() for _ in range(rows)]
        return layers_forward(self.runner, hidden.to(self.runner.dtype), caches, [0] * rows, self.runner.start,
                              self.runner.end, None, [adapter] * rows).float()

    def gradients(self, microbatches: list[tuple[torch.Tensor, torch.Tensor]]
                  ) -> tuple[float, int, dict[str, torch.Tensor]]:
        """(loss, counted targets, every adapter tensor's gradient), as SwarmTrainer.gradients."""
        total = sum(int((labels != IGNORE).sum()) for _, labels in microbatches)
        params = self.state.params
        sums = {name: torch.zeros_like(p) for name, p in params.items()}
        loss = 0.0
        for ids, labels in microbatches:
            with torch.enable_grad():
                leaves = {name: p.detach().requires_grad_(True) for name, p in params.items()}
                adapter = Adapter(self.state.spec, leaves, self.state.model_id)
                output = self._layers(embed_batch(self.head, ids), adapter)
                mb_loss, grad = loss_and_grad(self.head, output.detach(), labels, total)
                grads = torch.autograd.grad(output, list(leaves.values()), grad_outputs=grad, allow_unused=True)
            loss += mb_loss
            for (name, leaf), g in zip(leaves.items(), grads):
                sums[name] += g if g is not None else torch.zeros_like(leaf)
        return loss, total, sums

    def step(self, microbatches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[float, int, float]:
        """One optimizer step: (loss, counted targets, seconds)."""
        began = time.perf_counter()
        loss, total, sums = self.gradients(microbatches)
        self.state.apply(sums)
        return loss, total, time.perf_counter() - began

    def evaluate(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        adapter, total, loss = self.state.adapter(), 0, 0.0
        for ids, labels in batches:
            with torch.inference_mode():
                output = self._layers(embed_batch(self.head, ids), adapter)
            loss += loss_sum(self.head, output, labels)
            total += int((labels != IGNORE).sum())
        return loss / max(total, 1)
