"""The worker of ``gradpress bench e2e`` (bench/e2e_worker.py and what it
imports from e2e_worker_setup.py and e2e_worker_counts.py), pinned where
the other bench tests do not reach: written for survivors of ``make mutants``
(``e2e`` group; the run, the profile and the command are in
test_mutants_e2e_run.py). Every expected value is computed here by the
definition (the median of the step times a scripted clock gives, counter
deltas over the measured steps, 4 B per element for plain DDP, the
time-to-target loop of docs/e2e.md driven tick by tick) or is the documented
value, never the code's output. One process, a world-1 gloo group, the
clock, the link counters and the evaluation scripted: about 3 s.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from gradpress import torch_compat
from gradpress.bench import e2e_worker, e2e_worker_counts, e2e_worker_setup
from gradpress.bench.e2e_configs import RunConfig
from gradpress.train import loop

pytestmark = pytest.mark.mutants


class Clock:
    """``perf_counter`` that hands out the given readings in order (and fails past them)."""

    def __init__(self, readings: list[float]) -> None:
        self.readings = list(readings)

    def perf_counter(self) -> float:
        assert self.readings, "the worker read the clock more often than it has steps to time"
        return self.readings.pop(0)


def _scripted_clock(monkeypatch, readings: list[float]) -> Clock:
    clock = Clock(readings)
    monkeypatch.setattr(e2e_worker, "time", SimpleNamespace(perf_counter=clock.perf_counter,
                                                            monotonic=time.monotonic, sleep=time.sleep))
    return clock


@pytest.fixture
def one_rank(tmp_path, monkeypatch):
    """``start()`` joins a fresh world-1 gloo group (the worker's ``_finish`` destroys it after each run)."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    count = [0]

    def start() -> None:
        count[0] += 1
        dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous{count[0]}", rank=0, world_size=1)

    yield start
    if dist.is_initialized():
        torch_compat.destroy_process_group()


def _job(tmp_path, mode: str, config: RunConfig | None, **over):
    job = {"mode": mode, "tag": mode, "result_dir": str(tmp_path), "workload": "digits-mlp", "params": None,
           "hidden": 16, "samples": 256, "batch_size": 16, "lr": 0.02, "optimizer": "adam", "schedule": "cosine",
           "epochs": 4, "seed": 0, "threads": 1, "warmup": 2, "steps": 4, "n_batches": 3,
           "config": config.to_dict() if config is not None else None, "target": 0.8, "eval_every": 5,
           "max_steps": None, "time_limit": None}
    job.update(over)
    return job


def _record_batches(monkeypatch) -> tuple[list[int], list[list]]:
    """Which of the worker's pre-drawn batches each ``train_step`` got (its index in ``_batches``' list)."""
    used: list[int] = []
    drawn: list[list] = []
    real_batches, real_step = e2e_worker._batches, e2e_worker.train_step

    def batches(*a, **k):
        drawn.append(real_batches(*a, **k))
        return drawn[-1]

    def step(algo, opt, loss_fn, x, y):
        used.append(next(i for i, (bx, _) in enumerate(drawn[-1]) if bx is x))
        return real_step(algo, opt, loss_fn, x, y)

    monkeypatch.setattr(e2e_worker, "_batches", batches)
    monkeypatch.setattr(e2e_worker, "train_step", step)
    return used, drawn


def _digits_parameters(job) -> int:
    from gradpress import workloads

    return sum(p.numel() for p in workloads.build("digits-mlp", hidden=job["hidden"], samples=job["samples"])
               .model.parameters())


# ---------------------------------------------------------------- helpers
def test_interface_bytes_reads_rx_and_tx_bytes_of_exactly_that_interface(monkeypatch):
    """/proc/net/dev: two header lines, then ``name: rx_bytes rx_packets ... (8 receive fields) tx_bytes ...``."""
    text = ("Inter-|   Receive                                                |  Transmit\n"
            " face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls\n"
            "  eth01: 9 9 9 9 9 9 9 9 9 9 9 9 9 9 9 9\n"
            "    lo: 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26\n"
            "  eth0: 101 2 3 4 5 6 7 8 909 10 11 12 13 14 15 16\n")
    import io

    monkeypatch.setattr(e2e_worker_counts, "open", lambda path: io.StringIO(text), raising=False)
    assert e2e_worker.interface_bytes("eth0") == (101, 909)
    assert e2e_worker.interface_bytes("lo") == (11, 19)
    with pytest.raises(ValueError, match="'eth' not found"):
        e2e_worker.interface_bytes("eth")


def test_payload_formulas_at_the_edges():
    """docs/e2e.md: plain DDP the gradient's bytes, fp16 2 B/element, PowerSGD (n + m) r x 4 B where
    (n + m) r x 2 < n m (strictly: PyTorch's min_compression_rate 2), dense otherwise; frozen tensors send
    nothing."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4, bias=False), torch.nn.Linear(4, 30, bias=False),
                                torch.nn.Linear(30, 2)).double()
    model[2].bias.requires_grad_(False)
    elements = [16, 120, 60]  # 4x4, 30x4, 2x30 (the frozen bias left out)
    assert e2e_worker.payload_bytes_per_step(model, RunConfig("ddp", "d")) == 8 * sum(elements)
    assert e2e_worker.payload_bytes_per_step(model, RunConfig("torch-fp16", "f")) == 2 * sum(elements)
    # rank 1: 4x4: (4+4) x 2 = 16 = 16, not below: dense; 30x4: 34 x 2 = 68 < 120: factors (34 x 8 B);
    # 2x30: 32 x 2 = 64 >= 60: dense
    got = e2e_worker.payload_bytes_per_step(model, RunConfig("torch-powersgd", "p", rank=1))
    assert got == 8 * (16 + 34 * 1 + 60)


def test_batches_are_training_rows_each_rank_and_seed_its_own():
    x = torch.arange(2.0).unsqueeze(1)  # two samples: every draw of 64 must hit both
    wl = SimpleNamespace(train=(x, torch.tensor([5, 7])))
    got = e2e_worker._batches(wl, 64, 3, rank=1, seed=2)
    assert len(got) == 3
    for bx, by in got:
        assert bx.shape == (64, 1) and by.shape == (64,)
        assert torch.equal(by, torch.where(bx[:, 0] == 0, 5, 7))  # each row with its own label
        assert set(bx[:, 0].tolist()) == {0.0, 1.0}
    # uniform with replacement: each of the 2 rows half of 3 x 4096 draws, within 5 standard deviations
    draws = torch.cat([bx[:, 0] for bx, _ in e2e_worker._batches(wl, 4096, 3, rank=0, seed=1)])
    assert abs(float(draws.sum()) - draws.numel() / 2) < 5 * math.sqrt(draws.numel() / 4)
    same = e2e_worker._batches(wl, 64, 3, rank=1, seed=2)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(got, same))
    for other in (e2e_worker._batches(wl, 64, 3, rank=0, seed=2), e2e_worker._batches(wl, 64, 3, rank=1, seed=3)):
        assert not torch.equal(other[0][0], got[0][0])


# ---------------------------------------------------------------- building what runs a configuration
def test_build_algorithm_options_match_the_documented_ones(one_rank, monkeypatch):
    """docs/e2e.md: DDP without the initial broadcast (init_sync=False, no buffer broadcast); PyTorch's
    PowerSGD as PowerSGDState(rank R, start I, min_compression_rate=2, use_error_feedback=True,
    warm_start=True) on a single bucket of the model's size in MiB + 1; an unknown kind named."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    one_rank()
    kwargs, states = [], []
    real_kwargs = torch_compat.ddp_kwargs
    monkeypatch.setattr(torch_compat, "ddp_kwargs", lambda o: kwargs.append(dict(o)) or real_kwargs(o))

    class State(powerSGD_hook.PowerSGDState):
        def __init__(self, **kw):
            states.append(kw)
            super().__init__(**kw)

    monkeypatch.setattr(powerSGD_hook, "PowerSGDState", State)
    model = torch.nn.Sequential(torch.nn.Linear(600, 600), torch.nn.Linear(600, 10))  # 1.40 MiB of fp32
    size = sum(p.numel() for p in model.parameters()) * 4
    assert 1 < size / 2**20 < 2
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = RunConfig("torch-powersgd", "p", rank=3, start=5, single_bucket=True)
    algo, gp, cap = e2e_worker._build_algorithm(model, opt, cfg, seed=11)
    assert cap == 3 and gp is None and algo.module is model  # ceil(1.40) + 1 MiB
    assert kwargs == [{"init_sync": False, "broadcast_buffers": False, "bucket_cap_mb": 3}]
    assert states == [{"process_group": None, "matrix_approximation_rank": 3, "start_powerSGD_iter": 5,
                       "min_compression_rate": 2, "use_error_feedback": True, "warm_start": True,
                       "random_seed": 11}]
    exact = torch.nn.Linear(512, 512, bias=False).double()  # exactly 2 MiB: 2 + 1
    assert e2e_worker._build_algorithm(exact, opt, cfg, seed=0)[2] == 3
    assert e2e_worker._build_algorithm(model, opt, RunConfig("ddp", "d"), seed=0)[2] is None  # DDP's buckets
    assert kwargs[-1]["bucket_cap_mb"] is None
    with pytest.raises(ValueError, match="config kind 'nccl-thing' is not one of ddp, torch-fp16, torch-powersgd"):
        e2e_worker._build_algorithm(model, opt, RunConfig("nccl-thing", "x"), seed=0)


def test_fp16_baseline_sends_the_gradient_rounded_to_half(one_rank):
    """``torch-fp16``: PyTorch's fp16_compress_hook; on one rank the averaged gradient is the gradient
    rounded to float16 (computed here on a copy of the model without DDP)."""
    one_rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 3)
    ref = torch.nn.Linear(8, 3)
    ref.load_state_dict(model.state_dict())
    x = torch.randn(5, 8) * 1e-3
    algo, _, _ = e2e_worker._build_algorithm(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                             RunConfig("torch-fp16", "f"), seed=0)
    algo.model(x).pow(2).sum().backward()
    ref(x).pow(2).sum().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        want = q.grad.to(torch.float16).to(torch.float32)
        assert not torch.equal(want, q.grad)  # the rounding shows
        assert torch.equal(p.grad, want)


