"""docs/authoring.md's worked example (TBQ, threshold binary quantization)
runs as written: the declaration block is executed, the compressor is built
from a spec string, checked against TBQ's formula computed here in float64
(sign(x) tau where |x| >= tau, else 0), its derived layout and traits are
the ones the page shows, and it runs through the error-feedback exchange of
two ranks like any registered compressor. It also passes what the page's
"The generic tests on your plugin" runs on it as a plugin: its declared
scale degree and the extreme inputs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from gradpress.compress import Context, create
from gradpress.compress.registry import _REGISTRY

DOC = Path(__file__).resolve().parents[1] / "docs" / "authoring.md"


def _example() -> str:
    text = DOC.read_text()
    section = text[text.index("## Worked example"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.fixture()
def tbq():
    namespace: dict = {}
    exec(compile(_example(), str(DOC), "exec"), namespace)  # noqa: S102 - the documented example itself
    try:
        yield namespace["TBQ"]
    finally:
        _REGISTRY.classes.pop("tbq", None)


def test_the_declaration_is_at_most_about_twenty_lines() -> None:
    lines = [ln for ln in _example().splitlines() if ln.strip() and not ln.lstrip().startswith(("#", '"""'))]
    assert len(lines) <= 22, len(lines)


def test_tbq_matches_its_formula_on_every_dtype(tbq) -> None:
    tau = 0.5
    comp = create(f"tbq:tau={tau}")
    assert type(comp) is tbq
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        for d in (0, 1, 5, 4096, 10_001):
            x = torch.randn(d, generator=torch.Generator().manual_seed(d), dtype=torch.float64).to(dtype)
            xd = x.double()
            want = torch.where(xd.abs() >= tau, torch.sign(xd) * tau, torch.zeros_like(xd)).to(dtype)
            packet = comp.encode(x)
            out = comp.decode(packet)
            assert out.dtype == dtype and out.shape == x.shape
            assert torch.equal(out, want), (dtype, d)
            buf = torch.full((d,), float("nan"), dtype=dtype)
            assert comp.decode_into(packet, buf) is buf and torch.equal(buf, want.reshape(-1)), (dtype, d)
            assert packet.nbytes == comp.wire_bytes(d, dtype) == (2 * d + 7) // 8


def test_derived_layout_and_traits_are_the_documented_ones(tbq) -> None:
    comp = create("tbq:tau=0.001")
    assert [(f.name, f.dtype, f.count, f.bits, f.nbytes) for f in comp.layout(1000)] == [
        ("codes", torch.uint8, 1000, 2, 250)]
    assert (comp.wire_bytes(1_000_003), comp.variable_size, comp.uses_context, comp.default_error_feedback) == (
        250001, False, False, True)
    doc = DOC.read_text()
    assert "[('codes', torch.uint8, 1000, 2, 250)]" in doc and "(250001, False, False, True)" in doc
    with pytest.raises(ValueError, match="parameter 'tau' got -1.0; allowed: tau > 0"):
        create("tbq:tau=-1")


def test_tbq_trains_through_error_feedback_like_any_compressor(tbq) -> None:
    """What TBQ drops stays in the residual: over steps of a constant
    gradient g with |g| <= tau, the sum of what was sent stays within tau of
    the sum of g (error feedback), computed here step by step in float64."""
    comp = create("tbq:tau=0.25")
    g = torch.linspace(-0.2, 0.2, 101, dtype=torch.float64)
    residual = torch.zeros_like(g)
    sent = torch.zeros_like(g)
    for step in range(200):
        p = g + residual
        out = comp.decode(comp.encode(p.float(), Context(step=step))).double()
        residual = p - out
        sent += out
    assert float((sent - 200 * g).abs().max()) < 0.25 + 1e-6  # the residual stays below tau
    assert float(sent.abs().max()) > 0


def test_the_worked_example_passes_the_generic_extreme_and_degree_checks(tbq) -> None:
    """What docs/authoring.md's "The generic tests on your plugin" runs on this
    declaration as a plugin holds: its declared ``scale_degree`` by its
    definition (decode(encode(s g)) against s**d decode(encode(g)) in float64,
    tests/test_compressor_traits.py) and the extreme inputs of every dtype
    (tests/test_extreme.py). A fixed tau is not homogeneous: declared with the
    default 1, or with tiny inputs required to decode nonzero, both failed."""
    from test_compressor_traits import test_declared_scale_degree_holds_by_its_definition
    from test_extreme import check_family

    assert create("tbq").scale_degree is None
    test_declared_scale_degree_holds_by_its_definition("tbq:tau=0.01")
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        check_family("tbq:tau=0.01", dtype)


def test_a_loss_scaler_is_refused_for_the_worked_example(tbq) -> None:
    """Under the DDP hook with a ``GradScaler`` the compressor sees the scaled gradient: TBQ's fixed tau
    (``scale_degree = None``) would then select by the scale, not by the gradient. Refused by name when the
    hook is made (and when it binds: the same ``check_feedback``); ``threshold``, whose tau is compared with
    |x| / ctx.loss_scale (degree 1), is accepted."""
    import gradpress.ddp

    if not hasattr(torch, "amp") or not hasattr(torch.amp, "GradScaler"):
        pytest.skip("this torch has no torch.amp.GradScaler")
    with pytest.raises(ValueError, match=r"^scaler: compressor 'tbq:tau=0.01' declares scale_degree=None "):
        gradpress.ddp.make_hook("tbq:tau=0.01", scaler=torch.amp.GradScaler("cpu"))
    state, _ = gradpress.ddp.make_hook("threshold:tau=0.01", scaler=torch.amp.GradScaler("cpu"))
    state.close()
