"""``gradpress algorithms``: list every training algorithm (``ddp`` and the
registered ones) with its parameters, defaults and default compressor."""

from __future__ import annotations

import argparse
import json

from gradpress.train.algorithm import describe


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "algorithms", help="list training algorithms, their parameters, defaults and default compressor",
        description="List every training algorithm `gradpress train --algorithm SPEC` accepts: ddp (DDP with "
                    "the gradpress comm hook, the default) and every registered algorithm, with parameters "
                    "(default; allowed values) and the compressor it runs when --compressor is left out. "
                    "Build one with a spec such as 'localsgd:period=8'; `gradpress compare --algorithms` and "
                    "`gradpress bench e2e --configs ALGORITHM/COMPRESSOR` use the same syntax.",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    rows = describe()
    if args.json:
        print(json.dumps(rows, indent=2, default=str))
        return 0
    print(f"{'name':<14} {'compressor':<18} {'parameters (default; allowed)'}")
    for r in rows:
        params = "; ".join(f"{p['name']}={p['default']} ({p['allowed']})" for p in r["params"]) or "-"
        print(f"{r['name']:<14} {r['default_compressor']:<18} {params}")
        if r["summary"]:
            print(f"{'':<14} {r['summary']}")
    return 0