def test_gradpress_configurations_go_through_the_training_packages_create(monkeypatch):
    """``gradpress``: ``create(algorithm, model, opt, compressor=, strategy=, seed=, error_feedback=)``; DDP's
    options (no initial broadcast) only for ``ddp``, whose DDP the gradpress hook drives."""
    import gradpress.train.algorithm as algorithm

    calls = []
    monkeypatch.setattr(algorithm, "create", lambda *a, **k: calls.append((a, k)) or SimpleNamespace(tag=len(calls)))
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = RunConfig("gradpress", "g", spec="topk:ratio=0.5", strategy="allgather", error_feedback=False)
    algo, gp, cap = e2e_worker._build_algorithm(model, opt, cfg, seed=7)
    assert algo is gp and cap is None
    (args, kw), = calls
    assert args == ("ddp", model, opt)
    assert kw == {"compressor": "topk:ratio=0.5", "strategy": "allgather", "seed": 7, "error_feedback": False,
                  "ddp_options": {"init_sync": False, "broadcast_buffers": False, "bucket_cap_mb": None}}
    local = RunConfig("gradpress", "l", spec="none", algorithm="localsgd:period=2")
    e2e_worker._build_algorithm(model, opt, local, seed=7)
    assert calls[-1][0][0] == "localsgd:period=2" and calls[-1][1]["ddp_options"] is None


