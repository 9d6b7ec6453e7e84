"""Gossip algorithms: checkpoints that resume bit-identically (messages in
flight included), clear errors for bad specs and unsound compressors, and a
dead or stuck peer named within the timeout."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from distributed import checkpoint, fault_entry, restore, run_until_rank0_reports, run_workers
from test_gossip import check_pushsum, consensus_run, loss_of, make_mlp

import gradpress.algorithms as algorithms
from gradpress.algorithms.gossip_codec import accepted_compressors, gossip_scale
from gradpress.compress import create as compressor

RESUME = [("sgp:overlap=1,gamma=0.5", "topk:ratio=0.1"), ("sgp:overlap=2", None), ("sgp:peers=2", "qsgd:levels=4"),
          ("choco:gamma=0.3", "sidco:ratio=0.05"), ("dpsgd", None)]


def _run(model: torch.nn.Module, opt: torch.optim.Optimizer, algo, rank: int, steps: range) -> list[torch.Tensor]:  # noqa: ANN001
    out = []
    for step in steps:
        opt.zero_grad()
        loss_of(model, rank, step).backward()
        algo.step()
        out.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    return out


def _build(spec: str, comp: str | None) -> tuple:
    model = make_mlp()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    return model, opt, algorithms.create(spec, model, opt, compressor=comp, min_numel=64)


def _errors(rank: int) -> dict:
    out = {}
    cases = {
        "peers": ("sgp:peers=3", {}), "signsgd": ("choco", {"compressor": "signsgd"}),
        "powersgd": ("choco", {"compressor": "powersgd"}), "dgc": ("sgp", {"compressor": "dgc"}),
        "minmax8": ("sgp", {"compressor": "minmax8"}), "dpsgd_topk": ("dpsgd", {"compressor": "topk"}),
        "no_feedback": ("choco", {"error_feedback": False}), "skip": ("sgp", {"nonfinite": "skip"}),
        "ring": ("dpsgd", {"strategy": "ring"}), "mismatch": (f"choco:gamma={0.1 * (rank + 1):.1f}", {}),
    }
    for name, (spec, kw) in cases.items():
        model = make_mlp()
        try:
            algorithms.create(spec, model, torch.optim.SGD(model.parameters(), lr=0.1), **kw)
            out[name] = None
        except ValueError as exc:
            out[name] = str(exc)
    return out


def _worker(rank: int, world: int) -> dict:
    out: dict = {}
    for spec, comp in RESUME:
        model, opt, algo = _build(spec, comp)
        _run(model, opt, algo, rank, range(5))
        saved = checkpoint(algo=algo, model=model, opt=opt)
        cont = _run(model, opt, algo, rank, range(5, 10))
        model2, opt2, algo2 = _build(spec, comp)
        restore(saved, model=model2, opt=opt2, algo=algo2)
        resumed = _run(model2, opt2, algo2, rank, range(5, 10))
        out[spec] = {"cont": cont, "resumed": resumed, "stats": algo2.stats, "first": cont[0]}
    out["errors"] = _errors(rank)
    for tau in (0, 1):
        out[("pushsum", tau)] = consensus_run(rank, world, f"sgp:overlap={tau}", None, 150)
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_workers(_worker, 3)


@pytest.mark.parametrize("spec,comp", RESUME)
def test_resume_from_state_dict_is_bit_identical(results: list[dict], spec: str, comp: str | None) -> None:
    for res in results:
        r = res[spec]
        for a, b in zip(r["cont"], r["resumed"]):
            assert torch.equal(a, b)
        assert r["stats"]["steps"] == 10
    assert not torch.equal(results[0][spec]["first"], results[1][spec]["first"])  # replicas differ: gossip, not DDP


@pytest.mark.parametrize("tau", [0, 1])
def test_pushsum_on_3_workers(results: list[dict], tau: int) -> None:
    """Any n works: on 3 workers the hops are 1 and 2 (2^0, 2^1)."""
    check_pushsum(results, ("pushsum", tau), tau)


@pytest.mark.parametrize("case,words", [
    ("peers", ["'peers' got 3", "1 <= peers <= 2 on 3 workers"]),
    ("signsgd", ["'signsgd' is refused", "majority votes", "topk"]),
    ("powersgd", ["'powersgd:", "multi-round"]),
    ("dgc", ["own error memory"]),
    ("minmax8", ["neither contractive", "accepted:"]),
    ("dpsgd_topk", ["gossips exact parameters", "use choco or sgp"]),
    ("no_feedback", ["error_feedback=False is not possible", "public copies"]),
    ("skip", ["nonfinite='skip' is not supported", "allowed: propagate"]),
    ("ring", ["strategy 'ring' does not apply"]),
    ("mismatch", ["differs between ranks", "choco:gamma=0.2"]),
])
def test_clear_errors(results: list[dict], case: str, words: list[str]) -> None:
    for res in results:
        msg = res["errors"][case]
        assert msg is not None, f"{case}: no error"
        for w in words:
            assert w in msg, (w, msg)


def test_registry_lists_gossip_and_validates_specs() -> None:
    rows = {r["name"]: r for r in algorithms.describe()}
    assert [p["name"] for p in rows["sgp"]["params"]] == ["peers", "overlap", "gamma"]
    assert rows["choco"]["default_compressor"] == "efsignsgd"
    assert [(p["name"], p["default"]) for p in rows["dpsgd"]["params"]] == [("topology", "ring")]
    with pytest.raises(ValueError, match="algorithm 'sgp': parameter 'overlap' got 65; allowed: 0 <= overlap <= 64"):
        algorithms.parse("sgp:overlap=65")
    with pytest.raises(ValueError, match="parameter 'topology' got 'star'; allowed: ring | exponential | complete"):
        algorithms.parse("choco:topology=star")
    with pytest.raises(ValueError, match="parameter 'gamma' got 0.0"):
        algorithms.parse("choco:gamma=0")


def test_compressor_soundness_from_traits() -> None:
    d = 4096
    assert gossip_scale(compressor("topk:ratio=0.01"), d, "choco") == 1.0
    assert gossip_scale(compressor("randomk:ratio=0.25"), d, "choco") == 1.0
    assert gossip_scale(compressor("randomk:ratio=0.25,scale=true"), d, "choco") == pytest.approx(0.25)
    assert gossip_scale(compressor("natural"), d, "choco") == pytest.approx(8 / 9)
    omega = min(512 / 16**2, 512**0.5 / 16)  # QSGD, bucket 512, 16 levels
    assert gossip_scale(compressor("qsgd:levels=16,bucket=512"), d, "choco") == pytest.approx(1 / (1 + omega))
    assert gossip_scale(compressor("topk:ratio=0.01>natural"), d, "choco") == 1.0
    for refused in ("signsgd", "signum", "powersgd", "dgc", "adacomp", "minmax8", "terngrad"):
        with pytest.raises(ValueError, match="is refused"):
            gossip_scale(compressor(refused), d, "choco")
    ok = " ".join(accepted_compressors())
    for name in ("topk", "randomk", "efsignsgd", "onebit", "fp16", "sidco", "qsgd (unbiased"):
        assert name in ok
    assert "signsgd" not in ok.split() and "minmax8" not in ok


def test_docs_compressor_table_is_what_the_code_decides() -> None:
    """docs/gossip.md's table of accepted and refused compressors."""
    import pathlib
    import re

    doc = (pathlib.Path(__file__).parent.parent / "docs" / "gossip.md").read_text()
    table = doc[doc.index("| compressor | accepted as | why |"):].split("\n\n")[0].splitlines()[2:]
    seen = 0
    for row in table:
        names, verdict = row.split(" | ")[0], row.split(" | ")[1]
        for name in re.findall(r"`([^`]+)`", names):
            comp = compressor(name.replace("ratio=r", "ratio=0.01"))
            if "refused" in verdict:
                with pytest.raises(ValueError, match="is refused"):
                    gossip_scale(comp, 4096, "choco")
            else:
                assert gossip_scale(comp, 4096, "choco") > 0
            seen += 1
    assert seen >= 20


