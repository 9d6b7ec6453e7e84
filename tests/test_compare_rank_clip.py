"""``gradpress compare --seeds``: intervals reported within the range of their quantity and the rank by
wall-clock time to target (``--rank-by time``), no worker (``train.run`` is a stand-in), about 15 s (two compares write their plots). Every
reference is computed here by the definition: the t interval by tests/references.py's float64 t quantile,
clipped here to [0, 1] for an accuracy, [0, inf) for bits per character (the unclipped interval kept in
compare-stats.json, the clipped end marked in the table and named in the page's note); the time to target is
the training clock of the history's first evaluation at or beyond the target; the rank by time is 1 + the
number of configurations whose whole time interval lies below one's own, the rule and function
``bench e2e --train-to --seeds`` uses."""

from __future__ import annotations

import json
import math

import pytest
from references import ci_ref
from refusals import forbid

from gradpress import compare, compare_report, compare_stats, train, workloads
from gradpress.bench import e2e_seeds
from gradpress.cli import main as cli


def _run(compressor: str, seed: int, finals: list[float], *, metric: str = "accuracy", seconds: list[float] | None = None,
         nbytes: list[float] | None = None) -> dict:
    """What train.run returns: evaluations at steps 10, 20, ... with the given metrics, clock and bytes."""
    n = len(finals)
    seconds = seconds or [0.5 * (i + 1) for i in range(n)]
    nbytes = nbytes or [1000.0 * (i + 1) for i in range(n)]
    hist = [{"step": 10 * (i + 1), "bytes_total": nbytes[i], "metric": finals[i], "loss": 1.0,
             "seconds": seconds[i]} for i in range(n)]
    return {"compressor": compressor, "algorithm": "ddp", "final_metric": finals[-1], "final_loss": 1.0,
            "higher_is_better": metric == "accuracy", "seed": seed, "median_step_s": 0.01,
            "bytes_per_step": 100.0, "history": hist, "compression_ratio": 1.0, "lr": 0.01, "strategy": "allreduce",
            "workload": "digits-mlp" if metric == "accuracy" else "charlm-lstm", "world_size": 1, "steps": 10 * n,
            "batch_size": 16, "optimizer": "adam", "schedule": "constant", "metric": metric,
            "nothing_compressed": False, "diverged_at_step": None, "allow_divergence": False}


def _cells(table: str) -> tuple[list[str], dict[str, list[str]]]:
    lines = [[c.strip() for c in line.strip().strip("|").split("|")] for line in table.splitlines()]
    return lines[0], {r[1].strip("`"): r for r in lines[2:]}


def _clipped_cell(ci: tuple[float, float], low: float, high: float) -> str:
    ends = [f"{min(max(v, low), high):.4f}" + ("" if low <= v <= high else " (clipped)") for v in ci]
    return f"[{ends[0]}, {ends[1]}]"


@pytest.mark.parametrize("metric,finals,low,high", [
    ("accuracy", {"none": [0.99, 0.97, 0.80], "topk": [0.60, 0.62, 0.61]}, 0.0, 1.0),  # none's upper end > 1
    ("bits_per_char", {"none": [0.05, 0.90, 0.10], "topk": [2.0, 2.1, 2.05]}, 0.0, math.inf),  # lower end < 0
])
def test_an_interval_is_reported_within_the_metrics_range_and_kept_unclipped(metric, finals, low, high):
    runs = [_run(c, s, [v], metric=metric) for c, vs in finals.items() for s, v in enumerate(vs)]
    out = compare.annotate(runs, None)
    groups = compare_report.aggregate(out)
    head, rows = _cells(compare_report.aggregate_table(groups, metric, "none", False))
    col = head.index(f"final {metric}: 95% CI of the mean (t, n-1 df)")
    for g in groups:
        ci = ci_ref(finals[g["label"]])
        assert rows[g["label"]][col] == _clipped_cell(ci, low, high)
        assert g["final_metric"]["ci95"] == pytest.approx(list(ci), rel=1e-9)  # compare-stats.json: unclipped
        assert g["final_metric"]["ci95_reported"] == pytest.approx([min(max(v, low), high) for v in ci], rel=1e-9)
        assert g["final_metric"]["clipped"] == [not low <= v <= high for v in ci]
    ci = ci_ref(finals["none"])
    assert (ci[1] > high) if metric == "accuracy" else (ci[0] < low)  # the case is the one meant
    end = "upper" if metric == "accuracy" else "lower"
    note = compare_report.clipped_note(groups, metric, "none")
    bad = ci[1] if metric == "accuracy" else ci[0]
    assert f"`none` final {metric}, {end} end (unclipped {bad:.6g})" in note
    assert "`topk`" not in note  # topk's interval lies inside the range: not clipped, not named
    # the plot's band is the table's interval as reported
    band = compare.curve([r for r in out if r["compressor"] == "none"])
    assert [band["lo"][0], band["hi"][0]] == pytest.approx([min(max(v, low), high) for v in ci], rel=1e-9)
    assert workloads.metric_range(metric) == (low, high)


def test_a_difference_of_accuracies_is_reported_within_plus_or_minus_one():
    ref = [0.10, 0.95, 0.20]
    other = [0.95, 0.05, 0.90]  # per-seed differences +0.85, -0.90, +0.70: the paired interval passes +-1
    runs = [_run("none", s, [v]) for s, v in enumerate(ref)] + [_run("topk", s, [v]) for s, v in enumerate(other)]
    groups = compare_report.aggregate(compare.annotate(runs, None))
    ci = ci_ref([b - a for a, b in zip(ref, other)])
    assert ci[0] < -1 and ci[1] > 1
    d = groups[1]["vs_reference"]
    assert d["ci95"] == pytest.approx(list(ci), rel=1e-9) and d["ci95_reported"] == [-1.0, 1.0]
    assert compare_stats.fmt_difference(d) == "[-1.0000 (clipped), +1.0000 (clipped)] paired by seed (3)"


