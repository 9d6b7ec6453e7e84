"""gradpress/compress/plugins.py in one process (the `compat` group's tests of it; tests/test_plugins.py's launches
are too slow for the group): the module list of a value or of ``$GRADPRESS_PLUGINS`` (order kept, blanks
and repeats dropped, a value that is no module name refused naming it), ``load`` importing each module once
(also when its ``sys.modules`` entry is gone), retrying one that failed, telling a module that cannot be found
from one that fails while importing, a lookup of an unchanged ``$GRADPRESS_PLUGINS`` costing one comparison;
``add`` (``--plugin``) appending to the variable without repeats; ``add_option`` putting ``--plugin`` on
every command that takes options, once.

Each plugin module is a file written to tmp_path that appends its name to a log when it is imported.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

import pytest

from gradpress.compress import plugins

pytestmark = pytest.mark.mutants

SOURCE = "--plugin/GRADPRESS_PLUGINS"


@pytest.fixture
def plug(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A function writing tmp_path/plugs/NAME.py (its body after a line logging the import) and returning
    a function that reads the log; the loaded set, the done marker, sys.modules and the variable are put back."""
    where = tmp_path / "plugs"
    where.mkdir()
    log = tmp_path / "imports.log"
    monkeypatch.syspath_prepend(str(where))
    monkeypatch.setenv(plugins.ENV, "")
    monkeypatch.delenv(plugins.ENV)
    saved = (set(plugins._LOADED), plugins._DONE[0])
    plugins._DONE[0] = None  # as in a fresh process
    written: list[str] = []

    def write(name: str, body: str = "") -> None:
        (where / f"{name}.py").write_text(f"with open({str(log)!r}, 'a') as f:\n    f.write({name!r} + '\\n')\n"
                                          + body)
        written.append(name)
        importlib.invalidate_caches()

    def imported() -> list[str]:
        return log.read_text().split() if log.exists() else []

    write.imported = imported  # type: ignore[attr-defined]
    yield write
    plugins._LOADED.clear()
    plugins._LOADED.update(saved[0])
    plugins._DONE[0] = saved[1]
    for name in written:
        sys.modules.pop(name, None)


def test_requested_keeps_the_order_and_drops_blanks_and_repeats(monkeypatch: pytest.MonkeyPatch) -> None:
    assert plugins.requested(" a , b.c,,a, d_1 ,b.c ") == ["a", "b.c", "d_1"]
    assert plugins.requested("") == []
    assert plugins.requested(" , ,") == []
    monkeypatch.setenv(plugins.ENV, "x, y ,x")
    assert plugins.requested() == ["x", "y"]  # the variable by default
    assert plugins.requested("z") == ["z"]  # a value given wins
    assert plugins.requested("") == []  # also an empty one
    monkeypatch.delenv(plugins.ENV)
    assert plugins.requested() == []


@pytest.mark.parametrize("bad", ["1mod", "a-b", "a..b", "a.", ".a", "my/plug.py", "a b", "a.1b", "mod!"])
def test_a_value_that_is_no_module_name_is_refused_naming_it(bad: str) -> None:
    with pytest.raises(ValueError) as info:
        plugins.requested(f"ok, {bad}")
    text = str(info.value)
    for words in (f"plugin {bad!r} ({SOURCE}) is not a module name", "allowed: a Python module name"):
        assert words in text, text


def test_load_imports_each_module_once_in_order_even_when_it_left_sys_modules(plug) -> None:
    plug("plug_one")
    plug("plug_two")
    plugins.load(["plug_one", "plug_two", "plug_one"])
    assert plug.imported() == ["plug_one", "plug_two"]
    del sys.modules["plug_one"]
    plugins.load(["plug_one"])  # imported by load already: not again
    assert plug.imported() == ["plug_one", "plug_two"]


def test_a_plugin_that_loads_plugins_while_it_is_imported_is_imported_once(plug) -> None:
    plug("plug_self", "from gradpress.compress import plugins\nplugins.load(['plug_self'])\n")
    plugins.load(["plug_self"])
    assert plug.imported() == ["plug_self"]


def test_load_reads_the_variable_and_an_unchanged_value_costs_one_comparison(plug, monkeypatch) -> None:
    plug("plug_one")
    plug("plug_two")
    monkeypatch.setenv(plugins.ENV, "plug_one")
    plugins.load()
    assert plug.imported() == ["plug_one"]
    monkeypatch.setenv(plugins.ENV, "plug_one,plug_two")
    plugins.load()
    assert plug.imported() == ["plug_one", "plug_two"]

    def no_parse(value=None):
        raise AssertionError("the unchanged variable was parsed again")

    monkeypatch.setattr(plugins, "requested", no_parse)
    plugins.load()  # every module of this value imported: nothing read
    assert plug.imported() == ["plug_one", "plug_two"]


