"""``gradpress compare``: train one workload with several algorithms and
compressors and compare accuracy, bytes on the wire and time; see
:mod:`gradpress.compare`."""

from __future__ import annotations

import argparse

from gradpress import compare, train


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
    train.add_arguments(p, compare=True)
    p.set_defaults(func=run_cli)


def run_cli(args: argparse.Namespace) -> int:
    opts = {k: v for k, v in vars(args).items() if k in train.FIELDS or k == "config"}
    out = opts.pop("out", "runs/compare")
    result = compare.run(args.compressors, opts, out=out, target=args.target, algorithms=args.algorithms)
    print()
    print(compare.table(result))
    tgt = result[0]["target"]
    if tgt is not None:
        print(f"target {result[0]['metric']}: {tgt:.4f}")
    print(f"wrote {out}/compare.json, {out}/compare.md, {out}/compare.png")
    return 0
