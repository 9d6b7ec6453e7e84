"""``gradpress compare``: spec splitting, target logic, the three output files,
algorithms x compressors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from gradpress import compare
from gradpress.cli import main as cli


@pytest.mark.parametrize("text,specs", [
    ("none,fp16,topk:ratio=0.01", ["none", "fp16", "topk:ratio=0.01"]),
    ("qsgd:levels=16,bucket=512,none", ["qsgd:levels=16,bucket=512", "none"]),
    ("topk:ratio=0.01>natural,fp16", ["topk:ratio=0.01>natural", "fp16"]),
    ("a:x=1,y=2>b:z=3,c", ["a:x=1,y=2>b:z=3", "c"]),
    ("none;topk:ratio=0.1", ["none", "topk:ratio=0.1"]),
    (["none", "fp16,bf16"], ["none", "fp16", "bf16"]),
])
def test_split_specs(text, specs):
    assert compare.split_specs(text) == specs


@pytest.mark.parametrize("bad,match", [("none,,fp16", "empty entry"), ("none,none", "more than once"), ([], "at least one")])
def test_split_specs_rejects(bad, match):
    with pytest.raises(ValueError, match=match):
        compare.split_specs(bad)
    with pytest.raises(ValueError, match="^algorithms: "):
        compare.split_specs(bad, "algorithms")


def _fake(name, finals, higher=True, algorithm=None):
    hist = [{"step": 10 * (i + 1), "bytes_total": 1000 * (i + 1), "metric": m, "loss": 1.0} for i, m in enumerate(finals)]
    run = {"compressor": name, "final_metric": finals[-1], "higher_is_better": higher, "history": hist}
    if algorithm is not None:
        run["algorithm"] = algorithm
    return run


def test_reference_prefers_ddp_none_and_labels_name_the_algorithm():
    runs = [_fake("none", [0.5], algorithm="localsgd:period=4"), _fake("topk", [0.7], algorithm="ddp"),
            _fake("none", [0.8], algorithm="ddp")]
    out = compare.annotate(runs, None)
    assert out[0]["reference"] == "none" and out[0]["target"] == pytest.approx(0.76)
    assert [compare.label(r) for r in out] == ["localsgd:period=4/none", "topk", "none"]
    only_local = compare.annotate(runs[:1] + [_fake("fp16", [0.9], algorithm="localsgd:period=4")], None)
    assert only_local[1]["reference"] == "localsgd:period=4/none"  # no ddp/none run: the first none run


def test_target_and_steps_to_target():
    runs = [_fake("topk", [0.5, 0.7, 0.9]), _fake("none", [0.6, 0.95, 1.0]), _fake("fp16", [0.1, 0.2, 0.3])]
    out = compare.annotate(runs, None)
    assert out[0]["target"] == pytest.approx(0.95)  # 95% of the none run, wherever it is listed
    assert [r["steps_to_target"] for r in out] == [None, 20, None]
    assert out[1]["bytes_to_target"] == 2000
    assert out[0]["delta_vs_reference"] == pytest.approx(-0.1) and out[0]["reference"] == "none"
    given = compare.annotate(runs, 0.65)
    assert [r["steps_to_target"] for r in given] == [20, 20, None]
    lower = compare.annotate([_fake("none", [3.0, 2.0], False), _fake("x", [4.0, 2.05], False)], None)
    assert lower[0]["target"] == pytest.approx(2.1)  # lower is better: 105%
    assert [r["steps_to_target"] for r in lower] == [20, 20]


def test_compare_writes_three_files(tmp_path, capsys):
    out = tmp_path / "cmp"
    rc = cli(["compare", "--compressors", "none,fp16,topk:ratio=0.1", "--workload", "digits-mlp", "--hidden", "32",
              "--samples", "256", "--batch-size", "32", "--epochs", "3", "--lr", "0.01", "--min-numel", "256",
              "--no-progress", "--out", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "| algorithm | compressor" in printed and "compare.png" in printed
    runs = json.loads((out / "compare.json").read_text())
    assert [r["compressor"] for r in runs] == ["none", "fp16", "topk:ratio=0.1"]
    assert all(r["algorithm"] == "ddp" for r in runs)  # --algorithms left out
    assert [r["strategy"] for r in runs] == ["allreduce", "allreduce", "allgather"]
    assert all(r["seed"] == 0 and r["workload"] == "digits-mlp" and len(r["history"]) == 3 for r in runs)
    assert runs[0]["delta_vs_reference"] == 0.0 and runs[0]["steps_to_target"] is not None
    md = (out / "compare.md").read_text()
    assert all(f"`{r['compressor']}`" in md for r in runs) and "Target accuracy" in md
    png = (out / "compare.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    for i, name in enumerate(["none", "fp16", "topk_ratio=0.1"]):
        assert (out / f"{i}-{name}" / "summary.json").exists()


def test_compare_bad_spec_trains_nothing(tmp_path, capsys):
    rc = cli(["compare", "--compressors", "none,bogus", "--out", str(tmp_path / "x"), "--no-progress"])
    assert rc == 2
    assert "unknown compressor 'bogus'" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
    assert cli(["compare", "--compressors", "none", "--target", "nan", "--out", str(tmp_path / "y")]) == 2
    assert cli(["compare", "--algorithms", "ddp:x=1", "--out", str(tmp_path / "z"), "--no-progress"]) == 2
    assert "algorithm 'ddp' takes no parameters" in capsys.readouterr().err
    assert cli(["compare", "--out", str(tmp_path / "w"), "--no-progress"]) == 2
    assert "give at least one compressor or algorithm spec" in capsys.readouterr().err
    assert not (tmp_path / "z").exists() and not (tmp_path / "w").exists()
    with pytest.raises(ValueError, match="algorithm: not a compare option"):
        compare.run("none", {"algorithm": "ddp"}, out=str(tmp_path / "v"))


def test_runs_are_the_cross_product_of_algorithms_and_compressors(tmp_path):
    runs = compare._plan_runs("none,topk:ratio=0.1", "ddp;localsgd", {"workload": "digits-mlp"}, tmp_path)
    assert [(c.algorithm, c.compressor, Path(c.out).name) for c in runs] == [
        ("ddp", "none", "0-none"), ("ddp", "topk:ratio=0.1", "1-topk_ratio=0.1"),
        ("localsgd:period=8,optimizer_state=auto", "none", "2-localsgd_period=8_optimizer_state=auto-none"),
        ("localsgd:period=8,optimizer_state=auto", "topk:ratio=0.1", "3-localsgd_period=8_optimizer_state=auto-topk_ratio=0.1")]
    assert {c.strategy for c in runs} == {"collective"}
    defaults = compare._plan_runs(None, "localsgd:period=2,ddp", {}, tmp_path)  # each algorithm's default
    assert [(c.algorithm, c.compressor) for c in defaults] == [("localsgd:period=2,optimizer_state=auto", "none"), ("ddp", "none")]
    with pytest.raises(ValueError, match="unknown algorithm 'nosuch'"):
        compare._plan_runs(None, "ddp,nosuch", {}, tmp_path)


def test_compare_algorithms_on_two_workers(tmp_path, capsys):
    out = tmp_path / "cmp"
    rc = cli(["compare", "--algorithms", "ddp,localsgd:period=4", "--compressors", "none;topk:ratio=0.1",
              "--nproc", "2", "--workload", "digits-mlp", "--hidden", "16", "--samples", "128", "--batch-size", "16",
              "--epochs", "2", "--min-numel", "64", "--no-progress", "--out", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "| algorithm" in printed and "| `localsgd:period=4` | `topk:ratio=0.1` |" in printed  # defaults left out
    runs = json.loads((out / "compare.json").read_text())
    assert [(r["algorithm"], r["compressor"]) for r in runs] == [
        ("ddp", "none"), ("ddp", "topk:ratio=0.1"), ("localsgd:period=4,optimizer_state=auto", "none"), ("localsgd:period=4,optimizer_state=auto", "topk:ratio=0.1")]
    assert all(r["world_size"] == 2 and r["steps"] == 8 and r["reference"] == "none" for r in runs)
    # ratios compare across algorithms: dense = what DDP sends; local SGD sends every 4th step: uncompressed,
    # the parameters and Adam's two moments (optimizer_state=auto averages them), compressed the top-k deltas
    assert runs[0]["compression_ratio"] == pytest.approx(1.0)
    assert runs[2]["compression_ratio"] == pytest.approx(4 / 3, rel=0.1) and runs[3]["compression_ratio"] > 3
    assert "algorithms: ddp, localsgd:period=4)" in (out / "compare.md").read_text()
    assert (out / "3-localsgd_period=4_optimizer_state=auto-topk_ratio=0.1" / "summary.json").exists()


def _seeded(name, finals, seed, step_s=0.01, higher=True):
    run = _fake(name, finals, higher, algorithm="ddp")
    run.update(seed=seed, median_step_s=step_s, bytes_per_step=100.0, compression_ratio=1.0, lr=0.01)
    for h in run["history"]:  # the training clock: slower early steps, so not steps x the median step time
        h["seconds"] = h["step"] * step_s + 0.1
    return run


def test_seed_aggregate_reports_missed_targets():
    from gradpress import compare_report, compare_stats

    runs = [_seeded("none", [0.6, 0.9, 0.95], 0), _seeded("none", [0.7, 0.8, 0.85], 1),
            _seeded("topk", [0.5, 0.95, 0.96], 0, 0.02), _seeded("topk", [0.2, 0.3, 0.4], 1, 0.02)]
    out = compare.annotate(runs, 0.9)
    assert [r["steps_to_target"] for r in out] == [20, None, 20, None]
    assert out[2]["time_to_target"] == pytest.approx(20 * 0.02 + 0.1)  # the clock at step 20, not 20 x 0.02
    assert out[2]["delta_vs_reference"] == pytest.approx(0.01)  # vs the reference run of the same seed
    groups = compare_report.aggregate(out)
    assert [g["label"] for g in groups] == ["none", "topk"] and groups[0]["seeds"] == [0, 1]
    fm = groups[0]["final_metric"]
    assert (fm["n"], fm["k"], fm["min"], fm["max"]) == (2, 2, 0.85, 0.95)
    assert fm["mean"] == pytest.approx(0.9) and fm["std"] == pytest.approx(0.0707107, rel=1e-5)
    st = groups[1]["steps_to_target"]
    assert (st["n"], st["k"], st["values"]) == (2, 1, [20, None])  # the miss is kept, not dropped
    cell = compare_stats.fmt(st, lambda v: f"{v:.0f}")
    assert cell == "20 ± 0 [20, 20]; not reached (1 of 2)"
    assert compare_stats.fmt(compare_stats.stat([None, None, None])) == "not reached (3 of 3)"
    tbl = compare_report.aggregate_table(groups, "accuracy", "none", False)
    assert "not reached (1 of 2)" in tbl and "0.9000 ± 0.0707 [0.8500, 0.9500]" in tbl
    # no target given: 95% of the reference's mean final metric over seeds
    assert compare.annotate(runs, None)[0]["target"] == pytest.approx(0.95 * 0.9)


@pytest.mark.parametrize("text,base,seeds", [("3", 0, [0, 1, 2]), ("2", 5, [5, 6]), ("0,4,7", 9, [0, 4, 7]),
                                            (None, 0, None), (2, 1, [1, 2])])
def test_parse_seeds(text, base, seeds):
    from gradpress import compare_stats

    assert compare_stats.parse_seeds(text, base) == seeds


def test_parse_seeds_and_rates_reject():
    from gradpress import compare_stats

    for bad in ("0", "a,b", "1,1", "-1,2"):
        with pytest.raises(ValueError, match="^seeds"):
            compare_stats.parse_seeds(bad)
    assert compare_stats.parse_lr_grid("x0.3,x1,x3", 0.01) == [0.003, 0.01, 0.03]
    assert compare_stats.parse_lr_grid("0.03,0.003,0.01") == [0.003, 0.01, 0.03]
    for bad in ("x2", "0,0.1", "fast", ""):
        with pytest.raises(ValueError, match="^lr-sweep"):
            compare_stats.parse_lr_grid(bad, None)


def test_parse_seeds_refuses_out_of_range_and_huge_counts():
    """A count was expanded without a bound (``--seeds 99999999999`` allocated a list of 1e11 ints) and seeds
    past 2**32 - 1, which ``gradpress train`` refuses, passed here and failed only at that seed's run."""
    from gradpress import compare_stats

    with pytest.raises(ValueError, match=r"^seeds: the count must be from 1 to 1000, got 5000"):
        compare_stats.parse_seeds("5000")
    with pytest.raises(ValueError, match=r"^seeds: 2 seeds from --seed 4294967295 go up to 4294967296"):
        compare_stats.parse_seeds("2", 2**32 - 1)
    with pytest.raises(ValueError, match=r"^seeds: must be from 0 to 4294967295, got \[0, 4294967296\]"):
        compare_stats.parse_seeds("0,4294967296")
    with pytest.raises(ValueError, match=r"^seeds: 1001 seeds listed; allowed: at most 1000"):
        compare_stats.parse_seeds(",".join(map(str, range(1001))))
    assert compare_stats.parse_seeds("1000") == list(range(1000))
    assert compare_stats.parse_seeds("1", 2**32 - 1) == [2**32 - 1]


