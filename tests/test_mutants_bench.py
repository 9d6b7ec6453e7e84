"""The statistics every ranking table reports and the bench commands'
argument checks, pinned where the other bench tests do not reach: written
for survivors of ``make mutants`` (``bench`` group: compare_stats.py,
bench/{specs, e2e_args, e2e_configs, measure}.py). Every expected value is
computed here (float64, by the textbook formula: mean, sample standard
deviation with n - 1, median of the timed calls, bytes read + written over
the median time) or is the documented message, never the code's output.
One process, no cluster, no workers: about 3 s.
"""

from __future__ import annotations

import math
import types

import pytest
import torch

from gradpress import compare_stats
from gradpress.bench import measure

pytestmark = pytest.mark.mutants


def _mean(xs: list[float]) -> float:
    return math.fsum(xs) / len(xs)


def _sample_std(xs: list[float]) -> float:
    """Sample standard deviation, ddof = 1, by the definition."""
    m = _mean(xs)
    return math.sqrt(math.fsum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


# ------------------------------------------------------------------ stat / fmt / group
@pytest.mark.parametrize("values", [[0.93, 0.927, 0.935], [3.0, None, 1.0, 2.0, 10.0], [5.0, 5.0],
                                    [-1.5, 2.25, None, float("nan"), 0.0, 7.0]])
def test_stat_is_the_textbook_mean_sample_std_min_max_of_the_finite_values(values):
    got = [float(v) for v in values if v is not None and math.isfinite(v)]
    st = compare_stats.stat(values)
    assert (st["n"], st["k"]) == (len(values), len(got))
    assert st["values"] == [v if v is not None and math.isfinite(v) else None for v in values]
    assert st["mean"] == pytest.approx(_mean(got), rel=1e-12, abs=1e-15)
    assert st["std"] == pytest.approx(_sample_std(got), rel=1e-12, abs=1e-15)
    assert (st["min"], st["max"]) == (min(got), max(got))


def test_stat_of_one_value_has_zero_spread_and_of_none_has_no_statistics():
    st = compare_stats.stat([0.5])
    assert (st["n"], st["k"], st["mean"], st["std"], st["min"], st["max"]) == (1, 1, 0.5, 0.0, 0.5, 0.5)
    for values in ([None], [None, float("inf")], []):
        st = compare_stats.stat(values)
        assert (st["n"], st["k"]) == (len(values), 0)
        assert (st["mean"], st["std"], st["min"], st["max"]) == (None, None, None, None)


def test_fmt_writes_mean_std_range_and_the_missing_count():
    """``mean ± std [min, max]``, ``; MISSING (n - k of n)`` when seeds lack a value; one seed: the value
    alone; no value: ``MISSING (n of n)``, or ``MISSING`` alone for one seed."""
    values = [0.9312, None, 0.9270, 0.9350]
    got = [0.9312, 0.9270, 0.9350]
    cell = compare_stats.fmt(compare_stats.stat(values))
    assert cell == f"{_mean(got):.4f} ± {_sample_std(got):.4f} [0.9270, 0.9350]; not reached (1 of 4)"
    assert compare_stats.fmt(compare_stats.stat(got), lambda v: f"{v:.2f}") == (
        f"{_mean(got):.2f} ± {_sample_std(got):.2f} [0.93, 0.94]")
    assert compare_stats.fmt(compare_stats.stat([0.25])) == "0.2500"
    assert compare_stats.fmt(compare_stats.stat([None]), missing="-") == "-"
    assert compare_stats.fmt(compare_stats.stat([None, None]), missing="-") == "- (2 of 2)"


def test_group_keeps_first_seen_order_and_summarizes_each_field():
    rows = [{"m": "b", "seed": 0, "x": 1.0}, {"m": "a", "seed": 0, "x": 4.0}, {"m": "b", "seed": 1, "x": 3.0},
            {"m": "a", "seed": 1, "x": None}, {"m": "b", "seed": 2, "x": 8.0}]
    out = compare_stats.group(rows, lambda r: r["m"], {"x": lambda r: r["x"], "twice": lambda r: r["seed"] * 2.0})
    assert [g["key"] for g in out] == ["b", "a"]
    b, a = out
    assert b["seeds"] == [0, 1, 2] and a["seeds"] == [0, 1]
    assert b["rows"] == [rows[0], rows[2], rows[4]] and a["rows"] == [rows[1], rows[3]]
    assert b["x"]["mean"] == pytest.approx(_mean([1.0, 3.0, 8.0])) and b["x"]["std"] == pytest.approx(
        _sample_std([1.0, 3.0, 8.0]))
    assert (a["x"]["n"], a["x"]["k"], a["x"]["mean"], a["x"]["std"]) == (2, 1, 4.0, 0.0)
    assert b["twice"]["values"] == [0.0, 2.0, 4.0]


# ------------------------------------------------------------------ best_lr
def test_best_lr_takes_the_best_mean_over_seeds():
    scores = {0.01: [0.80, 0.96], 0.03: [0.90, 0.90], 0.1: [0.95, 0.70]}  # means 0.88, 0.90, 0.825
    best = max(scores, key=lambda lr: _mean(scores[lr]))
    assert compare_stats.best_lr(scores) == best == 0.03
    worst = min(scores, key=lambda lr: _mean(scores[lr]))
    assert compare_stats.best_lr(scores, higher_is_better=False) == worst == 0.1


def test_best_lr_ties_within_1e_9_go_to_the_smaller_rate_and_larger_gaps_do_not():
    assert compare_stats.best_lr({0.1: [0.5 + 5e-10], 0.01: [0.5]}) == 0.01  # within 1e-9: a tie
    assert compare_stats.best_lr({0.1: [0.5 + 5e-9], 0.01: [0.5]}) == 0.1  # past it: better
    assert compare_stats.best_lr({0.1: [0.5 - 5e-10], 0.01: [0.5]}, higher_is_better=False) == 0.01
    assert compare_stats.best_lr({0.1: [0.5 - 5e-9], 0.01: [0.5]}, higher_is_better=False) == 0.1


def test_best_lr_never_takes_a_rate_with_a_missing_seed_unless_all_miss():
    # 0.1's one finite seed is the best value seen, but a seed diverged: never chosen
    assert compare_stats.best_lr({0.01: [0.6, 0.6], 0.1: [0.99, None]}) == 0.01
    assert compare_stats.best_lr({0.01: [0.6, 0.6], 0.1: [0.99, float("nan")]}) == 0.01
    assert compare_stats.best_lr({0.01: [2.0, 2.0], 0.1: [0.1, None]}, higher_is_better=False) == 0.01
    assert compare_stats.best_lr({0.3: [None], 0.1: [None, None], 0.03: [float("inf")]}) == 0.03  # all: the smallest
    assert compare_stats.best_lr({0.3: [0.7]}) == 0.3


# ------------------------------------------------------------------ seeds and rates
def test_parse_seeds_accepts_a_count_a_list_or_a_sequence_and_refuses_a_bool():
    assert compare_stats.parse_seeds(3, 7) == [7, 8, 9]
    assert compare_stats.parse_seeds(" 2 ", 4) == [4, 5]
    assert compare_stats.parse_seeds([5, 1]) == [5, 1]
    assert compare_stats.parse_seeds((0,)) == [0]
    assert compare_stats.parse_seeds("1000", compare_stats.SEED_MAX - 999)[-1] == compare_stats.SEED_MAX
    for bad in (True, False):
        with pytest.raises(ValueError, match=r"^seeds: expected a count or a comma-separated list, got (True|False)"):
            compare_stats.parse_seeds(bad)
    with pytest.raises(ValueError, match=r"^seeds: the count must be from 1 to 1000, got 0"):
        compare_stats.parse_seeds(0)
    with pytest.raises(ValueError, match=r"^seeds: the count must be from 1 to 1000, got 1001"):
        compare_stats.parse_seeds(1001)
    with pytest.raises(ValueError, match=r"^seeds: must be from 0 to 4294967295, got \[-1\]"):
        compare_stats.parse_seeds([-1])
    with pytest.raises(ValueError, match=r"^seeds: \[3, 3\] lists a seed more than once"):
        compare_stats.parse_seeds([3, 3])
    with pytest.raises(ValueError, match=r"^seeds: 1001 seeds listed; allowed: at most 1000"):
        compare_stats.parse_seeds(list(range(1001)))
    with pytest.raises(ValueError, match=r"^seeds: expected a count \(3\) or a comma-separated list \(0,1,2\), got '1,x'"):
        compare_stats.parse_seeds("1,x")


def test_parse_lr_grid_rates_and_factors_at_six_significant_digits():
    assert compare_stats.parse_lr_grid("*2, x0.5, 0.1", 0.03) == [0.015, 0.06, 0.1]
    assert compare_stats.parse_lr_grid([0.1, 0.01, 0.1]) == [0.01, 0.1]
    assert compare_stats.parse_lr_grid("x3", 0.1) == [float(f"{3 * 0.1:.6g}")] == [0.3]  # not 0.30000000000000004
    assert compare_stats.parse_lr_grid("0.1234567") == [0.123457]
    assert compare_stats.parse_lr_grid(None, 0.1) is None
    with pytest.raises(ValueError, match=r"^lr-sweep: factor 'x2' needs a default lr"):
        compare_stats.parse_lr_grid("x2")
    with pytest.raises(ValueError, match=r"^lr-sweep: 'xx' is neither a rate \(0.01\) nor a factor"):
        compare_stats.parse_lr_grid("xx", 0.1)
    for bad in ("-0.1", "inf", "nan", "x0", "0"):
        with pytest.raises(ValueError, match=rf"^lr-sweep: rates must be positive and finite, got '{bad}'"):
            compare_stats.parse_lr_grid(bad, 0.1)
    with pytest.raises(ValueError, match=r"^lr-sweep: give at least one rate"):
        compare_stats.parse_lr_grid([])


# ------------------------------------------------------------------ measure: timing and roofline
class _Clock:
    """A stand-in for the ``time`` module: ``perf_counter`` reads from a script and logs each read."""

    def __init__(self, readings: list[float], log: list[str]) -> None:
        self.readings, self.log = iter(readings), log

    def perf_counter(self) -> float:
        self.log.append("clock")
        return next(self.readings)


@pytest.mark.parametrize("durations", [[0.5, 0.1, 0.3, 0.9, 0.2], [0.4, 0.1, 0.2, 0.3]])
def test_time_call_reports_the_median_of_the_timed_calls_after_untimed_warmups(monkeypatch, durations):
    """Invariant (measure module doc): the median of ``repeats`` timed calls after ``warmup`` untimed ones;
    on CUDA the device is synchronized before the clock starts and after each call, before it stops
    (``torch.cuda.synchronize`` replaced by a recorder: no GPU needed)."""
    log: list[str] = []
    readings = []
    t = 100.0
    for d in durations:
        readings += [t, t + d]
        t += d + 1.0
    monkeypatch.setattr(measure, "time", _Clock(readings, log))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: log.append("sync"))
    calls = []

    def fn():
        calls.append(len(calls))
        log.append("call")
        return len(calls)

    seconds, last = measure.time_call(fn, torch.device("cuda"), repeats=len(durations), warmup=2)
    assert seconds == pytest.approx(_median(durations), rel=1e-12)
    assert last == 2 + len(durations) and len(calls) == 2 + len(durations)
    assert log == ["call", "call"] + ["sync", "clock", "call", "sync", "clock"] * len(durations)


