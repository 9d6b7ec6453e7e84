"""``gradpress train``: configuration and errors, every workload end to end,
sharding, agreement between ranks, exact resume on 2 workers (also from a
checkpoint written before algorithms existed), the loop's algorithm
interface."""

from __future__ import annotations

import json
import pickle
import shutil

import numpy as np
import pytest
import torch
from distributed import run_workers
from stub_algorithm import CountingAlgorithm

from gradpress import torch_compat, train
from gradpress.cli import main as cli

TINY = ["--samples", "96", "--batch-size", "16", "--no-progress", "--log-every", "1"]


def _rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _write_legacy(path):
    """Rewrite a checkpoint as the train.py before algorithms wrote it
    (format gradpress-train/1): no algorithm in the config, per rank the
    hook's state under "hook" and numpy's own RNG tuple (a pickled array)."""
    ck = torch.load(path, weights_only=True)
    ranks = []
    for r in ck["ranks"]:
        rng, npy = r["rng"], r["rng"]["numpy"]
        ranks.append({"hook": r["algorithm"], "rng": {
            "torch": rng["torch"],
            "numpy": (npy["name"], npy["key"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"],
                      npy["cached_gaussian"]),
            "python": (rng["python"][0], tuple(rng["python"][1]), rng["python"][2])}})
    config = {k: v for k, v in ck["config"].items() if k not in ("algorithm", "nonfinite")}
    torch.save({**ck, "format": "gradpress-train/1", "config": config, "ranks": ranks}, path)


# ------------------------------------------------------------------ errors
@pytest.mark.parametrize("argv,needle", [
    (["--workload", "imagenet"], "unknown workload 'imagenet'; allowed: mnist1d-cnn"),
    (["--error-feedback", "maybe"], "--error-feedback must be one of on, off, auto"),
    (["--optimizer", "lbfgs"], "optimizer must be one of sgd, momentum, adam"),
    (["--lr", "-1"], "lr must be a positive"),
    (["--epochs", "0"], "epochs must be an integer >= 1"),
    (["--compressor", "nosuch:ratio=1"], "unknown compressor 'nosuch'"),
    (["--compressor", "topk:ratio=7"], "ratio"),
    (["--strategy", "carrier-pigeon"], "unknown strategy 'carrier-pigeon'"),
    (["--strategy", "hierarchical:chunk=-5"], "'chunk' got -5"),
    (["--strategy", "ring:chunk=5"], "strategy 'ring' takes no parameters"),
    (["--device", "tpu"], "device must be one of cpu, cuda"),
    (["--params", "10M"], "params sets the size of 'wide-mlp' only"),
    (["--workload", "wide-mlp", "--params", "lots"], "params must be a count"),
    (["--workload", "data-mlp"], "data: workload 'data-mlp' needs --data"),
    (["--schedule", "zigzag"], "schedule must be one of constant, cosine"),
    (["--algorithm", "ddp:period=2"], "algorithm 'ddp' takes no parameters"),
    (["--algorithm", ""], "algorithm must be a spec string"),
    (["--nonfinite", "ignore"], "nonfinite must be one of propagate, skip, raise"),
    (["--algorithm", "nosuch"], "unknown algorithm 'nosuch'; allowed: ddp, "),
    (["--algorithm", "localsgd:period=0"], "algorithm 'localsgd': parameter 'period' got 0"),
    (["--algorithm", "localsgd:perio=2"], "unknown parameter 'perio' (did you mean 'period'?); allowed parameters: period"),
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


def _count_data_reads(monkeypatch):
    """Counts of the .npy members numpy reads in this process (``x`` and
    ``y`` of a --data archive: each read decompresses the whole array) and
    of the bytes read out of zip members (a header-only look reads a few
    hundred)."""
    import zipfile

    counts = {"arrays": 0, "bytes": 0}
    read_array, zip_read = np.lib.format.read_array, zipfile.ZipExtFile.read

    def counting_read_array(*a, **k):
        counts["arrays"] += 1
        return read_array(*a, **k)

    def counting_zip_read(self, n=-1):
        data = zip_read(self, n)
        counts["bytes"] += len(data)
        return data

    monkeypatch.setattr(np.lib.format, "read_array", counting_read_array)
    monkeypatch.setattr(zipfile.ZipExtFile, "read", counting_zip_read)
    return counts


def test_a_data_file_is_read_once_by_the_launcher(tmp_path, monkeypatch):
    """A --data file was read whole three times (the config check, the
    launcher's preload, each worker): the config check now reads the .npy
    headers only, the launcher reads the arrays once (its preload, which
    checks the values before any worker starts), each worker once."""
    from gradpress.train import launch

    rng = np.random.RandomState(0)
    path = tmp_path / "big.npz"
    np.savez(path, x=rng.randn(4000, 8), y=np.arange(4000) % 3)  # 256 KB of features
    counts = _count_data_reads(monkeypatch)
    cfg = train.make_config({"data": str(path), "nproc": 2, "steps": 1, "out": str(tmp_path / "o")})
    assert counts == {"arrays": 0, "bytes": counts["bytes"]} and counts["bytes"] < 1024, counts
    launched = []
    monkeypatch.setattr(launch, "_start_forkserver", lambda: None)
    monkeypatch.setattr("torch.distributed.launcher.api.elastic_launch",
                        lambda config, entry: lambda cfg_dict, env: launched.append(cfg_dict) or {0: {"ok": {}}})
    assert launch.run(cfg) == {} and len(launched) == 1
    assert counts["arrays"] == 2, counts  # x and y, once each: the preload
    # a worker builds its data once: x and y once each
    counts["arrays"] = 0
    from gradpress import workloads

    workloads.build("data-mlp", data=str(path), hidden=8)
    assert counts["arrays"] == 2, counts


def test_bad_data_values_still_fail_before_any_worker_starts(tmp_path, monkeypatch):
    """What the headers cannot show (NaN features, non-integer labels, one
    class) is found by the launcher's one read, before any worker starts,
    with the same messages."""
    from gradpress.train import launch

    monkeypatch.setattr(launch, "_start_forkserver", lambda: None)
    monkeypatch.setattr("torch.distributed.launcher.api.elastic_launch",
                        lambda *a: pytest.fail("a worker was started"))
    x = np.zeros((30, 4))
    for arrays, match in [({"x": np.full((30, 4), np.nan), "y": np.arange(30) % 2}, "NaN"),
                          ({"x": x, "y": np.linspace(0, 1, 30)}, "y must hold integer class labels"),
                          ({"x": x, "y": np.zeros(30, dtype=int)}, "at least 2 classes")]:
        np.savez(tmp_path / "bad.npz", **arrays)
        with pytest.raises(ValueError, match=match):
            launch.run({"data": str(tmp_path / "bad.npz"), "nproc": 2, "steps": 1, "out": str(tmp_path / "o")})


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
    assert s["algorithm"] == "ddp" and s["compressor"] == (argv[argv.index("--compressor") + 1]
                                                           if "--compressor" in argv else "none")
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
    ckpt = torch.load(part / "checkpoint.pt", weights_only=True)  # tensors, numbers, strings only
    assert ckpt["format"] == "gradpress-train/2" and ckpt["config"]["algorithm"] == "ddp"
    assert len(ckpt["ranks"]) == 2 and (ckpt["epoch"], ckpt["batch"]) == (1, 0)
    assert "model" not in ckpt["ranks"][0]  # ddp keeps replicas identical: one copy of model and optimizer
    res = [ckpt["ranks"][r]["algorithm"]["feedback"]["residuals"] for r in range(2)]
    assert res[0] and any(not torch.equal(res[0][k], res[1][k]) for k in res[0])  # per-rank state matters
    legacy = tmp_path / "legacy"
    shutil.copytree(part, legacy)
    _write_legacy(legacy / "checkpoint.pt")
    assert cli([*common, "--out", str(part), "--resume"]) == 0
    a, b = _rows(full), _rows(part)
    assert [r["step"] for r in b] == list(range(1, 17))
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    assert [r.get("metric") for r in a] == [r.get("metric") for r in b]
    sa, sb = (json.loads((d / "summary.json").read_text()) for d in (full, part))
    assert sa["final_metric"] == sb["final_metric"] and sa["bytes_total"] == sb["bytes_total"]
    # a checkpoint of the train.py before algorithms (gradpress-train/1, numpy RNG state, the
    # hook's state under "hook") resumes as algorithm ddp, exactly
    with pytest.raises(pickle.UnpicklingError):
        torch.load(legacy / "checkpoint.pt", weights_only=True)  # numpy arrays: not plain weights
    if not torch_compat.allows_globals():  # torch 2.2.2: no way to allow numpy in weights_only
        from gradpress.train.checkpoint import load as load_checkpoint

        with pytest.raises(ValueError, match="holds numpy objects.*resume it with a newer torch"):
            load_checkpoint(legacy / "checkpoint.pt")
    else:
        assert cli([*common, "--out", str(legacy), "--resume", "--compressor", "none"]) == 2  # checked as any other
        assert cli([*common, "--out", str(legacy), "--resume"]) == 0
        assert [r["loss"] for r in _rows(legacy)] == [r["loss"] for r in a]
    # a changed configuration is refused, naming the field
    assert cli([*common, "--out", str(part), "--resume", "--seed", "9"]) == 2


# ------------------------------------------------------------------ checkpoints and the algorithm seam
def test_resume_checks_name_the_algorithm_and_refuse_foreign_files(tmp_path):
    from gradpress.train import checkpoint

    cfg = train.make_config({"workload": "digits-mlp", "out": str(tmp_path)})
    assert cfg.algorithm == "ddp" and cfg.compressor == "none"  # left out: the algorithm's default
    state = {"format": checkpoint.FORMAT, "config": {**checkpoint.compat(cfg, 2), "algorithm": "localsgd:period=4"}}
    with pytest.raises(ValueError, match=r"algorithm: checkpoint has 'localsgd:period=4', this run has 'ddp'"):
        checkpoint.check_resume(state, cfg, 2)
    checkpoint.check_resume({**state, "config": checkpoint.compat(cfg, 2)}, cfg, 2)
    with pytest.raises(ValueError, match=r"world_size: checkpoint has 2, this run has 3"):
        checkpoint.check_resume({**state, "config": checkpoint.compat(cfg, 2)}, cfg, 3)
    with pytest.raises(ValueError, match=r"format 'other/1'; allowed: 'gradpress-train/2', 'gradpress-train/1'"):
        checkpoint.check_resume({"format": "other/1"}, cfg, 2)
    # a file that needs arbitrary unpickling is refused before anything runs
    torch.save({"format": "gradpress-train/2", "evil": _NotAWeight()}, tmp_path / "checkpoint.pt")
    with pytest.raises(ValueError, match="not a gradpress training checkpoint.*weights_only"):
        checkpoint.load(tmp_path / "checkpoint.pt")
    (tmp_path / "checkpoint.pt").write_text("not a zip")
    with pytest.raises(ValueError, match="not a gradpress training checkpoint"):
        checkpoint.load(tmp_path / "checkpoint.pt")


class _NotAWeight:
    pass


def test_rng_state_round_trips_through_weights_only(tmp_path):
    import random

    from gradpress.train import checkpoint

    cpu = torch.device("cpu")
    torch.manual_seed(3)
    np.random.seed(3)
    random.seed(3)
    np.random.standard_normal()  # a cached Gaussian in numpy's state
    torch.save(checkpoint.rng_state(cpu), tmp_path / "rng.pt")
    want = (torch.rand(3), np.random.standard_normal(3), random.random())
    checkpoint.set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True), cpu)
    got = (torch.rand(3), np.random.standard_normal(3), random.random())
    assert torch.equal(want[0], got[0]) and np.array_equal(want[1], got[1]) and want[2] == got[2]


class _Stub:
    """The smallest algorithm: no exchange, just the optimizer step (world size 1)."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer, self.steps = model, optimizer, 0

    def step(self):
        self.optimizer.step()
        self.steps += 1

    def eval_model(self):
        return self.model


def test_loop_drives_any_algorithm_through_the_interface():
    wl = train.workloads.build("digits-mlp", hidden=8, samples=64)
    opt = train.make_optimizer("sgd", wl.model.parameters(), 0.5)
    algo = _Stub(wl.model, opt)
    x, y = wl.train
    from gradpress.train.loop import shard_batches

    batches = list(shard_batches(x, y, seed=0, rank=0, world=1, batch_size=16, epochs=3))
    assert [(e, b) for e, b, _, _ in batches] == [(e, b) for e in range(3) for b in range(4)]
    assert torch.equal(batches[5][3], y[train.epoch_order(64, 0, 1)[16:32]])  # epoch 1, batch 1
    ticks, lrs = [], []

    def after(t):
        ticks.append(t)
        lrs.append(opt.param_groups[0]["lr"])
        return t.step == 6

    before = train.evaluate(wl, algo.eval_model())
    done = train.run_steps(algo, opt, wl.loss, batches, lr=0.5, schedule="cosine", horizon=12, step=2, after=after)
    assert done == 6 and algo.steps == 4 and [t.step for t in ticks] == [3, 4, 5, 6]
    assert lrs == pytest.approx([0.25 * (1 + np.cos(np.pi * s / 12)) for s in (2, 3, 4, 5)])
    assert all(t.seconds > 0 and t.loss.requires_grad for t in ticks)
    assert train.evaluate(wl, algo.eval_model()) != before and wl.model.training


class _Plain(CountingAlgorithm):
    """A stand-in for a registered algorithm: local steps, no exchange (world
    size 1), stats in the hook's vocabulary, state that must survive resume."""

    name = "plain"
    default_compressor = "fp16"
    PARAMS = (type("P", (), {"name": "every", "default": 1})(),)

    def __init__(self, spec, model, optimizer, compressor=None, **options):
        self.spec, self.model, self.optimizer = spec, model, optimizer
        self.compressor = compressor or self.default_compressor
        self.options = options
        self.counter = 0

    def step(self):
        self.optimizer.step()
        self.counter += 1

    def describe(self):
        return {"algorithm": self.spec, "compressor": self.compressor, "strategy": "allreduce",
                "error_feedback": False, "every": int(self.spec.partition("=")[2] or 1)}


class _Registry:
    """What train needs of gradpress.algorithms: names, parse, describe, create."""

    @staticmethod
    def names():
        return ["plain"]

    @staticmethod
    def parse(spec):
        name, _, params = spec.partition(":")
        if name != "plain":
            raise ValueError(f"unknown algorithm {name!r}; allowed: plain")
        key, _, value = params.partition("=")
        if params and (key != "every" or not value.isdigit()):
            raise ValueError(f"algorithm 'plain': bad parameter {params!r}; allowed parameters: every (int)")
        return _Plain, ({"every": int(value)} if params else {})

    @staticmethod
    def describe():
        return [{"name": "plain", "summary": "local steps only", "default_compressor": "fp16",
                 "params": [{"name": "every", "type": "int", "default": 1, "allowed": ">= 1", "doc": "unused"}]}]

    @staticmethod
    def create(spec, model, optimizer, compressor=None, **options):
        return _Registry.parse(spec)[0](spec, model, optimizer, compressor, **options)


@pytest.fixture
def plain_registry(monkeypatch):
    from gradpress.train import algorithm

    monkeypatch.setattr(algorithm, "_registry", lambda: _Registry)


def test_a_registered_algorithm_is_validated_listed_and_trained(plain_registry, tmp_path, capsys):
    assert train.make_config({"algorithm": "plain"}).compressor == "fp16"  # the algorithm's default compressor
    assert train.make_config({"algorithm": "plain:every=3", "compressor": "none"}).compressor == "none"
    with pytest.raises(ValueError, match="unknown algorithm 'nosuch'; allowed: ddp, plain"):
        train.make_config({"algorithm": "nosuch:every=2"})
    with pytest.raises(ValueError, match="algorithm 'plain': bad parameter 'every=x'"):
        train.make_config({"algorithm": "plain:every=x"})
    assert cli(["algorithms", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["name"], r["default_compressor"]) for r in rows] == [("ddp", "none"), ("plain", "fp16")]
    assert cli(["algorithms"]) == 0
    table = capsys.readouterr().out
    assert "ddp" in table and "plain" in table and "every=1 (>= 1)" in table

    common = {"workload": "digits-mlp", "hidden": 16, "samples": 128, "batch_size": 16, "epochs": 2,
              "algorithm": "plain:every=2", "progress": False, "log_every": 1}
    full = train.run({**common, "out": str(tmp_path / "full")})
    assert (full["algorithm"], full["compressor"], full["strategy"], full["every"]) == ("plain:every=2", "fp16",
                                                                                       "allreduce", 2)
    assert full["bytes_per_step"] == 10 and full["compression_ratio"] == 4 and full["steps"] == 16
    train.run({**common, "out": str(tmp_path / "part"), "steps": 8})
    ckpt = torch.load(tmp_path / "part" / "checkpoint.pt", weights_only=True)
    assert int(ckpt["ranks"][0]["algorithm"]["counter"]) == 8
    assert set(ckpt["ranks"][0]) == {"algorithm", "rng", "model", "optimizer"}  # replicas may differ: each rank's own
    resumed = train.run({**common, "out": str(tmp_path / "part"), "resume": True})
    assert [r["loss"] for r in _rows(tmp_path / "full")] == [r["loss"] for r in _rows(tmp_path / "part")]
    assert resumed["bytes_total"] == full["bytes_total"] == 160
    with pytest.raises(ValueError, match="algorithm: checkpoint has 'plain:every=2', this run has 'ddp'"):
        train.run({**common, "algorithm": "ddp", "compressor": "fp16", "out": str(tmp_path / "part"),
                   "resume": True})


def test_localsgd_trains_on_two_workers_and_resumes_exactly_mid_period(tmp_path, capsys):
    """A registered algorithm through train: its default compressor, its
    summary fields, and exact resume from a checkpoint taken between two
    averagings (replicas differ: each rank's model and optimizer are saved)."""
    assert train.make_config({"algorithm": "localsgd"}).algorithm == "localsgd:period=8,optimizer_state=auto"  # canonical spec
    assert train.make_config({"algorithm": "localsgd"}).compressor == "none"  # its default compressor
    common = ["train", "--nproc", "2", "--workload", "digits-mlp", "--hidden", "16", "--samples", "256",
              "--batch-size", "16", "--epochs", "2", "--algorithm", "localsgd:period=3", "--compressor",
              "topk:ratio=0.1", "--strategy", "allgather", "--min-numel", "64", "--log-every", "1", "--no-progress"]
    full, part = tmp_path / "full", tmp_path / "part"
    assert cli([*common, "--out", str(full)]) == 0
    assert "digits-mlp / localsgd:period=3 / topk:ratio=0.1 on 2 worker(s): 16 steps" in capsys.readouterr().out
    s = json.loads((full / "summary.json").read_text())
    assert (s["algorithm"], s["compressor"], s["strategy"], s["error_feedback"]) == (
        "localsgd:period=3,optimizer_state=auto", "topk:ratio=0.1", "allgather", True)
    # 5 averagings of top-10% deltas in 16 steps vs. DDP's dense gradient every step
    assert s["steps"] == 16 and s["compression_ratio"] > 10 and s["bytes_total"] > 0
    assert cli([*common, "--out", str(part), "--steps", "8"]) == 0  # 8 steps per epoch: 8 % 3 = 2 local steps
    ckpt = torch.load(part / "checkpoint.pt", weights_only=True)
    models = [ckpt["ranks"][r]["model"] for r in range(2)]
    assert any(not torch.equal(models[0][k], models[1][k]) for k in models[0])  # mid-period: replicas differ
    assert cli([*common, "--out", str(part), "--resume"]) == 0
    assert [r["loss"] for r in _rows(full)] == [r["loss"] for r in _rows(part)]
    assert [r.get("metric") for r in _rows(full)] == [r.get("metric") for r in _rows(part)]
    assert json.loads((part / "summary.json").read_text())["bytes_total"] == s["bytes_total"]
    assert cli([*common, "--out", str(part), "--resume", "--algorithm", "localsgd:period=4"]) == 2
    assert "algorithm: checkpoint has 'localsgd:period=3,optimizer_state=auto', this run has 'localsgd:period=4,optimizer_state=auto'" in capsys.readouterr().err


def test_algorithms_command_lists_ddp_and_the_registry(capsys):
    import gradpress.algorithms

    assert cli(["algorithms", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in rows] == ["ddp", *gradpress.algorithms.names()]
    assert rows[0] == {"name": "ddp", "summary": rows[0]["summary"], "params": [], "default_compressor": "none"}
    local = next(r for r in rows if r["name"] == "localsgd")
    assert local["params"][0]["name"] == "period" and local["params"][0]["default"] == 8
    assert cli(["algorithms"]) == 0
    out = capsys.readouterr().out
    assert "localsgd" in out and "period=8 (integer >= 1)" in out


def test_ddp_adapter_skips_the_optimizer_step_the_hook_dropped():
    """--nonfinite skip: a NaN gradient drops the step on every rank, and the
    ddp algorithm then leaves the optimizer alone (momentum untouched too)."""
    import torch.distributed as dist

    from gradpress.train.algorithm import create
    from gradpress.train.launch import init_group

    created = init_group("cpu")
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(64, 64)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        algo = create("ddp", model, opt, compressor="topk:ratio=0.1", strategy="allgather", min_numel=64,
                      nonfinite="skip")
        described = algo.describe()
        assert described.pop("plan")["decisions"]  # the plan, as JSON (summary.json's "plan")
        assert described == {"algorithm": "ddp", "compressor": "topk:ratio=0.1", "strategy": "allgather",
                             "error_feedback": True}
        assert algo.eval_model() is model and algo.model is not model  # forward through DDP, evaluate the module
        x = torch.randn(4, 64)
        before = [p.detach().clone() for p in model.parameters()]
        algo.model(x * float("nan")).sum().backward()
        algo.step()
        assert algo.stats["skipped_steps"] == 1 and not opt.state
        assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
        opt.zero_grad()
        algo.model(x).sum().backward()
        algo.step()
        assert algo.stats["skipped_steps"] == 1 and opt.state
        assert not torch.equal(before[0], model.weight)
        algo.close()
    finally:
        if created:
            dist.destroy_process_group()
