"""``gradpress strategies``: every strategy the engine accepts, with what it
carries, checked against facts stated independently of the listing (the
summable trait, the strategies' documented supports)."""

from __future__ import annotations

import json

import pytest

from gradpress import cli
from gradpress.compress import registry
from gradpress.exchange.base import available
from gradpress.exchange.catalog import describe_strategies


def _rows(capsys: pytest.CaptureFixture, *argv: str) -> list[dict]:
    assert cli.main(["strategies", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_lists_every_accepted_name_once(capsys: pytest.CaptureFixture) -> None:
    names = [r["name"] for r in _rows(capsys)]
    assert sorted(names) == sorted(available()) and len(set(names)) == len(names)
    assert names[-2:] == ["auto", "collective"]


def test_what_each_strategy_carries(capsys: pytest.CaptureFixture) -> None:
    rows = {r["name"]: r for r in _rows(capsys)}
    every = set(registry.names())
    summable = {n for n in every if registry.create(n).is_summable}
    assert summable >= {"none", "fp16", "bf16", "randomk"} and "topk" not in summable
    assert every - set(rows["allreduce"]["refuses"]) == summable
    for name in ("allgather", "auto", "collective"):
        assert rows[name]["refuses"] == {}, name
    assert every - set(rows["cyclic"]["refuses"]) == {"topk", "threshold"}  # cyclic.py's documented support
    assert {"topk", "threshold", "sidco", "dgc_threshold"} <= every - set(rows["union"]["refuses"])
    for name in ("ring", "ps", "hierarchical"):  # majority vote needs every rank's packet
        assert {"signsgd", "signum"} <= set(rows[name]["refuses"]), name
    assert "majority vote" in rows["ring"]["refuses"]["signsgd"]


def test_parameters_and_summaries(capsys: pytest.CaptureFixture) -> None:
    rows = {r["name"]: r for r in _rows(capsys)}
    params = {p["name"]: p["default"] for p in rows["hierarchical"]["params"]}
    assert set(params) == {"workers_per_host", "outer", "chunk"} and params["outer"] == "collective"
    assert rows["allgather"]["summary"] == "the general path for any compressor."
    assert all(r["summary"] and not r["summary"].startswith("``") for r in rows.values())


def test_one_compressor_spec(capsys: pytest.CaptureFixture) -> None:
    rows = {r["name"]: r for r in _rows(capsys, "--compressor", "qsgd:levels=4")}
    assert all(set(r["refuses"]) <= {"qsgd:levels=4"} for r in rows.values())
    assert "not summable" in rows["allreduce"]["refuses"]["qsgd:levels=4"]
    assert rows["ring"]["refuses"] == {} and rows["hierarchical"]["refuses"] == {}
    assert set(rows["union"]["refuses"]) == {"qsgd:levels=4"}


def test_table_and_errors(capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["strategies"]) == 0
    out = capsys.readouterr().out
    assert "hierarchical" in out and "only: threshold, topk" in out and "--compressor SPEC" in out
    assert cli.main(["strategies", "--compressor", "topk"]) == 0
    out = capsys.readouterr().out
    assert "Which strategies can carry topk" in out and "why not: compressor 'topk' is not summable" in out
    assert cli.main(["strategies", "--compressor", "bogus"]) == 2
    assert "unknown compressor 'bogus'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="qsgd"):
        describe_strategies("qsgd:levels=0")


def test_listing_commands_refuse_two_output_formats_at_once(capsys: pytest.CaptureFixture) -> None:
    """`gradpress compressors --json --markdown` printed JSON and ignored --markdown; two formats at once are
    refused (exit 2) naming both flags. algorithms and strategies have one format flag (--json) only."""
    formats = ("--json", "--markdown")
    for command in ("compressors", "algorithms", "strategies"):
        sub = cli.build_parser()._subparsers._group_actions[0].choices[command]
        flags = [f for f in formats if f in sub._option_string_actions]
        assert flags == (list(formats) if command == "compressors" else ["--json"]), (command, flags)
        if len(flags) < 2:
            continue
        with pytest.raises(SystemExit) as exc:
            cli.main([command, *flags])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and all(f in err.splitlines()[-1] for f in flags), err
