"""Output of ``gradpress bench compressors``: the text table printed to
stdout and the JSON-safe form of the result (infinities as strings).
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["format_table"]


def _fmt(v: Any, spec: str = ".2f") -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and math.isinf(v):
        return "inf"
    return format(v, spec)


def format_table(result: dict[str, Any]) -> str:
    head = (f"{'compressor':<28} {'numel':>10} {'enc GB/s':>9} {'dec GB/s':>9} {'into GB/s':>9} {'%roof':>6} {'ratio':>8} "
            f"{'wire bytes':>11} {'rel err':>8} {'dens q':>7} {'vs topk':>8} {'peak/in':>8}")
    lines = [head, "-" * len(head)]
    last = None
    for r in result["rows"]:
        if last is not None and r["numel"] != last:
            lines.append("")
        last = r["numel"]
        lines.append(
            f"{r['compressor'][:28]:<28} {r['numel']:>10,} {_fmt(r['encode_gbps']):>9} {_fmt(r['decode_gbps']):>9} "
            f"{_fmt(r.get('decode_into_gbps')):>9} {_fmt(100 * r['encode_roofline_fraction'], '.1f'):>6} {_fmt(r['ratio'], '.1f'):>8} "
            f"{r['wire_bytes']:>11,} {_fmt(r['rel_error'], '.4f'):>8} {_fmt(r['density_quality'], '.3f'):>7} "
            f"{_fmt(r['speedup_vs_topk'], '.2f'):>8} {_fmt(r['peak_temp_ratio'], '.2f'):>8}"
        )
    lines.append("")
    pairs = result.get("rooflines", {})
    for size, roof in result["roofline"].items():
        pair = pairs.get(size)
        if pair is None:
            lines.append(f"copy roofline at {int(size):,} elements: {roof:.2f} GB/s (bytes read + written)")
            continue
        lines.append(f"copy roofline at {int(size):,} elements (bytes read + written, best of several runs): "
                     f"1 thread {pair['1']:.2f} GB/s, all threads {pair['all']:.2f} GB/s; "
                     f"%roof uses {roof:.2f} GB/s, measured at this run's {pair['run_threads']} thread(s)"
                     + (f" (the better of {pair['run_before']:.2f} before the rows and {pair['run_after']:.2f} after)"
                        if "run_after" in pair else ""))
    env = result.get("env", {})
    if env.get("transparent_hugepage") is not None and any(r["numel"] * 4 > 32 * 2**20 for r in result["rows"]):
        lines.append(f"dec: decode returns a fresh tensor; above ~32 MB its pages are faulted in on every call; into: "
                     f"decode_into a reused buffer, as aggregation decodes "
                     f"(transparent huge pages: {env['transparent_hugepage'] or 'unknown'}; "
                     f"THP_MEM_ALLOC_ENABLE={env.get('thp_alloc') or 'unset'})")
    for s in result["skipped"]:
        lines.append(f"skipped {s['compressor']} at {s['numel']:,}: {s['reason']}")
    missed = [t for t in result["targets"] if not t["met"]]
    lines.append(f"targets: {len(result['targets']) - len(missed)} of {len(result['targets'])} met")
    for t in missed:
        lines.append(f"  MISSED {t['target']}: {t['compressor']} at {t['numel']:,}: "
                     f"{t['value']:.3g} (needs {t['threshold']:g})")
    return "\n".join(lines)


def _json_safe(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_json_safe(v) for v in obj]
    return obj
