"""``gradpress bench estimators``: do the threshold estimators keep the
density asked of them? (issue 14, part 3; the SIDCo paper's quality metric)

For every method spec, data kind, size and target density: feed one
compressor instance (state kept across calls, one tensor key) ``--steps``
successive draws, count what each call kept from the *decoded* tensor (its
nonzeros; the compressor's own bookkeeping is not used), and report the
mean, min and max of achieved/target density, whether they meet the issue's
bounds (mean within [0.8, 1.25], every call within [0.5, 2.0]), the
counting passes per call besides the selection itself (``counts/call``:
redsync's bisection, gaussiank's paper corrections, the in-call search of
``correction=adaptive``; ``-`` for methods that never count), and the median
time per call next to exact top-k's (the ``topk`` compressor's encode on the same
tensors, timed in the same loop).

Data: ``normal`` N(0, 1), ``laplace`` Laplace(0, 1), ``student_t3``
Student-t with 3 degrees of freedom (heavy tails like real gradients), each
draw fresh from one seeded generator per kind and size; and real gradients
of ``mnist1d-cnn`` and ``charlm-lstm`` (:func:`workload_gradients`: the
whole model's gradient, flattened as one DDP bucket, of each of the first
``--steps`` training steps with the workload's default optimizer, learning
rate and batch size; their size is the model's, ``--sizes`` does not apply).

Invariants: every figure is measured in this run; the same arguments give
the same density figures (times vary with the machine).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from gradpress.bench.args import check_threads, positive_int
from gradpress.bench.measure import sync
from gradpress.bench.specs import parse_compressors, parse_sizes
from gradpress.train.config import check_seed

__all__ = ["DEFAULT_METHODS", "DATA", "register_bench", "run_estimators", "format_table", "format_wide",
           "workload_gradients", "synthetic_draws", "with_correction"]

#: every SIDCo configuration the issue names, then the three baselines
DEFAULT_METHODS = (
    "sidco:dist=exp", "sidco:dist=gpareto", "sidco:dist=gamma",
    "sidco:dist=exp,stages=1", "sidco:dist=gpareto,stages=1", "sidco:dist=gamma,stages=1",
    "sidco:dist=exp,stages=3", "sidco:dist=gpareto,stages=3", "sidco:dist=gamma,stages=3",
    "dgc_threshold", "redsync", "gaussiank",
)
SYNTHETIC = ("normal", "laplace", "student_t3")
WORKLOADS = ("mnist1d-cnn", "charlm-lstm")
DATA = SYNTHETIC + WORKLOADS
CORRECTIONS = ("adaptive", "none")
MEAN_BOUNDS = (0.8, 1.25)
CALL_BOUNDS = (0.5, 2.0)
#: draws per chunk when generating (bounds the temporaries at 25M elements)
_CHUNK = 1 << 22


def register_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "estimators", help="achieved/target density of the threshold estimators (sidco, dgc_threshold, redsync, gaussiank)",
        description="Density quality of the threshold estimators: mean/min/max achieved/target density over "
                    "successive draws, against the bounds mean in [0.8, 1.25] and every call in [0.5, 2.0], "
                    "with the time per call next to exact top-k's.",
    )
    p.add_argument("--methods", default="default",
                   help="'default' (every sidco configuration, dgc_threshold, redsync, gaussiank) or specs "
                        "without ratio, separated by ';' or ',' (e.g. 'sidco:dist=exp,stages=1;redsync')")
    p.add_argument("--correction", default="adaptive",
                   help="comma-separated: adaptive (the default form), none (the paper's form) (default: adaptive)")
    p.add_argument("--data", default="normal,laplace,student_t3",
                   help=f"comma-separated from {', '.join(DATA)} (default: normal,laplace,student_t3)")
    p.add_argument("--sizes", default="1M", help="element counts of the synthetic data, K/M/G suffixes (default: 1M)")
    p.add_argument("--ratios", default="0.1,0.01,0.001", help="target densities (default: 0.1,0.01,0.001)")
    p.add_argument("--steps", type=positive_int("--steps"), default=10, help="successive draws per row (default: 10)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="device (default: cpu)")
    p.add_argument("--seed", type=int, default=0, help="seed of the data (default: 0)")
    p.add_argument("--threads", type=positive_int("--threads"), default=None,
                   help="CPU threads for torch (default: torch's choice); 1 gives steadier times on a shared machine")
    p.add_argument("--format", default="wide", choices=("wide", "long"),
                   help="wide: one row per method, data and size, a column per ratio; long: one row per ratio "
                        "with the counting passes per call (default: wide)")
    p.add_argument("--json", metavar="FILE", default=None, help="write the rows as JSON to FILE")
    p.set_defaults(func=main)


def _choices(text: str, allowed: tuple[str, ...], flag: str) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in items if t not in allowed]
    if bad or not items:
        raise ValueError(f"{flag} got {text!r}; allowed: comma-separated from {', '.join(allowed)}")
    return items


def _ratios(text: str) -> list[float]:
    out = []
    for token in text.split(","):
        try:
            value = float(token)
        except ValueError:
            value = math.nan
        if not 0 < value < 1:
            raise ValueError(f"--ratios: bad density {token.strip()!r}; allowed: numbers with 0 < ratio < 1")
        out.append(value)
    return out


def with_correction(spec: str, correction: str) -> str:
    """``spec`` with ``correction=<correction>`` added (a spec that names
    its correction already is returned unchanged)."""
    if "correction=" in spec:
        return spec
    return f"{spec},correction={correction}" if ":" in spec else f"{spec}:correction={correction}"


def main(args: argparse.Namespace) -> int:
    check_seed(args.seed, "--seed")
    methods = list(DEFAULT_METHODS) if args.methods.strip() == "default" else parse_compressors(args.methods)
    for spec in methods:
        if "ratio=" in spec:
            raise ValueError(f"--methods: {spec!r} names a ratio; give densities with --ratios")
    corrections = _choices(args.correction, CORRECTIONS, "--correction")
    data = _choices(args.data, DATA, "--data")
    sizes = parse_sizes(args.sizes)
    ratios = _ratios(args.ratios)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device got 'cuda' but CUDA is not available on this machine; allowed here: cpu")
    if args.json and Path(args.json).is_dir():
        raise ValueError(f"--json got {args.json!r}, which is a directory; allowed: a file path")
    check_threads(args.threads)
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    result = run_estimators(methods, corrections, data, sizes, ratios, args.steps, args.device, args.seed, log)
    result["command"] = "gradpress bench estimators " + " ".join(
        f"--{k} {v}" for k, v in (("methods", args.methods), ("correction", args.correction), ("data", args.data),
                                  ("sizes", args.sizes), ("ratios", args.ratios), ("steps", args.steps),
                                  ("device", args.device), ("seed", args.seed), ("threads", args.threads),
                                  ("format", args.format))
        if v is not None)
    result["threads"] = torch.get_num_threads()
    print(format_wide(result) if args.format == "wide" else format_table(result))
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2))
        print(f"json: {path}")
    return 0


# ----------------------------------------------------------------------------- data
def synthetic_draws(kind: str, numel: int, steps: int, seed: int, device: str | torch.device = "cpu") -> Iterator[torch.Tensor]:
    """``steps`` successive fp32 draws of ``numel`` i.i.d. values of ``kind``
    from one generator seeded by (seed, kind, numel); generated in chunks
    on the CPU so temporaries stay small."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + SYNTHETIC.index(kind) * 7919 + numel % 1_000_000_007)
    for _ in range(steps):
        out = torch.empty(numel)
        for a in range(0, numel, _CHUNK):
            n = min(_CHUNK, numel - a)
            if kind == "normal":
                out[a : a + n] = torch.randn(n, generator=gen)
            elif kind == "laplace":  # inverse CDF: -sign(u) ln(1 - 2|u|), u ~ U(-1/2, 1/2)
                u = torch.rand(n, generator=gen) - 0.5
                out[a : a + n] = -torch.sign(u) * torch.log1p(-2.0 * u.abs().clamp(max=0.5 - 1e-7))
            else:  # Student-t(3) = Z / sqrt(chi^2_3 / 3)
                z = torch.randn(n, generator=gen)
                chi2 = torch.zeros(n)
                for _ in range(3):
                    chi2.add_(torch.randn(n, generator=gen).square_())
                out[a : a + n] = z / torch.sqrt(chi2 / 3.0)
        yield out.to(device)


