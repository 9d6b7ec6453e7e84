"""One worker of ``gradpress bench e2e``: ``python3 -m gradpress.bench.e2e_worker --job JOB.json``.

The benchmark starts this module in every node of the emulated cluster (the
torchrun-style variables ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``... come
from :meth:`EmulatedCluster.run`). The job file says what to do:

* ``mode="step"``: DDP with one configuration (plain, a PyTorch hook, or the
  gradpress hook); ``warmup`` untimed steps, then ``steps`` timed steps, each
  timed on its own (``perf_counter`` around zero_grad + forward + backward
  + optimizer step; no barrier inside a step). Around the timed steps it
  reads the node's interface counters (``/proc/net/dev`` of the node's own
  network namespace: every byte of every Ethernet frame the link carried,
  both directions) and the gradpress hook's ``stats``.
* ``mode="compute"``: the same steps without DDP or any process group
  (world size 1); started in every node at once, so the CPU is shared as in
  the distributed runs; with ``solo``, rank 0 then waits until the other
  nodes have written their results and times the steps again, alone.
* ``mode="train"``: train the workload with the configuration until the
  test metric reaches ``target`` (checked every ``eval_every`` steps, with
  the clock paused while evaluating), or ``max_steps`` / ``time_limit``.

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

from gradpress.bench.e2e_configs import RunConfig
from gradpress.train import make_optimizer

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


def _init_group() -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")


def _wrap_ddp(model: torch.nn.Module, cfg: RunConfig, seed: int):
    """DDP around ``model`` with ``cfg``'s hook; returns (ddp, gradpress handle or None, bucket_cap_mb)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    bucket_cap_mb = None
    if cfg.single_bucket:
        total = sum(p.numel() * p.element_size() for p in model.parameters())
        bucket_cap_mb = math.ceil(total / 2**20) + 1  # one bucket: PowerSGD's hook on gloo needs it
    ddp = DDP(model, init_sync=False, broadcast_buffers=False, bucket_cap_mb=bucket_cap_mb)
    handle = None
    if cfg.kind == "torch-fp16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(dist.group.WORLD, default_hooks.fp16_compress_hook)
    elif cfg.kind == "torch-powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps

        state = ps.PowerSGDState(process_group=None, matrix_approximation_rank=cfg.rank,
                                 start_powerSGD_iter=cfg.start, min_compression_rate=2, use_error_feedback=True,
                                 warm_start=True, random_seed=seed)
        ddp.register_comm_hook(state, ps.powerSGD_hook)
    elif cfg.kind == "gradpress":
        import gradpress.ddp

        handle = gradpress.ddp.register(ddp, cfg.spec, strategy=cfg.strategy, seed=seed,
                                        error_feedback=cfg.error_feedback)
    elif cfg.kind != "ddp":
        raise ValueError(f"config kind {cfg.kind!r} is not one of ddp, torch-fp16, torch-powersgd, gradpress")
    return ddp, handle, bucket_cap_mb


def _buckets(ddp: Any) -> int | None:
    try:
        sizes = ddp._get_ddp_logging_data().get("rebuilt_bucket_sizes") or ddp._get_ddp_logging_data().get("bucket_sizes")
    except Exception:  # noqa: BLE001 - private API: report unknown instead of failing the run
        return None
    return len(str(sizes).split(",")) if sizes else None


def _write(job: dict[str, Any], rank: int, result: dict[str, Any]) -> None:
    path = Path(job["result_dir"]) / f"{job['tag']}-rank{rank}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    os.replace(tmp, path)


