"""``gradpress compressors``: list every registered compressor with its
parameters, defaults and traits."""

from __future__ import annotations

import argparse
import json

from gradpress.compress import describe


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "compressors", help="list compressors, their parameters, defaults and traits",
        description="List every registered compressor: parameters (default; allowed values), whether its "
                    "packets are summable (allreduce), whether it is unbiased, and whether error feedback is "
                    "on by default. Build one with a spec such as 'qsgd:levels=16,bucket=512' or "
                    "'topk:ratio=0.01>natural'.",
    )
    fmt = p.add_mutually_exclusive_group()  # one output format: --json --markdown is refused (exit 2)
    fmt.add_argument("--json", action="store_true", help="print JSON instead of a table")
    fmt.add_argument("--markdown", action="store_true", help="print the README's Markdown table")
    p.set_defaults(func=run)


def _flag(v: bool) -> str:
    return "yes" if v else "-"


def run(args: argparse.Namespace) -> int:
    rows = describe()
    if args.json:
        print(json.dumps(rows, indent=2, default=str))
        return 0
    if args.markdown:
        print(markdown_table(rows))
        return 0
    print(f"{'name':<14} {'summable':<9} {'unbiased':<9} {'EF':<4} {'parameters (default; allowed)'}")
    for r in rows:
        params = "; ".join(f"{p['name']}={p['default']} ({p['allowed']})" for p in r["params"]) or "-"
        print(f"{r['name']:<14} {_flag(r['summable']):<9} {_flag(r['unbiased']):<9} "
              f"{'on' if r['error_feedback_default'] else 'off':<4} {params}")
        if r["summary"]:
            print(f"{'':<14} {r['summary']}")
    return 0


def markdown_table(rows: list[dict]) -> str:
    """The compressor table of the README, generated from the registry."""
    lines = [
        "| name | method | parameters (default) | summable | unbiased | error feedback by default |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        params = ", ".join(f"`{p['name']}={p['default']}`" for p in r["params"]) or "-"
        lines.append(
            f"| `{r['name']}` | {r['summary']} | {params} | {_flag(r['summable'])} | {_flag(r['unbiased'])} | "
            f"{'on' if r['error_feedback_default'] else 'off'} |"
        )
    return "\n".join(lines)
