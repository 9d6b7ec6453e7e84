"""``gradpress compare --seeds``: the 95% confidence intervals of the mean
(Student t, n-1 degrees of freedom) of the final metric and of the
difference to the reference (paired by seed when both ran the same seeds,
else Welch), the rank by bytes to target (a rank shared where intervals
overlap) and the plot's band (the same interval). Every reference is
computed here by the definition in float64: the t quantile by Newton's
method on the t distribution's CDF, itself Simpson's rule on the density.
No worker starts (``train.run`` is replaced by a stand-in)."""

from __future__ import annotations

import json
import math

import pytest
from references import ci_ref, mean_sd, t_ref

from gradpress import compare, compare_report, compare_stats, train
from gradpress.cli import main as cli

FINALS = {("none", 0): 0.80, ("none", 1): 0.90, ("none", 2): 0.70,
          ("topk:ratio=0.1", 0): 0.75, ("topk:ratio=0.1", 1): 0.95, ("topk:ratio=0.1", 2): 0.60}


def _summary(compressor: str, seed: int, final: float, bytes_total: float = 1000.0) -> dict:
    """What train.run returns: one evaluation at step 10 (the final metric), ``bytes_total`` sent by then."""
    return {"compressor": compressor, "algorithm": "ddp", "final_metric": final, "final_loss": 1.0,
            "higher_is_better": True, "seed": seed, "median_step_s": 0.01, "bytes_per_step": bytes_total / 10,
            "history": [{"step": 10, "bytes_total": bytes_total, "metric": final, "loss": 1.0}],
            "compression_ratio": 1.0, "lr": 0.01, "strategy": "allreduce", "workload": "digits-mlp",
            "world_size": 1, "steps": 10, "batch_size": 16, "optimizer": "sgd", "schedule": "constant",
            "metric": "accuracy", "nothing_compressed": False, "diverged_at_step": None, "allow_divergence": False}


def _table(runs: list[dict], target: float | None = None) -> tuple[list[str], dict[str, list[str]]]:
    """The aggregate table's header and its rows by compressor."""
    out = compare.annotate(runs, target)
    text = compare_report.aggregate_table(compare_report.aggregate(out), "accuracy", out[0]["reference"], False)
    lines = [[c.strip() for c in line.strip().strip("|").split("|")] for line in text.splitlines()]
    return lines[0], {r[1].strip("`"): r for r in lines[2:]}


@pytest.mark.parametrize("p,df,printed", [(0.975, 1, 12.706), (0.975, 2, 4.303), (0.975, 3, 3.182),
                                          (0.975, 4, 2.776), (0.975, 10, 2.228), (0.975, 30, 2.042),
                                          (0.95, 3, 2.353), (0.975, 10**6, 1.960)])
def test_the_t_quantile_is_the_printed_tables_and_the_definitions(p, df, printed):
    got = compare_stats.t_quantile(p, df)
    assert got == pytest.approx(printed, abs=5e-4)  # the values printed in every statistics table
    if df <= 30:
        assert got == pytest.approx(t_ref(p, df), rel=1e-9)


@pytest.mark.parametrize("p,df", [(0.975, 0), (0.975, -1), (0.975, math.nan), (1.0, 3), (0.0, 3), (math.inf, 3)])
def test_a_t_quantile_outside_its_domain_is_refused_naming_the_value(p, df):
    with pytest.raises(ValueError, match=r"(probability|degrees of freedom) .* got"):
        compare_stats.t_quantile(p, df)


def test_stat_gives_the_95_percent_interval_of_the_mean_over_the_seeds_with_a_value():
    values = [0.8, 0.9, 0.7, None]  # the miss is not a value: 3 values, 2 degrees of freedom
    st = compare_stats.stat(values)
    assert st["ci95"] == pytest.approx(list(ci_ref([0.8, 0.9, 0.7])), rel=1e-9)
    assert compare_stats.stat([0.5])["ci95"] is None and compare_stats.stat([None, None])["ci95"] is None


