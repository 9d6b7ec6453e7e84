"""A state load refuses what the engine cannot use: residuals and compressor buffers under keys no tensor of
the engine builds, or of the wrong shape or dtype; one process, a one-rank gloo group, about 15 s.

``exchange/state_check.py:check_contents`` runs before anything changes. Each case runs an engine ``a`` and its
twin ``b`` (same parameters, gradients and seed) for 2 calls, ``a`` having saved its state (through
``torch.save`` / ``torch.load(weights_only=True)``) after its first, breaks one entry of that state and loads
it into ``a``: ``ValueError`` naming the entry's key and what was found and expected (both shapes, or the
dtype) and "nothing was loaded"; ``a``'s ``state_dict()`` is then bitwise the one before the load, and the
next 2 calls of ``a`` and ``b`` average bit-identically and leave bit-identical states. The parameters are
``w`` (16 x 12, which PowerSGD of rank 2 compresses), ``enc/x`` (escaped ``enc%2Fx`` in every key) and ``b``.
The DDP hook's load goes through the same check (after its keys and layout are upgraded): a DGC momentum one
entry short is refused there too, the hook stays bound and steps as its twin.

Before the checks these loaded: a residual under a foreign or typo'd key (``wx``, ``rnig/w``, an unescaped
``enc/x``) was kept and written into every later checkpoint; a worker residual of another shape (transposed,
flat) was ignored by ``Feedback.compensate`` without a word; DGC's momentum of another size, or not flat, restarted
at zero; PowerSGD's Q of another rank was drawn afresh; Signum's momentum of another size loaded and failed the
next call mid-exchange (``key 'w' has a momentum buffer of 191 entries``). The legitimate variants still load:
a worker residual in the gradient's half precision (mixed precision), a ring residual of a partition
(``ring/w#1``, half the elements), a PowerSGD Q of a tensor it sends dense (no shape to hold it to).

Planted (each alone): ``check_contents`` not called: every refusal case loads (13 fail, and the hook's); ``_check_residual``'s
namespace check removed: ``namespace_typo`` and ``unescaped`` fail with "never exchanges" in place of the
namespace, and the worker-shape check removed: ``worker_transposed`` and ``worker_flat`` load; the namespaced
bound removed: ``ring_too_big`` loads; ``key_tail``'s tail grammar accepting any tail: ``root_bad_tail``
loads; ``namespace_tail``'s check removed (each namespace's suffix): ``root_without_ps``, ``ring_with_ps`` and
``host_with_ps`` load; the element buffers' 1-D check removed: ``dgc_velocity_2d`` loads; ``PowerSGD.state_shape`` returning
None: ``powersgd_q_rank`` loads; ``Compressor.state_shape`` returning None: ``dgc_momentum_size`` and
``signum_momentum_size`` load.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn
from distributed import one_rank_module
from state_diff import diff as _diff
from torch.nn.parallel import DistributedDataParallel as DDP

import gradpress
from gradpress.exchange.engine import Synchronizer

group = one_rank_module  # the module's one-process gloo group
F32 = torch.float32
PARAMS = [("w", (16, 12), F32), ("enc/x", (6, 5), F32), ("b", (12,), F32)]
KEYS = [k for k, _, _ in PARAMS]


def _grads(step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(shape, generator=g, dtype=dtype) for _, shape, dtype in PARAMS]


def _call(engine: Synchronizer, step: int) -> list[torch.Tensor]:
    tensors = _grads(step)
    engine.sync(KEYS, tensors, step=step)
    return tensors


def _roundtrip(state: dict[str, Any]) -> dict[str, Any]:
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)




def _residuals(s: dict) -> dict:
    return s["feedback"]["residuals"]


def _set(where: Callable[[dict], dict], key: str, value: Callable[[dict], torch.Tensor]) -> Callable[[dict], None]:
    def corrupt(s: dict) -> None:
        where(s)[key] = value(where(s))
    return corrupt


def _comp(entry: str) -> Callable[[dict], dict]:
    return lambda s: s["compressor"][entry]


def _unescaped(s: dict) -> None:
    _residuals(s)["enc/x"] = _residuals(s).pop("enc%2Fx")


TOPK = "topk:ratio=0.3"
POWERSGD = "powersgd:rank=2,start_iter=0"
#: case: (compressor, how the saved state is broken, fragments the error must hold)
REFUSED: dict[str, tuple[str, Callable[[dict], None], tuple[str, ...]]] = {
    "foreign_key": (TOPK, _set(_residuals, "wx", lambda r: r["w"].clone()),
                    ("feedback['residuals']['wx']", "never exchanges", "'w'", "'enc/x'")),
    "unescaped": (TOPK, _unescaped, ("['enc/x']", "namespace 'enc'")),
    "namespace_typo": (TOPK, _set(_residuals, "rnig/w", lambda r: r["w"].clone()), ("['rnig/w']", "namespace 'rnig'")),
    "worker_transposed": (TOPK, _set(_residuals, "w", lambda r: r["w"].t().contiguous()),
                          ("['w']", "shape (12, 16) float32", "expected shape (16, 12)")),
    "worker_flat": (TOPK, _set(_residuals, "enc%2Fx", lambda r: r["enc%2Fx"].reshape(-1)),
                    ("['enc%2Fx']", "shape (30,) float32", "expected shape (6, 5)")),
    "worker_int": (TOPK, _set(_residuals, "w", lambda r: r["w"].to(torch.int32)),
                   ("['w']", "shape (16, 12) int32", "floating-point")),
    "ring_too_big": (TOPK, _set(_residuals, "ring/w", lambda r: torch.zeros(193)),
                     ("['ring/w']", "shape (193,) float32", "at most 192")),
    "root_bad_tail": (TOPK, _set(_residuals, "root/w#sp", lambda r: torch.zeros(4)), ("['root/w#sp']", "never exchanges")),
    "root_without_ps": (TOPK, _set(_residuals, "root/w", lambda r: torch.zeros(4)),
                        ("['root/w']", "not the key of a root residual", "then '#ps'")),
    "ring_with_ps": (TOPK, _set(_residuals, "ring/w#1#ps", lambda r: torch.zeros(4)),
                     ("['ring/w#1#ps']", "not the key of a ring residual", "then nothing")),
    "host_with_ps": (TOPK, _set(_residuals, "host/enc%2Fx#ps", lambda r: torch.zeros(4)),
                     ("['host/enc%2Fx#ps']", "not the key of a host residual")),
    "dgc_momentum_size": ("dgc:ratio=0.3", _set(_comp("momentums"), "w", lambda m: m["w"][:-1].clone()),
                          ("compressor 'dgc'", "momentums['w']", "shape (191,) float32", "expected shape (192,)")),
    "dgc_velocity_2d": ("dgc:ratio=0.3", _set(_comp("velocities"), "w", lambda m: m["w"].reshape(16, 12)),
                        ("compressor 'dgc'", "velocities['w']", "shape (16, 12) float32", "1-D")),
    "dgc_foreign_key": ("dgc:ratio=0.3", _set(_comp("momentums"), "v", lambda m: m["w"].clone()),
                        ("compressor 'dgc'", "momentums['v']", "never exchanges")),
    "powersgd_q_rank": (POWERSGD, _set(_comp("q"), "w", lambda q: torch.zeros(12, 3)),
                        ("compressor 'powersgd'", "q['w']", "shape (12, 3) float32", "expected shape (12, 2)")),
    "signum_momentum_size": ("signum", _set(_comp("momentum"), "w", lambda m: m["w"][:-1].clone()),
                             ("compressor 'signum'", "momentum['w']", "shape (191,) float32",
                              "expected shape (192,)")),
}

#: case: (compressor, a legitimate variant of the saved state)
LOADED: dict[str, tuple[str, Callable[[dict], None]]] = {
    "worker_half": (TOPK, _set(_residuals, "w", lambda r: r["w"].half())),
    "ring_partition": (TOPK, _set(_residuals, "ring/w#1", lambda r: torch.zeros(96))),
    "powersgd_dense_q": (POWERSGD, _set(_comp("q"), "enc%2Fx", lambda q: torch.zeros(5, 2))),
}


def _twins(compressor: str) -> tuple[Synchronizer, Synchronizer, dict[str, Any]]:
    """Two engines after 2 calls, and the first one's state saved after its first call."""
    a, b = (Synchronizer(compressor, params=PARAMS, min_numel=1, seed=3) for _ in range(2))
    saved = None
    for step in range(2):
        _call(a, step)
        _call(b, step)
        if step == 0:
            saved = _roundtrip(a.state_dict())
    assert saved is not None
    return a, b, saved


