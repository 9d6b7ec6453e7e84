"""``gradpress train --resume --reshard`` end to end (gloo): a checkpoint
of 4 workers (top-k with error feedback, one epoch) resumed on 2. Each new
rank starts with the float64 mean of the 4 saved residuals (read from the
checkpoint here) cast to float32, DDP's replicas are identical after the
first step, and the run completes, recording the reshard in summary.json and
the next checkpoint; without ``--reshard`` the run is refused before any
worker starts, naming both world sizes and the flag. Local SGD (replicas
that differ mid-period) starts every new rank from the mean of the saved
models (marked ``long``: another 4-worker run). A ring checkpoint is refused,
naming the strategy and the hop residual a saved rank holds (top-k with error
feedback); one of random-k (summable: no hop residual) continues from 2
workers on 3. Marked ``long`` too: 2 workers resumed on 4. ``ps`` (one-bit
with error feedback, whose root residuals are not zero) 2 -> 3: each new
rank starts with the root residuals of the keys the round robin gives it,
bitwise its saved root's (marked ``long``: 4 -> 2 -> 4); ``hierarchical``
2 hosts x 2 -> 1 x 2 (``long``): every new rank starts with the mean of the
saved leaders' host residuals, which the one host sends once in full. A
checkpoint stopped inside an epoch (2 workers) continues on 3 over exactly
the epoch's remaining samples. Without the ``long`` ones it starts 4
workers once and 2 or 3 workers seven times: 19 s at load 8 on the shared
2-core machine before the ps and mid-epoch tests, which add 20 s and 6 s
at a lighter load (the ps one 37 s at load 8); 105 s at load 20 (the
4-worker launch is most of it). The ``long`` ones: 4 -> 2 -> 4 of ps 38 s,
hierarchical 14 s at that lighter load."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from distributed import run_workers

from gradpress.cli import main as cli

COMMON = ["--workload", "mnist1d-cnn", "--hidden", "8", "--samples", "256", "--batch-size", "16",
          "--compressor", "topk:ratio=0.05", "--min-numel", "64", "--log-every", "1", "--no-progress",
          "--schedule", "cosine"]


def _mean64(tensors):
    total = torch.zeros(tensors[0].shape, dtype=torch.float64)
    for t in tensors:
        total = total + t.double()
    return total / len(tensors)


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    """A one-epoch checkpoint of 4 workers: 256 // 4 // 16 = 4 steps."""
    out = tmp_path_factory.mktemp("reshard") / "four"
    assert cli(["train", "--nproc", "4", "--epochs", "1", *COMMON, "--out", str(out)]) == 0
    return out


def _start(rank, world, out, options):
    """Build the resumed run on this rank (the session's own setup), return
    what it starts with, then take one step and return the parameters."""
    from gradpress.train.config import make_config
    from gradpress.train.loop import run_steps, shard_batches
    from gradpress.train.session import _Run

    cfg = make_config({"workload": "mnist1d-cnn", "hidden": 8, "samples": 256, "batch_size": 16, "epochs": 2,
                       "min_numel": 64, "schedule": "cosine", "out": out, "resume": True, "reshard": True,
                       **options})
    run = _Run(cfg)
    state = run.setup()
    algo_state = run.algo.state_dict()
    exchange = algo_state.get("exchange", algo_state)  # an algorithm's engine state, or the hook's
    start = {"residuals": {k: v.clone() for k, v in exchange["feedback"]["residuals"].items()},
             "model": {k: v.detach().clone() for k, v in run.model.state_dict().items()},
             "rank": exchange["rank"], "world_size": exchange["config"]["world_size"]}
    x, y = run.wl.train
    batches = shard_batches(x, y, seed=cfg.seed, rank=rank, world=world, batch_size=cfg.batch_size,
                            epochs=cfg.epochs, start=(state["epoch"], 0), count=1)
    run_steps(run.algo, run.opt, run.wl.loss, batches, lr=cfg.lr, schedule=cfg.schedule, horizon=16,
              step=state["step"])
    start["after"] = {k: v.detach().clone() for k, v in run.model.state_dict().items()}
    run.algo.close()
    return start