def test_modules_given_and_the_variable_are_loaded_apart(plug, monkeypatch) -> None:
    plug("plug_one")
    plug("plug_two")
    plug("plug_three")
    monkeypatch.setenv(plugins.ENV, "plug_two")
    plugins.load(["plug_one"])
    assert plug.imported() == ["plug_one"]
    plugins.load()  # the modules given did not mark the variable done: its module is still to import
    assert plug.imported() == ["plug_one", "plug_two"]
    plugins.load(["plug_three"])  # the variable done does not stand for modules given
    assert plug.imported() == ["plug_one", "plug_two", "plug_three"]


@pytest.mark.parametrize("name,missing", [("plug_absent", "plug_absent"), ("plug_nopkg.sub", "plug_nopkg"),
                                          ("plug_one.sub", "plug_one.sub")])
def test_a_module_that_cannot_be_found_is_refused_naming_it_and_retried_later(plug, name, missing) -> None:
    plug("plug_one")  # a module, not a package: plug_one.sub cannot be found
    with pytest.raises(ValueError) as info:
        plugins.load([name])
    text = str(info.value)
    for words in (f"plugin {name!r} ({SOURCE}): cannot import it: No module named {missing!r}",
                  "allowed: a module on sys.path", "PYTHONPATH"):
        assert words in text, text
    assert isinstance(info.value.__cause__, ModuleNotFoundError)
    if name == "plug_absent":
        plug("plug_absent")  # written since: the next load imports it
        plugins.load([name])
        assert plug.imported()[-1] == "plug_absent"


@pytest.mark.parametrize("body,kind", [("import plug_no_such_dependency\n", "ModuleNotFoundError: No module named "
                                                                         "'plug_no_such_dependency'"),
                                       ("x = 1 / 0\n", "ZeroDivisionError: division by zero")])
def test_a_module_that_fails_while_importing_is_refused_naming_it_and_retried_later(plug, body, kind) -> None:
    plug("plug_broken", body)
    with pytest.raises(ValueError) as info:
        plugins.load(["plug_broken"])
    assert str(info.value) == f"plugin 'plug_broken' ({SOURCE}) failed while importing: {kind}"
    assert info.value.__cause__ is not None and kind.startswith(type(info.value.__cause__).__name__)
    plug("plug_broken")  # fixed: the next load imports it
    plugins.load(["plug_broken"])
    assert plug.imported() == ["plug_broken", "plug_broken"]


def test_add_appends_to_the_variable_without_repeats_and_loads(plug, monkeypatch) -> None:
    import os

    plug("plug_one")
    plug("plug_two")
    plugins.add([])
    assert plugins.ENV not in os.environ  # nothing asked: the variable is not created
    plugins.add(["plug_one"])
    assert os.environ[plugins.ENV] == "plug_one"
    assert plug.imported() == ["plug_one"]
    monkeypatch.setenv(plugins.ENV, " plug_one ,,")
    plugins.add(["plug_two", "plug_one", "plug_two"])
    assert os.environ[plugins.ENV] == "plug_one,plug_two"
    assert plug.imported() == ["plug_one", "plug_two"]
    plugins.add([])
    assert os.environ[plugins.ENV] == "plug_one,plug_two"
    with pytest.raises(ValueError, match="'bad-name'"):
        plugins.add(["bad-name"])
    assert os.environ[plugins.ENV] == "plug_one,plug_two"  # refused before the variable changed


def test_add_option_puts_plugin_on_every_command_that_takes_options_once() -> None:
    top = argparse.ArgumentParser(prog="top")
    subs = top.add_subparsers(dest="cmd")
    leaf = subs.add_parser("leaf")
    group = subs.add_parser("group")
    inner = group.add_subparsers(dest="inner").add_parser("inner")
    own = subs.add_parser("own")
    own.add_argument("--plugin", dest="mine")
    plugins.add_option(top)
    plugins.add_option(top)  # twice: still one option each

    def options(parser: argparse.ArgumentParser) -> list[str]:
        return [s for a in parser._actions for s in a.option_strings if s == "--plugin"]

    assert [options(p) for p in (top, leaf, group, inner, own)] == [[], ["--plugin"], [], ["--plugin"], ["--plugin"]]
    args = top.parse_args(["leaf", "--plugin", "a", "--plugin", "b.c"])
    assert args.plugins == ["a", "b.c"]
    assert top.parse_args(["leaf"]).plugins is None
    assert top.parse_args(["group", "inner", "--plugin", "x"]).plugins == ["x"]
    assert top.parse_args(["own", "--plugin", "x"]).mine == "x"
    help_text = leaf.format_help()
    assert "--plugin MODULE" in help_text and "$GRADPRESS_PLUGINS" in help_text
    alone = argparse.ArgumentParser()
    plugins.add_option(alone)
    assert alone.parse_args(["--plugin", "m"]).plugins == ["m"]
