"""Tables of ``gradpress compare`` over several seeds: one row per
configuration with mean ± std [min, max] over seeds, the 95% confidence
intervals of the mean final metric and of its difference to the reference,
and the rank by bytes to target or, with ``--rank-by time``, by wall-clock
time to target (see :mod:`gradpress.compare_stats`), and the Markdown page.

Reported intervals are clipped to the range of their quantity: the final
metric's to the metric's (:func:`gradpress.workloads.metric_range`: an
accuracy in [0, 1], bits per character >= 0), a difference of two final
metrics to plus or minus that range's width, the figures to target, bytes
per step and step times to >= 0. A clipped end is marked ``(clipped)`` and
the page says which; compare-stats.json keeps every interval unclipped
(``ci95``) beside the reported one (``ci95_reported``, ``clipped``); the
rank uses the unclipped intervals."""

from __future__ import annotations

import math
from typing import Any

from gradpress import compare, compare_stats, workloads
from gradpress.train.algorithm import shown

__all__ = ["aggregate", "aggregate_table", "lr_note", "markdown", "clipped_note", "TIME_NOTE"]

#: what the page says of ranking by time
TIME_NOTE = ("Wall-clock time on a shared machine is noisy (other processes take the cores; rerunning moves it), "
             "and on one machine's loopback it measures computation and compression, not a slow link; bytes to "
             "target are exact (what rank 0 handed to collectives) and repeat bit for bit.")

FIELDS = {
    "final_metric": compare.final,
    "delta_vs_reference": lambda r: r["delta_vs_reference"],
    "steps_to_target": lambda r: r["steps_to_target"],
    "time_to_target": lambda r: r["time_to_target"],
    "bytes_to_target": lambda r: r["bytes_to_target"],
    "bytes_per_step": lambda r: r["bytes_per_step"],
    "median_step_s": lambda r: r["median_step_s"],
}


def _ranges(metric: str | None) -> dict[str, tuple[float, float]]:
    """Per field of :data:`FIELDS` (and ``vs_reference``) the range its values can take (module doc); an unknown
    metric's final values and differences unbounded."""
    low, high = workloads.METRIC_RANGES.get(metric or "", (-math.inf, math.inf))
    width = high - low
    out = {name: (0.0, math.inf) for name in FIELDS}
    out.update(final_metric=(low, high), delta_vs_reference=(-width, width), vs_reference=(-width, width))
    return out


def aggregate(result: list[dict[str, Any]], seeds: int | None = None, rank_by: str = "bytes") -> list[dict[str, Any]]:
    """Annotated per-seed summaries grouped by configuration (algorithm,
    compressor), in input order, with a :func:`compare_stats.stat` per field;
    ``vs_reference``: :func:`compare_stats.difference` of its final metric and
    the reference's (paired by seed when they have the same seeds); each with
    its interval as reported (:func:`compare_stats.clip_stat`, module doc);
    ``rank`` (None: unranked, ``rank_note`` says why) and ``not_separable_from``
    (labels) by the rule of ``rank_by`` (:data:`compare_stats.RANK_RULES`: ``bytes``
    or ``time`` to target). ``seeds``: how many seeds each configuration ran
    (default: the most finished runs of one configuration)."""
    if rank_by not in compare_stats.RANK_RULES:
        raise ValueError(f"rank-by must be one of {', '.join(compare_stats.RANK_RULES)}, got {rank_by!r}")
    groups = compare_stats.group(result, compare.label, FIELDS)
    ranges = _ranges(result[0].get("metric") if result else None)
    for g in groups:
        r0 = g["rows"][0]
        g.update(label=g["key"], algorithm=r0.get("algorithm", "ddp"), compressor=r0["compressor"],
                 lr=r0.get("lr"), compression_ratio=r0["compression_ratio"],
                 nothing_compressed=bool(r0.get("nothing_compressed")))
    if not groups:
        return groups
    ref = next((g for g in groups if g["label"] == result[0].get("reference")), groups[0])
    ref_finals = {r.get("seed"): compare.final(r) for r in ref["rows"]}
    for g in groups:
        g["vs_reference"] = compare_stats.difference({r.get("seed"): compare.final(r) for r in g["rows"]},
                                                     ref_finals)
        for name, (low, high) in ranges.items():
            compare_stats.clip_stat(g[name], low, high)
    seeds = seeds if seeds is not None else max(g["bytes_to_target"]["n"] for g in groups)
    field = compare_stats.RANK_RULES[rank_by][0]
    for g, r in zip(groups, compare_stats.rank([g[field] for g in groups], seeds)):
        g.update(rank=r["rank"], rank_note=r["why"],
                 not_separable_from=[groups[j]["label"] for j in r["not_separable_from"]])
    return groups


