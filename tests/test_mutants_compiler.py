"""Written for survivors of ``make mutants`` (``compiler`` group: the kit's
compile policy and cache, compress/kit/compiler.py, the span cut of
compress/spans.py and the shared ``ratio`` parameter of compress/params.py).
Expected values are the test's own: the ``auto`` threshold as the module
documents it (16K entries), a kernel's values computed here, and what a
failed compile leaves behind as ``is_compiled``/``compiled_count`` document
it. ``torch.compile`` is replaced by a stand-in (it returns the function it
is given, or one that fails), so nothing here runs Inductor: a few
milliseconds per test.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from gradpress.compress.kit import compiler

pytestmark = pytest.mark.mutants


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Callable[..., Any]]]:
    """An empty compile cache and failure set, and a ``torch.compile`` that
    returns the function it is given (recorded in the list yielded)."""
    given: list[Callable[..., Any]] = []

    def identity_compile(fn: Callable[..., Any], **options: Any) -> Callable[..., Any]:
        given.append(fn)
        return fn

    monkeypatch.setattr(compiler, "_cache", {})
    monkeypatch.setattr(compiler, "_failed", set())
    monkeypatch.setattr(torch, "compile", identity_compile)
    yield given


# ----------------------------------------------------------------------------- the auto threshold
@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_auto_compiles_from_16k_entries(device_type: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``auto`` compiles a tensor of at least 16K = 16,384 entries (the
    module's docstring, docs/authoring.md, README.md), not one entry fewer, where
    Inductor knows the eager-numerics options (here: all of them)."""
    monkeypatch.delenv("GRADPRESS_COMPILE", raising=False)
    monkeypatch.setattr(compiler, "_known_options", [dict.fromkeys(compiler.EAGER_NUMERICS, True)])
    assert compiler.mode() == "auto"
    assert compiler.compiles(16 * 1024, device_type)
    assert not compiler.compiles(16 * 1024 - 1, device_type)


def _failing_compile(fn: Callable[..., Any], **options: Any) -> Callable[..., Any]:
    """A ``torch.compile`` whose compiled function fails when called (no C++ compiler)."""
    def compiled(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("no compiler here")
    return compiled


# ----------------------------------------------------------------------------- callables used as they are
class _Scaler:
    def __init__(self, factor: float) -> None:
        self.factor = factor

    def kernel(self, v: torch.Tensor) -> torch.Tensor:
        return v * self.factor


def test_a_bound_method_kernel_is_compiled_as_it_is(fresh: list[Callable[..., Any]]) -> None:
    """A bound method has a ``__code__`` (its function's) but is no plain
    function: it is handed to ``torch.compile`` as it is, bound to its
    object, so it computes its values compiled, with no failed-compile
    warning. (Rebuilt as a function from that code object, it would lose
    ``self`` and fail on its first call.)"""
    x = torch.arange(10, dtype=torch.float64)
    scaler = _Scaler(3.0)
    with compiler.forced("on"), warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        got = compiler.run(scaler.kernel, x.numel(), x)
    assert torch.equal(got, torch.tensor([3.0 * i for i in range(10)], dtype=torch.float64))
    assert fresh == [scaler.kernel] and compiler.compiled_count() == 1 and not compiler._failed



def test_a_bound_method_kernel_counts_as_compiled_and_is_dropped_when_a_compile_fails(
        fresh: list[Callable[..., Any]], monkeypatch: pytest.MonkeyPatch) -> None:
    """Each ``obj.method`` is a new bound-method object, equal (not
    identical) to the one cached: ``is_compiled`` finds it once compiled,
    and when a later signature of it fails to compile, the variants compiled
    before are dropped with it (``compiled_count`` back to 0), as for a plain
    function; the values stay the kernel's."""
    scaler = _Scaler(3.0)
    x = torch.arange(10, dtype=torch.float64)
    with compiler.forced("on"):
        compiler.run(scaler.kernel, x.numel(), x)
    assert compiler.is_compiled(scaler.kernel) and compiler.compiled_count() == 1
    monkeypatch.setattr(torch, "compile", _failing_compile)
    with compiler.forced("on"), pytest.warns(RuntimeWarning, match="running it eagerly"):
        got = compiler.run(scaler.kernel, x.numel(), x.float())  # another signature: compiled anew, fails
    assert torch.equal(got, torch.tensor([3.0 * i for i in range(10)], dtype=torch.float32))
    assert compiler.compiled_count() == 0 and not compiler.is_compiled(scaler.kernel)
    assert not compiler.will_compile(scaler.kernel, x.numel(), "cpu")

def test_a_plain_function_kernel_is_compiled_as_a_copy_of_its_own(fresh: list[Callable[..., Any]]) -> None:
    """A plain function is compiled as a copy over a code object of its own
    (Dynamo counts recompiles per code object), computing the same values."""
    def triple(v: torch.Tensor) -> torch.Tensor:
        return v * 3

    x = torch.arange(10, dtype=torch.float64)
    with compiler.forced("on"):
        got = compiler.run(triple, x.numel(), x)
    assert torch.equal(got, torch.tensor([3.0 * i for i in range(10)], dtype=torch.float64))
    assert len(fresh) == 1 and fresh[0] is not triple and fresh[0].__code__ is not triple.__code__
    assert compiler.is_compiled(triple)


# ----------------------------------------------------------------------------- a failed compile
@pytest.mark.parametrize("first", ["into", "kernel"])
def test_a_failed_compile_leaves_neither_the_kernel_nor_its_into_variant_compiled(
        first: str, fresh: list[Callable[..., Any]], monkeypatch: pytest.MonkeyPatch) -> None:
    """Whichever of a kernel and its ``into`` variant fails first, neither
    counts as compiled afterwards (``is_compiled``, ``compiled_count``: the
    failed variant's cache entry is dropped), neither will compile again,
    and the call's values come from the eager kernel."""
    monkeypatch.setattr(torch, "compile", _failing_compile)

    def add_one(v: torch.Tensor) -> torch.Tensor:
        return v + 1

    x = torch.arange(6, dtype=torch.float64)
    want = torch.tensor([i + 1.0 for i in range(6)], dtype=torch.float64)
    with compiler.forced("on"), pytest.warns(RuntimeWarning, match="running it eagerly"):
        if first == "into":
            out = torch.zeros(6, dtype=torch.float64)
            compiler.run(compiler.into(add_one), x.numel(), out, x)
        else:
            out = compiler.run(add_one, x.numel(), x)
    assert torch.equal(out, want)
    assert compiler.compiled_count() == 0
    assert not compiler.is_compiled(add_one) and not compiler.is_compiled(compiler.into(add_one))
    assert not compiler.will_compile(add_one, 6, "cpu") and not compiler.will_compile(compiler.into(add_one), 6, "cpu")
