"""Agreement and overflow guards of the exchange engine (issue 15, points
5-8; issue 14, the reproducible planner): ranks can never build different
plans, a bad option on one rank fails on every rank, an overflow in the
exchange of finite gradients is caught, ``raise`` raises the documented
type, old hook states load."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from distributed import run_workers
from refusals import forbid
from torch.nn.parallel import DistributedDataParallel as DDP

import gradpress.ddp
from gradpress.compress.halfprec import Float16
from gradpress.exchange import Synchronizer
from gradpress.exchange.costs import FIELDS, CostModel, Fit, load_costs
from gradpress.exchange.probe import measure


def model() -> torch.nn.Module:
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(40, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))


SLOW = {"allreduce": (2e-4, 2e-4, 1e-7), "allgather": (2e-4, 2e-4, 2e-7), "broadcast": (2e-4, 2e-4, 1e-7),
        "p2p": (2e-4, 2e-4, 1e-7), "encode": (1e-5, 1e-5, 1e-9), "decode": (1e-5, 1e-5, 1e-9),
        "wire": (0.0, 8.0, 0.08), "root_wire": (0.0, 8.0, 0.16)}
FAST = dict(SLOW, allreduce=(1e-6, 1e-6, 1e-12), allgather=(1e-6, 1e-6, 1e-12), broadcast=(1e-6, 1e-6, 1e-12),
            p2p=(1e-6, 1e-6, 1e-12))


def _registration_error(fn) -> str | None:  # noqa: ANN001
    try:
        fn()
    except ValueError as exc:
        return str(exc)
    return None


def _agreement(rank: int, world: int, tmp: str) -> dict:
    out: dict = {}
    # 5. plan_costs differ between ranks: refused on every rank, naming the field
    costs = SLOW if rank == 0 else FAST
    out["costs"] = _registration_error(lambda: gradpress.ddp.register(DDP(model()), "topk:ratio=0.1", strategy="auto",
                                                                       min_numel=16, plan_costs=costs))
    # one rank injects, the other measures: refused too
    kw = {"plan_costs": SLOW} if rank == 0 else {}
    out["inject_vs_measure"] = _registration_error(
        lambda: gradpress.ddp.register(DDP(model()), "topk:ratio=0.1", strategy="auto", min_numel=16, **kw))
    # 6. an invalid timeout on one rank fails on every rank, quickly
    out["timeout"] = _registration_error(lambda: gradpress.ddp.register(DDP(model()), "topk:ratio=0.1",
                                                                         timeout=-1 if rank == 1 else 30))
    # 14.2: ranks that measured different timings still use rank 0's plan (fit of the max, broadcast)
    engine = Synchronizer("topk:ratio=0.1", params=[("w", (64, 40), torch.float32), ("v", (4, 64), torch.float32)],
                          group=None, strategy="auto", min_numel=16)
    engine.replan(SLOW if rank == 0 else FAST)
    out["plan"] = engine.plan.to_json()

    def timer(fn, reps):  # noqa: ANN001,ANN202 - rank 1 is three times slower at everything
        fn()
        return 1e-3 * (rank * 2 + 1)

    out["measured"] = measure(None, engine.compressor, timer=timer, reps=1).fits()
    # a cost file gives the same plan twice
    path = f"{tmp}/costs.json"
    if rank == 0:
        with open(path, "w") as f:
            json.dump(CostModel.from_mapping(SLOW).to_json(compressor="topk:ratio=0.1", world_size=world), f)
    dist.barrier()
    plans = []
    for _ in range(2):
        hook = gradpress.ddp.register(DDP(model()), "topk:ratio=0.1", strategy="auto", min_numel=16, plan_costs=path)
        plans.append(hook.plan.to_json())
        hook.close()
    out["file_plans"] = plans
    out["file_other_compressor"] = _registration_error(
        lambda: gradpress.ddp.register(DDP(model()), "qsgd", strategy="auto", plan_costs=path))
    return out


@pytest.fixture(scope="module")
def agreement(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_workers(_agreement, 2, str(tmp_path_factory.mktemp("costs")))


def test_plan_costs_are_part_of_the_configuration_check(agreement: list[dict]) -> None:
    for res in agreement:
        assert res["costs"] and "differs between ranks" in res["costs"] and "plan_costs" in res["costs"]
        assert res["inject_vs_measure"] and "plan_costs" in res["inject_vs_measure"]


def test_invalid_timeout_on_one_rank_fails_on_every_rank(agreement: list[dict]) -> None:
    for res in agreement:
        assert res["timeout"] and "rank 1" in res["timeout"] and "timeout must be a positive number" in res["timeout"]
        # no wall-clock bound: a rank that had waited out the group's timeout would fail with a
        # timeout error, not with this ValueError naming rank 1's bad value


def test_every_rank_uses_rank_zeros_plan(agreement: list[dict]) -> None:
    assert agreement[0]["plan"] == agreement[1]["plan"]
    assert agreement[0]["plan"]["decisions"]["w"]["strategy"] != "uncompressed"  # SLOW (rank 0's) compresses


def test_measurement_fits_the_slowest_rank_on_every_rank(agreement: list[dict]) -> None:
    fits = agreement[0]["measured"]
    assert fits == agreement[1]["measured"]
    # every timing was 1 ms on rank 0 and 3 ms on rank 1: the fit is of 3 ms, flat
    for field in ("allreduce", "allgather", "broadcast", "p2p", "encode", "decode"):
        overhead, a, b = fits[field]
        assert overhead == pytest.approx(3e-3) and Fit(overhead, a, b)(1e6) == pytest.approx(3e-3), (field, fits[field])


def test_cost_file_gives_the_same_plan_and_refuses_another_compressor(agreement: list[dict]) -> None:
    for res in agreement:
        assert res["file_plans"][0] == res["file_plans"][1]
        assert res["file_plans"][0]["cost_model"] == CostModel.from_mapping(SLOW).fits()
        assert "measured with compressor 'topk:ratio=0.1'" in res["file_other_compressor"]


def test_cost_file_errors(tmp_path) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match="does not exist"):
        load_costs(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="not a gradpress cost file"):
        load_costs(tmp_path / "bad.json")
    (tmp_path / "ok.json").write_text(json.dumps(CostModel.from_mapping(SLOW).to_json(world_size=4)))
    with pytest.raises(ValueError, match="world_size 4, this run has 2"):
        load_costs(tmp_path / "ok.json", world_size=2)
    assert set(load_costs(tmp_path / "ok.json").fits()) == set(FIELDS)


# ----------------------------------------------------------- 7. overflow in the sum
class _UnboundedFp16(Float16):
    """fp16 without its summand bound: a summable codec whose sum can
    overflow, to exercise the engine's check of compressed averages."""

    def bound_summand(self, x: torch.Tensor, summands: int) -> torch.Tensor:
        return x