def test_time_call_does_not_synchronize_on_cpu_and_runs_each_warmup(monkeypatch):
    log: list[str] = []
    monkeypatch.setattr(measure, "time", _Clock([0.0, 2.0, 5.0, 6.0, 7.0, 10.0], log))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: log.append("sync"))
    seconds, last = measure.time_call(lambda: log.append("call") or "r", torch.device("cpu"), repeats=3, warmup=0)
    assert seconds == _median([2.0, 1.0, 3.0]) == 2.0 and last == "r"
    assert log == ["clock", "call", "clock"] * 3
    monkeypatch.setattr(measure, "time", _Clock([0.0, 1.0], log))
    n = []
    measure.time_call(lambda: n.append(1), torch.device("cpu"), repeats=1, warmup=3)
    assert len(n) == 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_copy_roofline_counts_bytes_read_and_written_over_the_median_time(monkeypatch, dtype):
    x = torch.arange(1000, dtype=dtype)
    seen = {}

    def fake_time_call(fn, device, repeats, warmup=1):
        out = fn()
        seen.update(device=device, repeats=repeats, warmup=warmup, copied=out.clone(), same=out is not x)
        return 0.25, out

    monkeypatch.setattr(measure, "time_call", fake_time_call)
    gbps, seconds = measure.copy_roofline(x, repeats=7, warmup=3)
    nbytes = 2 * 1000 * torch.tensor([], dtype=dtype).element_size()  # read x once, write the copy once
    assert seconds == 0.25 and gbps == pytest.approx(nbytes / 0.25 / 1e9, rel=1e-12)
    assert (seen["repeats"], seen["warmup"], seen["device"]) == (7, 3, x.device)
    assert torch.equal(seen["copied"], x) and seen["same"]