# ---------------------------------------------------------------- compute-only steps
def test_compute_steps_time_each_step_and_rank_0_repeats_them_alone(tmp_path, monkeypatch):
    """``mode="compute"``: ``warmup`` untimed steps, ``steps`` timed ones cycling through the pre-drawn
    batches; with ``solo``, rank 0 waits for the other ranks' result files, then times the steps again."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    job = _job(tmp_path, "compute", None, warmup=4, steps=3, solo=True)
    for r in (1, 2):
        (tmp_path / f"compute-rank{r}.json").write_text("{}")
    used, _ = _record_batches(monkeypatch)
    clock = _scripted_clock(monkeypatch, [1.0, 1.5, 2.0, 2.25, 3.0, 3.875,  # shared: 0.5, 0.25, 0.875
                                          10.0, 10.125, 11.0, 11.0625, 12.0, 12.5])  # alone: 0.125, 0.0625, 0.5
    res = e2e_worker.run_compute(job)
    assert not clock.readings
    assert used == [0, 1, 2, 0] + [0, 1, 2] + [0, 1, 2]  # i mod 3 batches
    assert res["step_s"] == [0.5, 0.25, 0.875] and res["median_step_s"] == 0.5
    assert res["solo_step_s"] == [0.125, 0.0625, 0.5] and res["solo_median_step_s"] == 0.125
    assert res["rank"] == 0 and res["mode"] == "compute" and res["parameters"] == _digits_parameters(job)
    monkeypatch.setenv("RANK", "1")  # only rank 0 repeats the steps alone
    _scripted_clock(monkeypatch, [0.0, 2.0, 3.0, 4.0, 5.0, 7.5])
    res = e2e_worker.run_compute(job)
    assert res["rank"] == 1 and res["step_s"] == [2.0, 1.0, 2.5] and res["median_step_s"] == 2.0
    assert "solo_step_s" not in res


# ---------------------------------------------------------------- timed steps
def _fake_link(monkeypatch, before: tuple[int, int], after: tuple[int, int]) -> list[str]:
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    readings, devs = [before, after], []

    def read(dev: str) -> tuple[int, int]:
        devs.append(dev)
        return readings.pop(0)

    monkeypatch.setattr(e2e_worker, "interface_bytes", read)
    return devs


def test_step_mode_times_each_measured_step_and_counts_link_bytes_per_step(one_rank, tmp_path, monkeypatch):
    """A PyTorch baseline: max(warmup, compression start) warm-up steps, then ``steps`` timed steps each on
    its own; the link counters' deltas over the measured steps / steps; the payload by the formula (plain
    DDP: 4 B per parameter)."""
    one_rank()
    job = _job(tmp_path, "step", RunConfig("ddp", "torch ddp"), warmup=2, steps=4)
    used, _ = _record_batches(monkeypatch)
    devs = _fake_link(monkeypatch, (1000, 5000), (1000 + 4 * 300, 5000 + 4 * 701))
    clock = _scripted_clock(monkeypatch, [5.0, 5.25,  # registration
                                          10.0, 10.5, 11.0, 11.125, 12.0, 12.75, 13.0, 13.25])
    res = e2e_worker.run_step(job)
    assert not clock.readings and devs == ["lo", "lo"]
    assert used == [0, 1] + [2, 0, 1, 2]  # warm-up 0, 1; then (2 + i) mod 3
    assert res["step_s"] == [0.5, 0.125, 0.75, 0.25] and res["median_step_s"] == statistics.median([0.5, 0.125, 0.75, 0.25])
    assert res["register_s"] == 0.25 and res["warmup"] == 2 and res["steps"] == 4 and len(res["loss"]) == 4
    assert res["link_rx_bytes_per_step"] == 300 and res["link_tx_bytes_per_step"] == 701
    params = _digits_parameters(job)
    assert res["parameters"] == params and res["dense_bytes_per_step"] == 4 * params
    assert res["payload_bytes_per_step"] == 4 * params and res["payload_source"] == "computed from the parameter shapes"
    assert res["world_size"] == 1 and res["label"] == "torch ddp" and res["buckets"] == 1


def test_step_mode_warms_up_until_the_compression_starts(one_rank, tmp_path, monkeypatch):
    one_rank()
    cfg = RunConfig("torch-powersgd", "torch powersgd r=1", rank=1, start=4, single_bucket=True)
    job = _job(tmp_path, "step", cfg, warmup=2, steps=2)
    used, _ = _record_batches(monkeypatch)
    res = e2e_worker.run_step(job)
    assert used == [0, 1, 2, 0] + [1, 2] and res["warmup"] == 4
    assert res["bucket_cap_mb"] == 2  # a tiny model: ceil(size in MiB) + 1


def test_step_mode_payload_of_a_real_gradpress_configuration_is_its_formula_per_step(one_rank, tmp_path):
    """``fp16@allreduce`` on digits-mlp (hidden 16): the 64x16 weight at 2 B per element, the three small
    tensors the plan leaves dense (16 + 160 + 10 elements) at 4 B, plus the engine's prelude (a few words
    of flags riding in the same collective); the same per step over 2 or 3 measured steps."""
    formula = 2 * 64 * 16 + 4 * (16 + 10 * 16 + 10)
    got = []
    for steps in (2, 3):
        one_rank()
        res = e2e_worker.run_step(_job(tmp_path, "step", RunConfig("gradpress", "g", spec="fp16", strategy="allreduce"),
                                       steps=steps))
        assert (res["compressed_tensors"], res["dense_tensors"]) == (1, 3)
        got.append(res["payload_bytes_per_step"])
        assert res["strategy_bytes_per_step"] == {"allreduce": got[-1]} and res["host_bytes_per_step"] == 0
    assert got[0] == got[1] and formula <= got[0] < formula + 64, (got, formula)


class _Stats:
    """A gradpress algorithm's ``stats``: ``before`` at the first read, ``after`` at the second."""

    def __init__(self, before: dict, after: dict) -> None:
        self.reads = [before, after]

    @property
    def stats(self) -> dict:
        return self.reads.pop(0)

    def describe(self) -> dict:
        return {"strategy": "allgather"}


