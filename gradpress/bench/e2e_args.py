"""The arguments of ``gradpress bench e2e``: their validation into the job
settings every run shares, and the exact command line spelled back for the
report.

Invariant: every bad argument raises ``ValueError`` here, before any cluster
is built.
"""

from __future__ import annotations

import argparse
import math
import shlex
from pathlib import Path
from typing import Any

from gradpress.bench.args import check_threads
from gradpress.bench.e2e_configs import parse_baselines, parse_configs

__all__ = ["command_line"]


def _resolve(args: argparse.Namespace) -> dict[str, Any]:
    """Validate every argument before any cluster is built; return the job
    settings shared by every run."""
    from gradpress import workloads
    from gradpress.cluster import parse_rate
    from gradpress.cluster.netns import MAX_NODES, MAX_WORKERS_PER_NODE
    from gradpress.train.config import check_nproc, check_out, check_seed

    if not 2 <= args.nodes <= MAX_NODES:
        raise ValueError(f"--nodes got {args.nodes}; allowed: an integer >= 2 and <= {MAX_NODES}")
    rate = parse_rate(args.bandwidth, "--bandwidth")
    per = getattr(args, "workers_per_node", 1) or 1
    if not 1 <= per <= MAX_WORKERS_PER_NODE:
        raise ValueError(f"--workers-per-node got {per}; allowed: an integer >= 1 and <= {MAX_WORKERS_PER_NODE}")
    check_seed(args.seed, "--seed")
    if getattr(args, "intra_bandwidth", None) is not None:
        parse_rate(args.intra_bandwidth, "--intra-bandwidth")
        if per == 1:
            raise ValueError("--intra-bandwidth shapes traffic between a host's own workers; it needs --workers-per-node >= 2")
    world = args.nodes * per
    check_nproc(world, "--nodes x --workers-per-node")  # every worker is a local process, as --nproc's
    mode = "train" if args.train_to is not None else "step"
    default = "mnist1d-cnn" if mode == "train" else "wide-mlp"
    workload = default if args.workload is None else args.workload  # "" is refused, not the default
    if workload not in workloads.names():
        raise ValueError(f"--workload got {workload!r}; allowed: {', '.join(workloads.names())}")
    params = args.params
    if workload == "wide-mlp":
        from gradpress.workloads.wide import parse_count

        params = "10M" if params is None else params
        parse_count(params, "--params")
    elif params is not None:
        raise ValueError(f"--params sets the size of 'wide-mlp' only; --workload is {workload!r}")
    defaults = workloads.defaults(workload)
    lr = defaults["lr"] if args.lr is None else args.lr
    if not (isinstance(lr, (int, float)) and lr > 0 and lr < float("inf")):
        raise ValueError(f"--lr got {args.lr!r}; allowed: a positive finite number")
    from gradpress.train.optim import OPTIMIZERS

    optimizer = getattr(args, "optimizer", None)
    optimizer = defaults["optimizer"] if optimizer is None else optimizer
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"--optimizer got {optimizer!r}; allowed: {', '.join(OPTIMIZERS)}")
    for flag, value in (("--timeout", args.timeout), ("--time-limit", args.time_limit)):
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ValueError(f"{flag} got {value!r}; allowed: a finite number of seconds > 0")
    if args.train_to is not None:
        accuracy = workloads.get(workload).metric == "accuracy"
        if not (math.isfinite(args.train_to) and args.train_to > 0 and (args.train_to <= 1 or not accuracy)):
            raise ValueError(f"--train-to got {args.train_to!r}; allowed: a finite metric value > 0"
                             + (f", and <= 1 for an accuracy (workload {workload!r})" if accuracy else ""))
    configs = parse_baselines(args.baselines) + parse_configs(args.configs)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out got {args.out!r}, which is a file; allowed: a directory")
    check_out(str(out), "--out")  # one it cannot create or write in: now, not after the cluster's probe
    if getattr(args, "seeds", None) is not None and args.train_to is not None:
        from gradpress.compare_stats import parse_seeds

        parse_seeds(args.seeds, args.seed)
    cpus = check_threads(args.threads)
    return {
        "mode": mode, "workload": workload, "params": params, "hidden": args.hidden, "rate": rate,
        "batch_size": args.batch_size or defaults["batch_size"], "lr": float(lr),
        "optimizer": optimizer, "schedule": defaults["schedule"], "epochs": defaults["epochs"],
        "threads": args.threads or max(1, cpus // world), "configs": configs, "out": out, "cpus": cpus,
        "workers_per_node": per, "world": world,
    }


def command_line(args: argparse.Namespace) -> str:
    """The exact command, every option spelled out (reproducible from the report)."""
    parts = ["gradpress", "bench", "e2e", "--nodes", str(args.nodes), "--bandwidth", args.bandwidth]
    if (getattr(args, "workers_per_node", 1) or 1) > 1:
        parts += ["--workers-per-node", str(args.workers_per_node)]
    if getattr(args, "intra_bandwidth", None) is not None:
        parts += ["--intra-bandwidth", args.intra_bandwidth]
    if args.workload:
        parts += ["--workload", args.workload]
    for flag, value in (("--params", args.params), ("--hidden", args.hidden), ("--batch-size", args.batch_size),
                        ("--lr", args.lr), ("--optimizer", getattr(args, "optimizer", None)),
                        ("--threads", args.threads)):
        if value is not None:
            parts += [flag, str(value)]
    parts += ["--configs", args.configs, "--baselines", args.baselines, "--seed", str(args.seed)]
    if args.train_to is None:
        parts += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
    else:
        parts += ["--train-to", str(args.train_to), "--eval-every", str(args.eval_every)]
        if args.max_steps is not None:
            parts += ["--max-steps", str(args.max_steps)]
        if args.time_limit is not None:
            parts += ["--time-limit", str(args.time_limit)]
        if getattr(args, "seeds", None) is not None:
            parts += ["--seeds", str(args.seeds)]
    parts += ["--out", str(args.out)]
    return shlex.join(parts)
