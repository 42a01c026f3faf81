"""The butterfly all-reduce's cut of a flat vector into one contiguous part per member. Pure, no I/O.

Member i of a group of n owns part i (it aggregates everyone's part i). Parts are as equal as
possible: the first size % n parts hold one element more; with size < n the last parts are empty,
so every member still has a (possibly empty) part and the protocol needs no special case.
"""

from __future__ import annotations

import torch


def bounds(size: int, n: int) -> list[tuple[int, int]]:
    """n (start, end) ranges covering 0..size in order, sizes differing by at most 1."""
    if size < 0 or n < 1:
        raise ValueError(f"bounds: need size >= 0 and n >= 1, got size={size}, n={n}")
    base, extra = divmod(size, n)
    out, start = [], 0
    for i in range(n):
        end = start + base + (1 if i < extra else 0)
        out.append((start, end))
        start = end
    return out


def split(x: torch.Tensor, n: int) -> list[torch.Tensor]:
    """x flattened, cut into n parts by `bounds` (views, no copy)."""
    flat = x.reshape(-1)
    return [flat[a:b] for a, b in bounds(flat.numel(), n)]


def join(parts: list[torch.Tensor]) -> torch.Tensor:
    """The parts concatenated in order: the inverse of `split` (an empty fp32 vector for no parts)."""
    if not parts:
        return torch.zeros(0, dtype=torch.float32)
    return torch.cat([p.reshape(-1) for p in parts])