def test_peak_extra_bytes_on_cuda_is_the_peak_above_the_start_never_negative(monkeypatch):
    """CUDA: ``max_memory_allocated`` after ``reset_peak_memory_stats``, minus what was live at the start
    (stand-ins for the CUDA calls: no GPU needed)."""
    log: list[str] = []
    state = {"live": 5000, "peak": 5000}

    def reset(device=None):
        log.append("reset")
        state["peak"] = state["live"]

    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: log.append("sync"))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: state["live"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: state["peak"])

    def fn():
        log.append("call")
        state["peak"] = max(state["peak"], state["live"] + 3000)
        return "r"

    assert measure.peak_extra_bytes(fn, torch.device("cuda")) == 3000
    assert log == ["sync", "reset", "call", "sync"]
    state.update(live=5000, peak=1000)  # a peak below the start (a stand-in's odd reading) is 0, not negative
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    assert measure.peak_extra_bytes(lambda: None, torch.device("cuda")) == 0


def test_quiet_stderr_silences_the_stderr_descriptor_and_restores_it(capfd):
    import os
    import sys

    with measure._quiet_stderr():
        os.write(sys.stderr.fileno(), b"profiler noise\n")
    os.write(sys.stderr.fileno(), b"after\n")
    err = capfd.readouterr().err
    assert "profiler noise" not in err and "after" in err