@pytest.mark.parametrize("name", list(REFUSED))
def test_a_state_with_an_entry_the_engine_cannot_use_is_refused_naming_it(group, name: str) -> None:  # noqa: ANN001
    compressor, corrupt, fragments = REFUSED[name]
    a, b, saved = _twins(compressor)
    before = _roundtrip(a.state_dict())
    assert _diff(saved, before) is not None, "the saved state equals the live one: no test"
    corrupt(saved)
    with pytest.raises(ValueError) as info:
        a.load_state_dict(saved)
    message = str(info.value)
    for fragment in (*fragments, "nothing was loaded"):
        assert fragment in message, (fragment, message)
    assert _diff(before, a.state_dict(), "state") is None
    for step in (2, 3):
        ya, yb = _call(a, step), _call(b, step)
        assert _diff(ya, yb, f"averages of call {step}") is None
        assert _diff(a.state_dict(), b.state_dict(), f"state after call {step}", timing=False) is None


@pytest.mark.parametrize("name", list(LOADED))
def test_a_legitimate_variant_still_loads(group, name: str) -> None:  # noqa: ANN001
    compressor, vary = LOADED[name]
    a, _, saved = _twins(compressor)
    vary(saved)
    a.load_state_dict(saved)
    assert _diff(saved["feedback"], a.state_dict()["feedback"]) is None
    assert _diff(saved["compressor"], a.state_dict()["compressor"]) is None
    _call(a, 2)  # and it steps


