"""``gradpress compare``: train the same workload with several algorithms
and compressors (their cross product), one run after another (same seed,
same data, same workers), and report final metric, bytes on the wire, step
time and how fast each reaches a target.

Algorithms (``--algorithms``, default ``ddp``) and compressors
(``--compressors``, default: each algorithm's own default compressor) use
the spec syntax of ``gradpress train --algorithm`` / ``--compressor``.

Outputs in ``out``: ``compare.json`` (the list of training summaries, each
with ``steps_to_target``, ``bytes_to_target``, ``delta_vs_reference`` and
``target`` added), ``compare.md`` (the table) and ``compare.png`` (metric vs
step and metric vs cumulative bytes sent by rank 0, log scale). Each run's
own files are in ``out/<n>-<compressor>/`` (``out/<n>-<algorithm>-<compressor>/``
for algorithms other than ``ddp``).

Strategy: unless one is given, each compressor runs on its general
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

import json
import math
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from gradpress import train

__all__ = ["split_specs", "run", "table", "target_for", "plot", "annotate", "label"]


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
                head = piece.split(">", 1)[0]
                if current and "=" in head and ":" not in head:
                    current[-1] += "," + piece
                elif piece:
                    current.append(piece)
                else:
                    raise ValueError(f"{what}: empty entry in {item!r}")
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
    """A run's name: its compressor, prefixed ``ALGORITHM/`` unless the algorithm is ``ddp``."""
    algo = s.get("algorithm", "ddp")
    return s["compressor"] if algo == "ddp" else f"{algo}/{s['compressor']}"


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


def target_for(summaries: list[dict[str, Any]], target: float | None = None) -> float | None:
    """The target metric (see the module docstring)."""
    if target is not None:
        return float(target)
    ref = _reference(summaries)
    if ref["final_metric"] is None:
        return None
    return ref["final_metric"] * (0.95 if ref["higher_is_better"] else 1.05)


def _reached(s: Mapping[str, Any], target: float | None) -> tuple[int | None, int | None]:
    if target is None:
        return None, None
    for h in s["history"]:
        ok = h["metric"] >= target if s["higher_is_better"] else h["metric"] <= target
        if ok:
            return h["step"], h["bytes_total"]
    return None, None


