"""Where one worker's step time goes in a compressed allgather exchange:
``python -m gradpress.bench.e2e_profile --params 10M --world 4 --compressors topk:ratio=0.001,...``.

For the wide-mlp gradient shapes of ``--params`` it times, in one process
and one thread (as a worker of ``gradpress bench e2e`` runs), every phase of
the rank-local work the engine and the ``allgather`` strategy do for one
step, on the packets of ``--world`` ranks: error compensation (g + e), the
compressor's encode, the residual, wire pack/unpack, then the two ways of
averaging: decoding every rank's packet into a dense tensor and folding
them in rank order (what allgather did before, and still does for
non-sparse methods), and one accumulated scatter of all ranks' sparse
packets written into the output (:func:`gradpress.compress.sparse.sparse_sum`,
exact-value sparsifiers). Then the finiteness checks of the NaN protocol.
Each figure is the median of ``--repeats`` timings; nothing travels over a
network (the wire is timed by ``gradpress bench e2e``). Results in
docs/bench.md, "Where the time goes".
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from gradpress.bench.args import check_threads, positive_int
from gradpress.bench.specs import parse_compressors
from gradpress.compress import create
from gradpress.compress.base import Context, all_finite
from gradpress.compress.sparse import sparse_sum
from gradpress.exchange.base import aggregate
from gradpress.transport import wire


def _median_s(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def profile(spec: str, shapes: list[tuple[int, ...]], world: int, repeats: int = 5) -> dict[str, float]:
    """Seconds per phase (median) of one step's rank-local allgather work."""
    comp = create(spec)
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(s, generator=gen) for s in shapes]
    resid = [torch.randn(s, generator=gen) * 0.1 for s in shapes]
    ctxs = [Context(key=f"t{i}", step=1, rank=0, world_size=world) for i in range(len(shapes))]
    out: dict[str, float] = {}
    out["compensate (g + e)"] = _median_s(lambda: [g + e for g, e in zip(grads, resid)], repeats)
    ps = [g + e for g, e in zip(grads, resid)]
    out["encode"] = _median_s(lambda: [comp.encode(p, c) for p, c in zip(ps, ctxs)], repeats)
    packets = [comp.encode(p, c) for p, c in zip(ps, ctxs)]
    copies = [[p.clone() for p in ps] for _ in range(repeats)]
    it = iter(copies)
    out["residual"] = _median_s(lambda: [comp.residual(p, k) for p, k in zip(next(it), packets)], repeats)
    variable = bool(comp.variable_size)
    out["pack"] = _median_s(lambda: wire.pack_packets(packets, variable), repeats)
    buf = wire.pack_packets(packets, variable)
    out[f"unpack x{world - 1}"] = _median_s(lambda: [wire.unpack_packets(buf, packets, variable) for _ in range(world - 1)], repeats)

    def dense_fold() -> list[torch.Tensor]:
        decoded = [[comp.decode(k) for k in packets] for _ in range(world)]
        return [aggregate(comp, [decoded[r][i] for r in range(world)], world) for i in range(len(shapes))]

    out[f"average: decode x{world} + dense fold"] = _median_s(dense_fold, repeats)
    if comp.exact_values and all(len(k.tensors) == 2 for k in packets):
        dst = [torch.empty(s) for s in shapes]
        out[f"average: sparse_sum of {world} packets"] = _median_s(
            lambda: [sparse_sum([k.tensors[0]] * world, [k.tensors[1]] * world, k.numel, k.dtype, d.view(-1)).div_(world)
                     for k, d in zip(packets, dst)], repeats)
        out["copy back (dense fold only)"] = _median_s(lambda: [g.copy_(d) for g, d in zip(grads, dst)], repeats)
    out["finite checks x3 (flags, output, residual)"] = _median_s(
        lambda: [bool(all_finite(t)) for t in grads * 3], repeats)
    return out


def main(argv: list[str] | None = None) -> int:
    from gradpress.workloads import wide

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params", default="10M", help="wide-mlp size (default 10M)")
    p.add_argument("--world", type=positive_int("--world"), default=4,
                   help="ranks whose packets are averaged (default 4)")
    p.add_argument("--compressors", default="topk:ratio=0.001,dgc_threshold:ratio=0.001,sidco:ratio=0.001",
                   help="comma-separated specs, as bench compressors' --compressors")
    p.add_argument("--repeats", type=positive_int("--repeats"), default=5)
    p.add_argument("--threads", type=positive_int("--threads"), default=1)
    a = p.parse_args(argv)
    try:
        check_threads(a.threads)
        h = wide.width_for(wide.parse_count(a.params, "--params"))
        specs = parse_compressors(a.compressors)
    except ValueError as exc:
        p.error(str(exc))
    torch.set_num_threads(a.threads)
    shapes = [(h, wide.IN_DIM), (h, h), (wide.CLASSES, h)]
    print(f"wide-mlp {a.params}: weight shapes {shapes}, world {a.world}, {a.threads} thread(s), median of {a.repeats}")
    for spec in specs:
        phases = profile(spec.strip(), shapes, a.world, a.repeats)
        print(f"\n{spec}")
        for name, s in phases.items():
            print(f"  {name:45s} {s * 1000:8.1f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
