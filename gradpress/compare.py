"""``gradpress compare``: train the same workload with several algorithms
and compressors (their cross product), one run after another (same seed,
same data, same workers), and report final metric, bytes on the wire, step
time and how fast each reaches a target.

Algorithms (``--algorithms``, default ``ddp``) and compressors
(``--compressors``, default: each algorithm's own default compressor) use
the spec syntax of ``gradpress train --algorithm`` / ``--compressor``.

Outputs in ``out``: ``compare.json`` (the list of training summaries, one
per configuration and seed, each with ``steps_to_target``,
``bytes_to_target``, ``time_to_target``, ``delta_vs_reference``,
``target`` and ``status`` ``finished`` added; a run that failed is its
:func:`gradpress.compare_run.failure` record there, ``status`` ``failed``), ``compare-stats.json`` (per configuration: mean, std,
min, max over seeds; the learning rates used; the sweep), ``sweep.json``
(with ``--lr-sweep``), ``compare.md`` (the tables) and ``compare.png``
(metric vs step and metric vs cumulative bytes sent by rank 0, log scale;
over several seeds the mean with a band: the 95% confidence interval of
the mean, the table's interval).

Seeds (``--seeds N`` or ``--seeds 0,1,2``): every configuration at every
seed; the table gives mean ± std [min, max] over seeds and counts the seeds
that miss the target (``not reached (k of N)``), the 95% confidence
intervals of the mean final metric and of the difference to the reference
(paired by seed; reported within the metric's range) and a rank by bytes to target
(:data:`gradpress.compare_stats.RANK_RULE`) or, ``rank_by="time"``, by wall-clock time to
target, see :mod:`gradpress.compare_report`. An interrupted compare continues with
``resume`` (:mod:`gradpress.compare_resume`). Learning rate: all methods
share one (the table says which) unless ``--lr-sweep`` picks one per method
(see :mod:`gradpress.compare_run`). Each run's
own files are in ``out/<n>-<compressor>/`` (``out/<n>-<algorithm>-<compressor>/``
for algorithms other than ``ddp``).

Strategy: unless one is given (option or ``--config`` file), each compressor runs on its general
strategy (``collective``: allreduce if summable, else allgather),
not ``auto``, whose planner may decide that compressing does not pay on a
fast link and leave every tensor dense.

Target: ``target`` if given; otherwise 95% of the reference run's final
metric for metrics where higher is better (accuracy), 105% for lower-is-
better ones (bits per character). The reference is the ``ddp`` run with
compressor ``none`` if there is one, else the first ``none`` run, else the
first run. A run reaches the target at its first
evaluation point at or beyond it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from gradpress import train
from gradpress.compress.spec import append_piece
from gradpress.train.algorithm import shown

__all__ = ["split_specs", "run", "table", "target_for", "plot", "annotate", "label", "curve"]


def split_specs(values: str | Iterable[str], what: str = "compressors") -> list[str]:
    """``"none,fp16,qsgd:levels=16,bucket=512,topk:ratio=0.01"`` ->
    ``["none", "fp16", "qsgd:levels=16,bucket=512", "topk:ratio=0.01"]``.

    A comma starts a new spec unless the next piece is a ``key=value``
    parameter of the previous one (it has ``=`` and no ``:`` before its
    first ``>``). ``;`` always separates. A list of strings is split item by
    item (``--compressors`` may be repeated). ``what`` names the option in
    errors (``compressors`` or ``algorithms``)."""
    items = [values] if isinstance(values, str) else list(values)
    specs: list[str] = []
    for item in items:
        if not isinstance(item, str):
            raise ValueError(f"{what} must be strings, got {item!r}")
        for group in item.split(";"):
            current: list[str] = []
            for piece in group.split(","):
                piece = piece.strip()
                if not piece:
                    raise ValueError(f"{what}: empty entry in {item!r}")
                append_piece(current, piece, what, item)
            specs.extend(current)
    if not specs:
        example = "none,fp16,topk:ratio=0.01" if what == "compressors" else "ddp,localsgd:period=8"
        raise ValueError(f"{what}: give at least one spec, e.g. {example}")
    dupes = sorted({s for s in specs if specs.count(s) > 1})
    if dupes:
        raise ValueError(f"{what}: {', '.join(dupes)} listed more than once")
    return specs


def _slug(spec: str) -> str:
    return re.sub(r"[^A-Za-z0-9._=-]+", "_", spec).strip("_") or "run"


def label(s: Mapping[str, Any]) -> str:
    """A run's name: its compressor, prefixed ``ALGORITHM/`` unless the algorithm is ``ddp``; the algorithm
    without its defaults (:func:`gradpress.train.algorithm.shown`: one name per canonical spec, so runs group
    as before), the compressor as the run recorded it."""
    algo = s.get("algorithm", "ddp")
    return s["compressor"] if algo == "ddp" else f"{shown(algo)}/{s['compressor']}"


def _is_identity(spec: str) -> bool:
    """Whether ``spec`` names the identity compressor (the dense baseline)."""
    from gradpress.compress import create

    try:
        return create(spec).identity
    except ValueError:
        return False


def _reference(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    nones = [s for s in summaries if _is_identity(s["compressor"])]
    for s in nones:
        if s.get("algorithm", "ddp") == "ddp":
            return s
    return nones[0] if nones else summaries[0]


def _ref_runs(summaries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The reference configuration's runs (one per seed)."""
    name = label(_reference(summaries))
    return [s for s in summaries if label(s) == name]


