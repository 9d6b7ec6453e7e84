"""A folded engine state loads through the load's refusals (``exchange/state_check.py``) into a real engine of
the new world and steps: the reshard (``Strategy.reshard_fold``) and the checks agree on what an engine keeps.

4 gloo workers run real engines of ``ps`` and ``hierarchical:workers_per_host=2`` for 2 calls and save their
states (through ``torch.save`` / ``torch.load(weights_only=True)``); the test folds them onto 2 ranks
(:func:`gradpress.exchange.reshard.fold`) and 2 workers load each rank's fold into a fresh engine, then call it
twice. Cases: ``ps`` with one-bit (root residuals ``root/<key>#ps`` moved to their new roots, not zero) and
with top-k (its root residuals are zero, their keys moved alike; no built-in compressor that ``ps`` carries
keeps per-tensor state, so no root compressor state ``<key>#ps`` is built: DGC and AdaComp are refused by
``ps``, PowerSGD and Signum too);
``hierarchical`` with top-k (new rank 1 is no leader of the one new host and still gets the ``host/``
copy), DGC (the leaders' momentum folded) and PowerSGD (the leaders' equal Q, of shape ``(m, r)``, kept).
Each load must succeed, the loaded engine's residuals and compressor state must be the fold's, bitwise,
and the new ranks' averages of the 2 calls are equal (one average) and finite. Parameters ``w`` (16 x 12,
PowerSGD's matrix), ``enc/x`` (escaped ``enc%2Fx`` in every key) and ``b``.

Planted (each alone): ps_reshard placing a root residual under its key with the ``#ps`` suffix dropped
(``root/w``, which the load's checks accept: a namespaced key without a tail): both ps cases failed on the
new ranks' root keys (``['root/enc%2Fx', 'root/w']``); hierarchical_reshard giving only new rank 0 the
``host/`` part: hier_topk and hier_powersgd failed (``KeyError: 'host/w'`` on rank 1); state_check's
namespaced bound at ``>=`` in place of ``>``: the load failed on worker 0 ("192 elements, expected at most
192") and every case errored. Two launches (4 workers, then 2), about 20 s on the shared machine.
"""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
from distributed import run_workers
from state_diff import diff

from gradpress.exchange.reshard import fold

F32 = torch.float32
PARAMS = [("w", (16, 12), F32), ("enc/x", (6, 5), F32), ("b", (12,), F32)]
KEYS = [k for k, _, _ in PARAMS]
HIER = "hierarchical:workers_per_host=2"
#: case: (compressor, strategy)
CASES = {
    "ps_onebit": ("onebit", "ps"),
    "ps_topk": ("topk:ratio=0.3", "ps"),
    "hier_topk": ("topk:ratio=0.3", HIER),
    "hier_dgc": ("dgc:ratio=0.3", HIER),
    "hier_powersgd": ("powersgd:rank=2,start_iter=0", HIER),
}


def _grads(rank: int, step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return [torch.randn(shape, generator=g, dtype=dtype) for _, shape, dtype in PARAMS]


def _roundtrip(state: Any) -> Any:
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _engine(name: str) -> Any:
    from gradpress.exchange.engine import Synchronizer

    compressor, strategy = CASES[name]
    return Synchronizer(compressor, strategy=strategy, params=PARAMS, min_numel=1, seed=3)


def _save(rank: int, world: int) -> dict[str, Any]:
    out = {}
    for name in CASES:
        engine = _engine(name)
        for step in range(2):
            engine.sync(KEYS, _grads(rank, step), step=step)
        out[name] = _roundtrip(engine.state_dict())
    return out


def _load(rank: int, world: int, folded: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    out = {}
    for name in CASES:
        engine = _engine(name)
        engine.load_state_dict(folded[name][rank])
        state = engine.state_dict()
        averages = []
        for step in (2, 3):
            tensors = _grads(rank, step)
            engine.sync(KEYS, tensors, step=step)
            averages.append(tensors)
        out[name] = {"feedback": state["feedback"], "compressor": state["compressor"],
                     "strategies": state["strategies"], "averages": averages}
    return out


@pytest.fixture(scope="module")
def folded_and_loaded() -> tuple[list[dict[str, Any]], dict[str, list[dict[str, Any]]], list[dict[str, Any]]]:
    saved = run_workers(_save, 4)
    folded = {name: [fold([s[name] for s in saved], r, 2) for r in range(2)] for name in CASES}
    return saved, folded, run_workers(_load, 2, folded)


@pytest.mark.parametrize("name", list(CASES))
def test_a_folded_state_loads_into_an_engine_of_the_new_world_and_steps(folded_and_loaded, name: str) -> None:  # noqa: ANN001
    saved, folded, loaded = folded_and_loaded
    for rank in range(2):
        got, want = loaded[rank][name], folded[name][rank]
        assert diff(want["feedback"]["residuals"], got["feedback"]["residuals"], f"rank {rank} residuals") is None
        assert diff(want["compressor"], got["compressor"], f"rank {rank} compressor") is None
    for step, (a, b) in enumerate(zip(loaded[0][name]["averages"], loaded[1][name]["averages"])):
        for key, x, y in zip(KEYS, a, b):
            assert torch.isfinite(x).all(), (step, key)
            assert torch.equal(x, y), (step, key)
    res = [folded[name][r]["feedback"]["residuals"] for r in range(2)]
    if name.startswith("ps"):  # every saved root residual on exactly one new rank, bitwise its saved root's
        held = {k: t for s in saved for k, t in s[name]["feedback"]["residuals"].items() if k.startswith("root/")}
        assert held and sorted(held) == sorted(k for r in res for k in r if k.startswith("root/"))
        for r in res:
            for k, t in r.items():
                if k.startswith("root/"):
                    assert torch.equal(t, held[k]), k
        if name == "ps_onebit":
            assert any(bool(t.abs().sum() > 0) for t in held.values())
    else:  # both new ranks hold the mean of the saved leaders' (0 and 2) host residuals; rank 1 leads no host
        hosts = [k for k in saved[0][name]["feedback"]["residuals"] if k.startswith("host/")]
        assert bool(hosts) == (name != "hier_dgc")  # DGC keeps its own error memory: no residual
        for k in hosts:
            want = ((saved[0][name]["feedback"]["residuals"][k].double()
                     + saved[2][name]["feedback"]["residuals"][k].double()) / 2).float()
            for r in range(2):
                assert torch.equal(res[r][k], want), (r, k)
        for entry in ("momentums", "velocities", "q"):  # the leaders' buffers: the mean (equal: kept)
            held = saved[0][name]["compressor"].get(entry)
            for k in held or ():
                want = ((held[k].double() + saved[2][name]["compressor"][entry][k].double()) / 2).float()
                for r in range(2):
                    assert torch.equal(folded[name][r]["compressor"][entry][k], want), (entry, k)
        if name != "hier_topk":
            assert any(saved[0][name]["compressor"].get(e) for e in ("momentums", "q"))
