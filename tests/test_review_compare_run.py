"""``gradpress compare`` driver (review): diverged runs in the lr sweep and
the comparison, output files of a reused directory, failed runs."""

from __future__ import annotations

import json

import pytest
from refusals import forbid

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
            "nothing_compressed": False, "diverged_at_step": diverged_at,
            "allow_divergence": bool(getattr(cfg, "allow_divergence", False))}


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


def test_a_failed_run_is_recorded_and_the_others_go_on(tmp_path, monkeypatch, capsys):
    """One failed run no longer stops the compare: it is recorded as failed
    (its error and the exit status `gradpress train` gives it) in compare.json
    and the table, the other runs go on, and compare exits 1 naming it."""
    from gradpress.train.launch import WorkerFailed

    def run(cfg):
        if cfg.compressor == "fp16":
            raise WorkerFailed("worker rank 1 was killed by SIGKILL (pid 4242)")
        if cfg.compressor == "topk:ratio=0.1":
            raise ValueError("hierarchical: a worker found something wrong")  # a worker's ValueError: train exits 2
        return _summary(cfg, 0.5)

    monkeypatch.setattr(train, "run", run)
    out = tmp_path / "cmp"
    rc = cli(["compare", "--compressors", "none,fp16,topk:ratio=0.1,signsgd", "--workload", "digits-mlp",
              "--steps", "4", "--out", str(out)])
    assert rc == 1  # as `gradpress train` (docs/train.md, "Failures and exit codes"), not a traceback
    captured = capsys.readouterr()
    last = captured.err.strip().splitlines()[-1]
    assert last.startswith("gradpress compare: error: 2 of 4 runs failed:"), last
    assert "fp16, seed 0" in last and "killed by SIGKILL" in last and "topk:ratio=0.1, seed 0" in last
    runs = json.loads((out / "compare.json").read_text())
    assert [(r["compressor"], r["status"]) for r in runs] == [
        ("none", "finished"), ("fp16", "failed"), ("topk:ratio=0.1", "failed"), ("signsgd", "finished")]
    assert runs[1]["exit_code"] == 1 and "killed by SIGKILL (pid 4242)" in runs[1]["error"]
    assert runs[2]["exit_code"] == 2 and "something wrong" in runs[2]["error"]
    assert runs[1]["out"].endswith("1-fp16") and runs[1]["seed"] == 0
    assert "| `fp16`" in captured.out and "failed (exit 1)" in captured.out  # the printed table
    md = (out / "compare.md").read_text()
    assert "failed (exit 1)" in md and "failed (exit 2)" in md and "killed by SIGKILL" in md
    assert not (out / "compare-partial.json").exists()  # everything is in compare.json
    assert (out / "compare-stats.json").exists() and (out / "compare.png").exists()


def test_every_run_failed_writes_the_failures_and_exits_1(tmp_path, monkeypatch, capsys):
    from gradpress.train.launch import WorkerFailed

    def run(cfg):
        raise WorkerFailed(f"worker rank 0 timed out ({cfg.compressor})")

    monkeypatch.setattr(train, "run", run)
    out = tmp_path / "cmp"
    rc = cli(["compare", "--compressors", "none,fp16", "--workload", "digits-mlp", "--steps", "4", "--seeds", "2",
              "--out", str(out)])
    assert rc == 1
    err = capsys.readouterr().err
    assert "4 of 4 runs failed" in err and "fp16, seed 1: worker rank 0 timed out (fp16)" in err
    runs = json.loads((out / "compare.json").read_text())
    assert [(r["compressor"], r["seed"], r["status"]) for r in runs] == [
        ("none", 0, "failed"), ("none", 1, "failed"), ("fp16", 0, "failed"), ("fp16", 1, "failed")]


def test_a_failed_sweep_run_counts_as_no_metric_and_fails_the_compare(tmp_path, monkeypatch, capsys):
    from gradpress.train.launch import WorkerFailed

    def run(cfg):
        if cfg.lr == 0.1 and cfg.steps == 10:  # a sweep run (a quarter of --steps 40)
            raise WorkerFailed("worker rank 1 was killed by SIGKILL (pid 7)")
        return _summary(cfg, 0.5)

    monkeypatch.setattr(train, "run", run)
    out = tmp_path / "cmp"
    assert cli(_args(out, "--lr-sweep", "0.01,0.1")) == 1
    record = json.loads((out / "sweep.json").read_text())
    failed = [r for r in record["methods"][0]["runs"] if r.get("status") == "failed"]
    assert [(r["lr"], r["exit_code"]) for r in failed] == [(0.1, 1)] and failed[0]["final_metric"] is None
    assert record["methods"][0]["best_lr"] == 0.01
    assert [r["status"] for r in json.loads((out / "compare.json").read_text())] == ["finished"]
    assert "1 of 3 runs failed: sweep none at lr 0.1, seed 0: worker rank 1 was killed" in capsys.readouterr().err


