"""The planner: cost fits, per-tensor decisions from injected measurements,
the plan table, bad input; when ``auto`` offers ``hierarchical``
(exchange/plans.py), and the pieces' invariant (exchange/pieces.py)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradpress.exchange.costs import CostModel, Fit
from gradpress.exchange.planner import MIN_GAIN, OPTIONS, Planner

PARAMS = [
    ("fc1.bias", 512, 4, False),
    ("tiny.weight", 64, 4, True),
    ("small.weight", 2_000, 4, True),
    ("mid.weight", 300_000, 4, True),
    ("big.weight", 4_000_000, 4, True),
]


def link(byte_s: float, latency: float = 2e-4) -> dict:
    """Costs of a link moving 1/byte_s bytes per second; a top-k-like
    compressor (8 bytes per kept element at 1%; the PS root at density x N)."""
    comm = (latency, latency, byte_s)
    return {
        "allreduce": comm, "allgather": (latency, latency, 2 * byte_s), "broadcast": comm, "p2p": comm,
        "encode": (2e-5, 2e-5, 5e-9), "decode": (1e-5, 1e-5, 2e-9),
        "wire": (0.0, 8.0, 0.08), "root_wire": (0.0, 8.0, 0.32),
    }


SLOW = link(1e-7)   # 10 MB/s
FAST = link(1e-11)  # 100 GB/s


@pytest.mark.parametrize("world", [2, 4, 8])
def test_slow_link_compresses_large_keeps_tiny(world):
    plan = Planner.from_costs(SLOW, world).plan(PARAMS)
    d = plan.decisions
    assert d["fc1.bias"].strategy == "uncompressed" and d["fc1.bias"].reason
    assert d["tiny.weight"].strategy == "uncompressed"
    assert d["big.weight"].compressed and d["mid.weight"].compressed
    for key in ("mid.weight", "big.weight"):
        costs = d[key].costs
        assert d[key].predicted_s == min(costs.values())
        assert d[key].predicted_s < costs["uncompressed"]


@pytest.mark.parametrize("world", [2, 4])
def test_ps_partitions_grow_with_size(world):
    # HiPress's example: PS only; tiny stays dense, large ones split across ranks
    plan = Planner.from_costs(SLOW, world, candidates=("ps",)).plan(PARAMS)
    d = plan.decisions
    assert d["tiny.weight"].strategy == "uncompressed"
    assert d["big.weight"].strategy == "ps" and d["big.weight"].parts > 1
    assert d["big.weight"].parts <= world
    assert d["mid.weight"].parts <= d["big.weight"].parts


def test_fast_link_compresses_nothing():
    plan = Planner.from_costs(FAST, 4).plan(PARAMS)
    assert all(d.strategy == "uncompressed" for d in plan.decisions.values()), plan.table()


def test_summable_prefers_allreduce_when_it_is_cheapest():
    costs = dict(SLOW, wire=(0.0, 0.0, 2.0), root_wire=(0.0, 0.0, 2.0))  # fp16-like
    plan = Planner.from_costs(costs, 4, summable=True).plan(PARAMS)
    big = plan.decisions["big.weight"]
    assert big.compressed and "allgather" not in big.costs
    assert big.costs["allreduce"] < big.costs["uncompressed"]


def test_table_lists_every_tensor():
    plan = Planner.from_costs(SLOW, 4).plan(PARAMS)
    table = plan.table()
    for key, *_ in PARAMS:
        assert key in table
    assert "decision" in table.splitlines()[1]
    assert plan.summary()["uncompressed"] >= 2
    assert set(plan.to_dict()) == {k for k, *_ in PARAMS}


@settings(max_examples=30, deadline=None)
@given(
    a=st.floats(1e-6, 1e-2), b=st.floats(1e-12, 1e-6),
    sizes=st.lists(st.integers(1, 10**8), min_size=2, max_size=6, unique=True),
)
def test_fit_recovers_a_line(a, b, sizes):
    fit = Fit.least_squares(sizes, [a + b * x for x in sizes])
    for x in sizes:
        assert fit(x) == pytest.approx(a + b * x, rel=1e-6)
    assert fit.overhead == pytest.approx(min(a + b * x for x in sizes))


@settings(max_examples=30, deadline=None)
@given(world=st.integers(1, 16), numel=st.integers(1, 10**8), byte_s=st.floats(1e-12, 1e-5))
def test_decision_is_deterministic_and_valid(world, numel, byte_s):
    planner = Planner.from_costs(link(byte_s), world)
    d1, d2 = planner.decide("w", numel), planner.decide("w", numel)
    assert d1 == d2
    assert d1.strategy in OPTIONS and 1 <= d1.parts <= max(1, world)
    best = min(d1.costs.values())
    flat = d1.costs["uncompressed"]
    if best < flat * (1 - MIN_GAIN):  # compression pays by the planner's margin: the cheapest option wins
        assert d1.predicted_s == best and d1.compressed
    else:  # a near tie (or dense is cheapest) stays dense
        assert d1.strategy == "uncompressed" and d1.predicted_s == flat


def test_cost_model_round_trips_through_a_tensor():
    model = CostModel.from_mapping(SLOW)
    assert CostModel.from_tensor(model.to_tensor()) == model


@pytest.mark.parametrize("bad, field", [
    ({**SLOW, "bogus": (0, 0, 0)}, "bogus"),
    ({k: v for k, v in SLOW.items() if k != "p2p"}, "p2p"),
    ({**SLOW, "encode": (0, 0, -1)}, "encode"),
    ({**SLOW, "decode": "fast"}, "decode"),
])
def test_bad_costs_name_the_field(bad, field):
    with pytest.raises(ValueError, match=field):
        CostModel.from_mapping(bad)


def test_bad_candidates():
    with pytest.raises(ValueError, match="gossip"):
        Planner.from_costs(SLOW, 4, candidates=("gossip",))
    with pytest.raises(ValueError, match="summable"):
        Planner.from_costs(SLOW, 4, summable=False, candidates=("allreduce",))


def _fit(t: tuple, x: float) -> float:
    o, a, b = t
    return max(o, a + b * x)


#: fp16-like summable wire; a fast link inside each host
FP16_HOSTS = dict(SLOW, wire=(0.0, 0.0, 2.0), root_wire=(0.0, 0.0, 2.0), intra_allreduce=(1e-5, 1e-5, 1e-11))


@pytest.mark.parametrize("summable", [True, False])
def test_hierarchical_prediction_follows_its_formula(monkeypatch, summable):
    """2 hosts x 2 workers (LOCAL_WORLD_SIZE=2), N = 4, fp32: the dense
    reduce and broadcast inside the host, 4 d bytes over the leader's host
    link each, AR_host(4 d L / (2 (L-1))) = AR_host(4 d) each, then the
    leaders' pipelined exchange (the wire or the codec, whichever is
    longer): summable 2 (H-1)/H c(d) per link, max(AR(c(d) N / (2 (N-1))),
    ENC + DEC), else (H-1) c(d), max(AG(c(d) / (N-1)), ENC + H DEC);
    computed here from the injected fits (other layouts and dtypes:
    tests/test_hierarchical_costs.py)."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.delenv("GRADPRESS_WORKERS_PER_HOST", raising=False)
    cands = ("allreduce", "hierarchical") if summable else ("allgather", "hierarchical")
    planner = Planner.from_costs(FP16_HOSTS, 4, summable=summable, candidates=cands)
    d = 4_000_000
    c = FP16_HOSTS
    inner = 2 * _fit(c["intra_allreduce"], 4 * d)
    wire = _fit(c["wire"], d)
    if summable:
        outer = max(_fit(c["allreduce"], wire * 4 / 6), _fit(c["encode"], d) + _fit(c["decode"], d))
    else:
        outer = max(_fit(c["allgather"], wire / 3), _fit(c["encode"], d) + 2 * _fit(c["decode"], d))
    got = planner.option_costs(d)["hierarchical"]
    assert got[0] == pytest.approx(inner + outer, rel=1e-12) and got[1] == 1
    decision = planner.decide("big.weight", d)
    assert decision.strategy == "hierarchical", decision.costs
    # without a host-level fit the inner steps cost the group's allreduce: dense in the host no longer pays
    slow_hosts = {k: v for k, v in FP16_HOSTS.items() if k != "intra_allreduce"}
    decision = Planner.from_costs(slow_hosts, 4, summable=summable, candidates=cands).decide("big.weight", d)
    assert decision.strategy != "hierarchical", decision.costs


