"""The estimator quality table of ``bench estimators``, pinned for survivors
of the ``benchreport`` group of ``make mutants`` (estimators.py).

Stand-in estimators keep scripted counts under a scripted clock, a stand-in
workload has a gradient known by hand; every expected figure is computed here
(achieved/target density = nonzeros / ceil(ratio d), the median times, the
float64 gradient) or is the law's own (the median of |X| of N(0, 1), Laplace,
Student-t(3)), never the code's output. One process: a few seconds.
"""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.mutants


# ----------------------------------------------------------------------------- bench estimators


class _Kept:
    """A stand-in threshold compressor: each call keeps the next scripted number of entries."""

    def __init__(self, name: str, kept: list[int], **attrs) -> None:
        self.name, self.kept, self.contexts, self.inputs = name, list(kept), [], []
        self.__dict__.update(attrs)

    def encode(self, x, ctx=None):
        import torch

        self.contexts.append(ctx)
        self.inputs.append(x.clone())
        out = torch.zeros(x.numel())
        out[: self.kept.pop(0)] = 1.0
        return out

    def decode(self, packet):
        return packet


def _estimate(monkeypatch, kept: dict, ratio: float, numel: int, steps: int, durations: list[float],
              topk_durations: list[float], seed: int | None = 4, **attrs):
    """run_estimators on stand-ins (one method per spec in ``kept``) with a clock that makes each timed call
    last the scripted time: per draw, top-k first, then each method in order."""
    import gradpress.compress as compress
    from gradpress.bench import estimators

    made: dict = {}

    def create(spec, ratio=None):
        if spec == "topk":
            return _Kept("topk", [1] * steps)
        made[spec] = _Kept(spec.split(":")[0], kept[spec], **attrs.get(spec, {}))
        return made[spec]

    ticks, now = [], 0.0
    for step in range(steps):
        for d in [topk_durations[step]] + [durations[step]] * len(kept):
            ticks += [now, now + d]
            now += d + 1.0
    monkeypatch.setattr(compress, "create", create)
    monkeypatch.setattr(estimators, "time", SimpleNamespace(perf_counter=lambda: ticks.pop(0)))
    given = {} if seed is None else {"seed": seed}
    result = estimators.run_estimators(list(kept), ["none"], ["normal"], [numel], [ratio], steps, **given)
    assert not ticks
    return result, made


def test_estimator_rows_are_kept_over_ceil_ratio_d_with_the_medians_of_the_clock(monkeypatch):
    spec = "redsync:correction=none"
    result, made = _estimate(monkeypatch, {spec: [2, 5, 8]}, 0.01, 400, 3, [0.002, 0.004, 0.003],
                             [0.010, 0.030, 0.020], **{spec: {"last_steps": 7}})
    (row,) = result["rows"]
    # k = ceil(0.01 x 400) = 4: 2/4, 5/4, 8/4; the mean 1.25 and the extremes 0.5 and 2.0 are inside the bounds
    assert row["per_call"] == [0.5, 1.25, 2.0] and (row["mean"], row["min"], row["max"]) == (1.25, 0.5, 2.0)
    assert row["within_bounds"] is True and row["steps"] == 3
    assert (row["method"], row["data"], row["numel"], row["ratio"]) == (spec, "normal", 400, 0.01)
    assert row["ms_per_call"] == pytest.approx(3.0, rel=1e-9) and row["topk_ms_per_call"] == pytest.approx(20.0, rel=1e-9)
    assert row["extra_counts"] == 7.0  # redsync's bisection steps
    assert [(c.key, c.step, c.seed) for c in made[spec].contexts] == [("w", 0, 4), ("w", 1, 4), ("w", 2, 4)]
    assert result["bounds"] == {"mean": [0.8, 1.25], "each_call": [0.5, 2.0]} and result["steps"] == 3
    assert result["seed"] == 4 and result["device"] == "cpu"


