"""A diverged run's NaN final metric over seeds: it counts as a run without a
metric (like ``None``), never poisons the mean, the spread or the target.
References are computed here with the ``statistics`` module."""

from __future__ import annotations

import math
import statistics

import pytest

from gradpress import compare, compare_report, compare_stats

NAN = float("nan")


@pytest.mark.parametrize("values", [[0.9, NAN, 0.8], [NAN, 0.9, 0.8], [0.8, 0.9, math.inf]])
def test_stat_counts_a_nonfinite_value_as_missing(values):
    finite = [0.9, 0.8]
    st = compare_stats.stat(values)
    assert (st["n"], st["k"]) == (3, 2)
    assert st["mean"] == pytest.approx(statistics.fmean(finite))
    assert st["std"] == pytest.approx(statistics.stdev(finite))
    assert (st["min"], st["max"]) == (0.8, 0.9)
    assert sum(v is None for v in st["values"]) == 1  # written `null` in compare-stats.json, as documented
    assert compare_stats.fmt(st, missing="-").endswith("; - (1 of 3)")


def _run(name, finals, seed):
    hist = [{"step": 10 * (i + 1), "bytes_total": 1000 * (i + 1), "metric": m, "loss": 1.0}
            for i, m in enumerate(finals)]
    return {"compressor": name, "algorithm": "ddp", "final_metric": finals[-1], "higher_is_better": True,
            "history": hist, "seed": seed, "median_step_s": 0.01, "bytes_per_step": 100.0,
            "compression_ratio": 1.0, "lr": 0.01}


def test_a_diverged_reference_seed_does_not_make_the_target_nan():
    runs = [_run("none", [0.5, 0.9], 0), _run("none", [0.5, NAN], 1), _run("none", [0.6, 0.8], 2),
            _run("topk", [0.5, 0.86], 0), _run("topk", [0.5, 0.87], 1), _run("topk", [0.5, 0.7], 2)]
    out = compare.annotate(runs, None)
    expected = 0.95 * statistics.fmean([0.9, 0.8])  # the reference's mean over the seeds that have a metric
    assert out[0]["target"] == pytest.approx(expected)
    assert [r["steps_to_target"] for r in out] == [20, None, None, 20, 20, None]
    fm = compare_report.aggregate(out)[0]["final_metric"]
    assert fm["k"] == 2 and fm["mean"] == pytest.approx(statistics.fmean([0.9, 0.8]))