def test_intra_allreduce_is_optional_and_round_trips():
    with_intra = CostModel.from_mapping(FP16_HOSTS)
    assert with_intra.intra_allreduce == Fit(1e-5, 1e-5, 1e-11)
    assert with_intra.intra_host_allreduce(1e6) == pytest.approx(1e-5 + 1e-11 * 1e6)
    assert CostModel.from_mapping(with_intra.to_json()) == with_intra
    without = CostModel.from_mapping(SLOW)
    assert without.intra_allreduce is None and "intra_allreduce" not in without.fits()
    assert without.intra_host_allreduce(1e6) == without.allreduce(1e6)
    with pytest.raises(ValueError, match="intra_allreduce"):
        CostModel.from_mapping({**SLOW, "intra_allreduce": (0, 0, -1)})


@pytest.mark.parametrize("xs, ts", [([], []), ([1.0, 2.0], [1.0]), ([1.0], [1.0, 2.0])])
def test_fit_refuses_unequal_or_empty_measurements(xs, ts):
    with pytest.raises(ValueError, match=f"need equally many sizes and times, got {len(xs)} and {len(ts)}"):
        Fit.least_squares(xs, ts)


def test_a_strategy_with_the_documented_predict_signature_is_planned(monkeypatch):
    """docs/architecture.md tells a strategy author to implement
    ``predict(costs, numel, world_size, summable)``; the planner (which now
    also gives ``elem_size`` to the strategies that take it) must still plan
    with such a strategy, by its own prediction."""
    from gradpress.exchange import planner as planner_module
    from gradpress.exchange.base import _STRATEGIES, Strategy

    calls = []

    class DocStyle(Strategy):
        name = "docstyle"

        @classmethod
        def predict(cls, costs, numel, world_size, summable):  # noqa: ANN001, ANN206 - the documented signature
            calls.append((numel, world_size, summable))
            return 1e-9 * numel, 1

    monkeypatch.setitem(_STRATEGIES.classes, "docstyle", DocStyle)
    monkeypatch.setattr(planner_module, "OPTIONS", (*OPTIONS, "docstyle"))
    planner = Planner.from_costs(SLOW, 4, candidates=("allgather", "docstyle"))
    costs = planner.option_costs(4_000_000, elem_size=2)
    assert costs["docstyle"] == (pytest.approx(4e-3), 1) and calls == [(4_000_000, 4, False)]
    assert planner.decide("big.weight", 4_000_000).strategy == "docstyle"


