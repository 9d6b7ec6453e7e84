"""groups: an infinite or huge timeout is refused with the ValueError that
names it, so ``own_group`` reports it instead of raising on one rank while
the others wait in ``new_group`` (review H)."""

from __future__ import annotations

import datetime

import pytest
from distributed import run_workers

from gradpress.transport.groups import own_group, timeout_of


@pytest.mark.parametrize("value", [float("inf"), 1e20])
def test_unrepresentable_timeout_is_a_value_error_naming_it(value: float) -> None:
    with pytest.raises(ValueError, match="timeout must be a positive number"):
        timeout_of(None, value)
    assert timeout_of(None, 2.5) == datetime.timedelta(seconds=2.5)


def _own_group_with(rank: int, world: int, value: float) -> tuple[bool, str | None]:
    group, error = own_group(None, value if rank == 1 else None)
    return group is not None, error


def test_own_group_reports_an_infinite_timeout_on_one_rank() -> None:
    results = run_workers(_own_group_with, 2, float("inf"))
    assert results[0] == (True, None)
    assert results[1][0] and results[1][1] and "timeout must be a positive number" in results[1][1], results
