"""Gossip algorithms (SGP, D-PSGD, CHOCO-SGD) against float64 references the
test computes itself from the papers' update rules (no gradpress code in the
references: graphs, weights and PushSum are written out here), on 3 and 4
gloo workers."""

from __future__ import annotations

import math
import time

import pytest
import torch
import torch.distributed as dist
from distributed import run_workers

import gradpress.algorithms as algorithms

LR = 0.1
SHAPE = (16, 64)  # 1024 entries, 2-D: compressed when a compressor is asked for (min_numel=0)


class Vec(torch.nn.Module):
    """One float64 parameter whose gradient the test sets by hand."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(SHAPE, dtype=torch.float64))


def start(rank: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(100 + rank), dtype=torch.float64)


def make_mlp() -> torch.nn.Module:
    torch.manual_seed(7)
    return torch.nn.Sequential(torch.nn.Linear(6, 40), torch.nn.Tanh(), torch.nn.Linear(40, 3)).double()


def loss_of(model: torch.nn.Module, rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, 6, generator=g, dtype=torch.float64)
    return torch.nn.functional.mse_loss(model(x), torch.sin(x[:, :3] * 2.0))


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


# ------------------------------------------------------------- references
def exp_offsets(n: int) -> list[int]:
    """SGP's directed exponential graph: hops 2^0 .. 2^floor(log2(n - 1))."""
    return [2 ** i for i in range(int(math.floor(math.log2(n - 1))) + 1)]


def ref_pushsum(v: list[torch.Tensor], rounds: int, tau: int, lr: float = 0.0,
                grad=None, peers: int = 1, gamma: float = 1.0) -> list[tuple[list[torch.Tensor], list[float]]]:  # noqa: ANN001
    """PushSum with ``peers`` = k out-peers per round (the offsets
    ``offs[(t k + j) mod L]``, j < k), each given gamma/(k+1) of (x, w), the
    rest kept (P_gamma = (1 - gamma) I + gamma P; k = 1, gamma = 1: weights
    1/2); the messages of round t absorbed at the start of round t + tau
    (tau = 0: at once); an optional gradient step x_i -= lr * grad(i, t, z_i),
    with z_i = x_i / w_i as it was when the round began. Returns (x, w) after
    every round."""
    n = len(v)
    offs = exp_offsets(n)
    share = gamma / (peers + 1)
    keep = 1.0 - peers * share
    x, w = [t.clone() for t in v], [1.0] * n
    flight: dict[int, list] = {}
    out = []

    def absorb(r: int) -> None:
        for dst, xs, ws in flight.pop(r, []):
            x[dst] = x[dst] + xs
            w[dst] = w[dst] + ws

    for t in range(rounds):
        g = [grad(i, t, x[i] / w[i]) for i in range(n)] if grad is not None else None
        if tau:
            absorb(t - tau)
        if g is not None:
            x = [x[i] - lr * g[i] for i in range(n)]
        outs = [offs[(t * peers + j) % len(offs)] for j in range(peers)]
        flight[t] = [((i + o) % n, x[i] * share, w[i] * share) for i in range(n) for o in outs]
        x, w = [xi * keep for xi in x], [wi * keep for wi in w]
        if not tau:
            absorb(t)
        out.append(([xi.clone() for xi in x], list(w)))
    return out


def ring(n: int) -> torch.Tensor:
    """W of the ring: 1/3 for itself and each of i +- 1 (n >= 4)."""
    w = torch.zeros(n, n, dtype=torch.float64)
    for i in range(n):
        for j in (i - 1, i, i + 1):
            w[i, j % n] = 1.0 / 3.0
    return w


def mlp_grad(flat_params: torch.Tensor, rank: int, step: int) -> torch.Tensor:
    m = make_mlp()
    torch.nn.utils.vector_to_parameters(flat_params.clone(), m.parameters())
    loss_of(m, rank, step).backward()
    return torch.cat([p.grad.reshape(-1) for p in m.parameters()])