def _with_stats(monkeypatch, before: dict, after: dict) -> None:
    real = e2e_worker._build_algorithm

    def build(*a, **k):
        algo, _, cap = real(*a, **k)
        return algo, _Stats(before, after), cap

    monkeypatch.setattr(e2e_worker, "_build_algorithm", build)


BEFORE = {"steps": 7, "bytes_sent": 10_000, "host_bytes": 100, "compress_s": 2.0, "comm_s": 1.0,
          "compressed_tensors": 2, "dense_tensors": 1, "strategy_bytes": {"allgather": 9_000, "uncompressed": 1_000},
          "exchange_s": 5.0, "exposed_s": 1.0}


@pytest.mark.parametrize("steps, after, overlap", [
    # 4 steps: busy 2 s, waited 0.5 s: overlap (2 - 0.5) / 2
    (4, {"steps": 11, "bytes_sent": 20_000, "host_bytes": 220, "compress_s": 4.0, "comm_s": 2.0,
         "compressed_tensors": 3, "dense_tensors": 4,
         "strategy_bytes": {"allgather": 17_000, "uncompressed": 2_600, "ring": 400},
         "exchange_s": 7.0, "exposed_s": 1.5}, (2.0, 0.5)),
    # waited longer than the exchange ran (clocks apart): capped at the exchange, overlap 0
    (4, dict(BEFORE, steps=11, exchange_s=7.0, exposed_s=4.0), (2.0, 2.0)),
    # one step, no exchange time: no overlap figure
    (1, dict(BEFORE, steps=8, bytes_sent=10_500, exchange_s=5.0, exposed_s=1.0), (0.0, 0.0)),
])
def test_step_mode_reads_the_algorithms_counters_over_the_measured_steps(one_rank, tmp_path, monkeypatch, steps,
                                                                         after, overlap):
    """gradpress: every figure is (counter after - counter before) / the steps the counters saw; the bytes per
    strategy likewise (a strategy new since the start counts from 0); the background clock's overlap is
    (busy - waited) / busy with waited <= busy, none without busy time."""
    one_rank()
    _with_stats(monkeypatch, BEFORE, after)
    res = e2e_worker.run_step(_job(tmp_path, "step", RunConfig("ddp", "d"), steps=steps))
    n = after["steps"] - BEFORE["steps"]
    for key, counter in (("payload_bytes_per_step", "bytes_sent"), ("host_bytes_per_step", "host_bytes"),
                         ("compress_s_per_step", "compress_s"), ("comm_s_per_step", "comm_s")):
        assert res[key] == pytest.approx((after[counter] - BEFORE[counter]) / n, rel=1e-12), key
    assert res["strategy_bytes_per_step"] == pytest.approx(
        {k: (v - BEFORE["strategy_bytes"].get(k, 0)) / n for k, v in after["strategy_bytes"].items()})
    assert res["compressed_tensors"] == after["compressed_tensors"] and res["dense_tensors"] == after["dense_tensors"]
    assert res["strategy"] == "allgather" and res["plan"] == {"*": ["allgather", 1]}
    assert res["payload_source"].startswith("gradpress stats")
    busy, waited = overlap
    assert res["exchange_s_per_step"] == pytest.approx(busy / n) and res["exposed_s_per_step"] == pytest.approx(waited / n)
    assert res["overlap"] == (pytest.approx((busy - waited) / busy) if busy > 0 else None)


