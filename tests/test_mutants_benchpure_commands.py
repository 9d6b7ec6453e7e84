"""The pure parts of three bench commands, pinned where the other bench
tests do not reach: written for survivors of ``make mutants``
(``benchpure`` group): ``gradpress bench plan``'s arguments, file and
printout (plan.py), the strategies benchmark's model, table and arguments
(strategies.py), and how ``bench e2e`` writes a job, reads the link
counters and results and describes a failure (e2e_jobs.py). Nothing here
starts a worker, a group or a namespace: the launcher, the worker and the
cluster are stand-ins. Every expected value is computed here (the parameter
count of the documented MLP, each link's counter after minus before, the
package's directory from ``gradpress.__file__``) or is the documented
default or message, never the code's output. One process: about 1 s.
"""

from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path

import pytest
import torch
from refusals import forbid

import gradpress
from gradpress.bench import plan, strategies
from gradpress.bench.e2e_jobs import _package_root, _Runner

pytestmark = pytest.mark.mutants


# ---------------------------------------------------------------- e2e_jobs.py

def _settings(tmp_path: Path, threads: int = 3) -> dict:
    return {"out": tmp_path, "threads": threads, "workload": "wide-mlp", "params": 1000, "hidden": None,
            "batch_size": 8, "lr": 0.1, "optimizer": "sgd", "schedule": "constant", "epochs": 1}


def test_the_package_root_is_the_directory_holding_gradpress_and_leads_the_workers_pythonpath(tmp_path, monkeypatch):
    root = str(Path(gradpress.__file__).resolve().parent.parent)
    assert _package_root() == root
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    env = _Runner(None, _settings(tmp_path), types.SimpleNamespace()).env
    assert env == {"OMP_NUM_THREADS": "3", "MKL_NUM_THREADS": "3", "PYTHONUNBUFFERED": "1",
                   "PYTHONPATH": root + os.pathsep + "/elsewhere"}
    monkeypatch.delenv("PYTHONPATH")
    assert _Runner(None, _settings(tmp_path), types.SimpleNamespace()).env["PYTHONPATH"] == root
    assert (tmp_path / "raw").is_dir()


def test_a_job_file_holds_the_settings_and_clears_the_tags_old_results(tmp_path):
    runner = _Runner(None, _settings(tmp_path), types.SimpleNamespace(seed=7, warmup=2, steps=3))
    raw = tmp_path / "raw"
    (raw / "t1-rank0.json").write_text("{}")
    (raw / "t1-rank12.json").write_text("{}")
    (raw / "t2-rank0.json").write_text("{}")
    path = runner.job("t1", "step", None, extra_field=5)
    assert path == raw / "t1.job.json"
    job = json.loads(path.read_text())
    assert job == {"mode": "step", "tag": "t1", "result_dir": str(raw.resolve()), "workload": "wide-mlp",
                   "params": 1000, "hidden": None, "batch_size": 8, "lr": 0.1, "optimizer": "sgd",
                   "schedule": "constant", "epochs": 1, "seed": 7, "threads": 3, "warmup": 2, "steps": 3,
                   "n_batches": 8, "config": None, "extra_field": 5}
    assert sorted(p.name for p in raw.glob("*-rank*.json")) == ["t2-rank0.json"]  # only t1's are cleared
    assert runner.argv(path) == [sys.executable, "-m", "gradpress.bench.e2e_worker", "--job", str(path.resolve())]