def _ci(st: dict[str, Any], f: Any = lambda v: f"{v:.4f}") -> str:
    """A stat's interval as reported (clipped, ends marked) for a table cell."""
    return compare_stats.fmt_interval(st.get("ci95_reported", st["ci95"]), f, st.get("clipped", (False, False)))


def aggregate_table(groups: list[dict[str, Any]], metric: str, reference: str, per_method_lr: bool,
                    rank_by: str = "bytes") -> str:
    """The Markdown table of :func:`aggregate`'s groups, in rank order (unranked last, in input order);
    ``rank_by`` names the rank's column (what :func:`aggregate` ranked by)."""
    head = ["algorithm", "compressor"] + (["lr"] if per_method_lr else []) + [
        "seeds", f"final {metric}", f"final {metric}: 95% CI of the mean (t, n-1 df)", f"vs {reference}",
        f"vs {reference}: 95% CI of the mean difference", "bytes/step", "ratio", "step ms", "steps to target",
        "bytes to target", "bytes to target: 95% CI", "time to target (s)", "time to target: 95% CI",
        f"rank ({'wall-clock time' if rank_by == 'time' else 'bytes'} to target)", "not separable from"]
    rows = []
    order = sorted(range(len(groups)), key=lambda i: (groups[i]["rank"] is None, groups[i]["rank"] or 0, i))
    for g in (groups[i] for i in order):
        n = g["final_metric"]["n"]
        rows.append([f"`{shown(g['algorithm'])}`",
                     f"`{g['compressor']}`" + (" (nothing compressed)" if g["nothing_compressed"] else "")]
                    + ([f"{g['lr']:g}"] if per_method_lr else []) + [
            str(n),
            compare_stats.fmt(g["final_metric"], missing="-"),
            _ci(g["final_metric"]),
            compare_stats.fmt(g["delta_vs_reference"], lambda v: f"{v:+.4f}", missing="-"),
            "reference" if g["label"] == reference else compare_stats.fmt_difference(g["vs_reference"]),
            compare._fmt_bytes(g["bytes_per_step"]["mean"]),
            f"{g['compression_ratio']:.1f}x",
            compare_stats.fmt(g["median_step_s"], lambda v: f"{v * 1e3:.1f}", missing="-"),
            compare_stats.fmt(g["steps_to_target"], lambda v: f"{v:.0f}"),
            compare_stats.fmt(g["bytes_to_target"], compare._fmt_bytes),
            _ci(g["bytes_to_target"], compare._fmt_bytes),
            compare_stats.fmt(g["time_to_target"], lambda v: f"{v:.2f}"),
            _ci(g["time_to_target"], lambda v: f"{v:.2f}"),
            str(g["rank"]) if g["rank"] is not None else f"- ({g['rank_note']})",
            ", ".join(f"`{o}`" for o in g["not_separable_from"]) or "-",
        ])
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    lines = ["| " + " | ".join(h.ljust(w) for h, w in zip(head, widths)) + " |",
             "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    lines += ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in rows]
    return "\n".join(lines)


def lr_note(result: list[dict[str, Any]], record: dict[str, Any] | None) -> dict[str, Any]:
    """Which learning rates the runs used, as data and as one sentence."""
    per = {compare.label(r): r["lr"] for r in result}
    if record is not None:
        steps = f"{record['steps']} steps" if record["steps"] is not None else "the full budget"
        chosen = ", ".join(f"`{k}` {v:g}" for k, v in per.items())
        text = (f"Learning rate per method, chosen by a sweep over {', '.join(f'{r:g}' for r in record['rates'])} "
                f"({steps}, seed {', '.join(map(str, record['seeds']))}; rule: {record['rule']}): {chosen}.")
        return {"shared": None, "per_method": per, "text": text}
    rates = set(per.values())
    if len(rates) == 1:
        lr = rates.pop()
        return {"shared": lr, "per_method": per,
                "text": f"All methods share one learning rate, {lr:g} (no sweep; not tuned per method)."}
    chosen = ", ".join(f"`{k}` {v:g}" for k, v in per.items())
    return {"shared": None, "per_method": per, "text": f"Learning rates (not swept): {chosen}."}


#: the table's names of the fields whose intervals it shows
_SHOWN = {"final_metric": "final {metric}", "vs_reference": "vs {reference}", "bytes_to_target": "bytes to target",
          "time_to_target": "time to target"}


def clipped_note(groups: list[dict[str, Any]], metric: str, reference: str) -> str | None:
    """The sentence that names every interval end the table shows clipped (None: none was), with its
    unclipped value."""
    found = []
    for g in groups:
        for name, title in _SHOWN.items():
            st = g[name]
            for end, (was, value) in enumerate(zip(st.get("clipped", ()), st["ci95"] or ())):
                if was:
                    shown = title.format(metric=metric, reference=reference)
                    found.append(f"`{g['label']}` {shown}, {'upper' if end else 'lower'} end (unclipped {value:.6g})")
    if not found:
        return None
    return ("Interval ends marked `(clipped)` lay outside the range their quantity can take (an accuracy in [0, 1], "
            "bits per character and the figures to target >= 0, a difference of two final metrics within that "
            "range's width) and are shown clipped to it: " + "; ".join(found) + ". compare-stats.json keeps every "
            "interval unclipped (`ci95`) beside the reported one (`ci95_reported`, `clipped`); the rank uses the "
            "unclipped intervals.")


def markdown(result: list[dict[str, Any]], groups: list[dict[str, Any]], target: float | None, seeds: list[int],
             multi: bool, note: dict[str, Any], record: dict[str, Any] | None,
             rows: list[dict[str, Any]] | None = None, failed: list[dict[str, Any]] | None = None,
             plugins: list[dict[str, Any]] | None = None, rank_by: str = "bytes") -> str:
    """The page: ``result`` the finished runs (annotated); ``rows`` every
    comparison run in order, failed ones included (default ``result``);
    ``failed`` every failed run's record, the sweep's included, listed with
    its error; ``plugins`` the plugin modules loaded
    (:func:`gradpress.compress.plugins.record`), named in the header;
    ``rank_by`` what :func:`aggregate` ranked by."""
    s0 = result[0]
    tgt = s0["target"]
    rule = "given with --target" if target is not None else (
        f"{'95' if s0['higher_is_better'] else '105'}% of the `{s0['reference']}` run's final {s0['metric']}"
        + (", mean over seeds" if multi and len(seeds) > 1 else ""))
    seed_text = f"seeds {', '.join(map(str, seeds))}" if multi else f"seed {s0['seed']}"
    md = [
        f"# gradpress compare: {s0['workload']}",
        "",
        f"{s0['world_size']} worker(s), {s0['steps']} steps, batch {s0['batch_size']} per worker, "
        f"{s0['optimizer']}, {s0['schedule']} schedule, {seed_text}, data split {s0.get('split', 'iid')}. Bytes are those rank 0 handed to collectives "
        f"(strategies: {', '.join(sorted({s['strategy'] for s in result}))}; "
        f"algorithms: {', '.join(dict.fromkeys(shown(s.get('algorithm', 'ddp')) for s in result))}).",
        note["text"],
        f"Target {s0['metric']}: {'-' if tgt is None else f'{tgt:.4f}'} ({rule}).",
    ]
    if plugins:
        md.append("Plugins: " + ", ".join(f"`{p['module']}` ({p['file'] or 'no file'}"
                                          + (f", sha256 {p['sha256'][:12]}" if p.get("sha256") else "") + ")"
                                          for p in plugins) + ".")
    md.append("")
    if multi:
        rank_name, rule = ("wall-clock time to target", compare_stats.TIME_RANK_RULE) if rank_by == "time" else (
            "bytes to target", compare_stats.RANK_RULE)
        clipped = clipped_note(groups, s0["metric"], s0["reference"])
        md += [f"Over {len(seeds)} seed(s): mean ± sample std [min, max]; steps, bytes and time to target over "
               "the seeds that reached it, and `not reached (k of N)` counts those that did not. Bytes to target = "
               "the bytes rank 0 had sent at that evaluation. Time to target = rank 0's training clock at that "
               "evaluation (the sum of its step times, evaluations not counted). " + TIME_NOTE
               + " Per-seed rows: below and in compare.json.", "",
               "Intervals: the 95% confidence interval of the mean over the seeds with a value, mean ± t(0.975, "
               "n-1) x sample std / sqrt(n) (Student t, n-1 degrees of freedom; none below 2 values). The "
               f"difference to `{s0['reference']}` is paired by seed (the interval of the mean per-seed "
               "difference) when both ran and finished the same seeds, else Welch's unpaired interval; each cell "
               f"says which. Rank, by {rank_name}: " + rule + ". Rows are in rank order, "
               "unranked ones last; the plot's bands are the same intervals.", "",
               aggregate_table(groups, s0["metric"], s0["reference"], record is not None, rank_by), ""]
        md += [clipped, ""] if clipped else []
        md += ["Per seed:", ""]
    else:
        md += ["Time to target (s) = rank 0's training clock at the first evaluation at or beyond the target (the "
               "sum of its step times, evaluations not counted). " + TIME_NOTE, ""]
    md += [compare.table(rows if rows is not None else result), ""]
    if failed:
        md += [f"Failed runs ({len(failed)}; `gradpress train` exit status in brackets):", ""]
        md += [f"* {f['label']} (exit {f['exit_code']}): {f['error']}" for f in failed] + [""]
    md += ["![metric vs step and bytes](compare.png)", ""]
    return "\n".join(md)
