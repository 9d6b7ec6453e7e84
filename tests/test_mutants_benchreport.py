"""The figures of the published benchmark tables, pinned for survivors of the
``benchreport`` group of ``make mutants`` (bench/e2e_rows.py, e2e_report.py,
e2e_seeds.py, compressors_rows.py, compressors_report.py, estimators.py).

The measurements are faked (rank results, per-seed rows, a stand-in clock or
compressor); every expected cell is computed here in float64 from those known
inputs, by the formula the tables document (ideal = compute + link bytes x 8 /
bandwidth, GB/s = 4 numel / seconds / 1e9, ratio = 4 numel / wire bytes,
achieved/target density = nonzeros / ceil(ratio d), mean ± sample std over
seeds), never taken from the code's output. One process, no cluster: a few
seconds.
"""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest

from gradpress.bench.e2e_configs import RunConfig

pytestmark = pytest.mark.mutants


def _sample_std(xs: list[float]) -> float:
    m = math.fsum(xs) / len(xs)
    return math.sqrt(math.fsum((x - m) ** 2 for x in xs) / (len(xs) - 1))


# ----------------------------------------------------------------------------- bench e2e: rows


def _rank(median: float, link_rx: float, link_tx: float, **extra) -> dict:
    r = {"warmup": 2, "steps": 3, "bucket_cap_mb": None, "buckets": 4, "median_step_s": median, "step_s": [median] * 3,
         "payload_bytes_per_step": 1000.0, "payload_source": "hook", "host_bytes_per_step": None,
         "compress_s_per_step": 0.01, "comm_s_per_step": 0.02, "register_s": 0.0,
         "link_rx_bytes_per_step": link_rx, "link_tx_bytes_per_step": link_tx}
    r.update(extra)
    return r


class _Runner:
    """Stands in for the cluster runner: names the failure by its tag."""

    def failure(self, res, tag: str) -> str:
        return f"failed {tag}"


OK = SimpleNamespace(ok=True, seconds=7.5)


def test_step_row_ideal_time_is_compute_plus_the_busiest_link_over_the_rate():
    from gradpress.bench.e2e_rows import _step_row

    cfg = RunConfig("gradpress", "g", "topk:ratio=0.1", strategy="allgather")
    plan = {"w": ["allgather", 1], "b": ["allgather", 1]}
    ranks = [_rank(0.5, 3000.0, 1000.0, plan=plan), _rank(0.7, 500.0, 4000.0), {"median_step_s": 9.0}]
    compute, rate, world = 0.25, 1_000_000, 3
    row = _step_row(cfg, OK, ranks, [{"b": 1}], compute, rate, world, _Runner(), "t")
    assert row["ok"] is True and row["error"] is None and row["seconds"] == 7.5 and row["tbf_bytes"] == [{"b": 1}]
    assert (row["label"], row["kind"], row["spec"], row["strategy"]) == ("g", "gradpress", "topk:ratio=0.1", "allgather")
    # rank 0's figures; the link: the busiest direction of the busiest rank that reported one
    for k in ("warmup", "steps", "buckets", "median_step_s", "step_s", "payload_bytes_per_step", "payload_source",
              "compress_s_per_step", "comm_s_per_step", "register_s"):
        assert row[k] == ranks[0][k], k
    assert row["link_bytes_per_step"] == 4000.0
    assert row["link_tx_bytes_per_step"] == [1000.0, 4000.0] and row["link_rx_bytes_per_step"] == [3000.0, 500.0]
    ideal = 0.25 + 4000.0 * 8 / 1e6
    assert row["compute_s"] == 0.25 and row["ideal_s"] == pytest.approx(ideal, rel=1e-12)
    assert row["measured_over_ideal"] == pytest.approx(0.5 / ideal, rel=1e-12)
    assert row["overlap_bound_s"] is None and row["over_bound"] is None  # no background exchange
    # the plan: one compressed strategy, no breakdown: its own factor (allgather: N - 1) on the payload
    assert row["plan_counts"] == {"allgather": 2} and row["strategy_used"] == "allgather"
    assert row["wire_factor"] == 2.0
    assert row["ideal_payload_s"] == pytest.approx(0.25 + 2.0 * 1000.0 * 8 / 1e6, rel=1e-12)