def test_a_parameter_after_a_spec_without_parameters_is_named():
    """``fp16,ratio=0.1`` was glued into one spec and refused as ``unknown compressor 'fp16,ratio=0.1'``."""
    for bad, first in (("fp16,ratio=0.1", "fp16"), ("none,topk:ratio=0.1>natural,bucket=4", "topk:ratio=0.1>natural")):
        with pytest.raises(ValueError) as exc:
            compare.split_specs(bad)
        msg = str(exc.value)
        assert msg.startswith("compressors: ") and f"{first!r} has no parameter list" in msg, msg
    assert compare.split_specs("qsgd:levels=4,bucket=512,fp16") == ["qsgd:levels=4,bucket=512", "fp16"]
    assert compare.split_specs("topk:ratio=0.1>natural:x=1,y=2") == ["topk:ratio=0.1>natural:x=1,y=2"]
    # a value without its key (a researcher's slip): it was read as a spec, "unknown compressor '0.2'"
    for bad, first, value in (("none,topk:ratio=0.1,0.2", "topk:ratio=0.1", "0.2"), ("dgc:ratio=0.01,1e-3", "dgc:ratio=0.01", "1e-3")):
        with pytest.raises(ValueError) as exc:
            compare.split_specs(bad)
        assert str(exc.value) == (f"compressors: {value!r} in {bad!r} is neither a NAME[:key=value,...] spec nor a "
                                  f"key=value parameter of {first!r}; a parameter after a comma is key=value "
                                  f"({first},KEY={value}), and ';' separates specs")
    from gradpress.bench.specs import parse_compressors

    with pytest.raises(ValueError, match="--compressors: .*'fp16' has no parameter list"):
        parse_compressors("fp16,ratio=0.1")


