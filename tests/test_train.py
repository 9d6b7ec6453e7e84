"""``gradpress train``: configuration and errors, every workload end to end,
sharding, agreement between ranks, exact resume on 2 workers."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from distributed import run_workers

from gradpress import train
from gradpress.cli import main as cli

TINY = ["--samples", "96", "--batch-size", "16", "--no-progress", "--log-every", "1"]


def _rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


# ------------------------------------------------------------------ errors
@pytest.mark.parametrize("argv,needle", [
    (["--workload", "imagenet"], "unknown workload 'imagenet'; allowed: mnist1d-cnn"),
    (["--error-feedback", "maybe"], "error_feedback must be one of on, off, auto"),
    (["--optimizer", "lbfgs"], "optimizer must be one of sgd, momentum, adam"),
    (["--lr", "-1"], "lr must be a positive"),
    (["--epochs", "0"], "epochs must be an integer >= 1"),
    (["--compressor", "nosuch:ratio=1"], "unknown compressor 'nosuch'"),
    (["--compressor", "topk:ratio=7"], "ratio"),
    (["--strategy", "carrier-pigeon"], "unknown strategy 'carrier-pigeon'"),
    (["--device", "tpu"], "device must be one of cpu, cuda"),
    (["--params", "10M"], "params sets the size of 'wide-mlp' only"),
    (["--workload", "wide-mlp", "--params", "lots"], "params must be a count"),
    (["--workload", "data-mlp"], "data: workload 'data-mlp' needs --data"),
    (["--schedule", "zigzag"], "schedule must be one of constant, cosine"),
])
def test_bad_arguments_exit_2(capsys, tmp_path, argv, needle):
    assert cli(["train", "--out", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err
    assert "gradpress train: error:" in err and needle in err
    assert not (tmp_path / "metrics.jsonl").exists()


def test_bad_config_files(capsys, tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('epochs = 2\nlearning_rate = 0.1\n')
    assert cli(["train", "--config", str(cfg), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "unknown key 'learning_rate'" in err and "allowed:" in err and "lr" in err
    cfg.write_text('epochs = = 2\n')
    assert cli(["train", "--config", str(cfg)]) == 2
    assert "is not valid TOML" in capsys.readouterr().err
    cfg.write_text('epochs = "two"\n')
    assert cli(["train", "--config", str(cfg)]) == 2
    assert "epochs must be an integer" in capsys.readouterr().err
    assert cli(["train", "--config", str(tmp_path / "none.toml")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_bad_data_files(capsys, tmp_path):
    bad = tmp_path / "bad.npz"
    np.savez(bad, x=np.zeros((30, 4)), labels=np.zeros(30))
    assert cli(["train", "--data", str(bad)]) == 2
    assert "lacks array(s) y" in capsys.readouterr().err
    np.savez(bad, x=np.zeros((30, 4)), y=np.arange(29) % 2)
    assert cli(["train", "--data", str(bad)]) == 2
    assert "x has 30 samples but y has 29" in capsys.readouterr().err
    assert cli(["train", "--data", str(bad), "--workload", "digits-mlp"]) == 2
    assert "data: --data trains the 'data-mlp' workload" in capsys.readouterr().err


def test_resume_without_checkpoint(capsys, tmp_path):
    assert cli(["train", "--resume", "--out", str(tmp_path / "empty")]) == 2
    assert "resume: no checkpoint" in capsys.readouterr().err


def test_config_precedence(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('workload = "digits-mlp"\nlr = 0.5\nbatch-size = 8\nerror_feedback = true\n')
    c = train.make_config({"config": str(cfg), "lr": 0.25})
    assert (c.workload, c.lr, c.batch_size, c.error_feedback) == ("digits-mlp", 0.25, 8, "on")
    # unset fields take the workload's defaults
    assert c.epochs == train.workloads.defaults("digits-mlp")["epochs"]
    with pytest.raises(ValueError, match="unknown training option"):
        train.make_config({"colour": "red"})


def test_data_order_is_sharded_and_deterministic():
    n, world = 103, 3
    orders = [train._epoch_order(n, 5, e) for e in range(3)]
    assert torch.equal(orders[0], train._epoch_order(n, 5, 0))
    assert not torch.equal(orders[0], orders[1]) and not torch.equal(orders[0], train._epoch_order(n, 6, 0))
    per = n // world
    shards = [set(orders[1][r * per:(r + 1) * per].tolist()) for r in range(world)]
    assert all(len(s) == per for s in shards)
    assert not (shards[0] & shards[1]) and not (shards[1] & shards[2]) and not (shards[0] & shards[2])


# ------------------------------------------------------------------ training
@pytest.mark.parametrize("argv", [
    ["--workload", "mnist1d-cnn", "--hidden", "8", "--compressor", "topk:ratio=0.1", "--min-numel", "64"],
    ["--workload", "mnist1d-mlp", "--hidden", "16", "--compressor", "fp16", "--optimizer", "momentum"],
    ["--workload", "digits-mlp", "--hidden", "16", "--optimizer", "sgd", "--lr", "0.1"],
    ["--workload", "charlm-lstm", "--hidden", "16", "--text-bytes", "20000", "--samples", "32", "--batch-size", "8"],
    ["--workload", "wide-mlp", "--params", "30K", "--compressor", "topk:ratio=0.05", "--schedule", "cosine"],
])
def test_each_workload_trains(tmp_path, argv, capsys):
    out = tmp_path / "run"
    assert cli(["train", *TINY, "--steps", "4", "--out", str(out), *argv]) == 0
    assert "summary:" in capsys.readouterr().out
    s = json.loads((out / "summary.json").read_text())
    for key in ("workload", "compressor", "strategy", "world_size", "steps", "metric", "final_metric",
                "bytes_per_step", "dense_bytes_per_step", "compression_ratio", "median_step_s"):
        assert key in s, key
    assert s["steps"] == 4 and s["world_size"] == 1 and s["workload"] == argv[1]
    assert s["final_metric"] is not None and np.isfinite(s["final_metric"])
    assert ("test_accuracy" in s) == (s["metric"] == "accuracy")
    assert s["bytes_per_step"] > 0 and s["compression_ratio"] == pytest.approx(s["dense_bytes_per_step"] / s["bytes_per_step"])
    rows = _rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(np.isfinite(r["loss"]) and r["bytes"] > 0 for r in rows) and "metric" in rows[-1]
    assert (out / "checkpoint.pt").exists()


def test_user_data_trains(tmp_path):
    rng = np.random.RandomState(1)
    x = rng.randn(200, 5).astype(np.float32)
    y = (x[:, 0] + x[:, 1] > 0).astype(int)
    np.savez(tmp_path / "mine.npz", x=x, y=y)
    s = train.run({"data": str(tmp_path / "mine.npz"), "epochs": 8, "hidden": 16, "lr": 0.01,
                   "out": str(tmp_path / "o"), "progress": False})
    assert s["workload"] == "data-mlp" and s["test_accuracy"] > 0.75  # a learnable linear rule


def _in_group(rank, world, out):
    return train.run({"workload": "digits-mlp", "hidden": 16, "samples": 256, "batch_size": 16, "epochs": 2,
                      "compressor": "topk:ratio=0.05", "strategy": "allgather", "min_numel": 64, "out": out, "log_every": 1,
                      "progress": False})


def test_torchrun_style_group_ranks_agree(tmp_path):
    """Inside an existing process group (what torchrun gives) every rank
    returns the same metrics, and rank 0 writes the files."""
    a, b = run_workers(_in_group, 2, str(tmp_path / "g"))
    assert a["world_size"] == 2 and a["steps"] == 2 * (128 // 16)
    assert a["history"] == b["history"]
    assert a["compression_ratio"] > 1.5
    assert len(_rows(tmp_path / "g")) == a["steps"]


def test_resume_is_exact_on_two_workers(tmp_path):
    """Two epochs straight == one epoch, stop, resume for the second: the
    logged losses are bit-identical (residuals of both ranks restored)."""
    common = ["train", "--nproc", "2", "--workload", "mnist1d-cnn", "--hidden", "8", "--samples", "256",
              "--batch-size", "16", "--epochs", "2", "--compressor", "topk:ratio=0.05", "--strategy", "allgather",
              "--min-numel", "64",
              "--log-every", "1", "--no-progress"]
    full, part = tmp_path / "full", tmp_path / "part"
    assert cli([*common, "--out", str(full)]) == 0
    assert cli([*common, "--out", str(part), "--steps", "8"]) == 0  # 256 // 2 // 16 = 8 steps per epoch
    assert [r["step"] for r in _rows(part)] == list(range(1, 9))
    ckpt = torch.load(part / "checkpoint.pt", weights_only=False)
    assert len(ckpt["ranks"]) == 2 and (ckpt["epoch"], ckpt["batch"]) == (1, 0)
    res = [ckpt["ranks"][r]["hook"]["memory"]["residuals"] for r in range(2)]
    assert res[0] and any(not torch.equal(res[0][k], res[1][k]) for k in res[0])  # per-rank state matters
    assert cli([*common, "--out", str(part), "--resume"]) == 0
    a, b = _rows(full), _rows(part)
    assert [r["step"] for r in b] == list(range(1, 17))
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    assert [r.get("metric") for r in a] == [r.get("metric") for r in b]
    sa, sb = (json.loads((d / "summary.json").read_text()) for d in (full, part))
    assert sa["final_metric"] == sb["final_metric"] and sa["bytes_total"] == sb["bytes_total"]
    # a changed configuration is refused, naming the field
    assert cli([*common, "--out", str(part), "--resume", "--seed", "9"]) == 2
