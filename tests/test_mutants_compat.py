"""Written for survivors of the ``compat`` group of ``make mutants``
(torch_compat.py, train/cli.py, cli.py, workloads/__init__.py,
cluster/selftest.py, compress/kit/__init__.py): the workloads' training
defaults and metrics against docs/train.md's tables, ``budget_note`` with no
step per epoch; ``gradpress train``'s summary line (the label of an
algorithm other than ddp, the bytes inside hosts, the median step in ms)
and its exit codes (docs/train.md, "Failures and exit codes");
``gradpress`` without a command; the cluster selftest on 2 gloo ranks on
127.0.0.1 (``env://``, no namespace): one compressed tensor is enough, none
fails, and ``--steps`` defaults to 3."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gradpress import cli as gradpress_cli
from gradpress import workloads
from gradpress.train import cli
from gradpress.train.launch import WorkerFailed

pytestmark = pytest.mark.mutants

ROOT = Path(__file__).resolve().parent.parent
OPTIMIZERS = {"momentum SGD": "momentum", "Adam": "adam", "SGD": "sgd"}


def _table(doc: str, heading: str) -> list[list[str]]:
    """The cells of the first markdown table after ``heading`` in ``doc`` (header and rule left out)."""
    lines = doc.split(heading, 1)[1].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows


def test_every_workloads_training_defaults_are_the_documented_ones() -> None:
    """docs/train.md, "Default optimizer, learning rate and schedule": one row per workload (or a row of
    several, their epochs listed in the same order)."""
    doc = (ROOT / "docs" / "train.md").read_text()
    documented: dict[str, dict[str, Any]] = {}
    for names, optimizer, lr, batch, schedule, epochs in _table(doc, "#### Default optimizer, learning rate and schedule"):
        listed = re.findall(r"`([^`]+)`", names)
        counts = [int(e) for e in epochs.split(",")]
        assert len(counts) == len(listed), (names, epochs)
        for name, count in zip(listed, counts):
            documented[name] = {"epochs": count, "lr": float(lr), "batch_size": int(batch),
                                "optimizer": OPTIMIZERS[re.sub(r"\s*\(.*\)", "", optimizer)], "schedule": schedule}
    assert sorted(documented) == sorted(workloads.names())
    for name, want in documented.items():
        assert workloads.defaults(name) == want, name


def test_every_workloads_metric_and_the_default_are_the_documented_ones() -> None:
    """docs/train.md, "Workloads": bits per character for the character models, test accuracy otherwise;
    the row marked (default) is ``DEFAULT``."""
    rows = _table((ROOT / "docs" / "train.md").read_text(), "### Workloads (`--workload`)")
    metrics = {re.findall(r"`([^`]+)`", r[0])[0]: r[3] for r in rows}
    assert sorted(metrics) == sorted(workloads.names())
    for name, text in metrics.items():
        want = "bits_per_char" if text.startswith("bits per character") else "accuracy"
        assert text.startswith(("bits per character", "test accuracy")), text
        assert workloads.get(name).metric == want, name
    assert [re.findall(r"`([^`]+)`", r[0])[0] for r in rows if "(default)" in r[0]] == [workloads.DEFAULT]


def test_budget_note_without_a_step_per_epoch_is_none() -> None:
    """No step per epoch states no schedule (the note would divide by it): None, not ZeroDivisionError."""
    assert workloads.budget_note("mnist1d-cnn", 20, 0) is None
    assert workloads.budget_note("mnist1d-cnn", 20, 1) is not None  # 20 steps: short of 1,240


def test_mnist1d_cnn_is_tuned_at_the_documented_schedule() -> None:
    """docs/train.md: "the 1,240 steps the defaults were tuned at"."""
    said = re.search(r"the ([\d,]+) steps the defaults were tuned at", (ROOT / "docs" / "train.md").read_text())
    assert said is not None
    assert workloads.get("mnist1d-cnn").tuned_steps == int(said.group(1).replace(",", ""))


# ----------------------------------------------------------------------------- gradpress train: summary and exit
SUMMARY = {"workload": "digits-mlp", "compressor": "topk:ratio=0.1", "world_size": 2, "steps": 10,
           "metric": "accuracy", "final_metric": 0.91234, "bytes_per_step": 1500, "dense_bytes_per_step": 2_000_000,
           "compression_ratio": 1333.33, "median_step_s": 0.0125}


@pytest.mark.parametrize("algorithm", [None, "ddp", "localsgd:period=4", "comprex:staleness=2", "choco"])
def test_summary_line_labels_the_algorithm_unless_ddp_and_gives_the_median_step_in_ms(algorithm: str | None) -> None:
    """Names that sort before and after "ddp" (parameters off their defaults: the line leaves defaults out)."""
    s = dict(SUMMARY) if algorithm is None else {**SUMMARY, "algorithm": algorithm}
    what = "topk:ratio=0.1" if algorithm in (None, "ddp") else f"{algorithm} / topk:ratio=0.1"
    assert cli.summary_line(s) == (f"digits-mlp / {what} on 2 worker(s): 10 steps, accuracy 0.9123, 1.5KB/step "
                                   "(dense 2.0MB, x1333.3), median step 12.5 ms")  # 0.0125 s = 12.5 ms


@pytest.mark.parametrize("host,inside", [(None, ""), (0, ""), (2_500_000, "2.5MB of it inside hosts; ")])
def test_summary_line_names_the_bytes_inside_hosts_only_when_there_are_some(host: int | None, inside: str) -> None:
    s = {**SUMMARY, "median_step_s": None, "final_metric": None, "host_bytes_per_step": host}
    assert cli.summary_line(s) == ("digits-mlp / topk:ratio=0.1 on 2 worker(s): 10 steps, accuracy n/a, 1.5KB/step "
                                   f"({inside}dense 2.0MB, x1333.3), median step n/a")


def _run_cli(monkeypatch: pytest.MonkeyPatch, outcome: Any, rank: str | None = None) -> int:
    """``run_cli`` with ``train.run`` replaced: it returns ``outcome`` (a summary) or raises it."""
    def run(args: argparse.Namespace) -> dict:
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    monkeypatch.setattr(cli, "run", run)
    monkeypatch.setattr(cli, "summary_line", lambda s: "summary")
    if rank is None:
        monkeypatch.delenv("RANK", raising=False)
    else:
        monkeypatch.setenv("RANK", rank)
    return cli.run_cli(argparse.Namespace(samples=64))


@pytest.mark.parametrize("rank", [None, "0", "1"])
def test_a_diverged_run_exits_3_and_with_allow_divergence_0_with_a_warning(monkeypatch, capsys, tmp_path,
                                                                           rank: str | None) -> None:
    """docs/train.md: exit 3, ``loss became non-finite at step N``; with --allow-divergence 0 and a warning;
    only rank 0 (RANK unset is rank 0) prints."""
    diverged = {"workload": "digits-mlp", "out": str(tmp_path), "diverged_at_step": 7}
    printing = rank != "1"
    assert _run_cli(monkeypatch, diverged, rank) == 3
    out, err = capsys.readouterr()
    assert ("gradpress train: error: loss became non-finite at step 7;" in err) is printing
    assert ("summary" in out) is printing
    assert _run_cli(monkeypatch, {**diverged, "allow_divergence": True}, rank) == 0
    err = capsys.readouterr().err
    assert (err == "gradpress train: warning: loss became non-finite at step 7\n") is printing
    assert printing or err == ""
    assert _run_cli(monkeypatch, {**diverged, "diverged_at_step": None}, rank) == 0
    assert capsys.readouterr().err == ""


def test_a_failed_worker_exits_1_and_ctrl_c_130(monkeypatch, capsys) -> None:
    assert _run_cli(monkeypatch, WorkerFailed("worker rank 1 was killed by SIGKILL (pid 42)")) == 1
    assert capsys.readouterr().err == "gradpress train: error: worker rank 1 was killed by SIGKILL (pid 42)\n"
    assert _run_cli(monkeypatch, KeyboardInterrupt()) == 130
    assert capsys.readouterr().err == "gradpress train: interrupted; workers stopped\n"


PLAN = {"source": "measured", "decisions": {"0.weight": {
    "numel": 4096, "strategy": "allgather", "parts": 1, "predicted_s": 0.001, "costs": {"uncompressed": 0.0025},
    "reason": "cheapest"}}}


@pytest.mark.parametrize("strategy,plan,printed", [("auto", PLAN, True), ("auto", None, False),
                                                   ("allgather", PLAN, False)])
def test_the_plan_table_follows_the_summary_of_an_auto_run(monkeypatch, capsys, tmp_path, strategy: str,
                                                            plan: dict | None, printed: bool) -> None:
    """``--strategy auto`` prints the plan it trained with; the summary comes back from the workers (JSON), so
    its strategy is an equal string, not this module's constant."""
    summary = {"workload": "digits-mlp", "out": str(tmp_path), "strategy": json.loads(json.dumps(strategy)),
               "plan": plan}
    assert _run_cli(monkeypatch, summary) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "summary"
    rows = [line.split() for line in out if line.startswith("0.weight")]
    assert ("plan (measured)" in out) is printed
    # predicted 0.001 s and uncompressed 0.0025 s, in ms
    assert rows == ([["0.weight", "4096", "allgather", "1", "1.000", "2.500", "cheapest"]] if printed else [])


