"""``gradpress bench compressors``: encode/decode micro-benchmark of every
compressor.

For each compressor and input size it measures, on one tensor of fp32 data:

* encode and decode throughput, GB/s of fp32 input (``4 * numel`` bytes over
  the median time of ``--repeats`` runs after warm-up; CUDA synchronized);
* wire bytes (``packet.nbytes``, the declared exact wire size) and the
  compression ratio ``4 * numel / wire_bytes``;
* relative error ``||D(C(x)) - x|| / ||x||``;
* for selection methods (a ``ratio``/``density`` parameter): achieved density
  (non-zeros of the decoded tensor / numel) over target density, and the
  speed-up over exact ``torch.topk`` at the same density;
* peak extra memory of one encode + decode (packet and output included) over
  the input bytes (see :mod:`gradpress.bench.measure` for how);
* the copy roofline of the same run, and encode throughput as a fraction of it.

``torch.topk`` and ``torch.kthvalue`` on ``|x|`` at each selection density are
reference rows. Methods with several exchange rounds (PowerSGD) run their
``begin``/``advance``/``finish`` protocol as a world of one (the allreduce of
one rank is the identity); their wire bytes are the sum over rounds. Methods
that reject 1-D input run on a ``(rows, cols <= 1024)`` matrix view.

Invariant: every figure is measured in this run; nothing is estimated.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import platform
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from gradpress.bench.args import positive_int
from gradpress.bench.data import DATA_KINDS, make_input, matrix_shape
from gradpress.bench.measure import copy_roofline, peak_extra_bytes, time_call
from gradpress.bench.specs import (
    QUANTIZERS,
    THRESHOLD_SELECTORS,
    build,
    density_of,
    parse_compressors,
    parse_sizes,
)
from gradpress.compress.base import Compressor, Context, Packet

__all__ = ["register_bench", "run_benchmark", "evaluate_targets", "ROW_FIELDS"]

#: fields every JSON row carries
ROW_FIELDS = (
    "compressor", "name", "kind", "numel", "shape", "device", "data",
    "encode_s", "decode_s", "encode_gbps", "decode_gbps", "wire_bytes", "ratio", "rel_error",
    "roofline_gbps", "encode_roofline_fraction",
    "density_target", "density_achieved", "density_quality", "reported_quality", "speedup_vs_topk",
    "peak_temp_bytes", "peak_temp_ratio", "note",
)

QUANTIZER_ROOFLINE_TARGET = 0.25
SELECTOR_SPEEDUP_TARGET = 3.0
PEAK_TEMP_TARGET = 3.0


class _Skip(Exception):
    """This method cannot run on this input; the message says why."""


class _Runner:
    """Uniform encode/decode over one-round compressors and multi-round
    protocols. A multi-round method with its own standalone ``encode``/
    ``decode`` (world of one) is timed through them, so that decode does the
    reconstruction; otherwise its ``begin``/``advance``/``finish`` protocol
    runs as a world of one."""

    def __init__(self, comp: Compressor, x: torch.Tensor) -> None:
        self.comp = comp
        self.x = x
        self.protocol = comp.rounds > 1 and type(comp).encode is Compressor.encode
        self._steps = itertools.count(1)

    def _ctx(self) -> Context:
        # the default context of a fresh compressor's first calls (key "", step 1, 2, ...)
        return Context(step=next(self._steps), seed=self.comp.seed)

    def encode(self) -> Any:
        c = self.comp
        if not self.protocol:
            return c.encode(self.x, self._ctx())
        ctx = self._ctx()
        state, out = c.begin(self.x, ctx)
        if out is None:
            raise _Skip("protocol declined this input (it would travel dense)")
        sent = [out.numel() * out.element_size()]
        while True:
            out = c.advance(state, out, ctx)  # allreduce-sum over one rank is the identity
            if out is None:
                break
            sent.append(out.numel() * out.element_size())
        return state, sum(sent)

    def decode(self, encoded: Any) -> torch.Tensor:
        if not self.protocol:
            return self.comp.decode(encoded)
        return self.comp.finish(encoded[0])

    def wire_bytes(self, encoded: Any) -> int:
        return encoded.nbytes if isinstance(encoded, Packet) else int(encoded[1])


def _rel_error(out: torch.Tensor, x: torch.Tensor) -> float:
    xd = x.double()
    denom = torch.linalg.vector_norm(xd)
    return float(torch.linalg.vector_norm(out.reshape(x.shape).double() - xd) / denom) if denom > 0 else 0.0


def _prepare(spec: str, x: torch.Tensor) -> tuple[_Runner, Any, torch.Tensor, str]:
    """``(runner, first encoded, first decoded, note)`` on ``x`` or, when the
    method rejects 1-D input (or, for a multi-round method, its protocol
    declines it), on its matrix view; raises _Skip with every reason when
    none runs. The first call is a fresh instance's ``encode(x)`` with the
    default context (``Context(step=1)``)."""
    errors = []
    candidates = [x]
    rows, cols = matrix_shape(x.numel())
    if rows > 1 and cols > 1:
        candidates.append(x.view(rows, cols))
    for cand in candidates:
        try:
            comp, note = build(spec)
            if comp.rounds > 1:
                _, out = comp.begin(cand, Context(step=1, seed=comp.seed))
                if out is None:
                    raise _Skip("the multi-round protocol declines this shape (it would travel dense)")
                comp, note = build(spec)  # fresh again: begin may have touched state
            runner = _Runner(comp, cand)
            encoded = runner.encode()
            out = runner.decode(encoded)
            if tuple(out.shape) != tuple(cand.shape) or out.dtype != cand.dtype:
                raise _Skip(f"decode returned {tuple(out.shape)} {out.dtype} for {tuple(cand.shape)} {cand.dtype}")
            return runner, encoded, out, note
        except Exception as exc:  # noqa: BLE001 - any failure means "cannot run on this input"
            errors.append(f"shape {tuple(cand.shape)}: {exc if isinstance(exc, _Skip) else repr(exc)}")
    raise _Skip("; ".join(errors))


def _base_row(spec: str, name: str, kind: str, x: torch.Tensor, data: str, roof: float) -> dict[str, Any]:
    row: dict[str, Any] = dict.fromkeys(ROW_FIELDS)
    row.update(compressor=spec, name=name, kind=kind, numel=x.numel(), shape=list(x.shape),
               device=str(x.device), data=data, roofline_gbps=roof, note="")
    return row


def _finish_row(row: dict[str, Any], nbytes_in: int, t_enc: float, t_dec: float | None, wire: int) -> None:
    row["encode_s"] = t_enc
    row["decode_s"] = t_dec
    row["encode_gbps"] = nbytes_in / t_enc / 1e9 if t_enc > 0 else math.inf
    row["decode_gbps"] = (nbytes_in / t_dec / 1e9 if t_dec > 0 else math.inf) if t_dec is not None else None
    row["wire_bytes"] = int(wire)
    row["ratio"] = nbytes_in / wire if wire > 0 else math.inf
    row["encode_roofline_fraction"] = row["encode_gbps"] / row["roofline_gbps"]


def bench_method(spec: str, x: torch.Tensor, data: str, roof: float, repeats: int, warmup: int) -> dict[str, Any]:
    """One row for compressor ``spec`` on ``x``; raises _Skip."""
    runner, first, out, note = _prepare(spec, x)
    comp = runner.comp
    row = _base_row(spec, comp.name, "method", runner.x, data, roof)
    row["note"] = note
    # error, density and wire size of the fresh instance's first call: for
    # stateful methods (momentum, residual-like accumulators) later calls
    # compress accumulated state, not x
    wire = runner.wire_bytes(first)
    row["rel_error"] = _rel_error(out, runner.x)
    target = density_of(comp)
    if target is not None:
        achieved = float(torch.count_nonzero(out)) / out.numel()
        row.update(density_target=target, density_achieved=achieved, density_quality=achieved / target)
    del first, out
    device = x.device
    nbytes_in = x.numel() * 4
    t_enc, encoded = time_call(runner.encode, device, repeats, warmup)
    t_dec, out = time_call(functools.partial(runner.decode, encoded), device, repeats, warmup)
    _finish_row(row, nbytes_in, t_enc, t_dec, wire)
    quality = getattr(comp, "quality", None)
    if isinstance(quality, (int, float)) and not isinstance(quality, bool):
        row["reported_quality"] = float(quality)
    del encoded, out

    def enc_dec() -> Any:
        enc = runner.encode()
        return enc, runner.decode(enc)

    peak = peak_extra_bytes(enc_dec, device)
    row.update(peak_temp_bytes=peak, peak_temp_ratio=peak / nbytes_in)
    return row


def bench_reference(kind: str, density: float, x: torch.Tensor, data: str, roof: float,
                    repeats: int, warmup: int) -> dict[str, Any]:
    """``torch.topk`` or ``torch.kthvalue`` selection of ``|x|`` at ``density``
    (wire size counted as fp32 values + int32 indices, as top-k sends)."""
    n = x.numel()
    k = min(n, max(1, math.ceil(density * n)))
    if kind == "topk":
        def fn() -> Any:
            return torch.topk(x.abs(), k, sorted=False)
    else:
        def fn() -> Any:
            return torch.kthvalue(x.abs(), n - k + 1)
    t, _ = time_call(fn, x.device, repeats, warmup)
    row = _base_row(f"ref:{kind}@{density:g}", kind, "reference", x, data, roof)
    _finish_row(row, n * 4, t, None, 8 * k)
    _, idx = torch.topk(x.abs(), k, sorted=False)
    kept = torch.zeros_like(x)
    kept[idx] = x[idx]
    row["rel_error"] = _rel_error(kept, x)
    row.update(density_target=density, density_achieved=k / n, density_quality=(k / n) / density)
    peak = peak_extra_bytes(fn, x.device)
    row.update(peak_temp_bytes=peak, peak_temp_ratio=peak / (n * 4))
    return row


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


# ----- presentation -------------------------------------------------------------


def _fmt(v: Any, spec: str = ".2f") -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and math.isinf(v):
        return "inf"
    return format(v, spec)


def format_table(result: dict[str, Any]) -> str:
    head = (f"{'compressor':<28} {'numel':>10} {'enc GB/s':>9} {'dec GB/s':>9} {'%roof':>6} {'ratio':>8} "
            f"{'wire bytes':>11} {'rel err':>8} {'dens q':>7} {'vs topk':>8} {'peak/in':>8}")
    lines = [head, "-" * len(head)]
    last = None
    for r in result["rows"]:
        if last is not None and r["numel"] != last:
            lines.append("")
        last = r["numel"]
        lines.append(
            f"{r['compressor'][:28]:<28} {r['numel']:>10,} {_fmt(r['encode_gbps']):>9} {_fmt(r['decode_gbps']):>9} "
            f"{_fmt(100 * r['encode_roofline_fraction'], '.1f'):>6} {_fmt(r['ratio'], '.1f'):>8} "
            f"{r['wire_bytes']:>11,} {_fmt(r['rel_error'], '.4f'):>8} {_fmt(r['density_quality'], '.3f'):>7} "
            f"{_fmt(r['speedup_vs_topk'], '.2f'):>8} {_fmt(r['peak_temp_ratio'], '.2f'):>8}"
        )
    lines.append("")
    for size, roof in result["roofline"].items():
        lines.append(f"copy roofline at {int(size):,} elements: {roof:.2f} GB/s (bytes read + written)")
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


# ----- command line -------------------------------------------------------------


def register_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "compressors", help="encode/decode throughput, ratio, error and memory of every compressor",
        description="Micro-benchmark of compressors: encode/decode GB/s, wire bytes, ratio, relative error, "
                    "density quality, peak temporary memory, against a copy roofline measured in the same run.",
    )
    p.add_argument("--compressors", default="all",
                   help="'all' (every registered name with its bench spec) or comma-separated specs, "
                        "e.g. 'fp16,topk:ratio=0.001,qsgd:levels=4' (default: all)")
    p.add_argument("--sizes", default="1M,25M", help="element counts, suffix K/M/G = 1e3/1e6/1e9 (default: 1M,25M)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="device (default: cpu)")
    p.add_argument("--data", default="gaussian", choices=DATA_KINDS,
                   help="input values: gaussian, laplace, or captured MLP gradients (default: gaussian)")
    p.add_argument("--repeats", type=positive_int("--repeats"), default=5,
                   help="timed runs per measurement; the median is reported (default: 5)")
    p.add_argument("--warmup", type=positive_int("--warmup"), default=1, help="untimed runs first (default: 1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the input data (default: 0)")
    p.add_argument("--threads", type=positive_int("--threads"), default=None,
                   help="CPU threads for torch (default: torch's choice); 1 gives stable figures on a shared machine")
    p.add_argument("--json", metavar="FILE", default=None, help="write rows, skips, targets as JSON to FILE")
    p.add_argument("--out", metavar="DIR", default="bench-results",
                   help="directory for bench.png (default: bench-results)")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    specs = parse_compressors(args.compressors)
    sizes = parse_sizes(args.sizes)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device got 'cuda' but CUDA is not available on this machine; allowed here: cpu")
    if args.json:
        json_path = Path(args.json)
        if json_path.is_dir():
            raise ValueError(f"--json got {args.json!r}, which is a directory; allowed: a file path")
    out_dir = Path(args.out)
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"--out got {args.out!r}, which is a file; allowed: a directory")

    if args.threads is not None:
        torch.set_num_threads(args.threads)

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    result = run_benchmark(specs, sizes, args.device, args.data, args.repeats, args.warmup, args.seed, log)
    result["command"] = "gradpress bench compressors " + " ".join(
        f"--{k} {v}" for k, v in (("compressors", args.compressors), ("sizes", args.sizes),
                                  ("device", args.device), ("data", args.data), ("repeats", args.repeats),
                                  ("threads", args.threads)) if v is not None)
    print(format_table(result))
    from gradpress.bench.plot import plot_throughput

    png = plot_throughput(result["rows"], out_dir / "bench.png",
                          f"encode throughput vs ratio, {max(sizes):,} elements, {args.data}, {args.device}")
    if png is not None:
        print(f"plot: {png}")
    if args.json:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(_json_safe(result), indent=2))
        print(f"json: {json_path}")
    return 0
