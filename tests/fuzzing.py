"""Shared pieces of the seeded distributed fuzz tests (test_exchange_fuzz,
test_hook_fuzz, test_algorithm_fuzz): run the cases on gloo workers, and
compare results NaN for NaN."""

from __future__ import annotations

import random
import traceback
import warnings
from collections.abc import Callable

import torch
from distributed import run_workers
from test_compressors import spec_for

from gradpress.compress import registry
from gradpress.exchange.base import check_strategy


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


def draw_pair(rnd: random.Random, strategies: list[str], adjust: Callable[[str], str] = lambda s: s
              ) -> tuple[str, str] | None:
    """A registered compressor (its small test spec) and a strategy drawn
    from ``strategies`` (``adjust``-ed), or None when the strategy refuses it."""
    spec = spec_for(rnd.choice(registry.names()))
    strategy = adjust(rnd.choice(strategies))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            check_strategy(strategy, registry.create(spec))
    except ValueError:
        return None
    return spec, strategy


def raised(per_rank: list[dict]) -> list[str]:
    """The first rank's error, if a case raised on any rank."""
    errors = [r["error"] for r in per_rank if "error" in r]
    return [f"raised: {errors[0]}"] if errors else []


def run_cases(seeds: list[int], draw: Callable[[int], dict | None], run: Callable[[dict, dict], None]) -> list[dict]:
    """This rank's results: for each seed, ``draw(seed)`` (None: skipped),
    then ``run(case, result)`` filling ``result``; an exception is kept as
    ``result["error"]`` (every rank goes on to the next case)."""
    warnings.simplefilter("ignore")
    out = []
    for seed in seeds:
        case = draw(seed)
        if case is None:
            continue
        res: dict = {"case": case}
        try:
            run(case, res)
        except Exception as exc:  # noqa: BLE001
            res["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-2000:]}"
        out.append(res)
    return out
