"""Tables of ``gradpress compare`` over several seeds: one row per
configuration with mean ± std [min, max] over seeds, the 95% confidence
intervals of the mean final metric and of its difference to the reference,
and the rank by bytes to target (see :mod:`gradpress.compare_stats`), and
the Markdown page."""

from __future__ import annotations

from typing import Any

from gradpress import compare, compare_stats

__all__ = ["aggregate", "aggregate_table", "lr_note", "markdown"]

FIELDS = {
    "final_metric": compare.final,
    "delta_vs_reference": lambda r: r["delta_vs_reference"],
    "steps_to_target": lambda r: r["steps_to_target"],
    "time_to_target": lambda r: r["time_to_target"],
    "bytes_to_target": lambda r: r["bytes_to_target"],
    "bytes_per_step": lambda r: r["bytes_per_step"],
    "median_step_s": lambda r: r["median_step_s"],
}


def aggregate(result: list[dict[str, Any]], seeds: int | None = None) -> list[dict[str, Any]]:
    """Annotated per-seed summaries grouped by configuration (algorithm,
    compressor), in input order, with a :func:`compare_stats.stat` per field;
    ``vs_reference``: :func:`compare_stats.difference` of its final metric and
    the reference's (paired by seed when they have the same seeds); ``rank``
    (None: unranked, ``rank_note`` says why) and ``not_separable_from`` (labels)
    by :data:`compare_stats.RANK_RULE`. ``seeds``: how many seeds each
    configuration ran (default: the most finished runs of one configuration)."""
    groups = compare_stats.group(result, compare.label, FIELDS)
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
    seeds = seeds if seeds is not None else max(g["bytes_to_target"]["n"] for g in groups)
    for g, r in zip(groups, compare_stats.rank([g["bytes_to_target"] for g in groups], seeds)):
        g.update(rank=r["rank"], rank_note=r["why"],
                 not_separable_from=[groups[j]["label"] for j in r["not_separable_from"]])
    return groups


def aggregate_table(groups: list[dict[str, Any]], metric: str, reference: str, per_method_lr: bool) -> str:
    """The Markdown table of :func:`aggregate`'s groups, in rank order (unranked last, in input order)."""
    head = ["algorithm", "compressor"] + (["lr"] if per_method_lr else []) + [
        "seeds", f"final {metric}", f"final {metric}: 95% CI of the mean (t, n-1 df)", f"vs {reference}",
        f"vs {reference}: 95% CI of the mean difference", "bytes/step", "ratio", "step ms", "steps to target",
        "bytes to target", "bytes to target: 95% CI", "time to target (s)", "rank (bytes to target)",
        "not separable from"]
    rows = []
    order = sorted(range(len(groups)), key=lambda i: (groups[i]["rank"] is None, groups[i]["rank"] or 0, i))
    for g in (groups[i] for i in order):
        n = g["final_metric"]["n"]
        rows.append([f"`{g['algorithm']}`",
                     f"`{g['compressor']}`" + (" (nothing compressed)" if g["nothing_compressed"] else "")]
                    + ([f"{g['lr']:g}"] if per_method_lr else []) + [
            str(n),
            compare_stats.fmt(g["final_metric"], missing="-"),
            compare_stats.fmt_interval(g["final_metric"]["ci95"]),
            compare_stats.fmt(g["delta_vs_reference"], lambda v: f"{v:+.4f}", missing="-"),
            "reference" if g["label"] == reference else compare_stats.fmt_difference(g["vs_reference"]),
            compare._fmt_bytes(g["bytes_per_step"]["mean"]),
            f"{g['compression_ratio']:.1f}x",
            compare_stats.fmt(g["median_step_s"], lambda v: f"{v * 1e3:.1f}", missing="-"),
            compare_stats.fmt(g["steps_to_target"], lambda v: f"{v:.0f}"),
            compare_stats.fmt(g["bytes_to_target"], compare._fmt_bytes),
            compare_stats.fmt_interval(g["bytes_to_target"]["ci95"], compare._fmt_bytes),
            compare_stats.fmt(g["time_to_target"], lambda v: f"{v:.2f}"),
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


def markdown(result: list[dict[str, Any]], groups: list[dict[str, Any]], target: float | None, seeds: list[int],
             multi: bool, note: dict[str, Any], record: dict[str, Any] | None,
             rows: list[dict[str, Any]] | None = None, failed: list[dict[str, Any]] | None = None,
             plugins: list[dict[str, Any]] | None = None) -> str:
    """The page: ``result`` the finished runs (annotated); ``rows`` every
    comparison run in order, failed ones included (default ``result``);
    ``failed`` every failed run's record, the sweep's included, listed with
    its error; ``plugins`` the plugin modules loaded
    (:func:`gradpress.compress.plugins.record`), named in the header."""
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
        f"algorithms: {', '.join(dict.fromkeys(s.get('algorithm', 'ddp') for s in result))}).",
        note["text"],
        f"Target {s0['metric']}: {'-' if tgt is None else f'{tgt:.4f}'} ({rule}).",
    ]
    if plugins:
        md.append("Plugins: " + ", ".join(f"`{p['module']}` ({p['file'] or 'no file'})" for p in plugins) + ".")
    md.append("")
    if multi:
        md += [f"Over {len(seeds)} seed(s): mean ± sample std [min, max]; steps, bytes and time to target over "
               "the seeds that reached it, and `not reached (k of N)` counts those that did not. Bytes to target = "
               "the bytes rank 0 had sent at that evaluation. Time to target = steps to target x that run's median "
               "step time (on one machine's loopback it measures computation and compression, not a slow link: "
               "there bytes to target is the figure to rank by). Per-seed rows: below and in compare.json.", "",
               "Intervals: the 95% confidence interval of the mean over the seeds with a value, mean ± t(0.975, "
               "n-1) x sample std / sqrt(n) (Student t, n-1 degrees of freedom; none below 2 values). The "
               f"difference to `{s0['reference']}` is paired by seed (the interval of the mean per-seed "
               "difference) when both ran and finished the same seeds, else Welch's unpaired interval; each cell "
               "says which. Rank, by bytes to target: " + compare_stats.RANK_RULE + ". Rows are in rank order, "
               "unranked ones last; the plot's bands are the same intervals.", "",
               aggregate_table(groups, s0["metric"], s0["reference"], record is not None), "",
               "Per seed:", ""]
    md += [compare.table(rows if rows is not None else result), ""]
    if failed:
        md += [f"Failed runs ({len(failed)}; `gradpress train` exit status in brackets):", ""]
        md += [f"* {f['label']} (exit {f['exit_code']}): {f['error']}" for f in failed] + [""]
    md += ["![metric vs step and bytes](compare.png)", ""]
    return "\n".join(md)