# ----------------------------------------------------------------------------- torch_compat
def test_ddp_kwargs_compares_keys_by_value(monkeypatch: pytest.MonkeyPatch) -> None:
    """Options read from a file or a spec are strings built at run time, equal to the keywords but not the same
    objects: ``bucket_cap_mb=None`` is still left out, and ``init_sync`` still dropped where DDP lacks it."""
    from gradpress import torch_compat

    options = json.loads('{"bucket_cap_mb": null, "init_sync": false, "broadcast_buffers": false}')
    assert not any(k is w for k in options for w in ("bucket_cap_mb", "init_sync"))  # what the test is about
    known = {"self", "module", "bucket_cap_mb", "broadcast_buffers"}
    monkeypatch.setattr(torch_compat, "_ddp_parameters", lambda: frozenset(known | {"init_sync"}))
    assert torch_compat.ddp_kwargs(options) == {"init_sync": False, "broadcast_buffers": False}
    monkeypatch.setattr(torch_compat, "_ddp_parameters", lambda: frozenset(known))  # torch 2.2: no init_sync
    assert torch_compat.ddp_kwargs(options) == {"broadcast_buffers": False}


# ----------------------------------------------------------------------------- gradpress
def test_gradpress_without_a_command_prints_its_help_and_exits_2(capsys) -> None:
    assert gradpress_cli.main([]) == 2
    out = capsys.readouterr().out
    assert out.startswith("usage: gradpress") and "COMMAND" in out