def test_quiet_stderr_passes_through_a_stderr_without_a_descriptor(monkeypatch):
    import io
    import sys

    fake = io.StringIO()
    monkeypatch.setattr(sys, "stderr", fake)
    with measure._quiet_stderr():
        print("kept", file=sys.stderr)
    assert fake.getvalue() == "kept\n"
    monkeypatch.setattr(sys, "stderr", types.SimpleNamespace(fileno=lambda: (_ for _ in ()).throw(AttributeError)))
    with measure._quiet_stderr():
        pass


# ------------------------------------------------------------------ bench compressors: --sizes, specs
def test_parse_sizes_suffixes_are_decimal_powers_of_ten():
    from gradpress.bench.specs import parse_sizes

    assert parse_sizes("1G, 2g,3M,4m,5K,6k,7") == [10**9, 2 * 10**9, 3 * 10**6, 4 * 10**6, 5000, 6000, 7]
    assert parse_sizes("0.5K,2.5e7,1e0,,") == [500, 25_000_000, 1]
    for bad, why in (("0", "a whole number of elements >= 1"), ("0.5", "a whole number of elements >= 1"),
                     ("1e400", "a whole number of elements >= 1"), ("-1", "positive element counts like 4K"),
                     ("1T", "positive element counts like 4K"), ("K", "positive element counts like 4K")):
        with pytest.raises(ValueError, match=rf"^--sizes: bad size '{bad}'; allowed: {why}"):
            parse_sizes(f"4K,{bad}")
    with pytest.raises(ValueError, match=r"^--sizes got ' , '; allowed: comma-separated element counts"):
        parse_sizes(" , ")


