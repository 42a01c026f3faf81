"""DiLoCo's local work: build the recipe's model, run one round of inner AdamW steps from
the outer weights, and apply the outer Nesterov SGD step; plus the eval loss and the
one-process baseline the bench compares against.

A round starts a fresh AdamW, so it is a pure function of (outer weights, recipe, run id,
peer id, round): any peer can re-run another's round and, on the same machine with the
same torch thread count, get the same pseudo-gradient bit for bit. Weights travel as one
flat fp32 tensor in `model.named_parameters()` order (tied weights once). No network.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from compushare.diloco.corpus import Corpus, eval_batches, minibatch, single_minibatch
from compushare.diloco.recipe import Recipe, model_param_count

# Eager attention: deterministic on CPU, and as fast as sdpa at the bench's sizes (measured).
ATTENTION = "eager"


@dataclass(frozen=True)
class RoundResult:
    pseudo_grad: torch.Tensor  # outer weights − weights after the round, fp32 1-D
    loss: float  # mean training loss over the round's steps
    tokens: int  # tokens trained on (steps × batch × seq_len)
    seconds: float


def build_model(recipe: Recipe) -> LlamaForCausalLM:
    """The recipe's Llama in fp32, its initial weights drawn from recipe.seed alone (the
    global torch RNG is left as it was)."""
    config = LlamaConfig(**recipe.model, attn_implementation=ATTENTION)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(recipe.seed)
        model = LlamaForCausalLM(config)
    return model.float()


def param_count(recipe: Recipe) -> int:
    return model_param_count(recipe.model)


def flat_params(model: torch.nn.Module) -> torch.Tensor:
    """A 1-D fp32 copy of every parameter, in named_parameters() order (tied weights once)."""
    return torch.cat([p.detach().reshape(-1).float() for _, p in model.named_parameters()])


def load_flat(model: torch.nn.Module, flat: torch.Tensor) -> None:
    """Set every parameter from a flat fp32 tensor in flat_params' order."""
    params = [p for _, p in model.named_parameters()]
    total = sum(p.numel() for p in params)
    if flat.dim() != 1 or flat.numel() != total:
        raise ValueError(f"flat weights of shape {tuple(flat.shape)}; the model has {total} parameters")
    offset = 0
    with torch.no_grad():
        for p in params:
            p.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()


def _loss(model: LlamaForCausalLM, batch: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross-entropy over a (B, T + 1) batch."""
    logits = model(input_ids=batch[:, :-1]).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


def _adamw(recipe: Recipe, model: torch.nn.Module) -> torch.optim.AdamW:
    # foreach=False: the plain per-tensor loop, the same arithmetic on every build.
    return torch.optim.AdamW(model.parameters(), lr=recipe.lr, betas=recipe.betas,
                             weight_decay=recipe.weight_decay, foreach=False)


def _inner_step(recipe: Recipe, model: LlamaForCausalLM, opt: torch.optim.AdamW, batch: torch.Tensor,
                step: int) -> float:
    """One AdamW step at linear-warmup lr (step counts from 0); returns the step's loss."""
    lr = recipe.lr * min(1.0, (step + 1) / recipe.warmup) if recipe.warmup else recipe.lr
    for group in opt.param_groups:
        group["lr"] = lr
    opt.zero_grad(set_to_none=True)
    loss = _loss(model, batch)
    loss.backward()
    if recipe.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.grad_clip, foreach=False)
    opt.step()
    return loss.item()


def train_round(recipe: Recipe, corpus: Corpus, weights: torch.Tensor, *, run_id: str, peer: str, round: int,
                model: LlamaForCausalLM | None = None) -> RoundResult:
    """One participant's round: recipe.steps AdamW steps (fresh optimizer, the recipe's warmup
    and grad clip) from `weights` on the participant's minibatches. Pass `model` to reuse a
    module built by build_model (its weights are overwritten)."""
    start = time.perf_counter()
    model = model if model is not None else build_model(recipe)
    load_flat(model, weights)
    model.train()
    opt = _adamw(recipe, model)
    losses = [_inner_step(recipe, model, opt, minibatch(corpus, recipe, run_id=run_id, peer=peer,
                                                        round=round, step=step), step)
              for step in range(recipe.steps)]
    pseudo_grad = weights.float() - flat_params(model)
    return RoundResult(pseudo_grad=pseudo_grad, loss=sum(losses) / len(losses),
                       tokens=recipe.steps * recipe.batch * recipe.seq_len, seconds=time.perf_counter() - start)