def test_python_m_gradpress_cli_runs_the_command_line(monkeypatch, capsys) -> None:
    """``python -m gradpress.cli --version`` (the module's ``__main__`` block, run here by runpy)."""
    import runpy

    from gradpress import __version__

    monkeypatch.setattr(sys, "argv", ["gradpress", "--version"])
    with pytest.warns(RuntimeWarning, match="found in sys.modules"), pytest.raises(SystemExit) as done:
        runpy.run_module("gradpress.cli", run_name="__main__")
    assert done.value.code == 0 and capsys.readouterr().out == f"gradpress {__version__}\n"


def test_an_error_line_names_the_command_and_its_subcommand() -> None:
    assert gradpress_cli.command_name(argparse.Namespace(command="train")) == "gradpress train"
    assert gradpress_cli.command_name(argparse.Namespace(command="bench", bench_command="e2e")) == "gradpress bench e2e"
    assert gradpress_cli.command_name(argparse.Namespace(command="bench", bench_command=None)) == "gradpress bench"


# ----------------------------------------------------------------------------- the cluster selftest on 127.0.0.1
#: name -> (ranks, arguments): the runs start at once (one module fixture), each rank a process
SELFTESTS = {"one": (2, ["--width", "32"]), "none": (1, ["--width", "16", "--steps", "1"])}


@pytest.fixture(scope="module")
def selftests(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[list[int], str, list[dict]]]:
    """``python -m gradpress.cluster.selftest ARGS --out DIR`` per entry of :data:`SELFTESTS` (gloo on 127.0.0.1,
    the environment ``gradpress cluster`` sets, docs/cluster.md): exit codes, rank 0's output, each rank's
    report."""
    from distributed import free_port

    base = tmp_path_factory.mktemp("selftest")
    procs: dict[str, list[subprocess.Popen]] = {}
    try:
        for name, (world, args) in SELFTESTS.items():
            port = str(free_port())
            procs[name] = [subprocess.Popen(
                [sys.executable, "-m", "gradpress.cluster.selftest", *args, "--out", str(base / name)],
                env={**os.environ, "RANK": str(r), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                     "MASTER_PORT": port, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"},
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(world)]
        outputs = {name: [p.communicate(timeout=120)[0] for p in ps] for name, ps in procs.items()}
    finally:
        for p in (p for ps in procs.values() for p in ps):
            if p.poll() is None:
                p.kill()
                p.wait()
    done = {}
    for name, (world, _) in SELFTESTS.items():
        missing = [r for r in range(world) if not (base / name / f"rank{r}.json").is_file()]
        assert not missing, f"{name}: ranks {missing} wrote no report:\n" + "\n".join(outputs[name])
        done[name] = ([p.returncode for p in procs[name]], outputs[name][0],
                      [json.loads((base / name / f"rank{r}.json").read_text()) for r in range(world)])
    return done


def test_selftest_passes_with_one_compressed_tensor_and_takes_3_steps_by_default(selftests) -> None:
    """Width 32: the first layer's 32 x 32 weight reaches ``min_numel`` (1024), the second's 32 x 10 does not:
    one tensor goes through the compressor, which is what the selftest asks for ("the compressor was really
    used"). ``--steps`` defaults to 3 (its help)."""
    codes, out, reports = selftests["one"]
    assert codes == [0, 0], out
    assert out.rstrip().endswith("compressed_tensors=1 -> ok"), out
    assert [r["stats"]["compressed_tensors"] for r in reports] == [1, 1]
    assert all(r["identical"] and r["steps"] == 3 and len(r["losses"]) == 3 for r in reports)
    assert reports[0]["param_sha256"] == reports[1]["param_sha256"]


def test_selftest_fails_when_no_tensor_was_compressed(selftests) -> None:
    """Width 16: 512 and 160 entries, both below ``min_numel``: nothing compressed, exit 1."""
    codes, out, (report,) = selftests["none"]
    assert codes == [1], out
    assert out.rstrip().endswith("compressed_tensors=0 -> FAILED"), out
    assert report["identical"] and report["stats"]["compressed_tensors"] == 0
