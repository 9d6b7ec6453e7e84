"""The training loop's pieces that the end-to-end training tests do not pin
down: written for survivors of ``make mutants`` (``train`` group:
train/loop.py, session.py, evaluate.py, algorithm.py, report.py). One
process, no workers; the few runs train a tiny model in-process on a
process group of one.
"""

from __future__ import annotations

import json
import math
import types

import pytest
import torch

from gradpress.train import algorithm, loop, report
from gradpress.train.evaluate import evaluate

pytestmark = pytest.mark.mutants


# ------------------------------------------------------------------ loop
def test_shard_batches_walk_each_ranks_slice_of_every_epochs_order_from_start():
    """Module doc: epoch e is the permutation ``epoch_order(n, seed, e)``; rank r
    trains on slice r (``n // world`` samples, the remainder dropped) in
    batches of ``batch_size``; ``start`` = (epoch, batch) and ``count`` bound the walk."""
    n, world, bs, seed = 50, 3, 4, 7
    x = torch.arange(n, dtype=torch.float64).unsqueeze(1) * 10
    y = torch.arange(n)
    per = n // world  # 16: 4 full batches per epoch
    for rank in range(world):
        want = []
        for e in range(3):
            order = loop.epoch_order(n, seed, e)
            shard = order[rank * per:(rank + 1) * per]
            want += [(e, b, shard[b * bs:(b + 1) * bs]) for b in range(per // bs)]
        got = list(loop.shard_batches(x, y, seed=seed, rank=rank, world=world, batch_size=bs, epochs=3))
        assert [(e, b) for e, b, _, _ in got] == [(e, b) for e, b, _ in want]
        for (_, _, xi, yi), (_, _, idx) in zip(got, want):
            assert torch.equal(yi, idx) and torch.equal(xi, x[idx])
        part = list(loop.shard_batches(x, y, seed=seed, rank=rank, world=world, batch_size=bs, epochs=3,
                                       start=(1, 2), count=3))
        assert [(e, b) for e, b, _, _ in part] == [(1, 2), (1, 3), (2, 0)]
        assert all(torch.equal(p[3], w[2]) for p, w in zip(part, want[6:9]))
        assert list(loop.shard_batches(x, y, seed=seed, rank=rank, world=world, batch_size=bs, epochs=3,
                                       count=0)) == []
    # the union of the ranks' shards of one epoch: disjoint, world * (n // world) samples
    seen = [set(loop.epoch_order(n, seed, 1)[r * per:(r + 1) * per].tolist()) for r in range(world)]
    assert len(set().union(*seen)) == world * per


def test_epoch_order_is_a_permutation_that_leaves_the_global_rng_alone():
    torch.manual_seed(11)
    want = torch.rand(3)
    torch.manual_seed(11)
    order = loop.epoch_order(97, 3, 2)
    assert torch.equal(torch.rand(3), want)
    assert sorted(order.tolist()) == list(range(97))
    assert torch.equal(order, loop.epoch_order(97, 3, 2))


@pytest.mark.parametrize("n,world,bs,steps", [(32, 2, 16, 1), (33, 2, 16, 1), (64, 1, 16, 4), (47, 3, 5, 3)])
def test_steps_per_epoch_is_the_full_batches_of_a_shard(n, world, bs, steps):
    assert loop.steps_per_epoch(n, world, bs) == steps == (n // world) // bs


def test_steps_per_epoch_names_the_batch_the_workers_and_the_samples():
    with pytest.raises(ValueError, match=r"batch_size 17 x 2 workers exceeds the 33 training samples of 'w'; "
                                         r"use a smaller --batch-size"):
        loop.steps_per_epoch(33, 2, 17, "w")


class _Recorder:
    """An algorithm that records the gradient it is handed and steps the optimizer."""

    def __init__(self, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        self.model, self.opt, self.grads = model, opt, []

    def step(self) -> None:
        self.grads.append([p.grad.clone() for p in self.model.parameters()])
        self.opt.step()


def test_train_step_hands_the_algorithm_this_batchs_gradient_only():
    """zero_grad before the backward: the gradient is the batch's own (float64,
    by hand: the gradient of mean((w x + b - y)^2)), not a sum over steps."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: the parameters stay put
    algo = _Recorder(model, opt)
    x, y = torch.randn(5, 3, dtype=torch.float64), torch.randn(5, 1, dtype=torch.float64)
    w, b = model.weight.detach().clone(), model.bias.detach().clone()
    for _ in range(2):
        loss = loop.train_step(algo, opt, torch.nn.functional.mse_loss, x, y)
    r = x @ w.T + b - y
    assert loss.item() == pytest.approx(float((r ** 2).mean()), rel=1e-12)
    assert torch.allclose(algo.grads[1][0], 2 * (r * x).mean(0, keepdim=True), rtol=1e-12, atol=0)
    assert torch.allclose(algo.grads[1][1], 2 * r.mean(0), rtol=1e-12, atol=0)


def _run(model, opt, batches, **kw):
    algo = _Recorder(model, opt)
    return algo, loop.run_steps(algo, opt, torch.nn.functional.mse_loss, batches, **kw)


def test_run_steps_sets_the_schedule_before_each_step_and_stops_when_told(monkeypatch):
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    batches = [(0, b, torch.randn(4, 2), torch.randn(4, 1)) for b in range(6)]
    lrs, ticks = [], []

    def after(t):
        ticks.append((t.step, t.epoch, t.batch))
        lrs.append(opt.param_groups[0]["lr"])
        return t.step == 7

    synced = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(device))
    cuda = torch.device("cuda", 1)
    algo, done = _run(model, opt, batches, lr=0.8, schedule="cosine", horizon=10, step=4, device=cuda, after=after)
    assert done == 7 and len(algo.grads) == 3 and ticks == [(5, 0, 0), (6, 0, 1), (7, 0, 2)]
    assert lrs == pytest.approx([0.8 * (1 + math.cos(math.pi * s / 10)) / 2 for s in (4, 5, 6)], rel=1e-12)
    assert synced == [cuda] * 3  # on CUDA the step is timed after a device synchronization
    synced.clear()
    opt.param_groups[0]["lr"] = 0.3
    _, done = _run(model, opt, batches[:2], lr=0.8, schedule="constant", horizon=10, device=torch.device("cpu"))
    assert done == 2 and opt.param_groups[0]["lr"] == 0.3 and synced == []


# ------------------------------------------------------------------ evaluate
class _Probe(torch.nn.Module):
    """Scores ``x[:, 0] > 0`` as class 1; records the mode and each chunk's size."""

    def __init__(self) -> None:
        super().__init__()
        self.modes, self.sizes = [], []

    def forward(self, x):
        self.modes.append(self.training)
        self.sizes.append(len(x))
        return torch.stack([-x[:, 0], x[:, 0]], dim=1)


def _wl(n=10):
    torch.manual_seed(1)
    x = torch.randn(n, 2)
    y = torch.randint(0, 2, (n,))
    from gradpress.workloads.base import classification_score

    return types.SimpleNamespace(test=(x, y), score=classification_score), x, y


@pytest.mark.parametrize("rank,world,chunk,sizes", [(0, 1, 3, [3, 3, 3, 1]), (1, 2, 2, [2, 2, 1]), (2, 3, 1024, [3])])
def test_evaluate_scores_the_strided_shard_in_chunks_in_eval_mode(rank, world, chunk, sizes):
    wl, x, y = _wl()
    model = _Probe()
    got = evaluate(wl, model, rank=rank, world=world, chunk=chunk)
    idx = list(range(rank, 10, world))
    want = sum(float((x[i, 0] > 0).long() == y[i]) for i in idx) / len(idx)
    assert got == pytest.approx(want, rel=1e-15)
    assert model.sizes == sizes and model.modes == [False] * len(sizes) and model.training


def test_evaluate_all_reduces_the_sum_and_count_not_the_ratio(monkeypatch):
    """Every rank gets sum_r correct_r / sum_r count_r: rank 0 of 2 here, with
    a stand-in all_reduce adding rank 1's (sum, count) computed by hand."""
    import torch.distributed as dist

    wl, x, y = _wl(11)
    odd = [i for i in range(1, 11, 2)]
    other = torch.tensor([sum(float((x[i, 0] > 0).long() == y[i]) for i in odd), len(odd)], dtype=torch.float64)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "all_reduce", lambda t, *a, **k: t.add_(other))
    got = evaluate(wl, _Probe(), rank=0, world=2)
    assert got == pytest.approx(sum(float((x[i, 0] > 0).long() == y[i]) for i in range(11)) / 11, rel=1e-15)


def test_evaluate_on_a_rank_past_the_test_set_scores_nothing_and_gets_the_others_value(monkeypatch):
    """More workers than test samples (``--samples 8 --nproc 4``: 2 test
    samples): ranks 2 and 3 hold no test sample. Each must contribute
    (0, 0) to the all-reduce, not fail (rank 3 raised in torch.arange)."""
    import torch.distributed as dist

    wl, x, y = _wl(2)
    assert evaluate(wl, _Probe(), rank=3, world=4) == 0.0  # no group: an empty shard scores 0
    both = torch.tensor([sum(float((x[i, 0] > 0).long() == y[i]) for i in range(2)), 2], dtype=torch.float64)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "all_reduce", lambda t, *a, **k: t.add_(both))
    for rank in (2, 3):
        model = _Probe()
        assert evaluate(wl, model, rank=rank, world=4) == float(both[0] / 2)
        assert model.sizes == [] and model.training


# ------------------------------------------------------------------ report
@pytest.mark.parametrize("n,text", [(0, "0B"), (999, "999B"), (999.4, "999B"), (1000, "1.0KB"), (1500, "1.5KB"),
                                    (-1500, "-1.5KB"), (2.5e6, "2.5MB"), (3e9, "3.0GB"), (5e12, "5000.0GB")])
def test_human_bytes(n, text):
    assert report.human_bytes(n) == text


def test_finite_or_null_replaces_every_non_finite_float_inside_dicts_and_lists():
    obj = {"a": math.nan, "b": [1.5, math.inf, (-math.inf, 2)], "c": {"d": 3, "e": "nan", "f": True}}
    assert report.finite_or_null(obj) == {"a": None, "b": [1.5, None, [None, 2]], "c": {"d": 3, "e": "nan", "f": True}}
    assert json.loads(report.dumps({"x": math.nan})) == {"x": None}


def test_metrics_log_keeps_the_lines_up_to_the_resumed_step_and_only_rank_0_writes(tmp_path):
    lines = [json.dumps({"step": s, "loss": 1.0}) for s in (1, 2, 3)]
    lines[1:1] = ["[1, 2]", json.dumps({"step": "2"}), json.dumps({"step": 2.0}), json.dumps({"loss": 1})]
    (tmp_path / report.METRICS).write_text("\n".join(lines) + "\n")
    report.MetricsLog(tmp_path, 1, resumed_at=2).write({"step": 9})  # rank 1: touches nothing
    assert (tmp_path / report.METRICS).read_text().count("\n") == 7
    log = report.MetricsLog(tmp_path, 0, resumed_at=2)
    log.write({"step": 3, "loss": math.inf})
    rows = [json.loads(r) for r in (tmp_path / report.METRICS).read_text().splitlines()]
    assert rows == [{"step": 1, "loss": 1.0}, {"step": 2, "loss": 1.0}, {"step": 3, "loss": None}]
    report.MetricsLog(tmp_path, 0, resumed_at=None)  # a fresh run starts an empty file
    assert (tmp_path / report.METRICS).read_text() == ""
    report.MetricsLog(tmp_path / "new", 0, resumed_at=5)  # resuming without a file: empty, directory made
    assert (tmp_path / "new" / report.METRICS).read_text() == ""


def _summary(tmp_path, stats, history, step_times, classifier=True, **cfg):
    c = types.SimpleNamespace(workload="w", device="cpu", epochs=2, batch_size=8, lr=0.1, optimizer="sgd",
                              schedule="constant", seed=0, **cfg)
    wl = types.SimpleNamespace(metric="accuracy" if classifier else "bits", higher_is_better=classifier,
                               classifier=classifier)
    return report.summarize(cfg=c, described={"algorithm": "ddp"}, stats=stats, world=2, steps=5,
                            steps_per_epoch=3, n_params=7, wl=wl, metric_value=0.75, history=history,
                            step_times=step_times, train_s=1.0, out=tmp_path)


def test_summary_divides_the_byte_counts_by_the_steps_the_algorithm_counted(tmp_path):
    stats = {"steps": 4, "bytes_sent": 1000, "dense_bytes": 4000, "host_bytes": 60, "compress_s": 0.5, "comm_s": 0.25,
             "compressed_tensors": 2, "nothing_compressed": 0, "dense_tensors": 1}
    s = _summary(tmp_path, stats, [{"step": 5, "loss": 0.5, "metric": 0.75}], [0.3, 0.1, 0.2, 0.4], allow_divergence=1)
    assert (s["bytes_per_step"], s["dense_bytes_per_step"], s["host_bytes_per_step"]) == (250.0, 1000.0, 15.0)
    assert s["compression_ratio"] == 4.0 and s["bytes_total"] == 1000 and s["median_step_s"] == 0.25
    assert s["final_loss"] == 0.5 and s["test_accuracy"] == 0.75 and s["steps"] == 5 and s["world_size"] == 2
    assert s["nothing_compressed"] is False and s["allow_divergence"] is True
    s = _summary(tmp_path, {**stats, "steps": 0, "bytes_sent": 0, "dense_bytes": 30, "nothing_compressed": 1}
                 | {"host_bytes": 0}, [], [], classifier=False)
    assert (s["bytes_per_step"], s["dense_bytes_per_step"], s["compression_ratio"]) == (0.0, 30.0, 1.0)
    assert s["final_loss"] is None and s["median_step_s"] is None and "test_accuracy" not in s
    assert s["nothing_compressed"] is True and s["allow_divergence"] is False


def test_write_summary_is_strict_json_and_leaves_no_temporary_file(tmp_path):
    report.write_summary(tmp_path, {"final_metric": math.nan, "steps": 3})
    assert json.loads((tmp_path / report.SUMMARY).read_text()) == {"final_metric": None, "steps": 3}
    assert sorted(p.name for p in tmp_path.iterdir()) == [report.SUMMARY]


# ------------------------------------------------------------------ algorithm
@pytest.mark.parametrize("bad", [None, 3, "", "   "])
def test_split_spec_refuses_what_is_not_a_spec_string(bad):
    with pytest.raises(ValueError, match=r"algorithm must be a spec string like 'ddp' or 'localsgd:period=8', got "
                                         + repr(bad).replace("(", r"\(")):
        algorithm.split_spec(bad)


def test_split_spec_strips_name_and_parameters():
    assert algorithm.split_spec("  localsgd : period=8 ") == ("localsgd", "period=8")
    assert algorithm.split_spec("ddp") == ("ddp", "")


def test_check_spec_names_what_is_wrong_and_spells_out_the_defaults():
    with pytest.raises(ValueError, match=r"algorithm 'ddp' takes no parameters, got 'x=1'; allowed: ddp"):
        algorithm.check_spec("ddp:x=1")
    with pytest.raises(ValueError, match=r"unknown algorithm 'nosuch'; allowed: ddp, "):
        algorithm.check_spec("nosuch")
    assert algorithm.check_spec(" ddp ") == "ddp"
    assert algorithm.check_spec(" localsgd:period=3 ").startswith("localsgd:period=3,")
    assert algorithm.names()[0] == "ddp" and algorithm.names().count("ddp") == 1
    assert [r["name"] for r in algorithm.describe()] == algorithm.names()
    assert algorithm.default_compressor("ddp") == "none"


def test_ddp_only_options_are_refused_for_other_algorithms():
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"plan_costs applies to algorithm 'ddp' only, not 'localsgd:period=8,"):
        algorithm.create("localsgd", model, opt, plan_costs="measure")
    with pytest.raises(ValueError, match=r"ddp_options apply to algorithm 'ddp' only, not 'localsgd:period=8,"):
        algorithm.create("localsgd", model, opt, ddp_options={"bucket_cap_mb": 1})


def test_preflight_asks_the_registry_for_every_algorithm_but_ddp(monkeypatch):
    asked = []
    monkeypatch.setattr(algorithm, "_registry", lambda: types.SimpleNamespace(preflight=lambda s, r: asked.append(s)))
    algorithm.preflight(" ddp ", object())
    algorithm.preflight(" localsgd:period=2 ", object())
    assert asked == ["localsgd:period=2"]
