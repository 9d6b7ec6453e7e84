"""States written before the key encoding (no ``keys`` entry), read through
:func:`gradpress.exchange.keys.upgrade_keys` (docs/architecture.md, "Residual keys").

Each old state is built here by the old definition: every key is the raw
tensor name followed by the suffixes the exchange appended (a plan
partition ``#k``, a hierarchical piece ``#j``, ``#ps``, ``#ring<c>``); today's
key is the escaped name (``%`` -> ``%25``, ``/`` -> ``%2F``, ``#`` -> ``%23``)
followed by the same suffixes. One process, under 2 s.
"""

from __future__ import annotations

import warnings

import torch

#: names that need escaping, and what the encoding makes of them (by its definition, written out)
ESCAPED = {"enc/x": "enc%2Fx", "w#0": "w%230", "p%2F": "p%252F", "plain": "plain"}
HIER = "hierarchical:chunk=32,workers_per_host=1"


def _upgraded(state: dict, names: list[str]) -> dict:
    from gradpress.exchange.keys import KEYS_FORMAT, upgrade_keys

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing here was shared by two tensors: no warning
        new = upgrade_keys(state, names)
    assert new["keys"] == KEYS_FORMAT
    return new


def test_hierarchical_piece_keys_are_rekeyed() -> None:
    """A pipelined ``hierarchical`` call (``chunk``) compresses each piece ``j`` of a tensor cut in several
    under ``<key>#j`` (DGC's momentum and velocity, a threshold's scale): those keys are the tensor's, whatever
    the plan's partitions. They were left under their old keys (``enc/x#1``), so the resumed run lost them."""
    names = list(ESCAPED)
    pieces = {"enc/x": 4, "w#0": 4, "p%2F": 2, "plain": 2}
    old_keys = {f"{n}#{j}": f"{ESCAPED[n]}#{j}" for n, k in pieces.items() for j in range(k)}
    values = {k: torch.full((2,), float(i)) for i, k in enumerate(old_keys)}
    state = {"compressor": {"momentums": dict(values), "velocities": dict(values), "quality": {"count": 3}},
             "feedback": {"residuals": {n: values[f"{n}#0"] for n in names}
                          | {f"host/{n}": values[f"{n}#1"] for n in names}},
             "plan": {n: {"strategy": HIER, "parts": 1} for n in names}}
    new = _upgraded(state, names)
    want = {old_keys[k]: v for k, v in values.items()}
    for part in ("momentums", "velocities"):
        assert new["compressor"][part] == want, sorted(new["compressor"][part])
    assert new["compressor"]["quality"] == {"count": 3}
    assert new["feedback"]["residuals"] == ({ESCAPED[n]: values[f"{n}#0"] for n in names}
                                            | {f"host/{ESCAPED[n]}": values[f"{n}#1"] for n in names})


def test_a_piece_suffix_is_only_read_where_the_plan_pipelines() -> None:
    """Outside ``hierarchical`` a tensor in one part has no ``#j`` key: ``w#0`` beside ``w`` is the
    parameter ``w#0``'s (kept, re-keyed), not piece 0 of ``w``; under ``hierarchical`` it may be either
    (both wrote it): dropped with the warning."""
    import pytest

    from gradpress.exchange.keys import upgrade_keys

    t = torch.ones(2)
    state = {"compressor": {"momentums": {"w#0": t}}, "plan": {"w": {"strategy": "allgather", "parts": 1},
                                                              "w#0": {"strategy": "allgather", "parts": 1}}}
    assert _upgraded(state, ["w", "w#0"])["compressor"]["momentums"] == {"w%230": t}
    state["plan"] = {n: {"strategy": HIER, "parts": 1} for n in ("w", "w#0")}
    with pytest.warns(UserWarning, match="w#0"):
        assert upgrade_keys(state, ["w", "w#0"])["compressor"]["momentums"] == {}


def test_nested_per_tensor_maps_are_rekeyed() -> None:
    """A threshold selector's state nests its per-tensor maps (``correction``: ``scales`` and ``slopes``,
    by context key; gaussiank, redsync, sidco, dgc_threshold): they are re-keyed like the top-level ones (they
    were kept under the old keys, so the resumed run started every scale afresh)."""
    names = list(ESCAPED)
    scales = {n: 0.5 + i for i, n in enumerate(names)}
    state = {"compressor": {"quality": {"count": 2, "mean": 1.0, "last": 1.0},
                            "correction": {"scales": dict(scales), "slopes": {"enc/x": 2.0}},
                            "positions": {"w#0": 1.5}},
             "plan": {n: {"strategy": "allgather", "parts": 1} for n in names}}
    new = _upgraded(state, names)["compressor"]
    assert new["correction"] == {"scales": {ESCAPED[n]: v for n, v in scales.items()}, "slopes": {"enc%2Fx": 2.0}}
    assert new["positions"] == {"w%230": 1.5}
    assert new["quality"] == {"count": 2, "mean": 1.0, "last": 1.0}


def test_gossip_contexts_use_the_escaped_key() -> None:
    """CHOCO/SGP's codec compresses each parameter under the key every other path uses (the escaped name),
    so a stateful compressor's state (redsync's positions) is where ``upgrade_keys`` puts an old state's: the
    codec resumed from the upgraded old state encodes the next step exactly as the uninterrupted one."""
    from gradpress.algorithms.gossip_codec import Codec
    from gradpress.compress import Context, create
    from gradpress.exchange.keys import upgrade_keys

    names = list(ESCAPED)
    shapes = [torch.Size([16, 8])] * len(names)
    spec = "redsync:ratio=0.25"

    def codec(comp):  # noqa: ANN001, ANN202
        return Codec(comp, names, shapes, [True] * len(names), "choco",
                     lambda key, step: Context(key=key, step=step, seed=0))

    def grads(step: int) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(step)
        return [torch.randn(s, generator=g) for s in shapes]

    a = create(spec)
    ca = codec(a)
    for step in range(3):
        ca.encode(grads(step), step)
    saved = a.state_dict()
    assert set(saved["positions"]) == set(ESCAPED.values()), sorted(saved["positions"])
    raw = {v: k for k, v in ESCAPED.items()}
    old = {"compressor": {**saved, "positions": {raw.get(k, k): v for k, v in saved["positions"].items()}},
           "plan": {n: {"strategy": "allgather", "parts": 1} for n in names}}
    b = create(spec)
    b.load_state_dict(upgrade_keys(old, names)["compressor"])
    cb = codec(b)
    _, pa = ca.encode(grads(3), 3)
    _, pb = cb.encode(grads(3), 3)
    for x, y in zip(pa, pb):
        assert all(torch.equal(u, v) for u, v in zip(x.tensors, y.tensors))
    assert a.state_dict() == b.state_dict()
