"""The cores gradpress counts are the ones this process may run on (its affinity mask), not the host's.

In a container (or under ``taskset``) ``os.cpu_count()`` is the host's count: a 2-CPU container on a 96-core
host capped ``--nproc`` at 768, gave each of 2 workers 48 OpenMP threads and accepted ``--threads 96`` in the
benchmarks. Each test narrows the affinity with a stand-in for ``os.sched_getaffinity`` and gives
``os.cpu_count`` a much larger host, then checks the count every site uses and names."""
from __future__ import annotations

import os

import pytest
from refusals import forbid

import gradpress.train.cpus as cpus_module
from gradpress.cli import build_parser
from gradpress.cli import main as cli_main
from gradpress.train.config import check_nproc, make_config, nproc_max

HOST = 96  # what os.cpu_count() says: the host's CPUs


@pytest.fixture
def cpus(monkeypatch):
    """Returns ``allow(n)``: this process may run on n CPUs of a host of HOST."""
    def allow(n: int) -> int:
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(n)), raising=False)
        monkeypatch.setattr(os, "cpu_count", lambda: HOST)
        monkeypatch.setattr(cpus_module, "cgroup_cpu_limit", lambda: None)  # no quota, whatever the host has
        return n
    return allow


def test_usable_cpus_is_the_affinity_else_the_cpu_count(monkeypatch, cpus):
    from gradpress.train.config import usable_cpus

    n = cpus(3)
    assert usable_cpus() == n
    monkeypatch.delattr(os, "sched_getaffinity")  # macOS, Windows: no affinity
    assert usable_cpus() == HOST
    monkeypatch.setattr(os, "cpu_count", lambda: None)  # undeterminable
    assert usable_cpus() == 1

    def unavailable(pid):
        raise OSError("not permitted")

    monkeypatch.setattr(os, "sched_getaffinity", unavailable, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 5)
    assert usable_cpus() == 5


def test_a_cgroup_quota_narrows_the_count_and_never_widens_it(monkeypatch, cpus):
    """Docker's ``--cpus`` and a Kubernetes CPU limit leave the affinity at the host's CPUs and set a quota."""
    from gradpress.train.config import usable_cpus

    cpus(8)
    monkeypatch.setattr(cpus_module, "cgroup_cpu_limit", lambda: 2)
    assert usable_cpus() == 2
    assert nproc_max() == 64
    monkeypatch.setattr(cpus_module, "cgroup_cpu_limit", lambda: 20)  # a quota above the affinity
    assert usable_cpus() == 8


def test_nproc_cap_counts_usable_cores_and_names_them(cpus):
    n = cpus(10)  # cap max(64, 8 x 10) = 80, not max(64, 8 x 96) = 768
    assert nproc_max() == max(64, 8 * n) == 80
    assert check_nproc(80) == 80
    with pytest.raises(ValueError) as exc:
        check_nproc(81, "--nproc")
    assert str(exc.value) == ("--nproc must be an integer from 1 to 80 (local workers on one machine: at most "
                              "max(64, 8 x 10 cores)), got 81")
    cpus(2)
    with pytest.raises(ValueError, match=r"from 1 to 64 .*8 x 2 cores\)\), got 65"):
        check_nproc(65)


def test_workers_omp_threads_share_the_usable_cores(tmp_path, monkeypatch, cpus):
    """``train --nproc`` on CPU sets OMP_NUM_THREADS = usable cores // nproc for its workers."""
    import torch.distributed.launcher.api as launcher_api

    import gradpress.train.launch as launch

    seen = {}

    def fake_launch(config, entry):
        def run(*args):
            seen["omp"] = os.environ.get("OMP_NUM_THREADS")
            seen["nproc"] = config.nproc_per_node
            return {0: {"ok": {"fake": True}}}
        return run

    monkeypatch.setattr(launcher_api, "elastic_launch", fake_launch)
    monkeypatch.setattr(launch, "_preload", lambda cfg: None)
    monkeypatch.setattr(launch, "_start_forkserver", lambda: None)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cfg = make_config(workload="digits-mlp", nproc=2, out=str(tmp_path / "run"))
    cpus(6)
    assert launch._launch(cfg) == {"fake": True}
    assert seen == {"omp": str(6 // 2), "nproc": 2}  # not 96 // 2 = 48
    assert "OMP_NUM_THREADS" not in os.environ  # restored


def test_bench_compressors_threads_bound_is_the_usable_cores(tmp_path, capsys, monkeypatch, cpus):
    import gradpress.bench.compressors as cmd

    forbid(monkeypatch, "the benchmark ran", (cmd, "run_benchmark"))
    cpus(2)
    rc = cli_main(["bench", "compressors", "--out", str(tmp_path), "--threads", "3"])
    err = capsys.readouterr().err
    assert rc == 2 and "--threads got 3; allowed: an integer >= 1 and <= 2 " in err, err


def test_bench_e2e_threads_bound_and_default_are_the_usable_cores(tmp_path, cpus):
    from gradpress.bench.e2e_args import _resolve

    def resolve(*extra: str) -> dict:
        return _resolve(build_parser().parse_args(["bench", "e2e", "--nodes", "2", "--out", str(tmp_path), *extra]))

    cpus(8)
    settings = resolve()
    assert settings["cpus"] == 8 and settings["threads"] == 8 // 2  # not 96 // 2
    assert resolve("--threads", "8")["threads"] == 8
    with pytest.raises(ValueError, match=r"--threads got 9; allowed: an integer >= 1 and <= 8 "):
        resolve("--threads", "9")


def test_bench_estimators_threads_bound_is_the_usable_cores(tmp_path, capsys, monkeypatch, cpus):
    """``bench estimators --threads`` had no upper bound (the other benchmarks refused more than the cores)."""
    import gradpress.bench.estimators as cmd

    forbid(monkeypatch, "the benchmark ran", (cmd, "run_estimators"))
    cpus(2)
    rc = cli_main(["bench", "estimators", "--threads", "3"])
    err = capsys.readouterr().err
    assert rc == 2 and "--threads got 3; allowed: an integer >= 1 and <= 2 (the cores this process may use)" in err, err


@pytest.mark.parametrize("argv, message", [
    (["--threads", "3"], "--threads got 3; allowed: an integer >= 1 and <= 2 (the cores this process may use)"),
    (["--threads", "0"], "--threads got 0; allowed: an integer >= 1"),
    (["--world", "0"], "--world got 0; allowed: an integer >= 1"),
    (["--repeats", "-1"], "--repeats got -1; allowed: an integer >= 1"),
    (["--compressors", "nope"], "unknown compressor 'nope'"),
    (["--params", "10Q"], "--params"),
])
def test_the_profile_script_refuses_bad_arguments_before_profiling(argv, message, capsys, monkeypatch, cpus):
    """``python -m gradpress.bench.e2e_profile`` took any int for --threads, --world and --repeats (0 threads
    crashed torch) and split --compressors its own way; now bench's parsers and checks, before any work."""
    from gradpress.bench import e2e_profile

    forbid(monkeypatch, "profiled", (e2e_profile, "profile"))
    cpus(2)
    with pytest.raises(SystemExit) as exit_info:
        e2e_profile.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