def _step(model: Any, opt: torch.optim.Optimizer, loss_fn: Any, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    opt.zero_grad(set_to_none=True)
    loss = loss_fn(model(batch[0]), batch[1])
    loss.backward()
    opt.step()
    return loss


# ------------------------------------------------------------------ modes
def run_compute(job: dict[str, Any]) -> dict[str, Any]:
    """Compute-only steps: forward + backward + optimizer, no communication."""
    rank = int(os.environ.get("RANK", "0"))
    wl = _build(job)
    model = wl.model
    opt = make_optimizer(job["optimizer"], model.parameters(), job["lr"])
    batches = _batches(wl, job["batch_size"], job["n_batches"], rank, job["seed"])
    for i in range(job["warmup"]):
        _step(model, opt, wl.loss, batches[i % len(batches)])

    def timed() -> list[float]:
        times = []
        for i in range(job["steps"]):
            t0 = time.perf_counter()
            _step(model, opt, wl.loss, batches[i % len(batches)])
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
    """Timed DDP steps of one configuration (see the module doc)."""
    import torch.distributed as dist

    cfg = RunConfig.from_dict(job["config"])
    _init_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = os.environ.get("GLOO_SOCKET_IFNAME")
    wl = _build(job)
    model = wl.model
    t_reg = time.perf_counter()
    ddp, hook, bucket_cap_mb = _wrap_ddp(model, cfg, job["seed"])
    register_s = time.perf_counter() - t_reg
    opt = make_optimizer(job["optimizer"], ddp.parameters(), job["lr"])
    batches = _batches(wl, job["batch_size"], job["n_batches"], rank, job["seed"])
    warmup = max(job["warmup"], cfg.start)
    for i in range(warmup):
        _step(ddp, opt, wl.loss, batches[i % len(batches)])
    dist.barrier()
    net0 = interface_bytes(dev) if dev else None
    stats0 = hook.stats if hook is not None else None
    times, losses = [], []
    for i in range(job["steps"]):
        t0 = time.perf_counter()
        loss = _step(ddp, opt, wl.loss, batches[(warmup + i) % len(batches)])
        times.append(time.perf_counter() - t0)
        losses.append(loss.detach())
    net1 = interface_bytes(dev) if dev else None
    n = job["steps"]
    result: dict[str, Any] = {
        "mode": "step", "rank": rank, "world_size": world, "label": cfg.label, "warmup": warmup, "steps": n,
        "step_s": times, "median_step_s": statistics.median(times), "register_s": register_s,
        "loss": [float(x) for x in losses], "parameters": sum(p.numel() for p in model.parameters()),
        "dense_bytes_per_step": sum(p.numel() * p.element_size() for p in model.parameters()),
        "bucket_cap_mb": bucket_cap_mb, "buckets": _buckets(ddp),
    }
    if net0 is not None and net1 is not None:
        result["link_rx_bytes_per_step"] = (net1[0] - net0[0]) / n
        result["link_tx_bytes_per_step"] = (net1[1] - net0[1]) / n
    if hook is not None:
        s1 = hook.stats
        steps = max(s1["steps"] - stats0["steps"], 1)
        result.update({
            "payload_bytes_per_step": (s1["bytes_sent"] - stats0["bytes_sent"]) / steps,
            "payload_source": "gradpress hook stats (bytes handed to collectives)",
            "compress_s_per_step": (s1["compress_s"] - stats0["compress_s"]) / steps,
            "comm_s_per_step": (s1["comm_s"] - stats0["comm_s"]) / steps,
            "compressed_tensors": s1["compressed_tensors"], "dense_tensors": s1["dense_tensors"],
            "strategy": hook.strategy_name,
            "plan": {k: [d.strategy, d.parts] for k, d in hook.plan.decisions.items()},
        })
        hook.close()
    else:
        result["payload_bytes_per_step"] = payload_bytes_per_step(model, cfg)
        result["payload_source"] = "computed from the parameter shapes"
    dist.barrier()
    dist.destroy_process_group()
    return result


def run_train(job: dict[str, Any]) -> dict[str, Any]:
    """Train until the test metric reaches ``job['target']`` (see the module doc)."""
    import torch.distributed as dist

    cfg = RunConfig.from_dict(job["config"])
    _init_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    wl = _build(job)
    model = wl.model
    ddp, hook, bucket_cap_mb = _wrap_ddp(model, cfg, job["seed"])
    opt = make_optimizer(job["optimizer"], ddp.parameters(), job["lr"])
    x, y = wl.train
    per_rank = len(y) // world
    bs = job["batch_size"]
    steps_per_epoch = per_rank // bs
    if steps_per_epoch < 1:
        raise ValueError(f"batch_size {bs} x {world} workers exceeds the {len(y)} training samples")
    horizon = job["epochs"] * steps_per_epoch
    max_steps = min(job["max_steps"] or horizon, horizon)
    # every epoch's batches of this rank, drawn before the clock starts
    batches: list[tuple[torch.Tensor, torch.Tensor]] = []
    for epoch in range(math.ceil(max_steps / steps_per_epoch)):
        g = torch.Generator().manual_seed(job["seed"] * 1_000_003 + epoch)
        order = torch.randperm(len(y), generator=g)[rank * per_rank:(rank + 1) * per_rank]
        for b in range(steps_per_epoch):
            idx = order[b * bs:(b + 1) * bs]
            batches.append((x[idx].contiguous(), y[idx].contiguous()))
    sign = 1.0 if wl.higher_is_better else -1.0
    history: list[dict[str, Any]] = []
    reached_at: dict[str, Any] | None = None
    dist.barrier()
    train_s = 0.0
    step = 0
    while step < max_steps:
        t0 = time.perf_counter()
        if job["schedule"] == "cosine":
            for group in opt.param_groups:
                group["lr"] = job["lr"] * 0.5 * (1.0 + math.cos(math.pi * step / horizon))
        _step(ddp, opt, wl.loss, batches[step])
        train_s += time.perf_counter() - t0
        step += 1
        if step % job["eval_every"] and step != max_steps:
            continue
        metric = _evaluate(wl, model, rank, world)
        # all ranks agree: the metric is all-reduced; time is rank 0's, broadcast
        t = torch.tensor([train_s], dtype=torch.float64)
        dist.broadcast(t, 0)
        history.append({"step": step, "seconds": float(t), "metric": metric})
        if sign * metric >= sign * job["target"]:
            reached_at = history[-1]
            break
        if job.get("time_limit") and float(t) > job["time_limit"]:
            break
    result = {
        "mode": "train", "rank": rank, "world_size": world, "label": cfg.label, "metric": wl.metric,
        "target": job["target"], "reached": reached_at is not None,
        "time_to_target_s": reached_at["seconds"] if reached_at else None,
        "steps_to_target": reached_at["step"] if reached_at else None,
        "steps": step, "train_s": train_s, "final_metric": history[-1]["metric"] if history else None,
        "best_metric": max((sign * h["metric"] for h in history), default=None),
        "history": history, "bucket_cap_mb": bucket_cap_mb, "buckets": _buckets(ddp),
        "parameters": sum(p.numel() for p in model.parameters()),
    }
    if result["best_metric"] is not None:
        result["best_metric"] *= sign
    if hook is not None:
        s = hook.stats
        result["payload_bytes_per_step"] = s["bytes_sent"] / max(s["steps"], 1)
        hook.close()
    else:
        result["payload_bytes_per_step"] = payload_bytes_per_step(model, cfg)
    dist.barrier()
    dist.destroy_process_group()
    return result


def _evaluate(wl: Any, model: torch.nn.Module, rank: int, world: int) -> float:
    import torch.distributed as dist

    x, y = wl.test
    idx = torch.arange(rank, len(y), world)
    total = torch.zeros(2, dtype=torch.float64)
    model.eval()
    with torch.no_grad():
        for chunk in idx.split(2048):
            s, n = wl.score(model(x[chunk]), y[chunk])
            total[0] += s
            total[1] += n
    model.train()
    dist.all_reduce(total)
    return float(total[0] / total[1].clamp_min(1))


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
    code = main()
    # the result is on disk: leave without interpreter teardown, where torch's
    # static destructors occasionally abort ("terminate called without an
    # active exception") and would turn a finished run into a failed one
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