# ---------------------------------------------------------------- train to a target
def _drive(monkeypatch, metrics: list[float], dt: float, higher_is_better: bool = True) -> dict:
    """Replace the training loop by its contract (docs: ``after(tick)`` after every step, True stops; the
    number of steps done is returned) with ticks of ``dt`` seconds, and the evaluation by ``metrics`` in
    order; returns what the loop was handed."""
    seen: dict = {"metrics": list(metrics)}

    def run_steps(algo, opt, loss_fn, batches, *, lr, schedule, horizon, after):
        seen.update(lr=lr, schedule=schedule, horizon=horizon, batches=len(batches))
        step = 0
        for b in range(len(batches)):
            step += 1
            if after(loop.Tick(step, 0, b, torch.tensor(1.0), dt)):
                break
        return step

    def evaluate(wl, model, *, rank, world, chunk):
        return seen["metrics"].pop(0)

    real_build = e2e_worker._build

    def build(job):
        wl = real_build(job)
        wl.higher_is_better = higher_is_better
        return wl

    monkeypatch.setattr(e2e_worker, "run_steps", run_steps)
    monkeypatch.setattr(e2e_worker, "evaluate", evaluate)
    monkeypatch.setattr(e2e_worker_setup, "_build", build)  # the one _setup calls
    return seen


