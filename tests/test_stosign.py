"""``stosign`` against its definition, computed here in float64: per chunk
of c entries m = max|x|; each entry decodes to +m with probability
(1 + x/m) / 2, else -m (unbiased, variance m^2 - x^2); wire size
4 ceil(d/c) + ceil(d/8) bytes."""

from __future__ import annotations

import math

import pytest
import torch

from gradpress.compress import Context, create

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def _chunk_max(x: torch.Tensor, c: int) -> torch.Tensor:
    """max|x| of each entry's chunk, float64, by the definition."""
    xd = x.double().reshape(-1).tolist()
    out = []
    for i in range(len(xd)):
        start = i // c * c
        out.append(max(abs(v) for v in xd[start: start + c]))
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d, c", [(0, 4), (1, 4), (7, 4), (8, 8), (513, 512), (1000, 64), (33, 1)])
def test_every_entry_decodes_to_plus_or_minus_its_chunk_maximum(dtype: torch.dtype, d: int, c: int) -> None:
    comp = create(f"stosign:chunk={c}")
    x = torch.randn(d, generator=torch.Generator().manual_seed(d + c), dtype=torch.float64).to(dtype)
    packet = comp.encode(x, Context(key="t", step=1, seed=3))
    out = comp.decode(packet)
    assert out.dtype == dtype and out.shape == x.shape
    assert packet.nbytes == comp.wire_bytes(d, dtype) == 4 * math.ceil(d / c) + math.ceil(d / 8)
    m = _chunk_max(x, c)
    got = out.double().abs()
    if dtype == torch.float64:  # the upper 32 bits rounded away from zero: >= m, within 2^-20
        assert bool(((got >= m) & (got <= m * (1 + 2.0**-20))).all())
    else:
        assert torch.equal(got, m)
    if c == 1:  # a chunk of one entry: m = |x|, P(+) is 1 or 0: exact
        assert torch.equal(out.double().sign(), x.double().sign())
    buf = torch.full((d,), float("nan"), dtype=dtype)
    assert comp.decode_into(packet, buf) is buf and torch.equal(buf, out.reshape(-1))


def test_the_probability_of_plus_is_one_plus_x_over_m_halved() -> None:
    """2000 draws of 16 entries (two chunks of 8): each entry's frequency of
    +m within 5 standard errors of (1 + x/m) / 2, its mean within 5 standard
    errors of x, and its mean squared error near m^2 - x^2."""
    c, n = 8, 2000
    x = torch.tensor([1.0, -1.0, 0.5, -0.25, 0.0, 0.9, -0.99, 0.1, 3.0, 0.0, -3.0, 1.5, -1.5, 2.9, 0.01, -0.01])
    comp = create(f"stosign:chunk={c}")
    draws = torch.stack([comp.decode(comp.encode(x, Context(key="p", step=s, seed=5))).double() for s in range(n)])
    m = _chunk_max(x, c)
    xd = x.double()
    p = (1 + xd / m) / 2
    freq = (draws > 0).double().mean(0)
    se = (p * (1 - p) / n).sqrt()
    assert bool(((freq - p).abs() <= 5 * se + 1e-12).all()), (freq, p)
    var = m**2 - xd**2
    assert bool(((draws.mean(0) - xd).abs() <= 5 * (var / n).sqrt() + 1e-12).all())
    mse = (draws - xd).pow(2).mean(0)
    assert bool(((mse - var).abs() <= 0.15 * m**2).all()), (mse, var)


def test_a_zero_chunk_decodes_to_zeros_and_a_nonfinite_one_stays_nonfinite() -> None:
    comp = create("stosign:chunk=4")
    x = torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0, float("inf"), -2.0, 0.5, float("nan"), 1.0, 2.0, 3.0])
    out = comp.decode(comp.encode(x, Context(key="z", step=0, seed=1)))
    assert bool((out[:4] == 0).all())
    assert not bool(torch.isfinite(out[4:]).any())


def test_variance_factor_is_the_chunk_bound() -> None:
    """E||Q - x||^2 = c m^2 - ||x||^2 <= (c - 1) ||x||^2 per chunk, and
    equality for one nonzero entry among c: omega = min(c, d) - 1."""
    assert create("stosign:chunk=8").variance_factor(100) == 7.0
    assert create("stosign:chunk=512").variance_factor(10) == 9.0
    x = torch.zeros(8, dtype=torch.float64)
    x[3] = 2.0
    comp = create("stosign:chunk=8")
    err = torch.stack([(comp.decode(comp.encode(x, Context(key="v", step=s, seed=2))) - x).pow(2).sum()
                       for s in range(400)]).mean()
    assert abs(float(err) / float(x.pow(2).sum()) - 7.0) < 1e-9  # every other entry is +-2 exactly: 7 * 4 / 4


@pytest.mark.mutants
def test_a_coin_is_plus_exactly_where_the_uniform_is_below_p(monkeypatch: pytest.MonkeyPatch) -> None:
    """Over a whole grid of uniforms u = k/16 the coin comes up + for exactly 16 p of them, p = (1 + x/m) / 2
    on the grid (the grid biases P(+) by less than one step, so by none here): u < p, not u <= p, which
    made x = -m come up + at u = 0. ``kit.uniform`` is replaced by the grid, the kernel called unfused."""
    from gradpress.compress import stosign

    n = 16
    j = torch.arange(n + 1, dtype=torch.float32)
    x = ((2 * j / n - 1) * 3.0).unsqueeze(1).expand(n + 1, n).contiguous()  # p = j/16, m = 3
    m = torch.full((n + 1, 1), 3.0)
    grid = (torch.arange(n, dtype=torch.float32) / n).expand(n + 1, n)
    monkeypatch.setattr(stosign.kit, "uniform", lambda v, key, drawn: grid)
    coins = stosign._coins(x, m, key=None, drawn=None, bits=1, fuse=False)
    assert coins.to(torch.int64).sum(1).tolist() == [int(v) for v in j.tolist()]


@pytest.mark.mutants
@pytest.mark.parametrize("chunk", [1, 8, 512])
def test_one_entry_is_sent_exactly_and_its_variance_factor_is_zero(chunk: int) -> None:
    """A tensor of one entry (or none) is one chunk with m = |x|: P(+) is 1 or 0, E||Q - x||^2 = 0, so
    omega = min(c, d) - 1 = 0 (it said 1 for any chunk of 2 or more entries under a mutant of max(d, 1))."""
    comp = create(f"stosign:chunk={chunk}")
    assert comp.variance_factor(1) == 0.0 and comp.variance_factor(0) == 0.0
    assert comp.variance_factor(2) == float(min(chunk, 2) - 1)
    for s, v in enumerate((2.5, -0.75, 1e-3)):  # fp32: m is exact (fp64 sends m rounded away from zero)
        x = torch.tensor([v], dtype=torch.float32)
        assert torch.equal(comp.decode(comp.encode(x, Context(key="one", step=s, seed=4))), x)