def _hook_step(ddp: DDP, opt: torch.optim.Optimizer, step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(5, 6, generator=g, dtype=torch.float64)
    opt.zero_grad(set_to_none=True)
    ((ddp(x) - x[:, :3]) ** 2).mean().backward()
    opt.step()
    return [p.detach().clone() for p in ddp.parameters()]


def test_the_hook_refuses_a_wrong_compressor_buffer_and_stays_bound_stepping_as_its_twin(group) -> None:  # noqa: ANN001
    """Through ``GradpressHook.load_state_dict`` (``ddp/hook_state.py:load``: keys and layout upgraded first):
    DGC's momentum of parameter ``0.weight`` (8 x 6) one entry short is refused naming it and both shapes;
    the hook stays bound at its step and steps as its twin."""
    objs = []
    for _ in range(2):
        torch.manual_seed(0)
        ddp = DDP(nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).to(torch.float64))
        hook = gradpress.ddp.register(ddp, "dgc:ratio=0.3", min_numel=1)
        objs.append((ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), hook))
    (da, oa, a), (db, ob, b) = objs
    saved = None
    for step in range(2):
        _hook_step(da, oa, step)
        _hook_step(db, ob, step)
        if step == 0:
            saved = _roundtrip(a.state_dict())
    assert saved is not None
    momentums = saved["compressor"]["momentums"]
    momentums["0.weight"] = momentums["0.weight"][:-1].clone()
    before = _roundtrip(a.state_dict())
    with pytest.raises(ValueError) as info:
        a.load_state_dict(saved)
    for fragment in ("compressor 'dgc'", "momentums['0.weight']", "shape (47,) float64", "expected shape (48,)",
                     "nothing was loaded"):
        assert fragment in str(info.value), (fragment, str(info.value))
    assert a.bound and a.step == 2
    assert _diff(before, a.state_dict(), "state") is None
    for step in (2, 3):
        assert _diff(_hook_step(da, oa, step), _hook_step(db, ob, step), f"parameters after step {step}") is None
        assert _diff(a.state_dict(), b.state_dict(), f"state after step {step}", timing=False) is None
    a.close()
    b.close()


def test_naming_a_declared_namespace_again_keeps_its_suffix() -> None:
    """A module that names ``root`` or ``ring`` again to read their residuals (tests/test_mutants_feedback.py does:
    ``namespace("root")``) keeps the suffix the strategy declared: before, it reset ``root``'s ``#ps`` to "any
    tail", and the full suite, which imports that module first, loaded ``root/w`` (no ``#ps``) and ``ring/w#ps``
    that this file refuses when run alone. Another suffix is refused by name."""
    from gradpress.exchange import keys
    from gradpress.exchange.strategies import ps, ring  # noqa: F401 - their declarations

    assert keys.namespace("root") == "root" and keys.namespace("ring") == "ring"
    assert keys.namespace_tail("root", "") is not None  # root/w: its #ps is missing
    assert keys.namespace_tail("root", "#ps") is None
    assert keys.namespace_tail("ring", "#ps") is not None
    with pytest.raises(ValueError, match=r"^residual namespace 'root' is declared with the key suffix '#ps', got ''"):
        keys.namespace("root", suffix="")