def test_step_row_of_a_baseline_and_of_plans_without_one_strategy():
    from gradpress.bench.e2e_rows import _step_row

    ddp = RunConfig("ddp", "torch ddp")
    row = _step_row(ddp, OK, [_rank(0.5, 10.0, 20.0), _rank(0.5, 10.0, 20.0)], [], 0.1, 8_000_000, 4, _Runner(), "t")
    assert row["strategy"] == "allreduce" and row["spec"] is None and "plan_counts" not in row
    assert row["wire_factor"] == 2 * 3 / 4  # a ring allreduce: 2 (N - 1) / N
    assert row["ideal_payload_s"] == pytest.approx(0.1 + 1.5 * 1000.0 * 8 / 8e6, rel=1e-12)
    cfg = RunConfig("gradpress", "g", "topk:ratio=0.1", strategy="auto")
    # two compressed strategies: none used alone, no single factor
    plan = {"a": ["ring", 1], "b": ["allgather", 1], "c": ["ring", 1], "d": ["uncompressed", 1]}
    row = _step_row(cfg, OK, [_rank(0.5, 1.0, 1.0, plan=plan)], [], 0.1, 8_000_000, 4, _Runner(), "t")
    assert row["plan_counts"] == {"allgather": 1, "ring": 2, "uncompressed": 1}
    assert list(row["plan_counts"]) == ["allgather", "ring", "uncompressed"]  # sorted by name
    assert row["strategy_used"] is None and row["wire_factor"] is None and row["ideal_payload_s"] is None
    # no plan at all: everything went through the plain fused allreduce
    row = _step_row(cfg, OK, [_rank(0.5, 1.0, 1.0)], [], 0.1, 8_000_000, 4, _Runner(), "t")
    assert row["plan_counts"] == {} and row["strategy_used"] == "allreduce" and row["wire_factor"] == 1.5
    # only uncompressed tensors: nothing compressed, the plain allreduce's factor
    row = _step_row(cfg, OK, [_rank(0.5, 1.0, 1.0, plan={"b": ["uncompressed", 1]})], [], 0.1, 8e6, 4, _Runner(), "t")
    assert row["strategy_used"] == "allreduce" and row["wire_factor"] == 1.5
    # no rank reported link counters: no link figure and no ideal
    bare = {k: v for k, v in _rank(0.5, 0, 0).items() if not k.startswith("link_")}
    row = _step_row(cfg, OK, [bare], [], 0.1, 8e6, 4, _Runner(), "t")
    assert row["link_bytes_per_step"] is None and row["ideal_s"] is None and row["measured_over_ideal"] is None
    assert row["link_tx_bytes_per_step"] == [] and row["link_rx_bytes_per_step"] == []


def test_step_row_breakdown_is_taken_within_one_millionth_of_the_payload():
    from gradpress.bench.e2e_rows import _step_row

    cfg = RunConfig("gradpress", "g", "topk:ratio=0.1", strategy="auto")
    plan = {"w": ["ring", 1], "b": ["uncompressed", 1]}

    def row(by: dict, payload: float = 1000.0) -> dict:
        r0 = _rank(0.5, 1.0, 1.0, plan=plan, payload_bytes_per_step=payload, strategy_bytes_per_step=by)
        return _step_row(cfg, OK, [r0], [], 0.25, 1_000_000, 4, _Runner(), "t")

    link = 600.0 * 1 + 400.0009 * 1.5  # each collective at its factor: ring 1, a plain allreduce 2 (N - 1) / N
    inside = row({"ring": 600.0, "uncompressed": 400.0009})  # off by 0.9e-6 of the payload: the breakdown holds
    assert inside["wire_factor"] == pytest.approx(link / 1000.0009, rel=1e-12)
    assert inside["ideal_payload_s"] == pytest.approx(0.25 + link * 8 / 1e6, rel=1e-12)
    outside = row({"ring": 600.0, "uncompressed": 400.0011})  # 1.1e-6 off: the breakdown misses bytes
    assert outside["wire_factor"] is None and outside["ideal_payload_s"] is None
    # below one byte the tolerance is 1e-6 of one byte, not of the payload
    assert row({"ring": 0.5 + 0.9e-6}, payload=0.5)["wire_factor"] == pytest.approx(1.0)
    assert row({"ring": 0.5 + 1.1e-6}, payload=0.5)["wire_factor"] is None
    # an empty step (0 bytes, all accounted for): the ideal is the compute alone, no factor from 0 / 0
    zero = row({"ring": 0.0}, payload=0.0)
    assert zero["wire_factor"] is None and zero["ideal_payload_s"] == 0.25


