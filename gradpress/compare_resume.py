"""``gradpress compare --resume``: continue an interrupted grid (Ctrl-C, a
crash, a killed job) instead of starting every run afresh.

Per run (the comparison's and the ``--lr-sweep``'s alike), by what its
directory holds:

* a ``summary.json`` (a finished run) whose recorded ``settings``
  (:func:`gradpress.train.config.settings`: every option but where it
  writes, what it prints and how long it waits) equal the run's planned ones,
  compressor and strategy specs in canonical form: read back, not rerun;
* no summary but a ``checkpoint.pt`` whose ``settings`` equal them: resumed
  from it (``gradpress train --resume``: exact, so the figures are an
  uninterrupted run's);
* neither: run.

A run that trains (afresh, or without ``--resume``) first loses any
``summary.json`` an earlier compare left in its directory, so a failure or
an interruption never leaves another run's summary there for a later
``--resume`` to take for this one's.

A summary or checkpoint of other settings (or one written before runs
recorded their settings, which cannot be checked) is an error naming the
directory and every differing setting, raised before anything trains (a
comparison run's lr under ``--lr-sweep``: right after the sweep chose it,
before any comparison run trains):
``--resume`` continues the same grid and never overwrites another one's
results; remove that directory (or give another ``--out``) to rerun it.

Every run's summary, read back or trained now, enters the compare as
summary.json holds it (:func:`as_written`): strict JSON, a non-finite number
``null``, except where it can only be a number (an evaluation always has
one): a history entry's ``metric`` and ``loss``, and ``final_metric``,
``final_loss`` and ``test_accuracy`` of a run that evaluated, which are NaN.
So a grid continued with ``--resume`` writes what an uninterrupted one writes.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gradpress import train
from gradpress.train import checkpoint, report
from gradpress.train.config import TrainConfig, settings

__all__ = ["REUSE", "RESUME", "RUN", "status", "Tally", "as_written"]

REUSE, RESUME, RUN = "reuse", "resume", "run"


def _differing(where: str, recorded: Mapping[str, Any], cfg: TrainConfig, ignore: tuple[str, ...]) -> list[str]:
    mine = settings(cfg)
    return [f"{k}: {where} has {recorded.get(k)!r}, this compare has {mine.get(k)!r}"
            for k in sorted(set(mine) | set(recorded))
            if k not in ignore and not checkpoint.same_setting(k, recorded.get(k), mine.get(k))]


def _check(recorded: Any, where: str, cfg: TrainConfig, ignore: tuple[str, ...]) -> None:
    if not isinstance(recorded, Mapping):
        raise ValueError(f"resume: {where} records no settings (written before runs recorded them), so compare "
                         f"cannot tell whether it ran this configuration; remove {str(Path(cfg.out))!r} to rerun it")
    diffs = _differing(where, recorded, cfg, ignore)
    if diffs:
        raise ValueError(f"resume: {where} is a run of a different configuration ({'; '.join(diffs)}); compare "
                         f"--resume continues the same grid: remove {str(Path(cfg.out))!r} to rerun it, or give "
                         "another --out")


def as_written(summary: Mapping[str, Any], read: bool = False) -> dict[str, Any]:
    """``summary`` as summary.json holds it, ``null`` back to NaN where only a number can stand (module doc);
    ``read``: it was read from summary.json already."""
    summary = dict(summary) if read else json.loads(report.dumps(summary))
    nan = math.nan
    summary["history"] = [dict(h, metric=nan if h.get("metric") is None else h["metric"],
                               loss=nan if h.get("loss") is None else h["loss"]) for h in summary.get("history", [])]
    if summary["history"]:
        for key in ("final_metric", "final_loss", "test_accuracy"):
            if key in summary and summary[key] is None:
                summary[key] = nan
    return summary


def status(cfg: TrainConfig, ignore: tuple[str, ...] = ()) -> tuple[str, dict[str, Any] | None]:
    """What ``--resume`` does with the run ``cfg`` (module doc): ``(REUSE, summary)``, ``(RESUME, None)`` or
    ``(RUN, None)``; ValueError for a directory of other settings (``ignore``: settings not compared, such as
    an lr a sweep has yet to choose)."""
    out = Path(cfg.out)
    path = out / report.SUMMARY
    if path.is_file():
        try:
            summary = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"resume: {str(path)!r} is not a readable summary ({exc}); remove {str(out)!r} to "
                             "rerun it") from None
        if not isinstance(summary, dict):
            raise ValueError(f"resume: {str(path)!r} is not a training summary; remove {str(out)!r} to rerun it")
        _check(summary.get("settings"), repr(str(path)), cfg, ignore)
        return REUSE, as_written(summary, read=True)
    ckpt = out / checkpoint.CHECKPOINT
    if ckpt.exists():
        state = checkpoint.load(ckpt)  # a damaged file: its one-line refusal, naming it
        _check(state.get("settings") if isinstance(state, Mapping) else None, repr(str(ckpt)), cfg, ignore)
        return RESUME, None
    return RUN, None


class Tally:
    """Runs a grid's runs through :meth:`train` (``resume``: by :func:`status`; else afresh) and counts what
    it did with them, for the ``reused N of M runs`` line."""

    def __init__(self, resume: bool) -> None:
        self.resume = resume
        self.counts = {REUSE: 0, RESUME: 0, RUN: 0}

    def check(self, configs: list[TrainConfig], ignore: tuple[str, ...] = ()) -> dict[str, int]:
        """Every run's :func:`status` before anything trains (its errors raised now); the counts."""
        counts = {REUSE: 0, RESUME: 0, RUN: 0}
        for cfg in configs:
            counts[status(cfg, ignore)[0] if self.resume else RUN] += 1
        return counts

    def train(self, cfg: TrainConfig) -> dict[str, Any]:
        """The run's summary: read back, resumed or trained."""
        what, summary = status(cfg) if self.resume else (RUN, None)
        self.counts[what] += 1
        if summary is not None:
            return summary
        # a run about to train has no finished summary: an earlier compare's would outlive a failure or an
        # interruption of this one and pass, to a later --resume, for this run's
        (Path(cfg.out) / report.SUMMARY).unlink(missing_ok=True)
        return as_written(train.run(train.make_config(cfg, resume=True) if what == RESUME else cfg))

    @staticmethod
    def line(counts: Mapping[str, int], what: str = "runs") -> str:
        total = sum(counts.values())
        return (f"gradpress compare: resume: reused {counts[REUSE]} of {total} {what} (finished), resuming "
                f"{counts[RESUME]} from their checkpoints, running {counts[RUN]}")

    @staticmethod
    def log(counts: Mapping[str, int], what: str = "runs") -> None:
        print(Tally.line(counts, what), file=sys.stderr, flush=True)
