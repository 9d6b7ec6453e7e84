"""The planner's prediction for ``hierarchical``: bytes per link by formula.

The test counts the bytes itself, by moving real tensors of the dtype
through the messages of each step (a pipelined chain reduce onto the
leader, a chain broadcast from it, a ring allreduce or an allgather among
the leaders), and reads the leader's links; then the predicted seconds
against the fits read at those bytes, through the planner, for several
host layouts and dtypes.
"""

from __future__ import annotations

import pytest
import torch

from gradpress.exchange.costs import CostModel, Fit
from gradpress.exchange.planner import Planner

LAYOUTS = [(2, 2), (2, 4), (4, 2), (3, 3), (2, 1)]  # (hosts, workers per host)
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
NUMEL = 3000
COSTS = {
    "allreduce": (2e-4, 2e-4, 1e-7), "allgather": (2e-4, 2e-4, 2e-7), "broadcast": (2e-4, 2e-4, 1e-7),
    "p2p": (2e-4, 2e-4, 1e-7), "encode": (2e-5, 2e-5, 5e-9), "decode": (1e-5, 1e-5, 2e-9),
    "wire": (0.0, 0.0, 0.75), "root_wire": (0.0, 0.0, 0.75),
}
INTRA = (1e-5, 1e-5, 1e-10)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _count(per: int, hosts: int, dtype: torch.dtype, packet: int, summable: bool) -> tuple[int, int, float]:
    """(bytes into the leader in the reduce, bytes out of it in the broadcast,
    bytes from the other leaders into one leader), by moving the messages."""
    grads = [torch.ones(NUMEL, dtype=dtype) for _ in range(per)]
    messages = []  # (from, to, tensor) inside the host; rank 0 is the leader
    partial = grads[-1]
    for r in range(per - 2, -1, -1):  # chain reduce: rank r + 1 hands its partial sum to rank r
        messages.append(("reduce", r + 1, r, partial))
        partial = partial + grads[r]
    average = partial / (per * hosts)
    for r in range(1, per):  # chain broadcast: rank r - 1 hands the average on to rank r
        messages.append(("broadcast", r - 1, r, average.clone()))
    into = sum(_nbytes(t) for step, _, dst, t in messages if step == "reduce" and dst == 0)
    out = sum(_nbytes(t) for step, src, _, t in messages if step == "broadcast" and src == 0)
    packets = [torch.zeros(packet, dtype=torch.uint8) for _ in range(hosts)]
    arrived = [0] * hosts
    if summable:  # ring allreduce: H - 1 reduce-scatter and H - 1 allgather hops of one chunk each
        chunks = [list(p.tensor_split(hosts)) for p in packets]
        for phase in range(2):
            for hop in range(hosts - 1):
                for h in range(hosts):
                    c = (h - hop - phase) % hosts
                    arrived[(h + 1) % hosts] += _nbytes(chunks[h][c])
    else:  # allgather: every other leader's packet arrives
        for h in range(hosts):
            arrived[h] += sum(_nbytes(packets[o]) for o in range(hosts) if o != h)
    return into, out, arrived[0]


@pytest.mark.parametrize("summable", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("hosts", "per"), LAYOUTS)
def test_link_bytes_are_what_the_messages_carry(hosts: int, per: int, dtype: torch.dtype, summable: bool) -> None:
    from gradpress.exchange.strategies.hierarchical_costs import link_bytes

    packet = 1200 * hosts  # a whole number of bytes per ring chunk
    into, out, outer = _count(per, hosts, dtype, packet, summable)
    got = link_bytes(NUMEL, torch.empty(0, dtype=dtype).element_size(), per, hosts, packet, summable)
    assert (got.reduce, got.broadcast, got.outer) == (into, out, outer)
    assert got.reduce == (NUMEL * torch.empty(0, dtype=dtype).element_size() if per > 1 else 0)


@pytest.mark.parametrize("intra", [True, False])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize(("hosts", "per"), [(2, 2), (2, 4), (4, 2)])
@pytest.mark.parametrize("summable", [True, False])
def test_planner_reads_the_fits_at_those_bytes(monkeypatch: pytest.MonkeyPatch, hosts: int, per: int,
                                               dtype: torch.dtype, summable: bool, intra: bool) -> None:
    """The planner's hierarchical cost: the host's link (the intra fit of L
    workers, else the group's allreduce of N) read at the payload whose
    allreduce moves the reduce's bytes per link, the same for the
    broadcast, plus the leaders' exchange; with the tensor's dtype and the
    host's size (the old formula: 2 AR_host(4 d) for every dtype and L)."""
    monkeypatch.setenv("GRADPRESS_WORKERS_PER_HOST", str(per))
    n = hosts * per
    fits = dict(COSTS, **({"intra_allreduce": INTRA} if intra else {}))
    model = CostModel.from_mapping(fits)
    e = torch.empty(0, dtype=dtype).element_size()
    packet = 0.75 * NUMEL
    into, out, outer = _count(per, hosts, dtype, int(packet), summable)
    host_fit, k = (Fit(*INTRA), per) if intra else (Fit(*COSTS["allreduce"]), n)

    def host(link: float) -> float:  # an allreduce of x among k ranks moves 2 (k - 1) / k x over each link
        return host_fit(link * k / (2 * (k - 1)))

    if summable:
        wire = Fit(*COSTS["allreduce"])(outer * n / (2 * (n - 1)))
        codec = Fit(*COSTS["encode"])(NUMEL) + Fit(*COSTS["decode"])(NUMEL)
    else:
        wire = Fit(*COSTS["allgather"])(outer / (n - 1))
        codec = Fit(*COSTS["encode"])(NUMEL) + hosts * Fit(*COSTS["decode"])(NUMEL)
    want = host(into) + host(out) + max(wire, codec)
    planner = Planner(model, n, summable, ["hierarchical"])
    got = planner.option_costs(NUMEL, e)["hierarchical"][0]
    assert got == pytest.approx(want, rel=1e-12), (got, want)
    assert planner.decide("w", NUMEL, e).costs["hierarchical"] == pytest.approx(want, rel=1e-12)


def test_link_bytes_refuse_bad_input() -> None:
    from gradpress.exchange.strategies.hierarchical_costs import link_bytes

    with pytest.raises(ValueError, match="per_host=0.*allowed: an integer >= 1"):
        link_bytes(10, 4, 0, 2, 10.0, True)
    with pytest.raises(ValueError, match="wire_bytes=-1.*allowed"):
        link_bytes(10, 4, 2, 2, -1, True)