def test_a_table_spec_that_no_longer_builds_falls_back_to_the_defaults_and_says_why(monkeypatch):
    from gradpress.bench import specs

    monkeypatch.setitem(specs.BENCH_SPECS, "topk", "topk:fraction=0.001")  # a renamed parameter
    c, note = specs.build("topk:fraction=0.001")
    assert c.name == "topk" and c.ratio == type(c)().ratio
    assert note.startswith("bench spec 'topk:fraction=0.001' rejected (") and note.endswith("); using defaults")
    assert "fraction" in note
    assert specs.build("topk:ratio=0.25")[1] == "" and specs.build("topk:ratio=0.25")[0].ratio == 0.25
    with pytest.raises(ValueError, match="ratio"):  # a spec of the user's own is refused, not replaced
        specs.build("topk:ratio=2")
    with pytest.raises(ValueError, match="fraction"):
        specs.build("topk:fraction=0.5")


def test_density_of_reads_the_selection_ratio_of_the_first_stage():
    from gradpress.bench.specs import density_of, is_selection
    from gradpress.compress import create

    assert density_of(create("topk:ratio=0.25")) == 0.25 and is_selection(create("randomk:ratio=1.0"))
    assert density_of(create("topk:ratio=0.125>qsgd")) == 0.125
    for spec in ("qsgd", "fp16", "threshold:tau=3", "threshold:tau=2>qsgd"):
        assert density_of(create(spec)) is None and not is_selection(create(spec)), spec


# ------------------------------------------------------------------ bench e2e: argument checks
def _e2e_args(*argv: str):
    from gradpress.cli import build_parser

    return build_parser().parse_args(["bench", "e2e", "--configs", "fp16", *argv])


@pytest.mark.parametrize("flag,value", [("--timeout", "0"), ("--timeout", "-0.5"), ("--time-limit", "0"),
                                        ("--time-limit", "-2")])
def test_e2e_timeouts_must_be_positive(tmp_path, flag, value):
    """``--timeout`` and ``--time-limit``: a finite number of seconds > 0; 0 and negatives are refused (only
    nan and inf were tested), naming the flag and the value."""
    from gradpress.bench.e2e_args import _resolve

    args = _e2e_args("--train-to", "0.5", flag, value, "--out", str(tmp_path / "out"))
    with pytest.raises(ValueError, match=rf"^{flag} got {float(value)!r}; allowed: a finite number of seconds > 0"):
        _resolve(args)
    ok = _e2e_args("--train-to", "0.5", flag, "0.25", "--out", str(tmp_path / "out"))
    assert _resolve(ok)["mode"] == "train"


def test_e2e_threads_on_one_usable_core(tmp_path, monkeypatch):
    """With one usable core (``train.config.usable_cpus``: the affinity mask, else ``os.cpu_count()``, at
    least 1; an unknown count is 1, tests/test_usable_cpus.py), ``--threads 1`` is accepted, the default is
    one thread per worker, and ``--threads 2`` is refused naming the bound."""
    from gradpress.bench import args as bench_args
    from gradpress.bench import e2e_args

    monkeypatch.setattr(bench_args, "usable_cpus", lambda: 1)
    settings = e2e_args._resolve(_e2e_args("--threads", "1", "--out", str(tmp_path / "out")))
    assert (settings["cpus"], settings["threads"]) == (1, 1)
    settings = e2e_args._resolve(_e2e_args("--out", str(tmp_path / "out")))
    assert (settings["cpus"], settings["threads"]) == (1, 1)
    with pytest.raises(ValueError, match=r"^--threads got 2; allowed: an integer >= 1 and <= 1 "
                                         r"\(the cores this process may use\)"):
        e2e_args._resolve(_e2e_args("--threads", "2", "--out", str(tmp_path / "out")))


