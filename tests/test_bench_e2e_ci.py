"""``gradpress bench e2e --train-to T --seeds N``: the table over seeds gives
the 95% confidence interval of the mean time to target and of the mean
final metric (Student t, n-1 degrees of freedom), the interval of the mean
time difference to plain DDP (the command's reference: paired by seed when
both reached the target at the same seeds, else Welch), and a rank by time
to target by the rule of ``gradpress compare`` (overlapping intervals share
a rank; a configuration that missed the target or failed at some seed is
unranked and counted); the plot's error bars are the same interval. Every
reference is computed here by the definition in float64 (the t quantile of
``tests/references.py``). Synthetic per-seed results: no cluster."""

from __future__ import annotations

import math

import pytest
from references import ci_ref, mean_sd, t_ref

from gradpress.bench import e2e_seeds

SEEDS = [0, 1, 2]
#: (label, kind) -> time to target per seed; None: that seed missed the target; "failed": the run failed
TIMES = {
    ("torch ddp", "ddp"): [15.0, 13.4, 16.1],
    ("torch powersgd r=2", "torch-powersgd"): [13.7, 13.3, 14.3],
    ("gradpress topk:ratio=0.01@allgather", "gradpress"): [6.2, 4.8, 7.0],
    ("gradpress choco/efsignsgd", "gradpress"): [3.3, 2.9, 3.5],
    ("gradpress missed", "gradpress"): [5.0, None, 6.0],
    ("gradpress broken", "gradpress"): [4.0, 4.5, "failed"],
}
#: final metric per configuration and seed (the failed run has none)
FINAL = {label: [0.851 + 0.007 * i + 0.003 * s * (1 + i % 3) for s in SEEDS] for i, (label, _) in enumerate(TIMES)}
SETUP = {"nodes": 4, "bandwidth": "100mbit", "bandwidth_bits": 100_000_000, "workload": "mnist1d-cnn",
         "parameters": 105_738, "batch_size": 16, "optimizer": "momentum", "lr": 0.1, "threads": 1, "torch": "2.x",
         "cpus": 2, "metric": "accuracy", "eval_every": 10}


def _results(times: dict = TIMES, seeds: list[int] = SEEDS) -> list[dict]:
    """One result of ``run_e2e`` per seed, its rows in the order the command runs them (DDP first)."""
    out = []
    for j, seed in enumerate(seeds):
        rows = []
        for (label, kind), per_seed in times.items():
            t = per_seed[j]
            ok = t != "failed"
            ref_t = next(iter(times.values()))[j]
            final = FINAL.get(label, [0.90, 0.91, 0.93])[j]
            rows.append({"label": label, "kind": kind, "spec": None, "ok": ok, "reached": ok and t is not None,
                         "time_to_target_s": t if ok else None,
                         "steps_to_target": 10 * round(t * 20) if ok and t is not None else None, "steps": 500,
                         "train_s": 30.0, "best_metric": final + 0.002 if ok else None,
                         "final_metric": final if ok else None, "payload_bytes_per_step": 12_550.0,
                         "speedup": ref_t / t if ok and t is not None and isinstance(ref_t, float) else None,
                         "error": None if ok else "worker rank 1 exited with 1"})
        out.append({"mode": "train", "target": 0.85, "setup": {**SETUP, "seed": seed}, "rows": rows, "notes": [],
                    "seconds": 60.0})
    return out


def _combined(times: dict = TIMES, seeds: list[int] = SEEDS) -> dict:
    return e2e_seeds.combine(_results(times, seeds), seeds, "gradpress bench e2e --train-to 0.85 --seeds 3")


def _table(res: dict) -> tuple[list[str], dict[str, list[str]], list[str]]:
    """The table's header, its rows by configuration (label without the failure note) and the row order."""
    lines = [line for line in e2e_seeds.markdown(res).splitlines() if line.startswith("| ")]
    cells = [[c.strip() for c in line.strip().strip("|").split("|")] for line in lines]
    order = [r[0].split(" (")[0] for r in cells[1:]]
    return cells[0], dict(zip(order, cells[1:])), order


def _reached(label: str) -> list[float]:
    return [t for (lab, _), v in TIMES.items() if lab == label for t in v if isinstance(t, float)]


