"""``gradpress compare --resume``: an interrupted grid continues, and its outputs are an uninterrupted
compare's. One real grid (digits-mlp, 2 compressors x 2 seeds, 16 steps each, in this process, no worker
process) is run straight, then again interrupted by Ctrl-C just after the first checkpoint of its third run
(a KeyboardInterrupt raised where ``checkpoint.save`` returns, as the signal does) with one finished run's
summary deleted, then resumed: one run read back, two resumed from their checkpoints (one at its end, one
after epoch 1), one run afresh; its compare.json equals the straight grid's in every figure but times, bit
for bit (bytes, metrics, histories), its plot byte for byte, and a second ``--resume`` reads every run back
and rewrites every output file byte for byte. The history's training clock (``seconds``) is the sum of the
step times the checkpoint keeps. The rest stands ``train.run`` in: the lr sweep read back, settings that
differ (a compressor, steps, an lr in a checkpoint) refused naming the directory and each setting before
anything trains, a rate the resumed sweep chooses otherwise refused right after the sweep, an equivalent compressor spelling reused, an earlier summary dropped before a run trains
again, non-finite numbers read back as the compare that trained wrote them. About 75 s on the shared
machine (the real grid 55 s)."""

from __future__ import annotations

import json
import math
import shutil

import pytest
from refusals import forbid

from gradpress import train
from gradpress.cli import main as cli
from gradpress.train import checkpoint, report
from gradpress.train.config import settings
from gradpress.train.launch import WorkerFailed

GRID = ["--compressors", "none,topk:ratio=0.1", "--seeds", "2", "--workload", "digits-mlp", "--hidden", "16",
        "--samples", "128", "--batch-size", "16", "--epochs", "2", "--lr", "0.01", "--min-numel", "64",
        "--eval-every", "4", "--no-progress"]
RUNS = ["0-none-s0", "0-none-s1", "1-topk_ratio=0.1-s0", "1-topk_ratio=0.1-s1"]
#: what a run's wall-clock figures are: they differ between any two runs of the same settings
TIMES = {"train_s", "median_step_s", "compress_s", "comm_s", "time_to_target"}
OUTPUTS = ("compare.json", "compare-stats.json", "compare.md", "compare.png")


def _figures(row: dict) -> dict:
    """A compare.json row without its times (the history without its clock) and its directory."""
    out = {k: v for k, v in row.items() if k not in TIMES and k != "out"}
    out["history"] = [{k: v for k, v in h.items() if k != "seconds"} for h in row["history"]]
    return out


def _stop_after_first_checkpoint_of(monkeypatch: pytest.MonkeyPatch, run_dir: str) -> None:
    real = checkpoint.save

    def save(path, cfg, *args, **kwargs):
        real(path, cfg, *args, **kwargs)
        if cfg.out.endswith(run_dir):
            raise KeyboardInterrupt  # Ctrl-C once the epoch-1 checkpoint is on disk

    monkeypatch.setattr(checkpoint, "save", save)