@pytest.mark.parametrize("numel, kept, ok", [
    (500, [4], True),  # k = 5: a mean of 0.8 exactly is inside
    (500, [7], False),  # a mean of 1.4
    (500, [3], False),  # 0.6
    (400, [1, 7, 4], False),  # k = 4: the mean is 1.0 but one call kept 0.25
    (400, [9, 2, 2, 3], False),  # the mean is 1.0 but one call kept 2.25
    (400, [3, 5, 4], True),
])
def test_estimator_bounds_mean_within_08_125_and_every_call_within_05_2(monkeypatch, numel, kept, ok):
    spec = "dgc_threshold:correction=none"
    steps = len(kept)
    result, _ = _estimate(monkeypatch, {spec: kept}, 0.01, numel, steps, [0.001] * steps, [0.001] * steps)
    (row,) = result["rows"]
    k = numel // 100
    assert row["per_call"] == [n / k for n in kept] and row["mean"] == pytest.approx(math.fsum(kept) / k / steps)
    assert row["within_bounds"] is ok and row["extra_counts"] is None  # dgc_threshold never counts


def test_counting_passes_per_call_by_method():
    from gradpress.bench.estimators import _extra_counts

    assert _extra_counts(SimpleNamespace(name="redsync", last_steps=6.0)) == 6
    assert _extra_counts(SimpleNamespace(name="sidco", corrected=True, last_passes=2)) == 2
    assert _extra_counts(SimpleNamespace(name="sidco", corrected=False, last_passes=2)) is None
    for adjustments, want in ((0, 1), (1, 2), (2, 3), (5, 3)):  # the paper's loop: once per step, at most 3
        assert _extra_counts(SimpleNamespace(name="gaussiank", last_adjustments=adjustments)) == want


def test_sizes_and_milliseconds_as_the_tables_write_them():
    from gradpress.bench.estimators import _ms, _size

    for n, want in ((999, "999"), (1000, "1K"), (1100, "1.1K"), (1050, "1,050"), (12_345, "12,345"),
                    (1_000_000, "1M"), (1_500_000, "1.5M"), (1_050_000, "1050K"), (10**9, "1G"), (2_500_000_000, "2.5G")):
        assert _size(n) == want, n
    for v, want in ((100.0, "100"), (123.4, "123"), (99.94, "99.9"), (10.0, "10.0"), (9.994, "9.99"), (0.1234, "0.12")):
        assert _ms(v) == want, v


def _erow(method: str, ratio: float, mean: float, ok: bool, extra=None) -> dict:
    return {"method": method, "data": "laplace", "numel": 1_000_000, "ratio": ratio, "steps": 3, "mean": mean,
            "min": mean - 0.1234, "max": mean + 0.2345, "within_bounds": ok, "per_call": [], "extra_counts": extra,
            "ms_per_call": 12.345, "topk_ms_per_call": 150.0}


def test_estimator_tables_cells_and_summary():
    from gradpress.bench.estimators import format_table, format_wide

    rows = [_erow("sidco", 0.1, 1.0, True, 1.25), _erow("sidco", 0.01, 1.5, False), _erow("redsync", 0.1, 0.9, True, 3)]
    result = {"rows": rows, "steps": 3, "command": "gradpress bench estimators --x"}
    long = format_table(result).splitlines()
    assert "| `sidco` | laplace | 1M | 0.1 | 1.000 | 0.877 | 1.234 | ok | 1.2 | 12.3 | 150 |" in long
    assert "| `sidco` | laplace | 1M | 0.01 | 1.500 | 1.377 | 1.734 | **MISS** | - | 12.3 | 150 |" in long
    summary = ["", "2 of 3 cases (method x data x size x ratio) within the bounds (mean achieved/target in "
                   "[0.8, 1.25], every call in [0.5, 2.0]) over 3 successive draws.",
               "MISS: `sidco` laplace d=1,000,000 ratio=0.01: mean 1.500, min 1.377, max 1.734",
               "command: `gradpress bench estimators --x`"]
    assert long[-4:] == summary
    wide = format_wide(result).splitlines()
    assert wide[0] == ("| method | data | d | 0.1: mean [min, max] | 0.01: mean [min, max] | 0.1: ms / top-k ms "
                       "| 0.01: ms / top-k ms |")
    assert wide[1] == "|---|---|---|---|---|---|---|"
    assert wide[2] == "| `sidco` | laplace | 1M | 1.000 [0.88, 1.23] | **1.500 [1.38, 1.73]** | 12.3 / 150 | 12.3 / 150 |"
    assert wide[3] == "| `redsync` | laplace | 1M | 0.900 [0.78, 1.13] | - | 12.3 / 150 | - |"
    assert wide[-4:] == summary
    del result["command"]
    assert not format_wide(result).splitlines()[-1].startswith("command:")