def test_the_table_gives_the_interval_of_the_mean_time_to_target_and_of_the_final_metric():
    res = _combined()
    head, rows, _ = _table(res)
    time_col = head.index("time to target: 95% CI of the mean (t, n-1 df)")
    final_col = head.index("final metric: 95% CI of the mean (t, n-1 df)")
    for (label, _), per_seed in TIMES.items():
        times = [t for t in per_seed if isinstance(t, float)]  # over the seeds that reached the target
        lo, hi = ci_ref(times)
        assert rows[label][time_col] == f"[{lo:.2f}, {hi:.2f}]", label
        finals = [f for f, t in zip(FINAL[label], per_seed) if t != "failed"]
        flo, fhi = ci_ref(finals)
        assert rows[label][final_col] == f"[{flo:.4f}, {fhi:.4f}]", label
        g = next(g for g in res["aggregate"] if g["label"] == label)
        assert g["time_to_target_s"]["ci95"] == pytest.approx([lo, hi], rel=1e-9)
        assert g["final_metric"]["ci95"] == pytest.approx([flo, fhi], rel=1e-9)
    # the interval is t(0.975, 2) = 4.303 standard errors wide on either side, not the min-max range
    m, s = mean_sd(_reached("torch ddp"))
    assert t_ref(0.975, 2) == pytest.approx(4.303, abs=5e-4)
    assert rows["torch ddp"][time_col] == f"[{m - 4.3027 * s / math.sqrt(3):.2f}, {m + 4.3027 * s / math.sqrt(3):.2f}]"


def test_the_difference_to_ddp_is_paired_by_seed_when_both_reached_at_the_same_seeds():
    res = _combined()
    assert res["reference"] == "torch ddp"
    head, rows, _ = _table(res)
    col = head.index("vs torch ddp: 95% CI of the mean time difference (s)")
    ddp = TIMES[("torch ddp", "ddp")]
    assert rows["torch ddp"][col] == "reference"
    for label in ("torch powersgd r=2", "gradpress topk:ratio=0.01@allgather", "gradpress choco/efsignsgd"):
        mine = next(v for (lab, _), v in TIMES.items() if lab == label)
        lo, hi = ci_ref([a - b for a, b in zip(mine, ddp)])  # the mean per-seed difference
        assert rows[label][col] == f"[{lo:+.2f}, {hi:+.2f}] paired by seed (3)", label
        g = next(g for g in res["aggregate"] if g["label"] == label)
        assert g["vs_reference"]["kind"] == "paired" and g["vs_reference"]["ci95"] == pytest.approx([lo, hi], rel=1e-9)
    # the configuration that missed seed 1: 2 values against DDP's 3, unpaired (Welch-Satterthwaite)
    a, b = _reached("gradpress missed"), ddp
    (ma, sa), (mb, sb) = mean_sd(a), mean_sd(b)
    va, vb = sa * sa / len(a), sb * sb / len(b)
    df = (va + vb) ** 2 / (va * va / (len(a) - 1) + vb * vb / (len(b) - 1))
    half = t_ref(0.975, df) * math.sqrt(va + vb)
    assert rows["gradpress missed"][col] == f"[{ma - mb - half:+.2f}, {ma - mb + half:+.2f}] Welch (2 vs 3 seeds)"
    g = next(g for g in res["aggregate"] if g["label"] == "gradpress missed")
    assert g["vs_reference"]["kind"] == "welch" and g["vs_reference"]["df"] == pytest.approx(df, rel=1e-12)


def test_the_reference_is_ddp_only_when_the_command_ran_it_first():
    """The speed-up's reference, ``e2e_run``'s rule: the first row when it is plain DDP."""
    times = {("gradpress a", "gradpress"): [1.0, 1.2, 1.1], ("gradpress b", "gradpress"): [2.0, 2.2, 2.5]}
    res = _combined(times)
    assert res["reference"] is None and all(g["vs_reference"] is None for g in res["aggregate"])
    head, _, _ = _table(res)
    assert not any(h.startswith("vs ") for h in head)


def test_the_rank_is_by_time_to_target_shared_where_the_intervals_overlap():
    res = _combined()
    head, rows, order = _table(res)
    rank, seps = head.index("rank (time to target)"), head.index("not separable from")
    full = {lab: v for (lab, _), v in TIMES.items() if all(isinstance(t, float) for t in v)}
    ci = {lab: ci_ref(v) for lab, v in full.items()}
    # the rule: ranked when the target was reached at every seed; rank = 1 + the number of ranked configurations
    # whose whole interval lies below its own (less time); overlapping ones are named
    want = {c: 1 + sum(ci[o][1] < ci[c][0] for o in ci) for c in ci}
    assert want == {"gradpress choco/efsignsgd": 1, "gradpress topk:ratio=0.01@allgather": 1,
                    "torch ddp": 3, "torch powersgd r=2": 3}  # the data is not trivial: two shared ranks
    for c in ci:
        assert rows[c][rank] == str(want[c]), c
        others = [f"`{o}`" for o in ci if o != c and ci[o][0] <= ci[c][1] and ci[c][0] <= ci[o][1]]
        assert rows[c][seps] == (", ".join(others) or "-"), c
    assert rows["gradpress missed"][rank] == "- (not reached at 1 of 3 seeds)"
    assert rows["gradpress broken"][rank] == "- (failed at 1 of 3 seeds)"
    # rank order, unranked last in the order they ran
    assert order == ["gradpress topk:ratio=0.01@allgather", "gradpress choco/efsignsgd", "torch ddp",
                     "torch powersgd r=2", "gradpress missed", "gradpress broken"]
    md = e2e_seeds.markdown(res)
    assert "Unranked: 2 of 6 configurations (the target missed or the run failed at some seed)." in md
    assert "rank by wall-clock time to target" in md.lower()
    g = {g["label"]: g for g in res["aggregate"]}
    assert g["torch ddp"]["rank"] == 3 and g["torch ddp"]["not_separable_from"] == ["torch powersgd r=2"]
    assert g["gradpress missed"]["rank"] is None and "time to target" in res["rank_rule"]


