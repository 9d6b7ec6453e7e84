"""One training run's logging, evaluation, divergence watch and checkpoint
position (train/session.py), written for the ``train`` group of ``make
mutants``. Runs in this process on a process group of one, with a stand-in
algorithm (registered through ``gradpress.train.algorithm._registry``) whose
byte counts are known: each step sends 10 bytes of 40 dense ones. About 5 s.
"""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from stub_algorithm import CountingAlgorithm

from gradpress import train
from gradpress.train import algorithm

pytestmark = pytest.mark.mutants


#: the learning rate of every step any stand-in took (cleared by the tests that read it)
LRS: list[float] = []


class _Counting(CountingAlgorithm):
    """Local steps only; ``stub:nan_at=K`` fills the parameters with NaN after step K."""

    name = "stub"
    default_compressor = "none"
    PARAMS = (type("P", (), {"name": "nan_at", "default": 0})(),)

    def __init__(self, spec, model, optimizer, nan_at=0):
        self.spec, self.model, self.optimizer, self.nan_at, self.counter = spec, model, optimizer, nan_at, 0

    def step(self):
        LRS.append(self.optimizer.param_groups[0]["lr"])
        self.optimizer.step()
        self.counter += 1
        if self.counter == self.nan_at:
            with torch.no_grad():
                for p in self.model.parameters():
                    p.fill_(math.nan)

    def extra_stats(self):
        return {"consensus_distance": 0.5 * self.counter}

    def describe(self):
        return {"algorithm": self.spec, "compressor": "none", "strategy": "allreduce", "error_feedback": False}


class _Registry:
    @staticmethod
    def names():
        return ["stub"]

    @staticmethod
    def parse(spec):
        _, _, params = spec.partition(":")
        return _Counting, ({"nan_at": int(params.partition("=")[2])} if params else {})

    @staticmethod
    def create(spec, model, optimizer, compressor=None, **options):
        return _Counting(spec, model, optimizer, **_Registry.parse(spec)[1])


@pytest.fixture(autouse=True)
def stub_registry(monkeypatch):
    monkeypatch.setattr(algorithm, "_registry", lambda: _Registry)


COMMON = {"workload": "digits-mlp", "hidden": 8, "samples": 64, "batch_size": 16, "epochs": 2, "optimizer": "sgd",
          "lr": 0.1, "algorithm": "stub", "progress": False}  # 4 steps per epoch, 8 steps


def _rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_each_logged_row_averages_its_window_and_evaluates_at_epoch_ends_the_last_step_and_eval_every(tmp_path):
    """log_every 3, eval_every 5: rows at steps 3, 4 (epoch end), 5, 6, 8
    (last); each row's loss is the mean of the per-step losses since the
    previous row (those of a log_every 1 run, by hand in float64), its bytes
    the bytes sent per step since then, its epoch ``e + (b + 1) / 4``; the
    metric (and the consensus distance) at steps 4, 5 and 8 only."""
    train.run({**COMMON, "out": str(tmp_path / "each"), "log_every": 1})
    losses = {r["step"]: r["loss"] for r in _rows(tmp_path / "each")}
    summary = train.run({**COMMON, "out": str(tmp_path / "w"), "log_every": 3, "eval_every": 5})
    rows = _rows(tmp_path / "w")
    assert [r["step"] for r in rows] == [3, 4, 5, 6, 8]
    start = 1
    for r in rows:
        window = [losses[s] for s in range(start, r["step"] + 1)]
        assert r["loss"] == pytest.approx(math.fsum(window) / len(window), rel=1e-12, abs=0)
        assert r["bytes"] == 10.0 and r["bytes_total"] == 10 * r["step"] and r["step_s"] > 0
        assert r["epoch"] == (r["step"] - 1) // 4 + ((r["step"] - 1) % 4 + 1) / 4
        evaluated = r["step"] in (4, 5, 8)
        assert ("metric" in r) == evaluated and ("consensus_distance" in r) == evaluated
        if evaluated:
            assert r["consensus_distance"] == 0.5 * r["step"] and 0 <= r["metric"] <= 1
        start = r["step"] + 1
    assert [(h["step"], h["bytes_total"], h["loss"]) for h in summary["history"]] == [
        (r["step"], r["bytes_total"], r["loss"]) for r in rows if "metric" in r]
    assert summary["final_metric"] == rows[-1]["metric"] and summary["steps"] == 8