def _overflow(rank: int, world: int) -> dict:
    out = {}
    for mode in ("propagate", "skip", "raise", "bounded"):
        m = model()
        ddp = DDP(m)
        codec = "fp16" if mode == "bounded" else _UnboundedFp16()
        hook = gradpress.ddp.register(ddp, codec, strategy="collective", min_numel=16,
                                      nonfinite="propagate" if mode == "bounded" else mode)
        x = torch.full((8, 40), 1.0)
        loss = ddp(x).sum() * 3e5  # every rank's gradient is finite; g/N is near fp16's max; the sum is not
        rec: dict = {"error": None}
        try:
            loss.backward()
        except Exception as exc:  # noqa: BLE001
            rec["error"] = f"{type(exc).__name__}: {exc}"
        w = m[0].weight.grad
        rec["grad_finite"] = bool(torch.isfinite(w).all()) if w is not None else None
        rec["skipped"] = hook.last_step_skipped
        rec["nonfinite_steps"] = hook.stats["nonfinite_steps"]
        rec["local_finite"] = True
        hook.close()
        out[mode] = rec
    return out


@pytest.fixture(scope="module")
def overflow() -> list[dict]:
    return run_workers(_overflow, 2)


def test_fp16_sum_overflow_is_caught(overflow: list[dict]) -> None:
    for res in overflow:
        assert res["propagate"]["grad_finite"] is False and res["propagate"]["nonfinite_steps"] == 1
        assert res["skip"]["skipped"] is True and res["skip"]["grad_finite"] is True, res["skip"]
        err = res["raise"]["error"]
        assert err and err.startswith("FloatingPointError") and "overflowed" in err, err
        # the registered fp16 bounds its summands (tests/test_summand_bound.py): the same gradients average to a
        # finite, saturated value, and the step is not treated as bad
        bounded = res["bounded"]
        assert bounded["grad_finite"] is True and bounded["nonfinite_steps"] == 0 and bounded["error"] is None


