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
    a collective: ring allreduce 2(N-1)/N (reduce-scatter + allgather; also
    ``uncompressed``, the plain fused allreduce of the tensors a plan leaves
    dense), allgather N-1 (each worker receives every other worker's
    packet), the compressed ring 1 (its counted bytes are the messages this
    rank sends); None where no single figure holds (ps: roots receive more)."""
    if strategy in ("allreduce", "uncompressed"):
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
    link: float | None = None
    payload = row["payload_bytes_per_step"]
    if cfg.kind == "gradpress":
        counts: dict[str, int] = {}
        for v in (r0.get("plan") or {}).values():
            counts[v[0]] = counts.get(v[0], 0) + 1
        row["plan_counts"] = dict(sorted(counts.items()))  # the planner's choice, per strategy (auto)
        planned = {v[0] for v in (r0.get("plan") or {}).values()}
        compressed = planned - {"uncompressed"}
        row["strategy_used"] = compressed.pop() if len(compressed) == 1 else (None if compressed else "allreduce")
        # a mixed plan has no one factor without the breakdown; no plan: everything plainly allreduced
        strategy = planned.pop() if len(planned) == 1 else (None if planned else "uncompressed")
        row["strategy_bytes_per_step"] = r0.get("strategy_bytes_per_step")
        if payload is not None and row["strategy_bytes_per_step"]:
            link = _link_bytes(row["strategy_bytes_per_step"], payload, world)
            total = sum(row["strategy_bytes_per_step"].values())
            if link is not None and total > 0:  # the mean factor, weighted by bytes (over the breakdown's own sum)
                row["wire_factor"] = link / total
    if link is None and strategy is not None and payload is not None:
        row["wire_factor"] = factor = wire_factor(strategy, world)
        link = None if factor is None else factor * payload
    if link is not None:
        row["ideal_payload_s"] = compute_s + link * 8 / rate
    return row


def _link_bytes(by_strategy: dict[str, float], payload: float, world: int) -> float | None:
    """Bytes on the busiest link direction per step: each collective's bytes
    (``by_strategy``: the engine's ``strategy_bytes`` per step, keyed by the
    strategy that handed them over, ``uncompressed`` for the plain fused
    allreduce) at its own :func:`wire_factor`. None when the breakdown does
    not account for the whole payload (an algorithm's own exchanges) or a
    strategy has no single factor."""
    if abs(sum(by_strategy.values()) - payload) > 1e-6 * max(payload, 1.0):
        return None
    factors = {name: wire_factor(name, world) for name in by_strategy}
    if any(f is None for f in factors.values()):
        return None
    return sum(factors[name] * nbytes for name, nbytes in by_strategy.items())  # type: ignore[operator]


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
