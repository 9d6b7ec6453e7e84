"""Plugins: a compressor and an algorithm of your own, in a module outside gradpress, used by every command
(`--plugin MODULE` or `GRADPRESS_PLUGINS=MODULE`), in the launcher and in every training worker.

The plugin module is written by each test to tmp_path. In process (about 5 s): `gradpress compressors`,
`gradpress algorithms` and `gradpress bench compressors` see it, and a module that cannot be imported, one
that fails while importing, or a value that is no module name, is refused before anything runs, naming the
value, where it came from and what is allowed. In subprocesses (about 40 s on 2 busy cores):
`gradpress compare --plugin` with 2 workers and `gradpress train` with `GRADPRESS_PLUGINS`, tiny steps; each
worker records that it encoded with the plugin compressor, and the plugin's decoded values, loaded through
`GRADPRESS_PLUGINS` as a worker loads it (in this process since the suitespeed session: it was one more
interpreter), are checked against the definition (x rounded to float16, computed by the test in float64).
The commands docs/authoring.md and docs/authoring-algorithms.md give for running the generic suites on a
plugin are collected as written, in subprocesses (30-90 s on 2 busy cores).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from refusals import forbid

import gradpress
import gradpress.algorithms.registry as algorithm_registry
import gradpress.compress.registry as compressor_registry
from gradpress.cli import main as cli
from gradpress.compress import plugins

ROOT = Path(__file__).resolve().parents[1]

PLUGIN = textwrap.dedent('''
    """A researcher's plugin: a compressor and an algorithm gradpress does not have."""
    import os

    import torch

    from gradpress.algorithms import Algorithm, register as register_algorithm
    from gradpress.compress import kit, register
    from gradpress.compress.base import Param


    def _mark(what):
        where = os.environ.get("PLUG_MARKS")
        if where:
            with open(os.path.join(where, f"{what}-{os.getpid()}"), "a") as f:
                f.write("x")


    @register
    class PlugHalf(kit.KitCompressor):
        name = "plughalf"
        PARAMS = (Param("scale", float, 1.0, "scale > 0", lambda v: v > 0, "multiplies before the cast"),)
        FIELDS = (kit.Field("vals", torch.float16),)
        summable = True
        summary = "x * scale rounded to float16"

        def encode_fields(self, flat, dtype, ctx):
            _mark("encode")
            return {"vals": (flat * self.scale).to(torch.float16)}

        def decode_fields(self, fields, numel, dtype):
            return (fields["vals"].to(torch.float32) / self.scale).to(dtype)


    @register_algorithm
    class PlugEvery(Algorithm):
        name = "plug-every"
        PARAMS = (Param("period", int, 1, "integer >= 1", lambda v: v >= 1, "local steps between averages"),)
        summary = "parameters averaged every period steps"

        def after_broadcast(self):
            self.since = 0

        @torch.no_grad()
        def step(self):
            _mark("algorithm")
            self.local_step()
            self.since += 1
            if self.since == self.period:
                self.sync([p for _, p in self.named])
                self.since = 0

        def extra_state(self):
            return {"since": self.since}

        def load_extra_state(self, state):
            self.since = int(state["since"])
