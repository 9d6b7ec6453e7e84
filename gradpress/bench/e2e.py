"""``gradpress bench e2e``: end-to-end training steps on the emulated cluster.

In one invocation and on one :class:`~gradpress.cluster.EmulatedCluster`, it
runs ``python3 -m gradpress.bench.e2e_worker`` in every node once per
configuration: plain PyTorch DDP, PyTorch's ``fp16_compress_hook`` and
``powerSGD_hook`` (``--baselines``), and each gradpress configuration
(``--configs SPEC[@STRATEGY],...``, see :mod:`gradpress.bench.e2e_configs`).
A compute-only run (no communication, world size 1, in every node at once so
that the CPU is shared as in the real runs) gives the ideal time

    ideal = compute-only step + link bytes per step x 8 / bandwidth

where the link bytes are those of the busiest direction of the busiest node
link during the measured steps (Ethernet frames, from the node's interface
counters). ``ideal_payload_s`` uses the payload instead, times the wire
factor of the strategy (allreduce 2(N-1)/N, allgather N-1, ring 1).

``--train-to TARGET`` (default workload ``mnist1d-cnn``) measures instead the
wall-clock time each configuration needs to reach a test metric.

Writes ``DIR/e2e.json`` (every figure), ``DIR/e2e.md`` (table + the exact
command), ``DIR/e2e.png`` (bar chart) and ``DIR/raw/`` (jobs and per-rank
results). Docs: ``docs/e2e.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from gradpress.bench.args import positive_int
from gradpress.bench.e2e_configs import DEFAULT_BASELINES, RunConfig, parse_baselines, parse_configs

__all__ = ["register_bench", "main", "run_e2e", "wire_factor"]

DEFAULT_CONFIGS = "topk:ratio=0.001@allgather,powersgd:rank=4,start_iter=2"


def register_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "e2e", help="end-to-end DDP step time (or time to accuracy) on the emulated cluster, vs PyTorch's hooks",
        description="Run plain DDP, PyTorch's fp16/PowerSGD hooks and gradpress configurations on one emulated "
                    "cluster (needs root); report step time, speed-up, bytes per step and the ideal time.",
    )
    p.add_argument("--nodes", type=positive_int("--nodes"), default=4, help="emulated hosts (default 4)")
    p.add_argument("--bandwidth", default="100mbit", help="link rate per direction, tc syntax (default 100mbit)")
    p.add_argument("--workload", default=None,
                   help="workload (default wide-mlp; mnist1d-cnn with --train-to)")
    p.add_argument("--params", default=None, help="wide-mlp size, e.g. 10M (default 10M for wide-mlp)")
    p.add_argument("--hidden", type=positive_int("--hidden"), default=None, help="width/channels of the workload")
    p.add_argument("--configs", default=DEFAULT_CONFIGS,
                   help="gradpress configurations SPEC[@STRATEGY][+ef|+noef], comma-separated "
                        f"(default {DEFAULT_CONFIGS!r}); strategies: auto (default), allreduce, allgather, ring, ps")
    p.add_argument("--baselines", default=DEFAULT_BASELINES,
                   help=f"PyTorch baselines: ddp, fp16, powersgd:rank=R[,start=I] (default {DEFAULT_BASELINES!r}); "
                        "plain ddp always runs")
    p.add_argument("--steps", type=positive_int("--steps"), default=5, help="measured steps (default 5)")
    p.add_argument("--warmup", type=positive_int("--warmup"), default=2,
                   help="warm-up steps (default 2; at least the configuration's compression start)")
    p.add_argument("--batch-size", dest="batch_size", type=positive_int("--batch-size"), default=None,
                   help="batch size per worker (default: the workload's)")
    p.add_argument("--lr", type=float, default=None, help="learning rate (default: the workload's)")
    p.add_argument("--threads", type=positive_int("--threads"), default=None,
                   help="torch threads per worker (default: max(1, cores // nodes))")
    p.add_argument("--seed", type=int, default=0, help="seed of weights, data and shared randomness (default 0)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds allowed per configuration run (default 600)")
    p.add_argument("--train-to", dest="train_to", type=float, default=None, metavar="TARGET",
                   help="measure wall-clock time to reach this test metric instead of step time")
    p.add_argument("--eval-every", dest="eval_every", type=positive_int("--eval-every"), default=10,
                   help="train-to: evaluate every N steps (default 10)")
    p.add_argument("--max-steps", dest="max_steps", type=positive_int("--max-steps"), default=None,
                   help="train-to: stop after N steps (default: the workload's epochs)")
    p.add_argument("--time-limit", dest="time_limit", type=float, default=None,
                   help="train-to: stop a configuration after this many training seconds")
    p.add_argument("--out", default="bench-results/e2e", metavar="DIR", help="output directory (default bench-results/e2e)")
    p.set_defaults(func=main)


# ------------------------------------------------------------------ validation
def _resolve(args: argparse.Namespace) -> dict[str, Any]:
    """Validate every argument before any cluster is built; return the job
    settings shared by every run."""
    from gradpress import workloads
    from gradpress.cluster import parse_rate

    if args.nodes < 2:
        raise ValueError(f"--nodes got {args.nodes}; allowed: an integer >= 2")
    rate = parse_rate(args.bandwidth, "--bandwidth")
    mode = "train" if args.train_to is not None else "step"
    workload = args.workload or ("mnist1d-cnn" if mode == "train" else "wide-mlp")
    if workload not in workloads.names():
        raise ValueError(f"--workload got {workload!r}; allowed: {', '.join(workloads.names())}")
    params = args.params
    if workload == "wide-mlp":
        from gradpress.workloads.wide import parse_count

        params = params or "10M"
        parse_count(params, "--params")
    elif params is not None:
        raise ValueError(f"--params sets the size of 'wide-mlp' only; --workload is {workload!r}")
    defaults = workloads.defaults(workload)
    lr = defaults["lr"] if args.lr is None else args.lr
    if not (isinstance(lr, (int, float)) and lr > 0 and lr < float("inf")):
        raise ValueError(f"--lr got {args.lr!r}; allowed: a positive finite number")
    if args.timeout <= 0:
        raise ValueError(f"--timeout got {args.timeout!r}; allowed: seconds > 0")
    if args.time_limit is not None and args.time_limit <= 0:
        raise ValueError(f"--time-limit got {args.time_limit!r}; allowed: seconds > 0")
    configs = parse_baselines(args.baselines) + parse_configs(args.configs)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out got {args.out!r}, which is a file; allowed: a directory")
    cpus = os.cpu_count() or 1
    return {
        "mode": mode, "workload": workload, "params": params, "hidden": args.hidden, "rate": rate,
        "batch_size": args.batch_size or defaults["batch_size"], "lr": float(lr),
        "optimizer": defaults["optimizer"], "schedule": defaults["schedule"], "epochs": defaults["epochs"],
        "threads": args.threads or max(1, cpus // args.nodes), "configs": configs, "out": out, "cpus": cpus,
    }


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


def command_line(args: argparse.Namespace) -> str:
    """The exact command, every option spelled out (reproducible from the report)."""
    parts = ["gradpress", "bench", "e2e", "--nodes", str(args.nodes), "--bandwidth", args.bandwidth]
    if args.workload:
        parts += ["--workload", args.workload]
    for flag, value in (("--params", args.params), ("--hidden", args.hidden), ("--batch-size", args.batch_size),
                        ("--lr", args.lr), ("--threads", args.threads)):
        if value is not None:
            parts += [flag, str(value)]
    parts += ["--configs", args.configs, "--baselines", args.baselines, "--seed", str(args.seed)]
    if args.train_to is None:
        parts += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
    else:
        parts += ["--train-to", str(args.train_to), "--eval-every", str(args.eval_every)]
        if args.max_steps is not None:
            parts += ["--max-steps", str(args.max_steps)]
        if args.time_limit is not None:
            parts += ["--time-limit", str(args.time_limit)]
    parts += ["--out", str(args.out)]
    return shlex.join(parts)


# ------------------------------------------------------------------ running
def _log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class _Runner:
    def __init__(self, cluster: Any, settings: dict[str, Any], args: argparse.Namespace) -> None:
        self.cluster = cluster
        self.s = settings
        self.args = args
        self.raw = settings["out"] / "raw"
        self.raw.mkdir(parents=True, exist_ok=True)
        self.env = {"OMP_NUM_THREADS": str(settings["threads"]), "MKL_NUM_THREADS": str(settings["threads"]),
                    "PYTHONUNBUFFERED": "1", "PYTHONPATH": _package_root()
                    + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")}

    def job(self, tag: str, mode: str, config: RunConfig | None, **extra: Any) -> Path:
        s = self.s
        job = {
            "mode": mode, "tag": tag, "result_dir": str(self.raw.resolve()), "workload": s["workload"],
            "params": s["params"], "hidden": s["hidden"], "batch_size": s["batch_size"], "lr": s["lr"],
            "optimizer": s["optimizer"], "schedule": s["schedule"], "epochs": s["epochs"], "seed": self.args.seed,
            "threads": s["threads"], "warmup": self.args.warmup, "steps": self.args.steps,
            "n_batches": min(8, self.args.warmup + self.args.steps + 8),
            "config": config.to_dict() if config is not None else None, **extra,
        }
        path = self.raw / f"{tag}.job.json"
        path.write_text(json.dumps(job, indent=1))
        for old in self.raw.glob(f"{tag}-rank*.json"):
            old.unlink()
        return path

    def argv(self, job: Path) -> list[str]:
        return [sys.executable, "-m", "gradpress.bench.e2e_worker", "--job", str(job.resolve())]

    def results(self, tag: str, ranks: range) -> list[dict[str, Any] | None]:
        out: list[dict[str, Any] | None] = []
        for r in ranks:
            p = self.raw / f"{tag}-rank{r}.json"
            out.append(json.loads(p.read_text()) if p.exists() else None)
        return out

    def run_all(self, tag: str, job: Path) -> tuple[Any, list[dict[str, Any] | None], list[dict[str, int]]]:
        before = [self.cluster.link_stats(i) for i in range(self.cluster.nodes)]
        res = self.cluster.run(self.argv(job), env=self.env, timeout=self.args.timeout, stream_rank0=False)
        after = [self.cluster.link_stats(i) for i in range(self.cluster.nodes)]
        tbf = [{k: after[i][k] - before[i][k] for k in ("tx_bytes", "rx_bytes", "tx_drops", "rx_drops")}
               for i in range(self.cluster.nodes)]
        return res, self.results(tag, range(self.cluster.nodes)), tbf

    def failure(self, res: Any, tag: str) -> str:
        if res.timed_out:
            return f"timed out after {self.args.timeout:.0f} s"
        tail = ""
        for r, code in enumerate(res.codes):
            if code != 0 and res.log(r) is not None:
                lines = [ln for ln in res.log(r).read_text(errors="replace").splitlines() if ln.strip()]
                tail = lines[-1] if lines else ""
                break
        return f"exit code {res.exit_code}" + (f": {tail}" if tail else "") + f" (logs: {res.log_dir})"


def _package_root() -> str:
    return str(Path(__file__).resolve().parents[2])


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


def _step_row(cfg: RunConfig, res: Any, results: list[dict[str, Any] | None], tbf: list[dict[str, int]],
              compute_s: float, rate: int, world: int, runner: _Runner, tag: str) -> dict[str, Any]:
    row: dict[str, Any] = {k: None for k in ("warmup", "steps", "bucket_cap_mb", "buckets", "median_step_s",
                                             "step_s", "speedup", "payload_bytes_per_step", "payload_source",
                                             "link_bytes_per_step", "link_tx_bytes_per_step",
                                             "link_rx_bytes_per_step", "compute_s", "ideal_s",
                                             "measured_over_ideal", "wire_factor", "ideal_payload_s",
                                             "compress_s_per_step", "comm_s_per_step", "register_s", "error")}
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
                                       "payload_bytes_per_step", "payload_source", "compress_s_per_step",
                                       "comm_s_per_step", "register_s")})
    row["link_bytes_per_step"] = max(link) if link else None
    row["link_tx_bytes_per_step"] = [r["link_tx_bytes_per_step"] for r in results if r and "link_tx_bytes_per_step" in r]
    row["link_rx_bytes_per_step"] = [r["link_rx_bytes_per_step"] for r in results if r and "link_rx_bytes_per_step" in r]
    row["compute_s"] = compute_s
    if row["link_bytes_per_step"] is not None:
        row["ideal_s"] = compute_s + row["link_bytes_per_step"] * 8 / rate
        row["measured_over_ideal"] = row["median_step_s"] / row["ideal_s"]
    strategy = row["strategy"]
    if cfg.kind == "gradpress":
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
    rate, world = settings["rate"], args.nodes
    mode = settings["mode"]
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    compute: dict[str, Any] | None = None
    t_start = time.monotonic()
    with EmulatedCluster(world, args.bandwidth, logs=out / "logs") as cluster:
        runner = _Runner(cluster, settings, args)
        if mode == "step":
            _log(f"e2e: compute-only steps ({world} nodes at once, then node 0 alone)")
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
                         f"ideal {row['ideal_s']:.3f} s")
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
                     "with several buckets on gloo its allreduces can be issued in different orders on different ranks.")
    starts = [c for c in configs if c.start > args.warmup]
    if mode == "step" and starts:
        notes.append("warm-up raised to the compression start for: "
                     + ", ".join(f"{c.label} ({c.start} steps)" for c in starts))
    first = next((r for r in rows if r["ok"]), None)
    parameters = (compute or {}).get("parameters") or _parameters(runner, rows, first)
    result: dict[str, Any] = {
        "mode": mode, "command": command_line(args), "target": args.train_to,
        "setup": {"nodes": world, "bandwidth": args.bandwidth, "bandwidth_bits": rate,
                  "bandwidth_text": format_rate(rate), "workload": settings["workload"], "params": settings["params"],
                  "hidden": settings["hidden"], "parameters": parameters, "batch_size": settings["batch_size"],
                  "lr": settings["lr"], "optimizer": settings["optimizer"], "threads": settings["threads"],
                  "seed": args.seed, "steps": args.steps, "warmup": args.warmup, "eval_every": args.eval_every,
                  "metric": "accuracy" if mode == "train" else None, "torch": torch.__version__,
                  "python": platform.python_version(), "cpus": settings["cpus"], "machine": platform.machine()},
        "compute": compute, "rows": rows, "notes": notes, "seconds": time.monotonic() - t_start,
    }
    if mode == "train":
        metric = next((r0.get("metric") for r0 in _raw_first(runner, len(configs)) if r0), "accuracy")
        result["setup"]["metric"] = metric
    return result


def _raw_first(runner: _Runner, n: int) -> list[dict[str, Any] | None]:
    return [runner.results(f"c{i:02d}", range(1))[0] for i in range(n)]


def _parameters(runner: _Runner, rows: list[dict[str, Any]], first: dict[str, Any] | None) -> int:
    for r0 in _raw_first(runner, len(rows)):
        if r0 and r0.get("parameters"):
            return int(r0["parameters"])
    return 0


def write_outputs(result: dict[str, Any], out: Path) -> list[Path]:
    from gradpress.bench.e2e_report import markdown, plot

    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "e2e.json", out / "e2e.md", out / "e2e.png"]
    paths[0].write_text(json.dumps(result, indent=2) + "\n")
    paths[1].write_text(markdown(result))
    plot(result, paths[2])
    return paths


def main(args: argparse.Namespace) -> int:
    _resolve(args)  # every bad argument fails here, before a cluster is built
    try:
        result = run_e2e(args)
    except RuntimeError as exc:
        print(f"gradpress bench e2e: error: {exc}", file=sys.stderr)
        return 1
    paths = write_outputs(result, Path(args.out))
    print(paths[1].read_text())
    print("written: " + ", ".join(str(p) for p in paths))
    return 0 if all(r["ok"] for r in result["rows"]) else 1