def test_run_all_reads_each_links_counters_before_and_after_and_every_ranks_result(tmp_path):
    """The link figures of a run are each node's counters after the run minus before it; a rank that
    wrote no result file is None."""
    counters = iter([
        {"tx_bytes": 100, "rx_bytes": 50, "tx_drops": 1, "rx_drops": 0},      # node 0 before
        {"tx_bytes": 7, "rx_bytes": 9, "tx_drops": 0, "rx_drops": 2},         # node 1 before
        {"tx_bytes": 1100, "rx_bytes": 80, "tx_drops": 4, "rx_drops": 0},     # node 0 after
        {"tx_bytes": 7, "rx_bytes": 2009, "tx_drops": 0, "rx_drops": 5},      # node 1 after
    ])
    calls = []

    class Cluster:
        nodes, world = 2, 3

        def link_stats(self, node):
            calls.append(("stats", node))
            return next(counters)

        def run(self, argv, env, timeout, stream_rank0):
            calls.append(("run", argv, env, timeout, stream_rank0))
            return "the result"

    runner = _Runner(Cluster(), _settings(tmp_path), types.SimpleNamespace(seed=0, warmup=1, steps=1, timeout=42.0))
    job = runner.job("tg", "step", None)
    (tmp_path / "raw" / "tg-rank0.json").write_text(json.dumps({"rank": 0}))
    (tmp_path / "raw" / "tg-rank2.json").write_text(json.dumps({"rank": 2}))
    res, results, tbf = runner.run_all("tg", job)
    assert res == "the result" and results == [{"rank": 0}, None, {"rank": 2}]
    assert tbf == [{"tx_bytes": 1000, "rx_bytes": 30, "tx_drops": 3, "rx_drops": 0},
                   {"tx_bytes": 0, "rx_bytes": 2000, "tx_drops": 0, "rx_drops": 3}]
    assert calls[:2] == [("stats", 0), ("stats", 1)] and calls[3:] == [("stats", 0), ("stats", 1)]
    assert calls[2] == ("run", runner.argv(job), runner.env, 42.0, False)


def test_a_failure_says_timed_out_or_the_exit_code_and_the_first_failed_ranks_last_line(tmp_path):
    logs = {r: tmp_path / f"r{r}.log" for r in range(4)}
    logs[0].write_text("rank 0 finished\n")
    logs[1].write_text("starting\n\nValueError: bad\n  \n")
    logs[2].write_text("RuntimeError: later\n")
    logs[3].write_text("\n \n")

    def res(codes, logged, timed_out=False, exit_code=1):
        return types.SimpleNamespace(timed_out=timed_out, codes=codes, exit_code=exit_code, log_dir="LOGS",
                                     log=lambda r: logs[r] if r in logged else None)

    runner = _Runner(None, _settings(tmp_path), types.SimpleNamespace(timeout=90.4))
    assert runner.failure(res([0, 0], (), timed_out=True), "t") == "timed out after 90 s"
    assert runner.failure(res([0, 2, 1], (0, 1, 2), exit_code=2), "t") == "exit code 2: ValueError: bad (logs: LOGS)"
    # a failed rank without a log is passed over (and one that succeeded, log or not); one whose log has
    # no line gives no tail
    assert runner.failure(res([0, 2, 1], (0, 2)), "t") == "exit code 1: RuntimeError: later (logs: LOGS)"
    assert runner.failure(res([0, 0, 0, 1], (0, 3)), "t") == "exit code 1 (logs: LOGS)"
    assert runner.failure(res([0, -9], (0, 1), exit_code=-9), "t") == "exit code -9: ValueError: bad (logs: LOGS)"


# ---------------------------------------------------------------- plan.py

def _plan_parser():
    import argparse

    parser = argparse.ArgumentParser(prog="gradpress bench")
    plan.register_bench(parser.add_subparsers())
    return parser


def test_bench_plan_help_shows_how_to_run_and_reuse_it_and_its_defaults():
    parser = _plan_parser()
    sub = parser._subparsers._group_actions[0].choices["plan"]
    assert sub.description.startswith("``gradpress bench plan --compressor topk:ratio=0.01 --nproc 4 --out costs.json``")
    assert "--plan-costs costs.json" in sub.description and "\n" not in sub.description
    args = parser.parse_args(["plan"])
    assert (args.compressor, args.nproc, args.device, args.reps, args.out) == ("none", 2, "cpu", 5, "costs.json")
    assert args.func is plan.main