def test_ctrl_c_still_exits_130_keeping_the_finished_and_failed_runs(tmp_path, monkeypatch, capsys):
    from gradpress.train.launch import WorkerFailed

    def run(cfg):
        if cfg.compressor == "fp16":
            raise WorkerFailed("worker rank 1 was killed by SIGKILL (pid 1)")
        if cfg.compressor == "signsgd":
            raise KeyboardInterrupt
        return _summary(cfg, 0.5)

    monkeypatch.setattr(train, "run", run)
    out = tmp_path / "cmp"
    assert cli(["compare", "--compressors", "none,fp16,signsgd,topk:ratio=0.1", "--workload", "digits-mlp",
                "--steps", "4", "--out", str(out)]) == 130
    assert "interrupted" in capsys.readouterr().err
    partial = json.loads((out / "compare-partial.json").read_text())
    assert [(r["compressor"], r["status"]) for r in partial] == [("none", "finished"), ("fp16", "failed")]
    assert not (out / "compare.json").exists()


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


def test_a_diverged_run_makes_compare_exit_3_as_train_does(tmp_path, monkeypatch, capsys):
    """`gradpress train` exits 3 when the loss became NaN/Inf (0 with
    --allow-divergence); compare exited 0. Now: the compare finishes, writes
    everything, names the diverged runs and exits 3 (0 and a warning with
    --allow-divergence); a failed run (exit 1) takes precedence."""
    def run(cfg):
        return _summary(cfg, 0.1, diverged_at=12) if cfg.compressor == "fp16" else _summary(cfg, 0.5)

    monkeypatch.setattr(train, "run", run)
    out = tmp_path / "cmp"
    args = ["compare", "--compressors", "none,fp16", "--workload", "digits-mlp", "--steps", "40", "--out", str(out)]
    assert cli(args) == 3
    err = capsys.readouterr().err
    assert "gradpress compare: error: 1 of 2 runs diverged (loss became non-finite): fp16, seed 0 at step 12" in err
    assert [r["diverged_at_step"] for r in json.loads((out / "compare.json").read_text())] == [None, 12]
    assert (out / "compare.md").exists()

    assert cli([*args, "--allow-divergence"]) == 0
    err = capsys.readouterr().err
    assert "gradpress compare: warning: 1 of 2 runs diverged (loss became non-finite): fp16, seed 0 at step 12" in err

    from gradpress.train.launch import WorkerFailed

    def worse(cfg):
        if cfg.compressor == "none":
            raise WorkerFailed("worker rank 1 was killed by SIGKILL (pid 3)")
        return run(cfg)

    monkeypatch.setattr(train, "run", worse)
    assert cli(args) == 1
    err = capsys.readouterr().err
    assert "1 of 2 runs failed: none, seed 0" in err and "1 of 2 runs diverged" in err


def test_a_real_diverged_run_exits_3(tmp_path, capsys):
    """End to end (one process, a few steps): lr 1e30 makes the loss NaN."""
    out = tmp_path / "cmp"
    rc = cli(["compare", "--compressors", "none", "--workload", "digits-mlp", "--hidden", "8", "--samples", "64",
              "--batch-size", "16", "--epochs", "1", "--optimizer", "sgd", "--lr", "1e30", "--log-every", "1",
              "--no-progress", "--out", str(out)])
    assert rc == 3
    assert "1 of 1 runs diverged" in capsys.readouterr().err
    assert json.loads((out / "compare.json").read_text())[0]["diverged_at_step"] is not None


