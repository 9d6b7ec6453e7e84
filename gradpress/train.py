"""The training loop behind ``gradpress train``: one process per worker, DDP
with the gradpress comm hook, sharded data, metrics, checkpoints, resume.

Entry points:

* ``gradpress train [flags]`` / ``python -m gradpress.train [flags]`` (also
  ``torchrun --nproc-per-node N -m gradpress.train ...``);
* ``gradpress.train.run(config) -> summary`` for Python callers (compare,
  benchmarks); ``config`` is a dict, an ``argparse.Namespace`` or a
  :class:`TrainConfig`.

Process group: inside an initialized group, use it; with ``nproc`` start that
many local workers through PyTorch's elastic launcher (the code torchrun
runs; c10d rendezvous on 127.0.0.1, free port); under torchrun join from
``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``; otherwise a
one-process gloo group, so DDP and the hook still run. Backend gloo on CPU,
nccl with ``device="cuda"``.

Invariants:

* Data: every epoch is a permutation of the training set drawn from
  (seed, epoch) alone; rank r trains on slice r of it (equal-sized, disjoint
  shards; the remainder of N // world is dropped). So the position in the
  data is fully described by (epoch, batch), which checkpoints record.
* Resume is exact: a checkpoint (written atomically by rank 0 after every
  epoch and at the end) holds the model, the optimizer, *every rank's* hook
  state (residuals differ between ranks) and RNG states, and the data
  position; on CPU the losses after resuming equal, bit for bit, those of a
  run that never stopped.
* All ranks agree on every logged number: losses and metrics are
  all-reduced (metrics over a sharded test set); byte counts are rank 0's
  ``hook.stats`` (the bytes that rank actually handed to collectives).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import socket
import statistics
import sys
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from gradpress import workloads

__all__ = ["TrainConfig", "run", "make_config", "add_arguments", "main", "OPTIMIZERS"]

OPTIMIZERS = ("sgd", "momentum", "adam")
SCHEDULES = ("constant", "cosine")
CHECKPOINT = "checkpoint.pt"
METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
_CKPT_FORMAT = "gradpress-train/1"


@dataclasses.dataclass
class TrainConfig:
    """Every training option. ``None`` means "the workload's default"."""

    workload: str | None = None
    data: str | None = None
    compressor: str = "none"
    strategy: str = "auto"
    error_feedback: str = "auto"
    epochs: int | None = None
    steps: int | None = None
    batch_size: int | None = None
    lr: float | None = None
    optimizer: str | None = None
    schedule: str | None = None
    seed: int = 0
    out: str = "runs/train"
    resume: bool = False
    device: str = "cpu"
    log_every: int = 10
    eval_every: int = 0
    nproc: int | None = None
    min_numel: int = 1024
    hidden: int | None = None
    params: str | None = None
    samples: int | None = None
    text_bytes: int | None = None
    progress: bool = True


FIELDS = tuple(f.name for f in dataclasses.fields(TrainConfig))
# changing these between a checkpoint and --resume would not continue the same run
_RESUME_FIXED = ("workload", "data", "hidden", "params", "samples", "text_bytes", "compressor", "strategy",
                 "error_feedback", "optimizer", "schedule", "batch_size", "seed", "min_numel")


# ---------------------------------------------------------------- configuration
def _load_toml(path: str) -> dict[str, Any]:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except FileNotFoundError:
        raise ValueError(f"config file {path!r} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"config file {path!r} is not valid TOML: {exc}") from None
    out: dict[str, Any] = {}
    for key, value in raw.items():
        name = key.replace("-", "_")
        if name not in FIELDS or name == "config":
            raise ValueError(f"config file {path!r}: unknown key {key!r}; allowed: {', '.join(FIELDS)}")
        out[name] = value
    return out


def _int(name: str, value: Any, low: int | None = None, optional: bool = False) -> int | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer{'' if low is None else f' >= {low}'}, got {value!r}")
    if low is not None and value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return int(value)


def _choice(name: str, value: Any, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")
    return value


def make_config(config: Mapping[str, Any] | argparse.Namespace | TrainConfig | None = None,
                **overrides: Any) -> TrainConfig:
    """Merge defaults < the TOML file named by ``config`` (key ``config``) <
    explicit values, fill workload defaults and validate everything.
    Raises ValueError naming the field, the value and what is allowed."""
    if config is None:
        given: dict[str, Any] = {}
    elif isinstance(config, TrainConfig):
        given = dataclasses.asdict(config)
    elif isinstance(config, argparse.Namespace):
        given = {k: v for k, v in vars(config).items() if k in FIELDS or k == "config"}
    elif isinstance(config, Mapping):
        given = {str(k).replace("-", "_"): v for k, v in config.items()}
    else:
        raise ValueError(f"config must be a dict, an argparse.Namespace or a TrainConfig, got {type(config).__name__}")
    given.update({k.replace("-", "_"): v for k, v in overrides.items()})
    unknown = [k for k in given if k not in FIELDS and k != "config"]
    if unknown:
        raise ValueError(f"unknown training option(s) {', '.join(map(repr, unknown))}; allowed: {', '.join(FIELDS)}")
    merged: dict[str, Any] = {}
    if given.get("config"):
        merged.update(_load_toml(str(given["config"])))
    merged.update({k: v for k, v in given.items() if k != "config"})
    cfg = TrainConfig(**merged)
    return _validate(cfg)


def _validate(cfg: TrainConfig) -> TrainConfig:
    if cfg.data is not None:
        if cfg.workload not in (None, "data-mlp"):
            raise ValueError(f"data: --data trains the 'data-mlp' workload, but workload={cfg.workload!r} was given")
        cfg.workload = "data-mlp"
        if not isinstance(cfg.data, (str, os.PathLike)):
            raise ValueError(f"data must be a path to a .npz file, got {cfg.data!r}")
        cfg.data = str(cfg.data)
    if cfg.workload is None:
        cfg.workload = workloads.DEFAULT
    if not isinstance(cfg.workload, str) or cfg.workload not in workloads.names():
        raise ValueError(f"unknown workload {cfg.workload!r}; allowed: {', '.join(workloads.names())}")
    if cfg.workload == "data-mlp" and cfg.data is None:
        raise ValueError("data: workload 'data-mlp' needs --data PATH.npz (arrays x and y)")
    for key, value in workloads.defaults(cfg.workload).items():
        if getattr(cfg, key) is None:
            setattr(cfg, key, value)
    cfg.epochs = _int("epochs", cfg.epochs, 1)
    cfg.steps = _int("steps", cfg.steps, 1, optional=True)
    cfg.batch_size = _int("batch_size", cfg.batch_size, 1)
    cfg.seed = _int("seed", cfg.seed, 0)
    cfg.log_every = _int("log_every", cfg.log_every, 1)
    cfg.eval_every = _int("eval_every", cfg.eval_every, 0)
    cfg.nproc = _int("nproc", cfg.nproc, 1, optional=True)
    cfg.min_numel = _int("min_numel", cfg.min_numel, 0)
    cfg.hidden = _int("hidden", cfg.hidden, 1, optional=True)
    cfg.samples = _int("samples", cfg.samples, 1, optional=True)
    cfg.text_bytes = _int("text_bytes", cfg.text_bytes, 1000, optional=True)
    if isinstance(cfg.lr, bool) or not isinstance(cfg.lr, (int, float)) or not math.isfinite(cfg.lr) or cfg.lr <= 0:
        raise ValueError(f"lr must be a positive finite number, got {cfg.lr!r}")
    cfg.lr = float(cfg.lr)
    cfg.optimizer = _choice("optimizer", cfg.optimizer, OPTIMIZERS)
    cfg.schedule = _choice("schedule", cfg.schedule, SCHEDULES)
    if isinstance(cfg.error_feedback, bool):
        cfg.error_feedback = "on" if cfg.error_feedback else "off"
    cfg.error_feedback = _choice("error_feedback", cfg.error_feedback, ("on", "off", "auto"))
    cfg.device = _choice("device", cfg.device, ("cpu", "cuda"))
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but torch.cuda.is_available() is False; allowed here: cpu")
    for name in ("resume", "progress"):
        if not isinstance(getattr(cfg, name), bool):
            raise ValueError(f"{name} must be true or false, got {getattr(cfg, name)!r}")
    if not isinstance(cfg.out, (str, os.PathLike)) or not str(cfg.out):
        raise ValueError(f"out must be a directory path, got {cfg.out!r}")
    cfg.out = str(cfg.out)
    if cfg.params is not None:
        if cfg.workload != "wide-mlp":
            raise ValueError(f"params sets the size of 'wide-mlp' only; workload is {cfg.workload!r}")
        from gradpress.workloads.wide import parse_count

        parse_count(cfg.params)
        cfg.params = str(cfg.params)
    if not isinstance(cfg.compressor, str):
        raise ValueError(f"compressor must be a spec string like 'topk:ratio=0.01', got {cfg.compressor!r}")
    from gradpress.compress import create

    create(cfg.compressor)  # raises ValueError naming the bad name / parameter
    if not isinstance(cfg.strategy, str):
        raise ValueError(f"strategy must be a string, got {cfg.strategy!r}")
    if cfg.strategy != "auto":
        from gradpress.comm import available

        if cfg.strategy not in available():
            raise ValueError(f"unknown strategy {cfg.strategy!r}; allowed: {', '.join(available())}")
    if cfg.data is not None:
        from gradpress.workloads.userdata import read

        read(cfg.data)  # fail before starting workers
    return cfg


# ---------------------------------------------------------------- argparse
def add_arguments(p: argparse.ArgumentParser, *, compare: bool = False) -> None:
    """Training flags. Defaults are left out of the namespace (SUPPRESS) so
    that a ``--config`` file can sit between built-in defaults and flags."""
    S = argparse.SUPPRESS
    p.add_argument("--workload", default=S, help=f"built-in workload (default {workloads.DEFAULT}): "
                   + ", ".join(workloads.names()))
    p.add_argument("--data", default=S, metavar="PATH.npz", help="train an MLP classifier on your data (arrays x, y)")
    if not compare:
        p.add_argument("--compressor", default=S, metavar="SPEC", help="compressor spec (default none), e.g. topk:ratio=0.01")
    choices = "collective, allreduce, allgather, ring, ps"
    if compare:
        p.add_argument("--strategy", default=S, help="every run's strategy (default: each compressor's general one, "
                       "allreduce if summable, else allgather, so every method is exercised); also auto (the planner), " + choices)
    else:
        p.add_argument("--strategy", default=S, help="auto (default: the planner decides per tensor), collective (always "
                       "compress: allreduce if summable, else allgather), allreduce, allgather, ring, ps")
    p.add_argument("--error-feedback", dest="error_feedback", default=S, metavar="on|off|auto",
                   help="residual error feedback (auto: the compressor's default)")
    p.add_argument("--epochs", type=int, default=S, help="epochs (default: the workload's)")
    p.add_argument("--steps", type=int, default=S, help="cap on the total number of steps")
    p.add_argument("--batch-size", dest="batch_size", type=int, default=S, help="batch size per worker")
    p.add_argument("--lr", type=float, default=S, help="learning rate (default: the workload's)")
    p.add_argument("--optimizer", default=S, metavar="sgd|momentum|adam", help="default: the workload's")
    p.add_argument("--schedule", default=S, metavar="constant|cosine",
                   help="learning rate schedule over epochs x steps per epoch (--steps only truncates it)")
    p.add_argument("--seed", type=int, default=S, help="seed for weights, data order and shared randomness (default 0)")
    p.add_argument("--out", default=S, metavar="DIR", help="output directory")
    p.add_argument("--config", default=S, metavar="FILE.toml", help="read options from a TOML file; flags override it")
    if not compare:
        p.add_argument("--resume", action="store_true", default=S, help="continue from DIR/checkpoint.pt")
    p.add_argument("--device", default=S, metavar="cpu|cuda", help="cpu (gloo, default) or cuda (nccl)")
    p.add_argument("--log-every", dest="log_every", type=int, default=S, help="log every N steps (default 10)")
    p.add_argument("--eval-every", dest="eval_every", type=int, default=S,
                   help="also evaluate every N steps (default 0: at epoch ends only)")
    p.add_argument("--nproc", type=int, default=S, help="start N local workers (torch elastic launcher, gloo on 127.0.0.1)")
    p.add_argument("--min-numel", dest="min_numel", type=int, default=S,
                   help="tensors smaller than this are not compressed (default 1024)")
    p.add_argument("--hidden", type=int, default=S, help="hidden width / channels of the workload's model")
    p.add_argument("--params", default=S, help="wide-mlp parameter count, e.g. 500K, 10M")
    p.add_argument("--samples", type=int, default=S, help="use only the first N training samples (N//4 test)")
    p.add_argument("--text-bytes", dest="text_bytes", type=int, default=S, help="charlm-lstm corpus size in bytes")
    p.add_argument("--no-progress", dest="progress", action="store_false", default=S, help="no progress bar")


# ---------------------------------------------------------------- launching
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _in_group_env() -> bool:
    return dist.is_initialized() or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def run(config: Mapping[str, Any] | argparse.Namespace | TrainConfig | None = None, **overrides: Any) -> dict[str, Any]:
    """Train and return the summary (also written to ``out/summary.json``).

    With ``nproc`` set and no process group around, starts ``nproc`` local
    workers and returns rank 0's summary; otherwise trains in this process
    (joining torchrun's group, or alone)."""
    cfg = make_config(config, **overrides)
    if cfg.nproc is not None and not _in_group_env():
        return _launch(cfg)
    return _train(cfg)


def _worker_entry(cfg_dict: dict[str, Any]) -> dict[str, Any]:
    try:
        return {"ok": _train(TrainConfig(**cfg_dict))}
    except ValueError as exc:
        return {"value_error": str(exc)}


def _start_method(device: str) -> str:
    """fork on Linux CPU runs: workers start in well under a second instead
    of re-importing torch (seconds each); spawn where fork is unsafe (CUDA,
    other platforms)."""
    return "fork" if device == "cpu" and sys.platform.startswith("linux") else "spawn"


def _preload(cfg: TrainConfig) -> None:
    """Import what workers need and build the data once in the parent:
    forked workers inherit it (imports cost seconds on a busy machine), and
    generated data land in the cache before workers look for them."""
    import torch._dynamo  # noqa: F401 - DDP imports it on construction
    import tqdm  # noqa: F401

    import gradpress.ddp  # noqa: F401

    workloads.build(cfg.workload, data=cfg.data, hidden=cfg.hidden, params=cfg.params,
                    samples=cfg.samples, text_bytes=cfg.text_bytes)


def _launch(cfg: TrainConfig) -> dict[str, Any]:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    assert cfg.nproc is not None
    launch = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=cfg.nproc, run_id=f"gradpress-{uuid.uuid4().hex[:12]}",
        rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{free_port()}", max_restarts=0, monitor_interval=0.1,
        start_method=_start_method(cfg.device), local_addr="127.0.0.1",
    )
    _preload(cfg)
    old = os.environ.get("OMP_NUM_THREADS")
    if old is None and cfg.device == "cpu":  # what torchrun does for several local workers
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // cfg.nproc))
    try:
        results = elastic_launch(launch, _worker_entry)(dataclasses.asdict(cfg))
    except ChildFailedError as exc:
        raise RuntimeError(f"a training worker failed:\n{exc.format_msg()}") from None
    finally:
        if old is None:
            os.environ.pop("OMP_NUM_THREADS", None)
    first = results[min(results)]
    if "value_error" in first:
        raise ValueError(first["value_error"])
    return first["ok"]