def test_the_table_gives_the_interval_of_the_final_metric_and_of_the_paired_difference():
    runs = [_summary(c, s, FINALS[(c, s)]) for c in ("none", "topk:ratio=0.1") for s in (0, 1, 2)]
    head, rows = _table(runs)
    final_col = head.index("final accuracy: 95% CI of the mean (t, n-1 df)")
    diff_col = head.index("vs none: 95% CI of the mean difference")
    for c in ("none", "topk:ratio=0.1"):
        lo, hi = ci_ref([FINALS[(c, s)] for s in (0, 1, 2)])
        # an accuracy's interval is reported within [0, 1] (topk's upper end is 1.0484 unclipped)
        ends = [f"{min(max(v, 0.0), 1.0):.4f}" + (" (clipped)" if not 0 <= v <= 1 else "") for v in (lo, hi)]
        assert rows[c][final_col] == f"[{ends[0]}, {ends[1]}]"
    lo, hi = ci_ref([FINALS[("topk:ratio=0.1", s)] - FINALS[("none", s)] for s in (0, 1, 2)])
    assert rows["topk:ratio=0.1"][diff_col] == f"[{lo:+.4f}, {hi:+.4f}] paired by seed (3)"
    assert rows["none"][diff_col] == "reference"
    group = compare_report.aggregate(compare.annotate(runs, None))[1]
    assert group["vs_reference"]["kind"] == "paired" and group["vs_reference"]["ci95"] == pytest.approx([lo, hi])


def test_the_difference_is_welch_when_the_reference_lacks_a_seed():
    # the reference's seed-2 run failed (not in the result): 3 values against 2, not paired
    runs = [_summary("none", s, FINALS[("none", s)]) for s in (0, 1)]
    runs += [_summary("topk:ratio=0.1", s, FINALS[("topk:ratio=0.1", s)]) for s in (0, 1, 2)]
    a = [FINALS[("topk:ratio=0.1", s)] for s in (0, 1, 2)]
    b = [FINALS[("none", s)] for s in (0, 1)]
    (ma, sa), (mb, sb) = mean_sd(a), mean_sd(b)
    va, vb = sa * sa / 3, sb * sb / 2
    df = (va + vb) ** 2 / (va * va / 2 + vb * vb / 1)  # Welch-Satterthwaite
    half = t_ref(0.975, df) * math.sqrt(va + vb)
    head, rows = _table(runs)
    cell = rows["topk:ratio=0.1"][head.index("vs none: 95% CI of the mean difference")]
    assert cell == f"[{ma - mb - half:+.4f}, {ma - mb + half:+.4f}] Welch (3 vs 2 seeds)"
    group = compare_report.aggregate(compare.annotate(runs, None))[1]
    assert group["vs_reference"]["kind"] == "welch"
    assert group["vs_reference"]["df"] == pytest.approx(df, rel=1e-12)
    assert group["vs_reference"]["ci95"] == pytest.approx([ma - mb - half, ma - mb + half], rel=1e-9)


#: bytes to target per seed; ``None``: that seed missed the target
BYTES_TO_TARGET = {"none": [100.0, 110.0, 120.0], "fp16": [130.0, 140.0, 150.0],
                   "topk:ratio=0.1": [160.0, 170.0, 180.0], "topk:ratio=0.01": [50.0, None, 50.0]}


def test_the_rank_is_by_bytes_to_target_and_shared_where_the_intervals_overlap():
    runs = [_summary(c, s, 0.9 if b is not None else 0.1, 1000.0 if b is None else b)
            for c, per_seed in BYTES_TO_TARGET.items() for s, b in enumerate(per_seed)]
    head, rows = _table(runs, target=0.5)
    # the rule, here: a configuration that reached the target at every seed is ranked; its rank is 1 + the
    # number of ranked configurations whose whole interval lies below its own; overlapping ones are named
    ci = {c: ci_ref(v) for c, v in BYTES_TO_TARGET.items() if None not in v}
    want = {c: 1 + sum(ci[o][1] < ci[c][0] for o in ci) for c in ci}
    assert want == {"none": 1, "fp16": 1, "topk:ratio=0.1": 2}  # fp16 overlaps both; none and topk 0.1 do not
    rank, seps = head.index("rank (bytes to target)"), head.index("not separable from")
    for c in ci:
        assert rows[c][rank] == str(want[c])
        others = [f"`{o}`" for o in ci if o != c and ci[o][0] <= ci[c][1] and ci[c][0] <= ci[o][1]]
        assert rows[c][seps] == (", ".join(others) or "-")
    assert rows["topk:ratio=0.01"][rank] == "- (not reached at 1 of 3 seeds)"
    lo, hi = ci["fp16"]
    assert rows["fp16"][head.index("bytes to target: 95% CI")] == f"[{lo:.0f} B, {hi:.0f} B]"  # as the bytes
    # rows in rank order, unranked last (in input order)
    out = compare.annotate(runs, 0.5)
    text = compare_report.aggregate_table(compare_report.aggregate(out), "accuracy", "none", False)
    order = [line.split("|")[2].strip().strip("`") for line in text.splitlines()[2:]]
    assert order == ["none", "fp16", "topk:ratio=0.1", "topk:ratio=0.01"]