def test_step_and_train_rows_of_a_failed_run_carry_the_runners_message():
    from gradpress.bench.e2e_rows import _step_row, _train_row

    cfg = RunConfig("gradpress", "g", "topk:ratio=0.1", strategy="ring")
    for res, results in ((SimpleNamespace(ok=False, seconds=1.0), [_rank(0.5, 1.0, 1.0)]),
                         (OK, [_rank(0.5, 1.0, 1.0), None])):
        row = _step_row(cfg, res, results, [], 0.1, 8e6, 2, _Runner(), "tag1")
        assert row["ok"] is False and row["error"] == "failed tag1" and row["median_step_s"] is None
    for res, results in ((SimpleNamespace(ok=False, seconds=1.0), [{"reached": True}]), (OK, []), (OK, [None])):
        row = _train_row(cfg, res, results, _Runner(), "tag2")
        assert row["ok"] is False and row["error"] == "failed tag2" and row["reached"] is None
    r0 = {"reached": True, "time_to_target_s": 12.5, "steps_to_target": 40, "steps": 60, "train_s": 20.0,
          "best_metric": 0.93, "final_metric": 0.92, "payload_bytes_per_step": 800.0, "history": [1],
          "label": "other", "kind": "x", "ok": False, "seconds": 99.0, "error": "no", "unknown": 1}
    row = _train_row(cfg, OK, [r0, None], _Runner(), "t")  # rank 0 reports the run
    assert row["ok"] is True and row["error"] is None and (row["label"], row["kind"], row["seconds"]) == ("g", "gradpress", 7.5)
    for k in ("reached", "time_to_target_s", "steps_to_target", "steps", "train_s", "best_metric", "final_metric",
              "payload_bytes_per_step", "history"):
        assert row[k] == r0[k], k
    assert "unknown" not in row and row["strategy"] == "ring" and row["speedup"] is None


# ----------------------------------------------------------------------------- bench e2e: the report


def test_human_bytes_in_powers_of_1000_up_to_gigabytes():
    from gradpress.bench.e2e_report import human_bytes

    cases = {0: "0 B", 999: "999 B", 999.4: "999 B", 1000: "1.00 KB", -1000: "-1.00 KB", 1234: "1.23 KB",
             999_994: "999.99 KB", 1_000_000: "1.00 MB", 87_540_000: "87.54 MB", 999_999_000: "1000.00 MB",
             1e9: "1.00 GB", 5e12: "5000.00 GB"}
    for n, want in cases.items():
        assert human_bytes(n) == want, n
    for n in (None, math.nan, math.inf, -math.inf):
        assert human_bytes(n) == "n/a"


def test_lr_text_names_the_configurations_with_their_own_rate():
    from gradpress.bench.e2e_report import lr_text

    assert lr_text(0.01, ["a", "b"]) == "lr 0.01 for every configuration"
    assert lr_text(0.5, ["a", "b+lr=0.1", "c+lr=0.2"]) == \
        "lr 0.5 except where a configuration names its own (+lr=, 2 of 3)"


SETUP = {"nodes": 2, "bandwidth": "50mbit", "bandwidth_bits": 50_000_000, "workload": "digits-mlp",
         "parameters": 12_345, "batch_size": 16, "optimizer": "adam", "lr": 0.01, "threads": 1, "torch": "2.x",
         "cpus": 2, "metric": "accuracy", "eval_every": 5}


def test_step_table_cells_are_the_rows_figures():
    from gradpress.bench.e2e_report import markdown

    ok = {"label": "g", "ok": True, "strategy": "allgather", "median_step_s": 0.5, "speedup": 1.5,
          "payload_bytes_per_step": 1000.0, "host_bytes_per_step": None, "link_bytes_per_step": 4000.0,
          "ideal_s": 0.282, "measured_over_ideal": 0.5 / 0.282, "compress_s_per_step": 0.0123,
          "comm_s_per_step": 0.0456, "buckets": 4, "bucket_cap_mb": None, "overlap": None}
    auto = {**ok, "label": "a", "strategy": "auto", "plan_counts": {"allgather": 2, "ring": 1}, "speedup": None,
            "ideal_s": None, "measured_over_ideal": math.nan, "buckets": None, "bucket_cap_mb": 25}
    failed = {"label": "f", "ok": False, "error": "exit code 1"}
    result = {"mode": "step", "command": "gradpress bench e2e --x", "setup": {**SETUP, "workers_per_node": 1},
              "compute": {"shared_s": 0.25, "solo_s": 0.2, "shared_after_s": 0.3}, "rows": [ok, auto, failed],
              "notes": ["note one"]}
    lines = markdown(result).splitlines()
    assert lines[0] == "# gradpress bench e2e (step)" and "gradpress bench e2e --x" in lines
    assert any(x.startswith("2 nodes, 50mbit per link direction (50,000,000 bit/s), workload digits-mlp "
                            "(12,345 parameters), batch 16 per worker, adam lr 0.01 for every configuration, "
                            "1 thread(s) per worker, torch 2.x, 2 CPU(s).") for x in lines)
    assert ("Compute-only step (no communication, world size 1, all 2 workers at once): 0.250 s; alone on the "
            "machine: 0.200 s; all at once again after the last configuration: 0.300 s.") in lines
    assert f"| g | 0.500 s | 1.50x | 1.00 KB | 4.00 KB | 0.282 s | {0.5 / 0.282:.2f} | 0.012 | 0.046 | 4 |" in lines
    assert "| a (allgather=2, ring=1) | 0.500 s | n/a | 1.00 KB | 4.00 KB | n/a | n/a | 0.012 | 0.046 " \
           "| n/a (bucket_cap_mb=25) |" in lines
    assert "| f | failed: exit code 1 | | | | | | | | |" in lines
    # the same rows read back from e2e.json (strings equal to the literals, not the literals themselves)
    assert "| a (allgather=2, ring=1) | 0.500 s |" in markdown(json.loads(json.dumps(result)))
    assert lines[-3:] == ["Notes:", "", "- note one"]
    assert not any("Exchanges behind compute" in x for x in lines)
    # hosts of several workers, and no second shared measurement
    result.update(setup={**SETUP, "workers_per_node": 2, "intra_bandwidth": None}, notes=[],
                  compute={"shared_s": 0.25, "solo_s": None})
    text = markdown(result)
    assert "2 hosts x 2 workers (4 ranks; inside a host unshaped loopback), 50mbit per link" in text
    assert "all 4 workers at once): 0.250 s; alone on the machine: n/a.\n" in text and "Notes:" not in text
    result["setup"]["intra_bandwidth"] = "1gbit"
    assert "(4 ranks; inside a host 1gbit)" in markdown(result)


