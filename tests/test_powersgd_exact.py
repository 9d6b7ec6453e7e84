"""PowerSGD (Vogels et al. 2019) on matrices of rank <= r, where one power
iteration is exact: P spans M's columns (M Q has M's column space for a
generic Q), so P P^T M = M. Checked against M itself (a float64 product the
test builds), standalone and through the multi-round protocol writing into
a caller's ``out`` (as the engine's allreduce does), plus Gram-Schmidt's
orthonormal columns."""

from __future__ import annotations

import warnings

import pytest
import torch

from gradpress.compress import Context, create
from gradpress.compress.powersgd import orthogonalize

pytestmark = pytest.mark.mutants


def _low_rank(n: int, m: int, r: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(n, r, generator=g, dtype=torch.float64)
    b = torch.randn(m, r, generator=g, dtype=torch.float64)
    return a @ b.t()


@pytest.mark.parametrize("shape, true_rank, rank", [((40, 30), 1, 1), ((40, 30), 2, 2), ((50, 8, 4), 3, 3)])
def test_rank_r_matrices_come_back_exactly(shape: tuple, true_rank: int, rank: int) -> None:
    m64 = _low_rank(shape[0], int(torch.tensor(shape[1:]).prod()), true_rank).reshape(shape)
    x = m64.float()
    comp = create(f"powersgd:rank={rank},start_iter=0")
    ctx = Context(key="w", step=0, rank=0, world_size=1, seed=3)
    out = comp.decode(comp.encode(x, ctx))
    assert out.shape == x.shape and out.dtype == x.dtype
    assert torch.allclose(out.double(), m64, rtol=0, atol=1e-4 * float(m64.abs().max()))


def test_the_protocol_writes_the_product_into_out() -> None:
    """begin -> advance (P, orthogonalized) -> advance (Q) -> finish(out)."""
    m64 = _low_rank(24, 18, 2, seed=1)
    x = m64.float()
    comp = create("powersgd:rank=2,start_iter=0")
    ctx = Context(key="w", step=0, rank=0, world_size=1, seed=3)
    state, p = comp.begin(x, ctx)
    q = comp.advance(state, p, ctx)
    assert comp.advance(state, q, ctx) is None
    out = torch.full_like(x, float("nan"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. torch resizing a wrongly shaped view of out
        assert comp.finish(state, out=out) is out
    assert torch.allclose(out.double(), m64, rtol=0, atol=1e-4 * float(m64.abs().max()))


def test_orthogonalize_gives_orthonormal_columns_spanning_the_input() -> None:
    p64 = torch.randn(30, 3, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    q = orthogonalize(p64.clone())
    assert torch.allclose(q.t() @ q, torch.eye(3, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(q @ (q.t() @ p64), p64, atol=1e-12)  # same column space
    zero = orthogonalize(torch.zeros(5, 2))
    assert torch.equal(zero, torch.zeros(5, 2))  # a zero column stays zero, no NaN
