"""Independent byte accounting (gloo, 2 and 3 workers).

Inside each worker a shim wraps the ``torch.distributed`` calls gradpress
makes (``all_reduce``, ``all_gather``, ``all_gather_into_tensor``,
``all_gather_single``, ``broadcast``, ``isend``, ``send``) and sums the bytes
this rank hands over: the whole buffer of an allreduce, this rank's
contribution to an allgather (so size exchanges and padding count), a
broadcast's buffer on its source, every point-to-point send (size prefixes
included). ``stats["bytes_sent"]`` and ``stats["last_step_bytes"]`` must
equal that count exactly, step by step, for every strategy (fixed- and
variable-size packets, summable or not, multi-round PowerSGD, partitioned
tensors under ``auto``), for the uncompressed path, for the DDP hook (several
buckets a step) and for an algorithm (compressed deltas plus plain buffers).
The count is made outside gradpress: a byte left out of the figure (the plain
allreduce of small tensors and NaN/Inf flags, a size exchange) or counted
twice fails.
"""

from __future__ import annotations

import contextlib
import time

import pytest
import torch
import torch.distributed as dist
from distributed import worlds_fixture

import gradpress
import gradpress.algorithms as algorithms
from gradpress.compress import create
from gradpress.compress.base import Context
from gradpress.exchange import Synchronizer, get_strategy
from gradpress.exchange.feedback import Feedback

pytestmark = pytest.mark.mutants

SHAPES = {"w": (33, 10), "v": (9, 7), "u": (4, 4), "b": (5,)}
STEPS = 3
#: a slow link on which the planner partitions large tensors over the PS (name#k)
PS_LINK = {
    "allreduce": (2e-4, 2e-4, 1e-6), "allgather": (2e-4, 2e-4, 4e-6), "broadcast": (5e-5, 5e-5, 1e-8),
    "p2p": (2e-4, 2e-4, 1e-6), "encode": (1e-5, 1e-5, 1e-9), "decode": (1e-5, 1e-5, 1e-9),
    "wire": (0.0, 0.0, 1.0), "root_wire": (0.0, 0.0, 1.0),
}

#: (strategy, spec, extra engine keywords)
CASES = [
    ("collective", "none", {}),  # nothing compressed: the dense path
    ("allreduce", "none", {}),
    ("allreduce", "fp16", {}),
    ("allreduce", "randomk:ratio=0.3", {}),
    ("allreduce", "powersgd:rank=2,start_iter=1", {}),
    ("allgather", "topk:ratio=0.1", {}),
    ("allgather", "threshold:tau=0.8", {}),  # variable size: size exchange and padding
    ("allgather", "qsgd:levels=4,bucket=16", {}),
    ("allgather", "signsgd", {}),
    ("allgather", "dgc:ratio=0.1", {}),
    ("ring", "none", {}),
    ("ring", "fp16", {}),
    ("ring", "topk:ratio=0.1", {}),
    ("ring", "threshold:tau=0.8", {}),
    ("ps", "none", {}),
    ("ps", "fp16", {}),
    ("ps", "topk:ratio=0.1", {}),
    ("ps", "threshold:tau=0.8", {}),
    ("union", "topk:ratio=0.1", {}),
    ("union", "threshold:tau=0.8", {}),  # counts differ between ranks
    ("auto", "topk:ratio=0.1", {"plan_costs": PS_LINK}),
]

_WRAPPED = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "broadcast", "isend", "send")


