"""Review findings in the kit (gradpress/compress/kit/): each test failed
before its fix. References are computed here from Python integers."""

from __future__ import annotations

import pytest
import torch

from gradpress.compress import kit
from gradpress.compress.kit import compiler
from gradpress.compress.kit.rng import counter_bits, counter_uniform, seed_words

N = 1 << 16


@pytest.mark.parametrize("dtype,p", [(torch.float16, 11), (torch.bfloat16, 8)])
def test_narrow_float_uniforms_lie_in_0_1_on_the_top_bits(dtype: torch.dtype, p: int) -> None:
    """fp16 and bf16 uniforms: the top p bits over 2^p, exact in the dtype,
    never 1.0 (a stochastic rounding floor(y + U) with U = 1 rounds up a
    whole level) nor inf (24 bits cast to fp16 overflowed)."""
    key, idx = seed_words(99), torch.arange(N, dtype=torch.int32)
    u = counter_uniform(key, idx, dtype)
    assert u.dtype == dtype
    unsigned = [b & 0xFFFFFFFF for b in counter_bits(key, idx).tolist()]
    want = torch.tensor([(b >> (32 - p)) / 2.0 ** p for b in unsigned], dtype=torch.float64)
    assert torch.equal(u.double(), want)
    assert float(u.max()) < 1 and float(u.min()) >= 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mode", ["off", "on"])
def test_stochastic_rounding_of_half_inputs_never_rounds_zero_up(mode: str, dtype: torch.dtype) -> None:
    """kit.uniform inside an elementwise kernel on a narrow float tensor (a
    declaration with CONVERT = False): floor(0 + U) is 0 for U in [0, 1)."""
    def kernel(v: torch.Tensor, *, key: torch.Tensor | None, drawn: torch.Tensor | None) -> torch.Tensor:
        return torch.floor(v + kit.uniform(v, key, drawn))

    y = torch.zeros(1 << 14, dtype=dtype)
    with compiler.forced(mode):
        out = kit.elementwise(kernel, y, 4096, key=seed_words(5))
    assert torch.equal(out, y)


def _broken_compile(*a: object, **k: object) -> object:
    """A ``torch.compile`` whose compiled function fails when called."""
    def fn(*x: object, **y: object) -> object:
        raise RuntimeError("no compiler here")
    return fn


def test_a_failing_kernel_warns_once_with_its_into_variant(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whole chunks and a tail (the kernel and its ``into`` variant): one
    failed compile, one warning, and eager from then on for both."""
    monkeypatch.setattr(torch, "compile", _broken_compile)
    monkeypatch.setattr(compiler, "_cache", {})
    monkeypatch.setattr(compiler, "_failed", set())

    def k3(v: torch.Tensor, *, key: torch.Tensor | None, drawn: torch.Tensor | None) -> torch.Tensor:
        return v * 3

    with compiler.forced("on"), pytest.warns(RuntimeWarning) as seen:
        out = kit.elementwise(k3, torch.ones(10), 4)
    assert torch.equal(out, torch.full((10,), 3.0))
    assert [str(w.message).split(" failed")[0] for w in seen if "compiling" in str(w.message)] == [
        f"gradpress kit: compiling {k3.__qualname__}"]
    assert not compiler.will_compile(compiler.into(k3), 10, "cpu")