def test_train_table_cells_are_the_rows_figures():
    from gradpress.bench.e2e_report import markdown

    reached = {"label": "g", "ok": True, "reached": True, "time_to_target_s": 12.34, "steps_to_target": 45,
               "steps": 100, "train_s": 30.0, "best_metric": 0.95, "speedup": 2.0, "payload_bytes_per_step": 1000.0}
    missed = {**reached, "label": "h", "reached": False, "speedup": None, "best_metric": 0.812345}
    result = {"mode": "train", "command": "c", "setup": SETUP, "target": 0.9, "notes": [],
              "rows": [reached, missed, {"label": "f", "ok": False, "error": "boom"}]}
    lines = markdown(result).splitlines()
    assert ("Target: accuracy >= 0.9 (evaluated every 5 steps; the clock stops while evaluating).") in lines
    assert "| g | 12.3 s | 45 | 0.9500 | 2.00x | 1.00 KB |" in lines
    assert "| h | not reached (30.0 s) | 100 | 0.8123 | n/a | 1.00 KB |" in lines
    assert "| f | failed: boom | | | | |" in lines
    assert not any(x.startswith("Compute-only") for x in lines)


def test_background_table_bound_and_overlap_cells():
    from gradpress.bench.e2e_report import _background_table

    assert _background_table({"rows": [{"ok": True, "overlap": None}, {"ok": False, "overlap": 0.5}]}) == []
    row = {"label": "c", "ok": True, "overlap": 0.754, "median_step_s": 0.25, "overlap_bound_s": 0.2,
           "over_bound": 1.25, "exchange_s_per_step": 0.2, "exposed_s_per_step": 0.0492}
    lines = _background_table({"rows": [row]})
    assert "| c | 0.250 s | 0.200 s | 1.25 | 0.200 | 0.049 | 0.75 |" in lines


# ----------------------------------------------------------------------------- bench e2e --seeds


def _train_rows(seed_times: tuple, best: tuple, ok: tuple = (True, True)) -> list[dict]:
    rows = []
    for (label, kind), t, b, good in zip((("torch ddp", "ddp"), ("gradpress topk", "gradpress")), seed_times, best, ok):
        rows.append({"label": label, "kind": kind, "spec": "topk" if kind == "gradpress" else None, "ok": good,
                     "reached": t is not None, "time_to_target_s": t, "steps_to_target": None if t is None else 10 * t,
                     "best_metric": b, "final_metric": b - 0.01, "payload_bytes_per_step": 2000.0 if good else 1.0,
                     "speedup": None if t is None or seed_times[0] is None else seed_times[0] / t})
    return rows