def test_best_lr_rule():
    from gradpress import compare_stats

    assert compare_stats.best_lr({0.01: [0.8, 0.9], 0.03: [0.9, 0.95], 0.1: [0.5, 0.6]}) == 0.03
    assert compare_stats.best_lr({0.03: [0.9], 0.01: [0.9]}) == 0.01  # a tie goes to the smaller rate
    assert compare_stats.best_lr({0.01: [2.0], 0.03: [1.5]}, higher_is_better=False) == 0.03
    assert compare_stats.best_lr({0.01: [0.5], 0.1: [None]}) == 0.01  # a diverged rate is never chosen


def test_lr_sweep_picks_each_methods_best_rate(tmp_path, monkeypatch, capsys):
    from gradpress import train

    best = {"none": 0.01, "topk:ratio=0.1": 0.03}  # the known answer: each method peaks at its own rate
    calls = []

    def fake_run(cfg):
        calls.append((cfg.compressor, cfg.lr, cfg.steps, cfg.seed))
        peak = best[cfg.compressor]
        final = 0.9 - abs(math.log(cfg.lr / peak)) / 10 + 0.001 * cfg.seed
        run = _seeded(cfg.compressor, [final / 2, final], cfg.seed)
        run.update(lr=cfg.lr, algorithm=cfg.algorithm, strategy="allreduce", workload=cfg.workload, world_size=1,
                   steps=cfg.steps, batch_size=cfg.batch_size, optimizer=cfg.optimizer, schedule=cfg.schedule,
                   metric="accuracy", nothing_compressed=False)
        return run

    monkeypatch.setattr(train, "run", fake_run)
    out = tmp_path / "sweep"
    rc = cli(["compare", "--compressors", "none,topk:ratio=0.1", "--workload", "digits-mlp", "--steps", "40",
              "--lr-sweep", "0.003,0.01,0.03,0.1", "--seeds", "2", "--no-progress", "--out", str(out)])
    assert rc == 0
    sweep_calls = [c for c in calls if c[2] == 10]  # a quarter of --steps, first seed only
    assert len(sweep_calls) == 8 and {c[3] for c in sweep_calls} == {0}
    assert sorted((c[0], c[1], c[3]) for c in calls if c[2] == 40) == [
        ("none", 0.01, 0), ("none", 0.01, 1), ("topk:ratio=0.1", 0.03, 0), ("topk:ratio=0.1", 0.03, 1)]
    record = json.loads((out / "sweep.json").read_text())
    assert [(m["label"], m["best_lr"]) for m in record["methods"]] == [("none", 0.01), ("topk:ratio=0.1", 0.03)]
    assert "ties" in record["rule"] and record["steps"] == 10
    stats = json.loads((out / "compare-stats.json").read_text())
    assert stats["lr"]["per_method"] == {"none": 0.01, "topk:ratio=0.1": 0.03}
    printed = capsys.readouterr().out
    assert "chosen by a sweep" in printed and "`topk:ratio=0.1` 0.03" in printed
    assert "best final validation metric" in (out / "compare.md").read_text()


