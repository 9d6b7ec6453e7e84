"""Issue 15, "Files and outputs" and the smaller items: ``gradpress train``
as a hostile user would run it. ``--out`` is checked before any worker;
a diverged run writes strict JSON and fails unless allowed; no progress
bar into logs; checkpoints are verified (CRCs) and a bad one is one line
and exit 2; a worker that dies or goes silent is named; Ctrl-C is exit 130;
a truncated data cache regenerates; a huge seed names the field;
``load_state_dict`` validates fully before it changes anything."""

from __future__ import annotations

import ast
import json
import os
import re
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch
from distributed import run_workers, worker_pids
from refusals import forbid

from gradpress import train
from gradpress.cli import main as cli
from gradpress.train import checkpoint

ROOT = Path(__file__).resolve().parent.parent
TINY = ["--workload", "digits-mlp", "--hidden", "16", "--samples", "256", "--batch-size", "16", "--no-progress"]


def _cmd(out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "gradpress.train", "--nproc", "2", *TINY, "--out", str(out), *extra]


def _one_line_error(err: str) -> str:
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err, err
    return lines[0]


# ----------------------------------------------------------- 9: --out
@pytest.mark.parametrize("make", ["file_child", "is_file", "unwritable"])
def test_bad_out_fails_before_any_worker_in_one_line(tmp_path, capsys, make):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    out = {"file_child": blocker / "run", "is_file": blocker, "unwritable": Path("/proc/gradpress-test/run")}[make]
    if make == "unwritable" and not Path("/proc/self").exists():
        pytest.skip("needs /proc (a place nobody, root included, can write)")
    t0 = time.monotonic()
    rc = cli(["train", "--nproc", "2", *TINY, "--out", str(out)])
    assert rc == 2
    line = _one_line_error(capsys.readouterr().err)
    assert "out:" in line and str(out) in line
    assert time.monotonic() - t0 < 5
    assert not (tmp_path / "a_file").is_dir()


@pytest.fixture
def no_workers(monkeypatch):
    """Starting workers fails the test: the options must be refused before."""
    import gradpress.train.launch as launch

    forbid(monkeypatch, "workers were started", (launch, "_launch"))


def test_config_file_key_given_twice_in_two_spellings_is_refused(tmp_path, capsys, no_workers):
    """``log-every`` and ``log_every`` are one option: the file set it twice and the last one silently won."""
    cfg = tmp_path / "c.toml"
    cfg.write_text('log-every = 3\nlog_every = 4\n')
    assert cli(["train", "--nproc", "1", *TINY, "--config", str(cfg), "--out", str(tmp_path / "r")]) == 2
    line = _one_line_error(capsys.readouterr().err)
    assert line.startswith("gradpress train: error: config file") and "'log-every'" in line and "'log_every'" in line
    assert "same option" in line, line
    with pytest.raises(ValueError, match="'log-every' and 'log_every'"):
        train.make_config({"config": str(cfg)})


def test_unwritable_tensorboard_dir_fails_before_any_worker(tmp_path, capsys, no_workers):
    """The workers opened it: exit 1 with a FileNotFoundError, seconds after the start."""
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    pytest.importorskip("tensorboard")
    assert cli(["train", "--nproc", "1", *TINY, "--out", str(tmp_path / "r"), "--tensorboard", str(blocker / "tb")]) == 2
    line = _one_line_error(capsys.readouterr().err)
    assert "tensorboard: cannot create" in line and "is a file, not a directory" in line, line


def test_hierarchical_layout_that_cannot_divide_nproc_fails_before_any_worker(tmp_path, capsys, no_workers):
    """Every worker refused it at registration (exit 2 after the start); --nproc gives the world size now."""
    assert cli(["train", "--nproc", "2", *TINY, "--out", str(tmp_path / "r"),
                "--strategy", "hierarchical:workers_per_host=3"]) == 2
    line = _one_line_error(capsys.readouterr().err)
    assert line == ("gradpress train: error: strategy 'hierarchical': workers_per_host=3 does not divide the group's "
                    "2 ranks; allowed: a divisor of 2"), line
    train.make_config(workload="digits-mlp", nproc=4, strategy="hierarchical:workers_per_host=2")  # divides: fine
    train.make_config(workload="digits-mlp", nproc=1, strategy="hierarchical:workers_per_host=3")  # one rank: one host


@pytest.mark.parametrize("workload,option,value", [("wide-mlp", "hidden", 8), ("digits-mlp", "text_bytes", 20000),
                                                   ("mnist1d-cnn", "text_bytes", 5000)])
def test_workload_options_the_workload_ignores_are_refused(workload, option, value):
    """--hidden on wide-mlp and --text-bytes off the charlm workloads were dropped silently."""
    with pytest.raises(ValueError, match=f"^{option} .*workload is {workload!r}"):
        train.make_config(workload=workload, **{option: value})