def final(s: Mapping[str, Any]) -> float | None:
    """A run's final metric; None where it has none: NaN/Inf, or a loss that became NaN/Inf (the run stopped
    early, or went on with NaN weights, keeping the finite metric of its last evaluation)."""
    fm = s["final_metric"]
    return None if fm is None or not math.isfinite(fm) or s.get("diverged_at_step") is not None else fm


def _mean_final(runs: list[dict[str, Any]]) -> float | None:
    vals = [v for v in map(final, runs) if v is not None]
    return sum(vals) / len(vals) if vals else None


def target_for(summaries: list[dict[str, Any]], target: float | None = None) -> float | None:
    """The target metric (see the module docstring; over several seeds, of
    the reference's mean final metric)."""
    if target is not None:
        return float(target)
    ref = _reference(summaries)
    mean = _mean_final(_ref_runs(summaries))
    if mean is None:
        return None
    return mean * (0.95 if ref["higher_is_better"] else 1.05)


def _reached(s: Mapping[str, Any], target: float | None) -> tuple[int | None, int | None, float | None]:
    """(step, cumulative bytes, training clock in seconds) at the first evaluation at or beyond ``target``;
    the clock None where the history has none (a summary written before train recorded it)."""
    if target is None:
        return None, None, None
    for h in s["history"]:
        ok = h["metric"] >= target if s["higher_is_better"] else h["metric"] <= target
        if ok:
            return h["step"], h["bytes_total"], h.get("seconds")
    return None, None, None


def annotate(summaries: list[dict[str, Any]], target: float | None) -> list[dict[str, Any]]:
    """Each summary plus ``target``, ``steps_to_target``, ``bytes_to_target``,
    ``time_to_target`` (wall-clock seconds of training to that evaluation: the sum of the step times before
    it, evaluations not counted, as ``bench e2e --train-to`` measures it; the history's ``seconds``),
    ``reference`` and ``delta_vs_reference`` (vs the reference run with the
    same seed, else the reference's mean)."""
    ref = _reference(summaries)
    refs = _ref_runs(summaries)
    ref_by_seed = {r.get("seed"): final(r) for r in refs}
    ref_mean = _mean_final(refs)
    tgt = target_for(summaries, target)
    out = []
    for s in summaries:
        s = dict(s)
        steps, nbytes, seconds = _reached(s, tgt)
        s["target"] = tgt
        s["steps_to_target"] = steps
        s["bytes_to_target"] = nbytes
        s["time_to_target"] = seconds
        s["reference"] = label(ref)
        base = ref_by_seed.get(s.get("seed"), ref_mean) if len(refs) > 1 else final(ref)
        s["delta_vs_reference"] = None if final(s) is None or base is None else final(s) - base
        out.append(s)
    return out


def _fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return "-"


