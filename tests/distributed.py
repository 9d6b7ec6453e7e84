"""Run a function on N gloo workers on 127.0.0.1 and collect what each returns.

Workers are new processes (``torch.multiprocessing``); the function must be
importable (module level). Exceptions in a worker are re-raised in the test
with the worker's traceback text.

Gloo workers on Linux are forked from the fork server that ``gradpress train``
uses (:func:`gradpress.train.launch._start_forkserver`: a fresh process that
imported torch and gradpress once), not spawned: a spawned worker imports torch
and gradpress again, 2-3 s of CPU each on 2 cores, for each of the suite's
hundreds of worker launches. A worker still gets what a spawned one gets: the
test's environment as it is at this launch (the fork server keeps the one it
started with), its ``sys.path`` and working directory (multiprocessing's
preparation data), the test's stdout and stderr (the fork server's would be
the capture of whichever test started it), and a fresh import of the test
module. NCCL workers and other platforms are spawned as before.
"""

from __future__ import annotations

import datetime
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gradpress import torch_compat
from gradpress.train.launch import _start_forkserver

# taken at import: a test that replaces launch._start_forkserver (with a recorder) must not stop this one
_START_FORKSERVER = _start_forkserver


class _Stdio:
    """The launching process's stdout and stderr, handed to a worker that the
    fork server forks (its own are those it started with)."""

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        from multiprocessing import reduction

        return _Stdio._restore, (reduction.DupFd(1), reduction.DupFd(2))

    @staticmethod
    def _restore(out: Any, err: Any) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, dup in ((1, out), (2, err)):
            got = dup.detach()
            os.dup2(got, fd)
            os.close(got)


def _bootstrap(rank: int, environ: dict[str, str], stdio: None, entry: Callable[..., Any], *args: Any) -> None:
    """In a worker: the launching test's environment of this launch, then ``entry(rank, *args)`` (its stdout
    and stderr were put in place while its arguments were unpickled, ``_Stdio``)."""
    os.environ.clear()
    os.environ.update(environ)
    entry(rank, *args)


def start_workers(entry: Callable[..., Any], world: int, args: tuple, join: bool, backend: str = "gloo") -> Any:
    """``torch.multiprocessing.start_processes(entry, args, world, join)``: gloo workers on Linux forked from
    the fork server (module doc), others spawned."""
    if backend != "gloo" or not sys.platform.startswith("linux"):
        return mp.start_processes(entry, args=args, nprocs=world, join=join, start_method="spawn")
    _START_FORKSERVER()
    return mp.start_processes(_bootstrap, args=(dict(os.environ), _Stdio(), entry, *args), nprocs=world, join=join,
                              start_method="forkserver")


def free_port() -> int:
    """gradpress's own choice (below the ephemeral range; see its doc)."""
    from gradpress.train.launch import free_port as choose

    return choose()


def _entry(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple, outdir: str,
           backend: str = "gloo") -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    result: dict[str, Any]
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        # a file rendezvous: no TCP port to race for when several test runs share the machine
        dist.init_process_group(backend, init_method=f"file://{os.path.join(outdir, 'rendezvous')}", rank=rank,
                                world_size=world, timeout=__import__("datetime").timedelta(seconds=60))
        result = {"ok": fn(rank, world, *args)}
    except BaseException as exc:  # noqa: BLE001
        result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    finally:
        if dist.is_initialized():
            try:
                torch_compat.destroy_process_group()  # on torch 2.2.2 a plain destroy could hang (see there)
            except Exception:  # noqa: BLE001
                pass
    torch.save(result, os.path.join(outdir, f"rank{rank}.pt"))
    # skip interpreter teardown: torch's static destructors occasionally abort
    # there ("terminate called without an active exception") after all is done
    os._exit(0)


