"""The rows of ``gradpress bench e2e``: one configuration's per-rank worker
results turned into a row of the report (step time, bytes per step and the
ideal time; or time to target), and the wire factor of a strategy.
"""

from __future__ import annotations

from typing import Any

from gradpress.bench.e2e_configs import RunConfig
from gradpress.bench.e2e_jobs import _Runner

__all__ = ["wire_factor"]


def wire_factor(strategy: str | None, world: int) -> float | None:
    """Bytes one link direction carries per payload byte a worker hands to
    a collective: ring allreduce 2(N-1)/N (reduce-scatter + allgather),
    allgather N-1 (each worker receives every other worker's packet), the
    compressed ring 1 (its counted bytes are the messages this rank sends);
    None where no single figure holds (ps: roots receive more; mixed plans)."""
    if strategy == "allreduce":
        return 2 * (world - 1) / world
    if strategy == "allgather":
        return float(world - 1)
    if strategy == "ring":
        return 1.0
    return None


def _step_row(cfg: RunConfig, res: Any, results: list[dict[str, Any] | None], tbf: list[dict[str, int]],
              compute_s: float, rate: int, world: int, runner: _Runner, tag: str) -> dict[str, Any]:
    row: dict[str, Any] = {k: None for k in ("warmup", "steps", "bucket_cap_mb", "buckets", "median_step_s",
                                             "step_s", "speedup", "payload_bytes_per_step", "payload_source",
                                             "host_bytes_per_step", "link_bytes_per_step", "link_tx_bytes_per_step",
                                             "link_rx_bytes_per_step", "compute_s", "ideal_s",
                                             "measured_over_ideal", "wire_factor", "ideal_payload_s",
                                             "compress_s_per_step", "comm_s_per_step", "register_s", "error",
                                             "exchange_s_per_step", "exposed_s_per_step", "overlap",
                                             "overlap_bound_s", "over_bound")}
    row.update({"label": cfg.label, "kind": cfg.kind, "spec": cfg.spec or None,
                "strategy": cfg.strategy if cfg.kind == "gradpress" else "allreduce",
                "ok": bool(res.ok and all(r is not None for r in results)), "tbf_bytes": tbf,
                "seconds": res.seconds})
    if not row["ok"]:
        row["error"] = runner.failure(res, tag)
        return row
    r0 = results[0]
    assert r0 is not None
    link = [max(r["link_rx_bytes_per_step"], r["link_tx_bytes_per_step"]) for r in results
            if r and "link_rx_bytes_per_step" in r]
    row.update({k: r0.get(k) for k in ("warmup", "steps", "bucket_cap_mb", "buckets", "median_step_s", "step_s",
                                       "payload_bytes_per_step", "payload_source", "host_bytes_per_step",
                                       "compress_s_per_step",
                                       "comm_s_per_step", "register_s", "exchange_s_per_step",
                                       "exposed_s_per_step", "overlap")})
    row["link_bytes_per_step"] = max(link) if link else None
    row["link_tx_bytes_per_step"] = [r["link_tx_bytes_per_step"] for r in results if r and "link_tx_bytes_per_step" in r]
    row["link_rx_bytes_per_step"] = [r["link_rx_bytes_per_step"] for r in results if r and "link_rx_bytes_per_step" in r]
    row["compute_s"] = compute_s
    if row["link_bytes_per_step"] is not None:
        row["ideal_s"] = compute_s + row["link_bytes_per_step"] * 8 / rate
        row["measured_over_ideal"] = row["median_step_s"] / row["ideal_s"]
    if row["overlap"] is not None and row["link_bytes_per_step"] is not None:
        # an exchange behind compute: compression is CPU work beside the compute, the wire can hide
        row["overlap_bound_s"] = max(compute_s + (row["compress_s_per_step"] or 0.0),
                                     row["link_bytes_per_step"] * 8 / rate)
        row["over_bound"] = row["median_step_s"] / row["overlap_bound_s"]
    strategy = row["strategy"]
    if cfg.kind == "gradpress":
        counts: dict[str, int] = {}
        for v in (r0.get("plan") or {}).values():
            counts[v[0]] = counts.get(v[0], 0) + 1
        row["plan_counts"] = dict(sorted(counts.items()))  # the planner's choice, per strategy (auto)
        planned = {v[0] for v in (r0.get("plan") or {}).values() if v[0] != "uncompressed"}
        strategy = planned.pop() if len(planned) == 1 else (None if planned else "allreduce")
        row["strategy_used"] = strategy
    factor = wire_factor(strategy, world)
    row["wire_factor"] = factor
    if factor is not None and row["payload_bytes_per_step"] is not None:
        row["ideal_payload_s"] = compute_s + factor * row["payload_bytes_per_step"] * 8 / rate
    return row


def _train_row(cfg: RunConfig, res: Any, results: list[dict[str, Any] | None], runner: _Runner,
               tag: str) -> dict[str, Any]:
    row: dict[str, Any] = {k: None for k in ("reached", "time_to_target_s", "steps_to_target", "steps", "train_s",
                                             "final_metric", "best_metric", "speedup", "payload_bytes_per_step",
                                             "bucket_cap_mb", "buckets", "history", "error")}
    row.update({"label": cfg.label, "kind": cfg.kind, "spec": cfg.spec or None,
                "strategy": cfg.strategy if cfg.kind == "gradpress" else "allreduce",
                "ok": bool(res.ok and results and results[0] is not None), "seconds": res.seconds})
    if not row["ok"]:
        row["error"] = runner.failure(res, tag)
        return row
    r0 = results[0]
    assert r0 is not None
    row.update({k: r0.get(k) for k in row if k in r0 and k not in ("label", "kind", "ok", "seconds", "error")})
    return row
