"""Per-step time of each synchronization strategy on one workload.

``python -m gradpress.bench.strategies --world 4 --steps 10`` spawns
``--world`` gloo workers on 127.0.0.1, builds the same MLP on each
(``--width`` hidden units: 1024 -> width -> 1024 -> 10, about 4.2 M
parameters at the default 2048), and for each (compressor, strategy) pair
trains ``--warmup`` + ``--steps`` steps of SGD on synthetic data through
``gradpress.ddp.register``. Reported per pair: median and mean step time on
rank 0 (forward, backward with the hook, optimizer step; ranks barrier before
each step so the times are comparable), bytes sent per step, and for
``auto`` the plan summary. Loopback numbers: they say what each strategy's
computation and message count cost, not what a slow network would.
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gradpress import torch_compat
from gradpress.bench.args import int_at_least, positive_int
from gradpress.compress import create
from gradpress.exchange.base import check_strategy

DEFAULT_PAIRS = (
    "none/allreduce", "none/ring", "none/ps", "none/auto",
    "topk:ratio=0.01/allgather", "topk:ratio=0.01/ring", "topk:ratio=0.01/ps", "topk:ratio=0.01/auto",
)


def build_model(width: int) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(1024, width), torch.nn.ReLU(), torch.nn.Linear(width, 1024), torch.nn.ReLU(),
        torch.nn.Linear(1024, 10),
    )


def _run_pair(rank: int, spec: str, strategy: str, args: argparse.Namespace) -> dict[str, Any]:
    import gradpress

    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(build_model(args.width))
    hook = gradpress.ddp.register(model, spec, strategy=strategy)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, 1024, generator=gen)
    y = torch.randint(0, 10, (args.batch,), generator=gen)
    times = []
    for step in range(args.warmup + args.steps):
        dist.barrier()
        t = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if step >= args.warmup:
            times.append(time.perf_counter() - t)
    stats = hook.stats
    plan = hook.plan.summary()
    hook.close()
    return {
        "median_ms": statistics.median(times) * 1e3, "mean_ms": statistics.mean(times) * 1e3,
        "bytes_per_step": stats["last_step_bytes"], "ratio": stats["ratio"], "plan": plan,
    }


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, outdir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    results = {}
    for pair in args.pairs:
        spec, strategy = pair.rsplit("/", 1)
        results[pair] = _run_pair(rank, spec, strategy, args)
    torch_compat.destroy_process_group()
    if rank == 0:
        torch.save(results, os.path.join(outdir, "results.pt"))


def run(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as outdir:
        mp.start_processes(_worker, args=(args.world, port, args, outdir), nprocs=args.world, join=True, start_method="spawn")
        return torch.load(os.path.join(outdir, "results.pt"), weights_only=True)  # numbers, strings, dicts


def format_table(results: dict[str, dict[str, Any]]) -> str:
    head = f"{'compressor/strategy':<28} {'median ms':>10} {'mean ms':>10} {'bytes/step':>12} {'ratio':>7}  plan"
    lines = [head, "-" * len(head)]
    for pair, r in results.items():
        plan = ", ".join(f"{k}={v}" for k, v in sorted(r["plan"].items()))
        lines.append(f"{pair:<28} {r['median_ms']:>10.1f} {r['mean_ms']:>10.1f} {r['bytes_per_step']:>12,} {r['ratio']:>7.1f}  {plan}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gradpress.bench.strategies", description=__doc__.splitlines()[0])
    p.add_argument("--world", type=positive_int("--world"), default=4)
    p.add_argument("--width", type=positive_int("--width"), default=2048)
    p.add_argument("--batch", type=positive_int("--batch"), default=32)
    p.add_argument("--steps", type=positive_int("--steps"), default=10)
    p.add_argument("--warmup", type=int_at_least("--warmup", 0), default=3)
    p.add_argument("--threads", type=positive_int("--threads"), default=1, help="torch threads per worker")
    p.add_argument("--pairs", nargs="+", default=list(DEFAULT_PAIRS), help="compressor/strategy pairs")
    args = p.parse_args(argv)
    for pair in args.pairs:
        if "/" not in pair:
            p.error(f"--pairs got {pair!r}; allowed: compressor/strategy, e.g. topk:ratio=0.01/ring")
        spec, strategy = pair.rsplit("/", 1)
        try:  # the workers' own checks, before any of them starts
            check_strategy(strategy, create(spec))
        except ValueError as exc:
            p.error(f"--pairs got {pair!r}: {exc}")
    nparams = sum(q.numel() for q in build_model(args.width).parameters())
    print(f"{args.world} workers (gloo, loopback), MLP {nparams:,} parameters, batch {args.batch}, "
          f"{args.steps} timed steps after {args.warmup} warm-up", flush=True)
    print(format_table(run(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
