"""Collectives (review H): allgathers of empty buffers issue no empty
collective, every rank gets every rank's bytes (sizes differing, 0
included), the count equals what was handed over; the fused allreduce of
mixed dtypes against a reference (gloo, 2 workers)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from distributed import run_workers

from gradpress.transport.collectives import allgather_with_head, fused_allreduce


def _payload(rank: int, n: int) -> torch.Tensor:
    return ((torch.arange(n, dtype=torch.int64) * 7 + 31 * rank + 1) % 256).to(torch.uint8)


def _gathers(rank: int, world: int, cases: list[tuple[list[int], int, bool]]) -> dict:
    handed: list[int] = []
    for name in ("all_gather_single", "all_gather_into_tensor"):
        orig = getattr(dist, name, None)
        if orig is not None:
            def spy(out, inp, *a, _orig=orig, **kw):  # noqa: ANN001,ANN002,ANN003,ANN202
                handed.append(inp.numel() * inp.element_size())
                return _orig(out, inp, *a, **kw)
            setattr(dist, name, spy)
    results = {}
    for sizes, h, variable in cases:
        head = torch.arange(h, dtype=torch.uint8) + 100 * rank
        handed.clear()
        heads, bufs, sent = allgather_with_head(_payload(rank, sizes[rank]), head, None, world, variable)
        alone = allgather_with_head(_payload(rank, sizes[rank]), head, None, 1, variable)[2]  # a world of one
        results[(tuple(sizes), h, variable)] = ([x.tolist() for x in heads], [b.tolist() for b in bufs], sent,
                                                list(handed), alone)
    mixed = [torch.tensor([1.5, -2.25], dtype=torch.float16) * (rank + 1), torch.arange(6, dtype=torch.int32).view(2, 3),
             torch.full((2, 2), 0.1, dtype=torch.float64), torch.zeros(0), torch.tensor([rank + 0.5]),
             torch.tensor([3, rank], dtype=torch.int64)]
    summed, sent = fused_allreduce(mixed, None)
    results["allreduce"] = ([(x.dtype, tuple(x.shape)) for x in summed], [x.tolist() for x in summed], sent)
    return results


CASES = [([0, 0], 0, True), ([0, 0], 0, False), ([0, 0], 3, True), ([0, 5], 3, True), ([9, 0], 0, True),
         ([5, 5], 3, False), ([8, 8], 0, False)]


def test_allgather_and_fused_allreduce_against_references() -> None:
    world = 2
    res = run_workers(_gathers, world, CASES)
    for rank, got in enumerate(res):
        for sizes, h, variable in CASES:
            heads, bufs, sent, handed, alone = got[(tuple(sizes), h, variable)]
            case = (rank, sizes, h, variable)
            assert heads == [(torch.arange(h, dtype=torch.uint8) + 100 * r).tolist() for r in range(world)], case
            assert bufs == [_payload(r, sizes[r]).tolist() for r in range(world)], case
            assert 0 not in handed, f"an empty collective was issued: {case}, {handed}"
            assert sent == sum(handed), (case, sent, handed)
            if len(set(sizes)) == 1:  # "figures compare across world sizes": a world of one counts the same
                assert alone == sent, (case, alone, sent)
        dtypes, values, sent = got["allreduce"]
        assert dtypes == [(torch.float16, (2,)), (torch.int32, (2, 3)), (torch.float64, (2, 2)), (torch.float32, (0,)),
                          (torch.float32, (1,)), (torch.int64, (2,))]
        assert values == [[4.5, -6.75], [[0, 2, 4], [6, 8, 10]], [[0.2] * 2] * 2, [], [2.0], [6, 1]]
        assert sent == 2 * 2 + 6 * 4 + 4 * 8 + 1 * 4 + 2 * 8  # every non-empty tensor's bytes, once
