"""bench e2e's figures for exchanges behind compute (issue 19): the worker
reads the algorithm's own clock (exchange time, time waited, overlap); the
row's bound is max(compute + compression, wire) by its formula; the report
prints them in their own table."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from distributed import run_workers
from test_bench_e2e import _run_worker_mode

from gradpress.bench.e2e_configs import parse_configs
from gradpress.bench.e2e_report import STEP_FIELDS, markdown
from gradpress.bench.e2e_rows import _step_row


def test_worker_records_the_background_exchange_clock(tmp_path) -> None:
    cfg = parse_configs("comprex:staleness=1/topk:ratio=0.05@allgather")[0].to_dict()
    a, b = run_workers(_run_worker_mode, 2, "step", cfg, str(tmp_path))
    for r in (a, b):
        assert r["exchange_s_per_step"] > 0 and 0 <= r["exposed_s_per_step"] <= r["exchange_s_per_step"]
        want = (r["exchange_s_per_step"] - r["exposed_s_per_step"]) / r["exchange_s_per_step"]
        assert r["overlap"] == pytest.approx(want)
    sync = parse_configs("topk:ratio=0.05@allgather")[0].to_dict()
    a, _ = run_workers(_run_worker_mode, 2, "step", sync, str(tmp_path))
    assert "overlap" not in a  # the DDP hook has no background exchange


def _result(rank: int, link: float, overlap: float | None) -> dict:
    out = {"warmup": 3, "steps": 4, "bucket_cap_mb": None, "buckets": None, "median_step_s": 0.25,
           "step_s": [0.25] * 4, "payload_bytes_per_step": 1000.0, "payload_source": "x",
           "compress_s_per_step": 0.04, "comm_s_per_step": 0.2, "register_s": 0.0, "plan": {"w": ["allgather", 1]},
           "link_rx_bytes_per_step": link, "link_tx_bytes_per_step": link * 0.5}
    if overlap is not None:
        out.update({"exchange_s_per_step": 0.2, "exposed_s_per_step": 0.2 * (1 - overlap), "overlap": overlap})
    return out


@pytest.mark.parametrize("compute, link, bound", [(0.1, 2.5e6, 0.2), (0.3, 2.5e6, 0.34)])
def test_bound_is_max_of_compute_plus_compression_and_wire(compute: float, link: float, bound: float) -> None:
    rate = 100_000_000
    cfg = parse_configs("comprex:staleness=1/topk:ratio=0.05@allgather")[0]
    res = SimpleNamespace(ok=True, seconds=1.0)
    row = _step_row(cfg, res, [_result(0, link, 0.75), _result(1, link * 0.9, 0.5)], [], compute, rate, 4, None, "t")
    # wire = 2.5 MB x 8 / 100 Mbit/s = 0.2 s; compute + compression = compute + 0.04
    assert row["overlap_bound_s"] == pytest.approx(max(compute + 0.04, 2.5e6 * 8 / rate))
    assert row["overlap_bound_s"] == pytest.approx(bound)
    assert row["over_bound"] == pytest.approx(0.25 / bound)
    assert row["overlap"] == 0.75  # rank 0's clock
    assert set(STEP_FIELDS) <= set(row)
    plain = _step_row(parse_configs("topk:ratio=0.05@allgather")[0], res, [_result(0, link, None)], [], compute,
                      rate, 4, None, "t")
    assert plain["overlap_bound_s"] is None and plain["over_bound"] is None
    setup = {"nodes": 4, "bandwidth": "100mbit", "bandwidth_bits": rate, "workload": "wide-mlp", "parameters": 10,
             "batch_size": 8, "optimizer": "momentum", "lr": 0.1, "threads": 1, "torch": "x", "cpus": 2}
    md = markdown({"mode": "step", "command": "gradpress bench e2e", "setup": setup,
                   "compute": {"shared_s": compute, "solo_s": compute}, "rows": [plain, row], "notes": []})
    assert "Exchanges behind compute" in md
    line = next(x for x in md.splitlines() if x.startswith(f"| {row['label']} | 0.250 s | {bound:.3f} s"))
    assert f"| {0.25 / bound:.2f} |" in line and "| 0.75 |" in line