# ------------------------------------------------------ old hook states still load
def _old_state(rank: int, world: int) -> dict:
    m = model()
    ddp = DDP(m)
    hook = gradpress.ddp.register(ddp, "topk:ratio=0.1", strategy="ring", min_numel=16)
    torch.manual_seed(rank)
    for _ in range(3):
        ddp(torch.randn(8, 40)).square().mean().backward()
    new = hook.state_dict()
    hook.close()
    residuals = new["feedback"]["residuals"]
    # the layout gradpress 0.1 wrote: residuals in three stores, parameters as tuples, no plan_costs
    config = {k: v for k, v in new["config"].items() if k != "plan_costs"}
    config["parameters"] = [(n, list(s), d) for n, s, d in config["parameters"]]
    old = {
        "format": "gradpress-hook/1", "config": config, "step": new["step"],
        "memory": {"beta": 1.0, "gamma": 1.0, "residuals": {k: v for k, v in residuals.items() if "/" not in k}},
        "compressor": new["compressor"],
        "strategies": {"ring": {"residuals": {k[len("ring/"):]: v for k, v in residuals.items() if k.startswith("ring/")}}},
        "plan": new["plan"], "stats": new["stats"],
    }
    hook2 = gradpress.ddp.register(DDP(model()), "topk:ratio=0.1", strategy="ring", min_numel=16)
    hook2.load_state_dict(old)
    again = hook2.state_dict()
    hook2.close()
    same = again["feedback"]["residuals"].keys() == residuals.keys() and all(
        torch.equal(again["feedback"]["residuals"][k], v) for k, v in residuals.items())
    garbage = _registration_error(lambda: hook2.load_state_dict({"format": "something/9"}))
    return {"same": same, "ring_keys": sum(k.startswith("ring/") for k in residuals), "step": again["step"],
            "garbage": garbage}


def test_version_one_hook_state_loads() -> None:
    for res in run_workers(_old_state, 2):
        assert res["ring_keys"] > 0 and res["same"] and res["step"] == 3
        assert "not a gradpress hook state dict" in res["garbage"]


