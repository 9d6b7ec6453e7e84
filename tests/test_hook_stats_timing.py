"""A DDP hook's ``state_dict()`` taken right after ``loss.backward()`` and ``opt.step()`` holds exactly the
completed steps' statistics, however late the communication thread is (2 gloo workers, one launch, about 15 s).

The hook's thread records a call's statistics (``ExchangeStats.record``, inside ``engine.sync``) before it
completes the call's Futures, and DDP waits for every bucket's Future before backward returns: so the
training thread never reads a step half counted. Made deterministic by slowing the thread where a race would
show: every ``record`` sleeps first, and the thread sleeps again after completing a call's Futures (where
bookkeeping left after the completion would still be running). With several buckets per step, per bucket and
coalesced (one engine call per step), each step's state is compared with the one read again once the thread
is idle, and with what the test expects: ``steps`` = steps done, ``bytes_sent`` = steps x the step's bytes,
``compress_s`` and ``comm_s`` grown at every step. (An Accelerate integration run once saw these two differ
between a state saved after the last step and the same run's checkpoint, the residuals equal; this file shows
that a record arriving after the step's end was not the cause.)"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from distributed import run_workers
from torch.nn.parallel import DistributedDataParallel as DDP

import gradpress
from gradpress.ddp.comm_thread import CommThread
from gradpress.exchange.stats import ExchangeStats

DELAY_S = 0.1
STEPS = 3


def _slowed(rank: int, world: int, coalesce: bool) -> dict:
    record, run = ExchangeStats.record, CommThread._run
    calls: list[bool] = []  # end_of_step of every record: how many engine calls a step took

    def slow_record(self: ExchangeStats, **kw: object) -> None:
        time.sleep(DELAY_S)
        calls.append(bool(kw["end_of_step"]))
        record(self, **kw)

    def slow_run(self: CommThread, jobs: list) -> None:
        run(self, jobs)
        time.sleep(DELAY_S)  # after the Futures completed

    ExchangeStats.record, CommThread._run = slow_record, slow_run  # this worker process only
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))
    dist._DEFAULT_FIRST_BUCKET_BYTES = int(0.004 * 2**20)  # several buckets (as tests/test_ddp.py)
    ddp = DDP(model, bucket_cap_mb=0.004)
    hook = gradpress.ddp.register(ddp, "topk:ratio=0.1", min_numel=64, strategy="collective", coalesce=coalesce)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    rows = []
    for _ in range(STEPS):
        loss = ddp(torch.randn(8, 16, generator=g)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        now, view = hook.state_dict()["stats"], hook.stats
        time.sleep(3 * DELAY_S)  # the thread is idle by now (nothing queued: every Future completed)
        rows.append({"now": now, "view": view, "later": hook.state_dict()["stats"], "step": hook.step})
    hook.close()
    return {"rows": rows, "calls": calls}


@pytest.fixture(scope="module", params=[False, True], ids=["per-bucket", "coalesced"])
def slowed(request: pytest.FixtureRequest) -> tuple[bool, list[dict]]:
    return request.param, run_workers(_slowed, 2, request.param)


def test_a_state_read_after_the_step_holds_exactly_its_statistics(slowed: tuple[bool, list[dict]]) -> None:
    coalesce, results = slowed
    for res in results:
        # one engine call per step coalesced; per bucket, the steps after DDP's first (which rebuilds its
        # buckets after it) take several
        assert res["calls"].count(True) == STEPS
        assert (len(res["calls"]) == STEPS) if coalesce else (len(res["calls"]) > STEPS), res["calls"]
        step_bytes = res["rows"][0]["now"]["last_step_bytes"]
        assert step_bytes > 0
        before = {"compress_s": 0.0, "comm_s": 0.0}
        for k, row in enumerate(res["rows"], start=1):
            now = row["now"]
            assert row["step"] == k and now["steps"] == k
            assert now["bytes_sent"] == k * step_bytes and now["last_step_bytes"] == step_bytes
            for key in ("compress_s", "comm_s"):
                assert now[key] > before[key], (k, key)
                before[key] = now[key]
            assert now == row["later"], k  # nothing of the step was recorded after the training thread read it
            assert {key: row["view"][key] for key in now} == now, k