_WORKLOAD_CACHE: dict[tuple[str, int, int], list[torch.Tensor]] = {}


def workload_gradients(name: str, steps: int, seed: int = 0) -> list[torch.Tensor]:
    """The flat fp32 gradient (all parameters concatenated, one DDP bucket)
    of each of the first ``steps`` training steps of workload ``name``
    (model init from ``torch.manual_seed(seed)``, the workload's default
    optimizer, learning rate and batch size, batches drawn in order from a
    generator seeded with ``seed``; no compression)."""
    key = (name, steps, seed)
    if key in _WORKLOAD_CACHE:
        return _WORKLOAD_CACHE[key]
    from gradpress import workloads
    from gradpress.train.optim import make_optimizer

    defaults = workloads.defaults(name)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        wl = workloads.build(name)
    model = wl.model
    optimizer = make_optimizer(defaults["optimizer"], model.parameters(), defaults["lr"])
    xs, ys = wl.train
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(xs.shape[0], generator=gen)
    batch = int(defaults["batch_size"])
    grads = []
    for step in range(steps):
        idx = order[(step * batch) % xs.shape[0]:][:batch]
        optimizer.zero_grad()
        loss = wl.loss(model(xs[idx]), ys[idx])
        loss.backward()
        grads.append(torch.cat([p.grad.detach().reshape(-1) for p in model.parameters() if p.grad is not None]).float())
        optimizer.step()
    _WORKLOAD_CACHE[key] = grads
    return grads


