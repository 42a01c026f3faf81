"""How the owner of a part combines the members' contributions to it. Pure, no I/O.

Two aggregators (AGGREGATORS), both deterministic for the same inputs in the same order (the caller
passes contributions sorted by peer id). The protocol does not rely on members agreeing bit for bit
on an aggregate (everyone uses the owner's int8 result); still, "mean" is only elementwise fp32 adds in
the given order, so it gives the same bits on any machine; "centered_clip" also depends on norms
(reductions whose summation order may vary with the CPU), so it is repeatable on one machine.

- "mean": the plain fp32 mean, summed in the given order.
- "centered_clip": BTARD's CenteredClip (Gorbunov et al. 2021, "Secure Distributed Training at
  Scale"): a fixed point v of  v = v + mean_i clip_tau(x_i - v),  clip_tau(d) = d · min(1, tau/‖d‖).
  Each contribution pulls v by at most tau, so a minority cannot drag the result far (see
  `centered_clip`); honest contributions closer than tau are not clipped at all and then v is their
  plain mean.

Norms are taken in fp64: the values may reach ±2^101 (quant.MAX_SCALE), whose squares overflow fp32.
"""

from __future__ import annotations

import torch

AGGREGATORS = ("mean", "centered_clip")
# Default tau = TAU_FACTOR × the median distance of the contributions from the coordinate-wise median.
TAU_FACTOR = 2.0


def _check(xs: list[torch.Tensor]) -> None:
    if not xs:
        raise ValueError("aggregate: no contributions")
    if any(x.shape != xs[0].shape for x in xs):
        raise ValueError("aggregate: contributions differ in shape")


def _stack(xs: list[torch.Tensor]) -> torch.Tensor:
    _check(xs)
    return torch.stack([x.reshape(-1).to(torch.float32) for x in xs])


def mean(xs: list[torch.Tensor]) -> torch.Tensor:
    """The fp32 mean, accumulated in fp32 in the given order (deterministic)."""
    _check(xs)
    acc = xs[0].reshape(-1).to(torch.float32).clone()
    for x in xs[1:]:
        acc += x.reshape(-1).to(torch.float32)
    return acc.div_(len(xs))


def median(stacked: torch.Tensor) -> torch.Tensor:
    """Coordinate-wise median along dim 0; for an even count the mean of the two middle values.

    (torch.median would pick the lower one; the mean of both keeps the median symmetric: negating every
    contribution negates it.)
    """
    n = stacked.shape[0]
    s = stacked.sort(dim=0).values
    lo, hi = s[(n - 1) // 2], s[n // 2]
    return lo.clone() if n % 2 else (lo + hi) / 2


def default_tau(stacked: torch.Tensor, center: torch.Tensor) -> float:
    """TAU_FACTOR × the median distance of the rows from `center` (the coordinate-wise median)."""
    dist = torch.linalg.vector_norm(stacked - center, dim=1, dtype=torch.float64)
    return TAU_FACTOR * float(median(dist[:, None])[0])


def centered_clip(
    xs: list[torch.Tensor], *, tau: float | None = None, iters: int = 20, eps: float = 1e-6
) -> torch.Tensor:
    """BTARD's CenteredClip of the contributions (fp32 result, same order in → same bits out).

    Starts at v0 = the coordinate-wise median, then iterates v ← v + mean_i clip_tau(x_i − v) until the
    update's norm is below eps·‖v‖ or after `iters` steps.

    Why a minority moves it little: at the fixed point Σ_i clip_tau(x_i − v) = 0. A bad contribution
    adds a term of norm at most tau whatever it sends; if the n − b honest ones are within tau of v
    (unclipped), their terms sum to (n − b)(mean_honest − v), so ‖v − mean_honest‖ ≤ b·tau/(n − b),
    about tau·b/n for a small minority, against an unbounded shift for the plain mean.

    tau=None takes tau = TAU_FACTOR × median_i ‖x_i − v0‖: data-driven (no per-model tuning, scales
    with the pseudo-gradients), and with b < n/2 bad contributions the median distance is an honest
    one's, so the bad ones cannot inflate tau. Factor 2 leaves honest contributions (spread alike)
    unclipped, so with no bad peer the result is the plain mean.
    """
    x = _stack(xs)
    v = median(x)
    if tau is None:
        tau = default_tau(x, v)
    if tau < 0:
        raise ValueError(f"centered_clip: tau must be >= 0, got {tau}")
    for _ in range(iters):
        d = x - v
        norm = torch.linalg.vector_norm(d, dim=1, dtype=torch.float64)
        weight = torch.where(norm > tau, tau / norm.clamp_min(1e-300), torch.ones_like(norm))
        step = _weighted_mean(d, weight.to(torch.float32))
        v = v + step
        step_norm = torch.linalg.vector_norm(step, dtype=torch.float64)
        if step_norm <= eps * torch.linalg.vector_norm(v, dtype=torch.float64):
            break
    return v


def _weighted_mean(d: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """mean_i weight_i · d_i, summed elementwise in row order (no reduction whose order could vary)."""
    acc = d[0] * weight[0]
    for i in range(1, d.shape[0]):
        acc += d[i] * weight[i]
    return acc.div_(d.shape[0])


def aggregate(xs: list[torch.Tensor], method: str) -> torch.Tensor:
    """Combine contributions by `method`, one of AGGREGATORS."""
    if method == "mean":
        return mean(xs)
    if method == "centered_clip":
        return centered_clip(xs)
    raise ValueError(f"aggregate: unknown method {method!r}, want one of {AGGREGATORS}")