def test_resuming_mid_epoch_continues_at_the_next_batch_exactly(tmp_path):
    """Stopped after step 3 (batch 2 of epoch 0), the checkpoint's position is
    (0, 3); the resumed run's rows (loss, bytes per step) equal the uninterrupted run's."""
    train.run({**COMMON, "out": str(tmp_path / "full"), "log_every": 1})
    train.run({**COMMON, "out": str(tmp_path / "part"), "log_every": 1, "steps": 3})
    ck = torch.load(tmp_path / "part" / "checkpoint.pt", weights_only=True)
    assert (ck["epoch"], ck["batch"], ck["step"]) == (0, 3, 3)
    train.run({**COMMON, "out": str(tmp_path / "part"), "log_every": 1, "resume": True})
    full, part = _rows(tmp_path / "full"), _rows(tmp_path / "part")
    assert [(r["step"], r["loss"], r["bytes"], r["epoch"]) for r in part] == [
        (r["step"], r["loss"], r["bytes"], r["epoch"]) for r in full]


def test_a_resumed_run_takes_the_learning_rate_it_is_given(tmp_path):
    """docs/train.md: ``--epochs``, ``--steps`` and ``--lr`` may change on resume. Under the constant schedule
    nothing resets the rate each step, so the restored optimizer's rate must
    be replaced by the new one at setup."""
    common = {**COMMON, "schedule": "constant", "log_every": 4, "out": str(tmp_path)}
    LRS.clear()
    train.run({**common, "steps": 3})
    train.run({**common, "lr": 0.05, "resume": True})
    assert LRS == [0.1] * 3 + [0.05] * 5


def test_resuming_a_run_that_reached_its_steps_takes_no_step(tmp_path):
    """Resumed with the ``--steps`` it already reached (or fewer), a run has nothing left to do."""
    common = {**COMMON, "log_every": 1, "out": str(tmp_path)}
    train.run({**common, "steps": 3})
    for steps in (3, 2):
        s = train.run({**common, "steps": steps, "resume": True})
        assert s["steps"] == 3 and s["bytes_total"] == 30
        assert [r["step"] for r in _rows(tmp_path)] == [1, 2, 3]


@pytest.mark.parametrize("go_on", [False, True])
def test_the_first_non_finite_step_is_reported_and_the_run_stops_at_the_next_row(tmp_path, go_on):
    """Parameters NaN after step 5: step 6's loss is the first non-finite one.
    With log_every 4 the run notices at the row of step 8 and stops there,
    keeping the checkpoint of step 4; --allow-divergence goes on to the end."""
    out = tmp_path / "run"
    s = train.run({**COMMON, "epochs": 3, "algorithm": "stub:nan_at=5", "out": str(out), "log_every": 4,
                   "allow_divergence": go_on})
    assert s["diverged_at_step"] == 6
    assert s["steps"] == (12 if go_on else 8)
    ck = torch.load(out / "checkpoint.pt", weights_only=True)
    assert ck["step"] == (12 if go_on else 4)
    assert [r["loss"] is None for r in _rows(out)] == ([False, True, True] if go_on else [False, True])


def test_plain_progress_lines_come_about_every_5_percent_and_at_evaluations(tmp_path, capsys):
    """A non-terminal stderr gets plain lines every ``log_every * ceil(total
    / 20 / log_every)`` steps (2 here: 32 steps) and at every evaluation. The algorithm is shown without its
    parameters at their defaults (``stub``, not ``stub:nan_at=0``)."""
    train.run({**COMMON, "samples": 128, "batch_size": 8, "out": str(tmp_path), "log_every": 1, "progress": True})
    err = capsys.readouterr().err
    steps = [int(m) for m in re.findall(r"^digits-mlp stub/none: step (\d+)/32, loss \d+\.\d{4}, 10B/step, "
                                        r"\d+\.\d ms/step", err, re.M)]
    assert steps == list(range(2, 33, 2)), err
    assert re.search(r"step 16/32, .*, accuracy \d\.\d{4}$", err, re.M), err
    assert "step 14/32" in err and not re.search(r"step 14/32.*accuracy", err)  # no metric before the first evaluation


def test_omp_num_threads_sets_this_process_thread_pool(tmp_path, monkeypatch):
    before = torch.get_num_threads()
    want = 1 if before != 1 else 2
    monkeypatch.setenv("OMP_NUM_THREADS", str(want))
    try:
        train.run({**COMMON, "epochs": 1, "out": str(tmp_path), "log_every": 4})
        assert torch.get_num_threads() == want
    finally:
        torch.set_num_threads(before)
