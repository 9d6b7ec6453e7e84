"""``gradpress bench e2e``: end-to-end training steps on the emulated cluster.

In one invocation and on one :class:`~gradpress.cluster.EmulatedCluster`, it
runs ``python3 -m gradpress.bench.e2e_worker`` in every node once per
configuration: plain PyTorch DDP, PyTorch's ``fp16_compress_hook`` and
``powerSGD_hook`` (``--baselines``), and each gradpress configuration
(``--configs SPEC[@STRATEGY],...``, see :mod:`gradpress.bench.e2e_configs`).
A compute-only run (no communication, world size 1, in every node at once so
that the CPU is shared as in the real runs) gives the ideal time

    ideal = compute-only step + link bytes per step x 8 / bandwidth

where the link bytes are those of the busiest direction of the busiest node
link during the measured steps (Ethernet frames, from the node's interface
counters). ``ideal_payload_s`` uses the payload instead, each strategy's
bytes times its wire factor (allreduce and the plain allreduce of
uncompressed tensors 2(N-1)/N, allgather N-1, ring 1).

``--train-to TARGET`` (default workload ``mnist1d-cnn``) measures instead the
wall-clock time each configuration needs to reach a test metric.

Writes ``DIR/e2e.json`` (every figure), ``DIR/e2e.md`` (table + the exact
command), ``DIR/e2e.png`` (bar chart) and ``DIR/raw/`` (jobs and per-rank
results). Docs: ``docs/e2e.md``.

Modules: the arguments in :mod:`gradpress.bench.e2e_args`, the run in
:mod:`gradpress.bench.e2e_run` (one configuration's jobs in
:mod:`gradpress.bench.e2e_jobs`, its row in :mod:`gradpress.bench.e2e_rows`),
the report in :mod:`gradpress.bench.e2e_report`; this module is the command.
Their public names are importable from here.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from gradpress.bench.args import positive_int
from gradpress.bench.e2e_args import _resolve, command_line
from gradpress.bench.e2e_configs import DEFAULT_BASELINES
from gradpress.bench.e2e_rows import wire_factor
from gradpress.bench.e2e_run import run_e2e

__all__ = ["register_bench", "main", "run_e2e", "wire_factor", "command_line"]

DEFAULT_CONFIGS = "topk:ratio=0.001@allgather,powersgd:rank=4,start_iter=2"


def register_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "e2e", help="end-to-end DDP step time (or time to accuracy) on the emulated cluster, vs PyTorch's hooks",
        description="Run plain DDP, PyTorch's fp16/PowerSGD hooks and gradpress configurations on one emulated "
                    "cluster (needs root); report step time, speed-up, bytes per step and the ideal time.",
    )
    p.add_argument("--nodes", type=positive_int("--nodes"), default=4, help="emulated hosts (default 4)")
    p.add_argument("--bandwidth", default="100mbit", help="link rate per direction, tc syntax (default 100mbit)")
    p.add_argument("--workers-per-node", dest="workers_per_node", type=positive_int("--workers-per-node"), default=1,
                   help="workers per emulated host (default 1); they share its link and talk over its loopback")
    p.add_argument("--intra-bandwidth", dest="intra_bandwidth", default=None, metavar="RATE",
                   help="rate between a host's own workers (tc syntax; default: unshaped loopback)")
    p.add_argument("--workload", default=None,
                   help="workload (default wide-mlp; mnist1d-cnn with --train-to)")
    p.add_argument("--params", default=None, help="wide-mlp size, e.g. 10M (default 10M for wide-mlp)")
    p.add_argument("--hidden", type=positive_int("--hidden"), default=None, help="width/channels of the workload")
    p.add_argument("--configs", default=DEFAULT_CONFIGS,
                   help="gradpress configurations [ALGORITHM/]SPEC[@STRATEGY][+ef|+noef][+lr=X], comma-separated; "
                        "+lr=X: this configuration's own learning rate "
                        f"(default {DEFAULT_CONFIGS!r}); strategies: collective (default), auto, allreduce, allgather, ring, "
                        "ps, hierarchical (hosts of --workers-per-node ranks); strategy parameters as @NAME:key=value, "
                        "e.g. qsgd@hierarchical:chunk=1048576")
    p.add_argument("--baselines", default=DEFAULT_BASELINES,
                   help=f"PyTorch baselines: ddp, fp16, powersgd:rank=R[,start=I] (default {DEFAULT_BASELINES!r}); "
                        "plain ddp always runs; +lr=X gives a baseline its own learning rate (ddp+lr=0.05)")
    p.add_argument("--steps", type=positive_int("--steps"), default=5, help="measured steps (default 5)")
    p.add_argument("--warmup", type=positive_int("--warmup"), default=2,
                   help="warm-up steps (default 2; at least the configuration's compression start)")
    p.add_argument("--batch-size", dest="batch_size", type=positive_int("--batch-size"), default=None,
                   help="batch size per worker (default: the workload's)")
    p.add_argument("--lr", type=float, default=None, help="learning rate (default: the workload's)")
    p.add_argument("--optimizer", default=None, metavar="NAME",
                   help="sgd, momentum or adam (default: the workload's; mnist1d-cnn: momentum)")
    p.add_argument("--threads", type=positive_int("--threads"), default=None,
                   help="torch threads per worker (default: max(1, cores // (nodes x workers per node)))")
    p.add_argument("--seed", type=int, default=0, help="seed of weights, data and shared randomness (default 0)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds allowed per configuration run (default 600)")
    p.add_argument("--train-to", dest="train_to", type=float, default=None, metavar="TARGET",
                   help="measure wall-clock time to reach this test metric instead of step time")
    p.add_argument("--eval-every", dest="eval_every", type=positive_int("--eval-every"), default=10,
                   help="train-to: evaluate every N steps (default 10)")
    p.add_argument("--max-steps", dest="max_steps", type=positive_int("--max-steps"), default=None,
                   help="train-to: stop after N steps (default: the workload's epochs)")
    p.add_argument("--time-limit", dest="time_limit", type=float, default=None,
                   help="train-to: stop a configuration after this many training seconds")
    p.add_argument("--seeds", default=None, metavar="N|LIST",
                   help="train-to: run at N seeds (--seed, --seed+1, ...) or a list (0,1,2), each in DIR/seed<S>/; "
                        "DIR/e2e.md gives mean ± std [min, max] over seeds, misses counted as not reached (k of N)")
    p.add_argument("--out", default="bench-results/e2e", metavar="DIR", help="output directory (default bench-results/e2e)")
    p.set_defaults(func=main)


def write_outputs(result: dict[str, Any], out: Path) -> list[Path]:
    from gradpress.bench.e2e_report import markdown, plot

    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "e2e.json", out / "e2e.md", out / "e2e.png"]
    paths[0].write_text(json.dumps(result, indent=2) + "\n")
    paths[1].write_text(markdown(result))
    plot(result, paths[2])
    return paths


def _seeds(args: argparse.Namespace) -> list[int] | None:
    from gradpress.compare_stats import parse_seeds

    if getattr(args, "seeds", None) is None:
        return None
    if args.train_to is None:
        raise ValueError("--seeds: only with --train-to (step times do not depend on the seed)")
    return parse_seeds(args.seeds, args.seed)


def main(args: argparse.Namespace) -> int:
    _resolve(args)  # every bad argument fails here, before a cluster is built
    seeds = _seeds(args)
    if seeds is not None:
        from gradpress.bench.e2e_seeds import run_seeds

        try:
            _, ok = run_seeds(args, seeds, command_line(args))
        except RuntimeError as exc:
            print(f"gradpress bench e2e: error: {exc}", file=sys.stderr)
            return 1
        print((Path(args.out) / "e2e.md").read_text())
        print(f"written: {args.out}/e2e.json, {args.out}/e2e.md, {args.out}/e2e.png, {args.out}/seed<S>/")
        return 0 if ok else 1
    try:
        result = run_e2e(args)
    except RuntimeError as exc:
        print(f"gradpress bench e2e: error: {exc}", file=sys.stderr)
        return 1
    paths = write_outputs(result, Path(args.out))
    print(paths[1].read_text())
    print("written: " + ", ".join(str(p) for p in paths))
    return 0 if all(r["ok"] for r in result["rows"]) else 1
