"""The driver of ``gradpress compare`` (:func:`gradpress.compare.run`):
optional learning-rate sweep, every configuration at every seed, the
output files. See :mod:`gradpress.compare` for the outputs and the target,
:mod:`gradpress.compare_stats` for the statistics and the lr rule.

A run that fails (a worker failed: :class:`~gradpress.train.launch.WorkerFailed`,
``gradpress train`` exit 1; or a ``ValueError`` from its workers, exit 2)
does not stop the compare: it is recorded (:func:`failure`) and the others
go on; after every run and every output file :func:`run` raises
:class:`RunsFailed` naming the failed runs. Ctrl-C stops at once, keeping
what was recorded in ``compare-partial.json``; ``resume`` continues such a
grid (:mod:`gradpress.compare_resume`)."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from gradpress import compare, compare_report, compare_stats, train, workloads
from gradpress.compare_resume import Tally
from gradpress.compress import plugins
from gradpress.train.config import check_out, load_toml, planned_world
from gradpress.train.launch import WorkerFailed, check_data

__all__ = ["run", "sweep", "OUTPUTS", "RunsFailed", "failure", "DEFAULT_OUT"]

#: the files a compare writes in its directory (``compare-partial.json``: the runs recorded before Ctrl-C)
OUTPUTS = ("compare.json", "compare-stats.json", "compare.md", "compare.png", "sweep.json", "compare-partial.json")
#: where a compare writes when neither ``out`` nor the ``--config`` file names a directory
DEFAULT_OUT = "runs/compare"


class RunsFailed(WorkerFailed):
    """Raised by :func:`run` after every run and every output file when some
    runs failed. ``result``: the finished runs, annotated (what :func:`run`
    returns otherwise); ``failed``: the :func:`failure` records, in run order."""

    def __init__(self, result: list[dict[str, Any]], failed: list[dict[str, Any]], total: int) -> None:
        self.result, self.failed = result, failed
        super().__init__(f"{len(failed)} of {total} runs failed: "
                         + "; ".join(f"{f['label']}: {f['error']}" for f in failed))


def failure(cfg: Any, seed: int, out: str, exc: BaseException, sweep: bool = False) -> dict[str, Any]:
    """The record of a failed run: ``status`` ``failed``, what it ran, its
    ``error`` and the ``exit_code`` ``gradpress train`` exits with for it
    (1: a worker failed; 2: a ValueError). ``label`` names it in messages;
    ``plugins`` the plugin modules of the compare (:func:`gradpress.compress.plugins.record`)."""
    name = compare.label(vars(cfg))
    return {"status": "failed", "algorithm": cfg.algorithm, "compressor": cfg.compressor, "seed": seed,
            "lr": cfg.lr, "out": out, "error": str(exc), "exit_code": 1 if isinstance(exc, WorkerFailed) else 2,
            "label": f"sweep {name} at lr {cfg.lr:g}, seed {seed}" if sweep else f"{name}, seed {seed}",
            "plugins": plugins.record()}


def _config_file(opts: Mapping[str, Any], out: str | None) -> str:
    """Where the compare writes: ``out``, else the ``--config`` file's
    ``out``, else :data:`DEFAULT_OUT`. The file may not set ``resume``
    (compare's own ``--resume`` continues a grid, run by run); nor ``algorithm``
    or ``compressor``: compare sets them per run."""
    path = opts.get("config")
    given = load_toml(str(path)) if path else {}
    for key in ("algorithm", "compressor"):  # compare sets them per run: the file's would be ignored
        if key in given:
            raise ValueError(f"{key}: not a compare option (config file {str(path)!r} sets {key} = {given[key]!r}); "
                             f"compare sets it per run from --compressors and --algorithms: remove it from the file")
    if given.get("resume", False) is not False:
        raise ValueError(f"resume: not a compare option (config file {str(path)!r} sets resume = "
                         f"{str(given['resume']).lower()}); to continue an interrupted compare give compare's own --resume: "
                         "remove it from the file")
    if given.get("reshard", False) is not False:
        raise ValueError(f"reshard: not a compare option (config file {str(path)!r} sets reshard = "
                         f"{str(given['reshard']).lower()}); every run of a compare uses its --nproc: remove it from the file")
    if out is None:
        out = given.get("out", DEFAULT_OUT)
        if not isinstance(out, (str, os.PathLike)) or not str(out):
            raise ValueError(f"out must be a directory path, got {out!r} (in config file {str(path)!r})")
    return str(out)


def _sweep_config(cfg: Any, lr: float, seed: int, steps: int | None, root: Path) -> Any:
    over: dict[str, Any] = {"lr": lr, "seed": seed, "out": str(root / "sweep" / f"{Path(cfg.out).name}-lr{lr:g}-s{seed}")}
    if steps is not None:
        over["steps"] = steps
    return train.make_config(cfg, **over)


def _clear_outputs(root: Path) -> None:
    """Remove the files an earlier compare wrote in ``root`` (:data:`OUTPUTS`)."""
    for name in OUTPUTS:
        (root / name).unlink(missing_ok=True)


def _check_swept_rates(tally: Tally, planned: list[Any]) -> None:
    """``--resume --lr-sweep``: the comparison's runs at the rates the sweep chose, checked (all their other
    settings were checked before the sweep). A directory of an earlier compare whose sweep chose another rate
    (one of its sweep runs had failed, say) is refused, naming it and both lrs, rather than recorded as a
    failed run once the comparison has begun to train."""
    try:
        tally.check(planned)
    except ValueError as exc:
        raise ValueError(f"lr-sweep: the sweep chose another rate than the earlier compare in this --out ran at "
                         f"(one of its sweep runs may have failed): {exc}") from None


def sweep(configs: list[Any], rates: list[float], steps: int | None, seeds: list[int],
          root: Path, failed: list[dict[str, Any]] | None = None, tally: Tally | None = None) -> dict[str, Any]:
    """Train every config at every rate (``steps`` steps, or its own budget
    if None) and every sweep seed; pick each config's rate by
    :data:`compare_stats.BEST_LR_RULE`. Returns the JSON-able record. A run
    that fails counts as no metric (as a diverged one) and its
    :func:`failure` record is appended to ``failed``. ``tally``: runs them
    (``--resume``: a finished sweep run read back; default: afresh)."""
    tally = tally or Tally(False)
    methods = []
    higher = True  # set by the first finished run; with none, every score is missing and the direction moot
    for i, cfg in enumerate(configs):
        scores: dict[float, list[float | None]] = {}
        runs = []
        for lr in rates:
            for seed in seeds:
                run_cfg = _sweep_config(cfg, lr, seed, steps, root)
                try:
                    s = tally.train(run_cfg)
                except (WorkerFailed, ValueError) as exc:
                    record = failure(run_cfg, seed, run_cfg.out, exc, sweep=True)
                    if failed is not None:
                        failed.append(record)
                    scores.setdefault(lr, []).append(None)
                    runs.append({"lr": lr, "seed": seed, "final_metric": None, "final_loss": None,
                                 "status": "failed", "error": record["error"], "exit_code": record["exit_code"]})
                    continue
                fm = compare.final(s)  # a diverged run's last finite evaluation counts as no metric
                scores.setdefault(lr, []).append(fm)
                runs.append({"lr": lr, "seed": seed, "final_metric": fm, "final_loss": s.get("final_loss")})
                higher = s["higher_is_better"]
        best = compare_stats.best_lr(scores, higher)
        methods.append({"algorithm": cfg.algorithm, "compressor": cfg.compressor, "label": compare.label(vars(cfg)),
                        "best_lr": best, "runs": runs,
                        "mean_final_metric": {f"{lr:g}": compare_stats.stat(v)["mean"] for lr, v in scores.items()}})
        configs[i] = train.make_config(cfg, lr=best)
    return {"rule": compare_stats.BEST_LR_RULE, "rates": rates, "steps": steps, "seeds": seeds, "methods": methods}


def run(compressors: str | Iterable[str] | None, options: Mapping[str, Any] | None = None, *,
        out: str | None = None, target: float | None = None,
        algorithms: str | Iterable[str] | None = None, seeds: str | int | list[int] | None = None,
        lr_sweep: str | list[float] | None = None, sweep_steps: int | None = None, resume: bool = False,
        rank_by: str = "bytes") -> list[dict[str, Any]]:
    """Train ``options`` (training options, as for :func:`gradpress.train.run`)
    once per (algorithm, compressor) pair and seed; write the output files;
    return the annotated per-run summaries. ``out`` None: the ``out`` of
    the ``config`` file in ``options``, else :data:`DEFAULT_OUT` (the file
    may not set ``resume``). ``compressors`` None: each
    algorithm's default; ``algorithms`` None: ``ddp``. ``seeds``: a count
    (seeds ``seed``, ``seed+1``, ...) or a list; None: the one ``seed``.
    ``lr_sweep``: rates or factors of the default lr (``"x0.3,x1,x3"``),
    tried on ``sweep_steps`` steps (default: a quarter of ``--steps``, or
    the full budget when only epochs are given) at the first seed; each
    method then runs at its own best rate. Runs that fail are recorded and
    the others go on; then :class:`RunsFailed` is raised (module doc).
    ``resume``: continue an interrupted compare in ``out`` (:mod:`gradpress.compare_resume`; its
    ``reused N of M runs`` line on stderr); ``rank_by``: ``bytes`` or ``time`` to target
    (:data:`compare_stats.RANK_RULES`)."""
    opts = dict(options or {})
    for key in ("algorithm", "compressor", "resume", "reshard"):
        if key in opts:
            raise ValueError(f"{key}: not a compare option (compare sets it per run)")
    out = _config_file(opts, out)
    check_out(out)  # the runs' directories are set below it after their own checks
    if not compressors and not algorithms:
        raise ValueError("compressors: give at least one compressor or algorithm spec, e.g. "
                         "--compressors none,fp16,topk:ratio=0.01 or --algorithms ddp,localsgd:period=8")
    if target is not None and (isinstance(target, bool) or not isinstance(target, (int, float))
                               or not math.isfinite(target)):
        raise ValueError(f"target must be a finite number, got {target!r}")
    if rank_by not in compare_stats.RANK_RULES:
        raise ValueError(f"rank-by must be one of {', '.join(compare_stats.RANK_RULES)}, got {rank_by!r}")
    if not isinstance(resume, bool):
        raise ValueError(f"resume must be true or false, got {resume!r}")
    if sweep_steps is not None and lr_sweep is None:
        raise ValueError("sweep-steps: only with --lr-sweep")
    if sweep_steps is not None and (isinstance(sweep_steps, bool) or not isinstance(sweep_steps, int)
                                    or sweep_steps < 1):
        raise ValueError(f"sweep-steps must be a positive integer, got {sweep_steps!r}")
    root = Path(out)
    configs = compare._plan_runs(compressors, algorithms, opts, root)  # validate everything before training
    accuracy = workloads.get(configs[0].workload).metric == "accuracy"
    if target is not None and not (target > 0 and (target <= 1 or not accuracy)):
        raise ValueError(f"target must be a metric value the runs can reach: > 0, and <= 1 for an accuracy "
                         f"(workload {configs[0].workload!r}), got {target!r}")
    seed_list = compare_stats.parse_seeds(seeds, configs[0].seed)
    multi = seed_list is not None
    seed_list = seed_list or [configs[0].seed]
    shared_lr = configs[0].lr
    rates = compare_stats.parse_lr_grid(lr_sweep, shared_lr)
    steps = sweep_steps if sweep_steps is not None else (max(1, configs[0].steps // 4) if configs[0].steps else None)
    for cfg in configs:
        if cfg.lr != shared_lr and rates is None:
            shared_lr = None  # e.g. an algorithm with its own default lr
    # a batch the data cannot fill: refused now (an option error), not by every run in turn
    check_data(configs[0], planned_world(configs[0].nproc) or 1)

    def planned(cfg: Any, seed: int) -> Any:
        return train.make_config(cfg, seed=seed, out=f"{cfg.out}-s{seed}") if multi else cfg

    tally = Tally(resume)
    if resume:  # every run directory checked before anything trains; the comparison's lr may await the sweep
        if rates is not None:
            Tally.log(tally.check([_sweep_config(c, lr, s, steps, root) for c in configs for lr in rates
                                   for s in seed_list[:1]]), "lr-sweep runs")
        Tally.log(tally.check([planned(c, s) for c in configs for s in seed_list],
                              ignore=("lr",) if rates is not None else ()))
    if not resume:  # a reused directory: no file of an earlier compare is left to pass for this one's
        _clear_outputs(root)
    record = None
    failed: list[dict[str, Any]] = []  # every failed run, the sweep's included
    total = 0
    if rates is not None:
        record = sweep(configs, rates, steps, seed_list[:1], root, failed, tally)
        total += len(configs) * len(rates)
        if resume:  # the rates are chosen: every comparison run's directory at them, before any of those trains
            _check_swept_rates(tally, [planned(c, s) for c in configs for s in seed_list])
    if resume:  # the earlier outputs (of this grid: checked) kept until nothing can refuse this compare
        _clear_outputs(root)
    if record is not None:
        root.mkdir(parents=True, exist_ok=True)
        (root / "sweep.json").write_text(json.dumps(record, indent=2) + "\n")
    rows: list[dict[str, Any]] = []  # the comparison's runs in order: summaries and failure records
    try:
        for cfg in configs:
            for seed in seed_list:
                run_cfg = planned(cfg, seed)
                try:
                    rows.append(dict(tally.train(run_cfg), status="finished"))
                except (WorkerFailed, ValueError) as exc:  # this run failed: record it, go on with the others
                    rows.append(failure(cfg, seed, run_cfg.out, exc))
                    failed.append(rows[-1])
    except BaseException:
        if rows:  # what was recorded is not lost
            root.mkdir(parents=True, exist_ok=True)
            (root / "compare-partial.json").write_text(json.dumps(rows, indent=2) + "\n")
        raise
    total += len(rows)
    finished = [r for r in rows if r["status"] == "finished"]
    result = compare.annotate(finished, target) if finished else []
    annotated = iter(result)
    rows = [next(annotated) if r["status"] == "finished" else r for r in rows]
    root.mkdir(parents=True, exist_ok=True)
    (root / "compare.json").write_text(json.dumps(rows, indent=2) + "\n")
    if result:
        agg = compare_report.aggregate(result, len(seed_list), rank_by)
        lr_note = compare_report.lr_note(result, record)
        (root / "compare-stats.json").write_text(json.dumps(
            {"seeds": seed_list, "target": result[0]["target"], "lr": lr_note, "sweep": record,
             "plugins": plugins.record(), "rank_by": rank_by, "rank_rule": compare_stats.RANK_RULES[rank_by][1],
             "aggregate": [{k: v for k, v in g.items() if k != "rows"} for g in agg], "failed": failed},
            indent=2) + "\n")
        (root / "compare.md").write_text(compare_report.markdown(result, agg, target, seed_list, multi, lr_note, record,
                                                                  rows=rows, failed=failed, plugins=plugins.record(),
                                                                  rank_by=rank_by))
        compare.plot(result, root / "compare.png")
    if failed:
        raise RunsFailed(result, failed, total)
    return result