def test_an_interrupted_grid_resumed_gives_the_straight_grids_figures(tmp_path, monkeypatch, capsys):
    straight, cut = tmp_path / "straight", tmp_path / "cut"
    assert cli(["compare", *GRID, "--out", str(straight)]) == 0
    for name in RUNS:  # the history's clock: the sum of the step times up to each evaluation
        step_times = checkpoint.load(straight / name / "checkpoint.pt")["step_times"]
        hist = json.loads((straight / name / "summary.json").read_text())["history"]
        assert len(step_times) == 16 and [h["step"] for h in hist] == [4, 8, 12, 16]
        assert [h["seconds"] for h in hist] == pytest.approx([math.fsum(step_times[:h["step"]]) for h in hist],
                                                             rel=1e-9)
    with monkeypatch.context() as m:
        _stop_after_first_checkpoint_of(m, RUNS[2])
        assert cli(["compare", *GRID, "--out", str(cut)]) == 130
    assert [(cut / n / "summary.json").exists() for n in RUNS] == [True, True, False, False]
    cut_state = checkpoint.load(cut / RUNS[2] / "checkpoint.pt")
    assert cut_state["step"] == 8 and len(cut_state["history"]) == 2
    (cut / RUNS[1] / "summary.json").unlink()  # a run killed after its last checkpoint
    before = (cut / RUNS[0] / "summary.json").read_bytes()
    capsys.readouterr()
    assert cli(["compare", *GRID, "--resume", "--out", str(cut)]) == 0
    assert ("resume: reused 1 of 4 runs (finished), resuming 2 from their checkpoints, running 1"
            in capsys.readouterr().err)
    assert (cut / RUNS[0] / "summary.json").read_bytes() == before  # read back, not rerun
    # resumed, not rerun: its first two evaluations are the checkpoint's, their clock readings included
    assert json.loads((cut / RUNS[2] / "summary.json").read_text())["history"][:2] == cut_state["history"]
    want = json.loads((straight / "compare.json").read_text())
    got = json.loads((cut / "compare.json").read_text())
    assert [_figures(r) for r in got] == [_figures(r) for r in want]  # bytes and metrics exactly, every run
    assert got[0] == json.loads(before) | {k: got[0][k] for k in ("target", "steps_to_target", "bytes_to_target",
                                                                 "time_to_target", "reference",
                                                                 "delta_vs_reference", "status")}
    assert (cut / "compare.png").read_bytes() == (straight / "compare.png").read_bytes()  # no time in the plot
    stats = [json.loads((d / "compare-stats.json").read_text())["aggregate"] for d in (straight, cut)]
    for a, b in zip(*stats):
        for field in ("final_metric", "bytes_to_target", "steps_to_target", "vs_reference", "bytes_per_step"):
            assert a[field] == b[field], field
    # every run finished now: a second --resume reads all four back and writes every output byte for byte
    first = {name: (cut / name).read_bytes() for name in OUTPUTS}
    forbid(monkeypatch, "trained", (train, "run"))
    assert cli(["compare", *GRID, "--resume", "--out", str(cut)]) == 0
    assert "reused 4 of 4 runs (finished), resuming 0 from their checkpoints, running 0" in capsys.readouterr().err
    assert {name: (cut / name).read_bytes() for name in OUTPUTS} == first
    # a checkpoint of another lr (here: rewritten as one) is refused before anything trains, naming it
    (cut / RUNS[3] / "summary.json").unlink()
    state = checkpoint.load(cut / RUNS[3] / "checkpoint.pt")
    state["settings"]["lr"] = 0.02
    import torch

    torch.save(state, cut / RUNS[3] / "checkpoint.pt")
    assert cli(["compare", *GRID, "--resume", "--out", str(cut)]) == 2
    err = capsys.readouterr().err
    assert f"{RUNS[3]}/checkpoint.pt' is a run of a different configuration (lr: " in err
    assert "has 0.02, this compare has 0.01)" in err


def _fake_run(calls: list):
    """A stand-in for train.run that writes summary.json as train does (its settings included)."""
    def run(cfg):
        calls.append((cfg.compressor, cfg.lr, cfg.steps, cfg.seed))
        final = 0.5 + cfg.lr + 0.01 * cfg.seed + (0.1 if cfg.compressor == "none" else 0.0)
        summary = {"compressor": cfg.compressor, "algorithm": cfg.algorithm, "final_metric": final,
                   "final_loss": 1.0, "higher_is_better": True, "seed": cfg.seed, "median_step_s": 0.01,
                   "history": [{"step": 10, "bytes_total": 1000.0, "metric": final, "loss": 1.0, "seconds": 0.1}],
                   "bytes_per_step": 100.0, "compression_ratio": 1.0, "lr": cfg.lr, "strategy": "allreduce",
                   "workload": cfg.workload, "world_size": 1, "steps": cfg.steps, "batch_size": cfg.batch_size,
                   "optimizer": cfg.optimizer, "schedule": cfg.schedule, "metric": "accuracy",
                   "nothing_compressed": False, "diverged_at_step": None, "allow_divergence": False,
                   "settings": settings(cfg), "out": cfg.out}
        from pathlib import Path

        Path(cfg.out).mkdir(parents=True, exist_ok=True)
        report.write_summary(Path(cfg.out), summary)
        return summary
    return run


SWEEP = ["--compressors", "none,topk:ratio=0.1", "--workload", "digits-mlp", "--steps", "40", "--seeds", "2",
         "--lr-sweep", "0.01,0.03", "--no-progress"]


