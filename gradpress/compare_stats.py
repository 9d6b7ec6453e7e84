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

Intervals: ``ci95`` of a :func:`stat` is the 95% confidence interval of the
mean, ``mean ± t(0.975, k-1) std / sqrt(k)`` (Student t, :func:`t_quantile`),
``None`` below two values. :func:`difference` gives the interval of the
difference of two configurations' means: paired by seed when both have a
value at the same seeds, else Welch's. :func:`rank` ranks by such intervals.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from gradpress.train.config import SEED_MAX  # the largest seed, train's rule

__all__ = ["parse_seeds", "parse_lr_grid", "stat", "fmt", "group", "best_lr", "BEST_LR_RULE", "MAX_SEEDS",
           "t_quantile", "interval", "difference", "rank", "fmt_interval", "fmt_difference", "RANK_RULE",
           "TIME_RANK_RULE", "RANK_RULES", "rank_rule", "clip", "clip_stat"]

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


def t_quantile(p: float, df: float) -> float:
    """The ``p`` quantile of Student's t distribution with ``df`` (> 0, not
    necessarily whole) degrees of freedom: ``t_quantile(0.975, 2)`` = 4.303."""
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p < 1:
        raise ValueError(f"t quantile: probability must be strictly between 0 and 1, got {p!r}")
    if isinstance(df, bool) or not isinstance(df, (int, float)) or not df > 0:  # NaN fails df > 0
        raise ValueError(f"t quantile: degrees of freedom must be a number > 0, got {df!r}")
    from scipy.special import stdtrit  # a gradpress dependency (pyproject); imported only when needed

    return float(stdtrit(float(df), float(p)))


def interval(mean: float, se: float, df: float, level: float = 0.95) -> list[float]:
    """``[mean - t se, mean + t se]``, ``t`` the (1 + level) / 2 quantile of t with ``df`` degrees of freedom."""
    half = t_quantile((1 + level) / 2, df) * se
    return [mean - half, mean + half]


def stat(values: Iterable[float | None]) -> dict[str, Any]:
    vals = [None if v is None or not math.isfinite(v) else v for v in values]
    got = [float(v) for v in vals if v is not None]
    out: dict[str, Any] = {"n": len(vals), "k": len(got), "values": vals}
    if got:
        out.update(mean=statistics.fmean(got), std=statistics.stdev(got) if len(got) > 1 else 0.0,
                   min=min(got), max=max(got))
        out["ci95"] = interval(out["mean"], out["std"] / math.sqrt(len(got)), len(got) - 1) if len(got) > 1 else None
    else:
        out.update(mean=None, std=None, min=None, max=None, ci95=None)
    return out


def difference(a: Mapping[Any, float | None], b: Mapping[Any, float | None]) -> dict[str, Any]:
    """The 95% interval of mean(a) - mean(b), ``a`` and ``b`` one value per
    seed (``None``/NaN: none). ``kind`` ``paired`` when both have a value at
    the same seeds (the interval of the mean per-seed difference, ``n`` - 1
    degrees of freedom), else ``welch`` (unpaired, Welch-Satterthwaite
    degrees of freedom ``df``); ``ci95`` None with fewer than two values
    (paired: pairs) on a side; ``df`` None where it is undefined. ``n``: pairs;
    ``n_a``, ``n_b``: values."""
    ga = {s: float(v) for s, v in a.items() if v is not None and math.isfinite(v)}
    gb = {s: float(v) for s, v in b.items() if v is not None and math.isfinite(v)}
    out: dict[str, Any] = {"n_a": len(ga), "n_b": len(gb)}
    if set(ga) == set(gb):
        st = stat([ga[s] - gb[s] for s in ga])
        out.update(kind="paired", n=len(ga), mean=st["mean"], df=len(ga) - 1 if ga else None, ci95=st["ci95"])
        return out
    out.update(kind="welch", n=None, mean=None, df=None, ci95=None)
    if ga and gb:
        out["mean"] = statistics.fmean(ga.values()) - statistics.fmean(gb.values())
    if len(ga) < 2 or len(gb) < 2:
        return out
    va, vb = statistics.variance(ga.values()) / len(ga), statistics.variance(gb.values()) / len(gb)
    if va + vb == 0:
        out["ci95"] = [out["mean"], out["mean"]]  # no spread on either side: a point (df undefined, None)
        return out
    out["df"] = (va + vb) ** 2 / (va * va / (len(ga) - 1) + vb * vb / (len(gb) - 1))
    out["ci95"] = interval(out["mean"], math.sqrt(va + vb), out["df"])
    return out


