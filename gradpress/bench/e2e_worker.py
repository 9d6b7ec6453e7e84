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
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from gradpress import torch_compat
from gradpress.bench.e2e_configs import RunConfig
from gradpress.train.evaluate import evaluate
from gradpress.train.loop import Tick, run_steps, shard_batches, steps_per_epoch, train_step
from gradpress.train.optim import make_optimizer
from gradpress.transport.groups import leave

__all__ = ["main", "payload_bytes_per_step", "interface_bytes"]


# ------------------------------------------------------------------ helpers
def interface_bytes(dev: str) -> tuple[int, int]:
    """``(rx_bytes, tx_bytes)`` of interface ``dev`` in this process's
    network namespace, from ``/proc/net/dev`` (per-namespace)."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, sep, rest = line.partition(":")
            if sep and name.strip() == dev:
                fields = rest.split()
                return int(fields[0]), int(fields[8])
    raise ValueError(f"interface {dev!r} not found in /proc/net/dev")


def payload_bytes_per_step(model: torch.nn.Module, cfg: RunConfig) -> int:
    """Bytes one worker hands to collectives per step for the PyTorch
    baselines (the gradpress hook counts its own): plain DDP allreduces every
    gradient in fp32, fp16 in half precision; PowerSGD (after its start
    iteration) allreduces P (n x r) and Q (m x r) in fp32 for every matrix
    (shape[0] x rest) where (n + m) r * 2 < n m (PyTorch's default
    ``min_compression_rate``), and the other tensors uncompressed."""
    total = 0
    for p in model.parameters():
        if not p.requires_grad:
            continue
        n_el, size = p.numel(), p.element_size()
        if cfg.kind == "torch-fp16":
            total += n_el * 2
        elif cfg.kind == "torch-powersgd" and p.dim() > 1:
            n = p.shape[0]
            m = n_el // n
            r = min(cfg.rank, n, m)
            total += (n + m) * r * size if (n + m) * r * 2 < n * m else n_el * size
        else:
            total += n_el * size
    return total


def _set_threads(job: dict[str, Any]) -> None:
    threads = job.get("threads")
    if threads:
        torch.set_num_threads(int(threads))
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass


def _build(job: dict[str, Any]):
    from gradpress import workloads

    torch.manual_seed(int(job["seed"]))
    opts = {k: job[k] for k in ("params", "hidden", "samples") if job.get(k) is not None}
    return workloads.build(job["workload"], **opts)


def _batches(wl: Any, batch_size: int, count: int, rank: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    x, y = wl.train
    g = torch.Generator().manual_seed(seed * 7919 + rank)
    out = []
    for _ in range(count):
        idx = torch.randint(0, len(y), (batch_size,), generator=g)
        out.append((x[idx].contiguous(), y[idx].contiguous()))
    return out


def _setup(job: dict[str, Any]) -> tuple[RunConfig, int, int, Any, torch.nn.Module, torch.optim.Optimizer]:
    """Join the group; the configuration, rank, world size, workload, model, optimizer."""
    import torch.distributed as dist

    if not dist.is_initialized():  # a test may run the worker inside its own group
        dist.init_process_group("gloo")
    wl = _build(job)
    opt = make_optimizer(job["optimizer"], wl.model.parameters(), job["lr"])
    return RunConfig.from_dict(job["config"]), dist.get_rank(), dist.get_world_size(), wl, wl.model, opt


def _finish(algo: Any) -> None:
    import torch.distributed as dist

    algo.close()
    dist.barrier()
    torch_compat.destroy_process_group()


class _TorchDDP:
    """A PyTorch baseline (plain DDP, or DDP with one of PyTorch's comm hooks)
    in the training loop's algorithm interface; the bare module (no DDP) for
    the compute-only steps."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, ddp: Any = None) -> None:
        self.module, self.model, self.step = model, (ddp if ddp is not None else model), optimizer.step

    def eval_model(self) -> torch.nn.Module:
        return self.module

    def close(self) -> None:
        pass


def _build_algorithm(model: torch.nn.Module, opt: torch.optim.Optimizer, cfg: RunConfig, seed: int):
    """What runs ``cfg``: (algorithm, gradpress stats source or None, bucket_cap_mb).
    gradpress configurations go through the training package's algorithms
    (``ddp``: DDP + the gradpress hook); the PyTorch baselines wrap DDP with
    PyTorch's own hooks."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    bucket_cap_mb = None
    if cfg.single_bucket:  # one bucket: PowerSGD's hook on gloo needs it
        bucket_cap_mb = math.ceil(sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20) + 1
    ddp_options = {"init_sync": False, "broadcast_buffers": False, "bucket_cap_mb": bucket_cap_mb}
    if cfg.kind == "gradpress":
        from gradpress.train.algorithm import create

        algo = create(cfg.algorithm, model, opt, compressor=cfg.spec, strategy=cfg.strategy, seed=seed,
                      error_feedback=cfg.error_feedback, ddp_options=ddp_options if cfg.algorithm == "ddp" else None)
        return algo, algo, bucket_cap_mb
    if cfg.kind not in ("ddp", "torch-fp16", "torch-powersgd"):
        raise ValueError(f"config kind {cfg.kind!r} is not one of ddp, torch-fp16, torch-powersgd, gradpress")
    ddp = DDP(model, **torch_compat.ddp_kwargs(ddp_options))
    if cfg.kind == "torch-fp16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(dist.group.WORLD, default_hooks.fp16_compress_hook)
    elif cfg.kind == "torch-powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps

        state = ps.PowerSGDState(process_group=None, matrix_approximation_rank=cfg.rank,
                                 start_powerSGD_iter=cfg.start, min_compression_rate=2, use_error_feedback=True,
                                 warm_start=True, random_seed=seed)
        ddp.register_comm_hook(state, ps.powerSGD_hook)
    return _TorchDDP(model, opt, ddp), None, bucket_cap_mb


def _buckets(algo: Any) -> int | None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = algo.model
    if not isinstance(ddp, DDP):
        return None  # not DDP: an algorithm that exchanges on its own
    try:
        sizes = ddp._get_ddp_logging_data().get("rebuilt_bucket_sizes") or ddp._get_ddp_logging_data().get("bucket_sizes")
    except Exception:  # noqa: BLE001 - private API: report unknown instead of failing the run
        return None
    return len(str(sizes).split(",")) if sizes else None


def _plan(algo: Any) -> dict[str, list[Any]]:
    """Per tensor, [strategy, parts] of the gradpress hook's plan; an algorithm
    without DDP reports its one strategy for every tensor."""
    from gradpress.train.algorithm import DDPAlgorithm

    if isinstance(algo, DDPAlgorithm):
        return {k: [d.strategy, d.parts] for k, d in algo.hook.plan.decisions.items()}
    return {"*": [algo.describe()["strategy"], 1]}


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
        s1 = gp.stats
        steps = max(s1["steps"] - stats0["steps"], 1)
        result.update({
            "payload_bytes_per_step": (s1["bytes_sent"] - stats0["bytes_sent"]) / steps,
            "host_bytes_per_step": (s1["host_bytes"] - stats0["host_bytes"]) / steps,
            "payload_source": "gradpress stats (bytes handed to collectives)",
            "compress_s_per_step": (s1["compress_s"] - stats0["compress_s"]) / steps,
            "comm_s_per_step": (s1["comm_s"] - stats0["comm_s"]) / steps,
            "compressed_tensors": s1["compressed_tensors"], "dense_tensors": s1["dense_tensors"],
            "strategy": gp.describe()["strategy"], "plan": _plan(gp),
            # per strategy that handed them over (the plain allreduce of dense tensors: "uncompressed"), so that
            # the report counts each at its own wire factor
            "strategy_bytes_per_step": {name: (nbytes - stats0.get("strategy_bytes", {}).get(name, 0)) / steps
                                        for name, nbytes in s1.get("strategy_bytes", {}).items()},
        })
        if "exchange_s" in s1 and "exposed_s" in s1:  # exchanges behind compute (comprex): their own clock
            busy = s1["exchange_s"] - stats0["exchange_s"]
            waited = min(s1["exposed_s"] - stats0["exposed_s"], busy)
            result.update({"exchange_s_per_step": busy / steps, "exposed_s_per_step": waited / steps,
                           "overlap": (busy - waited) / busy if busy > 0 else None})
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