def test_seeds_table_is_mean_std_min_max_over_the_seeds_by_hand():
    from gradpress.bench.e2e_seeds import combine, markdown

    per_seed = [((10.0, 4.0), (0.95, 0.93), (True, True)), ((12.0, 5.0), (0.93, 0.90), (True, True)),
                ((14.0, None), (0.91, 0.85), (True, True)), ((16.0, 2.0), (0.90, 0.99), (True, False))]
    seeds = [3, 5, 8, 13]
    results = [{"mode": "train", "target": 0.9, "setup": {**SETUP, "seed": s}, "rows": _train_rows(*p),
                "notes": [f"n{s}"], "seconds": 1.5 * (i + 1)} for i, (s, p) in enumerate(zip(seeds, per_seed))]
    res = combine(results, seeds, "gradpress bench e2e --seeds 3,5,8,13")
    assert res["seeds"] == seeds and res["setup"]["seed"] is None and res["setup"]["seeds"] == seeds
    assert res["seconds"] == 1.5 + 3.0 + 4.5 + 6.0 and res["notes"] == ["n3"] and res["target"] == 0.9
    assert [p["seed"] for p in res["per_seed"]] == seeds and res["per_seed"][1]["notes"] == ["n5"]
    ddp, topk = res["aggregate"]
    assert (ddp["label"], ddp["kind"], ddp["spec"], ddp["failed"]) == ("torch ddp", "ddp", None, 0)
    assert (topk["label"], topk["kind"], topk["spec"], topk["failed"]) == ("gradpress topk", "gradpress", "topk", 1)
    assert ddp["seeds"] == seeds
    t = ddp["time_to_target_s"]
    assert (t["n"], t["k"]) == (4, 4) and t["mean"] == pytest.approx(13.0) and t["min"] == 10.0 and t["max"] == 16.0
    assert t["std"] == pytest.approx(_sample_std([10.0, 12.0, 14.0, 16.0]), rel=1e-12)
    # the gradpress configuration: seed 8 missed the target, seed 13 failed (its figures do not count)
    t, s, b = topk["time_to_target_s"], topk["steps_to_target"], topk["best_metric"]
    assert t["values"] == [4.0, 5.0, None, None] and s["values"] == [40.0, 50.0, None, None]
    assert b["values"] == [0.93, 0.90, 0.85, None] and topk["final_metric"]["values"][3] is None
    assert topk["final_metric"]["values"][:3] == pytest.approx([0.92, 0.89, 0.84])
    assert topk["speedup"]["values"] == [2.5, 2.4, None, None] and topk["payload_bytes_per_step"]["k"] == 3
    md = markdown(res)
    assert "Seeds: 3, 5, 8, 13." in md and "# gradpress bench e2e (train, 4 seeds)" in md
    assert "Target: accuracy >= 0.9 (evaluated every 5 steps;" in md
    sd = _sample_std([10.0, 12.0, 14.0, 16.0])
    assert (f"| torch ddp | 13.00 ± {sd:.2f} [10.00, 16.00] | 130 ± {10 * sd:.0f} [100, 160] "
            f"| {(0.95 + 0.93 + 0.91 + 0.90) / 4:.4f} ± {_sample_std([0.95, 0.93, 0.91, 0.90]):.4f} [0.9000, 0.9500] "
            "| 1.00x ± 0.00x [1.00x, 1.00x] | 2.00 KB |") in md
    bm = _sample_std([0.93, 0.90, 0.85])
    assert (f"| gradpress topk (1 of 4 failed) | 4.50 ± {_sample_std([4.0, 5.0]):.2f} [4.00, 5.00]; not reached "
            f"(2 of 4) | 45 ± {_sample_std([40.0, 50.0]):.0f} [40, 50]; not reached (2 of 4) "
            f"| {(0.93 + 0.90 + 0.85) / 3:.4f} ± {bm:.4f} [0.8500, 0.9300]; - (1 of 4) "
            f"| 2.45x ± {_sample_std([2.5, 2.4]):.2f}x [2.40x, 2.50x]; - (2 of 4) | 2.00 KB |") in md
    assert md.endswith("Notes:\n\n- n3\n")
    # the total time is the sum of the seeds' times; a result without a clock adds nothing (never less)
    del results[1]["seconds"]
    assert combine(results, seeds, "c")["seconds"] == 1.5 + 4.5 + 6.0


# ----------------------------------------------------------------------------- bench compressors: rows


def _topk_by_hand(x, k: int):
    """Indices of the k largest |x| (float64 sort, ties to the lower index) and the relative error of keeping them."""
    xs = [float(v) for v in x.reshape(-1)]
    keep = sorted(range(len(xs)), key=lambda i: (-abs(xs[i]), i))[:k]
    dropped = math.fsum(xs[i] ** 2 for i in range(len(xs)) if i not in set(keep))
    return keep, math.sqrt(dropped / math.fsum(v * v for v in xs))


@pytest.fixture
def scripted(monkeypatch):
    """``time_call`` and ``peak_extra_bytes`` of compressors_rows replaced: each timed call gets the next
    scripted median (the function is still called once, its result returned); every peak is 777 bytes."""
    from gradpress.bench import compressors_rows

    calls: list = []
    medians: list[float] = []

    def time_call(fn, device, repeats, warmup=1):
        result = fn()
        calls.append(result)
        return medians.pop(0), result

    monkeypatch.setattr(compressors_rows, "time_call", time_call)
    monkeypatch.setattr(compressors_rows, "peak_extra_bytes", lambda fn, device: (fn(), 777)[1])
    return SimpleNamespace(calls=calls, medians=medians)


