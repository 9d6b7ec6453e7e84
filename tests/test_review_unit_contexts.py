"""Every encode a ``hierarchical`` leader makes sees it as one compressing unit of H encoding the mean of L
workers, through the outer strategy's own contexts too (4 gloo workers as 2 hosts x 2, one launch, about
25 s on the shared machine).

``Hierarchical`` hands its leaders' contexts (``rank`` = host, ``world_size`` = H, ``unit_workers`` = L) to
the outer exchange; the compressed ``ring`` derives one context per hop from them (``dataclasses.replace``
with the hop's key, rank and size). A hop context built field by field instead would fall back to
``unit_workers=1`` and DGC's clip would bound the host mean L times too loosely. Checked with a ``topk``
probe recording every encode's Context: at the two leaders (global ranks 0 and 2), every encode of the
``ring``, ``allgather`` and pipelined (default ``chunk``) outer paths has ``world_size`` 2, ``unit_workers``
2 and ``rank`` its host's index; the other ranks encode nothing.

Planted: ``Ring``'s hop context rebuilt as ``Context(key, c0.step, r, n, c0.seed, loss_scale=...)`` (the
field-by-field way): the ring case fails with ``unit_workers`` 1 at the leaders' hop encodes; ``unit_contexts``
applied after the pipelined path's return: the pipelined case fails (piece ``w#0`` encoded as rank 0 of 4, 1).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from distributed import run_workers

WORLD, PER_HOST = 4, 2
HOSTS = WORLD // PER_HOST
PROBE = "test-unit-probe"
HIER = f"hierarchical:workers_per_host={PER_HOST}"
CASES = {"ring": HIER + ",outer=ring,chunk=0", "allgather": HIER + ",outer=allgather,chunk=0",
         "pipelined": HIER + ",outer=allgather,chunk=128"}


def _run(rank: int, world: int) -> dict[str, list[tuple[str, int, int, int]]]:
    from gradpress.compress import registry
    from gradpress.compress.topk import TopK
    from gradpress.exchange.engine import Synchronizer

    seen: list[tuple[str, int, int, int]] = []

    class _Probe(TopK):
        name = PROBE

        def _encode(self, x: torch.Tensor, ctx: Any) -> Any:
            if not ctx.key.startswith("__"):  # not gradpress's own probes (wire size, meta), which encode ones
                seen.append((ctx.key, ctx.rank, ctx.world_size, ctx.unit_workers))
            return super()._encode(x, ctx)

    registry.register(_Probe)
    out = {}
    for name, strategy in CASES.items():
        seen.clear()
        eng = Synchronizer(f"{PROBE}:ratio=0.1", params=[("w", (16, 32), torch.float32)], strategy=strategy,
                           min_numel=64, error_feedback=True)
        for step in range(2):
            g = torch.randn(16, 32, generator=torch.Generator().manual_seed(10 * step + rank))
            eng.sync(["w"], [g], step=step)
        out[name] = list(seen)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, list[tuple[str, int, int, int]]]]:
    return run_workers(_run, WORLD)


@pytest.mark.parametrize("case", list(CASES))
def test_every_leader_encode_is_one_of_h_units_of_l_workers(results: list[dict], case: str) -> None:
    for rank, got in enumerate(results):
        encodes = got[case]
        if rank % PER_HOST:
            assert encodes == [], (case, rank)
            continue
        host = rank // PER_HOST
        assert encodes, (case, rank)
        for key, r, n, units in encodes:
            assert (r, n, units) == (host, HOSTS, PER_HOST), (case, rank, key, r, n, units)
    if case == "ring":  # the ring's hops encoded too (their own keys), not only the plain key
        assert len({k for k, *_ in results[0][case]}) > 1, results[0][case]
