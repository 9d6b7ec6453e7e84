"""``gradpress bench e2e --train-to T --seeds N``: the time-to-accuracy
benchmark once per seed (each in ``DIR/seed<S>/``, a full report of its
own), then one table over seeds, with the statistics of
:mod:`gradpress.compare_stats` (the same as ``gradpress compare``): mean ±
std [min, max] of time, steps to target, best and final metric per
configuration; a seed that misses the target counts as ``not reached (k of
N)``. Speed-up vs DDP is computed per seed (DDP's time / the configuration's
time, on the seeds where both reached the target) and then summarized.

Intervals and rank, as ``gradpress compare --seeds`` (the same functions):
the 95% confidence interval of the mean time to target and of the mean final
metric (:func:`compare_stats.stat`), the interval of the mean time
difference to plain DDP, the speed-up's reference
(:func:`compare_stats.difference`: paired by seed when both reached the
target at the same seeds, else Welch), and the rank by wall-clock time to
target (:func:`compare_stats.rank`, :data:`RANK_RULE`): configurations that
missed the target or failed at some seed are unranked and counted. The
plot's error bars are the same interval."""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path
from typing import Any

from gradpress import compare_stats
from gradpress.bench.e2e_report import reach_sign

__all__ = ["run_seeds", "combine", "table", "markdown", "bars", "caption", "plot", "RANK_RULE"]


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


#: the figure the table ranks by, and which way is better (the rule of ``gradpress compare --rank-by time``)
RANK_RULE = compare_stats.TIME_RANK_RULE


def combine(results: list[dict[str, Any]], seeds: list[int], command: str) -> dict[str, Any]:
    """One result over seeds from the per-seed results of :func:`run_e2e`:
    per configuration a :func:`compare_stats.stat` per field; ``vs_reference``,
    :func:`compare_stats.difference` of its time to target and the reference's
    (plain DDP when the command ran it first, as the speed-up's; None without
    one); ``rank`` by time to target (:data:`RANK_RULE`; None: unranked,
    ``rank_note`` says why) and ``not_separable_from`` (labels)."""
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
    time = FIELDS["time_to_target_s"]
    ref = groups[0] if groups and groups[0]["rows"][0]["kind"] == "ddp" else None  # e2e_run's speed-up reference
    for a, g in zip(agg, groups):
        a["vs_reference"] = None if ref is None else compare_stats.difference(
            {r["seed"]: time(r) for r in g["rows"]}, {r["seed"]: time(r) for r in ref["rows"]})
    for a, r in zip(agg, compare_stats.rank([a["time_to_target_s"] for a in agg], len(seeds))):
        a.update(rank=r["rank"], rank_note=_rank_note(a, r["why"], len(seeds)),
                 not_separable_from=[agg[j]["label"] for j in r["not_separable_from"]])
    first = results[0]
    return {"mode": "train", "command": command, "target": first["target"], "seeds": seeds,
            "reference": None if ref is None else ref["key"], "rank_rule": RANK_RULE,
            "setup": {**first["setup"], "seed": None, "seeds": seeds}, "aggregate": agg,
            "per_seed": [{"seed": s, "rows": res["rows"], "notes": res.get("notes", [])} for s, res in zip(seeds, results)],
            "notes": first.get("notes", []), "seconds": sum(r.get("seconds", 0.0) for r in results)}


def _rank_note(a: dict[str, Any], why: str | None, seeds: int) -> str | None:
    """Why a configuration is unranked, a failed run told apart from a missed target."""
    if why is None or not a["failed"]:
        return why
    missed = seeds - a["time_to_target_s"]["k"] - a["failed"]
    return f"failed at {a['failed']} of {seeds} seeds" + (f", not reached at {missed}" if missed > 0 else "")


def _order(agg: list[dict[str, Any]]) -> list[int]:
    """Rank order, unranked last in the order they ran."""
    return sorted(range(len(agg)), key=lambda i: (agg[i]["rank"] is None, agg[i]["rank"] or 0, i))


