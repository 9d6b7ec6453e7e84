"""Three loose ends of the state copy (``tests/test_review_snapcopy.py``), one process, a one-rank gloo group
(about 2 s).

1. ``state_dict_copies`` holds for the ``state_dict`` its class declared it with: a subclass that overrides
   ``state_dict`` without setting the flag in its own body gets False (a compressor or a strategy), so a
   plugin built on Signum whose ``state_dict`` returns the live momentum is deep-copied by the skip snapshot;
   its skipped step (a NaN at step 3 in ``w``; ``b`` is finite and its momentum moves in place) leaves no
   trace: both averages equal the float64 Signum reference without that step.
2. ``memory_bytes()["compressor"]`` is the bytes of the live state, summed here from the buffers by definition
   (DGC's momentum and velocity, Signum's momentum, PowerSGD's Q, AdaComp's residue), and takes no copy of it
   (no ``aten.clone``/``aten.copy_`` while counting).
3. ``load_state_dict``'s rollback backup is one copy of the state: a load of an engine's own state copies the
   bytes of its tensors twice (the backup, then the load), not three times (``state_dict`` then a deep copy).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from copy_count import Copies, tensor_bytes
from distributed import one_rank_module

from gradpress.compress import registry
from gradpress.compress.registry import _REGISTRY
from gradpress.compress.signum import Signum
from gradpress.exchange.engine import Synchronizer
from gradpress.exchange.strategies.ps import ParameterServer

group = one_rank_module  # the module's one-process gloo group

W, B = (16, 32), (8, 16)
BETA = 0.9  # Signum's default momentum
LIVE = "test-live-signum"
#: the built-in compressors with tensor state, and the keys of their live buffers
BUFFERS = {"dgc:ratio=0.05": ("momentums", "velocities"), "signum": ("buffers",),
           "powersgd:rank=2,start_iter=0": ("q",), "adacomp": ("residues",),
           "dgc:ratio=0.05>natural": ("momentums", "velocities")}


class _LiveSignum(Signum):
    """A plugin on Signum following torch's convention: ``state_dict`` returns the live buffers (Signum updates
    them in place). It declares nothing about copies; Signum's ``state_dict_copies = True`` is not its."""

    name = LIVE

    def state_dict(self) -> dict[str, Any]:
        return {"momentum": dict(self.buffers)}


class _DeclaredSignum(Signum):
    """Overrides ``state_dict`` and says in its own body that it copies: kept."""

    state_dict_copies = True

    def state_dict(self) -> dict[str, Any]:
        return {"momentum": {k: v.clone() for k, v in self.buffers.items()}}


class _PlainSignum(Signum):
    """Inherits Signum's ``state_dict``, and with it Signum's declaration."""


class _LivePS(ParameterServer):
    """A strategy whose ``state_dict`` hands out its live roots."""

    def state_dict(self) -> dict[str, Any]:
        return {"roots": self.roots, "next_root": self._next_root}


@pytest.fixture()
def live_signum():  # noqa: ANN201
    registry.register(_LiveSignum)
    try:
        yield LIVE
    finally:
        _REGISTRY.classes.pop(LIVE, None)


def _grads(step: int, bad: set[int] = frozenset()) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[assignment]
    w = torch.randn(W, generator=torch.Generator().manual_seed(1000 + step), dtype=torch.float64)
    b = torch.randn(B, generator=torch.Generator().manual_seed(77 + step), dtype=torch.float64)
    if step in bad:
        w[3, 5] = math.nan
    return w, b


def _engine(spec: Any, nonfinite: str = "skip") -> Synchronizer:
    return Synchronizer(spec, params=[("w", W, torch.float64), ("b", B, torch.float64)], min_numel=64,
                        nonfinite=nonfinite)


def _run(engine: Synchronizer, steps: int, bad: set[int] = frozenset()) -> list:  # type: ignore[assignment]
    out = []
    for step in range(steps):
        w, b = _grads(step, bad)
        engine.sync(["w", "b"], [w, b], step=step)
        out.append((w, b, engine.last_step_skipped))
    return out


def _bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


# ------------------------------------------------------------- 1. the declaration goes with its state_dict
def test_a_subclass_overriding_state_dict_does_not_inherit_state_dict_copies() -> None:
    assert Signum.state_dict_copies and _PlainSignum.state_dict_copies and _DeclaredSignum.state_dict_copies
    assert _LiveSignum.state_dict_copies is False, "a live state_dict inherited Signum's state_dict_copies = True"
    assert ParameterServer.state_dict_copies
    assert _LivePS.state_dict_copies is False, "a live strategy state_dict inherited ps's state_dict_copies = True"


