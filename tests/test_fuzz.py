"""Fuzzing every registered compressor (hypothesis).

For any shape (0-d, 1-d, odd lengths, matrices, a large tensor), dtype
(fp32, fp16, bf16, fp64) and kind of values (zeros, constants, denormals,
huge magnitudes up to 1e15 or the dtype's maximum, a single non-zero,
mixed scales): no crash, finite output for
finite input, shape and dtype preserved, ``packet.nbytes`` equal to the
payload's bytes and, for fixed-size methods, to the declared ``wire_bytes``.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_compressors import spec_for as small_spec

import gradpress
from gradpress.compress import Context

NAMES = gradpress.compressors.names()
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
SHAPES = [(), (1,), (2,), (7,), (13, 3), (5, 1, 3), (64, 33), (3, 256)]
KINDS = ["normal", "zeros", "constant", "denormal", "huge", "single", "mixed", "tiny"]


def make_values(kind: str, shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    base = torch.randn(n, generator=gen, dtype=torch.float64)
    finfo = torch.finfo(dtype)
    if kind == "zeros":
        x = torch.zeros(n, dtype=torch.float64)
    elif kind == "constant":
        x = torch.full((n,), -0.37, dtype=torch.float64)
    elif kind == "denormal":
        x = base.sign() * finfo.smallest_normal * torch.rand(n, generator=gen, dtype=torch.float64)
    elif kind == "huge":
        # 1e15 (fp16: near its maximum): squares and sums over a tensor stay in fp32 range,
        # the range in which every method guarantees finite output
        top = finfo.max / 2 if dtype == torch.float16 else 1e15
        x = base / (base.abs().max() + 1e-30) * top
    elif kind == "single":
        x = torch.zeros(n, dtype=torch.float64)
        if n:
            x[n // 2] = 3.5
    elif kind == "mixed":
        x = base * torch.logspace(-3, 3, n, dtype=torch.float64) if n else base
    elif kind == "tiny":
        x = base * 1e-20
    else:
        x = base
    return x.to(dtype).reshape(shape)


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    shape=st.sampled_from(SHAPES),
    dtype=st.sampled_from(DTYPES),
    kind=st.sampled_from(KINDS),
    seed=st.integers(0, 2**16),
)
def test_fuzz_round_trip(name: str, shape: tuple[int, ...], dtype: torch.dtype, kind: str, seed: int) -> None:
    comp = gradpress.compressor(small_spec(name))
    x = make_values(kind, shape, dtype, seed)
    assert torch.isfinite(x).all()
    packet = comp.encode(x, Context(key="fuzz", step=seed % 7 + 20, seed=1))
    out = comp.decode(packet)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert torch.isfinite(out).all(), f"{name} produced non-finite output on {kind} {dtype} {shape}"
    assert packet.nbytes == sum(t.numel() * t.element_size() for t in packet.tensors)
    if not comp.variable_size and comp.rounds == 1:
        assert packet.nbytes == comp.wire_bytes(max(1, x.numel()), dtype) or x.numel() == 0


@pytest.mark.parametrize("name", NAMES)
def test_large_tensor(name: str) -> None:
    comp = gradpress.compressor(small_spec(name))
    x = torch.randn(1024, 1537)  # odd, ~1.6M elements
    out = comp.decode(comp.encode(x, Context(key="big", step=50)))
    assert out.shape == x.shape and torch.isfinite(out).all()


@pytest.mark.parametrize("name", NAMES)
def test_integer_dtypes_are_refused(name: str) -> None:
    comp = gradpress.compressor(small_spec(name))
    with pytest.raises(ValueError, match="dtype"):
        comp.encode(torch.arange(10, dtype=torch.int64))