def _sources(data: list[str], sizes: list[int], steps: int, seed: int,
             device: str) -> Iterator[tuple[str, int, Callable[[], Iterator[torch.Tensor]]]]:
    for kind in data:
        if kind in WORKLOADS:
            grads = workload_gradients(kind, steps, seed)
            yield kind, grads[0].numel(), lambda g=grads: (x.to(device) for x in g)
        else:
            for numel in sizes:
                yield kind, numel, lambda k=kind, n=numel: synthetic_draws(k, n, steps, seed, device)


# ----------------------------------------------------------------------------- measurement
def _extra_counts(comp: Any) -> int | None:
    """Counting passes the last call spent besides the selection itself."""
    if comp.name == "redsync":
        return int(comp.last_steps)
    if getattr(comp, "corrected", False):
        return int(comp.last_passes)
    if comp.name == "gaussiank":  # the paper's loop counts once per step, at most 3 times
        return min(int(comp.last_adjustments) + 1, 3)
    return None


def run_estimators(methods: list[str], corrections: list[str], data: list[str], sizes: list[int],
                   ratios: list[float], steps: int, device: str = "cpu", seed: int = 0,
                   log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Rows (dicts) for every method x correction x data x size x ratio."""
    from gradpress.compress import Context, create

    dev = torch.device(device)
    rows: list[dict[str, Any]] = []
    specs = [with_correction(m, c) for m in methods for c in corrections]
    specs = list(dict.fromkeys(specs))
    for kind, numel, make in _sources(data, sizes, steps, seed, device):
        log(f"{kind} d={numel:,}")
        comps = {(s, r): create(s, ratio=r) for s in specs for r in ratios}
        topks = {r: create("topk", ratio=r) for r in ratios}
        quality: dict[tuple[str, float], list[float]] = {key: [] for key in comps}
        times: dict[tuple[str, float], list[float]] = {key: [] for key in comps}
        counts: dict[tuple[str, float], list[int]] = {key: [] for key in comps}
        topk_times: dict[float, list[float]] = {r: [] for r in ratios}
        for step, x in enumerate(make()):
            for r in ratios:
                k = min(numel, max(1, math.ceil(r * numel)))
                sync(dev)
                t0 = time.perf_counter()
                packet = topks[r].encode(x)
                sync(dev)
                topk_times[r].append(time.perf_counter() - t0)
                del packet
                for s in specs:
                    comp = comps[(s, r)]
                    ctx = Context(key="w", step=step, seed=seed)
                    sync(dev)
                    t0 = time.perf_counter()
                    packet = comp.encode(x, ctx)
                    sync(dev)
                    times[(s, r)].append(time.perf_counter() - t0)
                    kept = int(torch.count_nonzero(comp.decode(packet)))
                    quality[(s, r)].append(kept / k)
                    extra = _extra_counts(comp)
                    if extra is not None:
                        counts[(s, r)].append(extra)
                    del packet
        for s in specs:
            for r in ratios:
                qs = quality[(s, r)]
                mean = sum(qs) / len(qs)
                ok = MEAN_BOUNDS[0] <= mean <= MEAN_BOUNDS[1] and min(qs) >= CALL_BOUNDS[0] and max(qs) <= CALL_BOUNDS[1]
                cs = counts[(s, r)]
                rows.append({
                    "method": s, "data": kind, "numel": numel, "ratio": r, "steps": len(qs),
                    "mean": mean, "min": min(qs), "max": max(qs), "within_bounds": ok, "per_call": qs,
                    "extra_counts": sum(cs) / len(cs) if cs else None,
                    "ms_per_call": 1e3 * statistics.median(times[(s, r)]),
                    "topk_ms_per_call": 1e3 * statistics.median(topk_times[r]),
                })
                log(f"  {s:40s} {r:<6} mean {mean:.3f} min {min(qs):.3f} max {max(qs):.3f}"
                    f"{'' if ok else '  MISS'}")
    return {"rows": rows, "bounds": {"mean": list(MEAN_BOUNDS), "each_call": list(CALL_BOUNDS)},
            "device": device, "steps": steps, "seed": seed}


def _size(n: int) -> str:
    for div, suffix in ((10**9, "G"), (10**6, "M"), (10**3, "K")):
        if n >= div and n % (div // 10) == 0:
            return f"{n / div:g}{suffix}"
    return f"{n:,}"


def _ms(value: float) -> str:
    """Milliseconds with three significant digits or so."""
    return f"{value:.0f}" if value >= 100 else f"{value:.1f}" if value >= 10 else f"{value:.2f}"


def _summary(result: dict[str, Any]) -> list[str]:
    rows = result["rows"]
    misses = [r for r in rows if not r["within_bounds"]]
    lines = ["", f"{len(rows) - len(misses)} of {len(rows)} cases (method x data x size x ratio) within the bounds "
                 f"(mean achieved/target in "
                 f"[{MEAN_BOUNDS[0]}, {MEAN_BOUNDS[1]}], every call in [{CALL_BOUNDS[0]}, {CALL_BOUNDS[1]}]) "
                 f"over {result['steps']} successive draws."]
    for r in misses:
        lines.append(f"MISS: `{r['method']}` {r['data']} d={r['numel']:,} ratio={r['ratio']:g}: mean "
                     f"{r['mean']:.3f}, min {r['min']:.3f}, max {r['max']:.3f}")
    if "command" in result:
        lines.append(f"command: `{result['command']}`")
    return lines


def format_wide(result: dict[str, Any]) -> str:
    """Markdown: one row per method, data and size; per ratio a quality cell
    ``mean [min, max]`` (bold when outside the bounds) and a time cell
    ``ms/call / top-k ms/call``; then the summary lines."""
    rows = result["rows"]
    ratios = list(dict.fromkeys(r["ratio"] for r in rows))
    groups: dict[tuple[str, str, int], dict[float, dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["method"], r["data"], r["numel"]), {})[r["ratio"]] = r
    head = ["method", "data", "d"] + [f"{q:g}: mean [min, max]" for q in ratios] + [f"{q:g}: ms / top-k ms" for q in ratios]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (method, data, numel), by_ratio in groups.items():
        cells = [f"`{method}`", data, _size(numel)]
        for q in ratios:
            r = by_ratio.get(q)
            if r is None:
                cells.append("-")
                continue
            text = f"{r['mean']:.3f} [{r['min']:.2f}, {r['max']:.2f}]"
            cells.append(text if r["within_bounds"] else f"**{text}**")
        for q in ratios:
            r = by_ratio.get(q)
            cells.append("-" if r is None else f"{_ms(r['ms_per_call'])} / {_ms(r['topk_ms_per_call'])}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines + _summary(result))


def format_table(result: dict[str, Any]) -> str:
    """Markdown table, one row per ratio, then the summary lines."""
    lines = [
        "| method | data | d | ratio | mean | min | max | bounds | counts/call | ms/call | top-k ms/call |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    rows = result["rows"]
    for row in rows:
        extra = "-" if row["extra_counts"] is None else f"{row['extra_counts']:.1f}"
        lines.append(
            f"| `{row['method']}` | {row['data']} | {_size(row['numel'])} | {row['ratio']:g} | {row['mean']:.3f} "
            f"| {row['min']:.3f} | {row['max']:.3f} | {'ok' if row['within_bounds'] else '**MISS**'} | {extra} "
            f"| {_ms(row['ms_per_call'])} | {_ms(row['topk_ms_per_call'])} |")
    return "\n".join(lines + _summary(result))
