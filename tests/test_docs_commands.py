"""Every ``gradpress`` command line that README.md and docs/*.md show in a
shell block or a whole-command inline span parses with today's CLI (option names, choices, value types), so
a renamed or removed option cannot leave the docs showing a command that
fails. Placeholders written in capitals (``--seed S``, ``--out DIR``) get a
value of the option's type; optional parts in brackets (``[--compressor C]``)
are dropped."""

from __future__ import annotations

import contextlib
import functools
import io
import re
import shlex
from pathlib import Path

import pytest
from test_authoring_algorithms_doc import my_scaffold  # noqa: F401 - the algorithm guide's example, likewise
from test_kit_authoring import tbq  # noqa: F401 - the worked example's compressor, registered for its page's lines

from gradpress.cli import build_parser as _build_parser
from gradpress.train.config import make_config

#: one parser for the module (building one costs ~0.7 s; parsing leaves it unchanged)
build_parser = functools.cache(_build_parser)

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL = {"", "bash", "sh", "shell", "console"}
#: a value of the right type for an option whose value the docs leave as a placeholder
PLACEHOLDER_VALUES = {"--seed": "0", "--lr": "0.1", "--seeds": "3", "--nproc": "2", "--steps": "10",
                      "--algorithm": "ddp", "--compressor": "fp16", "--out": "out", "--threads": "1", "--nodes": "2",
                      "--bandwidth": "100mbit"}
_COMMAND = re.compile(r"(?:^|\s|&&\s*|;\s*)(?:gradpress|python3? -m gradpress(?:\.cli)?)\s+(.*)$")


def shell_lines(text: str) -> list[tuple[int, str]]:
    """(line number, command) for each line of the fenced shell blocks,
    backslash continuations joined."""
    out, in_block, lang, pending, start = [], False, "", "", 0
    for no, line in enumerate(text.splitlines(), 1):
        fence = re.match(r"^\s*```(\w*)\s*$", line)
        if fence:
            in_block, lang = not in_block, fence.group(1)
            continue
        if not in_block or lang not in SHELL:
            continue
        start = start if pending else no
        joined = f"{pending} {line.strip()}" if pending else line.rstrip()
        if joined.endswith("\\"):
            pending = joined[:-1]
            continue
        pending = ""
        out.append((start, joined.strip().removeprefix("$ ")))
    return out


def gradpress_argv(line: str) -> list[str] | None:
    """The arguments after ``gradpress`` on ``line`` (a pipe, redirection,
    ``&&`` or comment ends them), placeholders filled in; None when the line
    runs no gradpress command or shows an elided one (``...``, ``<...>``)."""
    found = _COMMAND.search(line)
    if not found:
        return None
    rest = re.split(r"\s(?:&&|\|\||\||;|>|2>|#)\s", f" {found.group(1)} ")[0]
    rest = re.sub(r"\[[^\]]*\]", " ", rest)  # optional parts
    argv = shlex.split(rest)
    if any("..." in a or "<" in a for a in argv):
        return None
    for i, arg in enumerate(argv):
        if re.fullmatch(r"[A-Z][A-Z0-9_]*", arg) and i and argv[i - 1].startswith("--"):
            argv[i] = PLACEHOLDER_VALUES.get(argv[i - 1], "placeholder")
    return argv


