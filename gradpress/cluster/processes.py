"""Running commands in the nodes of an emulated cluster: one process in one
node (``popen``/``exec``), or every rank of a ``torch.distributed`` job
(``run``), terminating the others when one fails, and reporting the failed
ranks' logs. :class:`ProcessesMixin` is part of
:class:`gradpress.cluster.netns.EmulatedCluster`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from gradpress.cluster.host import _kill_group
from gradpress.cluster.outcomes import ClusterError, RunResult

__all__ = ["ProcessesMixin"]


class ProcessesMixin:
    """Processes in the nodes of :class:`~gradpress.cluster.netns.EmulatedCluster`
    (killed at its teardown)."""

    def _require_up(self) -> None:
        if not self._up:
            raise ClusterError("the cluster is not up: use `with EmulatedCluster(...) as c:` or call start()")

    def popen(self, i: int, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen:
        """Start ``argv`` inside node ``i`` (``ip netns exec``) in its own process
        group; keyword arguments go to ``subprocess.Popen``. The process is
        killed at teardown if still running."""
        self._require_up()
        self._check_node(i)
        if isinstance(argv, (str, bytes)) or not argv:
            raise ValueError(f"argv={argv!r} is not allowed: expected a non-empty list of strings")
        kwargs.setdefault("start_new_session", True)
        p = subprocess.Popen([self._ip, "netns", "exec", self.namespace(i), *map(str, argv)], **kwargs)
        self._procs = [q for q in self._procs if q.poll() is None]
        self._procs.append(p)
        return p

    def exec(self, i: int, argv: Sequence[str], *, timeout: float | None = 60, check: bool = False,
             input: str | None = None, env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess:
        """Run ``argv`` in node ``i`` and wait; returns a ``CompletedProcess``
        with text ``stdout``/``stderr``. On timeout the process group is killed
        and ``subprocess.TimeoutExpired`` raised; with ``check`` a non-zero exit
        raises ``subprocess.CalledProcessError``."""
        p = self.popen(i, argv, stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                       env=None if env is None else {**os.environ, **env})
        try:
            out, err = p.communicate(input, timeout=timeout)
        except BaseException:
            _kill_group(p, signal.SIGKILL)
            p.communicate()
            raise
        done = subprocess.CompletedProcess(list(argv), p.returncode, out, err)
        if check:
            done.check_returncode()
        return done

    def rank_env(self, rank: int) -> dict[str, str]:
        """The ``torch.distributed`` environment of rank ``rank`` (in node
        ``rank // workers_per_node``, as torchrun numbers ranks)."""
        node = self.node_of(rank)
        per = self.workers_per_node
        dev = self.interface(node)
        return {
            "RANK": str(rank), "WORLD_SIZE": str(self.world),
            "LOCAL_RANK": str(rank % per), "LOCAL_WORLD_SIZE": str(per),
            "GROUP_RANK": str(node), "NODE_RANK": str(node),
            "MASTER_ADDR": self.address(0), "MASTER_PORT": str(self.master_port),
            "GLOO_SOCKET_IFNAME": dev, "TP_SOCKET_IFNAME": dev,
        }

    def _ensure_log_dir(self) -> Path:
        if self.log_dir is None:
            if self._logs_arg is not None:
                self._logs_arg.mkdir(parents=True, exist_ok=True)
                self.log_dir = self._logs_arg
            else:
                self.log_dir = Path(tempfile.mkdtemp(prefix=f"{self.tag}-logs-"))
                self._own_log_dir = True
        return self.log_dir

    def run(self, command: Sequence[str], *, env: Mapping[str, str] | None = None, timeout: float | None = None,
            stream_rank0: bool = True, stdout: IO | None = None, kill_grace: float = 5.0) -> RunResult:
        """Run every rank of ``command``, rank ``r`` in node ``r // workers_per_node``, with
        ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
        ``MASTER_ADDR``, ``MASTER_PORT``, ``GLOO_SOCKET_IFNAME`` set (see
        :meth:`rank_env`) on top of the current environment and ``env``.

        Rank 0 writes to this process's stdout/stderr (or ``stdout``) when
        ``stream_rank0``; the other ranks (and rank 0 otherwise) write to
        ``<log_dir>/rank<i>.log``. When a rank fails, the others are
        terminated (SIGTERM, SIGKILL after ``kill_grace`` s), like torchrun;
        after ``timeout`` seconds all are. The tails of failed ranks' logs are
        printed to stderr and the log directory is kept."""
        self._require_up()
        if isinstance(command, (str, bytes)) or not command:
            raise ValueError(f"command={command!r} is not allowed: expected a non-empty list of strings")
        log_dir = self._ensure_log_dir()
        procs: list[subprocess.Popen] = []
        files: list[IO] = []
        result = RunResult(codes=[], log_dir=log_dir)
        t0 = time.monotonic()
        try:
            for rank in range(self.world):
                rank_env = {**os.environ, **(env or {}), **self.rank_env(rank)}
                if rank == 0 and stream_rank0:
                    out = stdout
                else:
                    f = open(log_dir / f"rank{rank}.log", "wb")  # noqa: SIM115
                    files.append(f)
                    out = f
                procs.append(self.popen(self.node_of(rank), command, env=rank_env, stdin=subprocess.DEVNULL, stdout=out,
                                        stderr=subprocess.STDOUT if out is not None else None))
            failed_at: float | None = None
            while [p.poll() for p in procs].count(None):
                now = time.monotonic()
                if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
                    failed_at = now
                    for r, p in enumerate(procs):
                        if p.poll() is None:
                            result.killed.add(r)
                            _kill_group(p, signal.SIGTERM)
                if timeout is not None and now - t0 > timeout and not result.timed_out:
                    result.timed_out = True
                    failed_at = now
                    for r, p in enumerate(procs):
                        if p.poll() is None:
                            result.killed.add(r)
                            _kill_group(p, signal.SIGTERM)
                if failed_at is not None and now - failed_at > kill_grace:
                    for p in procs:
                        if p.poll() is None:
                            _kill_group(p, signal.SIGKILL)
                time.sleep(0.02)
        except BaseException:
            for p in procs:
                _kill_group(p, signal.SIGKILL)
            for p in procs:
                p.wait()
            raise
        finally:
            for f in files:
                f.close()
        result.codes = [p.returncode for p in procs]
        result.seconds = time.monotonic() - t0
        if not result.ok:
            self._keep_logs = True
            self._report_failure(result, stream_rank0)
        return result

    def _report_failure(self, result: RunResult, stream_rank0: bool, tail: int = 30) -> None:
        what = "timed out" if result.timed_out else "failed"
        print(f"gradpress cluster: run {what}; exit codes by rank: {result.codes} (logs in {result.log_dir})",
              file=sys.stderr)
        for r, code in enumerate(result.codes):
            if code == 0 or r in result.killed or (r == 0 and stream_rank0):
                continue
            path = result.log(r)
            if path is None:
                continue
            lines = path.read_text(errors="replace").splitlines()[-tail:]
            print(f"---- rank {r} (exit {code}), last {len(lines)} lines of {path} ----", file=sys.stderr)
            for line in lines:
                print(f"  {line}", file=sys.stderr)
