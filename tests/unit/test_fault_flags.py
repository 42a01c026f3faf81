"""The hidden --debug-* flags (app/debug.py): --debug-slow-steps is read and checked."""

import pytest

from compushare.app.debug import FaultInjection
from compushare.errors import UsageError


def test_slow_steps_are_first_count_seconds():
    assert FaultInjection().slow_steps_plan() is None
    assert FaultInjection.from_flags(slow_steps="10:2:3.5").slow_steps_plan() == (10, 2, 3.5)


@pytest.mark.parametrize("flag", ["10:2", "a:2:3", "10:2:3:4", "-1:2:3", "1:2:601"])
def test_a_malformed_slow_steps_flag_is_a_usage_error(flag):
    with pytest.raises(UsageError):
        FaultInjection(slow_steps=flag)