def _init_group(device: str) -> bool:
    """Join or create the default process group; True if we created it."""
    if dist.is_initialized():
        return False
    backend = "nccl" if device == "cuda" else "gloo"
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend)
    else:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    return True


# ---------------------------------------------------------------- helpers
def _rng_state(device: torch.device) -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: Mapping[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"].cpu())
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)


def _atomic_save(obj: Any, path: Path) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _epoch_order(n: int, seed: int, epoch: int) -> torch.Tensor:
    g = torch.Generator().manual_seed((seed * 1_000_003 + epoch * 7919 + 17) % (2**63 - 1))
    return torch.randperm(n, generator=g)


def make_optimizer(name: str, params: Any, lr: float) -> torch.optim.Optimizer:
    """``sgd``, ``momentum`` (SGD, momentum 0.9) or ``adam``."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if name == "momentum":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    return torch.optim.Adam(params, lr=lr)


def _human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1000
    return f"{n:.1f}GB"


def _read_metrics(path: Path, upto_step: int) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            if row["step"] <= upto_step:
                rows.append(row)
    return rows


# ---------------------------------------------------------------- training
def _train(cfg: TrainConfig) -> dict[str, Any]:
    import gradpress.ddp

    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0 and torch.get_num_threads() != int(threads):
        # forked workers inherit the parent's thread pool size, not the variable
        torch.set_num_threads(int(threads))
    created = _init_group(cfg.device)
    hook = None
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        if cfg.nproc is not None and cfg.nproc != world:
            raise ValueError(f"nproc={cfg.nproc} but the process group already has world_size={world}")
        if cfg.device == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
        out = Path(cfg.out)
        ckpt_path = out / CHECKPOINT
        state: dict[str, Any] | None = None
        if cfg.resume:
            if not ckpt_path.exists():
                raise ValueError(f"resume: no checkpoint at {str(ckpt_path)!r}")
            state = torch.load(ckpt_path, map_location="cpu", weights_only=False)
            _check_resume(state, cfg, world)

        torch.manual_seed(cfg.seed)
        np.random.seed(cfg.seed)
        random.seed(cfg.seed)
        wl = workloads.build(cfg.workload, data=cfg.data, hidden=cfg.hidden, params=cfg.params,
                             samples=cfg.samples, text_bytes=cfg.text_bytes)
        model = wl.model.to(device)
        if state is not None:
            model.load_state_dict(state["model"])
        n_params = sum(p.numel() for p in model.parameters())
        ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
        ef = {"on": True, "off": False, "auto": None}[cfg.error_feedback]
        hook = gradpress.ddp.register(ddp, cfg.compressor, error_feedback=ef, strategy=cfg.strategy,
                                      min_numel=cfg.min_numel, seed=cfg.seed)
        opt = make_optimizer(cfg.optimizer, ddp.parameters(), cfg.lr)
        if state is not None:
            opt.load_state_dict(state["optimizer"])
            for group in opt.param_groups:  # lr may be changed on resume
                group["lr"] = cfg.lr
            hook.load_state_dict(state["ranks"][rank]["hook"])
            _set_rng_state(state["ranks"][rank]["rng"], device)

        x_train, y_train = (t.to(device) for t in wl.train)
        n_train = len(y_train)
        per_rank = n_train // world
        steps_per_epoch = per_rank // cfg.batch_size
        if steps_per_epoch < 1:
            raise ValueError(f"batch_size {cfg.batch_size} x {world} workers exceeds the {n_train} training samples "
                             f"of {cfg.workload!r}; use a smaller --batch-size")
        horizon = cfg.epochs * steps_per_epoch  # the schedule's length; --steps only stops early
        total = horizon
        if cfg.steps is not None:
            total = min(total, cfg.steps)

        start_epoch, start_batch, step = 0, 0, 0
        step_times: list[float] = []
        history: list[dict[str, Any]] = []
        if state is not None:
            start_epoch, start_batch, step = state["epoch"], state["batch"], state["step"]
            step_times = list(state["step_times"])
            history = list(state["history"])
        rows: list[dict[str, Any]] = []
        if rank == 0:
            out.mkdir(parents=True, exist_ok=True)
            rows = _read_metrics(out / METRICS, step) if state is not None else []
            with open(out / METRICS, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)

        from tqdm import tqdm

        bar = tqdm(total=total, initial=min(step, total), unit="step", dynamic_ncols=True,
                   desc=f"{cfg.workload} {cfg.compressor}", disable=(rank != 0 or not cfg.progress))
        win_loss = torch.zeros((), dtype=torch.float64, device=device)
        win_n = 0
        win_time = 0.0
        last_bytes = hook.stats["bytes_sent"]
        t_start = time.perf_counter()
        metric_value: float | None = history[-1]["metric"] if history else None
        epoch = start_epoch
        while step < total and epoch < cfg.epochs:
            order = _epoch_order(n_train, cfg.seed, epoch)
            shard = order[rank * per_rank:(rank + 1) * per_rank].to(device)
            for b in range(start_batch if epoch == start_epoch else 0, steps_per_epoch):
                if step >= total:
                    break
                idx = shard[b * cfg.batch_size:(b + 1) * cfg.batch_size]
                t0 = time.perf_counter()
                if cfg.schedule == "cosine":
                    for group in opt.param_groups:
                        group["lr"] = cfg.lr * 0.5 * (1.0 + math.cos(math.pi * step / horizon))
                opt.zero_grad(set_to_none=True)
                loss = wl.loss(ddp(x_train[idx]), y_train[idx])
                loss.backward()
                opt.step()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                dt = time.perf_counter() - t0
                step += 1
                step_times.append(dt)
                win_loss += loss.detach().double()
                win_n += 1
                win_time += dt
                bar.update(1)
                epoch_end = b == steps_per_epoch - 1
                last = step == total
                evaluate = epoch_end or last or (cfg.eval_every > 0 and step % cfg.eval_every == 0)
                if not (evaluate or step % cfg.log_every == 0):
                    continue
                mean_loss = win_loss / win_n
                dist.all_reduce(mean_loss)
                stats = hook.stats
                row: dict[str, Any] = {
                    "step": step, "epoch": epoch + (b + 1) / steps_per_epoch,
                    "loss": float(mean_loss) / world,
                    "bytes": (stats["bytes_sent"] - last_bytes) / win_n,
                    "bytes_total": stats["bytes_sent"],
                    "step_s": win_time / win_n,
                }
                last_bytes = stats["bytes_sent"]
                win_loss.zero_()
                win_n, win_time = 0, 0.0
                if evaluate:
                    metric_value = _evaluate(wl, model, device, rank, world)
                    row["metric"] = metric_value
                    history.append({"step": step, "bytes_total": stats["bytes_sent"], "metric": metric_value,
                                    "loss": row["loss"]})
                if rank == 0:
                    rows.append(row)
                    with open(out / METRICS, "a") as f:
                        f.write(json.dumps(row) + "\n")
                    post = {"loss": f"{row['loss']:.4f}", "bytes/step": _human_bytes(row["bytes"]),
                            "step": f"{row['step_s'] * 1e3:.1f}ms"}
                    if metric_value is not None:
                        post[wl.metric] = f"{metric_value:.4f}"
                    bar.set_postfix(post, refresh=False)
                if epoch_end or last:
                    nxt = (epoch + 1, 0) if epoch_end else (epoch, b + 1)
                    _checkpoint(ckpt_path, cfg, world, rank, device, model, opt, hook, nxt, step, step_times, history)
            epoch += 1
        bar.close()
        stats = hook.stats
        steps_done = max(stats["steps"], 1)
        bytes_per_step = stats["bytes_sent"] / steps_done
        dense_per_step = stats["dense_bytes"] / steps_done
        summary: dict[str, Any] = {
            "workload": cfg.workload,
            "compressor": cfg.compressor,
            "strategy": hook.strategy_name,
            "error_feedback": hook.error_feedback,
            "world_size": world,
            "device": cfg.device,
            "steps": step,
            "epochs": cfg.epochs,
            "steps_per_epoch": steps_per_epoch,
            "batch_size": cfg.batch_size,
            "lr": cfg.lr,
            "optimizer": cfg.optimizer,
            "schedule": cfg.schedule,
            "seed": cfg.seed,
            "parameters": n_params,
            "metric": wl.metric,
            "higher_is_better": wl.higher_is_better,
            "final_metric": metric_value,
            "final_loss": history[-1]["loss"] if history else None,
            "bytes_per_step": bytes_per_step,
            "dense_bytes_per_step": dense_per_step,
            "compression_ratio": dense_per_step / bytes_per_step if bytes_per_step else 1.0,
            "bytes_total": stats["bytes_sent"],
            "median_step_s": statistics.median(step_times) if step_times else None,
            "compressed_tensors": stats.get("compressed_tensors"),
            "dense_tensors": stats.get("dense_tensors"),
            "compress_s": stats["compress_s"],
            "comm_s": stats["comm_s"],
            "train_s": time.perf_counter() - t_start,
            "history": history,
            "out": str(out),
        }
        if wl.classifier:
            summary["test_accuracy"] = metric_value
        if rank == 0:
            tmp = out / (SUMMARY + ".tmp")
            tmp.write_text(json.dumps(summary, indent=2) + "\n")
            os.replace(tmp, out / SUMMARY)
        return summary
    finally:
        if hook is not None:
            hook.close()
        if created and dist.is_initialized():
            dist.destroy_process_group()


def _evaluate(wl: workloads.Workload, model: torch.nn.Module, device: torch.device, rank: int, world: int) -> float:
    """Metric over the test set, each rank scoring a strided shard; the
    (sum, count) pair is all-reduced so every rank gets the same value."""
    x, y = wl.test
    idx = torch.arange(rank, len(y), world)
    total = torch.zeros(2, dtype=torch.float64, device=device)
    model.eval()
    with torch.no_grad():
        for chunk in idx.split(1024):
            s, n = wl.score(model(x[chunk].to(device)), y[chunk].to(device))
            total[0] += s
            total[1] += n
    model.train()
    dist.all_reduce(total)
    return float(total[0] / total[1].clamp_min(1))


def _compat(cfg: TrainConfig, world: int) -> dict[str, Any]:
    d = {k: getattr(cfg, k) for k in _RESUME_FIXED}
    d["world_size"] = world
    return d


def _check_resume(state: Mapping[str, Any], cfg: TrainConfig, world: int) -> None:
    if not isinstance(state, Mapping) or state.get("format") != _CKPT_FORMAT:
        raise ValueError(f"resume: {cfg.out}/{CHECKPOINT} is not a gradpress training checkpoint")
    theirs, mine = state["config"], _compat(cfg, world)
    diffs = [f"{k}: checkpoint has {theirs.get(k)!r}, this run has {mine[k]!r}" for k in mine if theirs.get(k) != mine[k]]
    if diffs:
        raise ValueError("resume: the checkpoint is from a different configuration (" + "; ".join(diffs) + ")")


def _checkpoint(path: Path, cfg: TrainConfig, world: int, rank: int, device: torch.device, model: torch.nn.Module,
                opt: torch.optim.Optimizer, hook: Any, nxt: tuple[int, int], step: int, step_times: list[float],
                history: list[dict[str, Any]]) -> None:
    """Gather every rank's hook and RNG state on rank 0, which writes one file
    atomically (temporary file + rename)."""
    mine = {"hook": hook.state_dict(), "rng": _rng_state(device)}
    gathered: list[Any] | None = [None] * world if rank == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    if rank == 0:
        _atomic_save({
            "format": _CKPT_FORMAT, "config": _compat(cfg, world), "epoch": nxt[0], "batch": nxt[1], "step": step,
            "model": model.state_dict(), "optimizer": opt.state_dict(), "ranks": gathered,
            "step_times": list(step_times), "history": list(history),
        }, path)
    dist.barrier()


# ---------------------------------------------------------------- CLI
def summary_line(s: Mapping[str, Any]) -> str:
    metric = s["final_metric"]
    m = "n/a" if metric is None else f"{metric:.4f}"
    return (f"{s['workload']} / {s['compressor']} on {s['world_size']} worker(s): {s['steps']} steps, "
            f"{s['metric']} {m}, {_human_bytes(s['bytes_per_step'])}/step "
            f"(dense {_human_bytes(s['dense_bytes_per_step'])}, x{s['compression_ratio']:.1f}), "
            f"median step {s['median_step_s'] * 1e3 if s['median_step_s'] else float('nan'):.1f} ms")


def run_cli(args: argparse.Namespace) -> int:
    summary = run(args)
    if int(os.environ.get("RANK", "0")) == 0:
        print(summary_line(summary))
        if summary["compressor"].strip() != "none" and summary.get("compressed_tensors") == 0:
            print(f"note: no tensor went through the compressor (strategy {summary['strategy']!r}: the plan left "
                  "every tensor dense, or all are 1-D / below --min-numel); force one with --strategy "
                  "allreduce|allgather or lower --min-numel")
        print(f"metrics: {Path(summary['out']) / METRICS}  summary: {Path(summary['out']) / SUMMARY}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m gradpress.train`` (the module torchrun starts)."""
    parser = argparse.ArgumentParser(prog="python -m gradpress.train", description="Train a workload with gradpress.")
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run_cli(args)
    except ValueError as exc:
        print(f"gradpress train: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