def test_out_and_resume_in_a_config_file(tmp_path, monkeypatch, capsys):
    """`out` in a --config TOML is where compare writes (a --out flag overrides
    it); `resume = true` is refused, naming the key and the file (compare
    starts every run afresh), before anything trains."""
    calls = []
    monkeypatch.setattr(train, "run", lambda cfg: calls.append(cfg.out) or _summary(cfg, 0.5))
    monkeypatch.chdir(tmp_path)
    toml = tmp_path / "cmp.toml"
    toml.write_text('workload = "digits-mlp"\nsteps = 4\nout = "from-toml"\n')
    base = ["compare", "--compressors", "none,fp16", "--config", str(toml)]
    assert cli(base) == 0
    assert (tmp_path / "from-toml" / "compare.json").exists() and not (tmp_path / "runs").exists()
    assert [str(tmp_path / "from-toml" / n) for n in ("0-none", "1-fp16")] == [str(tmp_path / c) for c in calls]
    assert cli([*base, "--out", str(tmp_path / "flag")]) == 0
    assert (tmp_path / "flag" / "compare.json").exists()
    from gradpress import compare

    compare.run("none", {"config": str(toml)})  # the Python API: out left out -> the file's
    assert calls[-1] == "from-toml/0-none"

    calls.clear()
    toml.write_text('workload = "digits-mlp"\nsteps = 4\nresume = true\n')
    assert cli([*base, "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert f"resume: not a compare option (config file {str(toml)!r} sets resume = true)" in err
    assert calls == [] and not (tmp_path / "r").exists()
    toml.write_text('workload = "digits-mlp"\nsteps = 4\nresume = false\n')
    assert cli([*base, "--out", str(tmp_path / "f")]) == 0


def test_a_strategy_in_a_config_file_is_honoured(tmp_path, monkeypatch):
    """(rev2) compare filled in `collective` for every run whose options named
    no strategy, before the --config file was merged: a `strategy` in the
    file was silently replaced (`out` and `steps` from it were honoured). The
    file's strategy runs; a --strategy flag overrides it; neither: train's
    default, `collective`."""
    strategies = []
    monkeypatch.setattr(train, "run", lambda cfg: strategies.append(cfg.strategy) or _summary(cfg, 0.5))
    toml = tmp_path / "cmp.toml"
    toml.write_text('workload = "digits-mlp"\nsteps = 4\nstrategy = "allgather"\n')
    assert cli(["compare", "--compressors", "fp16,topk", "--config", str(toml), "--out", str(tmp_path / "a")]) == 0
    assert strategies == ["allgather", "allgather"]
    strategies.clear()
    assert cli(["compare", "--compressors", "fp16", "--config", str(toml), "--strategy", "ring",
                "--out", str(tmp_path / "b")]) == 0
    assert strategies == ["ring"]
    strategies.clear()
    toml.write_text('workload = "digits-mlp"\nsteps = 4\n')
    assert cli(["compare", "--compressors", "fp16", "--config", str(toml), "--out", str(tmp_path / "c")]) == 0
    from gradpress import compare

    compare.run("fp16", {"workload": "digits-mlp", "steps": 4, "strategy": None}, out=str(tmp_path / "d"))
    assert strategies == ["collective", "collective"]


@pytest.fixture
def no_runs(monkeypatch):
    """Any training run fails the test: the options must be refused before the first."""
    forbid(monkeypatch, "a run started", (train, "run"))


def test_an_out_that_cannot_be_written_is_refused_before_any_run(tmp_path, capsys, no_runs):
    """The runs' own directories were checked as runs/train (compare sets them after the check): a file as
    --out, or under it, raised NotADirectoryError from removing old outputs, a traceback with exit 1."""
    (tmp_path / "file").write_text("x")
    for out in (tmp_path / "file", tmp_path / "file" / "cmp"):
        assert cli(_args(out)) == 2
        err = capsys.readouterr().err
        assert err.startswith("gradpress compare: error: --out: ") and str(out) in err, err
        assert len(err.strip().splitlines()) == 1, err


def test_a_batch_the_data_cannot_fill_is_refused_before_any_run(tmp_path, capsys, no_runs):
    """Each run refused it in turn (recorded as failed runs, '1 of 1 runs failed', exit 1): it is an option
    error, exit 2, before anything trains."""
    assert cli([*_args(tmp_path / "c"), "--samples", "3", "--nproc", "1"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == ("gradpress compare: error: batch_size 32 x 1 workers exceeds the 3 training samples of "
                           "'digits-mlp'; use a smaller --batch-size"), err
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("line", ['compressor = "topk:ratio=0.01"', "compressor = 5", 'algorithm = ["ddp"]',
                                  'algorithm = "localsgd"'])
def test_algorithm_or_compressor_in_a_config_file_is_refused(tmp_path, capsys, no_runs, line):
    """Compare sets both per run: the file's value (even a malformed one, compressor = 5) was ignored
    silently and the compare ran."""
    toml = tmp_path / "cmp.toml"
    toml.write_text(f'workload = "digits-mlp"\nsteps = 4\n{line}\n')
    assert cli(["compare", "--compressors", "none", "--config", str(toml), "--out", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err
    key = line.split(" ")[0]
    assert err.startswith(f"gradpress compare: error: {key}: not a compare option (config file {str(toml)!r} sets "
                          f"{key} = "), err
    assert "--compressors" in err and "--algorithms" in err and len(err.strip().splitlines()) == 1, err
