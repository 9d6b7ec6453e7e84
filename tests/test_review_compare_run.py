"""``gradpress compare`` driver (review): diverged runs in the lr sweep and
the comparison, output files of a reused directory, failed runs."""

from __future__ import annotations

import json

import pytest

from gradpress import train
from gradpress.cli import main as cli


def _summary(cfg, final, diverged_at=None):
    """What train.run returns: a run that diverged stopped at the next logging step with the metric of its
    last evaluation (finite: the evaluation before the NaN, or the NaN model's accuracy)."""
    hist = [{"step": 10, "bytes_total": 1000, "metric": final, "loss": 1.0}]
    return {"compressor": cfg.compressor, "algorithm": cfg.algorithm, "final_metric": final, "final_loss": 1.0,
            "higher_is_better": True, "history": hist, "seed": cfg.seed, "median_step_s": 0.01,
            "bytes_per_step": 100.0, "compression_ratio": 1.0, "lr": cfg.lr, "strategy": "allreduce",
            "workload": cfg.workload, "world_size": 1, "steps": cfg.steps, "batch_size": cfg.batch_size,
            "optimizer": cfg.optimizer, "schedule": cfg.schedule, "metric": "accuracy",
            "nothing_compressed": False, "diverged_at_step": diverged_at}


def _args(out, *extra):
    return ["compare", "--compressors", "none", "--workload", "digits-mlp", "--steps", "40", "--no-progress",
            "--out", str(out), *extra]


def test_lr_sweep_never_picks_a_rate_whose_run_diverged(tmp_path, monkeypatch):
    # lr 0.1 looked good at its last evaluation (0.8), then its loss became NaN at step 12: the sweep run
    # stopped short of its budget. 0.01 ran to the end (0.5). The rule: a diverged rate is never chosen.
    calls = []

    def fake_run(cfg):
        calls.append((cfg.lr, cfg.steps))
        return _summary(cfg, 0.8, diverged_at=12) if cfg.lr == 0.1 else _summary(cfg, 0.5)

    monkeypatch.setattr(train, "run", fake_run)
    out = tmp_path / "cmp"
    assert cli(_args(out, "--lr-sweep", "0.01,0.1")) == 0
    record = json.loads((out / "sweep.json").read_text())
    assert record["methods"][0]["best_lr"] == 0.01
    assert [c for c in calls if c[1] == 40] == [(0.01, 40)]


def test_a_reused_directory_keeps_no_files_of_an_earlier_compare(tmp_path, monkeypatch):
    out = tmp_path / "cmp"
    monkeypatch.setattr(train, "run", lambda cfg: _summary(cfg, 0.5))
    assert cli(_args(out, "--lr-sweep", "0.01,0.1")) == 0
    assert (out / "sweep.json").exists()

    def crash(cfg):  # the next compare's first run fails: nothing it wrote may look like a finished result
        raise RuntimeError("worker rank 1 was killed by SIGKILL")

    monkeypatch.setattr(train, "run", crash)
    with pytest.raises(RuntimeError):
        cli(_args(out))
    left = {p.name for p in out.iterdir() if p.is_file()}
    assert left.isdisjoint({"compare.json", "compare-stats.json", "compare.md", "compare.png", "sweep.json"}), left

    monkeypatch.setattr(train, "run", lambda cfg: _summary(cfg, 0.5))
    assert cli(_args(out, "--algorithms", "ddp")) == 0  # no sweep this time, and it finished
    stats = json.loads((out / "compare-stats.json").read_text())
    assert stats["sweep"] is None
    assert {p.name for p in out.iterdir() if p.is_file()} == {
        "compare.json", "compare-stats.json", "compare.md", "compare.png"}


def test_a_failed_worker_fails_compare_in_one_line_with_exit_1(tmp_path, monkeypatch, capsys):
    from gradpress.train.launch import WorkerFailed

    def run(cfg):
        if cfg.compressor == "fp16":
            raise WorkerFailed("worker rank 1 was killed by SIGKILL (pid 4242)")
        return _summary(cfg, 0.5)

    monkeypatch.setattr(train, "run", run)
    out = tmp_path / "cmp"
    rc = cli(["compare", "--compressors", "none,fp16", "--workload", "digits-mlp", "--steps", "4", "--out", str(out)])
    assert rc == 1  # as `gradpress train` (docs/train.md, "Failures and exit codes"), not a traceback
    err = capsys.readouterr().err
    assert "gradpress compare: error:" in err and "killed by SIGKILL" in err and "fp16" in err
    assert [s["compressor"] for s in json.loads((out / "compare-partial.json").read_text())] == ["none"]


def test_a_diverged_seed_counts_as_no_metric_in_the_target_and_the_aggregate():
    from types import SimpleNamespace

    from gradpress import compare, compare_report

    def run(name, seed, final, diverged_at=None):
        cfg = SimpleNamespace(compressor=name, algorithm="ddp", seed=seed, lr=0.01, workload="digits-mlp", steps=40,
                              batch_size=16, optimizer="sgd", schedule="constant")
        return _summary(cfg, final, diverged_at)

    # seed 1 of the reference diverged: its last evaluation (the NaN model's accuracy) is finite, 0.0625
    runs = [run("none", 0, 0.9), run("none", 1, 0.0625, diverged_at=30), run("none", 2, 0.8),
            run("fp16", 0, 0.88), run("fp16", 1, 0.87), run("fp16", 2, 0.86)]
    out = compare.annotate(runs, None)
    assert out[0]["target"] == pytest.approx(0.95 * (0.9 + 0.8) / 2)
    fm = compare_report.aggregate(out)[0]["final_metric"]
    assert fm["k"] == 2 and fm["mean"] == pytest.approx(0.85)
    assert "diverged at step 30" in compare.table(out)
