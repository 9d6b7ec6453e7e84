"""Written for the ``plots`` group of ``make mutants`` (gradpress/cluster/processes.py): the processes of an
emulated cluster, without namespaces or root, one process, a few seconds.

The cluster is never started: it is marked up by hand and its ``ip`` is a stand-in script that checks it was
asked for ``netns exec NAME``, exports the namespace name as ``GP_NS`` and runs the command on this host. So
``popen``, ``exec`` and ``run`` start real processes (``sh``, this Python) and the test reads what each saw:
its node's namespace, its rank's environment (by torchrun's numbering: node ``rank // workers_per_node``),
its own process group, its stdin; which rank writes where, who is terminated (SIGTERM, SIGKILL after the
grace) when a rank fails or the run times out, and the failure report's lines. Only the namespaces themselves
(``ip netns exec`` entering one, the links between them) need root; they are test_cluster.py's.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from gradpress.cluster import processes as processes_mod
from gradpress.cluster.netns import EmulatedCluster
from gradpress.cluster.outcomes import ClusterError

pytestmark = [pytest.mark.mutants, pytest.mark.timeout(60)]  # a mutant that never stops a process: 60 s, not 900

FAKE_IP = '#!/bin/sh\n[ "$1 $2" = "netns exec" ] || { echo "not netns exec: $*" >&2; exit 97; }\n' \
          'GP_NS=$3; export GP_NS; shift 3; exec "$@"\n'
#: a rank's report: its namespace and environment, one line
SHOW = 'echo "$GP_NS $RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $NODE_RANK $GP_X $GP_PARENT"'


@pytest.fixture
def cluster(tmp_path):
    """Clusters marked up, running their commands through the stand-in ``ip``; every process killed after."""
    ip = tmp_path / "ip"
    ip.write_text(FAKE_IP)
    ip.chmod(0o755)
    made: list[EmulatedCluster] = []

    def make(nodes: int = 2, **kwargs) -> EmulatedCluster:
        c = EmulatedCluster(nodes, "100mbit", prefix="gpplots", **kwargs)
        c._ip, c._up = str(ip), True
        made.append(c)
        return c

    yield make
    for c in made:
        for p in c._procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        c._up = False
        if c._own_log_dir and c.log_dir is not None:
            shutil.rmtree(c.log_dir, ignore_errors=True)


def test_nothing_starts_before_the_cluster_is_up(cluster):
    c = cluster()
    c._up = False
    with pytest.raises(ClusterError, match=r"the cluster is not up: use `with EmulatedCluster\(...\) as c:`"):
        c.popen(0, ["true"])
    with pytest.raises(ClusterError, match="not up"):
        c.exec(0, ["true"])
    with pytest.raises(ClusterError, match="not up"):
        c.run(["true"])
    assert c._procs == [] and c.log_dir is None


@pytest.mark.parametrize("argv", ["true", b"true", [], ()])
def test_an_argv_that_is_not_a_non_empty_list_is_refused(cluster, argv):
    c = cluster()
    with pytest.raises(ValueError, match=re.escape(f"argv={argv!r} is not allowed: expected a non-empty list")):
        c.popen(0, argv)
    with pytest.raises(ValueError, match=re.escape(f"command={argv!r} is not allowed: expected a non-empty list")):
        c.run(argv)
    assert c._procs == []


def test_popen_runs_in_the_nodes_namespace_in_its_own_session(cluster):
    c = cluster(3)
    with pytest.raises(ValueError, match="node=3 is not allowed"):
        c.popen(3, ["true"])
    code = "import os, sys; print(os.environ['GP_NS'], os.getpgrp() == os.getpid(), sys.argv[1:])"
    p = c.popen(2, (sys.executable, "-c", code, 7, Path("x")), stdout=subprocess.PIPE, text=True)
    assert p.communicate()[0].split(None, 2) == [c.namespace(2), "True", "['7', 'x']\n"]
    p = c.popen(1, [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=False)
    assert p.communicate()[0].split(None, 2)[:2] == [c.namespace(1), "False"]  # the caller's choice is kept


def test_popen_keeps_the_processes_still_running(cluster):
    c = cluster()
    done = c.popen(0, ["true"])
    done.wait()
    running = c.popen(1, ["sleep", "30"])
    third = c.popen(0, ["sleep", "30"])
    assert c._procs == [running, third]  # the finished one is forgotten, the running ones kept for teardown


def test_exec_waits_and_returns_text_output_with_the_merged_environment(cluster, monkeypatch):
    c = cluster()
    monkeypatch.setenv("GP_PARENT", "parent")
    monkeypatch.setenv("GP_X", "parent-x")
    show = 'echo "$GP_NS $GP_X $GP_PARENT"; echo err >&2; readlink /proc/self/fd/0; exit 3'
    done = c.exec(1, ("sh", "-c", show), env={"GP_X": "mine"})
    assert isinstance(done, subprocess.CompletedProcess) and done.args == ["sh", "-c", show]
    assert done.returncode == 3 and done.stderr == "err\n"
    first, stdin = done.stdout.splitlines()
    assert first == f"{c.namespace(1)} mine parent" and stdin == "/dev/null"
    done = c.exec(0, ["sh", "-c", 'echo "$GP_X"; cat'], input="fed\n")
    assert done.stdout == "parent-x\nfed\n" and done.returncode == 0
    with pytest.raises(subprocess.CalledProcessError) as e:
        c.exec(0, ["sh", "-c", "exit 4"], check=True)
    assert e.value.returncode == 4
    assert c.exec(0, ["true"], check=True).returncode == 0


def test_exec_timeout_kills_the_whole_process_group(cluster, tmp_path):
    c = cluster()
    pid_file = tmp_path / "child"
    script = f"trap '' TERM; sleep 20 & echo $! > {pid_file}; wait"  # deaf to SIGTERM: only SIGKILL ends it
    t0 = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        c.exec(0, ["sh", "-c", script], timeout=2.0)  # the shell has set its trap by then, even on a busy machine
    assert time.monotonic() - t0 < 10
    child = int(pid_file.read_text())
    for _ in range(200):
        if not _alive(child):
            break
        time.sleep(0.01)
    assert not _alive(child)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] if Path(f"/proc/{pid}").exists() else "X"
    return state not in ("Z", "X")


def test_rank_env_numbers_ranks_node_by_node():
    c = EmulatedCluster(3, "100mbit", workers_per_node=2, master_port=29611, subnet="10.9.8", prefix="gpplots")
    for rank in range(6):
        node = rank // 2
        assert c.rank_env(rank) == {
            "RANK": str(rank), "WORLD_SIZE": "6", "LOCAL_RANK": str(rank % 2), "LOCAL_WORLD_SIZE": "2",
            "GROUP_RANK": str(node), "NODE_RANK": str(node), "MASTER_ADDR": "10.9.8.1", "MASTER_PORT": "29611",
            "GLOO_SOCKET_IFNAME": "eth0", "TP_SOCKET_IFNAME": "eth0"}


def test_the_log_directory_is_the_one_asked_for_or_a_fresh_one(cluster, tmp_path):
    asked = tmp_path / "a" / "b"
    c = cluster(logs=asked)
    assert c._ensure_log_dir() == asked and asked.is_dir() and not c._own_log_dir
    assert c._ensure_log_dir() == asked
    c = cluster()
    made = c._ensure_log_dir()
    assert made.is_dir() and made.parent == Path(tempfile.gettempdir()) and made.name.startswith(f"{c.tag}-logs-")
    assert c._own_log_dir and c._ensure_log_dir() == made


def test_run_starts_every_rank_in_its_node_with_its_environment(cluster, tmp_path, monkeypatch):
    c = cluster(2, workers_per_node=2, logs=tmp_path / "logs")
    monkeypatch.setenv("GP_PARENT", "parent")
    monkeypatch.setenv("GP_X", "parent-x")
    rank0 = (tmp_path / "rank0.out").open("w")
    t0 = time.monotonic()
    result = c.run(["sh", "-c", SHOW + "; echo to-stderr >&2"], env={"GP_X": "x", "RANK": "99"}, stdout=rank0)
    wall = time.monotonic() - t0
    rank0.close()
    assert result.ok and result.codes == [0] * 4 and result.killed == set() and not result.timed_out
    assert 0 < result.seconds <= wall and result.log_dir == tmp_path / "logs" and not c._keep_logs
    want = [f"{c.namespace(r // 2)} {r} 4 {r % 2} 2 {r // 2} x parent" for r in range(4)]
    assert (tmp_path / "rank0.out").read_text() == f"{want[0]}\nto-stderr\n"
    assert result.log(0) is None
    for r in (1, 2, 3):
        assert result.log(r).read_text() == f"{want[r]}\nto-stderr\n"
    result = c.run(["sh", "-c", SHOW], stream_rank0=False)
    assert result.log(0).read_text() == f"{c.namespace(0)} 0 4 0 2 0 parent-x parent\n"


def test_a_failed_rank_stops_the_others_and_its_log_tail_is_reported(cluster, tmp_path, capsys):
    c = cluster(3, logs=tmp_path)
    fail = 'if [ "$RANK" = 1 ]; then seq 40; echo boom >&2; exit 3; fi; sleep 20'
    t0 = time.monotonic()
    result = c.run(["sh", "-c", fail])
    assert time.monotonic() - t0 < 10
    assert result.codes == [-signal.SIGTERM, 3, -signal.SIGTERM] and result.killed == {0, 2}
    assert not result.timed_out and result.exit_code == 3 and c._keep_logs
    err = capsys.readouterr().err.splitlines()
    assert err[0] == f"gradpress cluster: run failed; exit codes by rank: {result.codes} (logs in {tmp_path})"
    assert err[1] == f"---- rank 1 (exit 3), last 30 lines of {tmp_path / 'rank1.log'} ----"
    assert err[2:] == [f"  {i}" for i in range(12, 41)] + ["  boom"]


def test_a_failed_rank_0_is_reported_only_when_it_wrote_to_its_log(cluster, tmp_path, capsys):
    """Rank 0 fails, rank 1 is terminated (not reported): rank 0's log tail is printed when it wrote to its
    log, and not when it streamed, although a rank0.log of the run before is still there."""
    c = cluster(2, logs=tmp_path)
    zero_fails = 'if [ "$RANK" = 0 ]; then echo zero; exit 5; fi; sleep 20'
    result = c.run(["sh", "-c", zero_fails], stream_rank0=False)
    assert result.codes == [5, -signal.SIGTERM] and result.killed == {1}
    assert capsys.readouterr().err.splitlines()[1:] == [
        f"---- rank 0 (exit 5), last 1 lines of {tmp_path / 'rank0.log'} ----", "  zero"]
    result = c.run(["sh", "-c", zero_fails], stdout=subprocess.DEVNULL)
    assert result.codes == [5, -signal.SIGTERM] and result.log(0) == tmp_path / "rank0.log"
    assert len(capsys.readouterr().err.splitlines()) == 1


def _deaf_but(failing: int, world: int, ready: Path) -> str:
    """Every rank but ``failing`` ignores SIGTERM and says so (a file);
    ``failing`` exits 1 once all of them have: no race with a slow shell."""
    others = " ".join(str(r) for r in range(world) if r != failing)
    return (f"if [ \"$RANK\" = {failing} ]; then for r in {others}; do while [ ! -f {ready}/$r ]; do sleep 0.02; "
            f"done; done; exit 1; fi; trap '' TERM; touch {ready}/$RANK; sleep 20")


def test_ranks_deaf_to_sigterm_are_killed_after_the_grace(cluster, tmp_path):
    c = cluster(3)
    deaf = _deaf_but(2, 3, tmp_path)
    t0 = time.monotonic()
    result = c.run(["sh", "-c", deaf], kill_grace=0.3)
    assert time.monotonic() - t0 < 10
    assert result.codes == [-signal.SIGKILL, -signal.SIGKILL, 1] and result.killed == {0, 1}


def test_a_run_past_its_timeout_is_stopped_and_says_so(cluster, capsys):
    c = cluster(2)
    t0 = time.monotonic()
    result = c.run(["sleep", "20"], timeout=0.3)
    assert time.monotonic() - t0 < 10
    assert result.timed_out and result.codes == [-signal.SIGTERM] * 2 and result.killed == {0, 1}
    assert result.exit_code == 124 and not result.ok and c._keep_logs
    assert capsys.readouterr().err.startswith("gradpress cluster: run timed out; exit codes by rank: [-15, -15]")


def test_an_interrupted_run_kills_every_rank(cluster, monkeypatch):
    c = cluster(2)

    def interrupted(s):
        raise KeyboardInterrupt

    monkeypatch.setattr(processes_mod, "time", SimpleNamespace(monotonic=time.monotonic, sleep=interrupted))
    with pytest.raises(KeyboardInterrupt):
        c.run(["sh", "-c", "trap '' TERM; sleep 20"])
    assert [p.returncode for p in c._procs] == [-signal.SIGKILL] * 2


def test_the_default_grace_is_the_documented_5_s(cluster, monkeypatch, tmp_path):
    """docs/cluster.md: the others are terminated, "SIGKILL after 5 s". On a scripted clock (each poll of the
    loop 0.25 s later) the first SIGKILL goes out one poll past 5 s after the SIGTERM, not at 6."""
    c = cluster(2)
    clock = [0.0]
    real_sleep, real_kill = time.sleep, processes_mod._kill_group

    def sleep(s):
        real_sleep(0.005)
        clock[0] += 0.25

    sent: list[tuple[int, float]] = []

    def kill(p, sig):
        sent.append((sig, clock[0]))
        real_kill(p, sig)

    monkeypatch.setattr(processes_mod, "time", SimpleNamespace(monotonic=lambda: clock[0], sleep=sleep))
    monkeypatch.setattr(processes_mod, "_kill_group", kill)
    deaf = _deaf_but(1, 2, tmp_path)
    result = c.run(["sh", "-c", deaf])
    assert result.codes == [-signal.SIGKILL, 1] and result.killed == {0}
    (term, at), (first_kill, then) = sent[0], sent[1]
    assert (term, first_kill) == (signal.SIGTERM, signal.SIGKILL) and then - at == 5.25