def test_bad_out_from_python_raises_value_error_naming_out(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="out: cannot create .* is a file, not a directory"):
        train.make_config(workload="digits-mlp", out=str(tmp_path / "f" / "deeper" / "run"))


# --------------------------------------------------- 10: divergence
def test_divergence_writes_null_names_the_step_and_fails(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["train", *TINY, "--out", str(out), "--lr", "1e20", "--optimizer", "sgd", "--epochs", "2", "--log-every", "2"]
    rc = cli(argv)
    err = capsys.readouterr().err
    assert rc == 3, err
    assert re.search(r"loss became non-finite at step \d+", err), err
    for line in (out / "metrics.jsonl").read_text().splitlines():
        json.loads(line, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c} in metrics.jsonl"))
    text = (out / "summary.json").read_text()
    summary = json.loads(text, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c} in summary.json"))
    assert isinstance(summary["diverged_at_step"], int) and "NaN" not in text
    assert summary["steps"] < 2 * summary["steps_per_epoch"], "a diverged run stops unless told to go on"
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert any(r["loss"] is None for r in rows)

    rc = cli([*argv, "--allow-divergence", "--out", str(tmp_path / "go_on")])
    err = capsys.readouterr().err
    assert rc == 0 and "loss became non-finite at step" in err
    summary = json.loads((tmp_path / "go_on" / "summary.json").read_text())
    assert summary["steps"] == 2 * summary["steps_per_epoch"]


# ------------------------------------------- 11: no weights_only=False
def test_no_torch_load_without_weights_only_in_the_package():
    offenders = []
    for path in (ROOT / "gradpress").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "load" \
                    and "torch" in ast.unparse(node.func):
                kw = {k.arg: k.value for k in node.keywords}
                if not (isinstance(kw.get("weights_only"), ast.Constant) and kw["weights_only"].value is True):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, f"torch.load without weights_only=True: {offenders}"


def test_hook_state_dict_loads_with_weights_only(tmp_path):
    run_workers(_hook_state_weights_only, 1, str(tmp_path / "hook.pt"))


def _hook_state_weights_only(rank: int, world: int, path: str) -> None:
    import gradpress

    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 64))
    hook = gradpress.ddp.register(model, "topk:ratio=0.1", min_numel=16)
    model(torch.randn(4, 64)).sum().backward()
    torch.save(hook.state_dict(), path)
    hook.load_state_dict(torch.load(path, weights_only=True))
    hook.close()


# ------------------------------------------------------ 12: progress
def test_no_progress_bar_when_stderr_is_not_a_terminal(tmp_path):
    out = tmp_path / "run"
    argv = [a for a in _cmd(out, "--epochs", "2", "--log-every", "1") if a != "--no-progress"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "\r" not in done.stderr and "\x1b[" not in done.stderr
    lines = [ln for ln in done.stderr.splitlines() if "step " in ln]
    assert 2 <= len(lines) <= 25, done.stderr
    assert max(map(len, done.stderr.splitlines())) < 300


# ------------------------------------------------ 13, 14: checkpoints
def _corrupt_tensor_record(path: Path) -> None:
    with zipfile.ZipFile(path) as z:
        info = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    data = bytearray(path.read_bytes())
    # the local header: 30 bytes + name + extra field, then the record's bytes
    name_len, extra_len = int.from_bytes(data[info.header_offset + 26:info.header_offset + 28], "little"), \
        int.from_bytes(data[info.header_offset + 28:info.header_offset + 30], "little")
    start = info.header_offset + 30 + name_len + extra_len
    mid = start + info.file_size // 2
    data[mid:mid + 64] = bytes(64)
    path.write_bytes(bytes(data))


def test_damaged_tensor_bytes_are_refused_on_load(tmp_path):
    path = tmp_path / "checkpoint.pt"
    checkpoint._atomic_save({"format": checkpoint.FORMAT, "w": torch.randn(4096)}, path)
    assert checkpoint.load(path)["format"] == checkpoint.FORMAT
    _corrupt_tensor_record(path)
    torch.load(path, weights_only=True)  # torch itself does not notice
    with pytest.raises(ValueError, match=r"checkpoint\.pt' is corrupt: record .* fails its CRC check"):
        checkpoint.load(path)
    assert not list(tmp_path.glob("*.tmp*")), "the atomic write leaves no temporary file"


@pytest.mark.parametrize("kind", ["truncated", "empty", "garbage", "directory", "damaged"])
def test_bad_checkpoint_is_one_line_and_exit_2(tmp_path, capsys, kind):
    out = tmp_path / "run"
    path = out / "checkpoint.pt"
    if kind in ("truncated", "damaged"):
        out.mkdir()
        torch.save({"format": checkpoint.FORMAT, "w": torch.randn(4096)}, path)
        if kind == "truncated":
            path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
        else:
            _corrupt_tensor_record(path)
    elif kind == "directory":
        path.mkdir(parents=True)
    else:
        out.mkdir()
        path.write_bytes(b"" if kind == "empty" else b"this is not a checkpoint\n" * 10)
    t0 = time.monotonic()
    rc = cli(["train", "--nproc", "2", *TINY, "--out", str(out), "--resume"])
    assert rc == 2
    line = _one_line_error(capsys.readouterr().err)
    assert str(path) in line and "weights_only=False" not in line
    assert {"truncated": "truncated", "empty": "empty", "garbage": "not a gradpress training checkpoint", "directory": "directory",
            "damaged": "CRC"}[kind] in line
    assert time.monotonic() - t0 < 10, "refused before any worker starts"


# ---------------------------------------------- 15: who died, and how
def test_describe_failures_names_the_killed_worker_first():
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from gradpress.train.launch import describe_failures

    def failure(rank: int, exitcode: int, message: str, ts: int) -> ProcessFailure:
        f = ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file="/nonexistent")
        f.message, f.timestamp = message or f.message, ts
        return f

    msg = describe_failures({0: failure(0, 1, "RuntimeError: Connection reset by peer", 10),
                             1: failure(1, -signal.SIGKILL, "", 12)}, 2, 300)
    assert msg.startswith("worker rank 1 was killed by SIGKILL"), msg
    assert "rank 0" in msg and "Connection reset by peer" in msg
    # the launcher noticed only rank 0's consequence; the exit codes show who was killed
    msg = describe_failures({0: failure(0, 1, "RuntimeError: Connection closed by peer", 10)}, 2, 300,
                            {0: (1000, 1), 1: (1001, -signal.SIGKILL)})
    assert msg.startswith("worker rank 1 was killed by SIGKILL (pid 1001)"), msg
    msg = describe_failures({0: failure(0, 1, "DistBackendError: Timed out waiting 5000ms for recv", 10)}, 2, 5)
    assert "waiting for rank 1" in msg and "5 s" in msg, msg