# ------------------------------------------------------------------ faults
TIMEOUT = 5.0
FAULT_STEP = 3


def _fault_setup(rank: int, spec: str) -> Callable[[int], None]:
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    algo = algorithms.create(spec, model, opt, timeout=TIMEOUT)
    return lambda i: _run(model, opt, algo, rank, range(i, i + 1))


def _run_fault(how: str, spec: str, deadline: float = 90.0) -> dict | None:
    return run_until_rank0_reports(fault_entry, 2, (how, _fault_setup, (spec,), FAULT_STEP, FAULT_STEP + 4), deadline)[0]


@pytest.mark.parametrize("how,spec", [("exit", "sgp:overlap=1"), ("stuck", "choco")])
def test_dead_or_stuck_peer_is_named_within_the_timeout(how: str, spec: str) -> None:
    result = _run_fault(how, spec)
    assert result is not None, f"rank 0 neither finished nor raised (peer {how})"
    assert result["error"] is not None, f"rank 0 finished {result.get('steps')} steps without its peer"
    assert "peer rank 1" in result["error"], result["error"]
    assert result["elapsed"] < TIMEOUT + 25, f"raised only after {result['elapsed']:.1f} s"
    if how == "stuck":
        assert result["elapsed"] >= TIMEOUT - 0.5, f"raised after {result['elapsed']:.1f} s: not the timeout"
        assert "timeout" in result["error"].lower() or "timed out" in result["error"].lower()