def test_one_seed_gives_no_interval_and_no_rank():
    times = {k: v[:1] for k, v in TIMES.items()}
    res = _combined(times, [0])
    head, rows, _ = _table(res)
    assert rows["torch ddp"][head.index("time to target: 95% CI of the mean (t, n-1 df)")] == "-"
    assert rows["torch ddp"][head.index("rank (time to target)")] == "- (needs 2 seeds)"
    assert rows["gradpress choco/efsignsgd"][head.index("vs torch ddp: 95% CI of the mean time difference (s)")] == "-"


def test_the_plot_error_bars_are_the_tables_interval(tmp_path):
    res = _combined()
    bars = {b["label"]: b for b in e2e_seeds.bars(res)}
    for (label, _), per_seed in TIMES.items():
        times = [t for t in per_seed if isinstance(t, float)]
        lo, hi = ci_ref(times)
        m = math.fsum(times) / len(times)
        assert bars[label]["mean"] == pytest.approx(m, rel=1e-12)
        assert (bars[label]["lo"], bars[label]["hi"]) == pytest.approx((lo, hi), rel=1e-9), label
        assert bars[label]["hatched"] == (len(times) < 3)
    one = {b["label"]: b for b in e2e_seeds.bars(_combined({k: v[:1] for k, v in TIMES.items()}, [0]))}
    assert one["torch ddp"]["lo"] is None and one["torch ddp"]["hi"] is None  # one seed: no error bar
    assert "error bars: 95% confidence interval of the mean (t, n-1 df)" in e2e_seeds.caption(res).replace("\n", " ")
    path = e2e_seeds.plot(res, tmp_path / "e2e.png")
    assert path.stat().st_size > 1000


def test_the_difference_is_welch_when_the_seeds_differ_even_in_equal_number():
    """DDP missed seed 2, the configuration seed 0: 2 values each, at different seeds, so nothing pairs them
    (``plants7``: pairing the values in order when their counts match gave ``paired by seed (2)`` of seed 1's
    and seed 2's time minus seed 0's and seed 1's)."""
    times = {("torch ddp", "ddp"): [15.0, 13.4, None], ("gradpress late", "gradpress"): [None, 5.0, 6.5]}
    res = _combined(times)
    head, rows, _ = _table(res)
    a, b = [5.0, 6.5], [15.0, 13.4]
    (ma, sa), (mb, sb) = mean_sd(a), mean_sd(b)
    va, vb = sa * sa / 2, sb * sb / 2
    df = (va + vb) ** 2 / (va * va / 1 + vb * vb / 1)  # Welch-Satterthwaite
    half = t_ref(0.975, df) * math.sqrt(va + vb)
    col = head.index("vs torch ddp: 95% CI of the mean time difference (s)")
    assert rows["gradpress late"][col] == f"[{ma - mb - half:+.2f}, {ma - mb + half:+.2f}] Welch (2 vs 2 seeds)"
    g = next(g for g in res["aggregate"] if g["label"] == "gradpress late")
    assert g["vs_reference"]["kind"] == "welch" and g["vs_reference"]["df"] == pytest.approx(df, rel=1e-12)
    assert g["vs_reference"]["ci95"] == pytest.approx([ma - mb - half, ma - mb + half], rel=1e-9)


def test_the_rank_is_by_time_to_target_even_where_steps_to_target_order_them_the_other_way():
    """A compressed run often needs more steps to reach the target, each step cheaper: the rank is by wall-clock
    time (``plants7``: ranking by steps to target passed every other test, whose steps follow the time)."""
    times = {("torch ddp", "ddp"): [15.0, 13.4, 16.1], ("gradpress fast", "gradpress"): [3.3, 2.9, 3.5]}
    steps = {"torch ddp": [100, 110, 120], "gradpress fast": [300, 310, 320]}
    results = _results(times)
    for j, res in enumerate(results):
        for r in res["rows"]:
            r["steps_to_target"] = steps[r["label"]][j]
    res = e2e_seeds.combine(results, SEEDS, "gradpress bench e2e --train-to 0.85 --seeds 3")
    ci = {lab: ci_ref(v) for (lab, _), v in times.items()}
    want = {c: 1 + sum(ci[o][1] < ci[c][0] for o in ci) for c in ci}
    assert want == {"torch ddp": 2, "gradpress fast": 1}
    assert {g["label"]: g["rank"] for g in res["aggregate"]} == want
    assert res["aggregate"][0]["steps_to_target"]["values"] == steps["torch ddp"]  # the steps are the ones set
