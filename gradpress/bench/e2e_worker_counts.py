"""The figures a worker of ``gradpress bench e2e`` reports
(:mod:`gradpress.bench.e2e_worker`, which imports these): the link's bytes
from the interface counters, the payload of a PyTorch baseline by the
formula, and of a gradpress configuration the counters of its ``stats``
over the measured steps; DDP's buckets and the exchange plan.

Invariant: a gradpress configuration's payload is what it counted itself
(bytes handed to collectives, :data:`gradpress.exchange.stats.STATS_KEYS`),
taken as the difference of two readings around the measured steps, per
step; a baseline's is computed from the parameter shapes.
"""

from __future__ import annotations

from typing import Any

import torch

from gradpress.bench.e2e_configs import RunConfig


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


def step_counts(gp: Any, before: dict[str, Any]) -> dict[str, Any]:
    """Per measured step, the gradpress configuration ``gp``'s counters now
    less ``before`` (its ``stats`` read before the measured steps): payload
    and host bytes, compression and communication seconds, per strategy the
    bytes it handed over; the strategy and plan; for exchanges behind
    compute (their own clock), the busy and exposed seconds and the overlap."""
    s1 = gp.stats
    steps = max(s1["steps"] - before["steps"], 1)
    out = {
        "payload_bytes_per_step": (s1["bytes_sent"] - before["bytes_sent"]) / steps,
        "host_bytes_per_step": (s1["host_bytes"] - before["host_bytes"]) / steps,
        "payload_source": "gradpress stats (bytes handed to collectives)",
        "compress_s_per_step": (s1["compress_s"] - before["compress_s"]) / steps,
        "comm_s_per_step": (s1["comm_s"] - before["comm_s"]) / steps,
        "compressed_tensors": s1["compressed_tensors"], "dense_tensors": s1["dense_tensors"],
        "strategy": gp.describe()["strategy"], "plan": _plan(gp),
        # per strategy that handed them over (the plain allreduce of dense tensors: "uncompressed"), so that
        # the report counts each at its own wire factor
        "strategy_bytes_per_step": {name: (nbytes - before.get("strategy_bytes", {}).get(name, 0)) / steps
                                    for name, nbytes in s1.get("strategy_bytes", {}).items()},
    }
    if "exchange_s" in s1 and "exposed_s" in s1:  # exchanges behind compute (comprex): their own clock
        busy = s1["exchange_s"] - before["exchange_s"]
        waited = min(s1["exposed_s"] - before["exposed_s"], busy)
        out.update({"exchange_s_per_step": busy / steps, "exposed_s_per_step": waited / steps,
                    "overlap": (busy - waited) / busy if busy > 0 else None})
    return out
