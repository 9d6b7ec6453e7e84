"""One worker of ``gradpress bench e2e``: ``python3 -m gradpress.bench.e2e_worker --job JOB.json``.

The benchmark starts this module in every node of the emulated cluster (the
torchrun-style variables ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``... come
from :meth:`EmulatedCluster.run`). The job file says what to do:

* ``mode="step"``: one configuration (plain DDP, DDP with a PyTorch hook,
  or a gradpress algorithm: ``ddp`` is DDP with the gradpress hook);
  ``warmup`` untimed steps, then ``steps`` timed steps, each timed on its own
  (``perf_counter`` around :func:`gradpress.train.loop.train_step`: zero_grad
  + forward + backward + the algorithm's step; no barrier inside a step).
  Around the timed steps it reads the node's interface counters
  (``/proc/net/dev`` of the node's own network namespace: every byte of
  every Ethernet frame the link carried, both directions) and the gradpress
  ``stats``.
* ``mode="compute"``: the same steps without DDP or any process group
  (world size 1); started in every node at once, so the CPU is shared as in
  the distributed runs; with ``solo``, rank 0 then waits until the other
  nodes have written their results and times the steps again, alone.
* ``mode="train"``: train the workload with the configuration until the
  test metric reaches ``target`` (checked every ``eval_every`` steps, with
  the clock paused while evaluating), or ``max_steps`` / ``time_limit``;
  through the training package's loop, data order and evaluation
  (:func:`~gradpress.train.loop.run_steps`, :func:`~gradpress.train.evaluate.evaluate`).

Batches are drawn from the workload's in-memory data before the clock
starts (the timed loop only indexes a list). Every rank writes
``<result_dir>/<tag>-rank<r>.json``.

Invariant: every rank builds the identical model from the same seed, so DDP
is built with ``init_sync=False`` (its 40 MB parameter broadcast at 100 Mbit
would cost seconds per configuration and measure nothing).

Modules, one job each: this one (the modes: what is timed and how, the
result file, the command line), what a worker runs built from its job
(:mod:`gradpress.bench.e2e_worker_setup`: threads, workload, batches,
group, algorithm or PyTorch baseline), the figures it reports
(:mod:`gradpress.bench.e2e_worker_counts`: link, payload and ``stats``
counters, buckets, plan). The modes look the helpers up in this module.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from gradpress.bench.e2e_worker_counts import _buckets, interface_bytes, payload_bytes_per_step, step_counts
from gradpress.bench.e2e_worker_setup import (
    _batches,
    _build,
    _build_algorithm,
    _finish,
    _set_threads,
    _setup,
    _TorchDDP,
)
from gradpress.train.evaluate import evaluate
from gradpress.train.loop import Tick, run_steps, shard_batches, steps_per_epoch, train_step
from gradpress.train.optim import make_optimizer
from gradpress.transport.groups import leave

__all__ = ["main", "payload_bytes_per_step", "interface_bytes"]


def _write(job: dict[str, Any], rank: int, result: dict[str, Any]) -> None:
    path = Path(job["result_dir"]) / f"{job['tag']}-rank{rank}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    os.replace(tmp, path)


# ------------------------------------------------------------------ modes
def run_compute(job: dict[str, Any]) -> dict[str, Any]:
    """Compute-only steps: forward + backward + optimizer, no communication."""
    rank = int(os.environ.get("RANK", "0"))
    wl = _build(job)
    model = wl.model
    opt = make_optimizer(job["optimizer"], model.parameters(), job["lr"])
    local = _TorchDDP(model, opt)
    batches = _batches(wl, job["batch_size"], job["n_batches"], rank, job["seed"])
    for i in range(job["warmup"]):
        train_step(local, opt, wl.loss, *batches[i % len(batches)])

    def timed() -> list[float]:
        times = []
        for i in range(job["steps"]):
            t0 = time.perf_counter()
            train_step(local, opt, wl.loss, *batches[i % len(batches)])
            times.append(time.perf_counter() - t0)
        return times

    shared = timed()
    result: dict[str, Any] = {"mode": "compute", "rank": rank, "step_s": shared,
                              "median_step_s": statistics.median(shared),
                              "parameters": sum(p.numel() for p in model.parameters())}
    if job.get("solo") and rank == 0:
        # then alone: wait (file barrier, no process group) until every other node has finished
        world = int(os.environ.get("WORLD_SIZE", "1"))
        done = [Path(job["result_dir"]) / f"{job['tag']}-rank{r}.json" for r in range(1, world)]
        deadline = time.monotonic() + 300
        while not all(p.exists() for p in done) and time.monotonic() < deadline:
            time.sleep(0.05)
        solo = timed()
        result["solo_step_s"] = solo
        result["solo_median_step_s"] = statistics.median(solo)
    return result


def run_step(job: dict[str, Any]) -> dict[str, Any]:
    """Timed steps of one configuration (see the module doc)."""
    import torch.distributed as dist

    cfg, rank, world, wl, model, opt = _setup(job)
    dev = os.environ.get("GLOO_SOCKET_IFNAME")
    t_reg = time.perf_counter()
    algo, gp, bucket_cap_mb = _build_algorithm(model, opt, cfg, job["seed"])
    register_s = time.perf_counter() - t_reg
    batches = _batches(wl, job["batch_size"], job["n_batches"], rank, job["seed"])
    warmup = max(job["warmup"], cfg.start)
    for i in range(warmup):
        train_step(algo, opt, wl.loss, *batches[i % len(batches)])
    dist.barrier()
    net0 = interface_bytes(dev) if dev else None
    stats0 = gp.stats if gp is not None else None
    times, losses = [], []
    for i in range(job["steps"]):
        t0 = time.perf_counter()
        loss = train_step(algo, opt, wl.loss, *batches[(warmup + i) % len(batches)])
        times.append(time.perf_counter() - t0)
        losses.append(loss.detach())
    net1 = interface_bytes(dev) if dev else None
    n = job["steps"]
    result: dict[str, Any] = {
        "mode": "step", "rank": rank, "world_size": world, "label": cfg.label, "warmup": warmup, "steps": n,
        "step_s": times, "median_step_s": statistics.median(times), "register_s": register_s,
        "loss": [float(x) for x in losses], "parameters": sum(p.numel() for p in model.parameters()),
        "dense_bytes_per_step": sum(p.numel() * p.element_size() for p in model.parameters()),
        "bucket_cap_mb": bucket_cap_mb, "buckets": _buckets(algo),
    }
    if net0 is not None and net1 is not None:
        result["link_rx_bytes_per_step"] = (net1[0] - net0[0]) / n
        result["link_tx_bytes_per_step"] = (net1[1] - net0[1]) / n
    if gp is not None and stats0 is not None:
        result.update(step_counts(gp, stats0))
    else:
        result["payload_bytes_per_step"] = payload_bytes_per_step(model, cfg)
        result["payload_source"] = "computed from the parameter shapes"
    _finish(algo)
    return result


def run_train(job: dict[str, Any]) -> dict[str, Any]:
    """Train until the test metric reaches ``job['target']`` (see the module doc),
    through the training package's loop (:func:`gradpress.train.loop.run_steps`)."""
    import torch.distributed as dist

    cfg, rank, world, wl, model, opt = _setup(job)
    algo, gp, bucket_cap_mb = _build_algorithm(model, opt, cfg, job["seed"])
    x, y = wl.train
    horizon = job["epochs"] * steps_per_epoch(len(y), world, job["batch_size"], job["workload"])
    max_steps = min(job["max_steps"] or horizon, horizon)
    # this rank's batches (the epoch permutations, sharded), drawn before the clock starts
    batches = list(shard_batches(x, y, seed=job["seed"], rank=rank, world=world, batch_size=job["batch_size"],
                                 epochs=job["epochs"], count=max_steps))
    sign = 1.0 if wl.higher_is_better else -1.0
    history: list[dict[str, Any]] = []
    clock = {"train_s": 0.0}

    def after(t: Tick) -> bool:
        clock["train_s"] += t.seconds
        if t.step % job["eval_every"] and t.step != max_steps:
            return False
        metric = evaluate(wl, algo.eval_model(), rank=rank, world=world, chunk=2048)
        # all ranks agree: the metric is all-reduced; time is rank 0's, broadcast
        now = torch.tensor([clock["train_s"]], dtype=torch.float64)
        dist.broadcast(now, 0)
        history.append({"step": t.step, "seconds": float(now), "metric": metric})
        if sign * metric >= sign * job["target"]:
            return True
        return bool(job.get("time_limit") and float(now) > job["time_limit"])

    dist.barrier()
    step = run_steps(algo, opt, wl.loss, batches, lr=job["lr"], schedule=job["schedule"], horizon=horizon,
                     after=after)
    reached_at = history[-1] if history and sign * history[-1]["metric"] >= sign * job["target"] else None
    result = {
        "mode": "train", "rank": rank, "world_size": world, "label": cfg.label, "metric": wl.metric,
        "higher_is_better": wl.higher_is_better,
        "target": job["target"], "reached": reached_at is not None,
        "time_to_target_s": reached_at["seconds"] if reached_at else None,
        "steps_to_target": reached_at["step"] if reached_at else None,
        "steps": step, "train_s": clock["train_s"], "final_metric": history[-1]["metric"] if history else None,
        "best_metric": max((sign * h["metric"] for h in history), default=None),
        "history": history, "bucket_cap_mb": bucket_cap_mb, "buckets": _buckets(algo),
        "parameters": sum(p.numel() for p in model.parameters()),
    }
    if result["best_metric"] is not None:
        result["best_metric"] *= sign
    if gp is not None:
        s = gp.stats
        result["payload_bytes_per_step"] = s["bytes_sent"] / max(s["steps"], 1)
    else:
        result["payload_bytes_per_step"] = payload_bytes_per_step(model, cfg)
    _finish(algo)
    return result


MODES = {"compute": run_compute, "step": run_step, "train": run_train}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m gradpress.bench.e2e_worker",
                                description="One worker of 'gradpress bench e2e' (started by the benchmark).")
    p.add_argument("--job", required=True, help="job file (JSON) written by the benchmark")
    args = p.parse_args(argv)
    job = json.loads(Path(args.job).read_text())
    if job.get("mode") not in MODES:
        print(f"e2e_worker: job mode {job.get('mode')!r} is not one of {', '.join(MODES)}", file=sys.stderr)
        return 2
    _set_threads(job)
    result = MODES[job["mode"]](job)
    _write(job, int(os.environ.get("RANK", "0")), result)
    return 0


if __name__ == "__main__":
    leave(main())  # the result is on disk: no interpreter teardown (see leave)