def _horizon(job) -> int:
    """The workload's epochs x steps per epoch (each rank a 1/world shard, whole batches)."""
    from gradpress import workloads

    n = len(workloads.build("digits-mlp", hidden=job["hidden"], samples=job["samples"]).train[1])
    return job["epochs"] * (n // 1 // job["batch_size"])


def test_train_mode_stops_at_the_evaluation_that_reaches_the_target(one_rank, tmp_path, monkeypatch):
    one_rank()
    job = _job(tmp_path, "train", RunConfig("ddp", "torch ddp"), eval_every=5, target=0.8)
    seen = _drive(monkeypatch, [0.3, 0.9, 0.6], dt=0.25)
    res = e2e_worker.run_train(job)
    horizon = _horizon(job)
    assert (seen["lr"], seen["schedule"], seen["horizon"], seen["batches"]) == (0.02, "cosine", horizon, horizon)
    assert [h["step"] for h in res["history"]] == [5, 10] and [h["seconds"] for h in res["history"]] == [1.25, 2.5]
    assert res["reached"] and res["time_to_target_s"] == 2.5 and res["steps_to_target"] == 10 and res["steps"] == 10
    assert res["train_s"] == 2.5 and res["best_metric"] == 0.9 and res["final_metric"] == 0.9
    assert res["payload_bytes_per_step"] == 4 * _digits_parameters(job) and res["buckets"] == 1
    assert res["world_size"] == 1 and res["metric"] == "accuracy" and res["higher_is_better"]


def test_train_mode_evaluates_the_last_step_and_caps_max_steps_at_the_schedule(one_rank, tmp_path, monkeypatch):
    one_rank()
    job = _job(tmp_path, "train", RunConfig("ddp", "d"), eval_every=5, max_steps=12, target=0.95)
    seen = _drive(monkeypatch, [0.3, 0.7, 0.5], dt=0.5)
    res = e2e_worker.run_train(job)
    assert seen["batches"] == 12 and [h["step"] for h in res["history"]] == [5, 10, 12]
    assert not res["reached"] and res["time_to_target_s"] is None and res["steps_to_target"] is None
    assert res["steps"] == 12 and res["train_s"] == 6.0 and res["best_metric"] == 0.7 and res["final_metric"] == 0.5
    one_rank()
    horizon = _horizon(job)
    seen = _drive(monkeypatch, [0.0] * horizon, dt=0.5)
    res = e2e_worker.run_train(dict(job, max_steps=horizon + 50, eval_every=horizon))  # past the schedule: its end
    assert seen["batches"] == horizon and res["steps"] == horizon


def test_train_mode_for_a_lower_is_better_metric(one_rank, tmp_path, monkeypatch):
    """A loss-like metric reaches the target from above: 3.0 and 2.0 are not 1.0 or less; 0.5 is."""
    one_rank()
    job = _job(tmp_path, "train", RunConfig("ddp", "d"), eval_every=2, target=1.0)
    _drive(monkeypatch, [3.0, 2.0, 0.5, 0.1], dt=1.0, higher_is_better=False)
    res = e2e_worker.run_train(job)
    assert [h["metric"] for h in res["history"]] == [3.0, 2.0, 0.5] and res["reached"]
    assert res["steps_to_target"] == 6 and res["time_to_target_s"] == 6.0
    assert res["best_metric"] == 0.5 and not res["higher_is_better"]


def test_train_mode_stops_past_the_time_limit(one_rank, tmp_path, monkeypatch):
    """--time-limit: stop at the first evaluation past the limit (at the limit itself: go on)."""
    one_rank()
    job = _job(tmp_path, "train", RunConfig("ddp", "d"), eval_every=2, target=0.99, time_limit=1.0)
    _drive(monkeypatch, [0.1] * 10, dt=0.25)
    res = e2e_worker.run_train(job)
    assert [h["seconds"] for h in res["history"]] == [0.5, 1.0, 1.5] and res["steps"] == 6 and not res["reached"]


# ---------------------------------------------------------------- the command
def test_worker_main_refuses_an_unknown_mode_and_writes_this_ranks_result(tmp_path, monkeypatch, capsys):
    job = _job(tmp_path, "bogus", None, tag="c07", threads=3)
    path = tmp_path / "c07.job.json"
    path.write_text(json.dumps(job))
    assert e2e_worker.main(["--job", str(path)]) == 2
    err = capsys.readouterr().err
    assert "job mode 'bogus' is not one of compute, step, train" in err
    threads = []
    monkeypatch.setattr(torch, "set_num_threads", threads.append)
    monkeypatch.setattr(torch, "set_num_interop_threads", lambda n: None)  # the test process's own stay as they are
    monkeypatch.setattr(e2e_worker, "MODES", dict(e2e_worker.MODES, compute=lambda j: {"tag": j["tag"], "ok": 1}))
    monkeypatch.setenv("RANK", "3")
    path.write_text(json.dumps(dict(job, mode="compute")))
    assert e2e_worker.main(["--job", str(path)]) == 0
    assert threads == [3]
    assert json.loads((tmp_path / "c07-rank3.json").read_text()) == {"tag": "c07", "ok": 1}