@pytest.mark.parametrize("per, world, offered", [(2, 4, True), (4, 4, False), (1, 4, False), (3, 4, False),
                                                 (2, 8, True), (8, 8, False), (4, 8, True)])
def test_auto_offers_hierarchical_only_across_several_hosts(monkeypatch, per, world, offered):
    """exchange/plans.py: ``auto`` adds ``hierarchical`` when every rank sees
    the same L > 1 workers per host, L dividing the group into more than one
    host (N / L > 1). One host (L = N) has no slow link to spare: not offered
    (the ``plants5`` session planted ``N / L >= 1``). Checked with the layout
    read from the environment, outside a process group (no collective)."""
    from gradpress.exchange.plans import StrategyChoice

    monkeypatch.setenv("GRADPRESS_WORKERS_PER_HOST", str(per))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    choice = StrategyChoice.__new__(StrategyChoice)
    choice.world_size = world
    want = per > 1 and world % per == 0 and world // per > 1
    assert want is offered
    assert choice._several_per_host() is offered


def test_pieces_are_whole_rows_covering_each_tensor_in_order_at_their_flat_offsets():
    """exchange/pieces.py's invariant: the pieces of a tensor are contiguous,
    disjoint and cover it in order, each at most ``chunk`` entries of whole
    rows (or one row where a row is larger), and a piece's ``offset`` indexes
    the call's flat concatenation of its tensors: the entries there are the
    piece's own (the ``plants5`` session planted an offset counted in rows)."""
    from gradpress.exchange.pieces import cut

    shapes = [(10, 7), (50,), (3, 4, 2), (2, 30), (4, 5), ()]
    chunk = 20
    tensors, start = [], 0
    for s in shapes:
        n = 1
        for k in s:
            n *= k
        tensors.append(torch.arange(start, start + n, dtype=torch.float64).reshape(s))
        start += n
    flat = torch.cat([t.reshape(-1) for t in tensors])
    pieces = cut(tensors, chunk)
    for i, t in enumerate(tensors):
        mine = [p for p in pieces if p.tensor == i]
        assert [p.part for p in mine] == list(range(len(mine))) and all(p.parts == len(mine) for p in mine)
        rows = t.shape[0] if t.dim() else 1
        assert mine[0].row0 == 0 and mine[-1].row1 == rows
        assert all(a.row1 == b.row0 for a, b in zip(mine, mine[1:]))
        assert sum(p.numel for p in mine) == t.numel()
        row_len = t.numel() // rows
        for p in mine:
            assert p.numel <= max(chunk, row_len) or len(mine) == 1
            assert torch.equal(flat[p.offset : p.offset + p.numel], p.of(t).reshape(-1)), (i, p)
    # (10, 7): 2 rows (14 entries) a piece; (50,): 20 a piece; (2, 30): one row each; (4, 5) fits
    assert [sum(p.tensor == i for p in pieces) for i in range(len(shapes))] == [5, 3, 2, 2, 1, 1]
