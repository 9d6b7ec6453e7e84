"""Written for survivors of the ``compare`` group of ``make mutants``
(gradpress/compare.py, compare_run.py, compare_report.py and the CLI
subcommands in gradpress/commands/): the ranking table a user reads is
checked against figures the test computes itself from known per-seed
results; no worker starts (``train.run`` is replaced by a stand-in)."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest

from gradpress import compare, compare_report
from gradpress.cli import main as cli

pytestmark = pytest.mark.mutants

#: the known per-seed results: final metric of (compressor, seed), bytes per step of each compressor
FINALS = {("none", 0): 0.80, ("none", 1): 0.90, ("none", 2): 0.70,
          ("topk:ratio=0.1", 0): 0.75, ("topk:ratio=0.1", 1): 0.95, ("topk:ratio=0.1", 2): 0.60}
BYTES = {"none": 1_234_567.0, "topk:ratio=0.1": 999.0}


def _summary(cfg, final=None, bytes_per_step=None):
    """What train.run returns for ``cfg``: one evaluation at step 10 (the final metric)."""
    final = FINALS[(cfg.compressor, cfg.seed)] if final is None else final
    nbytes = BYTES.get(cfg.compressor, 100.0) if bytes_per_step is None else bytes_per_step
    return {"compressor": cfg.compressor, "algorithm": cfg.algorithm, "final_metric": final, "final_loss": 1.0,
            "higher_is_better": True, "seed": cfg.seed, "median_step_s": 0.01, "bytes_per_step": nbytes,
            "history": [{"step": 10, "bytes_total": 10 * nbytes, "metric": final, "loss": 1.0}],
            "compression_ratio": BYTES["none"] / max(nbytes, 1.0), "lr": cfg.lr, "strategy": "allreduce",
            "workload": cfg.workload, "world_size": 1, "steps": cfg.steps, "batch_size": cfg.batch_size,
            "optimizer": cfg.optimizer, "schedule": cfg.schedule, "metric": "accuracy",
            "nothing_compressed": False, "diverged_at_step": None, "allow_divergence": False}


def _cfg(compressor, seed, algorithm="ddp"):
    return SimpleNamespace(compressor=compressor, algorithm=algorithm, seed=seed, lr=0.01, workload="digits-mlp",
                           steps=40, batch_size=16, optimizer="sgd", schedule="constant")


def _si_bytes(n: float) -> str:
    """The table's byte figure by its definition: powers of 1000, B without decimals, one decimal above."""
    units = ["B", "KB", "MB", "GB", "TB"]
    i = 0
    while abs(n) >= 1000 and i < len(units) - 1:
        n, i = n / 1000, i + 1
    return f"{n:.0f} B" if i == 0 else f"{n:.1f} {units[i]}"


def _cells(table: str, first: str) -> list[list[str]]:
    """The cells of the table's rows whose first cell is ``first``."""
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in table.splitlines()]
    return [r for r in rows if r[0] == first]


def _col(table: str, name: str) -> int:
    """The index of the column headed ``name`` (the aggregate table gained interval and rank columns)."""
    return [c.strip() for c in table.splitlines()[0].strip().strip("|").split("|")].index(name)


def test_a_summary_read_back_from_json_is_labelled_as_its_algorithm_says():
    # a ddp run read back from compare.json: its "ddp" is an equal string, not the literal object
    run = json.loads('{"algorithm": "ddp", "compressor": "none"}')
    assert compare.label(run) == "none"
    assert compare.label(json.loads('{"algorithm": "localsgd:period=4", "compressor": "none"}')) == (
        "localsgd:period=4/none")
    runs = [dict(_summary(_cfg("none", 0)), algorithm=json.loads('"ddp"')),
            dict(_summary(_cfg("topk:ratio=0.1", 0)), algorithm=json.loads('"ddp"'))]
    out = compare.annotate(runs, None)
    assert [r["reference"] for r in out] == ["none", "none"]
    assert [g["label"] for g in compare_report.aggregate(out)] == ["none", "topk:ratio=0.1"]


def test_each_seed_is_compared_with_the_reference_run_of_its_own_seed():
    runs = [_summary(_cfg(c, s)) for c in ("none", "topk:ratio=0.1") for s in (0, 1, 2)]
    runs.append(_summary(_cfg("topk:ratio=0.1", 3), final=0.5))  # the reference has no seed 3: its mean
    out = compare.annotate(runs, None)
    ref_mean = math.fsum(FINALS[("none", s)] for s in (0, 1, 2)) / 3
    want = [FINALS[(c, s)] - FINALS[("none", s)] for c in ("none", "topk:ratio=0.1") for s in (0, 1, 2)]
    want.append(0.5 - ref_mean)
    assert [r["delta_vs_reference"] for r in out] == pytest.approx(want, abs=1e-12)
    assert out[0]["target"] == pytest.approx(0.95 * ref_mean, abs=1e-12)
    # the aggregate row: mean +- sample std [min, max] of the topk deltas, computed here
    deltas = want[3:]
    mean = math.fsum(deltas) / len(deltas)
    std = math.sqrt(math.fsum((d - mean) ** 2 for d in deltas) / (len(deltas) - 1))
    table = compare_report.aggregate_table(compare_report.aggregate(out), "accuracy", "none", False)
    row = _cells(table, "`ddp`")[1]
    assert row[1] == "`topk:ratio=0.1`" and row[2] == "4"
    assert row[_col(table, "vs none")] == f"{mean:+.4f} ± {std:+.4f} [{min(deltas):+.4f}, {max(deltas):+.4f}]"