class Shim:
    """Counts the bytes this rank hands to ``torch.distributed``."""

    def __init__(self) -> None:
        self.bytes = 0
        self.calls: dict[str, int] = {}
        self.by_call: dict[str, int] = {}  # bytes per torch.distributed function

    @staticmethod
    def _nbytes(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    def _count(self, name: str, nbytes: int) -> None:
        self.bytes += nbytes
        self.calls[name] = self.calls.get(name, 0) + 1
        self.by_call[name] = self.by_call.get(name, 0) + nbytes

    @contextlib.contextmanager
    def installed(self):  # noqa: ANN201
        originals = {name: getattr(dist, name) for name in _WRAPPED if hasattr(dist, name)}

        def wrap(name, fn):  # noqa: ANN001, ANN202
            def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
                if name in ("all_reduce", "isend", "send"):
                    self._count(name, self._nbytes(args[0] if args else kwargs["tensor"]))
                elif name == "all_gather":
                    self._count(name, self._nbytes(args[1] if len(args) > 1 else kwargs["tensor"]))
                elif name in ("all_gather_into_tensor", "all_gather_single"):
                    self._count(name, self._nbytes(args[1] if len(args) > 1 else kwargs["input_tensor"]))
                elif name == "broadcast":
                    src = args[1] if len(args) > 1 else kwargs.get("src")
                    tensor = args[0] if args else kwargs["tensor"]
                    if src == dist.get_rank():
                        self._count(name, self._nbytes(tensor))
                return fn(*args, **kwargs)
            return counted

        for name, fn in originals.items():
            setattr(dist, name, wrap(name, fn))
        try:
            yield self
        finally:
            for name, fn in originals.items():
                setattr(dist, name, fn)


def grads(rank: int, step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return {k: torch.randn(s, generator=g) for k, s in SHAPES.items()}


def _engine(rank: int, world: int, strategy: str, spec: str, kw: dict) -> dict:
    engine = Synchronizer(spec, params=[(k, s, torch.float32) for k, s in SHAPES.items()], strategy=strategy,
                          min_numel=16, **kw)
    shim = Shim()
    per_step = []
    keys = list(SHAPES)
    with shim.installed():
        for step in range(STEPS):
            before = shim.bytes
            g = grads(rank, step)
            # two calls per step (as two DDP buckets): the step closes with the second
            engine.sync(keys[:2], [g[k] for k in keys[:2]], step=step, end_of_step=False)
            engine.sync(keys[2:], [g[k] for k in keys[2:]], step=step, end_of_step=True)
            per_step.append((shim.bytes - before, engine.stats["last_step_bytes"]))
    return {"per_step": per_step, "total": shim.bytes, "stats": engine.stats, "calls": shim.calls,
            "plan": engine.plan.to_dict(), "by_call": shim.by_call}


def _large_prelude(rank: int, world: int) -> dict:
    """allgather with a prelude too large to ride inside the gather (a 1-D
    tensor of 20K floats, left uncompressed): it is allreduced on its own."""
    shapes = {"w": (33, 10), "big": (20_000,)}
    engine = Synchronizer("topk:ratio=0.1", params=[(k, s, torch.float32) for k, s in shapes.items()],
                          strategy="allgather", min_numel=16)
    shim = Shim()
    with shim.installed():
        for step in range(2):
            g = torch.Generator().manual_seed(step * 10 + rank)
            engine.sync(list(shapes), [torch.randn(s, generator=g) for s in shapes.values()], step=step)
    return {"total": shim.bytes, "stats": engine.stats, "by_call": shim.by_call}


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(13, 37)
        self.b = torch.nn.Linear(37, 29)
        self.c = torch.nn.Linear(29, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def _hook(rank: int, world: int, spec: str, strategy: str) -> dict:
    ddp = torch.nn.parallel.DistributedDataParallel(_Net(), bucket_cap_mb=0.002)  # several buckets
    hook = gradpress.ddp.register(ddp, spec, strategy=strategy, min_numel=64)
    shim = Shim()
    per_step = []
    with shim.installed():
        for step in range(STEPS):
            before = shim.bytes
            ddp.zero_grad()
            x = torch.randn(8, 13, generator=torch.Generator().manual_seed(step * 10 + rank))
            ddp(x).pow(2).mean().backward()
            per_step.append((shim.bytes - before, hook.stats["last_step_bytes"]))
    stats = hook.stats
    hook.close()
    return {"per_step": per_step, "total": shim.bytes, "stats": stats, "by_call": shim.by_call}


def _algorithm(rank: int, world: int, spec: str, compressor: str) -> dict:
    model = torch.nn.Sequential(torch.nn.Linear(6, 40), torch.nn.BatchNorm1d(40), torch.nn.Linear(40, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    algo = algorithms.create(spec, model, opt, compressor=compressor, min_numel=64)
    shim = Shim()
    per_step = []
    with shim.installed():
        for step in range(4):
            before = shim.bytes
            opt.zero_grad()
            x = torch.randn(16, 6, generator=torch.Generator().manual_seed(step * 10 + rank))
            model(x).pow(2).mean().backward()
            algo.step()
            per_step.append((shim.bytes - before, algo.stats["last_step_bytes"]))
        stats = algo.stats
        algo.close() if hasattr(algo, "close") else None
        closed = algo.stats
    return {"per_step": per_step, "total": shim.bytes, "stats": stats, "closed": closed}


#: strategies called directly, one of each kind of timing code (PowerSGD: the multi-round protocol)
TIMED = [("allreduce", "powersgd:rank=2,start_iter=0"), ("allreduce", "fp16"), ("allgather", "topk:ratio=0.1"),
         ("ring", "topk:ratio=0.1"), ("ps", "topk:ratio=0.1")]


def _timed(rank: int, world: int) -> dict:
    """Each strategy of TIMED called directly (with feedback): the wall time the
    test measures around ``exchange`` and the result's ``compress_s``/``comm_s``."""
    out = {}
    for name, spec in TIMED:
        strat, comp = get_strategy(name, None), create(spec)
        runs = []
        for step in range(2):
            g = grads(rank, step)
            ctxs = [Context(key=k, step=step, rank=rank, world_size=world) for k in SHAPES]
            feedback = Feedback()
            t0 = time.perf_counter()
            res = strat.exchange(comp, [g[k] for k in SHAPES], ctxs, feedback)
            wall = time.perf_counter() - t0
            feedback.commit()
            runs.append((wall, res.compress_s, res.comm_s))
        out[(name, spec)] = runs
    return out


def _worker(rank: int, world: int) -> dict:
    out: dict = {"timed": _timed(rank, world), "large prelude": _large_prelude(rank, world)}
    for strategy, spec, kw in CASES:
        out[(strategy, spec)] = _engine(rank, world, strategy, spec, kw)
    for spec, strategy in (("none", "collective"), ("topk:ratio=0.05", "collective"), ("qsgd", "ring"),
                           ("topk:ratio=0.05", "ps")):
        out[("hook", spec, strategy)] = _hook(rank, world, spec, strategy)
    for spec, compressor in (("localsgd:period=2", "topk:ratio=0.1"), ("diloco:period=2", "none"),
                             ("comprex:staleness=0", "topk:ratio=0.1"), ("comprex:staleness=2", "topk:ratio=0.1")):
        out[("algorithm", spec, compressor)] = _algorithm(rank, world, spec, compressor)
    dist.barrier()
    return out


world_results = worlds_fixture(_worker)


def _check(res: dict, what: object) -> None:
    for step, (counted, reported) in enumerate(res["per_step"]):
        assert counted > 0, (what, step, "nothing was handed over")
        assert reported == counted, (what, step, f"stats say {reported} bytes, the collectives were handed {counted}")
    assert res["stats"]["bytes_sent"] == res["total"], (what, res["stats"]["bytes_sent"], res["total"])
    assert res["stats"]["compress_s"] >= 0 and res["stats"]["comm_s"] >= 0, (what, res["stats"])


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}")
def test_engine_bytes_equal_what_collectives_were_handed(world_results, case) -> None:  # noqa: ANN001
    world, res = world_results
    strategy, spec, _ = case
    for r in range(world):
        _check(res[r][(strategy, spec)], (case, r))
    if strategy == "collective" and spec == "none":  # nothing compressed: no time spent compressing
        assert all(res[r][(strategy, spec)]["stats"]["compress_s"] == 0.0 for r in range(world))
    if strategy == "auto":
        parts = {d["parts"] for d in res[0][(strategy, spec)]["plan"].values()}
        assert max(parts) > 1, "the planner did not partition: name#k pieces are not covered"


def test_small_and_1d_tensors_travel_whole_and_uncompressed(world_results) -> None:  # noqa: ANN001
    """The plan's default decision for a 1-D tensor ("b"): uncompressed, in
    one part, whatever the strategy."""
    world, res = world_results
    for strategy, spec, _ in CASES:
        plan = res[0][(strategy, spec)]["plan"]
        assert plan["b"]["strategy"] == "uncompressed" and plan["b"]["parts"] == 1, (strategy, spec, plan["b"])


def test_variable_size_packets_pay_for_their_size_exchange(world_results) -> None:  # noqa: ANN001
    """The size exchange of variable-size packets is a collective of its own
    (one int64 per rank gathered, with the engine's prelude in front of it):
    at least two gathers per step, and their bytes are in the count."""
    world, res = world_results
    r0 = res[0][("allgather", "threshold:tau=0.8")]
    calls = r0["calls"]
    gathers = sum(calls.get(name, 0) for name in ("all_gather", "all_gather_single", "all_gather_into_tensor"))
    assert gathers >= 2 * STEPS, calls
    _check(r0, "threshold allgather")


@pytest.mark.parametrize("what", [("hook", "none", "collective"), ("hook", "topk:ratio=0.05", "collective"),
                                  ("hook", "qsgd", "ring"), ("hook", "topk:ratio=0.05", "ps")],
                         ids=lambda w: f"{w[1]}-{w[2]}")
def test_hook_bytes_equal_what_collectives_were_handed(world_results, what) -> None:  # noqa: ANN001
    world, res = world_results
    for r in range(world):
        _check(res[r][what], (what, r))


@pytest.mark.parametrize("what", [("algorithm", "localsgd:period=2", "topk:ratio=0.1"),
                                  ("algorithm", "diloco:period=2", "none")], ids=lambda w: w[1])
def test_algorithm_bytes_equal_what_collectives_were_handed(world_results, what) -> None:  # noqa: ANN001
    """Local steps hand over nothing (0 both ways); exchange steps count the
    compressed deltas and the plain BatchNorm statistics."""
    world, res = world_results
    for r in range(world):
        r_res = res[r][what]
        for step, (counted, reported) in enumerate(r_res["per_step"]):
            assert reported == counted, (what, r, step, reported, counted)
        assert any(c > 0 for c, _ in r_res["per_step"]) and any(c == 0 for c, _ in r_res["per_step"])
        assert r_res["stats"]["bytes_sent"] == r_res["total"], (what, r)


def test_comprex_bytes_equal_what_collectives_were_handed(world_results) -> None:  # noqa: ANN001
    """Comprex counts an exchange's bytes when its update is applied: with
    staleness 0 in the same step (every step exchanges); with staleness 2
    the last two are still in flight after 4 steps and count once ``close``
    has applied them, so the totals then agree."""
    world, res = world_results
    for r in range(world):
        inline = res[r][("algorithm", "comprex:staleness=0", "topk:ratio=0.1")]
        for step, (counted, reported) in enumerate(inline["per_step"]):
            assert counted > 0 and reported == counted, (r, step, reported, counted)
        assert inline["stats"]["bytes_sent"] == inline["total"], r
        stale = res[r][("algorithm", "comprex:staleness=2", "topk:ratio=0.1")]
        assert [reported for _, reported in stale["per_step"][:2]] == [0, 0]  # nothing applied yet
        assert stale["stats"]["bytes_sent"] < stale["total"] == stale["closed"]["bytes_sent"], r


@pytest.mark.parametrize("case", TIMED, ids=lambda c: f"{c[0]}-{c[1]}")
def test_strategy_times_fit_in_the_call(world_results, case) -> None:  # noqa: ANN001
    """``ExchangeResult``'s contract: ``compress_s`` (encoding, decoding) and
    ``comm_s`` (inside collectives) are disjoint parts of the call, so each is
    >= 0 and their sum is at most the wall time the test measures around
    ``exchange`` (a bound, not a speed claim: the clock difference taken with
    the wrong sign or operator, e.g. ``perf_counter() + t``, gives seconds
    since boot). The engine clips ``compress_s`` to its own wall time, so this
    is checked on the strategies themselves, the multi-round protocol
    (PowerSGD) included."""
    world, res = world_results
    for r in range(world):
        for step, (wall, compress_s, comm_s) in enumerate(res[r]["timed"][case]):
            assert compress_s >= 0.0 and comm_s >= 0.0, (case, r, step, compress_s, comm_s)
            assert compress_s + comm_s <= wall * (1 + 1e-9) + 1e-9, (case, r, step, wall, compress_s, comm_s)


@pytest.mark.parametrize("variable", [False, True])
def test_nothing_to_send_packs_to_nothing(variable: bool) -> None:
    """Wire format (``transport/wire.py``): no packets pack to a buffer of
    exactly zero bytes (a size header of zero counts when variable), which
    parses back to no packets: an empty send costs nothing and never fails."""
    from gradpress.transport import wire

    buf = wire.pack_packets([], variable, device=torch.device("cpu"))
    assert buf.dtype == torch.uint8 and buf.numel() == 0, buf
    assert wire.unpack_packets(buf, [], variable) == []


def test_stats_state_without_a_new_counter_restarts_it_at_zero():
    """A checkpoint written before ``host_bytes`` existed: the counters it
    holds are restored, the missing ones count from the resume (not this
    object's earlier figures)."""
    from gradpress.exchange.stats import ExchangeStats

    def used() -> ExchangeStats:
        s = ExchangeStats(count_skipped=False)
        s.record(sent=100, dense=400, compress_s=0.5, comm_s=0.25, compressed=1, plain=0,
                 tensor_bytes={"w": 100}, end_of_step=True, host=80)
        return s

    old = {k: v for k, v in used().state_dict().items() if "host" not in k}
    resumed = used()  # counters already moved: a load must not keep them
    resumed.load_state_dict(old)
    snap = resumed.snapshot()
    assert snap["bytes_sent"] == 100 and snap["steps"] == 1 and snap["tensor_bytes"] == {"w": 100}
    assert snap["host_bytes"] == 0 and snap["last_step_host_bytes"] == 0
    full = used().state_dict()
    resumed.load_state_dict(full)
    assert resumed.snapshot()["host_bytes"] == 80 == full["host_bytes"]


def _check_strategy_bytes(res: dict, what: object) -> None:
    """``strategy_bytes`` splits ``bytes_sent`` by the strategy that handed
    the bytes over; what went to ``all_reduce`` (counted by the shim) is the
    plain allreduce of the uncompressed tensors plus the allreduce strategy's
    own, nothing else (``union``, which allreduces its values, aside)."""
    by = res["stats"]["strategy_bytes"]
    assert sum(by.values()) == res["stats"]["bytes_sent"] == res["total"], (what, by, res["total"])
    if "union" not in by:
        assert by.get("uncompressed", 0) + by.get("allreduce", 0) == res["by_call"].get("all_reduce", 0), (
            what, by, res["by_call"])


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}")
def test_bytes_per_strategy_add_up_and_name_the_plain_allreduce(world_results, case) -> None:  # noqa: ANN001
    """Under a mixed plan (uncompressed small and 1-D tensors beside a
    compressed strategy) the uncompressed tensors' plain allreduce is counted
    apart from the strategy (``bench e2e`` counts each at its own wire
    factor): under ``ring`` and ``ps`` it is a collective of its own; under
    ``allgather`` (a small prelude) and ``allreduce`` it rides inside the
    strategy's collective and counts as the strategy's."""
    world, res = world_results
    strategy, spec, _ = case
    for r in range(world):
        got = res[r][(strategy, spec)]
        _check_strategy_bytes(got, (case, r))
        by, calls = got["stats"]["strategy_bytes"], got["by_call"]
        if strategy in ("ring", "ps"):
            assert by["uncompressed"] == calls["all_reduce"] > 0, (case, by, calls)
        if strategy == "allgather":  # the prelude rode inside the gather: no allreduce at all
            assert "uncompressed" not in by and "all_reduce" not in calls, (case, by, calls)
            gathered = sum(calls.get(n, 0) for n in ("all_gather", "all_gather_into_tensor", "all_gather_single"))
            assert by["allgather"] == gathered, (case, by, calls)
        if strategy == "collective" and spec == "none":  # nothing compressed: all of it the plain allreduce
            assert by == {"uncompressed": got["total"]}, (case, by)


def test_a_large_prelude_beside_allgather_counts_as_uncompressed(world_results) -> None:  # noqa: ANN001
    world, res = world_results
    for r in range(world):
        got = res[r]["large prelude"]
        _check_strategy_bytes(got, ("large prelude", r))
        by, calls = got["stats"]["strategy_bytes"], got["by_call"]
        assert by["uncompressed"] == calls["all_reduce"] >= 2 * 4 * 20_000, (by, calls)
        assert by["allgather"] == got["total"] - calls["all_reduce"], (by, calls)


@pytest.mark.parametrize("what", [("hook", "none", "collective"), ("hook", "topk:ratio=0.05", "collective"),
                                  ("hook", "qsgd", "ring"), ("hook", "topk:ratio=0.05", "ps")],
                         ids=lambda w: f"{w[1]}-{w[2]}")
def test_hook_bytes_per_strategy_add_up(world_results, what) -> None:  # noqa: ANN001
    world, res = world_results
    for r in range(world):
        _check_strategy_bytes(res[r][what], (what, r))
