"""``gradpress compare``: train one workload with several algorithms and
compressors and compare accuracy, bytes on the wire and time; see
:mod:`gradpress.compare`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from gradpress import compare, compare_report, train
from gradpress.train.launch import WorkerFailed


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "compare", help="train one workload with several compressors / algorithms; table + plot",
        description="Run `gradpress train` once per (algorithm, compressor) pair (same seed, data and workers), "
                    "print a table and write DIR/compare.json, DIR/compare.md and DIR/compare.png.",
    )
    p.add_argument("--compressors", action="append", default=None, metavar="SPECS",
                   help="comma-separated specs, e.g. none,fp16,topk:ratio=0.01 (';' also separates; repeatable); "
                        "default: each algorithm's own default compressor")
    p.add_argument("--algorithms", action="append", default=None, metavar="SPECS",
                   help="comma-separated algorithm specs, e.g. ddp,localsgd:period=8 (default ddp); every "
                        "algorithm runs with every compressor; see `gradpress algorithms`")
    p.add_argument("--target", type=float, default=None,
                   help="metric to reach (default: 95%% of the ddp/none run's final metric; 105%% for bits per char)")
    p.add_argument("--seeds", default=None, metavar="N|LIST",
                   help="run every configuration at N seeds (--seed, --seed+1, ...) or at a list (0,1,2); the "
                        "table gives mean ± std [min, max] over seeds; per-seed rows in compare.json")
    p.add_argument("--lr-sweep", default=None, metavar="RATES",
                   help="learning rates (0.003,0.01,0.03) or factors of the default lr (x0.3,x1,x3): each method "
                        "runs at each on a short budget, then the comparison runs at each method's best rate "
                        "(best final metric, ties to the smaller lr); written to sweep.json")
    p.add_argument("--sweep-steps", type=int, default=None, metavar="N",
                   help="steps per sweep run (default: a quarter of --steps; the full budget without --steps)")
    train.add_arguments(p, compare=True)
    p.set_defaults(func=run_cli)


def run_cli(args: argparse.Namespace) -> int:
    opts = {k: v for k, v in vars(args).items() if k in train.FIELDS or k == "config"}
    out = opts.pop("out", "runs/compare")
    try:
        result = compare.run(args.compressors, opts, out=out, target=args.target, algorithms=args.algorithms,
                             seeds=args.seeds, lr_sweep=args.lr_sweep, sweep_steps=args.sweep_steps)
    except WorkerFailed as exc:  # exit codes as `gradpress train`'s (docs/train.md)
        partial = Path(out) / "compare-partial.json"
        kept = f" (the runs that finished: {partial})" if partial.exists() else ""
        print(f"gradpress compare: error: {exc}{kept}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("gradpress compare: interrupted; workers stopped", file=sys.stderr)
        return 130
    stats = json.loads((Path(out) / "compare-stats.json").read_text())
    print()
    print(stats["lr"]["text"])
    if args.seeds is not None:
        groups = compare_report.aggregate(result)
        print(compare_report.aggregate_table(groups, result[0]["metric"], result[0]["reference"],
                                             stats["sweep"] is not None))
    else:
        print(compare.table(result))
    tgt = result[0]["target"]
    if tgt is not None:
        print(f"target {result[0]['metric']}: {tgt:.4f}")
    extra = f", {out}/sweep.json" if args.lr_sweep is not None else ""
    print(f"wrote {out}/compare.json, {out}/compare-stats.json{extra}, {out}/compare.md, {out}/compare.png")
    return 0
