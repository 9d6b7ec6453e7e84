"""``gradpress train`` / ``python -m gradpress.train``: run and print the summary line."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gradpress.train.args import add_arguments
from gradpress.train.launch import run
from gradpress.train.report import METRICS, SUMMARY, human_bytes

__all__ = ["summary_line", "run_cli", "main"]


def summary_line(s: Mapping[str, Any]) -> str:
    metric = s["final_metric"]
    m = "n/a" if metric is None else f"{metric:.4f}"
    what = s["compressor"] if s.get("algorithm", "ddp") == "ddp" else f"{s['algorithm']} / {s['compressor']}"
    return (f"{s['workload']} / {what} on {s['world_size']} worker(s): {s['steps']} steps, "
            f"{s['metric']} {m}, {human_bytes(s['bytes_per_step'])}/step "
            f"(dense {human_bytes(s['dense_bytes_per_step'])}, x{s['compression_ratio']:.1f}), "
            f"median step {s['median_step_s'] * 1e3 if s['median_step_s'] else float('nan'):.1f} ms")


def run_cli(args: argparse.Namespace) -> int:
    summary = run(args)
    if int(os.environ.get("RANK", "0")) == 0:
        print(summary_line(summary))
        if summary.get("strategy") == "auto" and summary.get("plan"):
            from gradpress.exchange.planner import Plan

            print(Plan.from_json(summary["plan"]).table())
        if summary.get("nothing_compressed"):
            print(f"note: no tensor went through the compressor (strategy {summary['strategy']!r}: the plan left "
                  "every tensor dense, or all are 1-D / below --min-numel); force one with --strategy "
                  "collective or lower --min-numel")
        print(f"metrics: {Path(summary['out']) / METRICS}  summary: {Path(summary['out']) / SUMMARY}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m gradpress.train`` (the module torchrun starts)."""
    parser = argparse.ArgumentParser(prog="python -m gradpress.train", description="Train a workload with gradpress.")
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run_cli(args)
    except ValueError as exc:
        print(f"gradpress train: error: {exc}", file=sys.stderr)
        return 2