def test_the_lr_sweep_is_read_back_and_other_settings_are_refused_by_name(tmp_path, monkeypatch, capsys):
    calls: list = []
    monkeypatch.setattr(train, "run", _fake_run(calls))
    out = tmp_path / "cmp"
    assert cli(["compare", *SWEEP, "--out", str(out)]) == 0
    assert len(calls) == 4 + 4  # 2 methods x 2 rates (first seed), then 2 methods x 2 seeds
    files = {name: (out / name).read_bytes() for name in (*OUTPUTS, "sweep.json")}
    capsys.readouterr()
    with monkeypatch.context() as m:
        forbid(m, "trained", (train, "run"))
        assert cli(["compare", *SWEEP, "--resume", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "reused 4 of 4 lr-sweep runs" in err and "reused 4 of 4 runs (finished)" in err
    assert {name: (out / name).read_bytes() for name in files} == files
    # a sweep run deleted: only it runs again, and the sweep picks the same rates
    shutil.rmtree(out / "sweep" / "1-topk_ratio=0.1-lr0.03-s0")
    calls.clear()
    assert cli(["compare", *SWEEP, "--resume", "--out", str(out)]) == 0
    assert calls == [("topk:ratio=0.1", 0.03, 10, 0)]
    assert {name: (out / name).read_bytes() for name in files} == files
    # another --steps: every directory holds other settings; refused before anything trains, naming each
    forbid(monkeypatch, "trained", (train, "run"))
    assert cli(["compare", *SWEEP[:5], "20", *SWEEP[6:], "--resume", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "0-none-lr0.01-s0/summary.json' is a run of a different configuration (steps: " in err
    assert "has 10, this compare has 5)" in err and "remove" in err
    assert {name: (out / name).read_bytes() for name in files} == files  # nothing rewritten


def test_a_rate_the_sweep_now_chooses_otherwise_is_refused_before_a_comparison_run_trains(tmp_path, monkeypatch,
                                                                                           capsys):
    """An earlier compare whose sweep run topk@0.03 failed chose 0.01 for topk (exit 1). Resumed, the sweep
    reruns that run and now chooses 0.03 (the stand-in scores a higher lr higher): topk's comparison
    directories hold runs at 0.01. Refused right after the sweep (exit 2, naming the directory and both
    lrs), before any comparison run trains: 0-none-s1, its summary removed, would train first."""
    calls: list = []
    fake = _fake_run(calls)

    def failing(cfg):
        if cfg.compressor.startswith("topk") and cfg.lr == 0.03:
            raise WorkerFailed("worker 0 failed")
        return fake(cfg)

    monkeypatch.setattr(train, "run", failing)
    out = tmp_path / "cmp"
    assert cli(["compare", *SWEEP, "--out", str(out)]) == 1
    sweep_record = json.loads((out / "sweep.json").read_text())
    assert [m["best_lr"] for m in sweep_record["methods"]] == [0.03, 0.01]
    topk_dir = out / "1-topk_ratio=0.1-s0"
    assert json.loads((topk_dir / "summary.json").read_text())["settings"]["lr"] == 0.01
    (out / "0-none-s1" / "summary.json").unlink()
    earlier = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    assert {"compare.json", "compare.png", "sweep.json"} <= set(earlier)
    monkeypatch.setattr(train, "run", fake)
    calls.clear()
    capsys.readouterr()
    assert cli(["compare", *SWEEP, "--resume", "--out", str(out)]) == 2
    # refused: the earlier compare's outputs are all still there, unchanged (they were removed before the sweep)
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == earlier
    err = capsys.readouterr().err
    assert calls == [("topk:ratio=0.1", 0.03, 10, 0)]  # the failed sweep run only: no comparison run trained
    assert "lr-sweep: the sweep chose another rate" in err
    assert f"'{topk_dir / 'summary.json'}' is a run of a different configuration (lr: " in err
    assert "has 0.01, this compare has 0.03)" in err and f"remove '{topk_dir}'" in err


@pytest.mark.parametrize("recorded,reused", [("topk:ratio=0.5", False), ("topk:ratio=0.1,bucket=0", None),
                                             ("topk:ratio=0.10", True)])
def test_a_finished_run_is_reused_only_for_the_same_compressor(tmp_path, monkeypatch, capsys, recorded, reused):
    calls: list = []
    monkeypatch.setattr(train, "run", _fake_run(calls))
    args = ["compare", "--compressors", "none,topk:ratio=0.1", "--workload", "digits-mlp", "--steps", "10",
            "--no-progress", "--out", str(tmp_path / "cmp")]
    assert cli(args) == 0
    path = tmp_path / "cmp" / "1-topk_ratio=0.1" / "summary.json"
    summary = json.loads(path.read_text())
    summary["settings"]["compressor"] = recorded
    path.write_text(json.dumps(summary))
    calls.clear()
    capsys.readouterr()
    rc = cli([*args, "--resume"])
    err = capsys.readouterr().err
    if reused is None:  # a spec that does not build: not the same compressor either
        assert rc == 2 and f"(compressor: '{path}' has '{recorded}', this compare has 'topk:ratio=0.1')" in err
    elif reused:  # the same compressor spelled another way (canonical specs compared)
        assert rc == 0 and calls == [] and "reused 2 of 2 runs" in err
    else:
        assert rc == 2 and calls == [] and f"'{path}' is a run of a different configuration" in err
        assert "(compressor: " in err and "has 'topk:ratio=0.5', this compare has 'topk:ratio=0.1')" in err


def test_a_summary_without_recorded_settings_is_refused_not_guessed(tmp_path, monkeypatch, capsys):
    calls: list = []
    monkeypatch.setattr(train, "run", _fake_run(calls))
    args = ["compare", "--compressors", "none", "--workload", "digits-mlp", "--steps", "10", "--no-progress",
            "--out", str(tmp_path / "cmp")]
    assert cli(args) == 0
    path = tmp_path / "cmp" / "0-none" / "summary.json"
    path.write_text(json.dumps({k: v for k, v in json.loads(path.read_text()).items() if k != "settings"}))
    assert cli([*args, "--resume"]) == 2
    assert "records no settings" in capsys.readouterr().err and len(calls) == 1


def test_a_run_that_trains_again_first_drops_an_earlier_summary(tmp_path, monkeypatch, capsys):
    """Without --resume a run trains afresh; an earlier compare's summary.json in its directory (here one of
    another --steps) is removed before it trains, so a failure leaves none behind to be taken for this
    run's by a later --resume, which then runs it."""
    calls: list = []
    monkeypatch.setattr(train, "run", _fake_run(calls))
    args = ["compare", "--compressors", "none", "--workload", "digits-mlp", "--no-progress", "--out",
            str(tmp_path / "cmp")]
    assert cli([*args, "--steps", "20"]) == 0
    summary = tmp_path / "cmp" / "0-none" / "summary.json"
    assert json.loads(summary.read_text())["settings"]["steps"] == 20

    def fail(cfg):
        assert not summary.exists()  # gone before the run starts
        raise WorkerFailed("worker 0 failed")

    monkeypatch.setattr(train, "run", fail)
    assert cli([*args, "--steps", "10"]) == 1
    assert not summary.exists()
    monkeypatch.setattr(train, "run", _fake_run(calls))
    calls.clear()
    capsys.readouterr()
    assert cli([*args, "--steps", "10", "--resume"]) == 0
    assert calls == [("none", 0.003, 10, 0)] and "running 1" in capsys.readouterr().err


def test_non_finite_numbers_read_back_as_an_uninterrupted_compare_wrote_them(tmp_path, monkeypatch, capsys):
    """A diverged run's NaN metric and loss and an infinite number elsewhere (summary.json: null): the
    compare.json and compare.md of a compare read back entirely with --resume are byte for byte those of the
    compare that trained (NaN where only a number can stand, null elsewhere: strict JSON but for those)."""
    from pathlib import Path

    base = _fake_run([])

    def diverged(cfg):
        s = base(cfg)
        if cfg.compressor == "none":
            return s
        s.update(final_metric=math.nan, final_loss=math.nan, diverged_at_step=5, allow_divergence=True,
                 plan={"predicted_s": math.inf})
        s["history"] = [dict(s["history"][0], metric=math.nan, loss=math.inf)]
        report.write_summary(Path(cfg.out), s)
        return s

    monkeypatch.setattr(train, "run", diverged)
    args = ["compare", "--compressors", "none,topk:ratio=0.1", "--workload", "digits-mlp", "--steps", "10",
            "--target", "0.5", "--no-progress", "--out", str(tmp_path / "cmp")]
    assert cli(args) == 0
    first = {name: (tmp_path / "cmp" / name).read_bytes() for name in ("compare.json", "compare.md")}
    row = json.loads(first["compare.json"])[1]
    assert row["plan"] == {"predicted_s": None} and math.isnan(row["final_metric"])
    assert math.isnan(row["history"][0]["loss"])  # summary.json's null for inf: only a number can stand there
    forbid(monkeypatch, "trained", (train, "run"))
    assert cli([*args, "--resume"]) == 0
    assert {name: (tmp_path / "cmp" / name).read_bytes() for name in first} == first