def annotate(summaries: list[dict[str, Any]], target: float | None) -> list[dict[str, Any]]:
    ref = _reference(summaries)
    tgt = target_for(summaries, target)
    out = []
    for s in summaries:
        s = dict(s)
        steps, nbytes = _reached(s, tgt)
        s["target"] = tgt
        s["steps_to_target"] = steps
        s["bytes_to_target"] = nbytes
        s["reference"] = label(ref)
        s["delta_vs_reference"] = (None if s["final_metric"] is None or ref["final_metric"] is None
                                   else s["final_metric"] - ref["final_metric"])
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
    """Markdown table of annotated summaries."""
    metric = summaries[0]["metric"]
    ref = summaries[0]["reference"]
    head = ["algorithm", "compressor", f"final {metric}", f"vs {ref}", "bytes/step", "ratio", "step ms", "steps to target",
            "bytes to target"]
    rows = []
    for s in summaries:
        fm = s["final_metric"]
        d = s["delta_vs_reference"]
        rows.append([
            f"`{s.get('algorithm', 'ddp')}`",
            f"`{s['compressor']}`" + (" (nothing compressed)" if s.get("nothing_compressed") else ""),
            "-" if fm is None else f"{fm:.4f}",
            "-" if d is None else f"{d:+.4f}",
            _fmt_bytes(s["bytes_per_step"]),
            f"{s['compression_ratio']:.1f}x",
            "-" if s["median_step_s"] is None else f"{s['median_step_s'] * 1e3:.1f}",
            "not reached" if s["steps_to_target"] is None else str(s["steps_to_target"]),
            "-" if s["bytes_to_target"] is None else _fmt_bytes(s["bytes_to_target"]),
        ])
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    lines = ["| " + " | ".join(h.ljust(w) for h, w in zip(head, widths)) + " |",
             "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    lines += ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in rows]
    return "\n".join(lines)


def plot(summaries: list[dict[str, Any]], path: Path) -> None:
    """Two panels: metric vs step, metric vs cumulative bytes (log x)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metric = summaries[0]["metric"].replace("_", " ")
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2), constrained_layout=True)
    cmap = plt.get_cmap("tab10")
    tgt = summaries[0]["target"]
    for i, s in enumerate(summaries):
        hist = s["history"]
        if not hist:
            continue
        steps = [h["step"] for h in hist]
        nbytes = [max(h["bytes_total"], 1) for h in hist]
        vals = [h["metric"] for h in hist]
        style = {"color": cmap(i % 10), "marker": "o" if len(hist) <= 40 else None, "markersize": 3, "linewidth": 1.6}
        name = f"{label(s)} ({s['compression_ratio']:.0f}x)" if s["compression_ratio"] >= 1.5 else label(s)
        a1.plot(steps, vals, label=name, **style)
        a2.plot(nbytes, vals, label=name, **style)
    for ax in (a1, a2):
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
    if tgt is not None:
        a1.text(0.99, tgt, "target", transform=a1.get_yaxis_transform(), ha="right", va="bottom", color="0.4", fontsize=8)
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
                # every eligible tensor through the compressor (allreduce if summable, else
                # allgather): "auto" may plan compression away on a fast link
                per_run["strategy"] = "collective"
            cfg = train.make_config(per_run, algorithm=algo, compressor=spec)
            name = _slug(cfg.compressor) if cfg.algorithm == "ddp" else f"{_slug(cfg.algorithm)}-{_slug(cfg.compressor)}"
            cfg.out = str(root / f"{len(configs)}-{name}")
            configs.append(cfg)
    return configs


def run(compressors: str | Iterable[str] | None, options: Mapping[str, Any] | None = None, *,
        out: str = "runs/compare", target: float | None = None,
        algorithms: str | Iterable[str] | None = None) -> list[dict[str, Any]]:
    """Train ``options`` (training options, as for :func:`gradpress.train.run`)
    once per (algorithm, compressor) pair; write the three files; return
    annotated summaries. ``compressors`` None: each algorithm's default;
    ``algorithms`` None: ``ddp``."""
    opts = dict(options or {})
    for key in ("algorithm", "compressor", "resume"):
        if key in opts:
            raise ValueError(f"{key}: not a compare option (compare sets it per run)")
    if not compressors and not algorithms:
        raise ValueError("compressors: give at least one compressor or algorithm spec, e.g. "
                         "--compressors none,fp16,topk:ratio=0.01 or --algorithms ddp,localsgd:period=8")
    if target is not None and (isinstance(target, bool) or not isinstance(target, (int, float))
                               or not math.isfinite(target)):
        raise ValueError(f"target must be a finite number, got {target!r}")
    root = Path(out)
    configs = _plan_runs(compressors, algorithms, opts, root)  # validate everything before training anything
    summaries = []
    for cfg in configs:
        summaries.append(train.run(cfg))
    result = annotate(summaries, target)
    root.mkdir(parents=True, exist_ok=True)
    (root / "compare.json").write_text(json.dumps(result, indent=2) + "\n")
    s0 = result[0]
    tgt = s0["target"]
    rule = "given with --target" if target is not None else (
        f"{'95' if s0['higher_is_better'] else '105'}% of the `{s0['reference']}` run's final {s0['metric']}")
    md = [
        f"# gradpress compare: {s0['workload']}",
        "",
        f"{s0['world_size']} worker(s), {s0['steps']} steps, batch {s0['batch_size']} per worker, "
        f"{s0['optimizer']} lr {s0['lr']}, seed {s0['seed']}. Bytes are those rank 0 handed to collectives "
        f"(strategies: {', '.join(sorted({s['strategy'] for s in result}))}; "
        f"algorithms: {', '.join(dict.fromkeys(s.get('algorithm', 'ddp') for s in result))}).",
        f"Target {s0['metric']}: {'-' if tgt is None else f'{tgt:.4f}'} ({rule}).",
        "",
        table(result),
        "",
        "![metric vs step and bytes](compare.png)",
        "",
    ]
    (root / "compare.md").write_text("\n".join(md))
    plot(result, root / "compare.png")
    return result
