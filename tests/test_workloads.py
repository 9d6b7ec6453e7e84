"""Built-in workloads: shapes, determinism, sizes, metrics, data validation."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from gradpress import workloads
from gradpress.workloads import charlm, userdata, wide

TINY = {
    "mnist1d-cnn": {"samples": 64, "hidden": 8},
    "mnist1d-mlp": {"samples": 64, "hidden": 16},
    "digits-mlp": {"samples": 64, "hidden": 16},
    "charlm-lstm": {"samples": 16, "hidden": 16, "text_bytes": 20_000},
    "wide-mlp": {"samples": 64, "params": "20K"},
}


def test_names_and_unknown():
    assert set(TINY) | {"data-mlp"} == set(workloads.names())
    with pytest.raises(ValueError, match="unknown workload 'nope'.*allowed: .*mnist1d-cnn"):
        workloads.build("nope")


@pytest.mark.parametrize("name", sorted(TINY))
def test_build_forward_step_deterministic(name):
    torch.manual_seed(3)
    a = workloads.build(name, **TINY[name])
    torch.manual_seed(3)
    b = workloads.build(name, **TINY[name])
    for ta, tb in zip(a.train + a.test, b.train + b.test):
        assert torch.equal(ta, tb)
    for pa, pb in zip(a.model.parameters(), b.model.parameters()):
        assert torch.equal(pa, pb)
    assert a.metric == workloads.get(name).metric  # the registry states it without building (compare's target check)
    x, y = a.train
    assert len(x) == len(y) == TINY[name]["samples"]
    assert len(a.test[1]) >= 1
    opt = torch.optim.Adam(a.model.parameters(), lr=1e-2)
    losses = []
    for _ in range(5):  # a few full-batch steps on a tiny set must lower the loss
        opt.zero_grad()
        loss = a.loss(a.model(x[:16]), y[:16])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]
    with torch.no_grad():
        s, n = a.score(a.model(a.test[0]), a.test[1])
    assert n > 0 and math.isfinite(float(s))
    if a.classifier:
        assert 0 <= float(s) <= n and a.metric == "accuracy" and a.higher_is_better
    else:
        assert a.metric == "bits_per_char" and not a.higher_is_better


def test_mnist1d_generates_without_network(monkeypatch):
    import mnist1d.data
    import requests

    def no_network(*a, **k):
        raise AssertionError("mnist1d tried to download")

    monkeypatch.setattr(requests, "get", no_network)
    monkeypatch.setattr(mnist1d.data.requests, "get", no_network)
    import random

    before = (random.getstate(), np.random.get_state()[1].copy())
    from gradpress.workloads.mnist1d import _generate

    d = _generate()
    assert d["x"].shape == (4000, 40) and d["x_test"].shape == (1000, 40)
    assert set(np.unique(d["y"])) == set(range(10))
    # global generators left as they were
    assert random.getstate() == before[0] and np.array_equal(np.random.get_state()[1], before[1])


def test_mnist1d_cnn_is_the_paper_cnn():
    w = workloads.build("mnist1d-cnn")
    shapes = [tuple(p.shape) for p in w.model.parameters()]
    assert shapes == [(25, 1, 5), (25,), (25, 25, 3), (25,), (25, 25, 3), (25,), (10, 125), (10,)]
    assert w.model(torch.zeros(3, 40)).shape == (3, 10)


@pytest.mark.parametrize("text,n", [("10M", 10_000_000), ("500k", 500_000), ("2.5M", 2_500_000), (123456, 123456),
                                    ("4000", 4000)])
def test_parse_count(text, n):
    assert wide.parse_count(text) == n


@pytest.mark.parametrize("bad", ["ten", "10X", "", "-5M", 12, True, "1.2.3M"])
def test_parse_count_rejects(bad):
    with pytest.raises(ValueError, match="params"):
        wide.parse_count(bad)


@pytest.mark.parametrize("target", [20_000, 1_000_000, 10_000_000])
def test_wide_mlp_size(target):
    h = wide.width_for(target)
    count = wide.IN_DIM * h + h + h * h + h + h * wide.CLASSES + wide.CLASSES
    assert abs(count - target) / target < 0.01


def test_charlm_corpus_and_bits():
    a, b = charlm.corpus(30_000), charlm.corpus(30_000)
    assert a == b and len(a) == 30_000
    assert charlm.corpus(10_000) == a[:10_000]  # a prefix: sorted files, fixed budget
    x, y = charlm.windows(a, 8)
    assert torch.equal(x[:, 1:], y[:, :-1]) and x.dtype == torch.int64
    uniform = torch.zeros(2, 8, 256)
    s, n = charlm.bits_score(uniform, y[:2])
    assert n == 16 and float(s) / n == pytest.approx(8.0)


def _save(tmp_path, **arrays):
    path = tmp_path / "d.npz"
    np.savez(path, **arrays)
    return str(path)


def test_userdata_ok(tmp_path):
    rng = np.random.RandomState(0)
    x = rng.randn(100, 3, 2)
    y = np.where(x[:, 0, 0] > 0, 7, 3)
    w = workloads.build("data-mlp", data=_save(tmp_path, x=x, y=y), hidden=8)
    assert w.train[0].shape == (80, 6) and w.test[0].shape == (20, 6)
    assert set(w.train[1].tolist()) <= {0, 1}
    assert w.model(w.test[0]).shape == (20, 2)
    assert w.metric == workloads.get("data-mlp").metric


@pytest.mark.parametrize("arrays,match", [
    ({"x": np.zeros((20, 3))}, "lacks array.*y"),
    ({"features": np.zeros((20, 3)), "y": np.zeros(20)}, "lacks array.*x"),
    ({"x": np.zeros((20, 3)), "y": np.arange(19) % 2}, "x has 20 samples but y has 19"),
    ({"x": np.array([["a", "b"]] * 20), "y": np.arange(20) % 2}, "x must be numeric"),
    ({"x": np.zeros((20, 3)), "y": np.linspace(0, 1, 20)}, "y must hold integer class labels"),
    ({"x": np.zeros((20, 3)), "y": np.array(["a", "b"] * 10)}, "y must hold integer class labels"),
    ({"x": np.zeros(20), "y": np.arange(20) % 2}, "x must have shape"),
    ({"x": np.zeros((20, 3)), "y": np.zeros((20, 2))}, "y must be 1-D"),
    ({"x": np.full((20, 3), np.nan), "y": np.arange(20) % 2}, "NaN"),
    ({"x": np.zeros((20, 3)), "y": np.zeros(20, dtype=int)}, "at least 2 classes"),
])
def test_userdata_rejects(tmp_path, arrays, match):
    with pytest.raises(ValueError, match=match):
        userdata.read(_save(tmp_path, **arrays))


@pytest.mark.parametrize("arrays,match", [
    ({"x": np.zeros((20, 3))}, "lacks array.*y"),
    ({"x": np.zeros((20, 3)), "y": np.arange(19) % 2}, "x has 20 samples but y has 19"),
    ({"x": np.array([["a", "b"]] * 20), "y": np.arange(20) % 2}, "x must be numeric"),
    ({"x": np.zeros((20, 3), dtype=complex), "y": np.arange(20) % 2}, "x must be real-valued"),
    ({"x": np.zeros((20, 3)), "y": np.array(["a", "b"] * 10)}, "y must hold integer class labels"),
    ({"x": np.zeros(20), "y": np.arange(20) % 2}, "x must have shape"),
    ({"x": np.zeros((20, 3)), "y": np.zeros((20, 2))}, "y must be 1-D"),
    ({"x": np.zeros((8, 3)), "y": np.arange(8) % 2}, "at least 10 samples"),
    ({"x": np.zeros((20, 0)), "y": np.arange(20) % 2}, "no features"),
    ({"x": np.array([{"a": 1}] * 12, dtype=object), "y": np.arange(12) % 2}, "pickled objects"),
])
def test_userdata_header_check_gives_reads_message(tmp_path, arrays, match):
    """What the training config checks from the .npy headers alone
    (userdata.check_header) fails with the message the full read gives."""
    path = _save(tmp_path, **arrays)
    with pytest.raises(ValueError, match=match) as full:
        userdata.read(path)
    with pytest.raises(ValueError, match=match) as header:
        userdata.check_header(path)
    assert str(header.value) == str(full.value)


def test_userdata_header_check_counts_and_leaves_values_to_read(tmp_path):
    rng = np.random.RandomState(0)
    assert userdata.check_header(_save(tmp_path, x=rng.randn(30, 2, 3), y=np.arange(30) % 2)) == (30, 6)
    # values only a read can see: the headers pass, the read refuses
    path = _save(tmp_path, x=np.full((20, 3), np.nan), y=np.linspace(0, 1, 20))
    assert userdata.check_header(path) == (20, 3)
    with pytest.raises(ValueError, match="y must hold integer class labels"):
        userdata.read(path)


def test_userdata_bad_files(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        userdata.read(str(tmp_path / "missing.npz"))
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"not a zip file at all")
    with pytest.raises(ValueError, match="not a"):
        userdata.read(str(junk))
    obj = tmp_path / "obj.npz"
    np.savez(obj, x=np.array([{"a": 1}] * 12, dtype=object), y=np.arange(12) % 2)
    with pytest.raises(ValueError, match="obj.npz"):
        userdata.read(str(obj))


# --- charlm-transformer (issue 24: the workload where Adam matters) ---
TINY["charlm-transformer"] = {"samples": 16, "hidden": 16, "text_bytes": 20_000}


def test_charlm_transformer_builds_learns_and_is_causal():
    from gradpress.workloads import charlm_transformer

    torch.manual_seed(3)
    a = workloads.build("charlm-transformer", **TINY["charlm-transformer"])
    torch.manual_seed(3)
    b = workloads.build("charlm-transformer", **TINY["charlm-transformer"])
    for pa, pb in zip(a.model.parameters(), b.model.parameters()):
        assert torch.equal(pa, pb)
    assert a.metric == "bits_per_char" == workloads.get("charlm-transformer").metric
    assert not a.higher_is_better and not a.classifier
    x, y = a.train
    assert x.shape == (16, charlm.SEQ_LEN) and torch.equal(x[:, 1:], y[:, :-1])
    with torch.no_grad():  # causal: changing the last byte leaves every earlier prediction as it was
        x2 = x[:2].clone()
        x2[:, -1] = (x2[:, -1] + 1) % 256
        assert torch.allclose(a.model(x[:2])[:, :-1], a.model(x2)[:, :-1], atol=1e-6)
    opt = torch.optim.Adam(a.model.parameters(), lr=1e-2)
    losses = []
    for _ in range(5):
        opt.zero_grad()
        loss = a.loss(a.model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]
    default = sum(p.numel() for p in charlm_transformer.CharTransformer().parameters())
    assert 300_000 <= default <= 3_000_000
    d = workloads.defaults("charlm-transformer")
    n_train = len(charlm.windows(charlm.corpus()[: int(0.9 * charlm.DEFAULT_BYTES)], charlm.SEQ_LEN)[1])
    assert d["epochs"] * ((n_train // 4) // d["batch_size"]) >= 300  # at least 300 steps with 4 workers
    with pytest.raises(ValueError, match="hidden=30 must be a multiple of 4"):
        workloads.build("charlm-transformer", hidden=30, samples=4, text_bytes=20_000)


def test_budget_note_names_the_epochs_that_reach_the_tuned_schedule():
    """mnist1d-cnn's defaults were tuned at 1,240 steps (4 workers x batch 16
    x 20 epochs, docs/train.md): 8 workers get 31 steps per epoch and are told
    that --epochs 40 reaches it; the tuned setting itself gets no note."""
    mnist_train = 4000  # MNIST-1D's training split
    per_epoch = {w: mnist_train // (w * 16) for w in (2, 4, 8)}
    assert per_epoch == {2: 125, 4: 62, 8: 31}
    assert workloads.budget_note("mnist1d-cnn", 20, per_epoch[4]) is None
    assert workloads.budget_note("mnist1d-cnn", 20, per_epoch[2]) is None
    note = workloads.budget_note("mnist1d-cnn", 20, per_epoch[8])
    assert note is not None and "620 steps" in note and "1240" in note and "--epochs 40 gives 1240" in note
    assert "--epochs 83 gives 1245" in workloads.budget_note("mnist1d-cnn", 20, 15)  # batch 64: ceil(1240 / 15)
    assert workloads.budget_note("wide-mlp", 1, 3) is None  # no tuned length stated


@pytest.mark.parametrize("samples,epochs,printed", [(None, 20, True), (None, 40, False), (256, 20, False)])
def test_train_prints_the_budget_note(monkeypatch, capsys, tmp_path, samples, epochs, printed):
    """`gradpress train` prints the note after its summary line on rank 0, not
    for a shrunk data set (--samples: a quick check)."""
    import argparse

    from gradpress.train import cli

    summary = {"workload": "mnist1d-cnn", "epochs": epochs, "steps_per_epoch": 31, "out": str(tmp_path)}
    monkeypatch.setattr(cli, "run", lambda args: summary)
    monkeypatch.setattr(cli, "summary_line", lambda s: "summary")
    assert cli.run_cli(argparse.Namespace(samples=samples)) == 0
    assert ("--epochs 40 gives 1240" in capsys.readouterr().out) is printed