def table(summaries: list[dict[str, Any]]) -> str:
    """Markdown table of annotated summaries; a failed run's record
    (``status`` ``failed``, :func:`gradpress.compare_run.failure`) is a row
    that says ``failed (exit N)``. At least one summary must be a finished run."""
    first = next(s for s in summaries if s.get("status") != "failed")
    metric = first["metric"]
    ref = first["reference"]
    seeds = len({s.get("seed") for s in summaries}) > 1
    lrs = len({s.get("lr") for s in summaries}) > 1
    head = ["algorithm", "compressor"] + (["seed"] if seeds else []) + (["lr"] if lrs else []) + [f"final {metric}", f"vs {ref}", "bytes/step", "ratio", "step ms", "steps to target",
            "bytes to target", "time to target (s)"]
    rows = []
    for s in summaries:
        if s.get("status") == "failed":
            rows.append([f"`{shown(s.get('algorithm', 'ddp'))}`", f"`{s['compressor']}`",
                         *([str(s.get("seed"))] if seeds else []), *([f"{s['lr']:g}"] if lrs else []),
                         f"failed (exit {s['exit_code']})"] + ["-"] * 7)
            continue
        fm = s["final_metric"]
        d = s["delta_vs_reference"]
        rows.append([
            f"`{shown(s.get('algorithm', 'ddp'))}`",
            f"`{s['compressor']}`" + (" (nothing compressed)" if s.get("nothing_compressed") else "")
            + ("" if s.get("diverged_at_step") is None else f" (diverged at step {s['diverged_at_step']})"),
            *([str(s.get("seed"))] if seeds else []), *([f"{s['lr']:g}"] if lrs else []),
            "-" if fm is None else f"{fm:.4f}",
            "-" if d is None else f"{d:+.4f}",
            _fmt_bytes(s["bytes_per_step"]),
            f"{s['compression_ratio']:.1f}x",
            "-" if s["median_step_s"] is None else f"{s['median_step_s'] * 1e3:.1f}",
            "not reached" if s["steps_to_target"] is None else str(s["steps_to_target"]),
            "-" if s["bytes_to_target"] is None else _fmt_bytes(s["bytes_to_target"]),
            "-" if s.get("time_to_target") is None else f"{s['time_to_target']:.2f}",
        ])
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    lines = ["| " + " | ".join(h.ljust(w) for h, w in zip(head, widths)) + " |",
             "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    lines += ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in rows]
    return "\n".join(lines)


def curve(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One configuration's runs (one per seed) as a curve: at the evaluation
    ``steps`` all of them share, the ``mean`` metric, the mean cumulative
    ``bytes`` (at least 1, for a log axis) and the band ``lo``/``hi``: the 95%
    confidence interval of the mean (:func:`gradpress.compare_stats.stat`, the
    table's interval, clipped as the table reports it to the metric's range,
    :func:`gradpress.workloads.metric_range`); ``lo``/``hi`` None below two runs."""
    from gradpress import compare_stats, workloads

    steps = sorted(set.intersection(*({h["step"] for h in s["history"]} for s in runs)))
    at = [{h["step"]: h for h in s["history"]} for s in runs]
    vals = [[a[t]["metric"] for a in at] for t in steps]
    nbytes = [max(sum(a[t]["bytes_total"] for a in at) / len(at), 1) for t in steps]
    out: dict[str, Any] = {"steps": steps, "mean": [sum(v) / len(v) for v in vals], "bytes": nbytes,
                           "lo": None, "hi": None}
    if len(runs) > 1:
        sts = [compare_stats.stat(v) for v in vals]
        # a step where some seed's metric is not finite has no mean and no interval: no band there (NaN leaves
        # a gap, as in the mean line); stat alone would give the interval of the other seeds
        low, high = workloads.metric_range(runs[0]["metric"])
        cis = [compare_stats.clip(st["ci95"], low, high)[0] if st["k"] == st["n"] else None for st in sts]
        out["lo"] = [math.nan if c is None else c[0] for c in cis]
        out["hi"] = [math.nan if c is None else c[1] for c in cis]
    return out


#: the note in each panel of a plot with no finite point to draw
NO_CURVE = "no finite {metric} to plot:\nevery run diverged or has no evaluation\n(the table and compare.json have the runs)"


def plot(summaries: list[dict[str, Any]], path: Path) -> None:
    """Two panels: metric vs step, metric vs cumulative bytes (log x). Runs
    of one configuration at several seeds: their mean, and a shaded band,
    the 95% confidence interval of the mean (:func:`curve`). No finite point
    at all (every run diverged): the panels empty, with :data:`NO_CURVE`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metric = summaries[0]["metric"].replace("_", " ")
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2), constrained_layout=True)
    cmap = plt.get_cmap("tab10")
    tgt = summaries[0]["target"]
    groups: dict[str, list[dict[str, Any]]] = {}
    for s in summaries:
        if s["history"]:
            groups.setdefault(label(s), []).append(s)
    drawn = False  # some curve has a finite point
    for i, (name, runs) in enumerate(groups.items()):
        # over seeds: the mean curve at the evaluation steps all runs share, the 95% interval of the mean around it
        c = curve(runs)
        steps, mean, nbytes = c["steps"], c["mean"], c["bytes"]
        s = runs[0]
        style = {"color": cmap(i % 10), "marker": "o" if len(steps) <= 40 else None, "markersize": 3, "linewidth": 1.6}
        name = f"{name} ({s['compression_ratio']:.0f}x)" if s["compression_ratio"] >= 1.5 else name
        if len(runs) > 1:
            name += f", {len(runs)} seeds"
        a1.plot(steps, mean, label=name, **style)
        a2.plot(nbytes, mean, label=name, **style)
        drawn = drawn or any(math.isfinite(v) for v in mean)
        # a band with no finite end anywhere (every seed diverged) is not drawn: matplotlib's fill_between of
        # NaN alone leaves a log axis with no positive limits ("Data cannot be log-scaled") when the figure saves
        if c["lo"] is not None and any(math.isfinite(v) for v in c["lo"] + c["hi"]):
            lo, hi = c["lo"], c["hi"]
            a1.fill_between(steps, lo, hi, color=style["color"], alpha=0.18, linewidth=0)
            a2.fill_between(nbytes, lo, hi, color=style["color"], alpha=0.18, linewidth=0)
    for ax in (a1, a2):
        if not drawn:  # every run diverged before its first evaluation or has no evaluation: empty panels, said so
            ax.text(0.5, 0.5, NO_CURVE.format(metric=metric), transform=ax.transAxes, ha="center", va="center",
                    color="0.35", fontsize=9, wrap=True)
        if tgt is not None and math.isfinite(tgt):
            ax.axhline(tgt, color="0.5", linestyle="--", linewidth=1)
        ax.grid(True, alpha=0.3, which="both")
        ax.set_ylabel(f"test {metric}")
    a1.set_xlabel("training step")
    a2.set_xscale("log")
    a2.set_xlabel("cumulative bytes sent per worker (log scale)")
    s0 = summaries[0]
    workers = f"{s0['world_size']} worker{'s' if s0['world_size'] != 1 else ''}"
    a1.set_title(f"{s0['workload']}, {workers}: {metric} vs step")
    a2.set_title(f"{metric} vs bytes on the wire")
    if any(len(runs) > 1 for runs in groups.values()):
        fig.suptitle("over seeds: mean, band = 95% confidence interval of the mean (t, n-1 df)", fontsize=9)
    if tgt is not None:
        a1.text(0.99, tgt, "target", transform=a1.get_yaxis_transform(), ha="right", va="bottom", color="0.4", fontsize=8)
    if groups:  # no run evaluated (e.g. every loss became NaN before the first evaluation): no curve, no legend
        a2.legend(loc="best", fontsize=8, framealpha=0.9)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plan_runs(compressors: str | Iterable[str] | None, algorithms: str | Iterable[str] | None,
               opts: Mapping[str, Any], root: Path) -> list[Any]:
    """Every (algorithm, compressor) pair as a validated training config."""
    algos = split_specs(algorithms, "algorithms") if algorithms else ["ddp"]
    specs: list[str | None] = list(split_specs(compressors)) if compressors else [None]
    configs = []
    for algo in algos:
        for spec in specs:
            per_run = dict(opts)
            if per_run.get("strategy") is None:
                # the --config file's strategy, else train's default "collective" (every eligible tensor
                # through the compressor; "auto" may plan compression away on a fast link). Filling in
                # "collective" here replaced a strategy the file gave.
                per_run.pop("strategy", None)
            cfg = train.make_config(per_run, algorithm=algo, compressor=spec)
            name = _slug(cfg.compressor) if cfg.algorithm == "ddp" else f"{_slug(cfg.algorithm)}-{_slug(cfg.compressor)}"
            cfg.out = str(root / f"{len(configs)}-{name}")
            configs.append(cfg)
    return configs




def run(compressors: str | Iterable[str] | None, options: Mapping[str, Any] | None = None, *,
        out: str | None = None, target: float | None = None, algorithms: str | Iterable[str] | None = None,
        seeds: str | int | list[int] | None = None, lr_sweep: str | list[float] | None = None,
        sweep_steps: int | None = None, resume: bool = False, rank_by: str = "bytes") -> list[dict[str, Any]]:
    """See :func:`gradpress.compare_run.run`."""
    from gradpress import compare_run

    return compare_run.run(compressors, options, out=out, target=target, algorithms=algorithms, seeds=seeds,
                           lr_sweep=lr_sweep, sweep_steps=sweep_steps, resume=resume, rank_by=rank_by)
