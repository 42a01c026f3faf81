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
backward is kernel_grads.py's), a layer at a time (`LayerTwins`). Twins are kept,
first come, while their bytes fit what the training server set aside for them
(half its training budget); the others are built for each pass and dropped after,
so a pass holds at most one layer's torch copy beyond those kept. With every layer
of the request kept, the backward is the torch span's: one graph over the twins.
Otherwise it runs the layers forward keeping each one's input, then each layer's
backward in turn (a layer's forward computed twice). Their numerics are torch's on the GGUF (bfloat16 activations into the
kernels), not ggml's: within the tolerance between the two runtimes
(proofs.inference.ACROSS_RUNTIMES), and equal to a torch server's on the same file.
"""

from __future__ import annotations

import threading
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
    """A span's layers on torch, for a span whose runtime has no backward (ggml):
    built from the model's stored weights (`runner.model_dir`) when asked, and kept,
    first come, while their bytes fit `keep_bytes` (a fixed set, never evicted: a
    pass visits every layer in turn, and a least-recently-used cache smaller than
    the span would miss every time)."""

    def __init__(self, runner, keep_bytes: int = 0) -> None:
        self.model_dir = runner.model_dir
        self.keep_bytes = keep_bytes
        self.kept: dict[int, object] = {}
        self.kept_bytes = 0
        self.built = 0  # layers built, kept or not (tests, benchmarks)
        self._lock = threading.Lock()  # training passes run in worker threads

    def holds(self, start: int, end: int) -> bool:
        """Whether every layer start..end-1 is kept (a backward may then hold them all)."""
        with self._lock:
            return all(index in self.kept for index in range(start, end))

    def layer(self, index: int):
        from .blocks import SpanRunner  # noqa: PLC0415  (transformers' layers)

        with self._lock:
            twin = self.kept.get(index)
        if twin is not None:
            return twin
        with torch.inference_mode(False):  # a kept twin built in a forward serves backwards too
            twin = SpanRunner.load(self.model_dir, index, index + 1)
        with self._lock:
            self.built += 1
            if index not in self.kept and self.kept_bytes + twin.weight_bytes <= self.keep_bytes:
                self.kept[index] = twin
                self.kept_bytes += twin.weight_bytes
        return twin


def twins_of(runner) -> LayerTwins:
    """The runner's twins (`runner.twins`, set by the training server with what it
    may keep), or ones that keep nothing."""
    twins = getattr(runner, "twins", None)
    return twins if twins is not None else LayerTwins(runner)


def needs_twins(runner) -> bool:
    return getattr(runner, "runtime", "torch") != "torch"


def span_forward(runner, hidden: torch.Tensor, adapter: Adapter | None, start: int, end: int, *,
                 between_layers: Callable[[], None] | None = None) -> torch.Tensor:
    """Layers start..end-1 on `hidden` [B, T, H] (B independent sequences), with
    `adapter`'s updates; float32 out."""
    with torch.inference_mode():
        if not needs_twins(runner):
            return _layers(runner, hidden, adapter, start, end, between_layers).float()
        twins = twins_of(runner)
        for index in range(start, end):
            hidden = _layers(twins.layer(index), hidden, adapter, index, index + 1, between_layers).float()
        return hidden


def span_backward(runner, hidden: torch.Tensor, grad_output: torch.Tensor, adapter: Adapter | None, start: int,
                  end: int, *, between_layers: Callable[[], None] | None = None
                  ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(d loss / d hidden, {adapter tensor name: d loss / d it}) for layers start..end-1,
    given d loss / d output: the forward recomputed with its graph, then backward. A
    span on ggml whose twins are all kept does the same over them; otherwise it goes
    a layer at a time (_twins_backward)."""
    if needs_twins(runner):
        twins = twins_of(runner)
        if not twins.holds(start, end):
            return _twins_backward(twins, hidden, grad_output, adapter, start, end, between_layers)
        segments = [(twins.kept[index], index, index + 1) for index in range(start, end)]
    else:
        segments = [(runner, start, end)]
    with torch.enable_grad():
        # A copy: `hidden` may be an inference tensor (span_forward's output), which can never require grad.
        leaf = hidden.detach().to(segments[0][0].dtype, copy=True).requires_grad_(True)
        params: dict[str, torch.Tensor] = {}
        trained = None
        if adapter is not None:
            params = {name: t.detach().clone().requires_grad_(True) for name, t in adapter.tensors.items()}
            trained = Adapter(adapter.spec, params, adapter.model_id)
        output = leaf
        for segment, first, last in segments:
            output = _layers(segment, output, trained, first, last, between_layers)
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
