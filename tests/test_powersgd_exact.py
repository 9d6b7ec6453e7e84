"""PowerSGD (Vogels et al. 2019) on matrices of rank <= r, where one power
iteration is exact: P spans M's columns (M Q has M's column space for a
generic Q), so P P^T M = M. Checked against M itself (a float64 product the
test builds), standalone and through the multi-round protocol writing into
a caller's ``out`` (as the engine's allreduce does), plus Gram-Schmidt's
orthonormal columns. Warm start: after a rank-1 step u v^T, Q is parallel to
v whatever the first draw, so the next step's result is the float64
projection of M2 onto M2 v (a Q drawn afresh would give another direction;
written for a planted bug that never reused Q, docs/testing.md, "plants2")."""

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


def test_warm_start_reuses_the_last_q() -> None:
    """Vogels et al. 2019, Algorithm 1: step t starts from step t - 1's Q.
    With M1 = u v^T and rank 1, Q1 = M1^T P1 is parallel to v, so step 2 gives
    P2 = M2 v / ||M2 v|| and the product P2 P2^T M2 (float64 here), on a
    non-square matrix (n != m: a transposed shape check never reuses Q)."""
    g = torch.Generator().manual_seed(5)
    u = torch.randn(30, 1, generator=g, dtype=torch.float64)
    v = torch.randn(20, 1, generator=g, dtype=torch.float64)
    m2 = torch.randn(30, 20, generator=g, dtype=torch.float64)
    p2 = m2 @ v
    p2 = p2 / p2.norm()
    want = p2 @ (p2.t() @ m2)
    outs = {}
    for warm in (True, False):
        comp = create(f"powersgd:rank=1,start_iter=0,warm_start={str(warm).lower()}")
        comp.decode(comp.encode(u @ v.t(), Context(key="w", step=0, rank=0, world_size=1, seed=3)))
        outs[warm] = comp.decode(comp.encode(m2, Context(key="w", step=1, rank=0, world_size=1, seed=3)))
    assert outs[True].dtype == torch.float64
    assert torch.allclose(outs[True], want, rtol=0, atol=1e-10 * float(m2.abs().max()))
    # the check has power: a fresh draw lands elsewhere
    assert not torch.allclose(outs[False], want, rtol=0, atol=1e-2 * float(m2.abs().max()))