def test_compare_two_seeds_on_two_workers(tmp_path, capsys):
    out = tmp_path / "cmp"
    rc = cli(["compare", "--compressors", "none", "--seeds", "2", "--nproc", "2", "--workload", "digits-mlp",
              "--hidden", "16", "--samples", "128", "--batch-size", "16", "--epochs", "2", "--lr", "0.01",
              "--no-progress", "--out", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "All methods share one learning rate, 0.01" in printed and "| seeds |" in printed
    runs = json.loads((out / "compare.json").read_text())
    assert [(r["compressor"], r["seed"], r["world_size"]) for r in runs] == [("none", 0, 2), ("none", 1, 2)]
    assert runs[0]["history"] != runs[1]["history"]  # the seeds differ
    stats = json.loads((out / "compare-stats.json").read_text())
    assert stats["seeds"] == [0, 1] and [g["label"] for g in stats["aggregate"]] == ["none"]
    fm = stats["aggregate"][0]["final_metric"]
    assert fm["n"] == 2 and fm["values"] == [runs[0]["final_metric"], runs[1]["final_metric"]]
    assert fm["min"] == min(fm["values"]) and fm["mean"] == pytest.approx(sum(fm["values"]) / 2)
    md = (out / "compare.md").read_text()
    assert "±" in md and "Per seed:" in md and "seeds 0, 1" in md
    assert (out / "0-none-s1" / "summary.json").exists()
    assert (out / "compare.png").read_bytes()[:4] == b"\x89PNG"


def _si(n):
    """A byte figure by the tables' definition: powers of 1000, B without decimals, one decimal above."""
    units = ["B", "KB", "MB", "GB", "TB"]
    i = 0
    while abs(n) >= 1000 and i < len(units) - 1:
        n, i = n / 1000, i + 1
    return f"{n:.0f} B" if i == 0 else f"{n:.1f} {units[i]}"


def test_the_seed_aggregate_table_shows_the_bytes_to_target():
    """Over seeds the table had steps and time to target but not bytes to target (compare-stats.json held
    them, the single-seed table shows them), the figure a communication-efficient method is ranked by; the
    cell is mean ± sample std [min, max] over the seeds that reached it, computed here by the definition:
    the cumulative bytes at the first evaluation at or beyond the target."""
    from gradpress import compare_report

    curves = {0: [0.95, 0.96, 0.97], 1: [0.5, 0.92, 0.97], 2: [0.1, 0.2, 0.91]}
    runs = [_seeded("none", [0.9, 0.95, 0.95], s) for s in curves]
    for s, finals in curves.items():
        run = _seeded("topk", finals, s)
        for i, h in enumerate(run["history"]):
            h["bytes_total"] = 1234.0 * (i + 1) * (s + 1)
        runs.append(run)
    out = compare.annotate(runs, 0.9)
    want = [1234.0 * (next(i for i, m in enumerate(curves[s]) if m >= 0.9) + 1) * (s + 1) for s in curves]
    assert [r["bytes_to_target"] for r in out[3:]] == pytest.approx(want)
    mean = math.fsum(want) / 3
    std = math.sqrt(math.fsum((w - mean) ** 2 for w in want) / 2)
    tbl = compare_report.aggregate_table(compare_report.aggregate(out), "accuracy", "none", False)
    head = [c.strip() for c in tbl.splitlines()[0].strip("|").split("|")]
    row = [c.strip() for c in tbl.splitlines()[3].strip("|").split("|")]
    assert row[1] == "`topk`"
    assert row[head.index("bytes to target")] == f"{_si(mean)} ± {_si(std)} [{_si(min(want))}, {_si(max(want))}]"
    missed = compare.annotate([*runs[:3], *[dict(r, history=r["history"][:1]) for r in runs[3:]]], 0.9)
    row = [c.strip() for c in compare_report.aggregate_table(compare_report.aggregate(missed), "accuracy", "none",
                                                              False).splitlines()[3].strip("|").split("|")]
    assert row[head.index("bytes to target")] == f"{_si(1234.0)} ± {_si(0.0)} [{_si(1234.0)}, {_si(1234.0)}]; " \
                                                 "not reached (2 of 3)"
