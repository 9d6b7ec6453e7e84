"""Output of ``gradpress bench e2e``: the Markdown table (``e2e.md``) and the
bar chart (``e2e.png``) from the result rows (``e2e.json``).

Step mode: one bar per configuration, its median step time, with the ideal
time (compute-only + link bytes / bandwidth) as a marker; train-to mode: one
bar per configuration, its wall-clock time to the target ("not reached"
bars are hatched and drawn at the time the run stopped).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

__all__ = ["STEP_FIELDS", "TRAIN_FIELDS", "human_bytes", "markdown", "plot"]

#: fields every step-mode row carries (None where not applicable)
STEP_FIELDS = (
    "label", "kind", "spec", "strategy", "ok", "warmup", "steps", "bucket_cap_mb", "buckets",
    "median_step_s", "step_s", "speedup", "payload_bytes_per_step", "payload_source", "host_bytes_per_step",
    "link_bytes_per_step",
    "link_tx_bytes_per_step", "link_rx_bytes_per_step", "compute_s", "ideal_s", "measured_over_ideal",
    "wire_factor", "ideal_payload_s", "compress_s_per_step", "comm_s_per_step", "register_s",
    "tbf_bytes", "seconds", "error", "exchange_s_per_step", "exposed_s_per_step", "overlap", "overlap_bound_s",
    "over_bound",
)
#: fields every train-to row carries
TRAIN_FIELDS = (
    "label", "kind", "spec", "strategy", "ok", "reached", "time_to_target_s", "steps_to_target", "steps",
    "train_s", "final_metric", "best_metric", "speedup", "payload_bytes_per_step", "bucket_cap_mb", "buckets",
    "history", "seconds", "error",
)



def reach_sign(setup: dict[str, Any]) -> str:
    """How the metric reaches its target: ``>=`` (accuracy), ``<=`` (a loss, bits per character)."""
    return ">=" if setup.get("higher_is_better", True) else "<="

def _payload(row: dict) -> str:
    """The payload cell: bytes per step, and the part that stayed inside a host when there is one."""
    host = row.get("host_bytes_per_step")
    cell = human_bytes(row["payload_bytes_per_step"])
    return f"{cell} ({human_bytes(host)} in hosts)" if host else cell


def human_bytes(n: float | None) -> str:
    if n is None or (isinstance(n, float) and not math.isfinite(n)):
        return "n/a"
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} GB"


def lr_text(lr: float, labels: list[str]) -> str:
    """How the learning rate was set: shared by every configuration, or
    ``--lr`` unless a label carries its own ``+lr=`` (issue 13: a table says
    whether its methods share one rate, and which)."""
    own = [lab for lab in labels if "+lr=" in lab]
    if not own:
        return f"lr {lr:g} for every configuration"
    return f"lr {lr:g} except where a configuration names its own (+lr=, {len(own)} of {len(labels)})"


def _f(v: Any, fmt: str, suffix: str = "") -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "n/a"
    return f"{v:{fmt}}{suffix}"


def markdown(result: dict[str, Any]) -> str:
    """The whole ``e2e.md``: title, exact command, setup, table, notes."""
    s = result["setup"]
    lines = [f"# gradpress bench e2e ({result['mode']})", "", "Command:", "", "```", result["command"], "```", ""]
    per = s.get("workers_per_node", 1) or 1
    hosts = (f"{s['nodes']} hosts x {per} workers ({s['nodes'] * per} ranks; inside a host "
             f"{s.get('intra_bandwidth') or 'unshaped loopback'}), " if per > 1 else f"{s['nodes']} nodes, ")
    lines.append(f"{hosts}{s['bandwidth']} per link direction ({s['bandwidth_bits']:,} bit/s), "
                 f"workload {s['workload']} ({s['parameters']:,} parameters), batch {s['batch_size']} per worker, "
                 f"{s['optimizer']} {lr_text(s['lr'], [r['label'] for r in result['rows']])}, "
                 f"{s['threads']} thread(s) per worker, torch {s['torch']}, {s['cpus']} CPU(s).")
    lines.append("")
    if result["mode"] == "step":
        c = result["compute"]
        lines.append(f"Compute-only step (no communication, world size 1, all {s['nodes'] * per} workers at once): "
                     f"{_f(c['shared_s'], '.3f', ' s')}; alone on the machine: {_f(c['solo_s'], '.3f', ' s')}"
                     + (f"; all at once again after the last configuration: {_f(c['shared_after_s'], '.3f', ' s')}"
                        if c.get("shared_after_s") is not None else "") + ".")
        lines.append("")
        lines.append("| configuration | step (median) | speed-up vs DDP | payload B/step/worker | link B/step (busiest) "
                     "| ideal | measured/ideal | compress s/step | comm s/step | buckets |")
        lines.append("|---|---|---|---|---|---|---|---|---|---|")
        for r in result["rows"]:
            if not r["ok"]:
                lines.append(f"| {r['label']} | failed: {r['error']} | | | | | | | | |")
                continue
            label = r["label"]
            if r.get("strategy") == "auto" and r.get("plan_counts"):  # what the planner chose
                label += " (" + ", ".join(f"{k}={v}" for k, v in r["plan_counts"].items()) + ")"
            lines.append(
                f"| {label} | {_f(r['median_step_s'], '.3f', ' s')} | {_f(r['speedup'], '.2f', 'x')} "
                f"| {_payload(r)} | {human_bytes(r['link_bytes_per_step'])} "
                f"| {_f(r['ideal_s'], '.3f', ' s')} | {_f(r['measured_over_ideal'], '.2f')} "
                f"| {_f(r['compress_s_per_step'], '.3f')} | {_f(r['comm_s_per_step'], '.3f')} "
                f"| {r['buckets'] if r['buckets'] is not None else 'n/a'}"
                f"{' (bucket_cap_mb=' + str(r['bucket_cap_mb']) + ')' if r['bucket_cap_mb'] else ''} |")
        lines += ["", "- step: median wall time of one step on rank 0 over the measured steps (after warm-up; "
                  "no barrier inside a step).",
                  "- payload: bytes one worker hands to collectives per step (gradpress: the hook's stats; "
                  "PyTorch baselines: computed from the parameter shapes); \"in hosts\": the part that stays "
                  "inside a host (hierarchical's dense reduce and broadcast).",
                  "- link: bytes per step on the busiest direction of the busiest node link (Ethernet frames, "
                  "from the node's interface counters over the measured steps).",
                  "- ideal = compute-only (shared CPU) + link bytes x 8 / bandwidth.",
                  "- PyTorch's powerSGD_hook runs with one DDP bucket (bucket_cap_mb shown): on gloo it needs one.",
                  "- compress/comm s/step: the gradpress hook's compress_s and comm_s per step (rank 0)."]
        lines += _background_table(result)
    else:
        lines.append(f"Target: {s['metric']} {reach_sign(s)} {result['target']} (evaluated every {s['eval_every']} steps; "
                     "the clock stops while evaluating).")
        lines.append("")
        lines.append("| configuration | time to target | steps to target | best metric | speed-up vs DDP "
                     "| payload B/step/worker |")
        lines.append("|---|---|---|---|---|---|")
        for r in result["rows"]:
            if not r["ok"]:
                lines.append(f"| {r['label']} | failed: {r['error']} | | | | |")
                continue
            t = _f(r["time_to_target_s"], ".1f", " s") if r["reached"] else f"not reached ({_f(r['train_s'], '.1f', ' s')})"
            lines.append(f"| {r['label']} | {t} | {r['steps_to_target'] if r['reached'] else r['steps']} "
                         f"| {_f(r['best_metric'], '.4f')} | {_f(r['speedup'], '.2f', 'x')} "
                         f"| {human_bytes(r['payload_bytes_per_step'])} |")
    if result.get("notes"):
        lines += ["", "Notes:", ""] + [f"- {n}" for n in result["notes"]]
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if r["ok"]]
    s = result["setup"]
    labels = [r["label"] for r in rows]
    fig, ax = plt.subplots(figsize=(max(7.0, 1.1 * len(rows) + 3), 5.5), dpi=110)
    xs = list(range(len(rows)))
    colors = ["tab:gray" if r["kind"] != "gradpress" else "tab:blue" for r in rows]
    if result["mode"] == "step":
        ys = [r["median_step_s"] for r in rows]
        ax.bar(xs, ys, color=colors, zorder=2)
        ideal = [(x, r["ideal_s"]) for x, r in zip(xs, rows) if r["ideal_s"]]
        if ideal:
            ax.scatter([p[0] for p in ideal], [p[1] for p in ideal], marker="_", s=900, linewidths=2.5,
                       color="tab:red", zorder=3, label="ideal: compute + link bytes / bandwidth")
        for x, r in zip(xs, rows):
            text = f"{r['median_step_s']:.3g}s" + (f"\n{r['speedup']:.1f}x" if r["speedup"] else "")
            ax.annotate(text, (x, r["median_step_s"]), textcoords="offset points", xytext=(0, 3), ha="center",
                        va="bottom", fontsize=8)
        ax.set_yscale("log")
        from matplotlib.ticker import FormatStrFormatter

        ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(FormatStrFormatter("%g"))
        ax.set_ylabel("median step time (s, log scale)")
        ax.set_title(f"{s['workload']} ({s['parameters'] / 1e6:.1f}M params), {s['nodes']} nodes, {s['bandwidth']}")
        ax.legend(fontsize=8, loc="upper right")
    else:
        ys = [r["time_to_target_s"] if r["reached"] else r["train_s"] for r in rows]
        bars = ax.bar(xs, ys, color=colors, zorder=2)
        for b, x, r in zip(bars, xs, rows):
            if not r["reached"]:
                b.set_hatch("//")
                b.set_alpha(0.5)
            text = f"{r['time_to_target_s']:.1f}s" if r["reached"] else "not reached"
            ax.annotate(text, (x, b.get_height()), textcoords="offset points", xytext=(0, 3), ha="center",
                        va="bottom", fontsize=8)
        ax.set_ylabel(f"wall-clock seconds to {s['metric']} {reach_sign(s)} {result['target']}")
        ax.set_title(f"time to target, {s['workload']}, {s['nodes']} nodes, {s['bandwidth']}")
    ax.set_xticks(xs)
    ax.set_xticklabels(labels, rotation=25, ha="right", fontsize=8)
    ax.grid(True, axis="y", which="both", alpha=0.3, zorder=0)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path


def _background_table(result: dict[str, Any]) -> list[str]:
    """Rows whose exchange runs behind compute (``comprex:staleness>=1``):
    step time against the bound max(compute + compression, wire), and the
    share of the exchange time that no step waited for."""
    rows = [r for r in result["rows"] if r.get("ok") and r.get("overlap") is not None]
    if not rows:
        return []
    out = ["", "Exchanges behind compute (background thread):", "",
           "| configuration | step (median) | bound = max(compute + compress, wire) | step / bound "
           "| exchange s/step | waited s/step | overlap |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['label']} | {_f(r['median_step_s'], '.3f', ' s')} | {_f(r['overlap_bound_s'], '.3f', ' s')} "
                   f"| {_f(r['over_bound'], '.2f')} | {_f(r['exchange_s_per_step'], '.3f')} "
                   f"| {_f(r['exposed_s_per_step'], '.3f')} | {_f(r['overlap'], '.2f')} |")
    out += ["", "- bound: compression is CPU work on the cores the next step computes on, so it adds to the "
            "compute-only step; the wire (link bytes x 8 / bandwidth) can hide behind both.",
            "- overlap = (exchange time - time the training thread waited for it) / exchange time, "
            "the algorithm's own clock (rank 0)."]
    return out
