"""Shared pieces of the seeded distributed fuzz tests (test_exchange_fuzz,
test_hook_fuzz, test_algorithm_fuzz): run the cases on gloo workers, and
compare results NaN for NaN."""

from __future__ import annotations

from collections.abc import Callable

import torch
from distributed import run_workers


def same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Equal bit for bit where finite or infinite, NaN where the other is
    NaN; two missing tensors (None) are the same."""
    if a is None or b is None:
        return a is None and b is None
    nan = torch.isnan(a)
    return torch.equal(nan, torch.isnan(b)) and torch.equal(a[~nan], b[~nan])


def check_cases(worker: Callable[..., list[dict]], problems: Callable[[list[dict]], list[str]], world: int,
                seeds: list[int], *, least: int, accepted: Callable[[dict], bool] = lambda r: True) -> None:
    """Run ``worker(rank, world, seeds)`` on ``world`` workers (one result
    per case it ran, with its ``case``); fail naming every case with
    problems (at most 20), or when fewer than ``least`` cases were accepted
    (the draw is broken)."""
    results = run_workers(worker, world, seeds)
    taken = sum(accepted(r) for r in results[0])
    assert taken >= least, f"only {taken} of {len(seeds)} cases were accepted: the draw is broken"
    report = [f"{per[0]['case']}: {p}" for per in zip(*results) for p in problems(list(per))]
    assert not report, "\n".join(report[:20])
