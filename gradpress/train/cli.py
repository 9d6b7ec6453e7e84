"""``gradpress train`` / ``python -m gradpress.train``: run and print the summary line."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gradpress import workloads
from gradpress.compress import plugins
from gradpress.train.algorithm import shown, shown_compressor
from gradpress.train.args import add_arguments
from gradpress.train.launch import WorkerFailed, run
from gradpress.train.report import METRICS, SUMMARY, human_bytes

__all__ = ["summary_line", "run_cli", "main"]


def summary_line(s: Mapping[str, Any]) -> str:
    metric = s["final_metric"]
    m = "n/a" if metric is None else f"{metric:.4f}"
    median = s.get("median_step_s")
    comp = shown_compressor(s["compressor"])  # the specs without their defaults; summary.json has them all
    what = comp if s.get("algorithm", "ddp") == "ddp" else f"{shown(s['algorithm'])} / {comp}"
    host = s.get("host_bytes_per_step") or 0  # hierarchical: dense bytes that never leave a host
    inside = f"{human_bytes(host)} of it inside hosts; " if host else ""
    return (f"{s['workload']} / {what} on {s['world_size']} worker(s): {s['steps']} steps, "
            f"{s['metric']} {m}, {human_bytes(s['bytes_per_step'])}/step "
            f"({inside}dense {human_bytes(s['dense_bytes_per_step'])}, x{s['compression_ratio']:.1f}), "
            f"median step " + (f"{median * 1e3:.1f} ms" if median else "n/a"))


def run_cli(args: argparse.Namespace) -> int:
    """Run, print the summary; exit codes: 0 done, 1 a worker failed (named),
    2 bad options or checkpoint (raised as ValueError), 3 the loss became
    NaN/Inf (0 with ``--allow-divergence``), 130 interrupted (Ctrl-C)."""
    try:
        summary = run(args)
    except WorkerFailed as exc:
        print(f"gradpress train: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("gradpress train: interrupted; workers stopped", file=sys.stderr)
        return 130
    rank0 = int(os.environ.get("RANK", "0")) == 0
    if rank0:
        print(summary_line(summary))
        for r in summary.get("reshards") or []:
            inside = f", inside epoch {r['epoch'] + 1} after batch {r['batch']} of it" if r.get("left") else ""
            print(f"resharded: the checkpoint of {r['from']} worker(s) continued on {r['to']} at step {r['step']} "
                  f"(epoch {r['epoch']}{inside})")
        if summary.get("strategy") == "auto" and summary.get("plan"):
            from gradpress.exchange.planner import Plan

            print(Plan.from_json(summary["plan"]).table())
        if summary.get("nothing_compressed"):
            print(f"note: no tensor went through the compressor (strategy {summary['strategy']!r}: the plan left "
                  "every tensor dense, or all are 1-D / below --min-numel); force one with --strategy "
                  "collective or lower --min-numel")
        if getattr(args, "samples", None) is None:  # a shrunk data set is a quick check, not a budget
            note = workloads.budget_note(summary["workload"], summary["epochs"], summary["steps_per_epoch"])
            if note:
                print(note)
        print(f"metrics: {Path(summary['out']) / METRICS}  summary: {Path(summary['out']) / SUMMARY}")
    bad = summary.get("diverged_at_step")
    if bad is not None:
        if summary.get("allow_divergence"):
            if rank0:
                print(f"gradpress train: warning: loss became non-finite at step {bad}", file=sys.stderr)
            return 0
        if rank0:
            print(f"gradpress train: error: loss became non-finite at step {bad}; the run stopped there and the "
                  "last good checkpoint was kept (lower --lr, or --allow-divergence to go on)", file=sys.stderr)
        return 3
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m gradpress.train`` (the module torchrun starts)."""
    parser = argparse.ArgumentParser(prog="python -m gradpress.train", description="Train a workload with gradpress.")
    add_arguments(parser)
    plugins.add_option(parser)
    args = parser.parse_args(argv)
    from gradpress.train.launch import one_line_warnings

    one_line_warnings()  # this process is a worker (torchrun started it)
    try:
        plugins.add(args.plugins or [])  # and those of $GRADPRESS_PLUGINS
        return run_cli(args)
    except ValueError as exc:
        print(f"gradpress train: error: {exc}", file=sys.stderr)
        return 2