def test_four_workers_resume_on_two(four, tmp_path, capsys):
    saved = torch.load(four / "checkpoint.pt", weights_only=True)
    assert len(saved["ranks"]) == 4 and (saved["epoch"], saved["batch"], saved["step"]) == (1, 0, 4)
    res = [r["algorithm"]["feedback"]["residuals"] for r in saved["ranks"]]
    assert res[0] and any(not torch.equal(res[0][k], res[1][k]) for k in res[0])  # they differ per rank

    # without --reshard: refused in the launcher, naming both sizes and the flag
    capsys.readouterr()
    assert cli(["train", "--nproc", "2", "--epochs", "2", "--resume", *COMMON, "--out", str(four)]) == 2
    err = capsys.readouterr().err
    assert ("world_size: checkpoint has 4, this run has 2; pass --reshard to fold the per-rank state into 2 ranks "
            "(the global batch becomes 32)") in err

    # what each new rank starts with: the float64 mean of the 4 saved residuals, cast back
    starts = run_workers(_start, 2, str(four), {"compressor": "topk:ratio=0.05"})
    for rank, got in enumerate(starts):
        assert (got["rank"], got["world_size"]) == (rank, 2)
        assert set(got["residuals"]) == set(res[0])
        for key in res[0]:
            want = _mean64([r[key] for r in res]).to(res[0][key].dtype)
            assert torch.equal(got["residuals"][key], want), (rank, key)
    for key in starts[0]["after"]:  # DDP: the replicas are identical after the first step
        assert torch.equal(starts[0]["after"][key], starts[1]["after"][key]), key
    assert any(not torch.equal(starts[0]["model"][k], starts[0]["after"][k]) for k in starts[0]["model"])

    # the whole run: 4 steps on 4 workers, then epoch 2 on 2 workers (256 // 2 // 16 = 8 steps)
    run = tmp_path / "run"
    shutil.copytree(four, run)
    capsys.readouterr()
    assert cli(["train", "--nproc", "2", "--epochs", "2", "--resume", "--reshard", *COMMON, "--out", str(run)]) == 0
    assert "resharded: the checkpoint of 4 worker(s) continued on 2 at step 4 (epoch 1)" in capsys.readouterr().out
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 12
    assert summary["reshards"] == [{"from": 4, "to": 2, "step": 4, "epoch": 1}]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 13))
    after = torch.load(run / "checkpoint.pt", weights_only=True)
    assert len(after["ranks"]) == 2 and after["config"]["world_size"] == 2 and after["reshards"] == summary["reshards"]


@pytest.mark.long
def test_local_sgd_ranks_start_from_the_mean_of_the_saved_models(tmp_path):
    """period 3: the checkpoint after step 4 is mid-period, so the 4 saved replicas differ."""
    out = tmp_path / "local"
    args = [*COMMON, "--algorithm", "localsgd:period=3", "--out", str(out)]
    assert cli(["train", "--nproc", "4", "--epochs", "1", *args]) == 0
    saved = torch.load(out / "checkpoint.pt", weights_only=True)
    models = [r["model"] for r in saved["ranks"]]
    assert any(not torch.equal(models[0][k], models[1][k]) for k in models[0])
    starts = run_workers(_start, 2, str(out), {"compressor": "topk:ratio=0.05", "algorithm": "localsgd:period=3"})
    for got in starts:
        for key in models[0]:
            assert torch.equal(got["model"][key], _mean64([m[key] for m in models]).to(models[0][key].dtype)), key


def test_a_ring_checkpoint_is_refused_naming_the_strategy(tmp_path, capsys):
    out = tmp_path / "ring"
    args = [*COMMON, "--samples", "128", "--strategy", "ring", "--out", str(out)]
    assert cli(["train", "--nproc", "2", "--epochs", "1", *args]) == 0
    capsys.readouterr()
    assert cli(["train", "--nproc", "3", "--epochs", "2", "--resume", "--reshard", *args]) == 2
    err = capsys.readouterr().err
    assert "cannot reshard 2 rank(s) into 3: /algorithm/strategies/ring (strategy 'ring'): its per-hop residuals" in err
    assert "saved rank 0 holds residual 'ring/" in err  # top-k with error feedback: hop residuals