FITS = {"allreduce": [0.00125, 2.5e-05, 3.75e-09], "encode": [0.0, 1e-06, 2.5e-10]}


def _result(rank):
    return {"compressor": "topk:ratio=0.1", "world_size": 3, "device": "cpu", "fits": FITS, "rank": rank}


def test_bench_plan_launches_nproc_workers_and_writes_rank_0s_model(tmp_path, capsys, monkeypatch):
    import torch.distributed.launcher.api as launcher

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    seen = {}

    def launch(config, entry):
        seen["config"], seen["entry"] = config, entry

        def call(*args):
            seen["args"] = args
            return {2: _result(2), 0: _result(0), 1: _result(1)}
        return call

    monkeypatch.setattr(launcher, "elastic_launch", launch)
    out = tmp_path / "c.json"
    args = _plan_parser().parse_args(["plan", "--compressor", "topk:ratio=0.1", "--nproc", "3", "--reps", "2",
                                      "--out", str(out)])
    assert plan.main(args) == 0
    cfg = seen["config"]
    assert (cfg.nproc_per_node, cfg.min_nodes, cfg.max_nodes, cfg.max_restarts) == (3, 1, 1, 0)
    assert cfg.start_method == "spawn" and cfg.rdzv_endpoint.startswith("127.0.0.1:")
    assert seen["entry"] is plan._worker and seen["args"] == ("topk:ratio=0.1", "cpu", 2)
    assert json.loads(out.read_text()) == _result(0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.json"]  # the temporary file renamed
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "cost model for topk:ratio=0.1 on 3 worker(s) (cpu):"
    assert lines[1] == "  allreduce  max(0.00125, 2.5e-05 + 3.75e-09 x)"
    assert lines[2] == "  encode     max(0, 1e-06 + 2.5e-10 x)"
    assert lines[3] == f"written: {out}  (use: --strategy auto --plan-costs {out})" and len(lines) == 4


@pytest.mark.parametrize("rank", ["0", "1"])
def test_bench_plan_under_torchrun_joins_the_group_and_only_rank_0_writes(tmp_path, capsys, monkeypatch, rank):
    import torch.distributed.launcher.api as launcher

    forbid(monkeypatch, "workers were started under torchrun", (launcher, "elastic_launch"))
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setattr(plan, "_worker", lambda compressor, device, reps: _result(int(rank)))
    out = tmp_path / "c.json"
    assert plan.main(_plan_parser().parse_args(["plan", "--nproc", "1", "--out", str(out)])) == 0
    assert out.exists() == (rank == "0")
    if rank == "0":
        assert json.loads(out.read_text()) == _result(0)
        assert "written:" in capsys.readouterr().out
    else:
        assert capsys.readouterr().out == ""


# ---------------------------------------------------------------- strategies.py

def test_strategies_model_is_the_documented_mlp():
    """1024 -> width -> 1024 -> 10 (module docstring): about 4.2 M parameters at the default width 2048."""
    for width in (8, 2048):
        model = strategies.build_model(width)
        count = 1024 * width + width + width * 1024 + 1024 + 1024 * 10 + 10
        assert sum(p.numel() for p in model.parameters()) == count
        assert model(torch.zeros(3, 1024)).shape == (3, 10)
    assert round(count / 1e6, 1) == 4.2


def test_strategies_table_has_a_header_a_rule_and_one_line_per_pair():
    results = {"none/allreduce": {"median_ms": 127.14, "mean_ms": 130.06, "bytes_per_step": 16_830_504,
                                  "ratio": 1.0, "plan": {"uncompressed": 3, "allreduce": 3}},
               "topk:ratio=0.01/auto": {"median_ms": 5.0, "mean_ms": 6.25, "bytes_per_step": 1234,
                                        "ratio": 99.94, "plan": {}}}
    lines = strategies.format_table(results).splitlines()
    assert len(lines) == 4 and lines[1] == "-" * len(lines[0])
    assert lines[0].split() == ["compressor/strategy", "median", "ms", "mean", "ms", "bytes/step", "ratio", "plan"]
    assert lines[2].split() == ["none/allreduce", "127.1", "130.1", "16,830,504", "1.0", "allreduce=3,", "uncompressed=3"]
    assert lines[3].split() == ["topk:ratio=0.01/auto", "5.0", "6.2", "1,234", "99.9"]
    assert lines[2].index("127.1") == lines[3].index("5.0") - 2  # right-aligned columns


def test_strategies_defaults_are_the_documented_run(monkeypatch, capsys):
    """docs/strategies.md: ``--world 4 --steps 10 --warmup 3`` measures the 4.2M MLP at batch 32 with one
    thread per worker, every default pair."""
    seen = []
    monkeypatch.setattr(strategies, "run", lambda args: seen.append(args) or {})
    assert strategies.main(["--world", "4", "--steps", "10", "--warmup", "3"]) == 0
    a = seen[0]
    assert (a.world, a.width, a.batch, a.steps, a.warmup, a.threads) == (4, 2048, 32, 10, 3, 1)
    assert a.pairs == list(strategies.DEFAULT_PAIRS)
    first = capsys.readouterr().out.splitlines()[0]
    assert first == "4 workers (gloo, loopback), MLP 4,207,626 parameters, batch 32, 10 timed steps after 3 warm-up"


@pytest.mark.parametrize(("argv", "message"), [
    (["--threads", "0"], "--threads got 0; allowed: an integer >= 1"),
    (["--world", "0"], "--world got 0; allowed: an integer >= 1"),
    (["--width", "-3"], "--width got -3; allowed: an integer >= 1"),
    (["--batch", "0"], "--batch got 0; allowed: an integer >= 1"),
    (["--steps", "0"], "--steps got 0; allowed: an integer >= 1"),
    (["--warmup", "-1"], "--warmup got -1; allowed: an integer >= 0"),
    (["--steps", "two"], "--steps got 'two'; allowed: an integer >= 1"),
    (["--pairs", "none/ring", "topk"], "--pairs got 'topk'; allowed: compressor/strategy, e.g. topk:ratio=0.01/ring"),
    (["--pairs", "none/rnig"], "--pairs got 'none/rnig': unknown strategy 'rnig'; allowed: allgather, allreduce, "
                               "auto, collective, cyclic, hierarchical, ps, ring, union"),
    (["--pairs", "topk:ratio=0.01/allreduce"], "--pairs got 'topk:ratio=0.01/allreduce': strategy 'allreduce': "
                                               "compressor 'topk' is not summable; use strategy 'allgather' (or 'auto')"),
    (["--pairs", "topk:ratio=2/ring"], "--pairs got 'topk:ratio=2/ring': compressor 'topk': parameter 'ratio' got "
                                       "2.0; allowed: 0 < ratio <= 1"),
])
def test_strategies_refuses_bad_arguments_in_one_line_before_spawning(monkeypatch, capsys, argv, message):
    """``--threads 0`` failed in every spawned worker (``torch.set_num_threads``), ``--steps 0`` there too
    (the median of no step), ``--world 0`` looked for a results file nobody wrote, and a pair without ``/``
    was a traceback: each is refused by the parser (exit 2), naming the flag, the value and what is allowed."""
    forbid(monkeypatch, "workers were spawned", (strategies, "run"))
    with pytest.raises(SystemExit) as exit_:
        strategies.main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] in (f"python -m gradpress.bench.strategies: error: argument {argv[0]}: {message}",
                       f"python -m gradpress.bench.strategies: error: {message}"), err


def test_strategies_accepts_no_warmup(monkeypatch):
    seen = []
    monkeypatch.setattr(strategies, "run", lambda args: seen.append(args) or {})
    assert strategies.main(["--warmup", "0", "--steps", "1", "--world", "1", "--pairs", "none/ring"]) == 0
    assert (seen[0].warmup, seen[0].steps, seen[0].world, seen[0].pairs) == (0, 1, 1, ["none/ring"])