def test_one_seed_reaching_the_target_gives_no_interval_and_no_rank():
    runs = [_summary(c, 0, 0.9, 100.0) for c in ("none", "fp16")]
    head, rows = _table(runs, target=0.5)
    assert rows["fp16"][head.index("rank (bytes to target)")] == "- (needs 2 seeds)"


def test_the_plot_band_is_the_same_interval_as_the_table():
    runs = [_summary("none", s, FINALS[("none", s)]) for s in (0, 1, 2)]
    for i, r in enumerate(runs):  # a second evaluation, step 20
        r["history"].append({"step": 20, "bytes_total": 2000.0 + i, "metric": r["final_metric"] + 0.01 * i,
                             "loss": 1.0})
    curve = compare.curve(runs)
    assert curve["steps"] == [10, 20]
    for j in range(2):
        vals = [r["history"][j]["metric"] for r in runs]
        assert curve["mean"][j] == pytest.approx(math.fsum(vals) / 3, rel=1e-12)
        # the table's interval as reported: an accuracy's ends within [0, 1] (the upper ones here are 1.048+)
        want = [min(max(v, 0.0), 1.0) for v in ci_ref(vals)]
        assert want[1] == 1.0 and ci_ref(vals)[1] > 1.0
        assert (curve["lo"][j], curve["hi"][j]) == pytest.approx(want, rel=1e-9)
    assert compare.curve(runs[:1])["lo"] is None  # one seed: no band


def test_compare_stats_json_and_the_page_carry_the_intervals_the_rank_and_the_plugins(tmp_path, monkeypatch):
    monkeypatch.setattr(train, "run", lambda cfg: _summary(cfg.compressor, cfg.seed, FINALS[(cfg.compressor, cfg.seed)]))
    monkeypatch.setattr("gradpress.compress.plugins.record", lambda: [{"module": "myplug", "file": "/x/myplug.py"}])
    out = tmp_path / "cmp"
    assert cli(["compare", "--compressors", "none,topk:ratio=0.1", "--workload", "digits-mlp", "--steps", "10",
                "--seeds", "3", "--no-progress", "--out", str(out)]) == 0
    stats = json.loads((out / "compare-stats.json").read_text())
    assert stats["plugins"] == [{"module": "myplug", "file": "/x/myplug.py"}]
    g = stats["aggregate"][1]
    assert g["final_metric"]["ci95"] == pytest.approx(list(ci_ref([0.75, 0.95, 0.60])), rel=1e-9)
    assert g["vs_reference"]["kind"] == "paired" and "rank" in g and "not_separable_from" in g
    md = (out / "compare.md").read_text()
    assert "Plugins: `myplug` (/x/myplug.py)." in md
    assert "95% confidence interval of the mean" in md and "paired by seed" in md and "rank" in md


def test_a_failed_runs_record_names_the_plugins_too(tmp_path, monkeypatch):
    from gradpress.train.launch import WorkerFailed

    def fake_run(cfg):
        if cfg.seed == 1:
            raise WorkerFailed("worker rank 1 exited with 1")
        return _summary(cfg.compressor, cfg.seed, 0.9)

    monkeypatch.setattr(train, "run", fake_run)
    monkeypatch.setattr("gradpress.compress.plugins.record", lambda: [{"module": "myplug", "file": "/x/myplug.py"}])
    out = tmp_path / "cmp"
    assert cli(["compare", "--compressors", "none", "--workload", "digits-mlp", "--steps", "10", "--seeds", "2",
                "--no-progress", "--out", str(out)]) == 1
    failed = [r for r in json.loads((out / "compare.json").read_text()) if r["status"] == "failed"]
    assert [f["plugins"] for f in failed] == [[{"module": "myplug", "file": "/x/myplug.py"}]]