def table(result: dict[str, Any]) -> list[str]:
    """The Markdown table over seeds, in rank order (see :func:`markdown`)."""
    from gradpress.bench.e2e_report import human_bytes

    n = len(result["seeds"])
    ref = result.get("reference")
    head = ["configuration", "time to target (s)", "time to target: 95% CI of the mean (t, n-1 df)"]
    head += [f"vs {ref}: 95% CI of the mean time difference (s)"] if ref is not None else []
    head += ["rank (time to target)", "not separable from", "steps to target", "best metric", "final metric",
             "final metric: 95% CI of the mean (t, n-1 df)", "speed-up vs DDP (per seed)", "payload B/step/worker"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    agg = result["aggregate"]
    for g in (agg[i] for i in _order(agg)):
        fail = f" ({g['failed']} of {n} failed)" if g["failed"] else ""
        cells = [g["label"] + fail, compare_stats.fmt(g["time_to_target_s"], lambda v: f"{v:.2f}"),
                 compare_stats.fmt_interval(g["time_to_target_s"]["ci95"], lambda v: f"{v:.2f}")]
        if ref is not None:
            cells.append("reference" if g["label"] == ref
                         else compare_stats.fmt_difference(g["vs_reference"], lambda v: f"{v:+.2f}"))
        cells += [str(g["rank"]) if g["rank"] is not None else f"- ({g['rank_note']})",
                  ", ".join(f"`{o}`" for o in g["not_separable_from"]) or "-",
                  compare_stats.fmt(g["steps_to_target"], lambda v: f"{v:.0f}"),
                  compare_stats.fmt(g["best_metric"], missing="-"),
                  compare_stats.fmt(g["final_metric"], missing="-"),
                  compare_stats.fmt_interval(g["final_metric"]["ci95"]),
                  compare_stats.fmt(g["speedup"], lambda v: f"{v:.2f}x", missing="-"),
                  human_bytes(g["payload_bytes_per_step"]["mean"])]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def markdown(result: dict[str, Any]) -> str:
    from gradpress.bench.e2e_report import lr_text

    s = result["setup"]
    n = len(result["seeds"])
    ref = result.get("reference")
    agg = result["aggregate"]
    unranked = sum(1 for g in agg if g["rank"] is None)
    vs = (f"The difference to `{ref}` (the reference of the speed-up): the configuration's time minus the "
          "reference's (negative: faster), paired by seed (the interval of the mean per-seed difference) when "
          "both reached the target at the same seeds, else Welch's unpaired interval; each cell says which. "
          if ref is not None else "No plain DDP ran first: no difference to a reference. ")
    lines = [f"# gradpress bench e2e (train, {n} seeds)", "", "Command:", "", "```", result["command"], "```", "",
             f"{s['nodes']} nodes, {s['bandwidth']} per link direction ({s['bandwidth_bits']:,} bit/s), "
             f"workload {s['workload']} ({s['parameters']:,} parameters), batch {s['batch_size']} per worker, "
             f"{s['optimizer']} {lr_text(s['lr'], [g['label'] for g in agg])}, "
             f"{s['threads']} thread(s) per worker, "
             f"torch {s['torch']}, {s['cpus']} CPU(s). Seeds: {', '.join(map(str, result['seeds']))}.", "",
             f"Target: {s['metric']} {reach_sign(s)} {result['target']} (evaluated every {s['eval_every']} steps; the clock stops "
             "while evaluating). Over seeds: mean ± sample std [min, max]; time and steps over the seeds that "
             "reached the target, `not reached (k of N)` counts the others. Speed-up vs DDP: per seed (DDP's time / "
             "this configuration's, where both reached), then summarized.", "",
             "Intervals: the 95% confidence interval of the mean over the seeds with a value, mean ± t(0.975, n-1) "
             "x sample std / sqrt(n) (Student t, n-1 degrees of freedom; none below 2 values). " + vs
             + "Rank by wall-clock time to target: " + result.get("rank_rule", RANK_RULE) + ". Rows are in rank "
             "order, unranked ones last; the plot's error bars are the same intervals.", ""]
    lines += table(result)
    lines += ["", f"Unranked: {unranked} of {len(agg)} configurations (the target missed or the run failed at some "
              "seed)." if unranked else f"Every configuration ranked ({len(agg)}).",
              "", "Per seed: `seed<S>/e2e.md` next to this file."]
    if result.get("notes"):
        lines += ["", "Notes:", ""] + [f"- {t}" for t in result["notes"]]
    return "\n".join(lines) + "\n"


def bars(result: dict[str, Any]) -> list[dict[str, Any]]:
    """What :func:`plot` draws per configuration, in run order: ``mean`` time
    to target over the seeds that reached it (None: none did), the error
    bar ``lo``..``hi`` = the table's 95% interval of the mean (None below 2
    values), ``hatched`` when some seed missed or failed, and its ``rank``."""
    out = []
    for g in result["aggregate"]:
        t = g["time_to_target_s"]
        ci = t["ci95"]
        out.append({"label": g["label"], "kind": g["kind"], "mean": t["mean"], "lo": ci[0] if ci else None,
                    "hi": ci[1] if ci else None, "k": t["k"], "n": t["n"], "hatched": t["k"] < t["n"],
                    "failed": g["failed"], "rank": g.get("rank")})
    return out


def caption(result: dict[str, Any]) -> str:
    """The plot's caption: what a bar, its error bar and its hatching are."""
    return ("bar = mean time to target over the seeds that reached it;\nerror bars: 95% confidence interval of the "
            "mean (t, n-1 df); hatched: a seed missed the target or failed (unranked)")


def plot(result: dict[str, Any], path: str | Path) -> Path:
    """Bars: mean time to target over the seeds that reached it, error bars
    the 95% interval of the mean (:func:`bars`); hatched if a seed missed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = bars(result)
    s = result["setup"]
    fig, ax = plt.subplots(figsize=(max(7.0, 1.1 * len(data) + 3), 5.5), dpi=110)
    xs = list(range(len(data)))
    for x, b in zip(xs, data):
        color = "tab:gray" if b["kind"] != "gradpress" else "tab:blue"
        if b["mean"] is None:
            ax.annotate(f"not reached\n(0 of {b['n']})", (x, 0), ha="center", va="bottom", fontsize=8)
            continue
        err = None if b["lo"] is None else [[b["mean"] - b["lo"]], [b["hi"] - b["mean"]]]
        bar = ax.bar([x], [b["mean"]], color=color, zorder=2, yerr=err, capsize=4)[0]
        if b["hatched"]:
            bar.set_hatch("//")
            bar.set_alpha(0.5)
        note = f"{b['mean']:.1f}s" + (f", rank {b['rank']}" if b["rank"] is not None else ", unranked")
        missed = b["n"] - b["k"] - b["failed"]
        gone = [f"{missed} of {b['n']} missed"] * (missed > 0) + [f"{b['failed']} of {b['n']} failed"] * (b["failed"] > 0)
        note += "".join("\n" + t for t in gone)
        ax.annotate(note, (x, b["hi"] if b["hi"] is not None else b["mean"]), textcoords="offset points",
                    xytext=(0, 3), ha="center", va="bottom", fontsize=8)
    ax.set_ylabel(f"wall-clock seconds to {s['metric']} {reach_sign(s)} {result['target']} (mean, 95% CI)")
    ax.set_title(f"time to target over {len(result['seeds'])} seeds, {s['workload']}, {s['nodes']} nodes, "
                 f"{s['bandwidth']}\n{caption(result)}", fontsize=9)
    ax.set_xticks(xs)
    ax.set_xticklabels([b["label"] for b in data], rotation=25, ha="right", fontsize=8)
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
