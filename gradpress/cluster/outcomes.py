"""What the emulated cluster reports with: its errors, the answer of the
support check, and the outcome (exit codes) of a run.
"""

from __future__ import annotations

import signal
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["ClusterError", "ClusterInterrupted", "RunResult", "Support", "worst_exit_code"]


class ClusterError(RuntimeError):
    """The emulated cluster cannot be built, used or removed."""


class ClusterInterrupted(KeyboardInterrupt):
    """Raised in the main thread when SIGTERM/SIGHUP arrives while a cluster is up
    (SIGINT raises the usual ``KeyboardInterrupt``)."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"received {signal.Signals(signum).name}")
        self.signum = signum


@dataclass(frozen=True)
class Support:
    """Whether this machine can host an emulated cluster, and why not."""

    ok: bool
    is_root: bool
    reasons: tuple[str, ...] = ()

    def __str__(self) -> str:
        if self.ok:
            return "emulated cluster supported (root, iproute2, netns, bridge, veth, tbf)"
        return "emulated cluster not supported: " + "; ".join(self.reasons)


@dataclass
class RunResult:
    """Outcome of :meth:`EmulatedCluster.run`; also a list of exit codes (``codes``)."""

    codes: list[int]
    killed: set[int] = field(default_factory=set)   # ranks the cluster terminated after another rank failed
    timed_out: bool = False
    log_dir: Path | None = None
    seconds: float = 0.0

    @property
    def exit_code(self) -> int:
        """The worst exit code, as a shell would report it (see :func:`worst_exit_code`)."""
        if self.timed_out:
            return 124
        return worst_exit_code(self.codes, ignore=self.killed)

    @property
    def ok(self) -> bool:
        return not self.timed_out and all(c == 0 for c in self.codes)

    def log(self, rank: int) -> Path | None:
        """Path of a rank's log file (None for a rank whose output was streamed)."""
        if self.log_dir is None:
            return None
        p = self.log_dir / f"rank{rank}.log"
        return p if p.exists() else None


def _shell_code(code: int) -> int:
    return 128 - code if code < 0 else code


def worst_exit_code(codes: Sequence[int], ignore: Sequence[int] | set[int] = ()) -> int:
    """0 if every rank succeeded; else the largest exit code (a death by signal
    ``s`` counts as ``128 + s``) among ranks not in ``ignore`` (ranks the
    cluster itself terminated because another one failed)."""
    bad = [_shell_code(c) for r, c in enumerate(codes) if c != 0 and r not in set(ignore)]
    if not bad:
        bad = [_shell_code(c) for c in codes if c != 0]
    return max(bad) if bad else 0
