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
