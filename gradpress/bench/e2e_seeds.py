"""``gradpress bench e2e --train-to T --seeds N``: the time-to-accuracy
benchmark once per seed (each in ``DIR/seed<S>/``, a full report of its
own), then one table over seeds, with the statistics of
:mod:`gradpress.compare_stats` (the same as ``gradpress compare``): mean ±
std [min, max] of time, steps to target and best metric per configuration;
a seed that misses the target counts as ``not reached (k of N)``.
Speed-up vs DDP is computed per seed (DDP's time / the configuration's
time, on the seeds where both reached the target) and then summarized."""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path
from typing import Any

from gradpress import compare_stats
from gradpress.bench.e2e_report import reach_sign

__all__ = ["run_seeds", "combine", "markdown", "plot"]


def _reached(field: str):
    return lambda r: r.get(field) if r.get("ok") and r.get("reached") else None


FIELDS = {
    "time_to_target_s": _reached("time_to_target_s"),
    "steps_to_target": _reached("steps_to_target"),
    "best_metric": lambda r: r.get("best_metric") if r.get("ok") else None,
    "final_metric": lambda r: r.get("final_metric") if r.get("ok") else None,
    "payload_bytes_per_step": lambda r: r.get("payload_bytes_per_step") if r.get("ok") else None,
    "speedup": lambda r: r.get("speedup") if r.get("ok") else None,
}


def combine(results: list[dict[str, Any]], seeds: list[int], command: str) -> dict[str, Any]:
    """One result over seeds from the per-seed results of :func:`run_e2e`."""
    rows = []
    for seed, res in zip(seeds, results):
        rows += [{**r, "seed": seed} for r in res["rows"]]
    groups = compare_stats.group(rows, lambda r: r["label"], FIELDS)
    agg = []
    for g in groups:
        r0 = g["rows"][0]
        agg.append({"label": g["key"], "kind": r0["kind"], "spec": r0.get("spec"), "seeds": g["seeds"],
                    "failed": sum(1 for r in g["rows"] if not r.get("ok")),
                    **{k: g[k] for k in FIELDS}})
    first = results[0]
    return {"mode": "train", "command": command, "target": first["target"], "seeds": seeds,
            "setup": {**first["setup"], "seed": None, "seeds": seeds}, "aggregate": agg,
            "per_seed": [{"seed": s, "rows": res["rows"], "notes": res.get("notes", [])} for s, res in zip(seeds, results)],
            "notes": first.get("notes", []), "seconds": sum(r.get("seconds", 0.0) for r in results)}


def markdown(result: dict[str, Any]) -> str:
    from gradpress.bench.e2e_report import human_bytes, lr_text

    s = result["setup"]
    n = len(result["seeds"])
    lines = [f"# gradpress bench e2e (train, {n} seeds)", "", "Command:", "", "```", result["command"], "```", "",
             f"{s['nodes']} nodes, {s['bandwidth']} per link direction ({s['bandwidth_bits']:,} bit/s), "
             f"workload {s['workload']} ({s['parameters']:,} parameters), batch {s['batch_size']} per worker, "
             f"{s['optimizer']} {lr_text(s['lr'], [g['label'] for g in result['aggregate']])}, "
             f"{s['threads']} thread(s) per worker, "
             f"torch {s['torch']}, {s['cpus']} CPU(s). Seeds: {', '.join(map(str, result['seeds']))}.", "",
             f"Target: {s['metric']} {reach_sign(s)} {result['target']} (evaluated every {s['eval_every']} steps; the clock stops "
             "while evaluating). Over seeds: mean ± sample std [min, max]; time and steps over the seeds that "
             "reached the target, `not reached (k of N)` counts the others. Speed-up vs DDP: per seed (DDP's time / "
             "this configuration's, where both reached), then summarized.", "",
             "| configuration | time to target (s) | steps to target | best metric | speed-up vs DDP (per seed) "
             "| payload B/step/worker |", "|---|---|---|---|---|---|"]
    for g in result["aggregate"]:
        fail = f" ({g['failed']} of {n} failed)" if g["failed"] else ""
        lines.append(
            f"| {g['label']}{fail} | {compare_stats.fmt(g['time_to_target_s'], lambda v: f'{v:.2f}')} "
            f"| {compare_stats.fmt(g['steps_to_target'], lambda v: f'{v:.0f}')} "
            f"| {compare_stats.fmt(g['best_metric'], missing='-')} "
            f"| {compare_stats.fmt(g['speedup'], lambda v: f'{v:.2f}x', missing='-')} "
            f"| {human_bytes(g['payload_bytes_per_step']['mean'])} |")
    lines += ["", "Per seed: `seed<S>/e2e.md` next to this file."]
    if result.get("notes"):
        lines += ["", "Notes:", ""] + [f"- {t}" for t in result["notes"]]
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: str | Path) -> Path:
    """Bars: mean time to target over the seeds that reached it, min-max error bars; hatched if a seed missed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    agg = result["aggregate"]
    s = result["setup"]
    fig, ax = plt.subplots(figsize=(max(7.0, 1.1 * len(agg) + 3), 5.5), dpi=110)
    xs = list(range(len(agg)))
    for x, g in zip(xs, agg):
        t = g["time_to_target_s"]
        color = "tab:gray" if g["kind"] != "gradpress" else "tab:blue"
        if t["k"] == 0:
            ax.annotate(f"not reached\n(0 of {t['n']})", (x, 0), ha="center", va="bottom", fontsize=8)
            continue
        bar = ax.bar([x], [t["mean"]], color=color, zorder=2,
                     yerr=[[t["mean"] - t["min"]], [t["max"] - t["mean"]]], capsize=4)[0]
        if t["k"] < t["n"]:
            bar.set_hatch("//")
            bar.set_alpha(0.5)
        note = f"{t['mean']:.1f}s" + (f"\n{t['n'] - t['k']} of {t['n']} missed" if t["k"] < t["n"] else "")
        ax.annotate(note, (x, t["max"]), textcoords="offset points", xytext=(0, 3), ha="center", va="bottom",
                    fontsize=8)
    ax.set_ylabel(f"wall-clock seconds to {s['metric']} {reach_sign(s)} {result['target']} (mean, min-max)")
    ax.set_title(f"time to target over {len(result['seeds'])} seeds, {s['workload']}, {s['nodes']} nodes, "
                 f"{s['bandwidth']}")
    ax.set_xticks(xs)
    ax.set_xticklabels([g["label"] for g in agg], rotation=25, ha="right", fontsize=8)
    ax.grid(True, axis="y", alpha=0.3, zorder=0)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path


def run_seeds(args: argparse.Namespace, seeds: list[int], command: str) -> tuple[dict[str, Any], bool]:
    """Run the benchmark at each seed (``DIR/seed<S>/``); return the combined result and whether every run was ok."""
    from gradpress.bench.e2e import write_outputs
    from gradpress.bench.e2e_run import run_e2e

    out = Path(args.out)
    results = []
    for seed in seeds:
        a = copy.copy(args)
        a.seed, a.seeds, a.out = seed, None, str(out / f"seed{seed}")
        res = run_e2e(a)
        write_outputs(res, Path(a.out))
        results.append(res)
    combined = combine(results, seeds, command)
    out.mkdir(parents=True, exist_ok=True)
    (out / "e2e.json").write_text(json.dumps(combined, indent=2) + "\n")
    (out / "e2e.md").write_text(markdown(combined))
    plot(combined, out / "e2e.png")
    return combined, all(r["ok"] for res in results for r in res["rows"])
