"""The consumer's ends of a training pass: token embeddings in, the loss and its
gradient out. The embedding and LM head stay frozen (only adapters train), so the
embedding needs no gradient and the head's backward is the gradient of the loss
with respect to the last span's output.

The loss of an optimizer step is the mean cross-entropy over every counted target
of every microbatch in it: each microbatch contributes sum / total, so the
gradients of microbatches add up to the whole step's, whatever their number.
"""

from __future__ import annotations

import torch

IGNORE = -100  # a label that counts in no loss (padding, prompt tokens)


def embed_batch(head, input_ids: torch.Tensor) -> torch.Tensor:
    """[B, T] token ids -> [B, T, H] float32 embeddings (padding ids embed too: their
    positions come after the tokens and count in no loss)."""
    return torch.cat([head.embed_tokens(row.tolist()) for row in input_ids], dim=0).float()


def loss_and_grad(head, hidden: torch.Tensor, labels: torch.Tensor, total_targets: int
                  ) -> tuple[float, torch.Tensor]:
    """(sum of cross-entropies of the counted targets / total_targets, d that / d hidden)."""
    with torch.enable_grad():
        leaf = hidden.detach().float().requires_grad_(True)
        loss = _loss(head, leaf, labels) / total_targets
        (grad,) = torch.autograd.grad(loss, [leaf])
    return loss.item(), grad


def loss_sum(head, hidden: torch.Tensor, labels: torch.Tensor) -> float:
    """The sum of the counted targets' cross-entropies (evaluation)."""
    with torch.no_grad():
        return _loss(head, hidden.float(), labels).item()


def _loss(head, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = head._project(head._norm(hidden)).float()
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                             ignore_index=IGNORE, reduction="sum")
