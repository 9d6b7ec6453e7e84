"""``gradpress bench plan``: fit the planner's cost model on the live group
once and write it to a file, so that ``strategy="auto"`` plans are the same
from run to run.

``gradpress bench plan --compressor topk:ratio=0.01 --nproc 4 --out costs.json``
starts the workers locally (or, under ``torchrun``, joins its group),
measures the collectives and the compressor on every rank
(:func:`gradpress.exchange.probe.measure`: median of repeated timings, the
slowest rank's figure per point, fitted on rank 0), prints the fitted model
and writes ``costs.json``. Reuse it with
``gradpress.ddp.register(ddp, spec, strategy="auto", plan_costs="costs.json")``
or ``gradpress train --strategy auto --plan-costs costs.json``. The file
records the compressor and world size it was measured with; both are checked
when it is used.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
import uuid
from pathlib import Path
from typing import Any

from gradpress.bench.args import check_file_path

__all__ = ["register_bench", "measure_costs"]


def register_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="fit the planner's cost model on this cluster and write it to a file",
                       description=__doc__.split("\n\n")[1].replace("\n", " "))
    p.add_argument("--compressor", default="none", metavar="SPEC", help="the compressor to plan for (default none)")
    p.add_argument("--nproc", type=int, default=2, help="local workers to start (ignored under torchrun; default 2)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="cpu (gloo) or cuda (nccl)")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions per point (median; default 5)")
    p.add_argument("--out", default="costs.json", metavar="FILE", help="where to write the cost model")
    p.set_defaults(func=main)


def measure_costs(compressor: str, device: str = "cpu", reps: int = 5) -> dict[str, Any]:
    """In a worker of an initialized group: measure and return the JSON
    mapping every rank agrees on."""
    import torch
    import torch.distributed as dist

    from gradpress.compress import create
    from gradpress.exchange.probe import measure

    comp = create(compressor)
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    model = measure(None, comp, device=dev, reps=reps)
    return model.to_json(compressor=comp.spec(), world_size=dist.get_world_size(), device=device,
                         backend=dist.get_backend(), reps=reps, host=socket.gethostname(),
                         measured=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))


def _worker(compressor: str, device: str, reps: int) -> dict[str, Any]:
    from gradpress import torch_compat
    from gradpress.train.launch import init_group

    created = init_group(device)
    try:
        return measure_costs(compressor, device, reps)
    finally:
        if created:
            torch_compat.destroy_process_group()


def main(args: argparse.Namespace) -> int:
    from gradpress.compress import create

    create(args.compressor)  # a bad spec fails here, before any worker starts
    from gradpress.train.config import check_nproc

    check_nproc(args.nproc, "--nproc")  # 4000 forked 4000 workers
    if args.reps < 1:
        raise ValueError(f"--reps must be an integer >= 1, got {args.reps}")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ValueError("--device got 'cuda' but CUDA is not available on this machine; allowed here: cpu")
    out = Path(args.out)
    check_file_path(out, "--out")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        result = _worker(args.compressor, args.device, args.reps)
        if int(os.environ["RANK"]) != 0:
            return 0
    else:
        from torch.distributed.launcher.api import LaunchConfig, elastic_launch

        from gradpress.train.launch import free_port

        launch = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=args.nproc, run_id=f"plan-{uuid.uuid4().hex[:8]}",
                              rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{free_port()}", max_restarts=0,
                              monitor_interval=0.1, start_method="spawn", local_addr="127.0.0.1")
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

        from gradpress.train.launch import describe_failures

        try:
            results = elastic_launch(launch, _worker)(args.compressor, args.device, args.reps)
        except ChildFailedError as exc:
            from torch.distributed import default_pg_timeout  # the group's timeout (init_group sets none)

            why = describe_failures(exc.failures, args.nproc, default_pg_timeout.total_seconds())
            print(f"gradpress bench plan: error: {why}", file=sys.stderr)
            return 1
        result = results[min(results)]
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    os.replace(tmp, out)
    print(f"cost model for {result['compressor']} on {result['world_size']} worker(s) ({result['device']}):")
    for field, (overhead, a, b) in result["fits"].items():
        print(f"  {field:10s} max({overhead:.3g}, {a:.3g} + {b:.3g} x)")
    print(f"written: {out}  (use: --strategy auto --plan-costs {out})")
    return 0
