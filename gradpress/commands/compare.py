"""``gradpress compare``: train one workload with several algorithms and
compressors and compare accuracy, bytes on the wire and time; see
:mod:`gradpress.compare`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from gradpress import compare, compare_report, compare_run, train
from gradpress.train.launch import WorkerFailed


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "compare", help="train one workload with several compressors / algorithms; table + plot",
        description="Run `gradpress train` once per (algorithm, compressor) pair (same seed, data and workers), "
                    "print a table and write DIR/compare.json, DIR/compare.md and DIR/compare.png.",
    )
    p.add_argument("--compressors", action="append", default=None, metavar="SPECS",
                   help="comma-separated specs, e.g. none,fp16,topk:ratio=0.01 (';' also separates; repeatable); "
                        "default: each algorithm's own default compressor")
    p.add_argument("--algorithms", action="append", default=None, metavar="SPECS",
                   help="comma-separated algorithm specs, e.g. ddp,localsgd:period=8 (default ddp); every "
                        "algorithm runs with every compressor; see `gradpress algorithms`")
    p.add_argument("--target", type=float, default=None,
                   help="metric to reach (default: 95%% of the ddp/none run's final metric; 105%% for bits per char)")
    p.add_argument("--seeds", default=None, metavar="N|LIST",
                   help="run every configuration at N seeds (--seed, --seed+1, ...) or at a list (0,1,2); the "
                        "table gives mean ± std [min, max] over seeds, 95%% confidence intervals of the mean and a rank by "
                        "bytes to target (docs/train.md); per-seed rows in compare.json")
    p.add_argument("--lr-sweep", default=None, metavar="RATES",
                   help="learning rates (0.003,0.01,0.03) or factors of the default lr (x0.3,x1,x3): each method "
                        "runs at each on a short budget, then the comparison runs at each method's best rate "
                        "(best final metric, ties to the smaller lr); written to sweep.json")
    p.add_argument("--resume", action="store_true",
                   help="continue an interrupted compare in DIR: a run with a finished summary.json of the same "
                        "settings is read back, one with a checkpoint resumes from it, the rest run; a run directory "
                        "of other settings is an error naming them (docs/train.md)")
    p.add_argument("--rank-by", dest="rank_by", choices=("bytes", "time"), default="bytes",
                   help="with --seeds, rank configurations by bytes to target (default: exact) or by wall-clock "
                        "time to target (noisy on a shared machine)")
    p.add_argument("--sweep-steps", type=int, default=None, metavar="N",
                   help="steps per sweep run (default: a quarter of --steps; the full budget without --steps)")
    train.add_arguments(p, compare=True)
    p.set_defaults(func=run_cli)


def run_cli(args: argparse.Namespace) -> int:
    """Run, print the table; exit codes (docs/train.md, "Comparing compressors
    and algorithms"): 0 every run finished, 1 some run failed (all the others
    ran; each named), 2 bad options (before anything trains), 3 some run's loss
    became NaN/Inf (0 with ``--allow-divergence``), 130 interrupted (Ctrl-C)."""
    # --resume is compare's own (continue the grid), not train's, which compare sets per run
    opts = {k: v for k, v in vars(args).items() if (k in train.FIELDS or k == "config") and k != "resume"}
    out = opts.pop("out", None)
    failed: list[dict] = []
    try:
        result = compare.run(args.compressors, opts, out=out, target=args.target, algorithms=args.algorithms,
                             seeds=args.seeds, lr_sweep=args.lr_sweep, sweep_steps=args.sweep_steps,
                             resume=args.resume, rank_by=args.rank_by)
    except compare_run.RunsFailed as exc:
        result, failed = exc.result, exc.failed
        error = f"gradpress compare: error: {exc}"
    except WorkerFailed as exc:  # not a run of its own (kept for callers that raise it)
        print(f"gradpress compare: error: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:  # a training flag's bad value: named as the flag typed (--lr), not the field (lr)
        from gradpress.train.flags import name_flags

        message = name_flags(str(exc), {*opts, *(["out"] if out else [])})
        if message == str(exc):
            raise
        raise ValueError(message) from None
    except KeyboardInterrupt:
        partial = Path(out or _out(opts)) / "compare-partial.json"
        kept = f" (the runs recorded: {partial})" if partial.exists() else ""
        print(f"gradpress compare: interrupted; workers stopped{kept}", file=sys.stderr)
        return 130
    out = out or _out(opts)
    if result:
        _print(args, result, out)
    diverged = [r for r in result if r.get("diverged_at_step") is not None]
    total = len(result) + sum(1 for f in failed if not f["label"].startswith("sweep "))
    if diverged:
        allowed = all(r.get("allow_divergence") for r in diverged)
        word = "warning" if allowed else "error"
        names = ", ".join(f"{compare.label(r)}, seed {r.get('seed')} at step {r['diverged_at_step']}"
                          for r in diverged)
        print(f"gradpress compare: {word}: {len(diverged)} of {total} runs diverged (loss became non-finite): "
              f"{names}", file=sys.stderr)
    if failed:
        print(error, file=sys.stderr)
        return 1
    return 0 if not diverged or all(r.get("allow_divergence") for r in diverged) else 3


def _out(opts: dict) -> str:
    """The directory a compare wrote to when ``--out`` was not given."""
    try:
        return compare_run._config_file(opts, None)
    except ValueError:
        return compare_run.DEFAULT_OUT


def _print(args: argparse.Namespace, result: list[dict], out: str) -> None:
    stats = json.loads((Path(out) / "compare-stats.json").read_text())
    print()
    print(stats["lr"]["text"])
    if args.seeds is not None:
        groups = compare_report.aggregate(result, len(stats["seeds"]), args.rank_by)
        print(compare_report.aggregate_table(groups, result[0]["metric"], result[0]["reference"],
                                             stats["sweep"] is not None, args.rank_by))
        clipped = compare_report.clipped_note(groups, result[0]["metric"], result[0]["reference"])
        if clipped:
            print(clipped)
    else:
        rows = json.loads((Path(out) / "compare.json").read_text())  # failed runs included
        print(compare.table(rows))
    tgt = result[0]["target"]
    if tgt is not None:
        print(f"target {result[0]['metric']}: {tgt:.4f}")
    extra = f", {out}/sweep.json" if args.lr_sweep is not None else ""
    print(f"wrote {out}/compare.json, {out}/compare-stats.json{extra}, {out}/compare.md, {out}/compare.png")