# ---------------------------------------------------------------- workers
def consensus_run(rank: int, world: int, spec: str, comp: str | None, rounds: int) -> dict:
    """Distinct starts v_i (one step of lr 1 with gradient p - v_i), then lr 0."""
    model = Vec()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    algo = algorithms.create(spec, model, opt, compressor=comp, min_numel=0)
    began = time.perf_counter()
    model.w.grad = model.w.detach() - start(rank)
    algo.step()
    opt.param_groups[0]["lr"] = 0.0
    hist = []
    for _ in range(rounds):
        hist.append({"x": algo.x[0].clone() if hasattr(algo, "x") else model.w.detach().clone(),
                     "w": float(algo.w) if hasattr(algo, "w") else 1.0, "z": model.w.detach().clone()})
        model.w.grad = torch.zeros_like(model.w)
        algo.step()
    hist.append({"x": algo.x[0].clone() if hasattr(algo, "x") else model.w.detach().clone(),
                 "w": float(algo.w) if hasattr(algo, "w") else 1.0, "z": model.w.detach().clone()})
    wall = time.perf_counter() - began
    avg = algo.eval_model().w.detach().clone()
    return {"hist": hist, "avg": avg, "stats": algo.stats, "wall": wall}


def _with_grads(rank: int, world: int, spec: str, comp: str | None, steps: int) -> dict:
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    algo = algorithms.create(spec, model, opt, compressor=comp)
    out = []
    for step in range(steps):
        opt.zero_grad()
        loss_of(model, rank, step).backward()
        algo.step()
        out.append(flat(model))
    return {"params": out, "stats": algo.stats, "describe": algo.describe()}


def _quadratic(rank: int, world: int, spec: str, comp: str | None, steps: int) -> dict:
    """f_i(z) = |z - c_i|^2 / 2 with nearby optima; lr 0.5 / (1 + t/10)."""
    model = Vec()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    algo = algorithms.create(spec, model, opt, compressor=comp, min_numel=0)
    c = start(0) + 0.1 * start(10 + rank)
    for t in range(steps):
        opt.param_groups[0]["lr"] = 0.5 / (1 + t / 10)
        model.w.grad = model.w.detach() - c
        algo.step()
    return {"z": model.w.detach().clone(), "avg": algo.eval_model().w.detach().clone(), "c": c}


#: overlap tau -> the exact SGP with two out-peers per round and lazy mixing (gamma 0.5)
LAZY = {0: "sgp:peers=2,gamma=0.5", 2: "sgp:peers=2,gamma=0.5,overlap=2"}

#: (spec, compressor) -> (compress_s, comm_s) per step under a clock that ticks 1 s per reading:
#: the phases each algorithm's step times, read off its update rule's order (post, overlap, wait, mix)
TICKED = {("dpsgd", None): (0, 2), ("choco:gamma=0.5", "topk:ratio=0.1"): (2, 1), ("sgp", None): (1, 1),
          ("sgp:overlap=1", None): (1, 2)}


def _ticked(rank: int, spec: str, comp: str | None, steps: int = 3) -> tuple[float, float]:
    model = Vec()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    algo = algorithms.create(spec, model, opt, compressor=comp, min_numel=0)
    readings = iter(range(10**6))
    algo.clock = lambda: float(next(readings))  # every phase boundary one tick later than the last
    for _ in range(steps):
        model.w.grad = model.w.detach() - start(rank)
        algo.step()
    return algo.stats["compress_s"] / steps, algo.stats["comm_s"] / steps


def _workers4(rank: int, world: int) -> dict:
    out: dict = {}
    for spec, comp in (("sgp", None), ("sgp:overlap=1", None), ("sgp:overlap=2", None),
                       ("sgp:gamma=0.3", "topk:ratio=0.1"), ("choco:gamma=0.1", "topk:ratio=0.1")):
        out[("consensus", spec, comp)] = consensus_run(rank, world, spec, comp, 300 if comp else 150)
    for spec in LAZY.values():  # two out-peers per round and lazy mixing, exact
        out[("consensus", spec, None)] = consensus_run(rank, world, spec, None, 100)
    for spec, comp in (("sgp", None), ("sgp:overlap=1", None), ("choco:gamma=1.0", "none"),
                       ("dpsgd", None), ("dpsgd:topology=exponential", None)):
        out[("grads", spec, comp)] = _with_grads(rank, world, spec, comp, 6)
    for spec, comp in (("sgp", None), ("dpsgd", None), ("choco:gamma=0.1", "topk:ratio=0.01")):
        out[("quadratic", spec, comp)] = _quadratic(rank, world, spec, comp, 400)
    for spec, comp in TICKED:
        out[("ticked", spec, comp)] = _ticked(rank, spec, comp)
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def four() -> list[dict]:
    return run_workers(_workers4, 4)