# ------------------------------------------------------------------ bench e2e: --configs
def test_an_algorithm_with_only_a_strategy_or_options_after_the_slash_takes_its_default_compressor():
    """``ALGORITHM/@STRATEGY`` and ``ALGORITHM/+OPTION``: nothing names a compressor, so the algorithm's
    default compressor carries the strategy and the options (docs/e2e.md)."""
    from gradpress.bench.e2e_configs import parse_configs
    from gradpress.train import algorithm

    algo = algorithm.check_spec("localsgd:period=8")
    default = algorithm.default_compressor(algo)
    a, b, c = parse_configs("localsgd:period=8/@allgather,localsgd:period=4/+lr=0.5,localsgd:period=2/@ring+noef")
    assert (a.algorithm, a.spec, a.strategy, a.error_feedback, a.lr) == (algo, default, "allgather", None, None)
    assert a.label == f"gradpress {algo}/{default}@allgather"
    assert (b.spec, b.strategy, b.lr) == (default, "collective", 0.5)
    assert (c.spec, c.strategy, c.error_feedback) == (default, "ring", False)


@pytest.mark.parametrize("opt", ["rate=0.1", "step=2", "x=1", "a=0.1", "eta=0.1", "lrx=0.1", "lr"])
def test_an_option_other_than_ef_noef_lr_is_refused_naming_it(opt):
    from gradpress.bench.e2e_configs import parse_baselines, parse_configs

    with pytest.raises(ValueError, match=rf"^--configs: configuration 'fp16\+{opt}': unknown or repeated option "
                                         rf"'\+{opt}'; allowed: \+ef, \+noef, \+lr=X, each once"):
        parse_configs(f"fp16+{opt}")
    with pytest.raises(ValueError, match=rf"^--baselines: configuration 'fp16\+{opt}': unknown or repeated option "
                                         rf"'\+{opt}'; allowed: \+lr=X, each once"):
        parse_baselines(f"fp16+{opt}")


def test_a_multi_round_protocol_under_ddp_runs_on_one_bucket_and_starts_at_its_start_iter():
    """PowerSGD (2 rounds) under DDP runs on one DDP bucket, as PyTorch's PowerSGD baseline does (the two
    compare on the same bucketing); under another algorithm, or a one-round compressor, DDP's buckets stay.
    ``start`` is the compressor's ``start_iter`` (the first compressed step)."""
    from gradpress.bench.e2e_configs import parse_configs

    ddp, explicit, local, fp16 = parse_configs("powersgd:rank=2,start_iter=3;ddp/powersgd:rank=1,start_iter=5;"
                                               "localsgd:period=2/powersgd:rank=2,start_iter=4;fp16")
    assert (ddp.single_bucket, ddp.start, ddp.algorithm) == (True, 3, "ddp")
    assert (explicit.single_bucket, explicit.start) == (True, 5)
    assert (local.single_bucket, local.start) == (False, 4)
    assert (fp16.single_bucket, fp16.start) == (False, 0)
    with pytest.raises(ValueError, match=r"strategy 'allgather' cannot carry 'powersgd' \(a 2-round allreduce protocol\); "
                                         r"allowed: collective, auto, allreduce"):
        parse_configs("powersgd:rank=2@allgather")


def test_a_namespace_without_workers_per_node_is_one_worker_per_node(tmp_path):
    """As the flag's default and the emulated cluster's (``workers_per_node=1``): a namespace built without
    the attribute (or with None) runs one worker per node, and the command line spells no flag for it."""
    from gradpress.bench.e2e_args import _resolve, command_line

    for value in ("absent", None):
        args = _e2e_args("--nodes", "3", "--out", str(tmp_path / "out"))
        if value == "absent":
            del args.workers_per_node
        else:
            args.workers_per_node = value
        settings = _resolve(args)
        assert (settings["workers_per_node"], settings["world"]) == (1, 3)
        assert "--workers-per-node" not in command_line(args)
