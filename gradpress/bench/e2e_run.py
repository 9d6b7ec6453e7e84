"""The run of ``gradpress bench e2e``: one emulated cluster, the compute-only
steps, then every configuration in turn; the speed-ups over plain DDP, the
notes and the setup of the result written to ``e2e.json``.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from gradpress.bench.e2e_args import _resolve, command_line
from gradpress.bench.e2e_configs import RunConfig
from gradpress.bench.e2e_jobs import _Runner
from gradpress.bench.e2e_rows import _step_row, _train_row

__all__ = ["run_e2e"]


def _log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _compute(runner: _Runner) -> dict[str, Any]:
    """Compute-only step time: in every node at once (shared CPU, as in the
    distributed runs) and in node 0 alone."""
    job = runner.job("compute", "compute", None, solo=True)
    res, results, _ = runner.run_all("compute", job)
    if not res.ok or any(r is None for r in results):
        raise RuntimeError(f"compute-only run failed: {runner.failure(res, 'compute')}")
    shared = statistics.median([t for r in results for t in r["step_s"]])  # type: ignore[index]
    r0 = results[0]
    assert r0 is not None
    return {"shared_s": shared, "solo_s": r0.get("solo_median_step_s"), "parameters": r0["parameters"],
            "per_rank_s": [r["median_step_s"] for r in results]}  # type: ignore[index]


def run_e2e(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark; returns the result written to ``e2e.json``."""
    import torch

    from gradpress.cluster import EmulatedCluster, check_support, format_rate

    settings = _resolve(args)
    support = check_support()
    if not support.ok:
        raise ValueError(f"the emulated cluster is not available here ({support}); allowed: run as root on Linux with iproute2")
    out: Path = settings["out"]
    out.mkdir(parents=True, exist_ok=True)
    configs: list[RunConfig] = settings["configs"]
    rate, world = settings["rate"], settings["world"]
    per = settings["workers_per_node"]
    mode = settings["mode"]
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    compute: dict[str, Any] | None = None
    t_start = time.monotonic()
    with EmulatedCluster(args.nodes, args.bandwidth, workers_per_node=per,
                         intra_bandwidth=getattr(args, "intra_bandwidth", None), logs=out / "logs") as cluster:
        runner = _Runner(cluster, settings, args)
        if mode == "step":
            _log(f"e2e: compute-only steps ({world} workers at once, then rank 0 alone)")
            compute = _compute(runner)
            _log(f"e2e: compute-only {compute['shared_s']:.3f} s/step shared, "
                 f"{compute['solo_s'] if compute['solo_s'] is None else round(compute['solo_s'], 3)} s alone")
        for i, cfg in enumerate(configs):
            tag = f"c{i:02d}"
            _log(f"e2e: [{i + 1}/{len(configs)}] {cfg.label}")
            if mode == "step":
                job = runner.job(tag, "step", cfg)
                res, results, tbf = runner.run_all(tag, job)
                assert compute is not None
                row = _step_row(cfg, res, results, tbf, compute["shared_s"], rate, world, runner, tag)
                if row["ok"]:
                    _log(f"e2e:     {row['median_step_s']:.3f} s/step, {row['payload_bytes_per_step']:.0f} B payload, "
                         f"ideal {'n/a' if row['ideal_s'] is None else format(row['ideal_s'], '.3f') + ' s'}")
            else:
                job = runner.job(tag, "train", cfg, target=args.train_to, eval_every=args.eval_every,
                                 max_steps=args.max_steps, time_limit=args.time_limit)
                res, results, _ = runner.run_all(tag, job)
                row = _train_row(cfg, res, results, runner, tag)
                if row["ok"]:
                    _log(f"e2e:     reached={row['reached']} time={row['time_to_target_s']} best={row['best_metric']}")
            if not row["ok"]:
                _log(f"e2e:     FAILED: {row['error']}")
            rows.append(row)
        if mode == "step" and compute is not None and configs:
            # again at the end: a shared machine's load can change under a run, and every ideal and bound uses it
            compute["shared_after_s"] = _compute(runner)["shared_s"]
            _log(f"e2e: compute-only again at the end: {compute['shared_after_s']:.3f} s/step shared")
            drift = compute["shared_after_s"] / compute["shared_s"]
            if not 0.9 <= drift <= 1.1:
                notes.append(f"the compute-only step moved from {compute['shared_s']:.3f} s (start) to "
                             f"{compute['shared_after_s']:.3f} s (end): the machine's load changed during the run, "
                             "so ideals and bounds (which use the start) are off by as much")
    ref = rows[0] if rows and rows[0]["kind"] == "ddp" and rows[0]["ok"] else None
    for row in rows:
        if not row["ok"] or ref is None:
            continue
        if mode == "step":
            row["speedup"] = ref["median_step_s"] / row["median_step_s"]
        elif ref["reached"] and row["reached"]:
            row["speedup"] = ref["time_to_target_s"] / row["time_to_target_s"]
    if any(c.single_bucket for c in configs):
        notes.append("PyTorch's powerSGD_hook runs with a single DDP bucket (bucket_cap_mb = model size + 1 MiB): "
                     "with several buckets on gloo its allreduces can be issued in different orders on different ranks. "
                     "gradpress PowerSGD (multi-round) runs on the same single bucket, so both compare on one bucketing.")
    starts = [c for c in configs if c.start > args.warmup]
    if mode == "step" and starts:
        notes.append("warm-up raised to the compression start for: "
                     + ", ".join(f"{c.label} ({c.start} steps)" for c in starts))
    first = next((r for r in rows if r["ok"]), None)
    parameters = (compute or {}).get("parameters") or _parameters(runner, rows, first)
    result: dict[str, Any] = {
        "mode": mode, "command": command_line(args), "target": args.train_to,
        "setup": {"nodes": args.nodes, "workers_per_node": per, "world": world,
                  "intra_bandwidth": getattr(args, "intra_bandwidth", None), "bandwidth": args.bandwidth, "bandwidth_bits": rate,
                  "bandwidth_text": format_rate(rate), "workload": settings["workload"], "params": settings["params"],
                  "hidden": settings["hidden"], "parameters": parameters, "batch_size": settings["batch_size"],
                  "lr": settings["lr"], "optimizer": settings["optimizer"], "threads": settings["threads"],
                  "seed": args.seed, "steps": args.steps, "warmup": args.warmup, "eval_every": args.eval_every,
                  "metric": "accuracy" if mode == "train" else None, "torch": torch.__version__,
                  "python": platform.python_version(), "cpus": settings["cpus"], "machine": platform.machine()},
        "compute": compute, "rows": rows, "notes": notes, "seconds": time.monotonic() - t_start,
    }
    if mode == "train":
        first = next((r0 for r0 in _raw_first(runner, len(configs)) if r0), {})
        result["setup"]["metric"] = first.get("metric", "accuracy")
        result["setup"]["higher_is_better"] = bool(first.get("higher_is_better", True))
    return result


def _raw_first(runner: _Runner, n: int) -> list[dict[str, Any] | None]:
    return [runner.results(f"c{i:02d}", range(1))[0] for i in range(n)]


def _parameters(runner: _Runner, rows: list[dict[str, Any]], first: dict[str, Any] | None) -> int:
    for r0 in _raw_first(runner, len(rows)):
        if r0 and r0.get("parameters"):
            return int(r0["parameters"])
    return 0