# ------------------------------------------------------------------- tests
def check_pushsum(results: list[dict], key, tau: int, peers: int = 1, gamma: float = 1.0) -> None:  # noqa: ANN001
    """The (x, w) of every rank after every round equal the hand-computed
    PushSum's; sums preserved; z reaches the initial average. (3 workers:
    tests/test_gossip_state.py, whose 3-worker run records them.)"""
    n = len(results)
    v = [start(r) for r in range(n)]
    rounds = len(results[0][key]["hist"])
    ref = ref_pushsum(v, rounds, tau, peers=peers, gamma=gamma)
    for t in range(rounds):
        xs, ws = ref[t]
        for r in range(n):
            got = results[r][key]["hist"][t]
            assert torch.allclose(got["x"], xs[r], rtol=0, atol=1e-13), (t, r)
            assert got["w"] == pytest.approx(ws[r], abs=1e-15)
    total = sum(v)
    final = results[0][key]["hist"][-1]
    if tau == 0:  # nothing in flight: the sums of x and w are exactly those of the start
        assert torch.allclose(sum(r[key]["hist"][-1]["x"] for r in results), total, rtol=0, atol=1e-12)
        assert sum(r[key]["hist"][-1]["w"] for r in results) == n
    for r in results:  # de-biased z converges to the initial average (delays slow it down)
        assert torch.allclose(r[key]["hist"][-1]["z"], total / n, rtol=0, atol=1e-12 if tau == 0 else 1e-5), final
        assert torch.allclose(r[key]["avg"], total / n, rtol=0, atol=1e-12 if tau == 0 else 1e-5)


@pytest.mark.parametrize("tau", [0, 1, 2])
def test_pushsum_matches_hand_computed_graph_on_4(four: list[dict], tau: int) -> None:
    spec = "sgp" if tau == 0 else f"sgp:overlap={tau}"
    check_pushsum(four, ("consensus", spec, None), tau)


@pytest.mark.parametrize("tau,spec", list(LAZY.items()))
def test_pushsum_with_two_peers_and_lazy_mixing_matches_hand_computed_graph(four: list[dict], tau: int,
                                                                            spec: str) -> None:
    """k = 2 out-peers per round (both offsets of 4 nodes), gamma = 0.5:
    each gets gamma/(k+1) = 1/6 of (x, w) and 1 - k gamma/(k+1) = 2/3 stays
    (a node that kept 1 - gamma/(k+1), as with one peer, created mass)."""
    check_pushsum(four, ("consensus", spec, None), tau, peers=2, gamma=0.5)


@pytest.mark.parametrize("spec,comp", [("sgp:gamma=0.3", "topk:ratio=0.1"), ("choco:gamma=0.1", "topk:ratio=0.1")])
def test_compressed_gossip_keeps_the_average_and_reaches_consensus(four: list[dict], spec: str, comp: str) -> None:
    res = [r[("consensus", spec, comp)] for r in four]
    mean = sum(start(r) for r in range(4)) / 4
    for t in range(len(res[0]["hist"])):  # mass conservation: every round, to rounding
        xs = sum(r["hist"][t]["x"] for r in res)
        assert torch.allclose(xs / 4, mean, rtol=0, atol=1e-12), t
        assert sum(r["hist"][t]["w"] for r in res) == pytest.approx(4.0, abs=1e-12)
    first = max(float((r["hist"][1]["z"] - mean).norm()) for r in res)
    for r in res:
        assert float((r["hist"][-1]["z"] - mean).norm()) < 1e-5 * first
    assert res[0]["stats"]["ratio"] > 3.0, res[0]["stats"]


def test_sgp_with_gradients_matches_pushsum_sgd(four: list[dict]) -> None:
    """x_i <- x_i - lr g(z_i), push half of (x, w), z = x / w; with overlap
    the weights leave 1 and the de-biasing matters."""
    for tau, spec in ((0, "sgp"), (1, "sgp:overlap=1")):
        x0 = flat(make_mlp())
        ref = ref_pushsum([x0.clone() for _ in range(4)], 6, tau, LR, lambda i, t, z: mlp_grad(z, i, t))
        for t in range(6):
            xs, ws = ref[t]
            for r in range(4):
                got = four[r][("grads", spec, None)]["params"][t]
                assert torch.allclose(got, xs[r] / ws[r], rtol=0, atol=1e-12), (spec, t, r)