def test_bench_plan_writes_a_cost_file_register_reuses(tmp_path) -> None:  # noqa: ANN001
    from gradpress.cli import main as cli

    out = tmp_path / "costs.json"
    assert cli(["bench", "plan", "--compressor", "topk:ratio=0.1", "--nproc", "2", "--reps", "1",
                "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["compressor"] == "topk:ratio=0.1" and data["world_size"] == 2 and set(data["fits"]) == set(FIELDS)
    assert load_costs(out, compressor="topk:ratio=0.1", world_size=2).fits() == data["fits"]
    assert cli(["bench", "plan", "--compressor", "topk:ratio=7", "--out", str(out)]) == 2  # bad spec: one line, exit 2


@pytest.fixture
def no_workers(monkeypatch):
    """Starting workers fails the test: the arguments must be refused before."""
    import torch.distributed.launcher.api as launcher

    forbid(monkeypatch, "workers were started", (launcher, "elastic_launch"))


def test_bench_plan_refuses_an_out_it_cannot_write_before_workers(tmp_path, capsys, no_workers) -> None:  # noqa: ANN001
    """A directory as --out measured, then failed with IsADirectoryError renaming DIR.tmp onto it (leaving
    DIR.tmp behind); a file as its parent was called a missing directory."""
    from gradpress.cli import main as cli

    (tmp_path / "file").write_text("x")
    cases = [(tmp_path, "which is a directory; allowed: a file path"),
             (tmp_path / "file" / "costs.json", "is a file, not a directory"),
             (tmp_path / "missing" / "costs.json", "does not exist")]
    if __import__("os").path.isdir("/proc/self"):
        cases.append(("/proc/self/costs.json", "cannot write"))
    for out, words in cases:
        assert cli(["bench", "plan", "--nproc", "1", "--reps", "1", "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("gradpress bench plan: error: --out") and words in err, err
        assert len(err.strip().splitlines()) == 1, err
    assert not (tmp_path.parent / (tmp_path.name + ".tmp")).exists()


def test_bench_plan_refuses_nproc_above_the_cap_before_workers(tmp_path, capsys, no_workers) -> None:  # noqa: ANN001
    """--nproc 4000 went to the elastic launcher (4000 forked workers); the cap is train's,
    max(64, 8 x cores) local workers."""
    import os

    from gradpress.cli import main as cli

    cap = max(64, 8 * len(os.sched_getaffinity(0)))
    for nproc in (str(cap + 1), "4000"):
        assert cli(["bench", "plan", "--nproc", nproc, "--reps", "1", "--out", str(tmp_path / "c.json")]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"gradpress bench plan: error: --nproc must be an integer from 1 to {cap}"), err
        assert err.strip().endswith(f"got {nproc}") and len(err.strip().splitlines()) == 1, err
    assert cli(["bench", "plan", "--nproc", "2", "--reps", "0", "--out", str(tmp_path / "c.json")]) == 2
    assert "--reps must be an integer >= 1, got 0" in capsys.readouterr().err


def test_bench_plan_refuses_cuda_without_cuda_before_workers(tmp_path, capsys, no_workers, monkeypatch) -> None:  # noqa: ANN001
    """--device cuda on a machine without CUDA failed in the workers, with the launcher's traceback."""
    from gradpress.cli import main as cli

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli(["bench", "plan", "--nproc", "1", "--device", "cuda", "--out", str(tmp_path / "c.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gradpress bench plan: error: --device got 'cuda'") and "allowed here: cpu" in err, err


def test_bench_plan_reports_a_failed_worker_in_one_line(tmp_path, capsys, monkeypatch) -> None:  # noqa: ANN001
    """A worker that fails is named in one line (exit 1), not the elastic launcher's traceback."""
    import torch.distributed.launcher.api as launcher
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from gradpress.cli import main as cli

    def failing(config, entry):
        def call(*args):
            failure = ProcessFailure(local_rank=0, pid=4242, exitcode=1, error_file=str(tmp_path / "none"))
            failure.message = "RuntimeError: boom"
            raise ChildFailedError("_worker", {0: failure})
        return call

    monkeypatch.setattr(launcher, "elastic_launch", failing)
    assert cli(["bench", "plan", "--nproc", "1", "--out", str(tmp_path / "c.json")]) == 1
    err = capsys.readouterr().err
    assert err.strip() == "gradpress bench plan: error: worker rank 0 failed with exit code 1: RuntimeError: boom", err


def _three_way_agreement(rank: int, world: int) -> dict:
    """agree() on 3 ranks: rank 2 alone differs (a field), then rank 2 alone failed (an error), then ranks 0
    and 2 failed alike and rank 1 otherwise."""
    from gradpress.exchange.agree import agree

    out = {}
    for case, mine, error in (("config", {"a": 1, "b": 2 if rank == 2 else 1}, None),
                              ("error", {"a": 1}, "boom on 2" if rank == 2 else None),
                              ("alike", {"a": 1}, "other" if rank == 1 else "same")):
        try:
            agree(mine, error, None)
            out[case] = None
        except ValueError as exc:
            out[case] = str(exc)
    return out


def test_agreement_compares_every_rank_not_the_first_two() -> None:
    """exchange/agree.py: "all raise the same ValueError if any rank failed or any configuration differs, naming the rank,
    the field and both values": the last of 3 ranks differing alone is refused on every rank (a comparison of
    ranks 0 and 1 only let it through on 2 workers' tests)."""
    results = run_workers(_three_way_agreement, 3)
    for r in results:
        assert r["config"] == "gradpress configuration differs between ranks: rank 2 has b=2 but rank 0 has 1"
        assert r["error"] == "gradpress registration failed: rank 2: boom on 2"
        # the same refusal on several ranks is said once, naming them (it was repeated once per rank: with
        # --nproc 64 the one sentence 64 times); ordered by the first rank that gave each
        assert r["alike"] == "gradpress registration failed: ranks 0, 2: same; rank 1: other"
