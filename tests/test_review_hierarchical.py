"""Review of ``hierarchical``: 4 gloo workers as 2 hosts x 2, the strategy
called directly; references in float64 here."""

from __future__ import annotations

import pytest
import torch
from distributed import run_workers

WORLD, PER_HOST = 4, 2
MIXED = [((30, 10), torch.float16), ((50,), torch.float32)]


def _grads(rank: int, spec: list) -> list[torch.Tensor]:  # noqa: ANN001
    gen = torch.Generator().manual_seed(rank + 7)
    return [(torch.randn(s, generator=gen, dtype=torch.float64) * (rank + 1)).to(d) for s, d in spec]


def _call(rank: int, spec: str, compressor: str, grads: list[torch.Tensor]) -> tuple:
    from gradpress.compress import create
    from gradpress.compress.base import Context
    from gradpress.exchange.base import parse_strategy
    from gradpress.exchange.strategies.hierarchical import Hierarchical

    strategy = Hierarchical(None, **parse_strategy(spec)[1])
    ctxs = [Context(key=f"k{i}", rank=rank, world_size=WORLD) for i in range(len(grads))]
    res = strategy.exchange(create(compressor), grads, ctxs, None)
    return [t.clone() for t in res.tensors], res.bytes_sent, res.host_bytes, list(res.tensor_bytes)


def _worker(rank: int, world: int) -> dict:
    out = {}
    for chunk in (0, 64):
        spec = f"hierarchical:workers_per_host={PER_HOST},chunk={chunk}"
        out[f"mixed{chunk}"] = _call(rank, spec, "none", _grads(rank, MIXED))
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_workers(_worker, WORLD)


@pytest.mark.parametrize("chunk", [0, 64])
def test_mixed_dtypes_keep_their_dtype_and_bytes(results: list[dict], chunk: int) -> None:
    """An fp16 tensor beside an fp32 one: the unpipelined path fused both into
    one promoted (fp32) buffer, so the fp16 result came back fp32 and its
    host bytes and packets counted (and moved) twice its size."""
    per = [_grads(r, MIXED) for r in range(WORLD)]
    refs = [sum(p[i].double() for p in per) / WORLD for i in range(len(MIXED))]
    dense = sum(t.numel() * t.element_size() for t in per[0])  # 600 + 200
    for rank, r in enumerate(results):
        tensors, sent, host, tensor_bytes = r[f"mixed{chunk}"]
        for t, ref, (shape, dtype) in zip(tensors, refs, MIXED):
            assert t.dtype == dtype and tuple(t.shape) == shape
            tol = 4e-3 if dtype == torch.float16 else 1e-6
            assert torch.allclose(t.double(), ref, atol=tol, rtol=0)
            assert torch.equal(t, results[0][f"mixed{chunk}"][0][MIXED.index((shape, dtype))])
        leader = rank % PER_HOST == 0
        assert host == dense * (2 if leader else 1)
        # 'none' between two leaders: an allreduce of the dense host means
        assert sent == (3 * dense if leader else dense)
        assert tensor_bytes == [t.numel() * t.element_size() for t in per[0]]