def _ref_decentralized(steps: int, w: torch.Tensor, combine_first: bool) -> list[list[torch.Tensor]]:
    n = w.shape[0]
    x = [flat(make_mlp()) for _ in range(n)]
    out = []
    for t in range(steps):
        g = [mlp_grad(x[i], i, t) for i in range(n)]
        if combine_first:  # Lian et al.: x_i <- sum_j w_ij x_j - lr g_i(x_i)
            x = [sum(w[i, j] * x[j] for j in range(n)) - LR * g[i] for i in range(n)]
        else:  # adapt, then combine: x_i <- sum_j w_ij (x_j - lr g_j(x_j))
            half = [x[j] - LR * g[j] for j in range(n)]
            x = [sum(w[i, j] * half[j] for j in range(n)) for i in range(n)]
        out.append([xi.clone() for xi in x])
    return out


@pytest.mark.parametrize("spec,w,combine_first", [
    ("choco:gamma=1.0", ring(4), False),
    ("dpsgd", ring(4), True),
    ("dpsgd:topology=exponential", torch.full((4, 4), 0.25, dtype=torch.float64), True),  # +-1, +-2 on 4: complete
])
def test_decentralized_sgd_matches_its_definition(four: list[dict], spec: str, w: torch.Tensor,
                                                  combine_first: bool) -> None:
    comp = "none" if spec.startswith("choco") else None
    ref = _ref_decentralized(6, w, combine_first)
    for t in range(6):
        for r in range(4):
            got = four[r][("grads", spec, comp)]["params"][t]
            assert torch.allclose(got, ref[t][r], rtol=0, atol=1e-12), (spec, t, r)


def test_stats_times_fit_in_the_run(four: list[dict]) -> None:
    """Every gossip run's compress and communication seconds are >= 0 and
    together fit in the wall time the test measured around its steps;
    a compressed run spends some time compressing."""
    for r in four:
        for key, res in r.items():
            if key[0] != "consensus":
                continue
            st = res["stats"]
            assert st["compress_s"] >= 0 and st["comm_s"] >= 0, (key, st["compress_s"], st["comm_s"])
            assert st["compress_s"] + st["comm_s"] <= res["wall"], (key, st["compress_s"], st["comm_s"], res["wall"])
            if key[2]:
                assert st["compress_s"] > 0, key


@pytest.mark.parametrize("case", list(TICKED), ids=lambda c: c[0])
def test_stats_times_add_the_right_phases(four: list[dict], case: tuple) -> None:
    """With a clock that ticks once per reading, each step's compress and
    communication seconds are exact counts of the phases they cover: a
    phase left out, counted twice or combined wrongly changes them."""
    for r in four:
        assert r[("ticked", *case)] == TICKED[case], (case, r[("ticked", *case)])


def test_stats_count_the_bytes_handed_to_sends(four: list[dict]) -> None:
    model_bytes = sum(p.numel() * 8 for p in make_mlp().parameters())
    for r in four:
        sgp = r[("grads", "sgp", None)]["stats"]
        assert sgp["bytes_sent"] == 6 * (model_bytes + 8)  # one out-peer, parameters and the PushSum weight
        assert sgp["dense_bytes"] == 6 * model_bytes and sgp["steps"] == 6 and sgp["exchanges"] == 6
        ring_ = r[("grads", "dpsgd", None)]["stats"]
        assert ring_["bytes_sent"] == 6 * 2 * model_bytes  # two ring neighbours
        complete = r[("grads", "dpsgd:topology=exponential", None)]["stats"]
        assert complete["bytes_sent"] == 6 * 3 * model_bytes
        assert r[("grads", "dpsgd", None)]["describe"] == {"algorithm": "dpsgd:topology=ring", "compressor": "none",
                                                           "strategy": "gossip", "error_feedback": False}
    # CHOCO with top-k 10% on one 1024-entry tensor: k = 103 values (8 B) + indices (4 B), to 2 neighbours
    choco = four[0][("consensus", "choco:gamma=0.1", "topk:ratio=0.1")]["stats"]
    assert choco["bytes_sent"] == choco["steps"] * 2 * 103 * 12
    assert choco["eval_bytes"] > 0 and choco["consensus_distance"] is not None


@pytest.mark.parametrize("spec,comp,node_tol", [("sgp", None, 2e-3), ("dpsgd", None, 5e-3),
                                                ("choco:gamma=0.1", "topk:ratio=0.01", 0.1)])
def test_quadratic_converges_to_the_optimum(four: list[dict], spec: str, comp: str | None, node_tol: float) -> None:
    res = [r[("quadratic", spec, comp)] for r in four]
    opt = sum(r["c"] for r in res) / 4
    scale = float(opt.norm())
    for r in res:
        assert float((r["avg"] - opt).norm()) / scale < 1e-6
        assert float((r["z"] - opt).norm()) / scale < node_tol
