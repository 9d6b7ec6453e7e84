"""``hierarchical``: 4 gloo workers on loopback as 2 "hosts" x 2 workers.

References are computed here in float64: the plain mean; for top-k with
error feedback at the leaders, the two-level algorithm itself (host sums,
host means plus the leader's residual, top-k per leader, mean over leaders,
new residual); for PowerSGD, a rank-1 mean that one power iteration
recovers exactly. Every check also asserts bit-identical replicas.
"""

from __future__ import annotations

import math
import os
import time
import warnings

import pytest
import torch
import torch.distributed as dist
from distributed import run_workers
from references import topk

from gradpress.exchange.engine import Synchronizer

WORLD, PER_HOST = 4, 2
SHAPES = [(64, 48), (40, 33), (5000,)]  # the 1-D tensor joins the plain allreduce
KEYS = ["a.weight", "b.weight", "c.bias"]
STEPS = 4
RATIO = 0.05
TAU = 1.5  # threshold compressor: keeps |x| > TAU, a variable-size packet
CHUNK = 500  # pipelined pieces: 10 rows of a.weight (7 pieces), 15 rows of b.weight (3 pieces)
BETA = 0.5  # the feedback's beta (DiLoCo's residual_decay sets it): q_h = S_h / L + beta e_h


def _grads(rank: int, step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return [torch.randn(s, generator=gen) * (1 + rank) for s in SHAPES]


def _low_rank(rank: int, step: int) -> list[torch.Tensor]:
    """c_r u v^T: every mean of these is rank 1 (PowerSGD r=1 recovers it)."""
    gen = torch.Generator().manual_seed(step)
    out = []
    for s in SHAPES:
        if len(s) == 1:
            out.append(torch.randn(s, generator=gen))
        else:
            u, v = torch.randn(s[0], 1, generator=gen), torch.randn(1, s[1], generator=gen)
            out.append(u @ v * (rank + 1.0))
    return out


def _engine(spec: str, strategy: str, **kw) -> Synchronizer:
    params = [(k, s, torch.float32) for k, s in zip(KEYS, SHAPES)]
    return Synchronizer(spec, params=params, strategy=strategy, min_numel=256, **kw)


def _run(engine: Synchronizer, rank: int, steps: range, grads=_grads) -> list[list[torch.Tensor]]:
    outs = []
    for step in steps:
        ts = grads(rank, step)
        engine.sync(KEYS, ts, step=step)
        outs.append([t.clone() for t in ts])
    return outs


def _error(fn) -> str:  # noqa: ANN001
    try:
        fn()
    except ValueError as exc:
        return str(exc)
    return ""


def _worker(rank: int, world: int) -> dict:
    out: dict = {}
    spec = f"hierarchical:workers_per_host={PER_HOST}"
    out["none"] = _run(_engine("none", spec), rank, range(STEPS))
    eng = _engine(f"topk:ratio={RATIO}", spec + ",chunk=0", error_feedback=True)  # not pipelined
    out["topk"] = _run(eng, rank, range(STEPS))
    out["flat_topk"] = _run(_engine(f"topk:ratio={RATIO}", "allgather", error_feedback=True), rank, range(STEPS))
    out["host_keys"] = sorted(eng.feedback.namespace("host"))
    out["worker_residual_max"] = max(float(v.abs().max()) for v in eng.feedback.namespace("").values())
    out["stats"] = eng.stats
    for name, extra in (("topk_beta", ",chunk=0"), ("pipe_topk_beta", f",chunk={CHUNK}")):
        decayed = _engine(f"topk:ratio={RATIO}", spec + extra, error_feedback=True)
        decayed.feedback.beta = BETA
        out[name] = _run(decayed, rank, range(3))
    out["ring_none"] = _run(_engine("none", spec + ",outer=ring"), rank, range(2))
    out["ring_topk"] = _run(_engine(f"topk:ratio={RATIO}", spec + ",outer=ring", error_feedback=True), rank, range(3))
    out["fp16"] = _run(_engine("fp16", spec), rank, range(2))
    # pipelined in pieces of whole rows (7 + 3 pieces): allreduce (none, fp16) and allgather (top-k) between leaders
    out["pipe_none"] = _run(_engine("none", spec + f",chunk={CHUNK}"), rank, range(2))
    piped = _engine(f"topk:ratio={RATIO}", spec + f",chunk={CHUNK}", error_feedback=True)
    out["pipe_topk"] = _run(piped, rank, range(2))
    again = _engine(f"topk:ratio={RATIO}", spec + f",chunk={CHUNK}", error_feedback=True)
    again.load_state_dict(piped.state_dict())
    out["pipe_topk"] += _run(again, rank, range(2, STEPS))
    out["pipe_host_keys"] = sorted(piped.feedback.namespace("host"))
    out["pipe_stats"] = piped.stats
    out["pipe_fp16"] = _run(_engine("fp16", spec + f",chunk={CHUNK}"), rank, range(2))
    # variable-size packets: the sizes travel first (the swap on the wire thread)
    out["pipe_threshold"] = _run(_engine(f"threshold:tau={TAU}", spec + f",chunk={CHUNK}", error_feedback=True),
                                 rank, range(3))
    out["pipe_direct"] = _direct(rank, spec + f",chunk={CHUNK}")
    with warnings.catch_warnings(record=True) as caught:  # every rank on one host: exact, nothing compressed
        warnings.simplefilter("always")
        one = _engine(f"topk:ratio={RATIO}", f"hierarchical:workers_per_host={WORLD}", error_feedback=True)
    out["one_host_warning"] = [str(w.message) for w in caught if "one host" in str(w.message)]
    t0 = time.perf_counter()
    out["one_host"] = _run(one, rank, range(2))
    out["one_host_wall"] = time.perf_counter() - t0
    out["one_host_stats"] = one.stats
    out["one_host_residuals"] = {k: float(v.abs().max()) for k, v in one.feedback.residuals.items()}
    # a host residual left by a compressing run's checkpoint is sent once in full, then cleared
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        left = _engine(f"topk:ratio={RATIO}", f"hierarchical:workers_per_host={WORLD}", error_feedback=True)
    if rank == 0:
        left.feedback.residuals["host/a.weight"] = _leftover()
    out["one_host_leftover"] = _run(left, rank, range(1))
    out["one_host_leftover_after"] = {k: float(v.abs().max()) for k, v in left.feedback.residuals.items()}
    out["algo_host"] = _algorithm_host_bytes(rank, spec)
    out["powersgd"] = _run(_engine("powersgd:rank=1", spec), rank, range(2), grads=_low_rank)
    # the environment route (torchrun's LOCAL_WORLD_SIZE, or GRADPRESS_WORKERS_PER_HOST)
    os.environ["GRADPRESS_WORKERS_PER_HOST"] = str(PER_HOST)
    out["env_none"] = _run(_engine("none", "hierarchical"), rank, range(1))
    # resume: 2 steps, state_dict, a new engine loads it and runs 2 more
    first = _engine(f"topk:ratio={RATIO}", spec + ",chunk=0", error_feedback=True)
    _run(first, rank, range(2))
    state = first.state_dict()
    second = _engine(f"topk:ratio={RATIO}", spec + ",chunk=0", error_feedback=True)
    second.load_state_dict(state)
    out["resumed"] = _run(second, rank, range(2, STEPS))
    # every rank raises alike on a bad layout
    os.environ["GRADPRESS_WORKERS_PER_HOST"] = "1" if rank == 3 else "2"
    out["disagree"] = _error(lambda: _engine("none", "hierarchical"))
    del os.environ["GRADPRESS_WORKERS_PER_HOST"]
    out["no_divide"] = _error(lambda: _engine("none", "hierarchical:workers_per_host=3"))
    out["bad_outer"] = _error(lambda: _engine("none", "hierarchical:outer=ps"))
    out["bad_param"] = _error(lambda: _engine("none", "allgather:workers_per_host=2"))
    out["vote"] = _error(lambda: _engine("signsgd", spec))
    out["ddp"], out["ddp_coalesced"] = _ddp(rank, ",chunk=0")
    out["ddp_piped"], out["ddp_piped_coalesced"] = _ddp(rank, f",chunk={CHUNK}")
    dist.barrier()
    return out


def _leftover() -> torch.Tensor:
    return torch.linspace(-1.0, 1.0, math.prod(SHAPES[0])).view(SHAPES[0])


def _algorithm_host_bytes(rank: int, spec: str) -> list[tuple[int, int]]:
    """(last_step_bytes, last_step_host_bytes) of localsgd:period=2 over
    the hierarchical strategy after each of 4 steps."""
    import gradpress.algorithms as algorithms

    torch.manual_seed(0)
    model = torch.nn.Linear(48, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    algo = algorithms.create("localsgd:period=2", model, opt, compressor=f"topk:ratio={RATIO}", strategy=spec,
                             min_numel=256)
    gen = torch.Generator().manual_seed(rank)
    out = []
    for _ in range(4):
        opt.zero_grad()
        model(torch.randn(8, 48, generator=gen)).square().mean().backward()
        algo.step()
        out.append((algo.stats["last_step_bytes"], algo.stats["last_step_host_bytes"]))
    return out


def _direct(rank: int, spec: str) -> dict:
    """The pipelined strategy called directly: contiguous tensors are
    averaged in place (the results are the inputs), non-contiguous ones
    (transposed views) through a fused copy that leaves them untouched."""
    from gradpress.compress import create
    from gradpress.compress.base import Context
    from gradpress.exchange.base import parse_strategy
    from gradpress.exchange.strategies.hierarchical import Hierarchical

    strategy = Hierarchical(None, **parse_strategy(spec)[1])
    none = create("none")
    ctxs = [Context(key=k, rank=rank, world_size=WORLD) for k in KEYS[:2]]
    grads = _grads(rank, 0)[:2]
    inputs = [g.clone() for g in grads]
    res = strategy.exchange(none, inputs, ctxs, None)
    transposed = [g.clone().t() for g in grads]
    before = [t.clone() for t in transposed]
    res_t = strategy.exchange(none, transposed, ctxs, None)
    mixed = [grads[0].clone().t(), grads[1].double()]  # non-contiguous fp32 and contiguous fp64
    res_m = strategy.exchange(none, mixed, ctxs, None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # one host: said once by the engine's test above
        one_host = Hierarchical(None, **parse_strategy(f"hierarchical:workers_per_host={WORLD}")[1])
    t0 = time.perf_counter()
    res_one = one_host.exchange(none, [g.clone() for g in grads], ctxs, None)
    wall_one = time.perf_counter() - t0
    return {"in_place": all(a is b for a, b in zip(res.tensors, inputs)),
            "one_host_times": (res_one.compress_s, res_one.comm_s, wall_one),
            "mixed": [t.clone() for t in res_m.tensors], "mixed_bytes": (res_m.bytes_sent, res_m.host_bytes),
            "contiguous": [t.clone() for t in res.tensors],
            "transposed": [t.clone() for t in res_t.tensors],
            "transposed_untouched": all(torch.equal(a, b) for a, b in zip(transposed, before))}


def _ddp(rank: int, extra: str = "") -> tuple[list[torch.Tensor], bool]:
    """A few DDP steps with qsgd between hosts: parameters after training,
    and whether the hook coalesced the step's buckets."""
    import gradpress

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.005)  # several buckets
    hook = gradpress.ddp.register(ddp, "qsgd:levels=8", strategy=f"hierarchical:workers_per_host={PER_HOST}{extra}",
                                  min_numel=256)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(3):
        x, y = torch.randn(16, 32, generator=gen), torch.randint(0, 4, (16,), generator=gen)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
    assert hook.stats["compressed_tensors"] > 0
    coalesced = hook.coalescing
    hook.close()
    return [p.detach().clone() for p in model.parameters()], coalesced


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_workers(_worker, WORLD)


def _identical(results: list[dict], name: str) -> list[list[torch.Tensor]]:
    first = results[0][name]
    for r in results[1:]:
        for a_step, b_step in zip(first, r[name]):
            for a, b in zip(a_step, b_step):
                assert torch.equal(a, b), name
    return first


def _mean64(grads, step: int) -> list[torch.Tensor]:  # noqa: ANN001
    per = [grads(r, step) for r in range(WORLD)]
    return [sum(p[i].double() for p in per) / WORLD for i in range(len(SHAPES))]


def test_none_is_the_exact_mean_on_every_rank(results: list[dict]) -> None:
    for name, steps in (("none", STEPS), ("ring_none", 2), ("env_none", 1)):
        got = _identical(results, name)
        for step in range(steps):
            for a, want in zip(got[step], _mean64(_grads, step)):
                assert torch.allclose(a.double(), want, rtol=1e-6, atol=1e-6), name


def _topk_rows(x: torch.Tensor, ratio: float, chunk: int) -> torch.Tensor:
    """top-k of each block of ``max(1, chunk // row length)`` whole rows
    (one block when ``chunk`` is 0 or the tensor fits), each keeping
    ``ceil(ratio * block size)``."""
    rows = x.shape[0]
    per = rows if not chunk or x.numel() <= chunk else max(1, chunk // (x.numel() // rows))
    blocks = [x[r : r + per] for r in range(0, rows, per)]
    return torch.cat([topk(b, ratio) for b in blocks])


def _reference_topk(steps: int, per_host: int = PER_HOST, chunk: int = 0,
                    beta: float = 1.0) -> list[list[torch.Tensor]]:
    """The two-level algorithm in float64: leader h keeps e_h; q_h = S_h / L + beta e_h;
    average = mean_h topk(q_h); e_h <- q_h - topk(q_h). 1-D tensors: plain mean.
    ``per_host=1``: flat allgather with every worker's own residual. ``chunk``:
    top-k per block of whole rows (the pipelined exchange's pieces)."""
    hosts = WORLD // per_host
    resid: dict[tuple[int, int], torch.Tensor] = {}
    outs = []
    for step in range(steps):
        per = [[g.double() for g in _grads(r, step)] for r in range(WORLD)]
        avg = []
        for i, shape in enumerate(SHAPES):
            if len(shape) == 1:
                avg.append(sum(p[i] for p in per) / WORLD)
                continue
            total = torch.zeros(shape, dtype=torch.float64)
            for h in range(hosts):
                q = sum(per[r][i] for r in range(h * per_host, (h + 1) * per_host)) / per_host
                q = q + beta * resid.get((h, i), torch.zeros(shape, dtype=torch.float64))
                sent = _topk_rows(q, RATIO, chunk)
                resid[(h, i)] = q - sent
                total += sent
            avg.append(total / hosts)
        outs.append(avg)
    return outs


def test_topk_with_feedback_at_the_leaders_matches_float64(results: list[dict]) -> None:
    got = _identical(results, "topk")
    for step, want_step in enumerate(_reference_topk(STEPS)):
        for a, want in zip(got[step], want_step):
            assert torch.allclose(a.double(), want, rtol=1e-5, atol=1e-5), step
    # the flat allgather of sparse packets (averaged without dense decodes) against the same reference
    flat = _identical(results, "flat_topk")
    for step, want_step in enumerate(_reference_topk(STEPS, per_host=1)):
        for a, want in zip(flat[step], want_step):
            assert torch.allclose(a.double(), want, rtol=1e-5, atol=1e-5), step
    # residuals: the host's at the leader (ranks 0 and 2), every worker's own is zero
    for r, res in enumerate(results):
        assert res["host_keys"] == (["a.weight", "b.weight"] if r % PER_HOST == 0 else [])
        assert res["worker_residual_max"] == 0.0


def test_the_leaders_residual_enters_scaled_by_the_feedback_beta(results: list[dict]) -> None:
    """q_h = S_h / L + beta e_h (the module doc) with beta = 0.5, which
    DiLoCo's ``residual_decay`` sets: unpipelined and in pieces, against the
    float64 two-level algorithm (the ``plants5`` session planted beta
    ignored at the leader: the residual added whole, every step after the
    first off)."""
    for name, chunk in (("topk_beta", 0), ("pipe_topk_beta", CHUNK)):
        got = _identical(results, name)
        for step, want_step in enumerate(_reference_topk(3, chunk=chunk, beta=BETA)):
            for a, want in zip(got[step], want_step):
                assert torch.allclose(a.double(), want, rtol=1e-5, atol=1e-5), (name, step)


def test_pipelined_pieces_match_float64_on_every_rank(results: list[dict]) -> None:
    """chunk=500: the exact mean in pieces; top-k per piece of whole rows
    with the host residual kept per tensor (and carried through a
    state_dict after step 2); fp16 pieces through the leaders' allreduce."""
    got = _identical(results, "pipe_none")
    for step in range(2):
        for a, want in zip(got[step], _mean64(_grads, step)):
            assert torch.allclose(a.double(), want, rtol=1e-6, atol=1e-6)
    got = _identical(results, "pipe_topk")
    for step, want_step in enumerate(_reference_topk(STEPS, chunk=CHUNK)):
        for a, want in zip(got[step], want_step):
            assert torch.allclose(a.double(), want, rtol=1e-5, atol=1e-5), step
    for r, res in enumerate(results):
        assert res["pipe_host_keys"] == (["a.weight", "b.weight"] if r % PER_HOST == 0 else [])
    for step, got_step in enumerate(_identical(results, "pipe_fp16")):
        for a, want in zip(got_step, _mean64(_grads, step)):
            assert torch.allclose(a.double(), want, rtol=2e-3, atol=2e-3)


def test_pipelined_direct_in_place_and_non_contiguous(results: list[dict]) -> None:
    want = _mean64(_grads, 0)[:2]
    for r, res in enumerate(results):
        got = res["pipe_direct"]
        assert got["in_place"] and got["transposed_untouched"]
        for a, b, w in zip(got["contiguous"], got["transposed"], want):
            assert torch.allclose(a.double(), w, rtol=1e-6, atol=1e-6)
            assert torch.allclose(b.double(), w.t(), rtol=1e-6, atol=1e-6)
        # mixed dtypes: each keeps its own, exact bytes (a worker hands its leader its tensors once)
        assert [t.dtype for t in got["mixed"]] == [torch.float32, torch.float64]
        assert torch.allclose(got["mixed"][0].double(), want[0].t(), rtol=1e-6, atol=1e-6)
        assert torch.allclose(got["mixed"][1], want[1], rtol=1e-12, atol=1e-12)
        inside = 4 * math.prod(SHAPES[0]) + 8 * math.prod(SHAPES[1])
        assert got["mixed_bytes"][1] == inside * (1 if r % PER_HOST else 2)
        if r % PER_HOST:
            assert got["mixed_bytes"][0] == inside
        for name in ("contiguous", "transposed", "mixed"):  # replicas bit-identical
            assert all(torch.equal(a, b) for a, b in zip(got[name], results[0]["pipe_direct"][name]))


def test_one_host_is_the_exact_mean_and_says_so(results: list[dict]) -> None:
    """workers_per_host = world size: no link between hosts, so no
    compression: the exact mean, bit-identical, the strategy's bytes inside
    the host (the engine's prelude, the plain 1-D tensor and the flags, is
    counted apart), no residual kept, and a warning that names the layout."""
    got = _identical(results, "one_host")
    for step in range(2):
        for a, want in zip(got[step], _mean64(_grads, step)):
            assert torch.allclose(a.double(), want, rtol=1e-6, atol=1e-6)
    dense = sum(4 * math.prod(s) for s in SHAPES[:2])
    prelude = 4 * (math.prod(SHAPES[2]) + len(SHAPES))
    # said once, by rank 0 (every rank has the same agreed layout)
    assert len(results[0]["one_host_warning"]) == 1 and f"workers_per_host={WORLD}" in results[0]["one_host_warning"][0]
    assert all(res["one_host_warning"] == [] for res in results[1:])
    for res in results:
        stats = res["one_host_stats"]
        assert stats["host_bytes"] == 2 * dense and stats["bytes_sent"] - stats["host_bytes"] == 2 * prelude
        assert not any(k.startswith("host/") for k in res["one_host_residuals"])
        assert 0 <= stats["comm_s"] + stats["compress_s"] <= res["one_host_wall"], (stats, res["one_host_wall"])
        compress_s, comm_s, wall = res["pipe_direct"]["one_host_times"]  # the strategy's own ExchangeResult
        assert compress_s == 0.0 and 0 < comm_s <= wall, (compress_s, comm_s, wall)
        assert all(v == 0.0 for v in res["one_host_residuals"].values())


def test_one_host_sends_a_leftover_host_residual_once(results: list[dict]) -> None:
    """A ``host/`` residual on the leader (a compressing run's checkpoint)
    joins the exact mean in full (mean + e) and is cleared."""
    got = _identical(results, "one_host_leftover")[0]
    want = _mean64(_grads, 0)
    assert torch.allclose(got[0].double(), want[0] + _leftover().double(), rtol=1e-6, atol=1e-6)
    assert torch.allclose(got[1].double(), want[1], rtol=1e-6, atol=1e-6)
    assert results[0]["one_host_leftover_after"]["host/a.weight"] == 0.0


def test_algorithm_step_counts_host_bytes_of_its_own_step(results: list[dict]) -> None:
    """localsgd:period=2: steps without an exchange report 0 host bytes,
    steps with one the dense host part (one reduce on a worker, reduce and
    broadcast on a leader), never more than the step's bytes."""
    dense = 4 * 48 * 64  # the weight (compressed); the bias is plain
    for r, res in enumerate(results):
        rows = res["algo_host"]
        assert [h for _, h in rows[0::2]] == [0, 0]
        assert all(h == dense * (1 if r % PER_HOST else 2) and h <= b for b, h in rows[1::2])


def test_pipelined_variable_size_packets_match_float64(results: list[dict]) -> None:
    """threshold with error feedback at the leaders, in pieces: elementwise,
    so the reference is per tensor: q = S_h / L + e_h; sent = q where |q| > tau."""
    hosts = WORLD // PER_HOST
    resid: dict[tuple[int, int], torch.Tensor] = {}
    got = _identical(results, "pipe_threshold")
    for step in range(3):
        per = [[g.double() for g in _grads(r, step)] for r in range(WORLD)]
        for i, shape in enumerate(SHAPES):
            if len(shape) == 1:
                want = sum(p[i] for p in per) / WORLD
            else:
                want = torch.zeros(shape, dtype=torch.float64)
                for h in range(hosts):
                    q = sum(per[r][i] for r in range(h * PER_HOST, (h + 1) * PER_HOST)) / PER_HOST
                    q = q + resid.get((h, i), torch.zeros(shape, dtype=torch.float64))
                    sent = torch.where(q.abs() > TAU, q, torch.zeros_like(q))
                    resid[(h, i)] = q - sent
                    want += sent / hosts
            assert torch.allclose(got[step][i].double(), want, rtol=1e-5, atol=1e-5), (step, i)


def test_resume_gives_the_same_next_steps(results: list[dict]) -> None:
    for res in results:
        for a_step, b_step in zip(res["topk"][2:], res["resumed"]):
            for a, b in zip(a_step, b_step):
                assert torch.equal(a, b)


def test_fp16_ring_and_powersgd_between_leaders(results: list[dict]) -> None:
    for step, got in enumerate(_identical(results, "fp16")):
        for a, want in zip(got, _mean64(_grads, step)):
            assert torch.allclose(a.double(), want, rtol=2e-3, atol=2e-3)
    for step, got in enumerate(_identical(results, "powersgd")):
        for a, want in zip(got, _mean64(_low_rank, step)):
            assert torch.allclose(a.double(), want, rtol=1e-4, atol=1e-4)
    ring = _identical(results, "ring_topk")
    assert all(bool(torch.isfinite(t).all()) for step in ring for t in step)


def test_bytes_leaders_carry_compressed_workers_dense(results: list[dict]) -> None:
    dense = sum(4 * math.prod(s) for s in SHAPES[:2])
    for r, res in enumerate(results):
        per_step = res["stats"]["bytes_sent"] / STEPS
        if r % PER_HOST:  # a worker hands its host leader its dense tensors (plus the small prelude)
            assert dense <= per_step < dense + 4 * 5000 + 64
        else:  # a leader: its dense part of the reduce, the broadcast, the prelude, the top-k packets
            assert 2 * dense + 4 * 5000 < per_step < 2 * dense + 4 * 5000 + 64 + 4 * RATIO * dense
        # the dense part stays inside the host, counted apart (unpipelined and pipelined alike)
        inside = dense * (1 if r % PER_HOST else 2)
        for stats, steps in ((res["stats"], STEPS), (res["pipe_stats"], 2)):
            assert stats["host_bytes"] == steps * inside and stats["last_step_host_bytes"] == inside


def test_ddp_hook_replicas_identical(results: list[dict]) -> None:
    """Several buckets; pipelined (chunk) the hook coalesces them by default."""
    for name in ("ddp", "ddp_piped"):
        first = results[0][name]
        for res in results[1:]:
            assert all(torch.equal(a, b) for a, b in zip(first, res[name]))
        assert all(bool(torch.isfinite(p).all()) for p in first)
    assert [res["ddp_coalesced"] for res in results] == [False] * WORLD
    assert [res["ddp_piped_coalesced"] for res in results] == [True] * WORLD


def test_bad_layouts_fail_on_every_rank(results: list[dict]) -> None:
    for res in results:
        assert "disagree" in res["disagree"] and "workers_per_host" in res["disagree"]
        assert "does not divide" in res["no_divide"]
        assert "'outer'" in res["bad_outer"] and "allgather" in res["bad_outer"]
        assert "takes no parameters" in res["bad_param"]
        assert "vote" in res["vote"] and "allgather" in res["vote"]


# ------------------------------------------------------------ auto plans it
#: a slow group, a fast link inside each host, an fp16-like wire (2 bytes per element)
_HOST_COSTS = {
    "allreduce": (2e-4, 2e-4, 1e-7), "allgather": (2e-4, 2e-4, 2e-7), "broadcast": (2e-4, 2e-4, 1e-7),
    "p2p": (2e-4, 2e-4, 1e-7), "encode": (2e-5, 2e-5, 5e-9), "decode": (1e-5, 1e-5, 2e-9),
    "wire": (0.0, 0.0, 2.0), "root_wire": (0.0, 0.0, 2.0), "intra_allreduce": (1e-5, 1e-5, 1e-11),
}


def _auto_worker(rank: int, world: int) -> dict:
    """``auto`` with injected costs: hierarchical is a candidate when every
    rank sees 2 workers per host (LOCAL_WORLD_SIZE), not when the
    environment says one per host or the ranks disagree."""
    out: dict = {}
    os.environ.pop("GRADPRESS_WORKERS_PER_HOST", None)
    os.environ["LOCAL_WORLD_SIZE"], os.environ["LOCAL_RANK"] = str(PER_HOST), str(rank % PER_HOST)
    eng = _engine("fp16", "auto", plan_costs=_HOST_COSTS)
    out["plan"] = {k: (d.strategy, sorted(d.costs)) for k, d in eng.plan.decisions.items()}
    out["fp16"] = _run(eng, rank, range(2))
    os.environ["LOCAL_WORLD_SIZE"] = "1"
    out["one_per_host"] = {k: sorted(d.costs) for k, d in _engine("fp16", "auto", plan_costs=_HOST_COSTS).plan.decisions.items()}
    os.environ["LOCAL_WORLD_SIZE"] = "1" if rank == 3 else str(PER_HOST)
    out["disagree"] = {k: sorted(d.costs) for k, d in _engine("fp16", "auto", plan_costs=_HOST_COSTS).plan.decisions.items()}
    del os.environ["LOCAL_WORLD_SIZE"], os.environ["LOCAL_RANK"]
    dist.barrier()
    return out


def test_auto_plans_hierarchical_with_several_workers_per_host() -> None:
    results = run_workers(_auto_worker, WORLD)
    for r in results:
        assert r["plan"]["a.weight"][0] == "hierarchical" and r["plan"]["b.weight"][0] == "hierarchical"
        assert r["plan"]["c.bias"][0] == "uncompressed"
        assert "hierarchical" in r["plan"]["a.weight"][1]
        for name in ("one_per_host", "disagree"):
            assert all("hierarchical" not in costs for costs in r[name].values()), name
            assert any(costs for costs in r[name].values()), name  # the planner did run
    got = _identical(results, "fp16")
    for step in range(2):
        for a, want in zip(got[step], _mean64(_grads, step)):
            # fp16 between the leaders: within fp16 rounding of the host means
            assert torch.allclose(a.double(), want, rtol=2e-3, atol=2e-3 * float(want.abs().max())), step
