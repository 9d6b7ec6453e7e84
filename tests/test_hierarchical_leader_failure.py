"""``hierarchical``: a leader whose encode raises fails its whole host at once.

4 gloo workers on loopback as 2 "hosts" x 2 (leaders: ranks 0 and 2), a
group timeout of 300 s and a deadline of 90 s for every rank to report: the
leaders' planted encode raises once (the first call, or the fifth: a later
piece of the pipelined exchange, with earlier pieces on the wire); every
rank must raise promptly (a non-leader an error naming its leader, the
leader its own), and the next step, healthy, must give the exact mean on
every rank (the collectives stayed matched). Before the fix the non-leaders
waited in the host broadcast until the group timeout.
"""

from __future__ import annotations

import datetime
import os
import tempfile
import time
import traceback

import pytest
import torch
import torch.distributed as dist
from distributed import free_port, start_workers, stop_processes

WORLD, PER_HOST = 4, 2
SHAPES = [(64, 48), (40, 33), (5000,)]
KEYS = ["a.weight", "b.weight", "c.bias"]
CHUNK = 500  # 7 + 3 pieces
GROUP_TIMEOUT_S = 300
DEADLINE_S = 90.0  # far below the group's timeout: spawn, import, two steps


def _grads(rank: int, step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return [torch.randn(s, generator=gen) * (1 + rank) for s in SHAPES]


def _entry(rank: int, world: int, port: int, chunk: int, fail_at: int, outdir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    result: dict = {"error": None}
    try:
        from gradpress.compress import create
        from gradpress.exchange.engine import Synchronizer

        dist.init_process_group("gloo", init_method=f"file://{os.path.join(outdir, 'rendezvous')}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
        comp = create("none")
        if rank % PER_HOST == 0:  # the leaders' encode raises on call number fail_at, once
            encode, calls = comp.encode, [0]

            def planted(x, ctx):  # noqa: ANN001, ANN202
                calls[0] += 1
                if calls[0] == fail_at + 1:
                    raise ValueError(f"planted encode failure on rank {rank}")
                return encode(x, ctx)

            comp.encode = planted  # type: ignore[method-assign]
        params = [(k, s, torch.float32) for k, s in zip(KEYS, SHAPES)]
        eng = Synchronizer(comp, params=params, strategy=f"hierarchical:workers_per_host={PER_HOST},chunk={chunk}",
                           min_numel=256)
        t0 = time.monotonic()
        try:
            eng.sync(KEYS, _grads(rank, 0), step=0)
        except Exception as exc:  # noqa: BLE001 - what each rank raised is the result
            result["error"] = f"{type(exc).__name__}: {exc}"
        result["elapsed"] = time.monotonic() - t0
        healthy = _grads(rank, 1)
        eng.sync(KEYS, healthy, step=1)
        result["next"] = [t.clone() for t in healthy]
    except BaseException as exc:  # noqa: BLE001
        result["fatal"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    torch.save(result, os.path.join(outdir, f"tmp{rank}.pt"))
    os.replace(os.path.join(outdir, f"tmp{rank}.pt"), os.path.join(outdir, f"rank{rank}.pt"))
    os._exit(0)  # no waiting on a peer in destroy_process_group


def _run(chunk: int, fail_at: int) -> tuple[list[dict | None], float]:
    """Every rank's result (None: it had not reported by the deadline) and the seconds waited."""
    with tempfile.TemporaryDirectory() as outdir:
        start = time.monotonic()
        ctx = start_workers(_entry, WORLD, (WORLD, free_port(), chunk, fail_at, outdir), join=False)
        paths = [os.path.join(outdir, f"rank{r}.pt") for r in range(WORLD)]
        try:
            while time.monotonic() - start < DEADLINE_S:
                if all(os.path.exists(p) for p in paths) or not any(p.is_alive() for p in ctx.processes):
                    break
                time.sleep(0.1)
            waited = time.monotonic() - start
            results = [torch.load(p, weights_only=False) if os.path.exists(p) else None for p in paths]
        finally:
            stop_processes(ctx.processes)
    return results, waited


@pytest.mark.parametrize(("chunk", "fail_at"), [(0, 0), (CHUNK, 0), (CHUNK, 4)])
def test_a_leader_whose_encode_raises_fails_its_host_at_once(chunk: int, fail_at: int) -> None:
    results, waited = _run(chunk, fail_at)
    missing = [r for r, res in enumerate(results) if res is None]
    assert not missing, f"ranks {missing} had not returned after {waited:.0f} s (group timeout {GROUP_TIMEOUT_S} s)"
    for r, res in enumerate(results):
        assert "fatal" not in res, (r, res.get("fatal"))
        assert res["elapsed"] < DEADLINE_S / 3, (r, res["elapsed"])
        if r % PER_HOST == 0:  # the leader: its own error
            assert res["error"] == f"ValueError: planted encode failure on rank {r}", (r, res["error"])
        else:  # its host's worker: an error naming the leader, its host and the call
            leader = r - r % PER_HOST
            assert res["error"] is not None and res["error"].startswith("RuntimeError: strategy 'hierarchical'"), res
            assert f"rank {leader}" in res["error"] and "a.weight" in res["error"], res["error"]
    # the next step is healthy: every rank got the exact mean (the collectives stayed matched)
    per = [_grads(r, 1) for r in range(WORLD)]
    for i in range(len(SHAPES)):
        want = sum(p[i].double() for p in per) / WORLD
        for r, res in enumerate(results):
            assert torch.allclose(res["next"][i].double(), want, rtol=1e-6, atol=1e-6), (r, i)
            assert torch.equal(res["next"][i], results[0]["next"][i])
