"""``gradpress bench compressors``: encode/decode micro-benchmark of every
compressor. This module is the command line: its options, their validation,
and the files it writes.

What one row measures is described in :mod:`gradpress.bench.compressors_rows`
(invariant: every figure is measured in this run; nothing is estimated); the
sweep over sizes and the target checks are in
:mod:`gradpress.bench.compressors_sweep`; the table and the JSON form in
:mod:`gradpress.bench.compressors_report`. Their public names are importable
from here.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from gradpress.bench.args import check_file_path, check_threads, positive_int
from gradpress.bench.compressors_report import _json_safe, format_table
from gradpress.bench.compressors_rows import ROW_FIELDS, VARIANTS, bench_method, bench_reference
from gradpress.bench.compressors_sweep import evaluate_targets, run_benchmark
from gradpress.bench.data import DATA_KINDS
from gradpress.bench.specs import parse_compressors, parse_sizes
from gradpress.train.config import check_out, check_seed

__all__ = ["register_bench", "run_benchmark", "evaluate_targets", "ROW_FIELDS",
           "bench_method", "bench_reference", "format_table"]


def register_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "compressors", help="encode/decode throughput, ratio, error and memory of every compressor",
        description="Micro-benchmark of compressors: encode/decode GB/s, wire bytes, ratio, relative error, "
                    "density quality, peak temporary memory, against a copy roofline measured in the same run.",
    )
    p.add_argument("--compressors", default="all",
                   help="'all' (every registered name with its bench spec) or comma-separated specs, "
                        "e.g. 'fp16,topk:ratio=0.001,qsgd:levels=4' (default: all)")
    p.add_argument("--sizes", default="1M,25M", help="element counts, suffix K/M/G = 1e3/1e6/1e9 (default: 1M,25M)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="device (default: cpu)")
    p.add_argument("--data", default="gaussian", choices=DATA_KINDS,
                   help="input values: gaussian, laplace, or captured MLP gradients (default: gaussian)")
    p.add_argument("--repeats", type=positive_int("--repeats"), default=5,
                   help="timed runs per measurement; the median is reported (default: 5)")
    p.add_argument("--warmup", type=positive_int("--warmup"), default=1, help="untimed runs first (default: 1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the input data (default: 0)")
    p.add_argument("--threads", type=positive_int("--threads"), default=None,
                   help="CPU threads for torch (default: torch's choice); 1 gives stable figures on a shared machine")
    p.add_argument("--variants", default="default",
                   help="comma-separated implementations to measure side by side: default (the registered "
                        "compressor under GRADPRESS_COMPILE), compiled and eager (kit declarations forced to "
                        "torch.compile or eager), hand (the frozen hand-written version a kit declaration "
                        "replaced); e.g. 'compiled,eager,hand' (default: default)")
    p.add_argument("--json", metavar="FILE", default=None, help="write rows, skips, targets as JSON to FILE")
    p.add_argument("--out", metavar="DIR", default="bench-results",
                   help="directory for bench.png (default: bench-results)")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    check_seed(args.seed, "--seed")
    specs = parse_compressors(args.compressors)
    sizes = parse_sizes(args.sizes)
    variants = tuple(v.strip() for v in args.variants.split(",") if v.strip())
    bad = [v for v in variants if v not in VARIANTS]
    if bad or not variants:
        raise ValueError(f"--variants got {args.variants!r}; allowed: comma-separated {', '.join(VARIANTS)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device got 'cuda' but CUDA is not available on this machine; allowed here: cpu")
    check_threads(args.threads)
    # the files it writes: refused now, not after the whole benchmark
    if args.json is not None:
        if not args.json:
            raise ValueError("--json got ''; allowed: a file path")
        json_path = Path(args.json)
        check_file_path(json_path, "--json")
    out_dir = Path(args.out)
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"--out got {args.out!r}, which is a file; allowed: a directory")
    check_out(str(out_dir), "--out")

    all_threads = torch.get_num_threads()  # torch's default, before --threads: the all-thread roofline
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    result = run_benchmark(specs, sizes, args.device, args.data, args.repeats, args.warmup, args.seed, log,
                           variants, all_threads)
    result["command"] = "gradpress bench compressors " + " ".join(
        f"--{k} {v}" for k, v in (("compressors", args.compressors), ("sizes", args.sizes),
                                  ("device", args.device), ("data", args.data), ("repeats", args.repeats),
                                  ("threads", args.threads), ("variants", args.variants if args.variants != "default" else None))
        if v is not None)
    print(format_table(result))
    from gradpress.bench.plot import plot_throughput

    png = plot_throughput(result["rows"], out_dir / "bench.png",
                          f"encode throughput vs ratio, {max(sizes):,} elements, {args.data}, {args.device}")
    if png is not None:
        print(f"plot: {png}")
    if args.json:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(_json_safe(result), indent=2))
        print(f"json: {json_path}")
    return 0
