"""Non-IID data splits (``--split``, gradpress/train/splits.py) against references computed here: the default
``iid`` split's batches are the old ones (the permutation formula written out here), ``labels:k`` (McMahan et
al. 2017: sort by label, cut into world x k shards, deal k to each worker) and ``dirichlet:alpha`` (Hsu et al.
2019: q_w ~ Dir(alpha p), slots filled one at a time in float64 here) give exactly the shards their definitions
give, with label histograms per worker, disjointness and coverage checked; every sample at most once per
epoch, the same assignment on every rank (2 gloo workers compute it in their own processes) and for every
seed its own; a resumed run's data walk is the uninterrupted one's, and ``gradpress train --resume`` mid-epoch
under ``labels:k=2`` (2 workers, SCAFFOLD) is bit-identical; bad values are refused before any worker starts,
naming the field. About 1 minute on 2 busy cores (three 2-worker training runs)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from distributed import run_workers
from refusals import forbid

from gradpress import train
from gradpress.cli import main as cli
from gradpress.train import checkpoint, loop, splits


# ------------------------------------------------------------------ references
def old_iid_order(n: int, seed: int, epoch: int) -> torch.Tensor:
    """The permutation ``gradpress train`` drew for every epoch before ``--split`` existed."""
    g = torch.Generator().manual_seed((seed * 1_000_003 + epoch * 7919 + 17) % (2**63 - 1))
    return torch.randperm(n, generator=g)


def _rng(kind: str, seed: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64([seed, splits._STREAM[kind]]))


def labels_reference(y: np.ndarray, world: int, k: int, seed: int) -> list[list[int]]:
    """McMahan et al.'s shards: a seeded choice of world*k*s samples (s = n // (world k)), sorted by label
    (Python's sort is stable: ties in the chosen order), cut into world*k runs of s, dealt k to a worker."""
    rng = _rng("labels", seed)
    n, shards = len(y), world * k
    size = n // shards
    keep = rng.permutation(n)[:shards * size].tolist()
    ordered = sorted(keep, key=lambda i: int(y[i]))
    cut = [ordered[j * size:(j + 1) * size] for j in range(shards)]
    deal = rng.permutation(shards).tolist()
    return [sum((cut[deal[w * k + i]] for i in range(k)), []) for w in range(world)]


def dirichlet_reference(y: np.ndarray, world: int, alpha: float, seed: int) -> list[list[int]]:
    """Hsu et al.'s q_w ~ Dir(alpha p), then one slot at a time (slot s belongs to worker s mod world): its
    class by inverse CDF of u_s under q_w restricted to the classes with samples left (p so restricted when
    q_w is 0 there), the next sample of that class's seeded shuffle."""
    rng = _rng("dirichlet", seed)
    n = len(y)
    classes = sorted(set(int(v) for v in y))
    code = np.array([classes.index(int(v)) for v in y])
    counts = np.array([int((code == j).sum()) for j in range(len(classes))])
    prior = counts / n
    q = rng.dirichlet(alpha * prior, size=world)
    pools = [list(rng.permutation(np.flatnonzero(code == j))) for j in range(len(classes))]
    per = n // world
    u = rng.random(per * world)
    left = counts.copy()
    out: list[list[int]] = [[] for _ in range(world)]
    for s in range(per * world):
        w = s % world
        weights = np.array([q[w, j] if left[j] > 0 else 0.0 for j in range(len(classes))])
        if weights.sum() <= 0:
            weights = np.array([prior[j] if left[j] > 0 else 0.0 for j in range(len(classes))])
        cum = np.cumsum(weights)
        target = u[s] * cum[-1]
        j = next((i for i in range(len(classes)) if cum[i] > target), max(np.flatnonzero(left > 0)))
        out[w].append(int(pools[j].pop(0)))
        left[j] -= 1
    return out


def _labels(n: int, classes: int, seed: int = 0) -> torch.Tensor:
    """Skewed class frequencies (class j about j + 1 times as frequent as class 0)."""
    g = torch.Generator().manual_seed(seed)
    return torch.multinomial(torch.arange(1, classes + 1, dtype=torch.float64), n, replacement=True, generator=g)


# ------------------------------------------------------------------ iid: unchanged
def test_the_default_split_is_iid_and_its_batches_are_the_old_ones(tmp_path):
    assert train.make_config({"out": str(tmp_path)}).split == "iid"
    assert splits.assign(splits.parse_split("iid"), torch.arange(50) % 3, 3, 7) is None
    n, world, bs, seed = 50, 3, 4, 7
    x = torch.arange(n, dtype=torch.float64).unsqueeze(1)
    y = torch.arange(n)
    per = n // world
    for rank in range(world):
        want = [(e, b, old_iid_order(n, seed, e)[rank * per:(rank + 1) * per][b * bs:(b + 1) * bs])
                for e in range(3) for b in range(per // bs)]
        got = list(loop.shard_batches(x, y, seed=seed, rank=rank, world=world, batch_size=bs, epochs=3))
        assert [(e, b) for e, b, _, _ in got] == [(e, b) for e, b, _ in want]
        assert all(torch.equal(g[3], w[2]) and torch.equal(g[2], x[w[2]]) for g, w in zip(got, want))


# ------------------------------------------------------------------ labels:k
def test_labels_k_gives_each_worker_k_whole_labels_when_every_shard_is_one_label():
    """10 classes of 40 samples, 5 workers, k = 2: 10 shards of 40, one label each, so every worker holds
    exactly 2 labels (40 samples of each), and the 5 workers together hold every sample once."""
    y = torch.arange(400) % 10
    shards = splits.assign(splits.parse_split("labels:k=2"), y, 5, seed=3)
    hist = [torch.bincount(y[s], minlength=10) for s in shards]
    for h in hist:
        assert sorted(h.tolist()) == [0] * 8 + [40, 40]
    assert torch.equal(sum(hist), torch.full((10,), 40))
    assert sorted(torch.cat(shards).tolist()) == list(range(400))


@pytest.mark.parametrize("n,classes,world,k,seed", [(1003, 10, 4, 2, 0), (1003, 10, 4, 1, 5), (500, 7, 3, 3, 1),
                                                    (97, 5, 2, 5, 2)])
def test_labels_k_against_the_sorted_shards_dealt_by_the_seed(n, classes, world, k, seed):
    y = _labels(n, classes, seed)
    got = splits.assign(splits.parse_split(f"labels:k={k}"), y, world, seed)
    want = labels_reference(y.numpy(), world, k, seed)
    assert [s.tolist() for s in got] == want
    size = n // (world * k)
    assert all(len(s) == k * size for s in got)
    flat = torch.cat(got)
    assert len(set(flat.tolist())) == len(flat) == world * k * size  # disjoint; n % (world k) left out
    for s in got:  # at most about k labels: each of the k sorted shards spans a run of labels
        runs = [set(y[s[i * size:(i + 1) * size]].tolist()) for i in range(k)]
        assert set(y[s].tolist()) == set().union(*runs)


# ------------------------------------------------------------------ dirichlet:alpha
@pytest.mark.parametrize("n,classes,world,alpha,seed", [(1003, 10, 4, 0.05, 0), (1003, 10, 4, 0.5, 1),
                                                        (600, 6, 3, 5.0, 2), (300, 40, 5, 0.3, 3),
                                                        (2000, 1500, 2, 1.0, 4)])
def test_dirichlet_against_the_one_slot_at_a_time_fill(n, classes, world, alpha, seed):
    y = _labels(n, classes, seed)
    got = splits.assign(splits.parse_split(f"dirichlet:alpha={alpha}"), y, world, seed)
    assert [s.tolist() for s in got] == dirichlet_reference(y.numpy(), world, alpha, seed)
    flat = torch.cat(got)
    assert all(len(s) == n // world for s in got)
    assert len(set(flat.tolist())) == len(flat) == world * (n // world)


def test_dirichlet_alpha_sets_how_far_each_workers_label_mix_is_from_the_prior():
    """Large alpha: every worker's mix is the prior (1000 samples: within 0.05 of it for every class, 5
    standard deviations); small alpha: far from it (mean total variation distance above 0.4)."""
    y = torch.arange(4000) % 10
    tv = {}
    for alpha in (1e4, 0.05):
        shards = splits.assign(splits.parse_split(f"dirichlet:alpha={alpha}"), y, 4, seed=0)
        mix = torch.stack([torch.bincount(y[s], minlength=10).double() / len(s) for s in shards])
        tv[alpha] = float((mix - 0.1).abs().sum(dim=1).mean() / 2)
        if alpha > 1:
            assert float((mix - 0.1).abs().max()) < 0.05
    assert tv[0.05] > 0.4 > 0.05 > tv[1e4]


# ------------------------------------------------------------------ epochs, seeds, ranks
@pytest.mark.parametrize("spec", ["labels:k=2", "dirichlet:alpha=0.3"])
def test_every_sample_at_most_once_per_epoch_in_a_new_order_each_epoch(spec):
    n, world, bs, seed = 403, 3, 8, 11
    y = _labels(n, 6, seed)
    x = torch.arange(n, dtype=torch.float64).unsqueeze(1)
    shards = splits.assign(splits.parse_split(spec), y, world, seed)
    size = len(shards[0])
    seen: dict[int, list[list[int]]] = {0: [], 1: []}
    for rank in range(world):
        walk = list(loop.shard_batches(x, y, seed=seed, rank=rank, world=world, batch_size=bs, epochs=2,
                                       shard=shards[rank]))
        assert len(walk) == 2 * (size // bs)
        for e in (0, 1):
            idx = torch.cat([xi[:, 0].long() for ep, _, xi, _ in walk if ep == e]).tolist()
            assert len(idx) == (size // bs) * bs and set(idx) <= set(shards[rank].tolist())
            assert all(torch.equal(yi, y[xi[:, 0].long()]) for _, _, xi, yi in walk)
            seen[e].append(idx)
        assert seen[0][-1] != seen[1][-1]  # a new order each epoch
    for e in (0, 1):
        flat = sum(seen[e], [])
        assert len(set(flat)) == len(flat)


def test_the_assignment_depends_on_the_seed_and_nothing_else():
    y = _labels(500, 8)
    for spec in ("labels:k=2", "dirichlet:alpha=0.5"):
        split = splits.parse_split(spec)
        a, b = splits.assign(split, y, 4, 0), splits.assign(split, y, 4, 0)
        assert all(torch.equal(p, q) for p, q in zip(a, b))
        c = splits.assign(split, y, 4, 1)
        assert any(not torch.equal(p, q) for p, q in zip(a, c))
    torch.manual_seed(5)
    np.random.seed(5)
    want = (torch.rand(2), np.random.rand(2))
    torch.manual_seed(5)
    np.random.seed(5)
    splits.assign(splits.parse_split("dirichlet:alpha=0.5"), y, 4, 0)
    assert torch.equal(torch.rand(2), want[0]) and np.array_equal(np.random.rand(2), want[1])  # global RNGs untouched


def _walk_on_rank(rank, world, spec, seed):
    y = _labels(300, 5, seed)
    x = torch.arange(300, dtype=torch.float64).unsqueeze(1)
    shards = splits.assign(splits.parse_split(spec), y, world, seed)
    walk = loop.shard_batches(x, y, seed=seed, rank=rank, world=world, batch_size=10, epochs=2, shard=shards[rank])
    return [s.tolist() for s in shards], [xi[:, 0].long().tolist() for _, _, xi, _ in walk]


def test_every_rank_computes_the_same_assignment_in_its_own_process():
    for spec in ("labels:k=2", "dirichlet:alpha=0.2"):
        results = run_workers(_walk_on_rank, 2, spec, 4)
        assert results[0][0] == results[1][0] == [s.tolist() for s in splits.assign(
            splits.parse_split(spec), _labels(300, 5, 4), 2, 4)]
        assert results[0][1] == _walk_on_rank(0, 2, spec, 4)[1] and results[1][1] == _walk_on_rank(1, 2, spec, 4)[1]
        assert not set(sum(results[0][1], [])) & set(sum(results[1][1], []))


def test_each_ranks_epoch_order_is_drawn_from_its_own_rank_too():
    """The module doc: an epoch's order is drawn from (seed, epoch, rank). Two ranks whose shards have one
    size must not walk them in the same positional order (``plants4``: the rank left out of the seed went
    unnoticed, since their shards hold other samples); each order is a permutation of the shard."""
    shard = torch.arange(64) * 3 + 1
    for seed, epoch in ((0, 0), (7, 2)):
        orders = [splits.shard_order(shard, seed, epoch, rank) for rank in range(4)]
        assert all(sorted(o.tolist()) == shard.tolist() for o in orders)
        assert len({tuple(o.tolist()) for o in orders}) == 4, f"seed {seed} epoch {epoch}: ranks share an order"
        assert not torch.equal(orders[0], splits.shard_order(shard, seed, epoch + 1, 0))  # and per epoch


def test_a_walk_resumed_mid_epoch_is_the_tail_of_the_uninterrupted_one():
    y = _labels(300, 5)
    x = torch.arange(300, dtype=torch.float64).unsqueeze(1)
    shard = splits.assign(splits.parse_split("dirichlet:alpha=0.2"), y, 3, 9)[1]
    full = list(loop.shard_batches(x, y, seed=9, rank=1, world=3, batch_size=8, epochs=3, shard=shard))
    per = len(shard) // 8
    part = list(loop.shard_batches(x, y, seed=9, rank=1, world=3, batch_size=8, epochs=3, shard=shard,
                                   start=(1, 3)))
    assert [(e, b) for e, b, _, _ in part] == [(e, b) for e, b, _, _ in full[per + 3:]]
    assert all(torch.equal(p[2], f[2]) for p, f in zip(part, full[per + 3:]))


def test_gradpress_train_resumes_mid_epoch_bit_identically_under_labels_k(tmp_path):
    """2 workers, SCAFFOLD (replicas differ between synchronizations), labels:k=2: 256 samples in 4 shards of
    64, 128 per worker, 8 steps per epoch; stopped at step 5 (mid-epoch), resumed: the losses and metrics of
    the uninterrupted run, bit for bit (the stopped run's own evaluation at step 5 aside); the split is in the
    summary and the checkpoint."""
    common = ["train", "--nproc", "2", "--workload", "mnist1d-cnn", "--hidden", "8", "--samples", "256",
              "--batch-size", "16", "--epochs", "2", "--split", "labels:k=2", "--algorithm", "scaffold:period=3",
              "--log-every", "1", "--no-progress"]
    full, part = tmp_path / "full", tmp_path / "part"
    assert cli([*common, "--out", str(full)]) == 0
    assert cli([*common, "--out", str(part), "--steps", "5"]) == 0
    ck = torch.load(part / "checkpoint.pt", weights_only=True)
    assert (ck["epoch"], ck["batch"], ck["config"]["split"]) == (0, 5, "labels:k=2")
    assert cli([*common, "--out", str(part), "--resume"]) == 0
    rows = [[json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()] for d in (full, part)]
    assert [r["step"] for r in rows[1]] == list(range(1, 17))
    assert [r["loss"] for r in rows[0]] == [r["loss"] for r in rows[1]]
    # the stopped run also evaluated at its last step, 5
    assert [r.get("metric") for r in rows[0] if r["step"] != 5] == [r.get("metric") for r in rows[1] if r["step"] != 5]
    summary = json.loads((full / "summary.json").read_text())
    assert summary["split"] == "labels:k=2" and summary["steps_per_epoch"] == 8
    assert cli([*common, "--out", str(part), "--resume", "--split", "iid"]) == 2  # another split: another run


def test_a_checkpoint_from_before_split_existed_resumes_as_iid(tmp_path):
    iid = train.make_config({"workload": "digits-mlp", "out": str(tmp_path)})
    old = {k: v for k, v in checkpoint.compat(iid, 2).items() if k != "split"}
    checkpoint.check_resume({"format": checkpoint.FORMAT, "config": old}, iid, 2)
    other = train.make_config({"workload": "digits-mlp", "out": str(tmp_path), "split": "labels:k=2"})
    with pytest.raises(ValueError, match="split: checkpoint has 'iid', this run has 'labels:k=2'"):
        checkpoint.check_resume({"format": checkpoint.FORMAT, "config": old}, other, 2)


# ------------------------------------------------------------------ refusals
def test_specs_are_canonical():
    assert train.make_config({"split": " dirichlet:alpha=.5 "}).split == "dirichlet:alpha=0.5"
    assert train.make_config({"split": "labels:k=03"}).split == "labels:k=3"
    assert train.make_config({"split": "iid:"}).split == "iid"


@pytest.mark.parametrize("value,says", [
    ("dirichlet:alpha=0", "alpha must be a finite number > 0, got 0"),
    ("dirichlet:alpha=-1", "alpha must be a finite number > 0, got -1"),
    ("dirichlet:alpha=nan", "alpha must be a finite number > 0, got nan"),
    ("dirichlet:alpha=inf", "alpha must be a finite number > 0, got inf"),
    ("dirichlet:alpha=lots", "alpha must be a number > 0, got 'lots'"),
    ("dirichlet", "'dirichlet' needs alpha="),
    ("dirichlet:k=2", "'dirichlet' takes alpha; got k"),
    ("labels:k=0", "k must be an integer >= 1, got 0"),
    ("labels:k=1.5", "k must be an integer >= 1, got '1.5'"),
    ("labels:k", "parameter 'k' is not key=value"),
    ("iid:alpha=1", "'iid' takes no parameters; got alpha"),
    ("zipf:s=2", "unknown kind 'zipf'"),
    ("", "must be a spec string"),
    (3, "must be a spec string"),
])
def test_bad_values_are_refused_naming_the_field_the_value_and_what_is_allowed(tmp_path, value, says):
    with pytest.raises(ValueError) as info:
        train.make_config({"split": value, "out": str(tmp_path)})
    msg = str(info.value)
    assert msg.startswith(f"split {value!r}: ") and says in msg
    assert msg.endswith(f"allowed: {splits.ALLOWED}")


@pytest.mark.parametrize("workload", ["charlm-lstm", "charlm-transformer"])
def test_workloads_without_labels_refuse_label_splits(tmp_path, workload):
    for spec in ("labels:k=1", "dirichlet:alpha=1.0"):
        with pytest.raises(ValueError, match=rf"split: '{spec}' deals samples by class label, and workload "
                                             rf"'{workload}' has no class labels .*allowed for it: iid"):
            train.make_config({"workload": workload, "split": spec, "out": str(tmp_path)})
    assert train.make_config({"workload": workload, "split": "iid", "out": str(tmp_path)}).split == "iid"
    with pytest.raises(ValueError, match="needs one integer class label per training sample"):
        splits.assign(splits.parse_split("labels:k=1"), torch.zeros(10, 5, dtype=torch.long), 2, 0)


@pytest.mark.parametrize("argv,says", [
    (["--split", "labels:k=11"], "split: labels:k=11 asks for more labels per worker than the 10 classes of the "
                                 "training set; allowed: k from 1 to 10"),
    (["--split", "dirichlet:alpha=0"], "split 'dirichlet:alpha=0': alpha must be a finite number > 0"),
    (["--split", "labels:k=2", "--batch-size", "40"], "batch_size 40 exceeds the 32 samples of each worker's "
                                                       "shard under split 'labels:k=2'"),
    (["--workload", "charlm-lstm", "--split", "labels:k=2"], "workload 'charlm-lstm' has no class labels"),
])
def test_bad_splits_fail_before_any_worker_starts(tmp_path, monkeypatch, capsys, argv, says):
    """train (exit 2, the launcher never called) and compare (exit 2, no run started)."""
    import torch.distributed.launcher.api as elastic

    from gradpress.train import launch

    forbid(monkeypatch, "workers were started", (elastic, "elastic_launch"))
    monkeypatch.setattr(launch, "_start_forkserver", lambda: None)
    common = ["--nproc", "2", "--samples", "64", "--out", str(tmp_path / "o"), *argv]
    assert cli(["train", *common]) == 2
    assert says in capsys.readouterr().err
    assert cli(["compare", "--algorithms", "ddp,localsgd", *common]) == 2
    assert says in capsys.readouterr().err


def test_compare_hands_the_split_to_every_run(tmp_path):
    from gradpress import compare

    configs = compare._plan_runs(None, "ddp,scaffold", {"split": "dirichlet:alpha=1e-1"}, tmp_path)
    assert [c.split for c in configs] == ["dirichlet:alpha=0.1"] * 2