def test_a_welch_difference_without_spread_is_a_point_and_stays_strict_json():
    d = compare_stats.difference({0: 0.9, 1: 0.9, 2: 0.9}, {0: 0.8, 1: 0.8})
    assert d["kind"] == "welch" and d["ci95"] == pytest.approx([0.1, 0.1], abs=1e-15)
    json.dumps(d, allow_nan=False)  # compare-stats.json: no Infinity for the degrees of freedom


def test_a_failed_run_leaves_its_configuration_unranked_and_the_note_says_it_failed():
    # topk's seed-1 run failed (not in the result): 2 finished runs of 3 seeds, both reached the target; it is
    # unranked (not every seed reached it), and the note says the seed failed, not that it missed the target
    runs = [_summary("none", s, 0.9, 100.0 + 10 * s) for s in (0, 1, 2)]
    runs += [_summary("topk:ratio=0.1", s, 0.9, 50.0 + 10 * s) for s in (0, 2)]
    groups = compare_report.aggregate(compare.annotate(runs, 0.5), seeds=3)
    topk = next(g for g in groups if g["compressor"] == "topk:ratio=0.1")
    assert topk["rank"] is None and topk["rank_note"] == "failed at 1 of 3 seeds"
    assert groups[0]["rank"] == 1
    # a failed seed and a missed one: both counted, each by name
    runs = [_summary("none", s, 0.9, 100.0 + 10 * s) for s in (0, 1, 2, 3)]
    runs += [_summary("topk:ratio=0.1", s, 0.9 if s else 0.1, 50.0) for s in (0, 1, 2)]
    groups = compare_report.aggregate(compare.annotate(runs, 0.5), seeds=4)
    assert groups[1]["rank"] is None and groups[1]["rank_note"] == "not reached at 1 of 4 seeds; failed at 1 of 4 seeds"


def test_the_plot_has_no_band_where_some_seed_is_not_finite():
    runs = [_summary("none", s, FINALS[("none", s)]) for s in (0, 1, 2)]
    for i, r in enumerate(runs):  # step 20: the third seed's metric is NaN
        r["history"].append({"step": 20, "bytes_total": 2000.0, "metric": math.nan if i == 2 else 0.5 + 0.1 * i,
                             "loss": 1.0})
    curve = compare.curve(runs)
    assert math.isnan(curve["mean"][1])  # the mean line has a gap there
    assert math.isnan(curve["lo"][1]) and math.isnan(curve["hi"][1])  # and so has the band
    lo, hi = ci_ref([FINALS[("none", s)] for s in (0, 1, 2)])
    assert (curve["lo"][0], curve["hi"][0]) == pytest.approx((lo, min(hi, 1.0)))  # an accuracy: within [0, 1]


def test_configurations_with_the_same_bytes_to_target_at_every_seed_share_their_rank():
    """Bytes per step are deterministic, so two configurations often reach the target after the same bytes at
    every seed: their intervals are the same point, neither lies *below* the other, so they share a rank and
    name each other (``plants7``: a rank counting intervals whose top touches its bottom, ``<=``, put both
    at rank 3)."""
    per_seed = {"none": [100.0] * 3, "fp16": [100.0] * 3, "topk:ratio=0.1": [50.0] * 3}
    runs = [_summary(c, s, 0.9, b) for c, v in per_seed.items() for s, b in enumerate(v)]
    head, rows = _table(runs, target=0.5)
    ci = {c: (v[0], v[0]) for c, v in per_seed.items()}  # mean +- t * 0: no spread, the interval is a point
    want = {c: 1 + sum(ci[o][1] < ci[c][0] for o in ci) for c in ci}  # the rule: whole interval strictly below
    assert want == {"none": 2, "fp16": 2, "topk:ratio=0.1": 1}
    rank, seps = head.index("rank (bytes to target)"), head.index("not separable from")
    for c in ci:
        assert rows[c][rank] == str(want[c]), c
    assert rows["none"][seps] == "`fp16`" and rows["fp16"][seps] == "`none`" and rows["topk:ratio=0.1"][seps] == "-"
