"""The kit's compiled path (torch.compile, Inductor) against its eager path:
the same declaration gives byte-identical packets and decodes either way,
on a tensor of whole chunks and on a ragged one (a short last chunk run by
the same kernel), on the random methods' counter stream. Also the policy:
``GRADPRESS_COMPILE=0`` never compiles, and a kernel whose compilation fails
falls back to eager with one warning.

These are the suite's only compiles (tests/conftest.py sets
GRADPRESS_COMPILE=0 for everything else): a few kernels, with dynamic
shapes, so each compiles once."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch

from gradpress.compress import Context, create, kit
from gradpress.compress.kit import compiler

SPECS = ["qsgd", "terngrad", "natural", "onebit", "minmax8:stochastic=true"]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.skipif(not compiler.keeps_eager_numerics("cpu"),
                    reason="this torch's Inductor lacks emulate_precision_casts: 'auto' does not compile on CPU here")
def test_compiled_encode_and_decode_are_byte_identical_to_eager(spec: str) -> None:
    before = compiler.compiled_count()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a failed compile falls back to eager with one: not here
        _compare_compiled_with_eager(spec)
    # every kit kernel compiles once per process (dynamic shapes); onebit's encode has no kit kernel
    assert (compiler.compiled_count() > before) is (spec != "onebit"), (spec, before)
    assert not compiler._failed


def _compare_compiled_with_eager(spec: str) -> None:
    for d in (8192, 8192 + 300):  # whole chunks; a ragged tail
        x = torch.randn(d, generator=torch.Generator().manual_seed(d)) * 5
        x[7] = 0.0
        x[11] = -1e-41
        ctx = Context(key="c", step=2, rank=1, world_size=2, seed=3)
        with compiler.forced("off"):
            eager = create(spec)
            pe = eager.encode(x, ctx)
            de = eager.decode(pe)
        with compiler.forced("on"):
            comp = create(spec)
            pc = comp.encode(x, ctx)
            dc = comp.decode(pc)
        assert all(_same(a, b) for a, b in zip(pe.tensors, pc.tensors)), (spec, d)
        assert _same(de, dc), (spec, d)


def test_the_pinned_torch_compiles_by_default() -> None:
    """On the torch that `make setup` installs, ``auto`` compiles on CPU and
    CUDA: a renamed Inductor option would otherwise quietly turn the kit
    eager (and skip the identity tests above)."""
    pinned = re.search(r"^TORCH_VERSION \?= (\S+)", (Path(__file__).parents[1] / "Makefile").read_text(), re.M)
    if pinned is None or torch.__version__.split("+")[0] != pinned.group(1):
        pytest.skip(f"torch {torch.__version__} is not the pinned one (make compat runs older releases)")
    assert compiler.keeps_eager_numerics("cpu") and compiler.keeps_eager_numerics("cuda")


def test_policy_off_never_compiles(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRADPRESS_COMPILE", "0")
    calls = []
    monkeypatch.setattr(torch, "compile", lambda *a, **k: calls.append(a) or (lambda *x, **y: None))

    def k(v: torch.Tensor, *, key: torch.Tensor | None, drawn: torch.Tensor | None) -> torch.Tensor:
        return v + 1

    out = kit.elementwise(k, torch.zeros(1 << 20), 1 << 20)
    assert not calls and float(out.sum()) == 1 << 20
    monkeypatch.setenv("GRADPRESS_COMPILE", "maybe")
    with pytest.raises(ValueError, match="GRADPRESS_COMPILE got 'maybe'"):
        compiler.mode()


def test_a_failing_compile_falls_back_to_eager_with_a_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*a: object, **k: object) -> object:
        def fn(*x: object, **y: object) -> object:
            raise RuntimeError("no compiler here")
        return fn

    monkeypatch.setattr(torch, "compile", broken)

    def k2(v: torch.Tensor, *, key: torch.Tensor | None, drawn: torch.Tensor | None) -> torch.Tensor:
        return v * 2

    with compiler.forced("on"), pytest.warns(RuntimeWarning, match="running it eagerly"):
        out = kit.elementwise(k2, torch.ones(10), 10)
    assert torch.equal(out, torch.full((10,), 2.0))
    with compiler.forced("on"):  # no second warning: the kernel stays eager
        assert torch.equal(kit.elementwise(k2, torch.ones(10), 10), torch.full((10,), 2.0))


def test_warns_once_when_inductor_lacks_the_eager_numerics_options(monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel compiled without the options its device needs may differ
    from eager (CUDA: docs/results/cuda-h200.md; CPU on torch 2.2.2): under
    ``on`` the kit says so, once; with them it says nothing."""
    monkeypatch.setattr(compiler, "_warned_numerics", [])
    cpu_only = {"emulate_precision_casts": True}
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        compiler._warn_missing_numerics(dict.fromkeys(compiler.EAGER_NUMERICS, True), "cuda")
        compiler._warn_missing_numerics(cpu_only, "cpu")
        assert not seen
        compiler._warn_missing_numerics(cpu_only, "cuda")
        compiler._warn_missing_numerics({}, "cpu")
    assert len(seen) == 1 and "eager_numerics.division_rounding" in str(seen[0].message)


def test_auto_compiles_only_where_inductor_keeps_eager_numerics(monkeypatch: pytest.MonkeyPatch) -> None:
    """``auto`` compiles a large kernel only where the device's options are
    known (CPU: emulate_precision_casts; CUDA: both); ``on`` still compiles
    (the user asked)."""
    monkeypatch.delenv("GRADPRESS_COMPILE", raising=False)
    big = 1 << 24
    monkeypatch.setattr(compiler, "_known_options", [{}])  # torch 2.2.2: neither
    assert not compiler.compiles(big, "cpu") and not compiler.compiles(big, "cuda")
    with compiler.forced("on"):
        assert compiler.compiles(big, "cpu") and compiler.compiles(big, "cuda")
    monkeypatch.setattr(compiler, "_known_options", [{"emulate_precision_casts": True}])  # torch 2.6.0
    assert compiler.compiles(big, "cpu") and not compiler.compiles(big, "cuda")
    assert not compiler.compiles(compiler.MIN_COMPILE_NUMEL - 1, "cpu")
    monkeypatch.setattr(compiler, "_known_options", [dict.fromkeys(compiler.EAGER_NUMERICS, True)])  # 2.11, 2.13
    assert compiler.compiles(big, "cpu") and compiler.compiles(big, "cuda")
    assert compiler._device_type((3, torch.zeros(1))) == "cpu" and compiler._device_type(()) == "cpu"
