"""Hidden states across a span's edges: the wire's CPU tensors to and from the
device the span computes on.

A span on CUDA holds its weights, KV caches and activations there; what enters and
leaves it is a CPU tensor (the wire, the head and the chain's CPU spans see nothing
else). Each crossing goes through page-locked (pinned) host memory, from torch's
caching host allocator, so the copy is one DMA, not a staging copy by the driver.
"""

from __future__ import annotations

import torch

CPU = torch.device("cpu")


def to_device(hidden: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`hidden` (on the host) on `device`, through a pinned buffer; itself on CPU."""
    if device.type == "cpu" or hidden.device == device:
        return hidden
    return hidden.pin_memory().to(device, non_blocking=True)


def to_host(hidden: torch.Tensor) -> torch.Tensor:
    """`hidden` (on a device) as a CPU tensor, copied into a pinned buffer and waited
    for; a CPU tensor as it is."""
    if hidden.device.type == "cpu":
        return hidden
    host = torch.empty(hidden.shape, dtype=hidden.dtype, pin_memory=True)
    host.copy_(hidden, non_blocking=True)
    torch.cuda.current_stream(hidden.device).synchronize()
    return host
