"""``make demo``: compare a few compressors on MNIST-1D with 2 workers.

Runs ``gradpress compare`` on the default workload (the MNIST-1D paper's
CNN) with 2 local gloo workers and about four compressors chosen among the
registered ones, then says where the table and the plot are. Takes a couple
of minutes on 2 CPU cores. ``python3 -m gradpress.demo [--out DIR]``.
"""

from __future__ import annotations

import argparse
import sys
import time

from gradpress import compare
from gradpress.compress import names

#: wanted in this order; the first four that are registered are used
PREFERRED = ("none", "fp16", "topk:ratio=0.01", "qsgd", "powersgd", "natural", "bf16")


def pick(limit: int = 4) -> list[str]:
    available = set(names())
    return [spec for spec in PREFERRED if spec.split(":", 1)[0] in available][:limit]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m gradpress.demo", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/demo", help="output directory (default runs/demo)")
    p.add_argument("--nproc", type=int, default=2, help="workers (default 2)")
    args = p.parse_args(argv)
    specs = pick()
    print(f"gradpress demo: mnist1d-cnn on {args.nproc} workers with {', '.join(specs)}", flush=True)
    t0 = time.perf_counter()
    result = compare.run(specs, {"nproc": args.nproc, "eval_every": 50}, out=args.out)
    print()
    print(compare.table(result))
    print(f"\ntarget {result[0]['metric']} {result[0]['target']:.4f} = 95% of the none run's final value")
    print(f"finished in {time.perf_counter() - t0:.0f} s")
    print(f"table: {args.out}/compare.md   plot: {args.out}/compare.png   data: {args.out}/compare.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
