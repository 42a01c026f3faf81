"""Who is blamed when a spot check disagrees: a third opinion protects an honest
server from a lying verifier."""

import pytest
import torch

from compushare.pipeline.client.chain import judge

TOL = 1e-3
TRUE = torch.randn(1, 3, 64, generator=torch.Generator().manual_seed(0))
NOISY = TRUE + 0.05 * torch.randn(1, 3, 64, generator=torch.Generator().manual_seed(1))
OTHER_NOISY = TRUE + 0.05 * torch.randn(1, 3, 64, generator=torch.Generator().manual_seed(2))
ROUNDING = TRUE * (1 + 1e-7)


@pytest.mark.parametrize("primary, check, arbiter, blamed", [
    (NOISY, TRUE, None, "primary"),  # no third server: the checked one is blamed
    (TRUE, NOISY, None, "primary"),  # ... even when the verifier lied (nobody can tell)
    (NOISY, TRUE, ROUNDING, "primary"),
    (TRUE, NOISY, ROUNDING, "verifier"),  # the lying verifier is outvoted
    (NOISY, OTHER_NOISY, TRUE, "both"),
    (TRUE, ROUNDING, TRUE, "neither"),
])
def test_judge(primary, check, arbiter, blamed):
    assert judge(primary, check, arbiter, TOL) == blamed
