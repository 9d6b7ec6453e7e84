"""What one worker of ``gradpress bench e2e`` runs, built from its job
(:mod:`gradpress.bench.e2e_worker`, which imports these): its threads, the
workload and the batches it draws, the group it joins and leaves, and the
configuration's algorithm: a gradpress one through the training package,
or a PyTorch baseline (plain DDP, DDP with PyTorch's fp16 or PowerSGD comm
hook) behind the same interface.

Invariant: every rank builds the identical model from the same seed, so DDP
is built with ``init_sync=False`` (its parameter broadcast would measure
nothing); each rank draws its own batches, from its rank and the seed, before
any clock starts.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from gradpress import torch_compat
from gradpress.bench.e2e_configs import RunConfig
from gradpress.train.optim import make_optimizer


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