class OuterOptimizer:
    """Nesterov SGD on flat fp32 weights, with the same arithmetic as
    torch.optim.SGD(lr, momentum, nesterov=True, dampening=0, weight_decay=0) given the
    averaged pseudo-gradient as the gradient. The momentum buffer starts at zero, which
    gives torch's first step exactly (its buffer starts as a copy of the first gradient)."""

    def __init__(self, recipe: Recipe, size: int) -> None:
        self.lr, self.momentum, self.nesterov = recipe.outer_lr, recipe.outer_momentum, recipe.nesterov
        self.buf = torch.zeros(size, dtype=torch.float32)

    def step(self, weights: torch.Tensor, avg_pseudo_grad: torch.Tensor) -> torch.Tensor:
        """The new outer weights (a new tensor; `weights` is left as it was)."""
        if avg_pseudo_grad.shape != self.buf.shape or weights.shape != self.buf.shape:
            raise ValueError(f"outer step on shapes {tuple(weights.shape)}, {tuple(avg_pseudo_grad.shape)}; "
                             f"the optimizer holds {tuple(self.buf.shape)}")
        grad = avg_pseudo_grad.float()
        self.buf.mul_(self.momentum).add_(grad)
        update = grad.add(self.buf, alpha=self.momentum) if self.nesterov else self.buf
        return weights.float().clone().add_(update, alpha=-self.lr)

    def state(self) -> torch.Tensor:
        """The momentum buffer (a copy): what a joiner needs to continue the run."""
        return self.buf.clone()

    def load_state(self, buf: torch.Tensor) -> None:
        if buf.shape != self.buf.shape or not torch.isfinite(buf).all():
            raise ValueError(f"a momentum buffer of shape {tuple(buf.shape)} (or not finite); "
                             f"expected {tuple(self.buf.shape)}")
        self.buf = buf.float().clone()


def eval_loss(recipe: Recipe, corpus: Corpus, weights: torch.Tensor, *, batches: int = 8,
              model: LlamaForCausalLM | None = None) -> float:
    """Mean cross-entropy (nats per byte) of `weights` over the first `batches` eval batches."""
    model = model if model is not None else build_model(recipe)
    load_flat(model, weights)
    model.eval()
    with torch.no_grad():
        losses = [_loss(model, batch).item() for batch in eval_batches(corpus, recipe, batches)]
    return sum(losses) / len(losses)


def train_single(recipe: Recipe, corpus: Corpus, *, global_batch: int, steps: int,
                 on_step: Callable[[int, float], None] | None = None, weights: torch.Tensor | None = None,
                 seed_label: str = "single") -> tuple[torch.Tensor, float]:
    """The one-process baseline: AdamW with the recipe's inner settings (warmup once, at the
    start) on batches of `global_batch` sequences for `steps` steps, from `weights` (default:
    the recipe's initial weights), batches drawn under `seed_label`. Returns the final flat
    weights and the mean loss of the last 10 steps."""
    model = build_model(recipe)
    if weights is not None:
        load_flat(model, weights)
    model.train()
    opt = _adamw(recipe, model)
    losses: list[float] = []
    for step in range(steps):
        batch = single_minibatch(corpus, recipe, global_batch=global_batch, step=step, seed_label=seed_label)
        losses.append(_inner_step(recipe, model, opt, batch, step))
        if on_step is not None:
            on_step(step, losses[-1])
    tail = losses[-10:]
    return flat_params(model), sum(tail) / len(tail)