def rank_rule(figure: str = "bytes to target", less: str = "fewer bytes") -> str:
    """:func:`rank`'s rule in words, for the quantity ranked (``figure``) and
    which way is better (``less``): ``gradpress compare`` ranks by bytes to
    target, ``gradpress bench e2e --seeds`` by wall-clock time to target."""
    return ("a configuration is ranked when it reached the target at every seed (at least 2); its rank is 1 + "
            f"the number of ranked configurations whose whole 95% interval of the mean {figure} lies "
            f"below its own ({less}); configurations whose intervals overlap are not separable: they may "
            "share a rank and each names the others")


RANK_RULE = rank_rule()
#: the rule of a rank by wall-clock time to target (``bench e2e --train-to --seeds``, ``compare --rank-by time``)
TIME_RANK_RULE = rank_rule("wall-clock time to target", "less time")
#: ``compare --rank-by`` choice -> (the field of :mod:`gradpress.compare_report` ranked, its rule)
RANK_RULES = {"bytes": ("bytes_to_target", RANK_RULE), "time": ("time_to_target", TIME_RANK_RULE)}


def clip(ci: Sequence[float] | None, low: float = -math.inf, high: float = math.inf
         ) -> tuple[list[float] | None, list[bool]]:
    """An interval as reported: its ends clipped to ``[low, high]``, the range the quantity can take (an
    accuracy's mean lies in [0, 1] though mean ± t s / sqrt(n) may not), and which ends were clipped
    (``[lower, upper]``). None stays None. The t interval itself (``ci95``) is kept unclipped beside it."""
    if ci is None:
        return None, [False, False]
    lo, hi = float(ci[0]), float(ci[1])
    return [min(max(lo, low), high), min(max(hi, low), high)], [not low <= lo <= high, not low <= hi <= high]


def clip_stat(st: dict[str, Any], low: float = -math.inf, high: float = math.inf) -> dict[str, Any]:
    """``st`` (a :func:`stat` or :func:`difference`) with ``ci95_reported`` (its ``ci95`` clipped to
    ``[low, high]``, :func:`clip`) and ``clipped`` (which ends were) added; ``ci95`` is left as it was."""
    st["ci95_reported"], st["clipped"] = clip(st["ci95"], low, high)
    return st


def rank(stats: Sequence[Mapping[str, Any]], seeds: int, lower_is_better: bool = True) -> list[dict[str, Any]]:
    """Per :func:`stat` (one per configuration) its ``rank`` by :data:`RANK_RULE`
    (None when unranked, ``why`` says why: seeds that did not reach the target,
    seeds whose run failed, or fewer than 2 seeds), and ``not_separable_from``: the
    indices of the other ranked ones whose interval overlaps its own. ``seeds``:
    how many seeds every configuration ran (a run that failed lowers ``n``)."""
    ranked = {}
    out: list[dict[str, Any]] = []
    for i, st in enumerate(stats):
        missed, failed = st["n"] - st["k"], seeds - st["n"]  # a failed run has no row: it lowers n
        why = "; ".join([f"not reached at {missed} of {seeds} seeds"] * (missed > 0)
                        + [f"failed at {failed} of {seeds} seeds"] * (failed > 0)) or None
        if why is None and st["ci95"] is None:
            why = "needs 2 seeds"
        elif why is None:
            ranked[i] = st["ci95"]
        out.append({"rank": None, "not_separable_from": [], "why": why})
    for i, (lo, hi) in ranked.items():
        better = [j for j, (lo2, hi2) in ranked.items() if (hi2 < lo if lower_is_better else lo2 > hi)]
        out[i]["rank"] = 1 + len(better)
        out[i]["not_separable_from"] = [j for j, (lo2, hi2) in ranked.items() if j != i and lo2 <= hi and lo <= hi2]
    return out


def fmt_interval(ci: Sequence[float] | None, f: Callable[[float], str] = lambda v: f"{v:.4f}",
                 clipped: Sequence[bool] = (False, False)) -> str:
    """``[lo, hi]`` for a table, ``-`` without an interval; an end that :func:`clip` clipped (``clipped``:
    ``[lower, upper]``) is followed by ``(clipped)``."""
    if ci is None:
        return "-"
    lo, hi = (f(v) + (" (clipped)" if c else "") for v, c in zip(ci, clipped))
    return f"[{lo}, {hi}]"


def fmt_difference(d: Mapping[str, Any], f: Callable[[float], str] = lambda v: f"{v:+.4f}") -> str:
    """A :func:`difference` for a table: its interval (as reported, when :func:`clip_stat` clipped it) and how
    it was formed (``paired by seed (n)`` or ``Welch (n_a vs n_b seeds)``), ``-`` without one."""
    if d["ci95"] is None:
        return "-"
    cell = fmt_interval(d.get("ci95_reported", d["ci95"]), f, d.get("clipped", (False, False)))
    if d["kind"] == "paired":
        return f"{cell} paired by seed ({d['n']})"
    return f"{cell} Welch ({d['n_a']} vs {d['n_b']} seeds)"


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