def test_estimator_arguments_are_refused_naming_the_flag_and_what_is_allowed():
    from gradpress.bench.estimators import CORRECTIONS, _choices, _ratios, with_correction

    assert _choices(" none , adaptive ,", CORRECTIONS, "--correction") == ["none", "adaptive"]
    for bad in ("", " , ", "none,bogus"):
        with pytest.raises(ValueError, match=r"--correction got .*; allowed: comma-separated from adaptive, none"):
            _choices(bad, CORRECTIONS, "--correction")
    assert _ratios("0.1, 0.001") == [0.1, 0.001]
    for bad in ("0", "1", "-0.1", "x", "nan", "0.1,"):
        with pytest.raises(ValueError, match=r"--ratios: bad density .*; allowed: numbers with 0 < ratio < 1"):
            _ratios(bad)
    assert with_correction("gaussiank", "adaptive") == "gaussiank:correction=adaptive"


def test_estimators_command_passes_its_arguments_and_writes_the_json(monkeypatch, tmp_path, capsys):
    from gradpress.bench import estimators
    from gradpress.cli import build_parser

    seen = {}

    def run(methods, corrections, data, sizes, ratios, steps, device, seed, log):
        seen.update(methods=methods, corrections=corrections, data=data, sizes=sizes, ratios=ratios, steps=steps,
                    device=device, seed=seed)
        return {"rows": [_erow("redsync:correction=none", 0.01, 1.0, True)], "steps": steps}

    monkeypatch.setattr(estimators, "run_estimators", run)
    path = tmp_path / "sub" / "e.json"
    args = build_parser().parse_args(["bench", "estimators", "--methods", "redsync;sidco:dist=exp", "--correction",
                                      "none", "--data", "laplace,normal", "--sizes", "2K", "--ratios", "0.01",
                                      "--steps", "2", "--seed", "9", "--format", "long", "--json", str(path)])
    assert args.func(args) == 0
    assert seen == {"methods": ["redsync", "sidco:dist=exp"], "corrections": ["none"], "data": ["laplace", "normal"],
                    "sizes": [2000], "ratios": [0.01], "steps": 2, "device": "cpu", "seed": 9}
    out = capsys.readouterr().out
    assert "| method | data | d | ratio |" in out and f"json: {path}" in out  # --format long
    written = json.loads(path.read_text())
    assert written["command"] == ("gradpress bench estimators --methods redsync;sidco:dist=exp --correction none "
                                  "--data laplace,normal --sizes 2K --ratios 0.01 --steps 2 --device cpu --seed 9 "
                                  "--format long")  # --threads not given: not shown
    assert written["threads"] >= 1 and written["rows"][0]["method"] == "redsync:correction=none"
    args = build_parser().parse_args(["bench", "estimators", "--sizes", "2K", "--steps", "1"])
    assert args.func(args) == 0 and seen["methods"] == list(estimators.DEFAULT_METHODS)
    assert seen["corrections"] == ["adaptive"] and seen["data"] == ["normal", "laplace", "student_t3"]
    assert seen["ratios"] == [0.1, 0.01, 0.001] and "json:" not in capsys.readouterr().out
    for argv, message in ((["--seed", "-1"], "--seed"), (["--json", str(tmp_path)], "is a directory; allowed: a file"),
                          (["--methods", "redsync:ratio=0.1"], "names a ratio; give densities with --ratios")):
        args = build_parser().parse_args(["bench", "estimators", *argv])
        with pytest.raises(ValueError, match=message):
            args.func(args)


def test_estimators_without_a_seed_draw_seed_0s_data(monkeypatch):
    import torch

    from gradpress.bench.estimators import synthetic_draws

    spec = "dgc_threshold:correction=none"
    result, made = _estimate(monkeypatch, {spec: [4, 4]}, 0.01, 400, 2, [0.001] * 2, [0.001] * 2, seed=None)
    assert result["seed"] == 0 and [c.seed for c in made[spec].contexts] == [0, 0]
    want = list(synthetic_draws("normal", 400, 2, 0))
    assert all(torch.equal(a, b) for a, b in zip(made[spec].inputs, want))


