"""``gradpress strategies``: list every exchange strategy with its
parameters and the compressors it can (not) carry."""

from __future__ import annotations

import argparse
import json
import textwrap

from gradpress.compress import registry
from gradpress.exchange.catalog import describe_strategies


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "strategies", help="list exchange strategies, their parameters and the compressors they carry",
        description="List every strategy `gradpress train --strategy SPEC` accepts (how compressed tensors "
                    "travel between ranks), with its parameters (default; allowed values) and which registered "
                    "compressors it cannot carry, and why. With --compressor, say for that one compressor which "
                    "strategies can carry it. Build one with a spec such as 'hierarchical:outer=ring'.",
    )
    p.add_argument("--compressor", metavar="SPEC", default=None,
                   help="check this compressor spec (e.g. 'qsgd:levels=16' or 'topk:ratio=0.01>natural') "
                        "against every strategy")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    rows = describe_strategies(args.compressor)
    if args.json:
        print(json.dumps(rows, indent=2, default=str))
        return 0
    total = len(registry.names())
    if args.compressor is not None:
        print(f"Which strategies can carry {args.compressor}:\n")
    print(f"{'name':<13} {'carries':<8} what it does; parameters (default; allowed)")
    for r in rows:
        if args.compressor is not None:
            carries = "no" if r["refuses"] else "yes"
        else:
            carries = f"{total - len(r['refuses'])}/{total}"
        print(f"{r['name']:<13} {carries:<8} {r['summary']}" if len(r["summary"]) <= 88
              else f"{r['name']:<13} {carries}")
        if len(r["summary"]) > 88:
            _block(r["summary"])
        if r["params"]:
            _block("parameters: " + "; ".join(f"{p['name']}={p['default']} ({p['allowed']})" for p in r["params"]))
        if args.compressor is not None:
            for reason in r["refuses"].values():
                _block(f"why not: {reason}")
        elif r["refuses"]:
            carried = [n for n in registry.names() if n not in r["refuses"]]
            _block(f"only: {', '.join(carried)}" if len(carried) < len(r["refuses"])
                   else f"not: {', '.join(r['refuses'])}")
    if args.compressor is None:
        print("\nWhy a strategy cannot carry a compressor: gradpress strategies --compressor SPEC")
    return 0


def _block(text: str) -> None:
    print(textwrap.fill(text, width=110, initial_indent=" " * 23, subsequent_indent=" " * 23))
