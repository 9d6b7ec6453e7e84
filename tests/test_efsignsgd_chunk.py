"""``efsignsgd:chunk=c``: one scale per chunk of c consecutive entries,
against a float64 reference computed here from the definition
(scale_k = ||x_k||_1 / |x_k|, decoded x_k -> scale_k sign(x_k), sign(0) =
+1; Karimireddy et al. 2019 per chunk, the chunked scaled sign of 1-bit
Adam, Tang et al. 2021)."""

from __future__ import annotations

import math

import pytest
import torch

from gradpress.compress import create, numerics


def reference(x: torch.Tensor, chunk: int) -> torch.Tensor:
    """The chunked scaled sign of ``x`` in float64, chunk by chunk."""
    flat = x.reshape(-1).to(torch.float64)
    out = torch.empty_like(flat)
    for a in range(0, flat.numel(), chunk):
        v = flat[a : a + chunk]
        out[a : a + chunk] = v.abs().sum() / v.numel() * torch.where(v >= 0, 1.0, -1.0).to(torch.float64)
    return out.reshape(x.shape)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.float64, 2 ** -20)])
@pytest.mark.parametrize("shape,chunk", [((1000,), 256), ((37, 19), 64), ((5,), 8), ((64, 16), 16), ((3,), 1)])
def test_decode_is_per_chunk_scaled_sign(dtype: torch.dtype, tol: float, shape: tuple[int, ...], chunk: int) -> None:
    g = torch.Generator().manual_seed(7)
    # rows of different magnitudes: the case a per-chunk scale is for
    x = (torch.randn(shape, generator=g, dtype=torch.float64)
         * torch.logspace(-3, 2, shape[0], dtype=torch.float64).reshape(-1, *[1] * (len(shape) - 1))).to(dtype)
    x.view(-1)[0] = 0.0  # sign(0) = +1
    comp = create(f"efsignsgd:chunk={chunk}")
    packet = comp.encode(x)
    out = comp.decode(packet)
    want = reference(x, chunk)
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out.to(torch.float64), want, rtol=tol, atol=0.0)
    d = x.numel()
    assert packet.tensors[0].numel() == math.ceil(d / chunk)  # one 4-byte scale per chunk
    assert sum(t.numel() * t.element_size() for t in packet.tensors) == 4 * math.ceil(d / chunk) + math.ceil(d / 8)


def test_error_never_above_whole_tensor_scale() -> None:
    """Per chunk, ||x_k||_1 / |x_k| minimises ||x_k - s sign(x_k)||, so the
    chunked error is at most the one-scale error (float64 references)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 64, generator=g, dtype=torch.float64) * torch.logspace(-2, 1, 64, dtype=torch.float64)[:, None]
    whole = (x - reference(x, x.numel())).norm()
    for chunk in (4096, 1024, 256, 64):
        got = create(f"efsignsgd:chunk={chunk}")
        err = (x - got.decode(got.encode(x))).norm()
        assert err <= whole * (1 + 1e-6), chunk
        want = (x - reference(x, chunk)).norm()
        assert abs(float(err - want)) <= 1e-5 * float(want), chunk
        if chunk < x.numel():
            assert err < whole, chunk  # rows of different magnitudes: strictly below


def test_chunk_zero_and_whole_tensor_chunk_are_the_plain_compressor() -> None:
    x = torch.randn(300, generator=torch.Generator().manual_seed(1))
    plain = create("efsignsgd")
    assert plain.spec() == "efsignsgd" and create("efsignsgd:chunk=0").spec() == "efsignsgd"
    assert create("efsignsgd:chunk=512").spec() == "efsignsgd:chunk=512"
    big = create("efsignsgd:chunk=512")
    torch.testing.assert_close(big.decode(big.encode(x)), plain.decode(plain.encode(x)), rtol=0, atol=0)
    with pytest.raises(ValueError, match="chunk"):
        create("efsignsgd:chunk=-1")


def test_overflowing_chunk_sum_and_sync_free_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunk whose |x| sum overflows fp32 still gets its finite mean; the
    sync-free path (no host read) gives the same bits."""
    big = torch.finfo(torch.float32).max / 2
    x = torch.tensor([big, -big, big, 1.0, 2.0, -3.0, 0.5, 0.25], dtype=torch.float32)
    comp = create("efsignsgd:chunk=3")
    out = comp.decode(comp.encode(x))
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.to(torch.float64), reference(x, 3), rtol=1e-6, atol=0.0)
    monkeypatch.setattr(numerics, "SYNC_FREE", True)
    assert torch.equal(comp.decode(comp.encode(x)), out)


def test_empty_tensor() -> None:
    comp = create("efsignsgd:chunk=16")
    x = torch.zeros(0)
    assert comp.decode(comp.encode(x)).shape == (0,)