def test_a_registered_live_subclass_is_copied_whole_and_its_skipped_step_leaves_no_trace(
        group, live_signum: str) -> None:  # noqa: ANN001
    engine = _engine(live_signum)
    assert type(engine.compressor) is _LiveSignum
    bad = {3}
    m = {"w": torch.zeros(W, dtype=torch.float64), "b": torch.zeros(B, dtype=torch.float64)}
    for step, (w, b, skipped) in enumerate(_run(engine, 7, bad)):
        if step in bad:
            assert skipped and not bool(w.any()) and not bool(b.any()), f"step {step}: not dropped"
            continue
        assert not skipped, f"step {step}: dropped"
        g = dict(zip("wb", _grads(step)))
        for key, got in (("w", w), ("b", b)):
            m[key] = BETA * m[key] + (1 - BETA) * g[key]
            want = torch.where(m[key] >= 0, 1.0, -1.0).double()
            assert torch.equal(got, want), (f"step {step} {key}: {int((got != want).sum())} signs differ from "
                                            "Signum's float64 reference without the skipped step")


# ------------------------------------------------------------- 2. memory_bytes without a copy
@pytest.mark.parametrize("spec", sorted(BUFFERS))
def test_memory_bytes_counts_the_live_buffers_without_copying_them(group, spec: str) -> None:  # noqa: ANN001
    engine = _engine(spec, nonfinite="propagate")
    _run(engine, 2)
    comp = engine.compressor
    comp = getattr(comp, "first", comp)  # a composition's state is its first stage's
    live = [t for attr in BUFFERS[spec] for t in getattr(comp, attr).values()]
    assert live, f"{spec}: no state after two steps (the test checks nothing)"
    with Copies() as copies:
        mem = engine.memory_bytes()
    assert mem["compressor"] == _bytes(live), f"{spec}: {mem['compressor']} bytes, the buffers hold {_bytes(live)}"
    assert copies.bytes == 0, f"{spec}: memory_bytes copied {copies.bytes} bytes to count {_bytes(live)}"


def test_memory_bytes_of_every_stateful_compressor_is_its_state_dicts_bytes(group) -> None:  # noqa: ANN001
    """The count and the state agree for every stateful compressor of the registry (none clones to count)."""
    for name in registry.names():
        if not registry.get_class(name).stateful:
            continue
        spec = next((s for s in BUFFERS if s.split(":")[0] == name), name)
        engine = _engine(spec, nonfinite="propagate")
        _run(engine, 2)
        held = tensor_bytes(engine.compressor.state_dict())
        with Copies() as copies:
            counted = engine.memory_bytes()["compressor"]
        assert counted == held, f"{name}: memory_bytes says {counted}, state_dict holds {held}"
        assert copies.bytes == 0, f"{name}: memory_bytes copied {copies.bytes} bytes"


# ------------------------------------------------------------- 3. the rollback backup is one copy
@pytest.mark.parametrize("spec", sorted(BUFFERS))
def test_load_state_dict_takes_one_backup_copy(group, spec: str) -> None:  # noqa: ANN001
    engine = _engine(spec, nonfinite="propagate")
    _run(engine, 2)
    comp = engine.compressor
    comp = getattr(comp, "first", comp)
    state = engine.state_dict()
    tensors = _bytes(engine.feedback.residuals.values()) + _bytes(
        t for attr in BUFFERS[spec] for t in getattr(comp, attr).values())
    assert tensors
    with Copies() as copies:
        engine.load_state_dict(state)
    assert copies.bytes == 2 * tensors, (f"{spec}: loading copied {copies.bytes} bytes for {tensors} bytes of "
                                         f"state ({copies.bytes / tensors:.1f} copies; one backup + one load = 2)")
    after = engine.state_dict()
    for key in ("momentum", "momentums", "velocities", "q", "residues"):
        for k, v in state["compressor"].get(key, {}).items():
            assert torch.equal(v, after["compressor"][key][k]), f"{spec}: {key}[{k!r}] changed by the load"


class _ExtraSignum(Signum):
    """Keeps one more tensor besides Signum's buffers and says so in its own ``state_dict`` only (no
    ``state_nbytes`` of its own): Signum's count of its buffers is not this class's."""

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        self.extra = torch.zeros(37, dtype=torch.float64)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "extra": self.extra.clone()}


def test_state_nbytes_goes_with_its_state_dict() -> None:
    from gradpress.compress import Context

    comp = _ExtraSignum()
    comp.encode(torch.ones(50), Context(key="w", step=1))
    want = 50 * 4 + 37 * 8  # Signum's momentum of w (float32) and the extra float64 tensor
    assert tensor_bytes(comp.state_dict()) == want
    assert comp.state_nbytes() == want, (f"a subclass with its own state_dict counted {comp.state_nbytes()} bytes "
                                         f"(Signum's buffers), its state_dict holds {want}")
