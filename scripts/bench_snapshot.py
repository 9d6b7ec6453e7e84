"""Time ``nonfinite='skip'``'s per-step state copy three ways, in one invocation.

Old: ``copy.deepcopy({"compressor": state_dict(), ...})`` (state_dict clones DGC's momentum and velocity, the
deep copy clones them again; before 2026-11-29). Fresh: one copy per step, the clone ``state_dict`` takes
(declared by ``state_dict_copies``; only the containers are copied again), a new allocation every step (main
before the kept buffers). Kept: ``Synchronizer._snapshot_state`` today, the compressor's ``live_state`` copied
into the buffers of the step before (``StepGuard.kept``), no allocation. Measured on a one-rank gloo group (no
peer, so the step is the compressor's work plus the copy), one thread by default:

* the snapshot alone, old, fresh and kept, alternated;
* a whole DGC step (``Synchronizer.sync`` of one tensor, ``nonfinite='skip'``) with each snapshot put in the
  engine's guard, with none (``skip`` without a copy), and with ``nonfinite='propagate'``, alternated;
* the minor page faults per step with the fresh and the kept snapshot (``getrusage``).

Each figure is the median of ``--repeats`` runs of ``--steps`` calls; the ratios are medians of the per-run
ratios. Run it alone on the machine::

    flock /tmp/gradpress-bench.lock python scripts/bench_snapshot.py --numel 4194304 --threads 1
"""

from __future__ import annotations

import argparse
import copy
import resource
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from gradpress.exchange.engine import Synchronizer


def old_snapshot(engine: Synchronizer) -> dict[str, Any] | None:
    """The snapshot before 2026-11-29 (state.py): a deep copy of the state dicts."""
    comp = engine.compressor.state_dict()
    strats = {n: st.state_dict() for n, st in engine.strategies.items()}
    if not comp and not any(strats.values()):
        return None
    return copy.deepcopy({"compressor": comp, "strategies": strats})


def fresh_snapshot(engine: Synchronizer) -> dict[str, Any] | None:
    """One fresh copy per step (2026-11-29 until the kept buffers): the clones ``state_dict`` takes."""
    comp, strats = engine._owned_state()
    if not comp and not any(strats.values()):
        return None
    return {"compressor": comp, "strategies": strats}


def per_call(fn: Callable[[int], Any], calls: int) -> float:
    """Seconds per call of ``fn(i)``, i = 0..calls-1."""
    start = time.perf_counter()
    for i in range(calls):
        fn(i)
    return (time.perf_counter() - start) / calls


def alternate(variants: dict[str, Callable[[int], Any]], calls: int, repeats: int) -> dict[str, list[float]]:
    """Each variant's seconds per call over ``repeats`` runs, the variants alternated run by run."""
    out: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, fn in variants.items():
            out[name].append(per_call(fn, calls))
    return out


def minor_faults(fn: Callable[[int], Any], calls: int) -> float:
    """Minor page faults of this process per call of ``fn(i)`` (``getrusage``: a fresh allocation's pages)."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for i in range(calls):
        fn(i)
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / calls


def ms(v: list[float]) -> str:
    return f"{1e3 * statistics.median(v):7.2f} ms"


def ratio(a: list[float], b: list[float]) -> float:
    return statistics.median(x / y for x, y in zip(a, b))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--numel", type=int, default=4 * 1024 * 1024,
                    help="elements of the one tensor, a (numel/1024) x 1024 matrix (default 4M)")
    ap.add_argument("--compressor", default="dgc", help="compressor spec (default dgc, ratio 0.001)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--steps", type=int, default=5, help="calls per run (default 5)")
    ap.add_argument("--repeats", type=int, default=7, help="runs per variant; the median is reported (default 7)")
    args = ap.parse_args(argv)
    if args.numel < 1024 or args.numel % 1024:
        ap.error(f"--numel: got {args.numel}; allowed: a positive multiple of 1024")
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=0, world_size=1)
        try:
            report(args)
        finally:
            dist.destroy_process_group()
    return 0


def report(args: argparse.Namespace) -> None:
    shape = (args.numel // 1024, 1024)  # a matrix: 1-D tensors travel uncompressed
    params = [("w", shape, torch.float32)]
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(shape, generator=gen) for _ in range(args.steps)]
    work = [g.clone() for g in grads]
    engines = {mode: Synchronizer(args.compressor, params=params, min_numel=1, nonfinite=mode)
               for mode in ("skip", "propagate")}
    skip = engines["skip"]
    new_fn = skip.guard._snapshot_fn
    counter = [0]

    def step(engine: Synchronizer, i: int) -> None:
        work[i].copy_(grads[i])  # sync averages in place; the same copy in every variant
        counter[0] += 1
        engine.sync(["w"], [work[i]], step=counter[0])

    for engine in engines.values():  # the state exists (DGC's buffers) before anything is timed
        for i in range(2):
            step(engine, i)
    state_bytes = sum(v.numel() * v.element_size() for d in skip.compressor.state_dict().values()
                      if isinstance(d, dict) for v in d.values() if isinstance(v, torch.Tensor))
    print(f"{args.compressor}, {args.numel} elements, {args.threads} thread(s), state {state_bytes / 2**20:.1f} MiB; "
          f"median of {args.repeats} runs of {args.steps} calls")
    snap = alternate({"old": lambda i: old_snapshot(skip), "fresh": lambda i: fresh_snapshot(skip),
                      "kept": lambda i: skip._snapshot_state()}, args.steps, args.repeats)
    print(f"snapshot  old {ms(snap['old'])}  fresh {ms(snap['fresh'])}  kept {ms(snap['kept'])}  "
          f"fresh/kept {ratio(snap['fresh'], snap['kept']):.2f}  old/kept {ratio(snap['old'], snap['kept']):.2f}")

    def skip_with(fn: Callable[[], Any]) -> Callable[[int], None]:
        def run(i: int) -> None:
            skip.guard._snapshot_fn = fn
            step(skip, i)
        return run

    whole = alternate({"old": skip_with(lambda: old_snapshot(skip)), "fresh": skip_with(lambda: fresh_snapshot(skip)),
                       "kept": skip_with(new_fn), "skip, no copy": skip_with(lambda: None),
                       "none": lambda i: step(engines["propagate"], i)}, args.steps, args.repeats)
    faults = {name: minor_faults(fn, args.steps) for name, fn in
              {"fresh": skip_with(lambda: fresh_snapshot(skip)), "kept": skip_with(new_fn)}.items()}
    skip.guard._snapshot_fn = new_fn
    print(f"minor page faults per step  fresh {faults['fresh']:.0f}  kept {faults['kept']:.0f}")
    nocopy = whole["skip, no copy"]
    print(f"step      old {ms(whole['old'])}  fresh {ms(whole['fresh'])}  kept {ms(whole['kept'])}  "
          f"skip without a copy {ms(nocopy)}  propagate {ms(whole['none'])}")
    print(f"step ratios  fresh/kept {ratio(whole['fresh'], whole['kept']):.2f}  "
          f"fresh/no copy {ratio(whole['fresh'], nocopy):.2f}  kept/no copy {ratio(whole['kept'], nocopy):.2f}")

if __name__ == "__main__":
    raise SystemExit(main())
