"""``gradpress train``: train a built-in workload (or your ``--data``) with an
algorithm and a compressor; see :mod:`gradpress.train` and ``docs/train.md``."""

from __future__ import annotations

import argparse

from gradpress import train


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train", help="train a workload with gradient compression (DDP, gloo/nccl) or another algorithm",
        description="Train a workload with an algorithm (default ddp: DDP and the gradpress comm hook) and a "
                    "compressor. Writes DIR/metrics.jsonl, DIR/summary.json and DIR/checkpoint.pt (every epoch). "
                    "Flags override --config FILE.toml.",
    )
    train.add_arguments(p)
    p.set_defaults(func=train.run_cli)
