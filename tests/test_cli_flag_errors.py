"""A bad value given to a ``gradpress train`` flag that argparse passes and
the training configuration refuses names the flag as typed (``--error-feedback``),
not the field (``error_feedback``); the same value in a ``--config`` TOML file
or through the Python API keeps the field's name, which is what the user wrote
there. The flags are read from the ``train`` subcommand's parser."""

from __future__ import annotations

import argparse

import pytest

from gradpress import train
from gradpress.cli import build_parser
from gradpress.cli import main as cli


def _train_parser() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["train"]


def _value_flags() -> list[argparse.Action]:
    """Every flag of ``gradpress train`` that takes a value and is checked after argparse (no choices=)."""
    return [a for a in _train_parser()._actions
            if a.option_strings and a.nargs is None and a.choices is None and isinstance(a, argparse._StoreAction)
            and a.dest != "plugins"]


FLAGS = _value_flags()


def _bad(action: argparse.Action, tmp_path) -> str:
    """A value the flag's field refuses: a negative number for a number, an existing file for a directory,
    else a word that names nothing."""
    if action.type in (int, float):
        return "-1"
    if action.dest in ("out", "tensorboard"):
        path = tmp_path / "a-file"
        path.write_text("x")
        return str(path)
    return "bogus"


def test_the_list_of_flags_is_the_parsers() -> None:
    names = {a.option_strings[0] for a in FLAGS}
    assert len(FLAGS) >= 25 and {"--error-feedback", "--batch-size", "--lr", "--split", "--config"} <= names
    assert any("_" in a.dest for a in FLAGS)  # the case this is about: a field spelled unlike its flag


def _message(action: argparse.Action, tmp_path, capsys) -> str:
    """The error line's message of ``gradpress train FLAG BAD`` (exit 2, nothing trained)."""
    flag = max(action.option_strings, key=len)
    out = [] if action.dest == "out" else ["--out", str(tmp_path / "run")]
    assert cli(["train", *out, flag, _bad(action, tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gradpress train: error: "), err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    return err.split("\n")[0].split("error: ", 1)[1]


@pytest.mark.parametrize("action", FLAGS, ids=[a.option_strings[0] for a in FLAGS])
def test_a_bad_flag_value_names_the_flag(action, tmp_path, capsys) -> None:
    flag = max(action.option_strings, key=len)
    message = _message(action, tmp_path, capsys)
    # the flag, or a message naming the kind of spec and the value ("unknown workload 'bogus'", "split 'bogus':
    # ...", "data file 'bogus' ..."): never the field as its subject ("error_feedback must be ...")
    assert message.startswith((flag, f"{action.dest} '", f"unknown {action.dest} '", f"{action.dest} file '")), message


def test_most_flags_are_named_as_flags(tmp_path, capsys) -> None:
    """The messages that have a field as their subject are most: each names the flag."""
    named = [a.option_strings[0] for a in FLAGS
             if _message(a, tmp_path, capsys).startswith(max(a.option_strings, key=len))]
    assert len(named) >= 20 and {"--error-feedback", "--batch-size", "--min-numel", "--plan-costs"} <= set(named), named


def test_reshard_without_resume_names_the_flag(tmp_path, capsys) -> None:
    assert cli(["train", "--out", str(tmp_path / "run"), "--reshard"]) == 2
    assert capsys.readouterr().err.startswith("gradpress train: error: --reshard: true without resume")


def test_the_flag_is_named_by_compare_too(tmp_path, capsys) -> None:
    assert cli(["compare", "--compressors", "none", "--out", str(tmp_path), "--error-feedback", "yes"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gradpress compare: error: --error-feedback must be one of on, off, auto, got 'yes'"), err


FIELDS = [a for a in FLAGS if a.dest in train.FIELDS]


@pytest.mark.parametrize("action", FIELDS, ids=[a.dest for a in FIELDS])
def test_the_same_value_in_a_toml_file_or_the_python_api_names_the_field(action, tmp_path, capsys) -> None:
    value = _bad(action, tmp_path)
    typed = int(value) if action.type is int else float(value) if action.type is float else value
    with pytest.raises(ValueError) as exc:
        train.make_config({"out": str(tmp_path / "api"), action.dest: typed})
    message = str(exc.value)
    assert not message.startswith("--") and action.dest in message.replace("-", "_"), message
    if action.dest == "out":
        return  # out given in the file and again as --out below: the flag's value wins
    toml = tmp_path / "bad.toml"
    text = f'"{typed}"' if isinstance(typed, str) else str(typed)
    toml.write_text(f"{action.dest} = {text}\n")
    assert cli(["train", "--out", str(tmp_path / "run"), "--config", str(toml)]) == 2
    err = capsys.readouterr().err.split("\n")[0]
    assert err.startswith("gradpress train: error: ") and not err.split("error: ", 1)[1].startswith("--"), err
    assert action.dest in err.replace("-", "_"), err