def test_reference_rows_keep_ceil_density_d_entries_at_8_bytes_each(scripted):
    import torch

    from gradpress.bench.compressors_rows import bench_reference

    x = torch.randn(1000, generator=torch.Generator().manual_seed(3))
    for kind, density, k in (("topk", 0.0123, 13), ("kthvalue", 0.0123, 13), ("topk", 1e-9, 1), ("topk", 1.5, 1000)):
        scripted.medians.append(0.002)
        row = bench_reference(kind, density, x, "normal", 16.0, repeats=3, warmup=1)
        keep, rel = _topk_by_hand(x, k)
        assert (row["compressor"], row["name"], row["kind"]) == (f"ref:{kind}@{density:g}", kind, "reference")
        assert row["numel"] == 1000 and row["data"] == "normal" and row["roofline_gbps"] == 16.0
        assert row["wire_bytes"] == 8 * k and row["ratio"] == pytest.approx(4000 / (8 * k), rel=1e-12)
        assert row["encode_s"] == 0.002 and row["encode_gbps"] == pytest.approx(4000 / 0.002 / 1e9, rel=1e-12)
        assert row["encode_roofline_fraction"] == pytest.approx(4000 / 0.002 / 1e9 / 16.0, rel=1e-12)
        assert row["decode_s"] is None and row["decode_gbps"] is None
        assert row["rel_error"] == pytest.approx(rel, rel=1e-9, abs=1e-12)
        assert row["density_target"] == density and row["density_achieved"] == k / 1000
        assert row["density_quality"] == pytest.approx(k / 1000 / density, rel=1e-12)
        assert row["peak_temp_bytes"] == 777 and row["peak_temp_ratio"] == 777 / 4000
        timed = scripted.calls.pop()
        if kind == "topk":
            assert sorted(timed.indices.tolist()) == sorted(keep)
        else:  # the (n - k + 1)-th smallest |x|: the k-th largest
            assert float(timed.values) == pytest.approx(abs(float(x[keep[-1]])), rel=1e-6)


def test_method_row_figures_from_the_first_call_and_the_timed_medians(scripted):
    import torch

    from gradpress.bench.compressors_rows import bench_method

    x = torch.randn(4000, generator=torch.Generator().manual_seed(5))
    scripted.medians.extend([0.004, 0.001, 0.0005])  # encode, decode, decode into a buffer
    row = bench_method("topk:ratio=0.01", x, "normal", 20.0, repeats=3, warmup=1)
    k = 40
    keep, rel = _topk_by_hand(x, k)
    assert (row["compressor"], row["name"], row["kind"], row["variant"]) == ("topk:ratio=0.01", "topk", "method",
                                                                             "default")
    assert row["shape"] == [4000] and row["numel"] == 4000 and row["threads"] == torch.get_num_threads()
    assert row["wire_bytes"] == 8 * k  # k fp32 values and k int32 indices
    assert row["ratio"] == pytest.approx(16000 / (8 * k), rel=1e-12)
    assert row["rel_error"] == pytest.approx(rel, rel=1e-9)
    assert row["density_target"] == 0.01 and row["density_achieved"] == k / 4000
    assert row["density_quality"] == pytest.approx(k / 4000 / 0.01, rel=1e-12)
    assert (row["encode_s"], row["decode_s"], row["decode_into_s"]) == (0.004, 0.001, 0.0005)
    assert row["encode_gbps"] == pytest.approx(16000 / 0.004 / 1e9, rel=1e-12)
    assert row["decode_gbps"] == pytest.approx(16000 / 0.001 / 1e9, rel=1e-12)
    assert row["decode_into_gbps"] == pytest.approx(16000 / 0.0005 / 1e9, rel=1e-12)
    assert row["encode_roofline_fraction"] == pytest.approx(16000 / 0.004 / 1e9 / 20.0, rel=1e-12)
    assert row["peak_temp_bytes"] == 777 and row["peak_temp_ratio"] == 777 / 16000
    assert row["reported_quality"] is None and row["speedup_vs_topk"] is None
    # a zero time is an infinite rate, never a division error; a method without a density has none
    scripted.medians.extend([0.0, 0.0, 0.0])
    row = bench_method("fp16", x, "normal", 20.0, repeats=1, warmup=0)
    assert row["encode_gbps"] == row["decode_gbps"] == row["decode_into_gbps"] == math.inf
    assert row["encode_roofline_fraction"] == math.inf and row["density_target"] is None
    assert row["wire_bytes"] == 2 * 4000 and row["ratio"] == 2.0


