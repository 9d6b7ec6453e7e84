"""``gradpress train``: train a built-in workload (or your ``--data``) with a
compressor; see :mod:`gradpress.train` and ``docs/train.md``."""

from __future__ import annotations

import argparse

from gradpress import train


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train", help="train a workload with gradient compression (DDP, gloo/nccl)",
        description="Train a workload with DDP and the gradpress comm hook. Writes DIR/metrics.jsonl, "
                    "DIR/summary.json and DIR/checkpoint.pt (every epoch). Flags override --config FILE.toml.",
    )
    train.add_arguments(p)
    p.set_defaults(func=train.run_cli)
