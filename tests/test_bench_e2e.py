"""``gradpress bench e2e``: configuration syntax (algorithms included),
argument errors, the byte formulas, the worker's modes on 2 local gloo
workers, and (as root) tiny real runs on the emulated cluster that must write
e2e.json / e2e.md / e2e.png with every field and consistent figures."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import torch
from distributed import run_workers
from refusals import forbid

from gradpress.bench import bench_modules
from gradpress.bench.e2e import command_line, wire_factor
from gradpress.bench.e2e_configs import RunConfig, parse_baselines, parse_configs
from gradpress.bench.e2e_report import STEP_FIELDS, TRAIN_FIELDS
from gradpress.bench.e2e_worker import interface_bytes, payload_bytes_per_step
from gradpress.cli import build_parser
from gradpress.cli import main as cli_main

IS_ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not IS_ROOT, reason="gradpress bench e2e builds an emulated cluster (network "
                                                    "namespaces, veth, tc), which needs root")


# ------------------------------------------------------------------ syntax
def test_e2e_is_a_bench_subcommand():
    assert "e2e" in [name for name, module, _ in bench_modules() if module is not None]
    args = build_parser().parse_args(["bench", "e2e", "--configs", "topk@ring"])
    assert args.configs == "topk@ring" and args.nodes == 4 and args.bandwidth == "100mbit"


def test_parse_configs_strategies_and_commas():
    cfgs = parse_configs("topk:ratio=0.01@allgather, qsgd:levels=4,bucket=512@ring;fp16,powersgd:rank=2,start_iter=3")
    assert [(c.spec, c.strategy) for c in cfgs] == [
        ("topk:ratio=0.01", "allgather"), ("qsgd:levels=4,bucket=512", "ring"), ("fp16", "collective"),
        ("powersgd:rank=2,start_iter=3", "collective")]
    assert all(c.kind == "gradpress" for c in cfgs)
    assert cfgs[3].start == 3 and cfgs[0].start == 0
    assert cfgs[0].label == "gradpress topk:ratio=0.01@allgather" and cfgs[2].label == "gradpress fp16"
    assert RunConfig.from_dict(cfgs[1].to_dict()) == cfgs[1]
    assert all(c.error_feedback is None for c in cfgs)
    ef = parse_configs("topk:ratio=0.001@allgather+noef,qsgd:levels=4,bucket=512+ef")
    assert [(c.spec, c.strategy, c.error_feedback) for c in ef] == [
        ("topk:ratio=0.001", "allgather", False), ("qsgd:levels=4,bucket=512", "collective", True)]
    assert ef[0].label.endswith("@allgather+noef")


def test_parse_configs_strategy_parameters():
    """``@STRATEGY:key=value,...``: the parameters stay with the strategy (the
    comma-separated list is not cut inside them)."""
    cfgs = parse_configs("qsgd:levels=16@hierarchical:chunk=1048576,outer=allgather,fp16@hierarchical")
    assert [(c.spec, c.strategy) for c in cfgs] == [("qsgd:levels=16", "hierarchical:chunk=1048576,outer=allgather"),
                                                    ("fp16", "hierarchical")]
    assert cfgs[0].label == "gradpress qsgd:levels=16@hierarchical:chunk=1048576,outer=allgather"


def test_parse_configs_with_an_algorithm():
    cfgs = parse_configs("ddp/qsgd:levels=4,bucket=512@ring+noef, ddp/,topk:ratio=0.01")
    assert [(c.algorithm, c.spec, c.strategy, c.error_feedback) for c in cfgs] == [
        ("ddp", "qsgd:levels=4,bucket=512", "ring", False), ("ddp", "none", "collective", None),
        ("ddp", "topk:ratio=0.01", "collective", None)]
    assert cfgs[1].label == "gradpress none"  # ddp/ alone: ddp's default compressor; ddp is not named
    assert RunConfig.from_dict(cfgs[0].to_dict()) == cfgs[0]
    old = {k: v for k, v in cfgs[2].to_dict().items() if k != "algorithm"}  # a job file from before algorithms
    assert RunConfig.from_dict(old).algorithm == "ddp"
    with pytest.raises(ValueError, match="twice"):
        parse_configs("ddp/topk,topk")
    local = parse_configs("localsgd:period=8/qsgd:levels=4,bucket=512@allgather,localsgd/,localsgd:period=2/+ef")
    assert [(c.algorithm, c.spec, c.strategy, c.error_feedback, c.label) for c in local] == [
        ("localsgd:period=8,optimizer_state=auto", "qsgd:levels=4,bucket=512", "allgather", None,
         "gradpress localsgd:period=8,optimizer_state=auto/qsgd:levels=4,bucket=512@allgather"),
        ("localsgd:period=8,optimizer_state=auto", "none", "collective", None, "gradpress localsgd:period=8,optimizer_state=auto/none"),  # its default compressor
        ("localsgd:period=2,optimizer_state=auto", "none", "collective", True, "gradpress localsgd:period=2,optimizer_state=auto/none+ef")]
    assert all(c.kind == "gradpress" for c in local)


def test_parse_baselines():
    b = parse_baselines("fp16,powersgd:rank=4,start=3")
    assert [c.kind for c in b] == ["ddp", "torch-fp16", "torch-powersgd"]  # plain DDP always first
    assert b[2].rank == 4 and b[2].start == 3 and b[2].single_bucket
    assert [c.kind for c in parse_baselines("ddp")] == ["ddp"]


def test_per_configuration_learning_rate(tmp_path):
    """``+lr=X`` (issue 13: each method at the rate a sweep chose for it)
    reaches the job file the workers read; the others keep ``--lr``; the
    report says which rates were shared."""
    from argparse import Namespace

    from gradpress.bench.e2e_jobs import _Runner
    from gradpress.bench.e2e_report import lr_text

    cfgs = parse_configs("topk:ratio=0.01@allgather+noef+lr=0.05,sgp/+lr=0.3,fp16")
    assert [(c.lr, c.error_feedback) for c in cfgs] == [(0.05, False), (0.3, None), (None, None)]
    assert cfgs[0].label == "gradpress topk:ratio=0.01@allgather+noef+lr=0.05" and cfgs[1].label.endswith("/none+lr=0.3")
    assert RunConfig.from_dict(cfgs[0].to_dict()) == cfgs[0]
    base = parse_baselines("ddp+lr=0.2,powersgd:rank=2+lr=0.4")
    assert [(c.kind, c.lr, c.label) for c in base] == [
        ("ddp", 0.2, "torch ddp+lr=0.2"), ("torch-powersgd", 0.4, "torch powersgd r=2+lr=0.4")]
    assert parse_baselines("fp16")[0].lr is None
    settings = {"out": tmp_path, "threads": 1, "workload": "mnist1d-cnn", "params": None, "hidden": None,
                "batch_size": 16, "lr": 0.1, "optimizer": "momentum", "schedule": "cosine", "epochs": 20}
    runner = _Runner(None, settings, Namespace(seed=0, warmup=2, steps=3))
    jobs = [json.loads(runner.job(f"t{i}", "train", c).read_text()) for i, c in enumerate(cfgs)]
    assert [j["lr"] for j in jobs] == [0.05, 0.3, 0.1]
    assert json.loads(runner.job("compute", "compute", None).read_text())["lr"] == 0.1
    assert lr_text(0.1, ["torch ddp", "gradpress fp16"]) == "lr 0.1 for every configuration"
    assert "except" in lr_text(0.1, [c.label for c in cfgs]) and "2 of 3" in lr_text(0.1, [c.label for c in cfgs])


@pytest.mark.parametrize("text,words", [
    ("topk:ratoi=0.01", ["--configs", "ratoi", "allowed parameters: ratio"]),
    ("topkk:ratio=0.01", ["--configs", "topkk", "allowed"]),
    ("topk:ratio=2", ["--configs", "ratio", "0 < ratio <= 1"]),
    ("topk@warp", ["--configs", "warp", "allgather"]),
    ("powersgd:rank=2@allgather", ["--configs", "allgather", "allowed: collective, auto, allreduce"]),
    ("topk,topk", ["--configs", "twice"]),
    ("@ring", ["--configs", "no compressor spec"]),
    ("topk@ring+fast", ["--configs", "+fast", "+ef, +noef, +lr=X"]),
    ("topk@ring+lr=0", ["--configs", "+lr got '0'", "positive finite"]),
    ("topk@ring+lr=fast", ["--configs", "+lr got 'fast'"]),
    ("topk@ring+ef+noef", ["--configs", "'+noef'", "each once"]),
    ("ddp:period=2/topk", ["--configs", "'ddp:period=2/topk'", "takes no parameters"]),
    ("ddp/topk:ratoi=0.01", ["--configs", "ratoi"]),
    ("nosuch:peers=1/topk", ["--configs", "unknown algorithm 'nosuch'", "allowed: ddp, ", "localsgd"]),
    ("localsgd:period=0/topk", ["--configs", "'period' got 0"]),
    ("qsgd@hierarchical:chunk=-1", ["--configs", "chunk", "chunk >= 0"]),
    ("qsgd@hierarchical:chunks=2", ["--configs", "chunks", "chunk"]),
    ("qsgd@allgather:chunk=4", ["--configs", "'allgather' takes no parameters", "chunk"]),
])
def test_bad_config_spec_names_the_field(text, words):
    with pytest.raises(ValueError) as exc:
        parse_configs(text)
    for w in words:
        assert w in str(exc.value), str(exc.value)


def test_malformed_lists_are_described_in_the_current_syntax():
    """The splitter's own errors: an empty list was 'allowed: a comma-separated list of configurations' (the
    configuration form and ';' unsaid); a key=value after a piece with no parameter list was glued to it and
    refused as an unknown compressor 'fp16,ratio=0.1' or strategy 'ring,bucket=3' (compare and bench compressors
    name it since 38973f7)."""
    form = "[ALGORITHM/]SPEC[@STRATEGY][+ef|+noef][+lr=X]"
    for text in (",", " ; ", ";,"):
        with pytest.raises(ValueError) as exc:
            parse_configs(text)
        assert str(exc.value) == (f"--configs got {text!r}; allowed: configurations {form} separated by ',' or "
                                  "';'"), str(exc.value)
        with pytest.raises(ValueError) as exc:
            parse_baselines(text)
        assert str(exc.value) == (f"--baselines got {text!r}; allowed: baselines ddp, fp16, "
                                  "powersgd:rank=R[,start=I], each [+lr=X], separated by ',' or ';'"), str(exc.value)
    for text, token, piece in (("fp16,ratio=0.1", "ratio=0.1", "fp16"),
                               ("topk:ratio=0.01@ring,bucket=3", "bucket=3", "ring"),
                               ("localsgd:period=8/fp16,ratio=2", "ratio=2", "fp16"),
                               ("none;topk:ratio=0.1>natural,bucket=4", "bucket=4", "natural")):
        with pytest.raises(ValueError) as exc:
            parse_configs(text)
        assert str(exc.value) == (f"--configs: {token!r} in {text!r} is a parameter, but {piece!r} has no parameter "
                                  "list; allowed: NAME:key=value,key=value"), str(exc.value)
    with pytest.raises(ValueError, match="--baselines: 'rank=2' in 'fp16,rank=2' is a parameter, but 'fp16' has no"):
        parse_baselines("fp16,rank=2")
    # parameter lists still continue across commas: the compressor's, the algorithm's, the strategy's
    cfgs = parse_configs("localsgd:period=8,optimizer_state=local/qsgd:levels=4,bucket=512@hierarchical:chunk=8,"
                         "outer=allgather,fp16")
    assert [(c.algorithm, c.spec, c.strategy) for c in cfgs][1] == ("ddp", "fp16", "collective")
    assert cfgs[0].spec == "qsgd:levels=4,bucket=512" and cfgs[0].strategy == "hierarchical:chunk=8,outer=allgather"


def test_a_rate_after_a_spec_without_parameters_starts_a_new_configuration():
    """``+lr=X`` is a configuration's option, not a parameter: the splitter took ``fp16+lr=0.03`` (an ``=`` and no
    ``:`` before the first ``/``, ``@`` or ``>``) for a ``key=value`` continuing the piece before it, so
    ``ddp,fp16+lr=0.03`` was refused ('fp16+lr=0.03' ... is a parameter, but 'ddp' has no parameter list) and
    ``topk:ratio=0.01,signsgd+lr=0.001`` was glued into one spec ``topk:ratio=0.01,signsgd``."""
    base = parse_baselines("ddp,fp16+lr=0.03")
    assert [(c.kind, c.lr) for c in base] == [("ddp", None), ("torch-fp16", 0.03)]
    base = parse_baselines("powersgd:rank=2,start=3,fp16+lr=0.05")
    assert [(c.kind, c.lr) for c in base] == [("ddp", None), ("torch-powersgd", None), ("torch-fp16", 0.05)]
    assert (base[1].rank, base[1].start) == (2, 3)
    cfgs = parse_configs("topk:ratio=0.01,signsgd+lr=0.001;qsgd:levels=4,bucket=512+lr=0.2,fp16+noef+lr=0.1")
    assert [(c.spec, c.lr) for c in cfgs] == [("topk:ratio=0.01", None), ("signsgd", 0.001),
                                              ("qsgd:levels=4,bucket=512", 0.2), ("fp16", 0.1)]
    assert cfgs[3].error_feedback is False


@pytest.mark.parametrize("text,words", [
    ("bf16", ["--baselines", "bf16", "ddp, fp16, powersgd"]),
    ("powersgd:rnk=2", ["--baselines", "rnk", "rank, start"]),
    ("powersgd:rank=0", ["rank", ">= 1"]),
    ("powersgd:rank=x", ["rank", "'x'", "integer"]),
    ("powersgd:start=1", ["start", ">= 2"]),
    ("ddp+ef", ["--baselines", "'+ef'", "+lr=X"]),
    ("fp16+lr=-1", ["--baselines", "+lr got '-1'"]),
])
def test_bad_baseline(text, words):
    with pytest.raises(ValueError) as exc:
        parse_baselines(text)
    for w in words:
        assert w in str(exc.value), str(exc.value)


@pytest.mark.parametrize("argv,words", [
    (["--configs", "topk:ratoi=0.01"], ["--configs", "ratoi"]),
    (["--nodes", "1"], ["--nodes", ">= 2"]),
    (["--bandwidth", "fast"], ["bandwidth", "fast"]),
    (["--workload", "resnet"], ["--workload", "resnet", "wide-mlp"]),
    (["--workload", "mnist1d-cnn", "--params", "1M"], ["--params", "mnist1d-cnn"]),
    (["--params", "lots"], ["--params", "lots"]),
    (["--lr", "-1"], ["--lr", "positive"]),
    (["--optimizer", "lbfgs"], ["--optimizer", "lbfgs", "momentum"]),
])
def test_cli_rejects_bad_arguments_before_building_a_cluster(argv, words, tmp_path, capsys):
    out = tmp_path / "out"
    code = cli_main(["bench", "e2e", *argv, "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2
    for w in words:
        assert w in err, err
    assert not out.exists()  # nothing ran


@pytest.fixture
def no_cluster(monkeypatch):
    """Any emulated cluster (check_support's probe included) fails the test: the arguments must be refused
    before a namespace is created."""
    import gradpress.cluster as cluster
    import gradpress.cluster.netns as netns

    forbid(monkeypatch, "an emulated cluster was built", (netns, "EmulatedCluster"), (cluster, "EmulatedCluster"))


@pytest.mark.parametrize("argv,words", [
    (["--nodes", "251"], ["--nodes got 251", "<= 250"]),
    (["--nodes", "2", "--workers-per-node", "65"], ["--workers-per-node got 65", "<= 64"]),
    (["--nodes", "250", "--workers-per-node", "64"],  # 16000 local workers: more than the cap of --nproc
     ["--nodes x --workers-per-node must be an integer from 1 to", "got 16000", "8 x"]),
    (["--bandwidth", "1e400mbit"], ["--bandwidth", "1e400mbit", "out of range"]),
    (["--seed=-1"], ["--seed must be an integer from 0 to 4294967295, got -1"]),
    (["--seed", "4294967296"], ["--seed must be an integer from 0 to 4294967295, got 4294967296"]),
    (["--timeout", "nan"], ["--timeout got nan", "finite"]),
    (["--timeout", "inf"], ["--timeout got inf", "finite"]),
    (["--train-to", "0.5", "--time-limit", "nan"], ["--time-limit got nan", "finite"]),
    (["--train-to", "nan"], ["--train-to got nan", "finite"]),
    (["--train-to", "2"], ["--train-to got 2", "<= 1", "accuracy"]),
    (["--train-to", "0"], ["--train-to got 0", "> 0"]),
    (["--train-to", "0.5", "--seeds", "2", "--seed", "4294967295"], ["seeds", "4294967296", "4294967295"]),
    (["--train-to", "0.5", "--seeds", "5000"], ["seeds", "5000", "1000"]),
    (["--threads", str(100 * len(os.sched_getaffinity(0)))], ["--threads got", f"<= {len(os.sched_getaffinity(0))}"]),
    (["--workload", ""], ["--workload got ''", "wide-mlp"]),  # empty: was the default, silently
    (["--optimizer", ""], ["--optimizer got ''", "momentum"]),
    (["--params", ""], ["--params", "''"]),
])
def test_cli_refuses_out_of_range_values_before_any_namespace(argv, words, tmp_path, capsys, no_cluster):
    code = cli_main(["bench", "e2e", *argv, "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("gradpress bench e2e: error: ") and len(err.strip().splitlines()) == 1, err
    for w in words:
        assert w in err, err
    assert not (tmp_path / "out").exists()


def test_cli_refuses_an_out_it_cannot_create_before_any_namespace(tmp_path, capsys, no_cluster):
    (tmp_path / "file").write_text("x")
    code = cli_main(["bench", "e2e", "--out", str(tmp_path / "file" / "out")])
    err = capsys.readouterr().err
    assert code == 2 and "--out" in err and "is a file, not a directory" in err, err


def test_wire_factor_and_command_line():
    assert wire_factor("allreduce", 4) == 1.5 and wire_factor("allgather", 4) == 3 and wire_factor("ring", 4) == 1
    assert wire_factor("ps", 4) is None and wire_factor(None, 4) is None
    args = build_parser().parse_args(["bench", "e2e", "--params", "1M", "--configs", "topk:ratio=0.01@ring",
                                      "--steps", "4", "--out", "x y"])
    line = command_line(args)
    assert "--configs topk:ratio=0.01@ring" in line and "--params 1M" in line and "'x y'" in line
    args = build_parser().parse_args(["bench", "e2e", "--workload", "mnist1d-cnn", "--optimizer", "adam",
                                      "--configs", "topk:ratio=0.01", "--steps", "4", "--out", "x"])
    assert "--optimizer adam" in command_line(args)
    from gradpress.bench.e2e_args import _resolve

    assert _resolve(args)["optimizer"] == "adam"
    args.optimizer = None
    assert _resolve(args)["optimizer"] == "momentum"  # mnist1d-cnn's default
    assert build_parser().parse_args(__import__("shlex").split(line)[1:]).steps == 4  # it parses back
    args = build_parser().parse_args(["bench", "e2e", "--nodes", "2", "--workers-per-node", "2", "--intra-bandwidth",
                                      "1gbit", "--configs", "fp16@hierarchical"])
    line = command_line(args)
    assert "--workers-per-node 2 --intra-bandwidth 1gbit" in line
    assert build_parser().parse_args(__import__("shlex").split(line)[1:]).workers_per_node == 2


def _gradpress_row(world: int, plan: dict, payload: float, by_strategy: dict | None) -> dict:
    """A row of ``bench e2e`` from one gradpress configuration's rank
    results, as the worker reports them (no cluster: the figures are given)."""
    from types import SimpleNamespace

    from gradpress.bench.e2e_rows import _step_row

    r0 = {"warmup": 2, "steps": 3, "median_step_s": 0.5, "step_s": [0.5] * 3, "payload_bytes_per_step": payload,
          "plan": plan, "strategy": "auto"}
    if by_strategy is not None:
        r0["strategy_bytes_per_step"] = by_strategy
    cfg = RunConfig("gradpress", "g", "topk:ratio=0.1", strategy="auto")
    return _step_row(cfg, SimpleNamespace(ok=True, seconds=1.0), [r0] * world, [], 0.25, 1_000_000, world, None, "t")


def test_ideal_payload_counts_each_partitions_bytes_at_the_factor_of_how_it_was_sent():
    """A mixed plan (a ``ring`` tensor, ``allgather`` partitions, uncompressed
    tensors): the ideal time counts each collective's bytes at its own wire
    factor (bytes on the busiest link direction per byte handed over). The
    uncompressed tensors went through a plain ring allreduce: 2(N-1)/N, not
    the ring's 1 that the one compressed strategy of the plan gave them."""
    world, rate, compute = 4, 1_000_000, 0.25
    plan = {"w": ["ring", 1], "v": ["ring", 1], "b": ["uncompressed", 1], "u": ["uncompressed", 1]}
    row = _gradpress_row(world, plan, 1400.0, {"ring": 1000.0, "uncompressed": 400.0})
    link = 1000 * 1 + 400 * 2 * (world - 1) / world  # 1600 bytes on the busiest link direction
    assert row["ideal_payload_s"] == pytest.approx(compute + link * 8 / rate)
    assert row["wire_factor"] == pytest.approx(link / 1400)
    # several compressed strategies and a plain allreduce, each at its factor
    plan = {"w#0": ["allgather", 2], "v": ["ring", 1], "b": ["uncompressed", 1]}
    row = _gradpress_row(world, plan, 700.0, {"allgather": 300.0, "ring": 100.0, "uncompressed": 300.0})
    link = 300 * (world - 1) + 100 * 1 + 300 * 2 * (world - 1) / world
    assert row["ideal_payload_s"] == pytest.approx(compute + link * 8 / rate)
    # the uncompressed tensors rode inside the allgather (a small prelude): all of it at N-1
    plan = {"w": ["allgather", 1], "b": ["uncompressed", 1]}
    row = _gradpress_row(world, plan, 500.0, {"allgather": 500.0})
    assert row["ideal_payload_s"] == pytest.approx(compute + 500 * (world - 1) * 8 / rate)
    # no breakdown (a worker of before, or an algorithm's own bytes) or a strategy of no single factor: no figure
    for by in (None, {"allgather": 400.0}, {"ps": 300.0, "uncompressed": 200.0}):
        row = _gradpress_row(world, plan, 500.0, by)
        assert row["ideal_payload_s"] is None and row["wire_factor"] is None, by
    # one strategy throughout: its factor, breakdown or not
    for by in (None, {"allreduce": 500.0}):
        row = _gradpress_row(world, {"w": ["allreduce", 1]}, 500.0, by)
        assert row["ideal_payload_s"] == pytest.approx(compute + 500 * 1.5 * 8 / rate), by


def test_intra_bandwidth_needs_several_workers_per_node():
    from gradpress.bench.e2e_args import _resolve

    args = build_parser().parse_args(["bench", "e2e", "--nodes", "2", "--intra-bandwidth", "1gbit"])
    with pytest.raises(ValueError, match="--workers-per-node"):
        _resolve(args)
    args = build_parser().parse_args(["bench", "e2e", "--nodes", "2", "--workers-per-node", "4", "--configs", "fp16"])
    settings = _resolve(args)
    assert settings["world"] == 8 and settings["threads"] == max(1, len(os.sched_getaffinity(0)) // 8)


def test_payload_formulas():
    model = torch.nn.Sequential(torch.nn.Linear(300, 200), torch.nn.Linear(200, 2), torch.nn.Conv1d(3, 4, 5))
    dense = sum(p.numel() * 4 for p in model.parameters())
    assert payload_bytes_per_step(model, RunConfig("ddp", "d")) == dense
    assert payload_bytes_per_step(model, RunConfig("torch-fp16", "f")) * 2 == dense
    got = payload_bytes_per_step(model, RunConfig("torch-powersgd", "p", rank=2))
    # 200x300: (200+300)*2 factors; 2x200: (2+200)*2*2 >= 400 -> dense; conv 4x15: (4+15)*2*2 >= 60 -> dense
    expect = (500 * 2 + 200 + 2 * 200 + 2 + 4 * 15 + 4) * 4
    assert got == expect


def test_interface_bytes_reads_this_namespace():
    rx, tx = interface_bytes("lo")
    assert rx >= 0 and tx >= 0
    with pytest.raises(ValueError, match="no-such-dev"):
        interface_bytes("no-such-dev")


# ------------------------------------------------------------------ the worker, locally
def _job(mode, config, tmp):
    return {"mode": mode, "tag": mode, "result_dir": tmp, "workload": "digits-mlp", "params": None, "hidden": 16,
            "samples": 256, "batch_size": 16, "lr": 0.02, "optimizer": "adam", "schedule": "cosine", "epochs": 4,
            "seed": 0, "threads": 1, "warmup": 2, "steps": 3, "n_batches": 8, "config": config,
            "target": 0.99, "eval_every": 5, "max_steps": 12, "time_limit": None}


def _run_worker_mode(rank, world, mode, config, tmp):
    from gradpress.bench import e2e_worker

    return e2e_worker.MODES[mode](_job(mode, config, tmp))


def test_worker_step_and_train_modes_on_two_local_workers(tmp_path):
    """The fields the benchmark reads from every rank's result, from real
    steps: gradpress through the training package's algorithm (DDP + hook),
    train mode through its loop, data order and evaluation."""
    cfg = parse_configs("topk:ratio=0.05@allgather")[0].to_dict()
    a, b = run_workers(_run_worker_mode, 2, "step", cfg, str(tmp_path))
    for key in ("warmup", "steps", "bucket_cap_mb", "buckets", "median_step_s", "step_s", "payload_bytes_per_step",
                "payload_source", "compress_s_per_step", "comm_s_per_step", "register_s", "plan", "loss"):
        assert key in a, key
    assert a["steps"] == 3 and len(a["step_s"]) == 3 and a["warmup"] == 2 and a["buckets"] >= 1
    assert 0 < a["payload_bytes_per_step"] < 0.5 * a["dense_bytes_per_step"]
    assert {s for s, _ in a["plan"].values()} <= {"allgather", "uncompressed"} and a["strategy"] == "allgather"
    # the payload by the strategy that handed it over (biases left dense ride inside the gather: small)
    assert set(a["strategy_bytes_per_step"]) <= {"allgather", "uncompressed"}
    assert sum(a["strategy_bytes_per_step"].values()) == pytest.approx(a["payload_bytes_per_step"])
    assert a["loss"] != b["loss"]  # each rank its own batches
    local = parse_configs("localsgd:period=2/topk:ratio=0.05@allgather")[0].to_dict()
    a, b = run_workers(_run_worker_mode, 2, "train", local, str(tmp_path))
    assert a["history"] == b["history"] and a["steps"] == 12 and not a["reached"]  # 0.99 is out of reach
    assert [h["step"] for h in a["history"]] == [5, 10, 12]
    assert a["best_metric"] == max(h["metric"] for h in a["history"]) and a["final_metric"] == a["history"][-1]["metric"]
    assert a["train_s"] > 0 and a["label"] == "gradpress localsgd:period=2,optimizer_state=auto/topk:ratio=0.05@allgather"
    assert a["buckets"] is None  # no DDP: the algorithm exchanges on its own
    # bytes per training step: one top-5% exchange every 2 steps, well under DDP's dense gradient
    dense = 4 * a["parameters"]
    assert 0 < a["payload_bytes_per_step"] < 0.2 * dense


# ------------------------------------------------------------------ real runs (root)
def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


@needs_root
@pytest.mark.cluster
@pytest.mark.slow
def test_tiny_e2e_step_run(tmp_path, capsys):
    out = tmp_path / "e2e"
    argv = ["bench", "e2e", "--nodes", "2", "--bandwidth", "50mbit", "--params", "200K",
            "--configs", "topk:ratio=0.01@allgather,randomk:ratio=0.01@allreduce",
            "--baselines", "ddp,fp16,powersgd:rank=1", "--warmup", "2", "--steps", "3", "--out", str(out)]
    assert cli_main(argv) == 0, capsys.readouterr().err
    result = json.loads((out / "e2e.json").read_text())
    md = (out / "e2e.md").read_text()
    w, h = _png_size(out / "e2e.png")
    assert w > 300 and h > 300
    assert result["mode"] == "step" and result["command"] in md
    labels = ["torch ddp", "torch fp16", "torch powersgd r=1", "gradpress topk:ratio=0.01@allgather",
              "gradpress randomk:ratio=0.01@allreduce"]
    assert [r["label"] for r in result["rows"]] == labels
    for label in labels:
        assert f"| {label} |" in md
    rate = 50_000_000
    params = result["setup"]["parameters"]
    assert 150_000 < params < 250_000
    comp = result["compute"]
    assert comp["shared_s"] > 0 and comp["solo_s"] > 0
    assert comp["shared_after_s"] > 0 and "again after the last configuration" in md  # measured twice: load drifts
    rows = {r["label"]: r for r in result["rows"]}
    for r in result["rows"]:
        assert set(STEP_FIELDS) <= set(r), set(STEP_FIELDS) - set(r)
        assert r["ok"] and r["error"] is None
        assert len(r["step_s"]) == 3 and r["median_step_s"] == sorted(r["step_s"])[1]
        assert r["ideal_s"] == pytest.approx(comp["shared_s"] + r["link_bytes_per_step"] * 8 / rate)
        assert r["measured_over_ideal"] == pytest.approx(r["median_step_s"] / r["ideal_s"])
        assert r["speedup"] == pytest.approx(rows["torch ddp"]["median_step_s"] / r["median_step_s"])
        # the link carried at least the payload (2 nodes: ring factor 2(N-1)/N = 1, allgather N-1 = 1)
        assert r["link_bytes_per_step"] >= 0.95 * r["payload_bytes_per_step"], r
        assert sum(t["tx_bytes"] for t in r["tbf_bytes"]) > 0
    ddp = rows["torch ddp"]
    assert ddp["payload_bytes_per_step"] == 4 * params
    # dense: the link carries the payload plus TCP/IP/Ethernet headers (~5%), not much more
    assert ddp["link_bytes_per_step"] < 1.25 * ddp["payload_bytes_per_step"]
    assert rows["torch fp16"]["payload_bytes_per_step"] == 2 * params
    ps = rows["torch powersgd r=1"]
    assert ps["buckets"] == 1 and ps["bucket_cap_mb"] >= 1 and ps["warmup"] >= 2
    for label in labels[3:]:
        r = rows[label]
        assert r["payload_bytes_per_step"] < 0.1 * ddp["payload_bytes_per_step"]
        assert r["link_bytes_per_step"] < 0.2 * ddp["link_bytes_per_step"]
        assert r["compress_s_per_step"] >= 0 and r["comm_s_per_step"] >= 0
        assert r["wire_factor"] == 1.0 and r["ideal_payload_s"] > comp["shared_s"]
    assert "single DDP bucket" in md


@needs_root
@pytest.mark.cluster
@pytest.mark.slow
def test_tiny_e2e_train_to(tmp_path, capsys):
    out = tmp_path / "t"
    argv = ["bench", "e2e", "--nodes", "2", "--bandwidth", "50mbit", "--workload", "digits-mlp",
            "--configs", "topk:ratio=0.05@allgather", "--baselines", "ddp", "--train-to", "0.5",
            "--eval-every", "5", "--max-steps", "60", "--out", str(out)]
    assert cli_main(argv) == 0, capsys.readouterr().err
    result = json.loads((out / "e2e.json").read_text())
    assert result["mode"] == "train" and result["target"] == 0.5
    _png_size(out / "e2e.png")
    md = (out / "e2e.md").read_text()
    assert result["command"] in md
    for r in result["rows"]:
        assert set(TRAIN_FIELDS) <= set(r)
        assert r["ok"]
        hist = r["history"]
        assert hist and all(h["step"] % 5 == 0 or h["step"] == r["steps"] for h in hist)
        assert [h["seconds"] for h in hist] == sorted(h["seconds"] for h in hist)
        if r["reached"]:
            assert r["time_to_target_s"] == hist[-1]["seconds"] and hist[-1]["metric"] >= 0.5
            assert all(h["metric"] < 0.5 for h in hist[:-1])
        else:
            assert all(h["metric"] < 0.5 for h in hist) and r["steps"] == 60
            assert "not reached" in md
    assert result["rows"][0]["reached"]  # plain DDP learns digits past 50% within 60 steps


# ------------------------------------------------------------------ seeds


def _seed_result(times, best):
    """A per-seed train result: DDP then one gradpress config; ``None`` time = target not reached."""
    rows = []
    for (label, kind), t, b in zip((("torch ddp", "ddp"), ("gradpress topk", "gradpress")), times, best):
        rows.append({"label": label, "kind": kind, "spec": None, "ok": True, "reached": t is not None,
                     "time_to_target_s": t, "steps_to_target": None if t is None else int(t * 10), "steps": 100,
                     "train_s": 20.0, "best_metric": b, "final_metric": b, "payload_bytes_per_step": 1000.0,
                     "speedup": None if t is None or times[0] is None else times[0] / t})
    setup = {"nodes": 2, "bandwidth": "50mbit", "bandwidth_bits": 50_000_000, "workload": "digits-mlp",
             "parameters": 1234, "batch_size": 16, "optimizer": "adam", "lr": 0.01, "threads": 1, "torch": "x",
             "cpus": 2, "metric": "accuracy", "eval_every": 5, "seed": 0}
    return {"mode": "train", "target": 0.9, "setup": setup, "rows": rows, "notes": [], "seconds": 1.0}


def test_seeds_aggregate_time_to_target_and_count_misses(tmp_path):
    from gradpress.bench.e2e_seeds import combine, markdown, plot

    res = combine([_seed_result([10.0, 5.0], [0.95, 0.92]), _seed_result([12.0, None], [0.93, 0.85])], [0, 1],
                  "gradpress bench e2e --seeds 2")
    ddp, topk = res["aggregate"]
    assert ddp["time_to_target_s"]["mean"] == pytest.approx(11.0) and ddp["time_to_target_s"]["k"] == 2
    assert (topk["time_to_target_s"]["k"], topk["time_to_target_s"]["n"]) == (1, 2)  # the miss is kept
    assert topk["speedup"]["values"] == [2.0, None] and topk["best_metric"]["min"] == 0.85
    md = markdown(res)
    assert "gradpress bench e2e --seeds 2" in md and "11.00 ± 1.41 [10.00, 12.00]" in md
    assert "5.00; not reached (1 of 2)" not in md  # one value of two: mean ± 0 [min, max]
    assert "5.00 ± 0.00 [5.00, 5.00]; not reached (1 of 2)" in md
    assert [p["seed"] for p in res["per_seed"]] == [0, 1]
    _png_size(plot(res, tmp_path / "e2e.png"))


def test_seeds_need_train_to(tmp_path, capsys):
    assert cli_main(["bench", "e2e", "--seeds", "2", "--out", str(tmp_path / "s")]) == 2
    assert "--seeds: only with --train-to" in capsys.readouterr().err
    assert cli_main(["bench", "e2e", "--seeds", "0", "--train-to", "0.5", "--out", str(tmp_path / "s")]) == 2
    assert "seeds: the count must be from 1 to 1000, got 0" in capsys.readouterr().err


def test_profile_phases_of_the_allgather_step():
    from gradpress.bench.e2e_profile import profile

    phases = profile("topk:ratio=0.01", [(40, 30), (5, 40)], world=3, repeats=1)
    assert "encode" in phases and "average: sparse_sum of 3 packets" in phases
    assert all(v >= 0 for v in phases.values())
    assert not any("sparse_sum" in k for k in profile("qsgd:levels=4", [(40, 30)], world=2, repeats=1))


def test_payload_cell_names_the_bytes_that_stay_inside_a_host():
    from gradpress.bench.e2e_report import _payload

    assert _payload({"payload_bytes_per_step": 87_540_000, "host_bytes_per_step": 80_000_000}) == \
        "87.54 MB (80.00 MB in hosts)"
    for host in (None, 0, 0.0):  # flat strategies and PyTorch baselines: the plain figure
        assert _payload({"payload_bytes_per_step": 7_600_000, "host_bytes_per_step": host}) == "7.60 MB"


def test_the_target_line_says_which_way_the_metric_reaches_it():
    """Accuracy reaches its target from below, bits per character from above."""
    from gradpress.bench.e2e_report import markdown

    res = _seed_result([10.0, 5.0], [0.95, 0.92])
    res["command"] = "gradpress bench e2e --train-to 0.9"
    assert "Target: accuracy >= 0.9 " in markdown(res)
    res["setup"].update(metric="bpc", higher_is_better=False)
    res["target"] = 2.5
    assert "Target: bpc <= 2.5 " in markdown(res)
    from gradpress.bench.e2e_seeds import combine
    from gradpress.bench.e2e_seeds import markdown as seeds_markdown

    assert "Target: bpc <= 2.5 " in seeds_markdown(combine([res, res], [0, 1], "gradpress bench e2e --seeds 2"))


def test_a_parameter_after_an_option_is_refused_naming_both():
    """``topk:ratio=0.01+lr=0.1,bucket=3``: the parameter was glued onto the +option and refused as
    '+lr got '0.1,bucket=3''; it is refused as a parameter written after the configuration's +options."""
    for text, option, parse in (("topk:ratio=0.01+lr=0.1,bucket=3", "--configs", parse_configs),
                                ("powersgd:rank=2+lr=0.1,start=3", "--baselines", parse_baselines),
                                ("qsgd:levels=4@ring+ef,bucket=512", "--configs", parse_configs)):
        with pytest.raises(ValueError) as exc:
            parse(text)
        token = text.rsplit(",", 1)[1]
        assert str(exc.value) == (f"{option}: {token!r} in {text!r} is a parameter written after the options of "
                                  f"{text.rsplit(',', 1)[0]!r}; allowed: NAME:key=value,key=value+option"), str(exc.value)