@pytest.mark.parametrize("nbytes", [0.0, 999.0, 999.4, 1000.0, 1_234_567.0, 2.5e9, 7.25e12, 3e15])
def test_bytes_are_written_in_powers_of_1000(nbytes):
    run = compare.annotate([_summary(_cfg("none", 0), bytes_per_step=nbytes)], None)
    table = compare.table(run)
    row = _cells(table, "`ddp`")[0]
    assert row[4] == _si_bytes(nbytes)
    # bytes to target: the history's cumulative bytes at step 10
    assert row[_col(table, "bytes to target")] == _si_bytes(10 * nbytes)


def test_algorithms_lists_each_summary_under_its_name_and_no_empty_one(monkeypatch, capsys):
    from gradpress.commands import algorithms as command

    rows = [{"name": "ddp", "summary": "DDP with the comm hook", "params": [], "default_compressor": "none"},
            {"name": "bare", "summary": "", "params": [{"name": "period", "default": 8, "allowed": "integer >= 1"}],
             "default_compressor": "topk"}]
    monkeypatch.setattr(command, "describe", lambda: rows)
    assert cli(["algorithms"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1:] == [f"{'ddp':<14} {'none':<18} -", f"{'':<14} DDP with the comm hook",
                         f"{'bare':<14} {'topk':<18} period=8 (integer >= 1)"]


def test_the_listing_commands_exit_0_and_list_every_registered_name(capsys):
    from gradpress.compress import registry

    assert cli(["compressors"]) == 0
    names = [line.split()[0] for line in capsys.readouterr().out.splitlines()[1:] if not line.startswith(" ")]
    assert sorted(names) == sorted(registry.names())  # each once
    assert cli(["compressors", "--markdown"]) == 0 and cli(["compressors", "--json"]) == 0


def test_cluster_defaults_are_the_documented_ones():
    from gradpress.cli import build_parser

    args = build_parser().parse_args(["cluster", "--nodes", "2", "--bandwidth", "1gbit", "--", "true"])
    # docs/cluster.md and --help: one rank per node, a 5 ms queue, MASTER_PORT 29500, no timeout
    assert (args.workers_per_node, args.queue_latency, args.master_port, args.timeout) == (1, "5ms", 29500, None)
    assert (args.intra_bandwidth, args.burst, args.prefix, args.logs) == (None, None, None, None)
    assert not (args.keep or args.check or args.cleanup or args.measure)


def test_the_aggregate_rows_bytes_per_step_is_the_mean_over_the_seeds():
    """compare.md's aggregate row: bytes/step is the mean over the seeds
    (the column of ``mean ± std`` rows; planted as the max, unnoticed before:
    every earlier test gave each seed the same bytes)."""
    per_seed = {0: 1000.0, 1: 2000.0, 2: 6000.0}
    runs = [_summary(_cfg(c, s), bytes_per_step=per_seed[s] if c == "topk:ratio=0.1" else None)
            for c in ("none", "topk:ratio=0.1") for s in (0, 1, 2)]
    table = compare_report.aggregate_table(compare_report.aggregate(compare.annotate(runs, None)), "accuracy",
                                           "none", False)
    row = _cells(table, "`ddp`")[1]
    assert row[1] == "`topk:ratio=0.1`"
    assert row[_col(table, "bytes/step")] == _si_bytes(math.fsum(per_seed.values()) / 3) == "3.0 KB", row


def test_a_sweep_on_a_metric_where_lower_is_better_picks_the_rate_with_the_lowest_mean(tmp_path, monkeypatch):
    """BEST_LR_RULE: the best final metric, mean over the sweep seeds; for a
    metric where lower is better (bits per character) the best is the lowest.
    Ranking every metric as higher-is-better (the sweep not handing the
    direction to ``best_lr``) picked the worst rate and went unnoticed: the
    sweep tests used accuracy."""
    from gradpress import train

    rates = (0.01, 0.03, 0.1)

    def fake_run(cfg):
        run = _summary(cfg, final=1.0 + abs(math.log(cfg.lr / 0.03)) + 0.01 * cfg.seed)
        run.update(higher_is_better=False, metric="bits_per_char")
        return run

    monkeypatch.setattr(train, "run", fake_run)
    out = tmp_path / "cmp"
    assert cli(["compare", "--compressors", "none", "--workload", "digits-mlp", "--steps", "40", "--lr-sweep",
                ",".join(map(str, rates)), "--seeds", "2", "--no-progress", "--out", str(out)]) == 0
    record = json.loads((out / "sweep.json").read_text())
    means = {lr: 1.0 + abs(math.log(lr / 0.03)) for lr in rates}  # the sweep's one seed, seed 0
    want = min(rates, key=lambda lr: means[lr])
    assert want == 0.03 and record["methods"][0]["best_lr"] == want, record["methods"][0]
    assert {r["lr"] for r in json.loads((out / "compare.json").read_text())} == {want}