def test_a_ring_checkpoint_of_a_summable_compressor_resumes_on_another_world_size(tmp_path, capsys):
    """random-k through the ring keeps no hop residual (the summed payloads are the packets): the checkpoint
    of 2 workers holds nothing of its world size and continues on 3, the next checkpoint of 3 ranks."""
    out = tmp_path / "ring"
    args = [*COMMON, "--samples", "128", "--strategy", "ring", "--compressor", "randomk:ratio=0.05", "--out",
            str(out)]
    assert cli(["train", "--nproc", "2", "--epochs", "1", *args]) == 0
    saved = torch.load(out / "checkpoint.pt", weights_only=True)
    residuals = [r["algorithm"]["feedback"]["residuals"] for r in saved["ranks"]]
    assert residuals[0] and not any("/" in k for r in residuals for k in r), residuals[0].keys()  # worker's only
    capsys.readouterr()
    assert cli(["train", "--nproc", "3", "--epochs", "2", "--resume", "--reshard", *args]) == 0
    assert "resharded: the checkpoint of 2 worker(s) continued on 3" in capsys.readouterr().out
    after = torch.load(out / "checkpoint.pt", weights_only=True)
    assert len(after["ranks"]) == 3 and after["reshards"][0]["from"] == 2 and after["reshards"][0]["to"] == 3


