"""Training-level defaults and the reproducible planner (issue 14): the
default strategy compresses, ``--strategy auto --plan-costs FILE`` gives the
same plan twice and writes it to summary.json, and a run that compressed
nothing says so in its summary and in compare's table."""

from __future__ import annotations

import json
import re

import pytest
from refusals import forbid

from gradpress import compare, train
from gradpress.cli import main as cli
from gradpress.exchange.costs import CostModel

COMMON = {"workload": "digits-mlp", "hidden": 32, "samples": 256, "batch_size": 16, "epochs": 1, "steps": 4,
          "nproc": 2, "progress": False, "min_numel": 64}
SLOW = {"allreduce": (2e-4, 2e-4, 1e-7), "allgather": (2e-4, 2e-4, 2e-7), "broadcast": (2e-4, 2e-4, 1e-7),
        "p2p": (2e-4, 2e-4, 1e-7), "encode": (1e-5, 1e-5, 1e-9), "decode": (1e-5, 1e-5, 1e-9),
        "wire": (0.0, 8.0, 0.08), "root_wire": (0.0, 8.0, 0.16)}


def test_default_strategy_compresses(tmp_path) -> None:  # noqa: ANN001
    s = train.run({**COMMON, "compressor": "topk:ratio=0.1", "out": str(tmp_path / "a")})
    assert s["strategy"] == "allgather" and s["compressed_tensors"] > 0 and not s["nothing_compressed"]
    assert s["compression_ratio"] > 3


def test_plan_costs_give_the_same_plan_twice(tmp_path) -> None:  # noqa: ANN001
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps(CostModel.from_mapping(SLOW).to_json(compressor="topk:ratio=0.1", world_size=2)))
    plans = []
    for run in ("a", "b"):
        s = train.run({**COMMON, "compressor": "topk:ratio=0.1", "strategy": "auto", "plan_costs": str(costs),
                       "out": str(tmp_path / run)})
        saved = json.loads((tmp_path / run / "summary.json").read_text())
        assert saved["plan"] == s["plan"]
        plans.append(saved["plan"])
    assert plans[0] == plans[1] and plans[0]["source"] == "injected costs"
    assert plans[0]["cost_model"] == CostModel.from_mapping(SLOW).fits()
    assert any(d["strategy"] != "uncompressed" for d in plans[0]["decisions"].values())


def test_plan_costs_are_checked_before_workers_start(tmp_path, capsys) -> None:  # noqa: ANN001
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps(CostModel.from_mapping(SLOW).to_json(compressor="qsgd:levels=16,bucket=512")))
    base = ["train", "--workload", "digits-mlp", "--compressor", "topk:ratio=0.1", "--nproc", "2", "--out", str(tmp_path)]
    assert cli([*base, "--strategy", "auto", "--plan-costs", str(costs)]) == 2
    assert "measured with compressor 'qsgd:levels=16,bucket=512'" in capsys.readouterr().err
    assert cli([*base, "--plan-costs", str(costs)]) == 2  # the default strategy does not plan
    assert "--plan-costs is used by --strategy auto" in capsys.readouterr().err  # the flag, as typed
    with pytest.raises(ValueError, match="does not exist"):
        train.make_config({**COMMON, "compressor": "topk:ratio=0.1", "strategy": "auto",
                           "plan_costs": str(tmp_path / "missing.json")})


def test_a_cost_file_of_another_world_size_is_refused_before_workers_start(tmp_path, capsys, monkeypatch) -> None:  # noqa: ANN001
    """A cost file measured on 2 workers given to ``--nproc 3`` (or torchrun's WORLD_SIZE=3): the workers
    refused it, each rank the same sentence in one message, after they had started; now the launcher
    does, once. Unknown world (no --nproc, no WORLD_SIZE): left to the workers, as before."""
    import torch.distributed.launcher.api as launcher

    forbid(monkeypatch, "workers were started", (launcher, "elastic_launch"))
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps(CostModel.from_mapping(SLOW).to_json(compressor="topk:ratio=0.1", world_size=2)))
    base = ["train", "--workload", "digits-mlp", "--compressor", "topk:ratio=0.1", "--strategy", "auto",
            "--plan-costs", str(costs), "--out", str(tmp_path / "o")]
    expected = f"plan_costs: {str(costs)!r} was measured with world_size 2, this run has 3; measure again with"
    assert cli([*base, "--nproc", "3"]) == 2
    err = capsys.readouterr().err
    assert "--" + expected.replace("_", "-", 1) in err and err.count("was measured with") == 1, err  # the flag
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ValueError, match=re.escape(expected)):
        train.make_config({**COMMON, "nproc": None, "compressor": "topk:ratio=0.1", "strategy": "auto",
                           "plan_costs": str(costs)})
    monkeypatch.delenv("WORLD_SIZE")
    cfg = train.make_config({**COMMON, "nproc": 2, "compressor": "topk:ratio=0.1", "strategy": "auto",
                             "plan_costs": str(costs)})  # its own world size: accepted
    assert cfg.plan_costs == str(costs)


def test_a_run_that_compressed_nothing_says_so(tmp_path, capsys) -> None:  # noqa: ANN001
    s = train.run({**COMMON, "compressor": "topk:ratio=0.1", "min_numel": 10**9, "out": str(tmp_path / "n")})
    assert s["nothing_compressed"] and s["compressed_tensors"] == 0
    none = train.run({**COMMON, "compressor": "none", "out": str(tmp_path / "d")})
    assert not none["nothing_compressed"]  # the identity has nothing to compress: not a surprise
    annotated = compare.annotate([none, s], None)
    assert "`topk:ratio=0.1` (nothing compressed)" in compare.table(annotated)


def test_compare_and_train_refuse_before_any_run(tmp_path, capsys) -> None:  # noqa: ANN001
    """Issue 15, point 19 (compare's part): a target no run can reach, and a
    strategy that cannot carry a compressor, fail before the first run."""
    base = ["compare", "--workload", "digits-mlp", "--nproc", "2", "--out", str(tmp_path / "c")]
    for target in ("-1", "5"):
        assert cli([*base, "--compressors", "none", "--target", target]) == 2
        assert "target must be" in capsys.readouterr().err
    assert cli([*base, "--compressors", "none,signsgd", "--strategy", "ring"]) == 2
    err = capsys.readouterr().err
    assert "strategy 'ring'" in err and "signsgd" in err
    assert not (tmp_path / "c").exists()  # nothing ran
    with pytest.raises(ValueError, match="strategy 'ps'.*powersgd"):
        train.make_config({**COMMON, "compressor": "powersgd", "strategy": "ps"})
