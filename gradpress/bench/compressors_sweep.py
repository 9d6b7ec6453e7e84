"""The sweep of ``gradpress bench compressors``: every compressor at every
size, the reference rows at each selection density, the speed-ups over
``torch.topk``, the environment, and the check of the issue's targets on
every measured row.
"""

from __future__ import annotations

import math
import os
import platform
import time
from collections.abc import Callable
from typing import Any

import torch

from gradpress.bench.compressors_rows import _Skip, bench_method, bench_reference, variant_applies
from gradpress.bench.data import make_input
from gradpress.bench.measure import sync
from gradpress.bench.specs import QUANTIZERS, THRESHOLD_SELECTORS

__all__ = ["best_copy_gbps", "run_benchmark", "evaluate_targets"]

QUANTIZER_ROOFLINE_TARGET = 0.25
SELECTOR_SPEEDUP_TARGET = 3.0
PEAK_TEMP_TARGET = 3.0


def best_copy_gbps(x: torch.Tensor, runs: int, threads: int | None = None) -> float:
    """Copy roofline, the best of ``runs`` timed ``dst.copy_(x)`` into a
    preallocated tensor (bytes read + written / seconds), with ``threads``
    CPU threads (None: the current setting). The best, not the median: the
    roofline is what the memory system can do, and on a shared machine
    every disturbance only slows a run down."""
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        dst = torch.empty_like(x)
        dst.copy_(x)  # first touch of the pages, untimed
        best = math.inf
        for _ in range(runs):
            sync(x.device)
            start = time.perf_counter()
            dst.copy_(x)
            sync(x.device)
            best = min(best, time.perf_counter() - start)
        return 2 * x.numel() * x.element_size() / best / 1e9
    finally:
        torch.set_num_threads(before)


def run_benchmark(specs: list[str], sizes: list[int], device: str = "cpu", data: str = "gaussian",
                  repeats: int = 5, warmup: int = 1, seed: int = 0,
                  log: Callable[[str], None] | None = None, variants: tuple[str, ...] = ("default",),
                  all_threads: int | None = None) -> dict[str, Any]:
    """Measure every spec (in every applicable variant) at every size.
    Returns ``{"rows", "skipped", "roofline", "rooflines", "targets", "env"}``.

    Two copy rooflines per size, each the best of ``max(10, 2 * repeats)``
    runs: one thread, and ``all_threads`` (default: the current setting);
    ``roofline`` (and every row's fraction) is the one at the thread count
    the rows ran with, measured before the size's rows and again after
    them, the better of the two (the memory system's speed drifts on a
    shared machine: a fraction against the slower one would flatter the
    rows)."""
    log = log or (lambda s: None)
    dev = torch.device(device)
    rows: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    roofline: dict[int, float] = {}
    rooflines: dict[str, dict[str, float]] = {}
    threads = torch.get_num_threads()
    for numel in sizes:
        x = make_input(data, numel, dev, seed)
        runs = max(10, 2 * repeats)
        pair = {"1": best_copy_gbps(x, runs, 1), "all": best_copy_gbps(x, runs, all_threads)}
        roof = best_copy_gbps(x, runs)
        roofline[numel] = roof
        rooflines[str(numel)] = {**pair, "run": roof, "run_threads": threads}
        log(f"size {numel:,}: copy roofline {roof:.2f} GB/s at {threads} threads "
            f"(1 thread {pair['1']:.2f}, all {pair['all']:.2f}; best of {runs}, read + write)")
        size_rows = []
        for spec, variant in [(s, v) for s in specs for v in variants if variant_applies(s, v)]:
            try:
                row = bench_method(spec, x, data, roof, repeats, warmup, variant)
            except _Skip as exc:
                skipped.append({"compressor": spec, "numel": numel, "reason": str(exc), "variant": variant})
                log(f"  skip {spec} [{variant}]: {exc}")
                continue
            except Exception as exc:  # noqa: BLE001 - a broken method must not stop the others
                skipped.append({"compressor": spec, "numel": numel, "reason": f"{type(exc).__name__}: {exc}",
                                "variant": variant})
                log(f"  skip {spec} [{variant}]: {type(exc).__name__}: {exc}")
                continue
            size_rows.append(row)
            log(f"  {row['compressor']}: encode {row['encode_gbps']:.2f} GB/s, ratio {row['ratio']:.1f}")
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
        after = best_copy_gbps(x, runs)
        if after > roof:  # the rows' fractions against the better roofline of the two
            roofline[numel] = after
            for r in size_rows:
                r["roofline_gbps"] = after
                r["encode_roofline_fraction"] = r["encode_gbps"] / after
        rooflines[str(numel)].update(run=roofline[numel], run_before=roof, run_after=after)
        log(f"size {numel:,}: copy roofline after the rows {after:.2f} GB/s (before {roof:.2f})")
        rows.extend(size_rows)
        del x
    env = {
        "torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
        "threads": torch.get_num_threads(),
        "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu",
        "thp_alloc": os.environ.get("THP_MEM_ALLOC_ENABLE", ""),
        "transparent_hugepage": transparent_hugepage(),
    }
    return {"rows": rows, "skipped": skipped, "roofline": {str(k): v for k, v in roofline.items()},
            "rooflines": rooflines, "targets": evaluate_targets(rows), "env": env}


def transparent_hugepage() -> str:
    """The kernel's transparent huge page mode (``always``, ``madvise``,
    ``never``), or "" where it cannot be read (not Linux). Decode times at
    large sizes depend on it: each decode returns a fresh tensor, and above
    glibc's mmap threshold (at most 32 MB) its pages are faulted in anew
    every call (docs/bench.md, "Decode pays for a fresh 100 MB output")."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            text = f.read()
    except OSError:
        return ""
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else text.strip()


def evaluate_targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's targets, checked on every measured row they apply to."""
    out = []
    hand = {(r["compressor"].rsplit(" [", 1)[0], r["numel"]): r for r in rows
            if r["kind"] == "method" and r.get("variant") == "hand"}
    for r in rows:
        if r["kind"] != "method":
            continue
        base = {"compressor": r["compressor"], "numel": r["numel"]}
        variant = r.get("variant", "default")
        ref = hand.get((r["compressor"].rsplit(" [", 1)[0], r["numel"]))
        if variant in ("default", "compiled") and ref is not None:
            out.append({**base, "target": "kit encode not slower than the hand-written version",
                        "value": r["encode_gbps"] / ref["encode_gbps"], "threshold": 1.0,
                        "met": r["encode_gbps"] >= ref["encode_gbps"]})
        if variant in ("hand", "eager"):
            continue  # the references; the targets hold for what the registered name runs
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