def run_workers(fn: Callable[..., Any], world: int, *args: Any, allow_errors: bool = False,
                backend: str = "gloo") -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` workers of ``backend``
    (``nccl``: rank r on CUDA device r mod the device count); return the list
    of results (or of ``{"error": ...}`` dicts when ``allow_errors``)."""
    with tempfile.TemporaryDirectory() as outdir:
        start_workers(_entry, world, (world, free_port(), fn, args, outdir, backend), join=True, backend=backend)
        results = [torch.load(os.path.join(outdir, f"rank{r}.pt"), weights_only=False) for r in range(world)]
    if allow_errors:
        return [r.get("ok", r) if "ok" in r else r for r in results]
    for r, res in enumerate(results):
        if "error" in res:
            raise AssertionError(f"worker {r} failed: {res['error']}\n{res['traceback']}")
    return [r["ok"] for r in results]


def run_until_rank0_reports(entry: Callable[..., None], world: int, args: tuple, deadline: float) -> tuple[Any, float]:
    """Start ``entry(rank, world, port, *args, outdir)`` on ``world`` new
    workers that are expected to fail (a dead or stuck peer); wait until rank 0
    writes ``outdir/rank0.pt`` or dies, at most ``deadline`` seconds; then stop
    every worker. Returns rank 0's result (None if it wrote none) and the
    seconds waited."""
    with tempfile.TemporaryDirectory() as outdir:
        start = time.monotonic()
        ctx = start_workers(entry, world, (world, free_port(), *args, outdir), join=False)
        path = os.path.join(outdir, "rank0.pt")
        result = None
        try:
            while time.monotonic() - start < deadline:
                if os.path.exists(path):
                    result = torch.load(path, weights_only=False)
                    break
                if not ctx.processes[0].is_alive():
                    break
                time.sleep(0.1)
        finally:
            waited = time.monotonic() - start
            stop_processes(ctx.processes)
    return result, waited


def stop_processes(processes: list[Any]) -> None:
    """Terminate the workers still running, and kill those that do not exit."""
    for p in processes:
        if p.is_alive():
            p.terminate()
    for p in processes:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)


def fault_entry(rank: int, world: int, port: int, how: str, setup: Callable[..., Callable[[int], None]],
                setup_args: tuple, fault_step: int, steps: int, outdir: str) -> None:
    """A worker for :func:`run_until_rank0_reports` in dead/stuck-peer tests:
    join the group (its default timeout 120 s, so only the code under test's
    own timeout can fire first), ``step = setup(rank, *setup_args)``, then
    ``step(i)`` for ``i < steps``; rank 1 dies (``how="exit"``) or hangs
    (``"stuck"``) at ``fault_step``. Writes ``rank{r}.pt`` with ``error``,
    ``traceback``, ``steps`` and ``elapsed`` (seconds from the start of the
    failing step), then leaves at once (``os._exit``: no waiting on a dead
    peer in ``destroy_process_group`` or atexit)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    result: dict = {"error": None}
    t0 = time.monotonic()
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
        step = setup(rank, *setup_args)
        for i in range(steps):
            if rank == 1 and i == fault_step:
                if how == "exit":
                    os._exit(1)
                time.sleep(120)  # "stuck": never joins the step
            t0 = time.monotonic()
            step(i)
        result["steps"] = steps
    except BaseException as exc:  # noqa: BLE001
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()
    result["elapsed"] = time.monotonic() - t0
    torch.save(result, os.path.join(outdir, f"tmp{rank}.pt"))
    os.replace(os.path.join(outdir, f"tmp{rank}.pt"), os.path.join(outdir, f"rank{rank}.pt"))
    os._exit(0)


def worlds_fixture(worker: Callable[[int, int], Any], worlds: tuple[int, ...] = (2, 3),
                   name: str = "world_results") -> Any:
    """A module-scoped pytest fixture ``name`` giving ``(world, results)``:
    ``worker`` run once per world size on that many gloo workers (cached, so
    every test of the module reads the same run)."""
    import pytest

    cache: dict[int, list[Any]] = {}

    @pytest.fixture(scope="module", params=list(worlds), name=name)
    def fixture(request: Any) -> tuple[int, list[Any]]:
        if request.param not in cache:
            cache[request.param] = run_workers(worker, request.param)
        return request.param, cache[request.param]

    return fixture


def checkpoint(**objects: Any) -> dict[str, Any]:
    """Each object's ``state_dict()`` through ``torch.save`` and
    ``torch.load(weights_only=True)``, as a resumed run reads its
    checkpoint: plain tensors that share no storage with the live objects
    (taken now; training on does not change it)."""
    import io

    buf = io.BytesIO()
    torch.save({name: obj.state_dict() for name, obj in objects.items()}, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def restore(saved: dict[str, Any], **objects: Any) -> None:
    """Load ``saved[name]`` (from :func:`checkpoint`) into each named object."""
    for name, obj in objects.items():
        obj.load_state_dict(saved[name])


def value_errors(build: Callable[[Any], Any], cases: dict[str, Any]) -> dict[str, str | None]:
    """``build(case)`` for each named case (each rank runs every case, since
    construction is collective): the ``ValueError`` message it raised, or
    None when it built."""
    errors: dict[str, str | None] = {}
    for name, case in cases.items():
        try:
            build(case)
            errors[name] = None
        except ValueError as exc:
            errors[name] = str(exc)
    return errors


def worker_pids(launcher: int) -> list[int]:
    """The training workers of a ``gradpress train`` process: the children
    of its fork server (Linux CPU runs), else its own children."""
    from pathlib import Path

    def children(pid: int) -> list[int]:
        path = Path(f"/proc/{pid}/task/{pid}/children")
        return [int(c) for c in path.read_text().split()] if path.exists() else []

    def cmdline(pid: int) -> str:
        try:
            return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            return ""

    direct = children(launcher)
    servers = [c for c in direct if "multiprocessing.forkserver import main" in cmdline(c)]
    if servers:
        return [w for s in servers for w in children(s)]
    return [c for c in direct if "resource_tracker" not in cmdline(c)]


@pytest.fixture(scope="module")
def one_rank_module(tmp_path_factory):  # noqa: ANN001,ANN201
    """A one-process gloo group for a whole test module (file rendezvous):
    import it into a test module and use it as a fixture; destroyed after
    the module's last test."""
    from gradpress import torch_compat

    assert not dist.is_initialized()
    path = tmp_path_factory.mktemp("rendezvous") / "file"
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        torch_compat.destroy_process_group()