def _t3_quantile(p: float) -> float:
    """Student-t with 3 degrees of freedom: its closed-form CDF inverted by bisection (float64)."""
    def cdf(t: float) -> float:
        return 0.5 + (t / (math.sqrt(3) * (1 + t * t / 3)) + math.atan(t / math.sqrt(3))) / math.pi

    lo, hi = 0.0, 10.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) < p else (lo, mid)
    return lo


@pytest.mark.parametrize("kind", ["normal", "laplace", "student_t3"])
def test_synthetic_draws_follow_their_laws(kind):
    """The median of |X| of 2^18 draws against the law's own (float64): N(0, 1) 0.6745, Laplace(0, 1) ln 2,
    Student-t(3) 0.7649; the tolerance is about 6 standard errors (1.5e-2 apart would be 7)."""
    import statistics

    import torch

    from gradpress.bench.estimators import synthetic_draws

    want = {"normal": statistics.NormalDist().inv_cdf(0.75), "laplace": math.log(2.0),
            "student_t3": _t3_quantile(0.75)}[kind]
    n = 1 << 18
    draws = list(synthetic_draws("".join(kind), n, 2, seed=1))  # a kind as a string built at run time (as parsed)
    assert len(draws) == 2 and not torch.equal(draws[0], draws[1])
    for x in draws:
        assert x.dtype == torch.float32 and x.shape == (n,) and bool(torch.isfinite(x).all())
        assert float(x.double().abs().median()) == pytest.approx(want, abs=0.012), kind


def test_workload_gradients_are_each_steps_flat_gradient_by_hand(monkeypatch):
    """A stand-in workload (a 2 -> 1 linear model, MSE, plain SGD, batch 2, and a parameter the loss never
    uses): each step's gradient is the float64 formula's, the unused parameter is left out, and SGD moves
    the weights between the steps; batches are the seeded permutation's, in order."""
    import torch

    from gradpress import workloads
    from gradpress.bench import estimators

    xs = torch.tensor([[1.0, 2.0], [-1.0, 0.5], [3.0, -2.0], [0.25, 1.0], [2.0, 2.0]])
    ys = torch.tensor([1.0, -2.0, 0.5, 3.0, -1.0])

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(2, 1)
            self.unused = torch.nn.Parameter(torch.zeros(3))
            with torch.no_grad():
                self.lin.weight.copy_(torch.tensor([[0.5, -0.25]]))
                self.lin.bias.fill_(0.1)

        def forward(self, x):
            return self.lin(x).squeeze(-1)

    def build(name):
        return SimpleNamespace(model=Model(), train=(xs, ys), loss=lambda out, y: ((out - y) ** 2).mean())

    monkeypatch.setattr(workloads, "defaults", lambda name: {"optimizer": "sgd", "lr": 0.1, "batch_size": 2})
    monkeypatch.setattr(workloads, "build", build)
    monkeypatch.setattr(estimators, "_WORKLOAD_CACHE", {})
    grads = estimators.workload_gradients("stand-in", 2, seed=7)
    order = torch.randperm(5, generator=torch.Generator().manual_seed(7)).tolist()
    w, b = [0.5, -0.25], 0.1
    for step, g in enumerate(grads):
        batch = order[2 * step: 2 * step + 2]
        err = [w[0] * float(xs[i, 0]) + w[1] * float(xs[i, 1]) + b - float(ys[i]) for i in batch]
        gw = [math.fsum(2 / 2 * e * float(xs[i, j]) for e, i in zip(err, batch)) for j in (0, 1)]
        gb = math.fsum(2 / 2 * e for e in err)
        assert g.dtype == torch.float32 and g.tolist() == pytest.approx(gw + [gb], rel=1e-5, abs=1e-6), step
        w, b = [w[0] - 0.1 * gw[0], w[1] - 0.1 * gw[1]], b - 0.1 * gb
    assert len(grads) == 2 and estimators.workload_gradients("stand-in", 2, seed=7) is grads  # cached
