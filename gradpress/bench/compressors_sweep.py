"""The sweep of ``gradpress bench compressors``: every compressor at every
size, the reference rows at each selection density, the speed-ups over
``torch.topk``, the environment, and the check of the issue's targets on
every measured row.
"""

from __future__ import annotations

import math
import platform
from collections.abc import Callable
from typing import Any

import torch

from gradpress.bench.compressors_rows import _Skip, bench_method, bench_reference
from gradpress.bench.data import make_input
from gradpress.bench.measure import copy_roofline
from gradpress.bench.specs import QUANTIZERS, THRESHOLD_SELECTORS

__all__ = ["run_benchmark", "evaluate_targets"]

QUANTIZER_ROOFLINE_TARGET = 0.25
SELECTOR_SPEEDUP_TARGET = 3.0
PEAK_TEMP_TARGET = 3.0


def run_benchmark(specs: list[str], sizes: list[int], device: str = "cpu", data: str = "gaussian",
                  repeats: int = 5, warmup: int = 1, seed: int = 0,
                  log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Measure every spec at every size. Returns ``{"rows", "skipped",
    "roofline", "targets", "env"}``."""
    log = log or (lambda s: None)
    dev = torch.device(device)
    rows: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    roofline: dict[int, float] = {}
    for numel in sizes:
        x = make_input(data, numel, dev, seed)
        roof, _ = copy_roofline(x, max(repeats, 3), warmup)
        roofline[numel] = roof
        log(f"size {numel:,}: copy roofline {roof:.2f} GB/s (read + write)")
        size_rows = []
        for spec in specs:
            try:
                row = bench_method(spec, x, data, roof, repeats, warmup)
            except _Skip as exc:
                skipped.append({"compressor": spec, "numel": numel, "reason": str(exc)})
                log(f"  skip {spec}: {exc}")
                continue
            except Exception as exc:  # noqa: BLE001 - a broken method must not stop the others
                skipped.append({"compressor": spec, "numel": numel, "reason": f"{type(exc).__name__}: {exc}"})
                log(f"  skip {spec}: {type(exc).__name__}: {exc}")
                continue
            size_rows.append(row)
            log(f"  {spec}: encode {row['encode_gbps']:.2f} GB/s, ratio {row['ratio']:.1f}")
        densities = sorted({r["density_target"] for r in size_rows if r["density_target"] is not None})
        refs = {}
        for density in densities:
            for kind in ("topk", "kthvalue"):
                ref = bench_reference(kind, density, x, data, roof, repeats, warmup)
                refs[(kind, density)] = ref
                size_rows.append(ref)
        for r in size_rows:
            ref = refs.get(("topk", r["density_target"]))
            if r["kind"] == "method" and ref is not None:
                r["speedup_vs_topk"] = ref["encode_s"] / r["encode_s"] if r["encode_s"] > 0 else math.inf
        rows.extend(size_rows)
        del x
    env = {
        "torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
        "threads": torch.get_num_threads(),
        "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu",
    }
    return {"rows": rows, "skipped": skipped, "roofline": {str(k): v for k, v in roofline.items()},
            "targets": evaluate_targets(rows), "env": env}


def evaluate_targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's targets, checked on every measured row they apply to."""
    out = []
    for r in rows:
        if r["kind"] != "method":
            continue
        base = {"compressor": r["compressor"], "numel": r["numel"]}
        if r["name"] in QUANTIZERS:
            out.append({**base, "target": "quantizer encode >= 25% of copy roofline",
                        "value": r["encode_roofline_fraction"], "threshold": QUANTIZER_ROOFLINE_TARGET,
                        "met": r["encode_roofline_fraction"] >= QUANTIZER_ROOFLINE_TARGET})
        if r["name"] in THRESHOLD_SELECTORS and r["speedup_vs_topk"] is not None:
            out.append({**base, "target": "threshold selection >= 3x faster than exact top-k",
                        "value": r["speedup_vs_topk"], "threshold": SELECTOR_SPEEDUP_TARGET,
                        "met": r["speedup_vs_topk"] >= SELECTOR_SPEEDUP_TARGET})
        out.append({**base, "target": "peak temporaries <= 3x input",
                    "value": r["peak_temp_ratio"], "threshold": PEAK_TEMP_TARGET,
                    "met": r["peak_temp_ratio"] <= PEAK_TEMP_TARGET})
    return out