''')


@pytest.fixture
def plugin_dir(tmp_path, monkeypatch):
    """tmp_path/plugdir/myplug.py on sys.path; the registries, the loaded plugins, sys.modules and
    GRADPRESS_PLUGINS are put back afterwards, so no other test sees the plugin's names."""
    where = tmp_path / "plugdir"
    where.mkdir()
    (where / "myplug.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(where))
    monkeypatch.setenv(plugins.ENV, "")  # recorded, so that what --plugin sets is undone too
    monkeypatch.delenv(plugins.ENV)
    compressor_registry._REGISTRY.load()
    algorithm_registry._REGISTRY.load()
    saved = (dict(compressor_registry._REGISTRY.classes), dict(algorithm_registry._REGISTRY.classes),
             set(plugins._LOADED), dict(plugins._DIGESTS))
    yield where
    compressor_registry._REGISTRY.classes.clear()
    compressor_registry._REGISTRY.classes.update(saved[0])
    algorithm_registry._REGISTRY.classes.clear()
    algorithm_registry._REGISTRY.classes.update(saved[1])
    plugins._LOADED.clear()
    plugins._LOADED.update(saved[2])
    plugins._DIGESTS.clear()
    plugins._DIGESTS.update(saved[3])
    plugins._DONE[0] = None
    for name in [m for m in sys.modules if m == "myplug" or m.startswith("broken")]:
        del sys.modules[name]


def test_compressors_and_algorithms_list_a_plugin(plugin_dir, capsys):
    assert cli(["compressors", "--plugin", "myplug"]) == 0
    assert "plughalf" in capsys.readouterr().out
    assert os.environ[plugins.ENV] == "myplug"  # what every process started from here inherits
    assert cli(["algorithms", "--plugin", "myplug"]) == 0
    assert "plug-every" in capsys.readouterr().out


def test_the_environment_variable_loads_a_plugin_at_the_first_lookup(plugin_dir, monkeypatch):
    monkeypatch.setenv(plugins.ENV, " myplug ,")
    assert "plughalf" in compressor_registry.names()
    assert "plug-every" in algorithm_registry.names()


def test_bench_compressors_measures_a_plugin(plugin_dir, tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = cli(["bench", "compressors", "--plugin", "myplug", "--compressors", "plughalf:scale=2", "--sizes", "1K",
              "--repeats", "1", "--warmup", "1", "--threads", "1", "--json", str(out)])
    assert rc == 0, capsys.readouterr().err
    rows = json.loads(out.read_text())["rows"]
    assert [r["compressor"] for r in rows] == ["plughalf:scale=2"]
    assert rows[0]["wire_bytes"] == 2 * 1000  # float16: 2 bytes per entry, by the plugin's definition


@pytest.mark.parametrize("value,words", [
    ("nosuchplugin", ["--plugin/GRADPRESS_PLUGINS", "'nosuchplugin'", "No module named 'nosuchplugin'",
                      "PYTHONPATH"]),
    ("my/plug.py", ["'my/plug.py'", "not a module name", "allowed: a Python module name", "mypkg.mymod"]),
    ("broken_plug", ["'broken_plug'", "failed while importing", "ZeroDivisionError"]),
])
def test_a_plugin_that_cannot_be_loaded_is_refused_before_anything_runs(plugin_dir, monkeypatch, capsys, value,
                                                                         words):
    (plugin_dir / "broken_plug.py").write_text("x = 1 / 0\n")
    from gradpress.train import launch

    forbid(monkeypatch, "a launch", (launch, "_launch"), (launch, "run"))
    rc = cli(["train", "--plugin", value, "--nproc", "2", "--out", str(plugin_dir / "run")])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith("gradpress train: error: plugin "), err
    for w in words:
        assert w in err, (w, err)


def test_record_names_each_plugin_module_and_its_file(plugin_dir, monkeypatch):
    """What summary.json and compare.json record: every module of GRADPRESS_PLUGINS (or loaded by
    plugins.load) with the file it was imported from, found before it is imported too, and the SHA-256 of
    that file's bytes (hashlib here) as imported: an edit after the import does not change it (the record
    had only the path, so two runs of a plugin edited in between looked the same)."""
    assert plugins.record() == []
    monkeypatch.setenv(plugins.ENV, "myplug")
    want = [{"module": "myplug", "file": str(plugin_dir / "myplug.py"), "sha256": _sha256(plugin_dir / "myplug.py")}]
    assert plugins.record() == want  # not imported yet: where the import would find it
    plugins.load()
    assert plugins.record() == want
    # edited after the import: the record keeps the digest of the code that was imported (and runs)
    (plugin_dir / "myplug.py").write_text(PLUGIN + "# edited\n")
    assert plugins.record() == want


def _sha256(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_an_unknown_name_points_at_plugins():
    with pytest.raises(ValueError, match=r"unknown compressor 'mine'; allowed: .*topk.*--plugin MODULE"):
        compressor_registry.create("mine")
    with pytest.raises(ValueError, match=r"unknown algorithm 'mine'; allowed: .*--plugin MODULE"):
        algorithm_registry.parse("mine")


@pytest.mark.parametrize("argv", [["train", "--algorithm", "mine", "--nproc", "2"],
                                  ["compare", "--algorithms", "ddp;mine", "--nproc", "2"]])
def test_the_commands_unknown_algorithm_points_at_plugins(plugin_dir, monkeypatch, capsys, argv):
    """`gradpress train --algorithm` and `compare --algorithms` check the name themselves (`ddp` is no registered
    algorithm): their refusal said only "unknown algorithm 'mine'; allowed: ddp, ...", not where a researcher's
    own algorithm comes from, which the registry's own refusal (above) says."""
    from gradpress.train import launch

    forbid(monkeypatch, "a launch", (launch, "_launch"), (launch, "run"))
    rc = cli([*argv, "--out", str(plugin_dir / "run")])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "unknown algorithm 'mine'; allowed: ddp, " in err, err
    assert "(one of your own: load its module with --plugin MODULE or GRADPRESS_PLUGINS=MODULE, docs/authoring.md)" \
        in err, err


def test_a_plugin_named_before_the_command_is_loaded(plugin_dir, capsys):
    """`gradpress --plugin M COMMAND` as well as `gradpress COMMAND --plugin M`: before, argparse took M for the
    command and failed with "invalid choice: 'myplug'", which did not say where --plugin goes."""
    assert cli(["--plugin", "myplug", "algorithms"]) == 0
    assert "plug-every" in capsys.readouterr().out
    assert os.environ[plugins.ENV] == "myplug"
    # both places at once: each module loaded
    (plugin_dir / "other_plug.py").write_text(PLUGIN.replace('"plughalf"', '"otherhalf"').replace(
        '"plug-every"', '"other-every"'))
    try:
        assert cli(["--plugin", "myplug", "compressors", "--plugin", "other_plug"]) == 0
        out = capsys.readouterr().out
        assert "plughalf" in out and "otherhalf" in out, out
        assert os.environ[plugins.ENV] == "myplug,other_plug"
    finally:
        sys.modules.pop("other_plug", None)


def _run(cmd: list[str], plugin_dir: Path, marks: Path, env: dict[str, str] | None = None) -> tuple[int, str, int]:
    from distributed import free_port

    full = {**{k: v for k, v in os.environ.items() if k != plugins.ENV}, "OMP_NUM_THREADS": "1", "PLUG_MARKS": str(marks), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()),
            "PYTHONPATH": os.pathsep.join([str(plugin_dir), str(ROOT), os.environ.get("PYTHONPATH", "")]),
            **(env or {})}
    proc = subprocess.Popen([sys.executable, "-m", "gradpress.cli", *cmd], cwd=plugin_dir.parent, env=full,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
    return proc.returncode, out, proc.pid


TINY = ["--workload", "digits-mlp", "--hidden", "32", "--samples", "128", "--batch-size", "16", "--steps", "3",
        "--min-numel", "256", "--no-progress", "--nproc", "2"]


def test_compare_runs_a_plugin_compressor_in_two_workers(plugin_dir, tmp_path, monkeypatch):
    marks = tmp_path / "marks"
    marks.mkdir()
    out = tmp_path / "cmp"
    rc, text, launcher = _run(["compare", "--plugin", "myplug", "--compressors", "none,plughalf:scale=4",
                               *TINY, "--out", str(out)], plugin_dir, marks)
    assert rc == 0, text
    runs = json.loads((out / "compare.json").read_text())
    assert [(r["compressor"], r["status"], r["world_size"]) for r in runs] == [
        ("none", "finished", 2), ("plughalf:scale=4", "finished", 2)]
    # each run records the plugins it loaded (module and file), as does the compare: reproducible
    recorded = [{"module": "myplug", "file": str(plugin_dir / "myplug.py"), "sha256": _sha256(plugin_dir / "myplug.py")}]
    assert [r["plugins"] for r in runs] == [recorded, recorded]
    assert json.loads((out / "compare-stats.json").read_text())["plugins"] == recorded
    assert json.loads((out / "0-none" / "summary.json").read_text())["plugins"] == recorded
    header = f"Plugins: `myplug` ({plugin_dir / 'myplug.py'}, sha256 {_sha256(plugin_dir / 'myplug.py')[:12]})."
    assert header in (out / "compare.md").read_text()
    encoders = {int(p.name.split("-")[1]) for p in marks.glob("encode-*")}
    assert len(encoders) == 2 and launcher not in encoders, encoders  # both workers, not the launcher
    # the plugin as a worker loads it (GRADPRESS_PLUGINS at the first lookup; in this process, as the
    # plugin_dir fixture puts the registries back): x * 4 rounded to float16, / 4 (a float64 reference)
    monkeypatch.setenv(plugins.ENV, "myplug")
    c = gradpress.compressor("plughalf:scale=4")
    x = torch.linspace(-3, 3, 4097, dtype=torch.float64).float()
    assert torch.equal(c.decode(c.encode(x)).double(), (x.double() * 4).half().double() / 4)


def test_train_runs_a_plugin_algorithm_from_the_environment(plugin_dir, tmp_path):
    marks = tmp_path / "marks"
    marks.mkdir()
    out = tmp_path / "run"
    rc, text, launcher = _run(["train", "--algorithm", "plug-every:period=2", "--compressor", "plughalf", *TINY,
                               "--out", str(out)], plugin_dir, marks, env={plugins.ENV: "myplug"})
    assert rc == 0, text
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["algorithm"], summary["compressor"], summary["steps"]) == ("plug-every:period=2", "plughalf:scale=1.0", 3)
    assert summary["plugins"] == [{"module": "myplug", "file": str(plugin_dir / "myplug.py"),
                                   "sha256": _sha256(plugin_dir / "myplug.py")}]
    stepped = {int(p.name.split("-")[1]): p.read_text() for p in marks.glob("algorithm-*")}
    assert len(stepped) == 2 and launcher not in stepped and set(stepped.values()) == {"xxx"}, stepped
    assert len(list(marks.glob("encode-*"))) == 2  # the period-2 synchronization, on each worker


def _documented_pytest_commands(doc: str, start: str) -> list[list[str]]:
    """The `python -m pytest` lines (continuations joined) of the first ```bash block after ``start`` in
    docs/``doc``, as argument lists."""
    import re
    import shlex

    text = (ROOT / "docs" / doc).read_text()
    block = re.search(r"```bash\n(.*?)```", text[text.index(start):], re.S).group(1).replace("\\\n", " ")
    return [shlex.split(line.split("#")[0])[3:] for line in block.splitlines() if line.startswith("python -m pytest")]


@pytest.mark.parametrize("doc,start,name,ours", [
    ("authoring.md", "### The generic tests on your plugin", "tbq", "plughalf"),
    ("authoring-algorithms.md", "**An algorithm in a plugin module**", "my-scaffold", "plug-every"),
])
def test_the_documented_generic_test_commands_select_a_plugin(plugin_dir, doc, start, name, ours):
    """The pages' commands that run the generic suites on a plugin (docs/authoring.md said a plugin "does not
    get" them and was to be copied into the tree on a branch; under GRADPRESS_PLUGINS they pick it up as
    they are), collected as written with this file's plugin in place of the page's name: each `-k NAME` file
    selects cases of the plugin (tests/test_unbiased.py only for a method declared unbiased, which plughalf
    is not), each node id is there. Collection only (30-90 s on 2 busy cores); running them on a plugin found
    a real fp64 overflow in a researcher's declaration. The algorithm page's command for the author's own
    test file (outside tests/) is run on a file of this test's that checks what the page says the two
    options give it: tests/conftest.py's GRADPRESS_COMPILE=0 (not inherited here: removed from the
    environment) and the suite's markers (importing test_algorithm_fuzz warned of `pytest.mark.long`)."""
    commands = _documented_pytest_commands(doc, start)
    assert any(a.startswith("tests/") for c in commands for a in c), f"docs/{doc}: no pytest line after {start!r}"
    env = {**{k: v for k, v in os.environ.items() if k not in (plugins.ENV, "GRADPRESS_COMPILE")},
           plugins.ENV: "myplug", "PYTHONPATH": os.pathsep.join([str(plugin_dir), str(ROOT), str(ROOT / "tests")])}
    for args in commands:
        own = [a for a in args if a.endswith(".py") and not a.startswith("tests/")]
        if own:  # the author's own file: this one in its place, run
            (plugin_dir / "test_own.py").write_text(OWN_TEST)
            args = [str(plugin_dir / "test_own.py") if a in own else a for a in args]
            proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args], cwd=ROOT,
                                  env=env, capture_output=True, text=True, timeout=300)
            out = proc.stdout + proc.stderr
            assert proc.returncode == 0 and "1 passed" in out, out[-3000:]
            assert "PytestUnknownMarkWarning" not in out, out[-3000:]
            continue
        if "-k" in args:
            assert args[args.index("-k") + 1] == name, args
            args = [*args[:args.index("-k")], "-k", ours, *args[args.index("-k") + 2:]]
        proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--collect-only", "-q",
                               *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        ids = [line for line in proc.stdout.splitlines() if "::" in line]
        for path in (a for a in args if a.startswith("tests/")):
            if "::" in path:
                assert path in ids, (path, ids)
            elif path != "tests/test_unbiased.py":
                mine = [i for i in ids if i.startswith(path + "::") and ours in i]
                assert mine, f"{path} selects no case of the plugin {ours!r} under {plugins.ENV}"


#: an author's own test file, outside tests/: the checkout's helpers import, the suite's settings apply
OWN_TEST = """
import os

import gradpress.algorithms
from distributed import run_workers  # noqa: F401
from test_algorithm_fuzz import check_algorithm_specs  # noqa: F401


def test_the_suite_settings_apply():
    assert os.environ.get("GRADPRESS_COMPILE") == "0"
    assert "plug-every" in gradpress.algorithms.names()
"""


def test_the_algorithm_fuzz_takes_a_plugin_algorithm(plugin_dir, monkeypatch):
    """tests/test_algorithm_fuzz.py's `check_algorithm_specs`, what docs/authoring-algorithms.md gives a plugin
    author in place of adding specs to its hand-kept `ALGORITHMS`: the plugin's specs with drawn compressors
    (the plugin's own among them), strategies and optimizers on 2 gloo workers that load the plugin from
    GRADPRESS_PLUGINS, resumed mid-period from a weights_only checkpoint (about 20 s). plug-every keeps its
    step counter in extra_state: without it a resume mid-period moves the averages, which the fuzz names
    ("the resumed run differs")."""
    from distributed import _START_FORKSERVER
    from test_algorithm_fuzz import check_algorithm_specs

    # the session's fork server keeps the environment it starts with: started here under GRADPRESS_PLUGINS,
    # every later worker of the session (whose sys.path lacks this tmp directory) failed to import myplug
    _START_FORKSERVER()
    monkeypatch.setenv(plugins.ENV, "myplug")
    check_algorithm_specs(["plug-every:period=2", "plug-every:period=3"], 2, range(9))
