"""The figures of the published benchmark tables, pinned for survivors of the
``benchreport`` group of ``make mutants`` (bench/e2e_rows.py, e2e_report.py,
e2e_seeds.py, compressors_rows.py, compressors_report.py, estimators.py); this
file: ``bench e2e`` (bench compressors and estimators:
test_mutants_benchreport_compressors.py).

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
from references import ci_ref, mean_sd, t_ref

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
    # the row format (columns) as of the intervals and the rank (bench e2e --seeds): time, its 95% interval,
    # the interval of the time difference to DDP, rank, not separable, steps, best, final, its interval, speed-up
    sd = _sample_std([10.0, 12.0, 14.0, 16.0])
    lo, hi = ci_ref([10.0, 12.0, 14.0, 16.0])
    finals = [0.94, 0.92, 0.90, 0.89]
    flo, fhi = ci_ref(finals)
    assert (f"| torch ddp | 13.00 ± {sd:.2f} [10.00, 16.00] | [{lo:.2f}, {hi:.2f}] | reference | 1 | - "
            f"| 130 ± {10 * sd:.0f} [100, 160] "
            f"| {(0.95 + 0.93 + 0.91 + 0.90) / 4:.4f} ± {_sample_std([0.95, 0.93, 0.91, 0.90]):.4f} [0.9000, 0.9500] "
            f"| {math.fsum(finals) / 4:.4f} ± {_sample_std(finals):.4f} [0.8900, 0.9400] | [{flo:.4f}, {fhi:.4f}] "
            "| 1.00x ± 0.00x [1.00x, 1.00x] | 2.00 KB |") in md
    bm = _sample_std([0.93, 0.90, 0.85])
    lo, hi = ci_ref([4.0, 5.0])
    (ma, sa), (mb, sb) = mean_sd([4.0, 5.0]), mean_sd([10.0, 12.0, 14.0, 16.0])  # Welch: 2 times against 4
    va, vb = sa * sa / 2, sb * sb / 4
    half = t_ref(0.975, (va + vb) ** 2 / (va * va / 1 + vb * vb / 3)) * math.sqrt(va + vb)
    finals = [0.92, 0.89, 0.84]
    flo, fhi = ci_ref(finals)
    assert (f"| gradpress topk (1 of 4 failed) | 4.50 ± {_sample_std([4.0, 5.0]):.2f} [4.00, 5.00]; not reached "
            f"(2 of 4) | [{lo:.2f}, {hi:.2f}] | [{ma - mb - half:+.2f}, {ma - mb + half:+.2f}] Welch (2 vs 4 seeds) "
            "| - (failed at 1 of 4 seeds, not reached at 1) | - "
            f"| 45 ± {_sample_std([40.0, 50.0]):.0f} [40, 50]; not reached (2 of 4) "
            f"| {(0.93 + 0.90 + 0.85) / 3:.4f} ± {bm:.4f} [0.8500, 0.9300]; - (1 of 4) "
            f"| {math.fsum(finals) / 3:.4f} ± {_sample_std(finals):.4f} [0.8400, 0.9200]; - (1 of 4) "
            f"| [{flo:.4f}, {fhi:.4f}] "
            f"| 2.45x ± {_sample_std([2.5, 2.4]):.2f}x [2.40x, 2.50x]; - (2 of 4) | 2.00 KB |") in md
    assert "Unranked: 1 of 2 configurations" in md
    assert md.endswith("Notes:\n\n- n3\n")
    # the total time is the sum of the seeds' times; a result without a clock adds nothing (never less)
    del results[1]["seconds"]
    assert combine(results, seeds, "c")["seconds"] == 1.5 + 4.5 + 6.0
