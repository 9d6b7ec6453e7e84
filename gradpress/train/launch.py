"""Where training runs: :func:`run` and the process group.

Inside an initialized group, use it; with ``nproc`` start that many local
workers through PyTorch's elastic launcher (the code torchrun runs; c10d
rendezvous on 127.0.0.1, free port); under torchrun join from
``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``; otherwise a
one-process gloo group, so DDP and the algorithms still run. Backend gloo on
CPU, nccl with ``device="cuda"``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import random
import signal
import socket
import sys
import uuid
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist

from gradpress import workloads
from gradpress.train.config import TrainConfig, make_config, usable_cpus

__all__ = ["run", "init_group", "free_port", "WorkerFailed", "describe_failures", "check_data", "one_line_warnings"]


class WorkerFailed(RuntimeError):
    """A training worker died or failed; the message names the first one and how."""


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range for ports bound to 0 (Linux's default elsewhere)."""
    try:
        lo, hi = (int(v) for v in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for a rendezvous store.

    Drawn at random *below* the kernel's ephemeral range, not by binding
    port 0: such a port comes from that range, and until the store binds it
    any socket bound to port 0 (gloo's connections, another run's store)
    may be given it; a start in a busy sweep then hangs or joins the wrong
    store. Falls back to port 0 when nothing below is free."""
    lo, _ = _ephemeral_range()
    rng = random.SystemRandom()
    for _ in range(64 if lo - 10_000 > 1_000 else 0):
        port = rng.randrange(10_000, lo)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
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
    from gradpress.train.session import train

    cfg = make_config(config, **overrides)
    if cfg.nproc is not None and not _in_group_env():
        if cfg.resume:  # a bad checkpoint fails here, in one line, before any worker starts
            from gradpress.train import checkpoint

            state = checkpoint.load(Path(cfg.out) / checkpoint.CHECKPOINT)
            checkpoint.check_resume(state, cfg, cfg.nproc, local_world=cfg.nproc)  # the workers' LOCAL_WORLD_SIZE
            from gradpress.train import reshard

            if reshard.saved_world(state) != cfg.nproc:  # --reshard: a state that cannot be folded fails here
                reshard.entry(state, 0, cfg.nproc)
            del state
        return _launch(cfg)
    return train(cfg)


def one_line_warnings() -> None:
    """A training worker's warnings as ``gradpress train: warning: MESSAGE``
    lines on stderr (the CLI's own form), without the source line Python
    prints under them (``return strategy_class(name)(group)`` says nothing
    to a user)."""

    def line(message: Warning | str, category: type[Warning], filename: str, lineno: int,
             text: str | None = None) -> str:
        kind = "" if category is UserWarning else f"{category.__name__}: "
        return f"gradpress train: warning: {kind}{message}\n"

    warnings.formatwarning = line


def _worker_entry(cfg_dict: dict[str, Any], env: dict[str, dict[str, str]] | None = None) -> dict[str, Any]:
    from gradpress.train.session import train

    one_line_warnings()
    if env is not None:
        _launcher_environ(env["base"], env["now"])
    # a worker inherits the signal handlers of the process it was forked from (which raise in odd places
    # and print tracebacks): the launcher alone handles Ctrl-C, and stops workers with SIGTERM
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)

    try:
        return {"ok": train(TrainConfig(**cfg_dict))}
    except ValueError as exc:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # the group may already be destroyed here
            # one rank's refusal (its own checkpoint entry, say): the others may already wait in a
            # collective it never joins, and a returned value would wait for them (the launcher then
            # reported their timeout, --timeout later, and lost this message): fail so they are stopped
            raise RankValueError(str(exc)) from None
        return {"value_error": str(exc)}


class RankValueError(Exception):
    """A ``ValueError`` raised on a rank of several: the worker fails with it, the launcher
    stops the other workers at once and raises it as a ``ValueError`` again (:func:`rank_value_error`)."""


def rank_value_error(failures: Mapping[int, Any]) -> str | None:
    """The earliest :class:`RankValueError`'s message among the launcher's failures, else None."""
    prefix = f"{RankValueError.__name__}: "
    found = []
    for failure in failures.values():
        message = failure.message.get("message", "") if isinstance(failure.message, Mapping) else failure.message
        if isinstance(message, str) and message.startswith(prefix):
            found.append((failure.timestamp, message[len(prefix):]))
    return min(found)[1] if found else None


def _launcher_environ(base: Mapping[str, str], now: Mapping[str, str]) -> None:
    """In a worker forked by the fork server: make ``os.environ`` the
    launcher's environment at this launch (``now``), plus what the elastic
    agent set for this worker. The fork server keeps the environment it
    started with (``base``), so a variable the launcher set or removed
    since would otherwise be missed; the agent's own variables (RANK,
    MASTER_PORT, ...) are those that differ from ``base``."""
    agent = {k: v for k, v in os.environ.items() if base.get(k) != v}
    os.environ.clear()
    os.environ.update(now)
    os.environ.update(agent)


#: the environment the fork server of this process started with (None: not started)
_FORKSERVER_ENV: dict[str, str] | None = None


#: what the fork server imports once, so that each worker it forks starts without importing them
FORKSERVER_PRELOAD = ["torch", "torch._dynamo", "tqdm", "gradpress.ddp", "gradpress.algorithms", "gradpress.train.session"]


def _start_method(device: str) -> str:
    """forkserver on Linux CPU runs, spawn elsewhere (CUDA, other platforms).

    Workers are never forked from the launcher itself: by the time the
    elastic agent starts them it runs threads (its rendezvous keep-alive
    timer, the TCPStore server), and a child forked while one of them held
    a lock inherits it locked. That happened: about one start in a hundred
    hung for the whole ``--timeout`` with one worker in glibc's resolver
    lock (``getnameinfo``, called by the TCPStore client to format an
    address), docs/train.md. The fork server is a fresh process (started by
    exec) that imports :data:`FORKSERVER_PRELOAD` once; workers forked from
    it start in a fraction of a second instead of re-importing torch."""
    return "forkserver" if device == "cpu" and sys.platform.startswith("linux") else "spawn"


def _start_forkserver() -> None:
    """Start the fork server now (once per process), importing
    :data:`FORKSERVER_PRELOAD`, so that its imports overlap the launcher's
    own preparation (:func:`_preload`)."""
    import multiprocessing
    import multiprocessing.forkserver

    global _FORKSERVER_ENV
    if _FORKSERVER_ENV is None:
        _FORKSERVER_ENV = dict(os.environ)
        multiprocessing.set_forkserver_preload(FORKSERVER_PRELOAD)
    multiprocessing.forkserver.ensure_running()


def _preload(cfg: TrainConfig) -> None:
    """Build the data once in the launcher, so that generated data land in
    the cache before the workers look for them (and a bad workload option,
    or a batch size that leaves a worker no full batch, fails here, before
    any worker starts). The workers' imports happen in the fork server
    (:data:`FORKSERVER_PRELOAD`) or in each spawned worker, not here: the
    launcher itself does not train."""
    assert cfg.nproc is not None
    check_data(cfg, cfg.nproc)


def check_data(cfg: TrainConfig, world: int) -> None:
    """Build ``cfg``'s data (generated data land in the cache) and refuse
    (ValueError) a ``--split`` the data cannot give (more labels per worker
    than classes, a shard per worker left empty) or a batch size that leaves
    a worker of ``world`` no full batch."""
    from gradpress.train import splits
    from gradpress.train.loop import steps_per_epoch

    wl = workloads.build(cfg.workload, data=cfg.data, hidden=cfg.hidden, params=cfg.params,
                         samples=cfg.samples, text_bytes=cfg.text_bytes)
    assert cfg.batch_size is not None
    shards = splits.assign(splits.parse_split(cfg.split), wl.train[1], world, cfg.seed)
    steps_per_epoch(len(wl.train[1]), world, cfg.batch_size, cfg.workload,
                    shard=None if shards is None else len(shards[0]), split=cfg.split)


def _exit_codes(exc: BaseException) -> dict[int, tuple[int, int | None]]:
    """rank -> (pid, exit code) of every local worker, read from the elastic
    agent the failed launch left in its traceback: the launcher reports only
    the first failure it noticed, which may be a consequence (a peer's
    "connection closed") of a worker killed by a signal. Empty where this
    torch does not expose it."""
    tb = exc.__traceback__
    while tb is not None:
        agent = tb.tb_frame.f_locals.get("agent")
        if agent is not None:
            try:
                procs = agent._pcontext._pc.processes
                return {i: (p.pid, p.exitcode) for i, p in enumerate(procs)}
            except AttributeError:
                return {}
        tb = tb.tb_next
    return {}


def _quiet_launcher_logs() -> list[tuple[Any, int]]:
    """Silence the elastic launcher's own logs (per-worker tracebacks, "terminating
    process" warnings) while it runs: the failure is reported once, by
    :func:`describe_failures`. Returns what to restore."""
    import logging

    prefixes = ("torch.distributed.elastic", "torch.multiprocessing.spawn", "torch.distributed.launcher")
    # the module loggers too: elastic gives several their own level (WARNING on 2.2.2 and 2.13.0), which the
    # parent's does not override (on 2.2.2 a killed worker's traceback got through)
    names = {*prefixes, *(n for n in list(logging.root.manager.loggerDict) if n.startswith(prefixes))}
    saved = []
    for name in sorted(names):
        logger = logging.getLogger(name)
        saved.append((logger, logger.level))
        logger.setLevel(logging.CRITICAL)
    return saved


def launch_config(cfg: TrainConfig, config_class: Any) -> Any:
    """The elastic launcher's configuration for ``cfg``: one node, no
    restarts, a rendezvous on a free loopback port. A stopped (SIGSTOP)
    worker gets SIGKILL 5 s after SIGTERM, not 30, where ``config_class``
    has ``shutdown_timeout`` (torch 2.11's has not: passing it made
    ``gradpress train`` fail with a TypeError; the launcher's default holds)."""
    fields = {f.name for f in dataclasses.fields(config_class)}
    grace = {"shutdown_timeout": 5} if "shutdown_timeout" in fields else {}
    return config_class(
        min_nodes=1, max_nodes=1, nproc_per_node=cfg.nproc, run_id=f"gradpress-{uuid.uuid4().hex[:12]}",
        rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{free_port()}", max_restarts=0, monitor_interval=0.1,
        start_method=_start_method(cfg.device), local_addr="127.0.0.1", **grace,
    )


def _launch(cfg: TrainConfig) -> dict[str, Any]:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    assert cfg.nproc is not None
    if _start_method(cfg.device) == "forkserver":
        _start_forkserver()
    _preload(cfg)  # seconds on a busy machine: the port is chosen after it, just before the store binds it
    launch = launch_config(cfg, LaunchConfig)
    old = os.environ.get("OMP_NUM_THREADS")
    if old is None and cfg.device == "cpu":  # what torchrun does for several local workers
        os.environ["OMP_NUM_THREADS"] = str(max(1, usable_cpus() // cfg.nproc))
    quiet = _quiet_launcher_logs()
    try:
        env = None if _FORKSERVER_ENV is None or launch.start_method != "forkserver" else \
            {"base": _FORKSERVER_ENV, "now": dict(os.environ)}
        results = elastic_launch(launch, _worker_entry)(dataclasses.asdict(cfg), env)
    except ChildFailedError as exc:
        refused = rank_value_error(exc.failures)
        if refused is not None:
            raise ValueError(refused) from None
        raise WorkerFailed(describe_failures(exc.failures, cfg.nproc, cfg.timeout, _exit_codes(exc))) from None
    except SignalException as exc:
        if exc.sigval == signal.SIGINT:
            raise KeyboardInterrupt from None
        raise WorkerFailed(f"the launcher got {signal.Signals(exc.sigval).name}; workers stopped") from None
    finally:
        for logger, level in quiet:
            logger.setLevel(level)
        if old is None:
            os.environ.pop("OMP_NUM_THREADS", None)
    first = results[min(results)]
    if "value_error" in first:
        raise ValueError(first["value_error"])
    return first["ok"]


_TIMEOUT_WORDS = ("timed out", "timeout", "timedout")


def _how(failure: Any) -> str:
    if failure.exitcode < 0:
        try:
            name = signal.Signals(-failure.exitcode).name
        except ValueError:
            name = f"signal {-failure.exitcode}"
        return f"was killed by {name} (pid {failure.pid})"
    message = failure.message
    if isinstance(message, Mapping):
        message = message.get("message", "")
    lines = [ln.strip() for ln in str(message or "").splitlines() if ln.strip()]
    what = lines[0] if lines else "no message"
    return f"failed with exit code {failure.exitcode}: {what[:300]}"


def describe_failures(failures: Mapping[int, Any], nproc: int | None, timeout: float | None,
                      exit_codes: Mapping[int, tuple[int, int | None]] | None = None) -> str:
    """One message from the elastic launcher's failures (rank -> ProcessFailure):
    the worker that died first and how. A worker killed by a signal comes
    first (the others' errors, such as "Connection reset by peer", are its
    consequences); else the earliest error. A timeout names the ranks that
    reported nothing (the silent ones). ``exit_codes``: rank -> (pid, exit
    code) of every worker, where known (see :func:`_exit_codes`)."""
    if not failures:
        return "a training worker failed (no details)"
    failures = dict(failures)
    timed_out = any(any(w in str(f.message).lower() for w in _TIMEOUT_WORDS) for f in failures.values())
    if not timed_out:  # a worker killed by a signal may be missing from the launcher's failures
        import types

        for rank, (pid, code) in (exit_codes or {}).items():
            if rank not in failures and code is not None and code < 0 and code != -signal.SIGTERM:
                failures[rank] = types.SimpleNamespace(exitcode=code, pid=pid, message="", timestamp=0)

    def order(item: tuple[int, Any]) -> tuple[int, int, int]:
        rank, f = item
        killed = f.exitcode < 0 and f.exitcode not in (-signal.SIGTERM, -signal.SIGINT)
        return (0 if killed else 1, f.timestamp, rank)
    ranked = sorted(failures.items(), key=order)
    rank, first = ranked[0]
    msg = f"worker rank {rank} {_how(first)}"
    text = str(first.message).lower()
    if first.exitcode >= 0 and any(w in text for w in _TIMEOUT_WORDS):
        silent = [r for r in range(nproc or 0) if r not in failures or failures[r].exitcode < 0]
        who = (f"rank {silent[0]}" if len(silent) == 1 else "ranks " + ", ".join(map(str, silent))) if silent \
            else "another rank"
        msg = (f"worker rank {rank} timed out after {timeout:g} s waiting for {who}, which stopped responding "
               f"(stopped, hung or far slower); raise --timeout if it is only slow. First error: {_how(first)}")
    others = [f"rank {r} {_how(f)}" for r, f in ranked[1:]]
    if others:
        msg += "; then " + "; ".join(others)
    return msg


def init_group(device: str, timeout: float | None = None) -> bool:
    """Join or create the default process group (``timeout`` seconds for its
    collectives; None: torch's default); True if we created it."""
    if dist.is_initialized():
        return False
    backend = "nccl" if device == "cuda" else "gloo"
    kw: dict[str, Any] = {} if timeout is None else {"timeout": datetime.timedelta(seconds=timeout)}
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend, **kw)
    else:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1, **kw)
    return True