def test_finish_row_ratios_and_rates_by_the_formula():
    from gradpress.bench.compressors_rows import _finish_row, _rel_error

    row = {"roofline_gbps": 8.0}
    _finish_row(row, 4_000_000, 0.5e-3, None, 0)
    assert row["encode_gbps"] == pytest.approx(4e6 / 0.5e-3 / 1e9, rel=1e-12) and row["decode_gbps"] is None
    assert row["ratio"] == math.inf and row["wire_bytes"] == 0 and row["decode_s"] is None
    assert row["encode_roofline_fraction"] == pytest.approx(4e6 / 0.5e-3 / 1e9 / 8.0, rel=1e-12)
    _finish_row(row, 4_000_000, 1.0, 2.0, 3)
    assert row["decode_gbps"] == pytest.approx(4e6 / 2.0 / 1e9, rel=1e-12) and row["ratio"] == pytest.approx(4e6 / 3)
    assert isinstance(row["wire_bytes"], int)
    import torch

    x = torch.tensor([3.0, 4.0])
    assert _rel_error(torch.tensor([3.0, 0.0]), x) == pytest.approx(4 / 5, rel=1e-12)
    assert _rel_error(torch.ones(2), torch.zeros(2)) == 0.0  # a zero input: no error figure, 0 by convention


@pytest.fixture()
def tbq():
    """docs/authoring.md's worked example: a kit declaration of the user's, with no hand-written version."""
    import re
    from pathlib import Path

    from gradpress.compress.registry import _REGISTRY

    doc = (Path(__file__).resolve().parents[1] / "docs" / "authoring.md").read_text()
    code = re.search(r"```python\n(.*?)```", doc[doc.index("## Worked example"):], re.S).group(1)
    exec(compile(code, "authoring.md", "exec"), {})  # noqa: S102 - the documented example itself
    try:
        yield
    finally:
        _REGISTRY.classes.pop("tbq", None)


def test_eager_and_compiled_apply_to_every_kit_declaration_hand_only_to_the_frozen_ones(tbq):
    from gradpress.bench.compressors_rows import variant_applies

    default, eager, compiled, hand = "default,eager,compiled,hand".split(",")  # as --variants gives them
    assert variant_applies("tbq:tau=0.5", eager) and variant_applies("tbq:tau=0.5", compiled)
    assert variant_applies("tbq:tau=0.5", default) and not variant_applies("tbq:tau=0.5", hand)
    assert not variant_applies("tbq:tau=0.5", "hand") and variant_applies("tbq:tau=0.5", "eager")


def test_variants_apply_to_the_methods_the_docs_name(monkeypatch):
    from gradpress.bench import compressors_rows
    from gradpress.bench.compressors_rows import _compile_mode, variant_applies
    from gradpress.compress.kit import compiler

    assert variant_applies("fp16>topk:ratio=0.1", "default") and not variant_applies("qsgd>topk", "hand")
    assert variant_applies("qsgd:levels=4", "hand") and variant_applies("topk:ratio=0.1", "hand")
    assert not variant_applies("fp16", "hand")
    assert variant_applies("qsgd:levels=4", "eager") and variant_applies("qsgd:levels=4", "compiled")
    assert not variant_applies("qsgd>fp16", "eager")
    import torch

    monkeypatch.setattr(compiler, "keeps_eager_numerics", lambda device_type="cpu": True)
    assert _compile_mode("compiled", torch.zeros(compiler.MIN_COMPILE_NUMEL)) == "auto"
    assert _compile_mode("compiled", torch.zeros(compiler.MIN_COMPILE_NUMEL + 1)) == "auto"
    assert _compile_mode("compiled", torch.zeros(compiler.MIN_COMPILE_NUMEL - 1)) == "on"
    monkeypatch.setattr(compiler, "keeps_eager_numerics", lambda device_type="cpu": False)
    assert _compile_mode("compiled", torch.zeros(compiler.MIN_COMPILE_NUMEL)) == "on"
    assert _compile_mode("eager", torch.zeros(4)) == "off"
    monkeypatch.setattr(compiler, "mode", lambda: "policy")
    assert _compile_mode("default", torch.zeros(4)) == _compile_mode("hand", torch.zeros(4)) == "policy"
    assert compressors_rows._builder("default") is compressors_rows.build


# ----------------------------------------------------------------------------- bench compressors: the table


def _crow(name: str, numel: int, **v) -> dict:
    row = {"compressor": name, "numel": numel, "encode_gbps": 1.234, "decode_gbps": 5.678, "decode_into_gbps": None,
           "encode_roofline_fraction": 0.12345, "ratio": 32.04, "wire_bytes": 12_345, "rel_error": 0.123456,
           "density_quality": None, "speedup_vs_topk": 1.5, "peak_temp_ratio": 0.25}
    row.update(v)
    return row


