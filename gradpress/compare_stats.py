"""Statistics over seeds and learning-rate selection, shared by
``gradpress compare`` and ``gradpress bench e2e --train-to`` (one
implementation of the aggregation both tables use).

A *quantity* over seeds is a list with one value per seed, ``None`` where
the run has none (it did not reach the target); a NaN or infinite value (a
diverged run) counts as ``None``: it never enters mean, std, min or max. :func:`stat` summarizes it:
``n`` (seeds), ``k`` (seeds with a value), ``mean``, ``std`` (sample
standard deviation, ddof=1; 0 for one value), ``min``, ``max`` over the
``k`` values, and ``values`` (per seed, ``None`` kept). :func:`fmt` writes
it for a table: ``0.9312 ± 0.0040 [0.9270, 0.9350]`` and, when some seeds
have no value, ``; not reached (1 of 3)`` — a missing run is never dropped
silently.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from gradpress.train.config import SEED_MAX  # the largest seed, train's rule

__all__ = ["parse_seeds", "parse_lr_grid", "stat", "fmt", "group", "best_lr", "BEST_LR_RULE", "MAX_SEEDS"]

#: the most seeds one ``--seeds`` may ask for (a count is expanded to a list up front: a typo such as
#: ``--seeds 99999999999`` must be refused, not allocated)
MAX_SEEDS = 1000

BEST_LR_RULE = ("best final validation metric after the sweep budget, mean over the sweep seeds "
                "(ties, within 1e-9, go to the smaller lr)")


def parse_seeds(value: str | int | Sequence[int] | None, base: int = 0) -> list[int] | None:
    """``"3"`` / ``3`` -> ``[base, base+1, base+2]``; ``"0,4,7"`` -> ``[0, 4, 7]``; None -> None."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"seeds: expected a count or a comma-separated list, got {value!r}")
    if isinstance(value, int):
        items: list[int] | None = None
        count = value
    elif isinstance(value, str):
        parts = [p.strip() for p in value.split(",")]
        try:
            nums = [int(p) for p in parts]
        except ValueError:
            raise ValueError(f"seeds: expected a count (3) or a comma-separated list (0,1,2), got {value!r}") from None
        items, count = (nums, 0) if len(nums) > 1 else (None, nums[0])
    else:
        items, count = [int(v) for v in value], 0
    if items is None:
        if not 1 <= count <= MAX_SEEDS:
            raise ValueError(f"seeds: the count must be from 1 to {MAX_SEEDS}, got {count}")
        if base + count - 1 > SEED_MAX:
            raise ValueError(f"seeds: {count} seeds from --seed {base} go up to {base + count - 1}; allowed: seeds "
                             f"from 0 to {SEED_MAX}")
        items = list(range(base, base + count))
    if len(items) > MAX_SEEDS:
        raise ValueError(f"seeds: {len(items)} seeds listed; allowed: at most {MAX_SEEDS}")
    if any(s < 0 or s > SEED_MAX for s in items):
        raise ValueError(f"seeds: must be from 0 to {SEED_MAX}, got {items}")
    if len(set(items)) != len(items):
        raise ValueError(f"seeds: {items} lists a seed more than once")
    return items


def parse_lr_grid(value: str | Sequence[float] | None, default_lr: float | None = None) -> list[float] | None:
    """``"0.003,0.01,0.03"`` -> those rates; ``"x0.3,x1,x3"`` -> factors of
    ``default_lr`` (the workload's default or ``--lr``). Sorted, unique."""
    if value is None:
        return None
    parts = [p.strip() for p in value.split(",")] if isinstance(value, str) else list(value)
    rates = []
    for p in parts:
        try:
            if isinstance(p, str) and p[:1] in ("x", "*"):
                if default_lr is None:
                    raise ValueError(f"lr-sweep: factor {p!r} needs a default lr")
                r = float(p[1:]) * default_lr
            else:
                r = float(p)
        except ValueError as e:
            if "needs a default" in str(e):
                raise
            raise ValueError(f"lr-sweep: {p!r} is neither a rate (0.01) nor a factor of the default (x3)") from None
        if not (math.isfinite(r) and r > 0):
            raise ValueError(f"lr-sweep: rates must be positive and finite, got {p!r}")
        rates.append(float(f"{r:.6g}"))
    if not rates:
        raise ValueError("lr-sweep: give at least one rate, e.g. 0.003,0.01,0.03 or x0.3,x1,x3")
    return sorted(set(rates))


def stat(values: Iterable[float | None]) -> dict[str, Any]:
    vals = [None if v is None or not math.isfinite(v) else v for v in values]
    got = [float(v) for v in vals if v is not None]
    out: dict[str, Any] = {"n": len(vals), "k": len(got), "values": vals}
    if got:
        out.update(mean=statistics.fmean(got), std=statistics.stdev(got) if len(got) > 1 else 0.0,
                   min=min(got), max=max(got))
    else:
        out.update(mean=None, std=None, min=None, max=None)
    return out


def fmt(st: Mapping[str, Any], f: Callable[[float], str] = lambda v: f"{v:.4f}", missing: str = "not reached") -> str:
    """One table cell for a :func:`stat` (see the module docstring)."""
    n, k = st["n"], st["k"]
    if k == 0:
        return f"{missing} ({n} of {n})" if n > 1 else missing
    if n == 1:
        return f(st["mean"])
    cell = f"{f(st['mean'])} ± {f(st['std'])} [{f(st['min'])}, {f(st['max'])}]"
    if k < n:
        cell += f"; {missing} ({n - k} of {n})"
    return cell


def group(rows: Sequence[Mapping[str, Any]], key: Callable[[Mapping[str, Any]], Any],
          fields: Mapping[str, Callable[[Mapping[str, Any]], float | None]]) -> list[dict[str, Any]]:
    """Rows grouped by ``key`` (first-seen order); per group ``key``,
    ``seeds`` (each row's ``seed``), ``rows`` and one :func:`stat` per field."""
    groups: dict[Any, list[Mapping[str, Any]]] = {}
    for r in rows:
        groups.setdefault(key(r), []).append(r)
    out = []
    for k, rs in groups.items():
        g: dict[str, Any] = {"key": k, "seeds": [r.get("seed") for r in rs], "rows": list(rs)}
        for name, get in fields.items():
            g[name] = stat(get(r) for r in rs)
        out.append(g)
    return out


def best_lr(scores: Mapping[float, Sequence[float | None]], higher_is_better: bool = True) -> float:
    """The lr whose mean final metric is best (:data:`BEST_LR_RULE`). A
    rate whose runs all lack a metric (diverged) is never chosen unless all do."""
    def score(lr: float) -> float:
        st = stat(scores[lr])
        if st["mean"] is None or not math.isfinite(st["mean"]) or st["k"] < st["n"]:
            return -math.inf
        return st["mean"] if higher_is_better else -st["mean"]
    rates = sorted(scores)
    best = rates[0]
    for lr in rates[1:]:
        if score(lr) > score(best) + 1e-9:
            best = lr
    return best