@pytest.mark.long
def test_two_workers_resume_on_four(tmp_path):
    out = tmp_path / "two"
    assert cli(["train", "--nproc", "2", "--epochs", "1", *COMMON, "--out", str(out)]) == 0
    saved = torch.load(out / "checkpoint.pt", weights_only=True)
    res = [r["algorithm"]["feedback"]["residuals"] for r in saved["ranks"]]
    starts = run_workers(_start, 4, str(out), {"compressor": "topk:ratio=0.05"})
    for got in starts:
        for key in res[0]:
            assert torch.equal(got["residuals"][key], _mean64([r[key] for r in res]).float()), key
    assert cli(["train", "--nproc", "4", "--epochs", "2", "--resume", "--reshard", *COMMON, "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 8 + 4 and summary["reshards"] == [{"from": 2, "to": 4, "step": 8, "epoch": 1}]


def _root_residuals(state):
    """The root residuals (``root/<key>#ps``) of a saved rank's engine state."""
    return {k: v for k, v in state["algorithm"]["feedback"]["residuals"].items() if k.startswith("root/")}


def _check_ps_starts(saved, starts):
    """Each new rank starts with the root residuals of the keys the round robin gives it (key i of the
    saved ``roots`` on new rank i % M), each the saved root's tensor bitwise, and the float64 mean of the
    saved ranks' own residuals."""
    roots = saved["ranks"][0]["algorithm"]["strategies"]["ps"]["roots"]
    n, m = len(saved["ranks"]), len(starts)
    # one-bit with error feedback: the roots' re-encoding is lossy (top-k's is not: the root re-encodes at density
    # ratio x N, which holds the whole sum of N top-k packets, so its root residuals are zero)
    assert any(bool(t.abs().sum() > 0) for r in saved["ranks"] for t in _root_residuals(r).values())
    own = [{k: v for k, v in r["algorithm"]["feedback"]["residuals"].items() if "/" not in k} for r in saved["ranks"]]
    for rank, got in enumerate(starts):
        want = {}
        for i, key in enumerate(roots):
            assert roots[key] == i % n  # the saved run's round robin
            held = _root_residuals(saved["ranks"][i % n])
            if i % m == rank and f"root/{key}#ps" in held:
                want[f"root/{key}#ps"] = held[f"root/{key}#ps"]
        assert want or rank >= len(roots)
        assert {k for k in got["residuals"] if k.startswith("root/")} == set(want), rank
        for key, t in want.items():
            assert torch.equal(got["residuals"][key], t), (rank, key)
        for key in own[0]:
            assert torch.equal(got["residuals"][key], _mean64([o[key] for o in own]).to(own[0][key].dtype)), key
    for key in starts[0]["after"]:  # the replicas are identical after the first step on the new roots
        assert torch.equal(starts[0]["after"][key], starts[-1]["after"][key]), key


def test_a_ps_checkpoint_resumes_on_more_workers_with_its_root_residuals_moved(tmp_path, capsys):
    """ps, one-bit with error feedback, 2 workers -> 3: the roots of conv2, conv3, linear go from ranks 0, 1,
    0 to 0, 1, 2, so linear's root residual moves from saved rank 0 to new rank 2 (not a mean: the server's
    owed error, whole); the run completes and its next checkpoint has the new assignment."""
    out = tmp_path / "ps"
    args = [*COMMON, "--samples", "192", "--strategy", "ps", "--compressor", "onebit", "--out", str(out)]
    assert cli(["train", "--nproc", "2", "--epochs", "1", *args]) == 0
    saved = torch.load(out / "checkpoint.pt", weights_only=True)
    starts = run_workers(_start, 3, str(out), {"compressor": "onebit", "strategy": "ps", "samples": 192})
    _check_ps_starts(saved, starts)
    capsys.readouterr()
    assert cli(["train", "--nproc", "3", "--epochs", "2", "--resume", "--reshard", *args]) == 0
    assert "resharded: the checkpoint of 2 worker(s) continued on 3 at step 6 (epoch 1)" in capsys.readouterr().out
    after = torch.load(out / "checkpoint.pt", weights_only=True)
    keys = list(saved["ranks"][0]["algorithm"]["strategies"]["ps"]["roots"])
    for rank, r in enumerate(after["ranks"]):
        assert r["algorithm"]["strategies"]["ps"]["roots"] == {k: i % 3 for i, k in enumerate(keys)}
        assert {k for k in _root_residuals(r)} == {f"root/{k}#ps" for i, k in enumerate(keys) if i % 3 == rank}


@pytest.mark.long
def test_a_ps_checkpoint_goes_from_four_workers_to_two_and_back(tmp_path, capsys):
    """4 -> 2 (the root residual of saved rank 2 goes to new rank 0, saved rank 3's, none, nowhere), then the
    2-worker checkpoint back onto 4."""
    out = tmp_path / "ps"
    args = [*COMMON, "--strategy", "ps", "--compressor", "onebit", "--out", str(out)]
    assert cli(["train", "--nproc", "4", "--epochs", "1", *args]) == 0
    saved = torch.load(out / "checkpoint.pt", weights_only=True)
    _check_ps_starts(saved, run_workers(_start, 2, str(out), {"compressor": "onebit", "strategy": "ps"}))
    assert cli(["train", "--nproc", "2", "--epochs", "2", "--resume", "--reshard", *args]) == 0
    saved = torch.load(out / "checkpoint.pt", weights_only=True)
    assert len(saved["ranks"]) == 2 and saved["epoch"] == 2
    _check_ps_starts(saved, run_workers(_start, 4, str(out), {"compressor": "onebit", "strategy": "ps",
                                                             "epochs": 3}))
    assert cli(["train", "--nproc", "4", "--epochs", "3", "--resume", "--reshard", *args]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert [(r["from"], r["to"]) for r in summary["reshards"]] == [(4, 2), (2, 4)]
    assert summary["steps"] == 4 + 8 + 4


@pytest.mark.long
def test_a_hierarchical_checkpoint_of_two_hosts_continues_on_one(tmp_path, capsys):
    """2 hosts x 2 workers -> 1 host x 2 (``workers_per_host=2`` on 4, then 2 ranks): each new rank starts
    with the float64 mean of the saved leaders' (ranks 0 and 2) host residuals, the error the average owes;
    the one host's leader sends it once in full, so after the first step no host residual is left."""
    out = tmp_path / "hier"
    spec = "hierarchical:workers_per_host=2"
    args = [*COMMON, "--strategy", spec, "--out", str(out)]
    assert cli(["train", "--nproc", "4", "--epochs", "1", *args]) == 0
    saved = torch.load(out / "checkpoint.pt", weights_only=True)
    res = [r["algorithm"]["feedback"]["residuals"] for r in saved["ranks"]]
    hosts = sorted(k for k in res[0] if k.startswith("host/"))
    assert hosts and all(not any(k.startswith("host/") for k in res[r]) for r in (1, 3))
    assert any(not torch.equal(res[0][k], res[2][k]) for k in hosts)
    starts = run_workers(_start, 2, str(out), {"compressor": "topk:ratio=0.05", "strategy": spec})
    for rank, got in enumerate(starts):
        for key in hosts:
            want = _mean64([res[0][key], res[2][key]]).to(res[0][key].dtype)
            assert torch.equal(got["residuals"][key], want), (rank, key)
    capsys.readouterr()
    assert cli(["train", "--nproc", "2", "--epochs", "2", "--resume", "--reshard", *args]) == 0
    assert "resharded: the checkpoint of 4 worker(s) continued on 2" in capsys.readouterr().out
    after = torch.load(out / "checkpoint.pt", weights_only=True)
    for key in hosts:  # sent once in full by the one host's leader, then cleared
        assert torch.equal(after["ranks"][0]["algorithm"]["feedback"]["residuals"][key],
                           torch.zeros_like(res[0][key]))


def _mid_session(rank, world, out, options):
    """A resumed ``gradpress train`` worker (the session's own code) recording the sample indices of every
    batch it trains on (the batches dealt again from ``arange(n)`` with the same arguments)."""
    import gradpress.train.session as session
    from gradpress.train.config import make_config

    real = session.shard_batches
    seen = []

    def spy(x, y, **kw):
        idx = torch.arange(len(y))
        for (e, b, xb, yb), (_, _, ib, _) in zip(real(x, y, **kw), real(idx, idx, **kw)):
            seen.append((e, b, ib.tolist()))
            yield e, b, xb, yb

    session.shard_batches = spy
    cfg = make_config({"workload": "mnist1d-cnn", "hidden": 8, "samples": 192, "batch_size": 16, "epochs": 2,
                       "min_numel": 64, "schedule": "cosine", "compressor": "topk:ratio=0.05", "log_every": 1,
                       "progress": False, "out": out, "resume": True, "reshard": True, **options})
    return {"seen": seen, "summary": session.train(cfg)}


def test_a_checkpoint_inside_an_epoch_continues_on_three_workers_over_its_remaining_samples(tmp_path, capsys):
    """2 workers stopped by --steps 9 inside epoch 2 (6 steps per epoch: after batch 3 of it) -> 3 workers:
    the 2 ranks' 3 unseen batches each (6) are shared, 2 per new rank, numbered 2, 3 of the 3-world's 4; the
    epoch's samples (the 2-worker epoch's, by the formula here) are each seen once, the first 3 batches by
    the 2 workers, the rest by the 3."""
    from gradpress.train.loop import epoch_order

    out = tmp_path / "mid"
    args = [*COMMON, "--samples", "192", "--out", str(out)]
    assert cli(["train", "--nproc", "2", "--epochs", "2", "--steps", "9", *args]) == 0
    saved = torch.load(out / "checkpoint.pt", weights_only=True)
    assert (saved["epoch"], saved["batch"], saved["step"], saved["steps_per_epoch"]) == (1, 3, 9, 6)
    three = run_workers(_mid_session, 3, str(out), {})
    perm = epoch_order(192, 0, 1).tolist()
    before = [perm[r * 96 + j] for r in range(2) for j in range(3 * 16)]  # the 2 workers' batches 0..2
    after = [i for got in three for e, b, idx in got["seen"] for i in idx]
    assert sorted(before + after) == sorted(perm[r * 96 + j] for r in range(2) for j in range(96))
    for got in three:
        assert [(e, b) for e, b, _ in got["seen"]] == [(1, 2), (1, 3)]
    summary = three[0]["summary"]
    assert summary["steps"] == 11 and summary["world_size"] == 3
    assert summary["reshards"] == [{"from": 2, "to": 3, "step": 9, "epoch": 1, "batch": 3, "left": 2}]
    final = torch.load(out / "checkpoint.pt", weights_only=True)  # written at the epoch's end
    assert (final["epoch"], final["batch"], final["step"], len(final["ranks"])) == (2, 0, 11, 3)