def test_every_workloads_metric_has_a_range():
    for name in workloads.names():
        low, high = workloads.metric_range(workloads.get(name).metric)
        assert low == 0.0 and high in (1.0, math.inf)
    with pytest.raises(ValueError, match="metric 'loss': no known range; allowed: accuracy, bits_per_char"):
        workloads.metric_range("loss")


#: per configuration and seed: (seconds, bytes) at the evaluation that reaches the target. Bytes rank them
#: none < fp16 < bf16; time the other way round, with intervals apart
REACHED = {"none": [(9.0, 100.0), (9.5, 110.0), (10.0, 105.0)],
           "fp16": [(5.0, 300.0), (5.5, 310.0), (5.2, 305.0)],
           "bf16": [(1.0, 900.0), (1.2, 910.0), (1.1, 905.0)]}


def _reaching_runs() -> list[dict]:
    # three evaluations; the target 0.9 is reached at the second one, whose clock and bytes are REACHED's
    return [_run(c, s, [0.5, 0.95, 0.96], seconds=[t / 2, t, t + 3.0], nbytes=[b / 2, b, b + 500.0])
            for c, per_seed in REACHED.items() for s, (t, b) in enumerate(per_seed)]


def _rank_ref(figure: int) -> dict[str, int]:
    cis = {c: ci_ref([p[figure] for p in per_seed]) for c, per_seed in REACHED.items()}
    return {c: 1 + sum(1 for o, (lo2, hi2) in cis.items() if o != c and hi2 < cis[c][0]) for c in cis}


def test_time_to_target_is_the_clock_at_the_first_evaluation_reaching_it():
    out = compare.annotate(_reaching_runs(), 0.9)
    assert [r["time_to_target"] for r in out] == [t for per_seed in REACHED.values() for t, _ in per_seed]
    assert [r["bytes_to_target"] for r in out] == [b for per_seed in REACHED.values() for _, b in per_seed]


@pytest.mark.parametrize("rank_by,figure", [("bytes", 1), ("time", 0)])
def test_rank_by_bytes_or_by_wall_clock_time_to_target(rank_by, figure):
    want = _rank_ref(figure)
    assert want == ({"none": 1, "fp16": 2, "bf16": 3} if rank_by == "bytes" else {"none": 3, "fp16": 2, "bf16": 1})
    groups = compare_report.aggregate(compare.annotate(_reaching_runs(), 0.9), rank_by=rank_by)
    assert {g["label"]: g["rank"] for g in groups} == want
    table = compare_report.aggregate_table(groups, "accuracy", "none", False, rank_by)
    head, rows = _cells(table)
    col = head.index("rank (wall-clock time to target)" if rank_by == "time" else "rank (bytes to target)")
    assert {c: int(r[col]) for c, r in rows.items()} == want
    assert list(rows) == sorted(want, key=want.get)  # rows in rank order
    ci = ci_ref([t for t, _ in REACHED["fp16"]])
    assert rows["fp16"][head.index("time to target: 95% CI")] == f"[{ci[0]:.2f}, {ci[1]:.2f}]"


def test_compare_rank_by_time_writes_bench_e2es_rule_and_says_time_is_noisy(tmp_path, monkeypatch):
    runs = {(r["compressor"], r["seed"]): r for r in _reaching_runs()}
    monkeypatch.setattr(train, "run", lambda cfg: runs[(cfg.compressor, cfg.seed)])
    args = ["compare", "--compressors", "none,fp16,bf16", "--workload", "digits-mlp", "--steps", "30", "--seeds",
            "3", "--target", "0.9", "--no-progress"]
    assert cli([*args, "--rank-by", "time", "--out", str(tmp_path / "t")]) == 0
    stats = json.loads((tmp_path / "t" / "compare-stats.json").read_text())
    assert stats["rank_by"] == "time" and stats["rank_rule"] == e2e_seeds.RANK_RULE == compare_stats.TIME_RANK_RULE
    assert [(g["label"], g["rank"]) for g in stats["aggregate"]] == [("none", 3), ("fp16", 2), ("bf16", 1)]
    md = (tmp_path / "t" / "compare.md").read_text()
    assert "Rank, by wall-clock time to target: " + compare_stats.TIME_RANK_RULE in md
    assert "Wall-clock time on a shared machine is noisy" in md and "bytes to target are exact" in md
    assert cli([*args, "--out", str(tmp_path / "b")]) == 0  # the default: bytes
    stats = json.loads((tmp_path / "b" / "compare-stats.json").read_text())
    assert stats["rank_by"] == "bytes" and stats["rank_rule"] == compare_stats.RANK_RULE
    assert [(g["label"], g["rank"]) for g in stats["aggregate"]] == [("none", 1), ("fp16", 2), ("bf16", 3)]


def test_a_bad_rank_by_is_refused_before_anything_trains(tmp_path, monkeypatch, capsys):
    forbid(monkeypatch, "trained", (train, "run"))
    with pytest.raises(ValueError, match="rank-by must be one of bytes, time, got 'speed'"):
        compare.run("none", {"workload": "digits-mlp"}, out=str(tmp_path / "x"), rank_by="speed")
    with pytest.raises(SystemExit):
        cli(["compare", "--compressors", "none", "--rank-by", "speed", "--out", str(tmp_path / "y")])
    assert "argument --rank-by: invalid choice: 'speed'" in capsys.readouterr().err
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