def expand_variables(lines: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """Lines with ``$NAME`` / ``${NAME}`` replaced by the value a plain
    ``NAME="..."`` line before them assigned (as the shell would, unquoted)."""
    values: dict[str, str] = {}
    out = []
    for no, line in lines:
        assign = re.fullmatch(r"([A-Za-z_]\w*)=(.*)", line)
        if assign:
            values[assign.group(1)] = " ".join(shlex.split(assign.group(2)))
            continue
        out.append((no, re.sub(r"\$\{?([A-Za-z_]\w*)\}?", lambda m: values.get(m.group(1), m.group(0)), line)))
    return out


def inline_commands(text: str) -> list[tuple[int, list[str]]]:
    """(line number, argv) of the inline code spans that show a whole command
    (`` `gradpress bench compressors --sizes 25M ...` ``, also behind
    ``flock LOCK``): the span starts with it and gives at least one value, so
    prose that names an option (`` `gradpress train --seed` ``) is left out."""
    found = []
    for span in re.finditer(r"`((?:flock \S+ )?gradpress [^`\n]*)`", text):
        argv = gradpress_argv(span.group(1))
        words = [a for a in (argv or [])[1:] if a not in ("compressors", "e2e", "estimators", "plan")]
        placeholder = any(re.search(r"\b[A-Z]{2,}\b", a) for a in words)  # SUBCOMMAND, NAME:k=v
        if argv and not placeholder and any(not a.startswith("-") for a in words):
            found.append((text.count("\n", 0, span.start()) + 1, argv))
    return found


def _commands() -> list[tuple[str, int, list[str]]]:
    found = []
    for doc in DOCS:
        text = doc.read_text()
        for no, line in expand_variables(shell_lines(text)):
            argv = gradpress_argv(line)
            if argv:
                found.append((doc.name, no, argv))
    return found


def _inline() -> list[tuple[str, int, list[str]]]:
    return [(doc.name, no, argv) for doc in DOCS for no, argv in inline_commands(doc.read_text())]


#: shell blocks' commands: parsed and checked as far as train, compare and bench e2e check before running
COMMANDS = _commands()
#: inline spans' commands: parsed only (prose examples of options, e.g. a costs file or --device cuda)
INLINE = _inline()


def test_the_docs_show_commands_of_every_kind() -> None:
    shown = {argv[0] for _, _, argv in COMMANDS}
    assert {"train", "compare", "bench", "compressors", "cluster"} <= shown, shown
    assert len(COMMANDS) >= 50, len(COMMANDS)


@pytest.mark.parametrize("doc, line, argv", COMMANDS + INLINE, ids=[f"{d}:{n}" for d, n, _ in COMMANDS + INLINE])
def test_every_command_the_docs_show_parses(doc: str, line: int, argv: list[str]) -> None:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            build_parser().parse_args(argv)
        except SystemExit as exc:
            if exc.code:
                pytest.fail(f"{doc}:{line}: `gradpress {shlex.join(argv)}` does not parse: "
                            f"{err.getvalue().strip().splitlines()[-1]}")


TRAIN = [c for c in COMMANDS if c[2][0] == "train"]


@pytest.mark.parametrize("doc, line, argv", TRAIN, ids=[f"{d}:{n}" for d, n, _ in TRAIN])
def test_every_train_command_the_docs_show_passes_the_configuration_checks(doc: str, line: int, argv: list[str],
                                                                         tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch,
                                                                         request: pytest.FixtureRequest) -> None:
    """Beyond parsing: workload, algorithm and compressor specs, strategy,
    numbers and their combinations, as ``gradpress train`` checks them before
    any worker starts (in a scratch directory, where ``--out`` is writable);
    docs/authoring.md's and docs/authoring-algorithms.md's lines with their worked examples registered
    (the first's `--plugin` lines name a module holding TBQ)."""
    monkeypatch.chdir(tmp_path)
    if doc == "authoring.md":
        request.getfixturevalue("tbq")
    if doc == "authoring-algorithms.md":
        request.getfixturevalue("my_scaffold")
    try:
        make_config(build_parser().parse_args(argv))
    except ValueError as exc:
        pytest.fail(f"{doc}:{line}: `gradpress {shlex.join(argv)}` is refused: {exc}")


COMPARE = [c for c in COMMANDS if c[2][0] == "compare"]


@pytest.mark.parametrize("doc, line, argv", COMPARE, ids=[f"{d}:{n}" for d, n, _ in COMPARE])
def test_every_compare_command_the_docs_show_plans_valid_runs(doc: str, line: int, argv: list[str],
                                                            tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """Every (algorithm, compressor) pair of a ``compare`` line is a
    configuration ``train`` accepts (compare's own planning step, no run);
    docs/authoring.md's lines with its worked example registered, as the
    page tells the reader to save it."""
    from gradpress import compare, train

    if doc == "authoring.md":
        request.getfixturevalue("tbq")
    if doc == "authoring-algorithms.md":
        request.getfixturevalue("my_scaffold")
    args = build_parser().parse_args(argv)
    opts = {k: v for k, v in vars(args).items() if k in train.FIELDS or k == "config"}
    opts.pop("out", None)
    try:
        runs = compare._plan_runs(args.compressors, args.algorithms, opts, tmp_path)
    except ValueError as exc:
        pytest.fail(f"{doc}:{line}: `gradpress {shlex.join(argv)}` is refused: {exc}")
    assert runs


E2E = [c for c in COMMANDS if c[2][:2] == ["bench", "e2e"]]


@pytest.mark.parametrize("doc, line, argv", E2E, ids=[f"{d}:{n}" for d, n, _ in E2E])
def test_every_bench_e2e_command_the_docs_show_passes_its_checks(doc: str, line: int, argv: list[str],
                                                               tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``bench e2e``'s checks before any cluster is built: sizes, rates,
    workload, configurations (strategy, compressor and algorithm specs),
    seeds; in a scratch directory, where ``--out`` is writable."""
    from gradpress.bench import e2e, e2e_args

    monkeypatch.chdir(tmp_path)
    args = build_parser().parse_args(argv)
    try:
        e2e_args._resolve(args)
        e2e._seeds(args)
    except ValueError as exc:
        pytest.fail(f"{doc}:{line}: `gradpress {shlex.join(argv)}` is refused: {exc}")


def test_a_stale_option_in_a_doc_block_is_caught() -> None:
    """The extraction itself: a block with a removed option, a continuation
    and a placeholder yields the argv that then fails to parse."""
    text = ('```bash\nW="--workload  mnist1d-cnn"\n$ gradpress train --nproc 2 $W \\\n'
            '    --seed S --no-such-option 3 | tee log\n```\n')
    (no, line), = expand_variables(shell_lines(text))
    argv = gradpress_argv(line)
    assert (no, argv) == (3, ["train", "--nproc", "2", "--workload", "mnist1d-cnn", "--seed", "0",
                              "--no-such-option", "3"])
    with contextlib.redirect_stderr(io.StringIO()), pytest.raises(SystemExit):
        build_parser().parse_args(argv)
