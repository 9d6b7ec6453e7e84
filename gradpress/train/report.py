"""What a training run writes besides its checkpoint: ``metrics.jsonl`` (one
line per logging step) and ``summary.json``."""

from __future__ import annotations

import json
import math
import os
import statistics
from pathlib import Path
from typing import Any

from gradpress.compress import plugins
from gradpress.train.config import TrainConfig, settings

__all__ = ["METRICS", "SUMMARY", "human_bytes", "finite_or_null", "dumps", "MetricsLog", "summarize", "write_summary"]

METRICS = "metrics.jsonl"
SUMMARY = "summary.json"


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1000
    return f"{n:.1f}GB"


def finite_or_null(obj: Any) -> Any:
    """``obj`` with every NaN/Inf float (also inside dicts and lists) replaced
    by None: the files are strict JSON (``null``), which every parser reads."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_or_null(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_or_null(v) for v in obj]
    return obj


def dumps(obj: Any, **kw: Any) -> str:
    """Strict JSON: non-finite numbers become ``null`` (never ``NaN``)."""
    return json.dumps(finite_or_null(obj), allow_nan=False, **kw)


def _read_metrics(path: Path, upto_step: int) -> list[dict[str, Any]]:
    """The complete lines of ``path`` up to step ``upto_step``. A line that
    is not a JSON object with a ``step`` is skipped: only the last line can
    be one, torn by a run that died while writing it (after its last
    checkpoint, so it is redone anyway)."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= upto_step:
            rows.append(row)
    return rows


class MetricsLog:
    """``out/metrics.jsonl``, written by rank 0 only. On resume the lines up to
    the checkpoint's step are kept and the rest dropped (they are redone)."""

    def __init__(self, out: Path, rank: int, resumed_at: int | None) -> None:
        self.path = out / METRICS
        self.active = rank == 0
        if self.active:
            out.mkdir(parents=True, exist_ok=True)
            rows = _read_metrics(self.path, resumed_at) if resumed_at is not None else []
            with open(self.path, "w") as f:
                f.writelines(dumps(r) + "\n" for r in rows)

    def write(self, row: dict[str, Any]) -> None:
        if self.active:
            with open(self.path, "a") as f:
                f.write(dumps(row) + "\n")


def summarize(*, cfg: Any, described: dict[str, Any], stats: dict[str, Any], world: int, steps: int,
              steps_per_epoch: int, n_params: int, wl: Any, metric_value: float | None,
              history: list[dict[str, Any]], step_times: list[float], train_s: float, out: Path,
              diverged_at_step: int | None = None, reshards: list[dict[str, int]] | None = None) -> dict[str, Any]:
    """The summary of a run (every rank computes the same one).
    ``diverged_at_step``: the first step whose loss was NaN/Inf on some rank.
    ``reshards``: the run's changes of world size, ``{"from", "to", "step", "epoch"}`` (``--reshard``)."""
    steps_done = max(stats["steps"], 1)
    bytes_per_step = stats["bytes_sent"] / steps_done
    dense_per_step = stats["dense_bytes"] / steps_done
    summary: dict[str, Any] = {
        "workload": cfg.workload,
        **described,
        "world_size": world,
        "device": cfg.device,
        "steps": steps,
        "epochs": cfg.epochs,
        "steps_per_epoch": steps_per_epoch,
        "batch_size": cfg.batch_size,
        "lr": cfg.lr,
        "optimizer": cfg.optimizer,
        "schedule": cfg.schedule,
        "seed": cfg.seed,
        "split": getattr(cfg, "split", "iid"),
        "parameters": n_params,
        "metric": wl.metric,
        "higher_is_better": wl.higher_is_better,
        "final_metric": metric_value,
        "final_loss": history[-1]["loss"] if history else None,
        "bytes_per_step": bytes_per_step,
        "dense_bytes_per_step": dense_per_step,
        "host_bytes_per_step": stats.get("host_bytes", 0) / steps_done,
        "compression_ratio": dense_per_step / bytes_per_step if bytes_per_step else 1.0,
        "bytes_total": stats["bytes_sent"],
        "median_step_s": statistics.median(step_times) if step_times else None,
        "compressed_tensors": stats.get("compressed_tensors"),
        "nothing_compressed": bool(stats.get("nothing_compressed")),
        "dense_tensors": stats.get("dense_tensors"),
        "compress_s": stats["compress_s"],
        "comm_s": stats["comm_s"],
        "train_s": train_s,
        "diverged_at_step": diverged_at_step,
        "reshards": [dict(r) for r in reshards or []],
        "allow_divergence": bool(getattr(cfg, "allow_divergence", False)),
        "settings": settings(cfg) if isinstance(cfg, TrainConfig) else None,  # what compare --resume checks
        "plugins": plugins.record(),  # the plugin modules this run loaded (--plugin / GRADPRESS_PLUGINS)
        "history": history,
        "out": str(out),
    }
    if wl.classifier:
        summary["test_accuracy"] = metric_value
    return summary


def write_summary(out: Path, summary: dict[str, Any]) -> None:
    tmp = out / (SUMMARY + ".tmp")
    tmp.write_text(dumps(summary, indent=2) + "\n")
    os.replace(tmp, out / SUMMARY)