# the end to end case (SIGKILL of rank 1 during a run) is in tests/test_train_faults.py


# --------------------------------------------- 16: silent rank, timeout
def test_timeout_flag_is_validated_and_reaches_the_config(tmp_path, capsys):
    assert cli(["train", *TINY, "--out", str(tmp_path), "--timeout", "-3"]) == 2
    assert "timeout must be a positive" in capsys.readouterr().err
    assert train.make_config(workload="digits-mlp", out=str(tmp_path)).timeout == 300.0
    assert train.make_config(workload="digits-mlp", out=str(tmp_path), timeout=7).timeout == 7.0


@pytest.mark.slow
@pytest.mark.long  # 39 s; test_train_faults' dead worker covers the launcher's failure path in 14 s
def test_stopped_worker_ends_the_run_naming_the_silent_rank(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen(_cmd(out, "--epochs", "400", "--timeout", "3"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while not (out / "checkpoint.pt").exists():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        workers = worker_pids(proc.pid)
        os.kill(workers[-1], signal.SIGSTOP)
        _, err = proc.communicate(timeout=150)
    finally:
        for pid in workers:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, err
    assert "waiting for rank 1" in err and "--timeout" in err, err


# -------------------------------------------------------- 18: Ctrl-C
@pytest.mark.slow
def test_ctrl_c_on_the_launcher_is_exit_130_and_cleans_workers(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen(_cmd(out, "--epochs", "400"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (out / "checkpoint.pt").exists():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        workers = worker_pids(proc.pid)
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole foreground group
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert "interrupted" in err and "Traceback" not in err and len(err.strip().splitlines()) <= 3, err
    time.sleep(0.5)
    assert not [w for w in workers if Path(f"/proc/{w}").exists()
                and "Z" not in Path(f"/proc/{w}/stat").read_text().split()[2]], "workers left running"


# ------------------------------------------------- 17: the data cache
def test_truncated_cache_file_is_regenerated(tmp_path, monkeypatch):
    import numpy as np

    from gradpress.workloads.base import cached_arrays

    monkeypatch.setenv("GRADPRESS_CACHE", str(tmp_path))
    calls = []

    def make():
        calls.append(1)
        return {"x": np.arange(10000, dtype=np.float32)}

    first = cached_arrays("t", {"k": 1}, make)
    (path,) = tmp_path.glob("t-*.npz")
    for damage in (lambda b: b[: len(b) // 2], lambda b: b"", lambda b: b[:-30]):
        path.write_bytes(damage(path.read_bytes()) if path.stat().st_size else b"")
        again = cached_arrays("t", {"k": 1}, make)
        np.testing.assert_array_equal(again["x"], first["x"])
    assert len(calls) == 4
    assert cached_arrays("t", {"k": 1}, make)["x"].shape == (10000,) and len(calls) == 4


# ------------------------------------------------------ 19: seed, state
@pytest.mark.parametrize("seed", ["99999999999999999999", "4294967296"])
def test_huge_seed_names_the_field(tmp_path, capsys, seed):
    assert cli(["train", *TINY, "--out", str(tmp_path), "--seed", seed]) == 2
    line = _one_line_error(capsys.readouterr().err)
    assert "seed must be an integer from 0 to 4294967295" in line


NPROC_CAP = max(64, 8 * len(os.sched_getaffinity(0)))  # the documented cap on local workers (docs/train.md)


def test_nproc_above_the_cap_is_refused_before_any_worker(tmp_path, capsys, no_workers):
    """--nproc 4000 (a typo) went to the elastic launcher, which forks that many workers: train, compare and
    the demo (compare's options) refuse more than max(64, 8 x cores) local workers, naming the cap."""
    too_many = str(NPROC_CAP + 1)
    words = f"nproc must be an integer from 1 to {NPROC_CAP}"
    assert cli(["train", *TINY, "--out", str(tmp_path / "t"), "--nproc", too_many]) == 2
    line = _one_line_error(capsys.readouterr().err)
    assert line.startswith(f"gradpress train: error: --{words}") and line.endswith(f"got {too_many}"), line
    assert f"max(64, 8 x {len(os.sched_getaffinity(0))} cores)" in line, line
    assert cli(["compare", *TINY, "--compressors", "none", "--out", str(tmp_path / "c"), "--nproc", "4000"]) == 2
    line = _one_line_error(capsys.readouterr().err)
    assert line.startswith(f"gradpress compare: error: --{words}") and line.endswith("got 4000"), line
    from gradpress import demo

    with pytest.raises(ValueError, match=words):
        demo.main(["--out", str(tmp_path / "d"), "--nproc", "4000"])
    assert train.make_config(workload="digits-mlp", nproc=NPROC_CAP, out=str(tmp_path / "ok")).nproc == NPROC_CAP
    with pytest.raises(ValueError, match=words):
        train.make_config(workload="digits-mlp", nproc=NPROC_CAP + 1, out=str(tmp_path / "ok"))
    assert not any((tmp_path / d).exists() for d in ("t", "c", "d"))


def _malformed_states_leave_the_hook_untouched(rank: int, world: int) -> None:
    import copy

    import gradpress

    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 64))
    hook = gradpress.ddp.register(model, "topk:ratio=0.1", min_numel=16)
    for _ in range(2):
        model(torch.randn(4, 64)).sum().backward()
    good = copy.deepcopy(hook.state_dict())
    other = copy.deepcopy(good)
    for key in other["feedback"]["residuals"]:
        other["feedback"]["residuals"][key] = torch.full_like(other["feedback"]["residuals"][key], 7.0)
    other["step"] = 99

    def broken(change):  # a state whose residuals differ, so a half-load would show
        s = copy.deepcopy(other)
        change(s)
        return s

    cases = {
        "not a mapping": (5, "not a gradpress hook state dict"),
        "no feedback": (broken(lambda s: s.pop("feedback")), "missing 'feedback'"),
        "residual not a tensor": (broken(lambda s: s["feedback"]["residuals"].update(
            {next(iter(s["feedback"]["residuals"])): "zeros"})), "must be a tensor"),
        "compressor junk": (broken(lambda s: s.__setitem__("compressor", {"junk": 1})), "compressor"),
        "strategies not a dict": (broken(lambda s: s.__setitem__("strategies", [1])), "'strategies' must be a dict"),
        "bad step": (broken(lambda s: s.__setitem__("step", "x")), "'step' must be an integer"),
        "no config": (broken(lambda s: s.pop("config")), "missing 'config'"),
    }
    for name, (state, needle) in cases.items():
        for target in (hook, hook.engine):
            if target is hook.engine and isinstance(state, dict):
                state = {k: v for k, v in state.items() if k != "step"} | {"format": hook.engine.state_dict()["format"]}
                if name == "bad step":
                    continue
            try:
                target.load_state_dict(state)
            except ValueError as exc:
                assert needle in str(exc) or target is hook.engine, (name, str(exc))
            else:
                raise AssertionError(f"{name}: accepted")
            now = hook.state_dict()
            assert now["step"] == good["step"], name
            for key, value in good["feedback"]["residuals"].items():
                assert torch.equal(now["feedback"]["residuals"][key], value), (name, key)
    hook.load_state_dict(other)  # a well-formed one still loads
    assert hook.state_dict()["step"] == 99
    hook.close()


def test_malformed_load_state_dict_raises_value_error_and_changes_nothing():
    run_workers(_malformed_states_leave_the_hook_untouched, 1)

