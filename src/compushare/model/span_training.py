"""A span's training passes: stateless forward and backward for a microbatch.

A server keeps nothing between a microbatch's forward and its backward: the
backward recomputes the span's forward from the span's input (as Petals'
rpc_backward does), recording the graph this time, and returns the gradient for
that input and for the adapter's factors it was given. The span's own weights are
frozen (their modules never require grad) and no optimizer runs here: the consumer
holds the trainable parameters.

Sequences of a microbatch are independent (each its own empty KV cache, position
0): a padded row's padding comes after its tokens and, attention being causal,
changes none of them. Synchronous: callers put it in a worker thread.

A span on ggml has no graph to differentiate: its training passes run each layer on
torch, built from the same stored weights (a GGUF's types on torch's kernels, whose
backward is kernel_grads.py's) one layer at a time and dropped after it
(`LayerTwins`), so a pass holds one layer's torch copy beyond the span. The
backward runs the layers forward keeping each one's input, then each backward in
turn. Their numerics are torch's on the GGUF (bfloat16 activations into the
kernels), not ggml's: within the tolerance between the two runtimes
(proofs.inference.ACROSS_RUNTIMES), and equal to a torch server's on the same file.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .lean import layers_forward
from .lora import Adapter


def _layers(runner, hidden: torch.Tensor, adapter: Adapter | None, start: int, end: int,
            between_layers: Callable[[], None] | None) -> torch.Tensor:
    if not (runner.start <= start < end <= runner.end):
        raise ValueError(f"sub-span {start}:{end} outside served span {runner.start}:{runner.end}")
    rows = hidden.shape[0]
    caches = [runner.new_cache() for _ in range(rows)]
    return layers_forward(runner, hidden.to(runner.dtype), caches, [0] * rows, start, end, between_layers,
                          [adapter] * rows if adapter is not None else None)


class LayerTwins:
    """A span's layers on torch, one at a time, for a span whose runtime has no backward
    (ggml): built from the model's stored weights (`runner.model_dir`) when asked."""

    def __init__(self, runner) -> None:
        self.model_dir = runner.model_dir

    def layer(self, index: int):
        from .blocks import SpanRunner  # noqa: PLC0415  (transformers' layers)

        return SpanRunner.load(self.model_dir, index, index + 1)


def needs_twins(runner) -> bool:
    return getattr(runner, "runtime", "torch") != "torch"


def span_forward(runner, hidden: torch.Tensor, adapter: Adapter | None, start: int, end: int, *,
                 between_layers: Callable[[], None] | None = None) -> torch.Tensor:
    """Layers start..end-1 on `hidden` [B, T, H] (B independent sequences), with
    `adapter`'s updates; float32 out."""
    with torch.inference_mode():
        if not needs_twins(runner):
            return _layers(runner, hidden, adapter, start, end, between_layers).float()
        twins = LayerTwins(runner)
        for index in range(start, end):
            hidden = _layers(twins.layer(index), hidden, adapter, index, index + 1, between_layers).float()
        return hidden


def span_backward(runner, hidden: torch.Tensor, grad_output: torch.Tensor, adapter: Adapter | None, start: int,
                  end: int, *, between_layers: Callable[[], None] | None = None
                  ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(d loss / d hidden, {adapter tensor name: d loss / d it}) for layers start..end-1,
    given d loss / d output: the forward recomputed with its graph, then backward."""
    if needs_twins(runner):
        return _twins_backward(LayerTwins(runner), hidden, grad_output, adapter, start, end, between_layers)
    with torch.enable_grad():
        # A copy: `hidden` may be an inference tensor (span_forward's output), which can never require grad.
        leaf = hidden.detach().to(runner.dtype, copy=True).requires_grad_(True)
        params: dict[str, torch.Tensor] = {}
        trained = None
        if adapter is not None:
            params = {name: t.detach().clone().requires_grad_(True) for name, t in adapter.tensors.items()}
            trained = Adapter(adapter.spec, params, adapter.model_id)
        output = _layers(runner, leaf, trained, start, end, between_layers)
        names = [name for name in params if params[name] is not None]
        grads = torch.autograd.grad(output, [leaf, *(params[n] for n in names)],
                                    grad_outputs=grad_output.to(output.dtype), allow_unused=True)
    grad_input = grads[0].float()
    return grad_input, {name: (g if g is not None else torch.zeros_like(params[name])).float()
                        for name, g in zip(names, grads[1:])}


def _twins_backward(twins: LayerTwins, hidden: torch.Tensor, grad_output: torch.Tensor, adapter: Adapter | None,
                    start: int, end: int, between_layers: Callable[[], None] | None
                    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """span_backward a layer at a time: each layer's input kept from a forward, then
    each layer's backward from the last (its torch twin built again: one held at once)."""
    inputs = []
    with torch.inference_mode():
        for index in range(start, end):
            inputs.append(hidden.clone())
            hidden = _layers(twins.layer(index), hidden, adapter, index, index + 1, between_layers).float()
    grads: dict[str, torch.Tensor] = {}
    grad = grad_output
    for index in reversed(range(start, end)):
        grad, layer_grads = span_backward(twins.layer(index), inputs[index - start], grad, adapter, index, index + 1,
                                          between_layers=between_layers)
        for name, value in layer_grads.items():  # every tensor of the adapter: zero outside this layer
            grads[name] = grads[name] + value if name in grads else value
    return grad, grads