def test_compressor_table_cells_rooflines_skips_and_targets():
    from gradpress.bench.compressors_report import format_table

    rows = [_crow("topk:ratio=0.01", 4000, density_quality=1.0, decode_into_gbps=9.0),
            _crow("a" * 40, 4000, ratio=math.inf, encode_gbps=math.inf, encode_roofline_fraction=0.5),
            _crow("fp16", 8000, speedup_vs_topk=None)]
    result = {"rows": rows, "roofline": {"4000": 12.345, "8000": 20.0},
              "rooflines": {"8000": {"1": 5.0, "all": 9.5, "run_threads": 2}},
              "skipped": [{"compressor": "powersgd", "numel": 4000, "reason": "not a matrix"}],
              "targets": [{"target": "t1", "compressor": "fp16", "numel": 8000, "value": 0.5, "threshold": 0.25,
                           "met": True},
                          {"target": "peak", "compressor": "qsgd", "numel": 1_000_000, "value": 3.14159,
                           "threshold": 3, "met": False}]}
    lines = format_table(result).splitlines()
    assert lines[0].split() == ["compressor", "numel", "enc", "GB/s", "dec", "GB/s", "into", "GB/s", "%roof", "ratio",
                                "wire", "bytes", "rel", "err", "dens", "q", "vs", "topk", "peak/in"]
    assert lines[1] == "-" * len(lines[0])
    assert lines[2].split() == ["topk:ratio=0.01", "4,000", "1.23", "5.68", "9.00", "12.3", "32.0", "12,345", "0.1235",
                                "1.000", "1.50", "0.25"]
    assert lines[3].split() == ["a" * 28, "4,000", "inf", "5.68", "-", "50.0", "inf", "12,345", "0.1235", "-", "1.50",
                                "0.25"]
    assert lines[4] == "" and lines[5].split()[:2] == ["fp16", "8,000"] and lines[5].split()[10] == "-"
    assert lines[6] == ""
    assert lines[7] == "copy roofline at 4,000 elements: 12.35 GB/s (bytes read + written)"
    assert lines[8] == ("copy roofline at 8,000 elements (bytes read + written, best of several runs): 1 thread "
                        "5.00 GB/s, all threads 9.50 GB/s; %roof uses 20.00 GB/s, measured at this run's 2 thread(s)")
    assert lines[9:] == ["skipped powersgd at 4,000: not a matrix", "targets: 1 of 2 met",
                         "  MISSED peak: qsgd at 1,000,000: 3.14 (needs 3)"]


def test_huge_page_line_only_above_32_mib_of_input():
    from gradpress.bench.compressors_report import format_table

    def table(numel: int) -> str:
        return format_table({"rows": [_crow("fp16", numel)], "roofline": {}, "skipped": [], "targets": [],
                             "env": {"transparent_hugepage": "", "thp_alloc": None}})

    assert "faulted in" not in table(8 * 2**20)  # exactly 32 MiB of fp32
    line = next(x for x in table(8 * 2**20 + 1).splitlines() if "faulted in" in x)
    assert "(transparent huge pages: unknown; THP_MEM_ALLOC_ENABLE=unset)" in line
    assert "faulted in" not in format_table({"rows": [_crow("fp16", 10**8)], "roofline": {}, "skipped": [],
                                             "targets": [], "env": {"transparent_hugepage": None}})


def test_json_safe_writes_infinities_as_strings_and_nan_as_null():
    from gradpress.bench.compressors_report import _json_safe

    got = _json_safe({"a": [1.5, math.inf, {"b": -math.inf}], "c": math.nan, "d": "inf", "e": 3})
    assert got == {"a": [1.5, "inf", {"b": "-inf"}], "c": None, "d": "inf", "e": 3}


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


def test_a_numeric_quality_of_the_method_is_reported_a_boolean_not(monkeypatch, scripted):
    import torch

    from gradpress.bench import compressors_rows
    from gradpress.compress import create

    x = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    for quality, want in ((0.75, 0.75), (2, 2.0), (True, None), ("0.5", None)):
        def build(spec, quality=quality):
            comp = create("fp16")
            comp.quality = quality
            return comp, "stand-in"

        monkeypatch.setattr(compressors_rows, "build", build)
        scripted.medians.extend([0.001, 0.001, 0.001])
        row = compressors_rows.bench_method("fp16", x, "normal", 10.0, repeats=1, warmup=0)
        assert row["reported_quality"] == want and row["note"] == "stand-in", quality
        assert want is None or isinstance(row["reported_quality"], float)
