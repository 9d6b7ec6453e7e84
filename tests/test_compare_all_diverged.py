"""``gradpress compare`` whose every run diverged (every curve NaN): the table,
compare.json, compare-stats.json and a plot are still written (empty panels
with a note), and the exit status is the one divergence gives anyway (0 with
``--allow-divergence``, 3 without). ``train.run`` is a stand-in writing
summary.json as train does (as tests/test_compare_resume.py's)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import matplotlib.axes
import pytest
from test_compare_resume import _fake_run

from gradpress import compare, train
from gradpress.cli import main as cli
from gradpress.train import report

PNG = b"\x89PNG\r\n\x1a\n"


def _diverging(nan_for: set[str], evaluations: int = 3):
    """A stand-in train.run: the compressors in ``nan_for`` diverge (every evaluation NaN), the others learn."""
    base = _fake_run([])

    def run(cfg):
        s = base(cfg)
        good = s["history"][0]
        s["history"] = [dict(good, step=10 * (i + 1), bytes_total=1000.0 * (i + 1), metric=0.5 + 0.1 * i
                             + 0.01 * cfg.seed) for i in range(evaluations)]
        if cfg.compressor in nan_for:
            s.update(final_metric=math.nan, final_loss=math.nan, diverged_at_step=5,
                     allow_divergence=cfg.allow_divergence)
            s["history"] = [dict(h, metric=math.nan, loss=math.inf) for h in s["history"]]
        report.write_summary(Path(cfg.out), s)
        return s
    return run


def _texts(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every string the plot writes into an axes with ``Axes.text``."""
    seen: list[str] = []
    original = matplotlib.axes.Axes.text

    def text(self, x, y, s, *args, **kwargs):
        seen.append(s)
        return original(self, x, y, s, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "text", text)
    return seen


@pytest.mark.parametrize("seeds", ["1", "2"])  # 2: the NaN band (fill_between) that made savefig raise
@pytest.mark.parametrize(("allow", "rc"), [(True, 0), (False, 3)])
def test_a_compare_whose_every_run_diverged_writes_its_outputs_and_a_plot(tmp_path, monkeypatch, capsys,
                                                                         seeds, allow, rc):
    monkeypatch.setattr(train, "run", _diverging({"none", "topk:ratio=0.1"}))
    texts = _texts(monkeypatch)
    out = tmp_path / "cmp"
    args = ["compare", "--compressors", "none,topk:ratio=0.1", "--workload", "digits-mlp", "--steps", "30",
            "--seeds", seeds, "--no-progress", "--out", str(out)] + (["--allow-divergence"] if allow else [])
    assert cli(args) == rc
    captured = capsys.readouterr()
    err = captured.err
    # the only complaint is the divergence (an error without --allow-divergence), not the plot
    assert all("runs diverged" in line for line in err.splitlines() if "error" in line or "warning" in line), err
    assert f"{out / 'compare.png'}" in captured.out
    runs = 2 * int(seeds)
    assert f"{runs} of {runs} runs diverged" in err, err
    rows = json.loads((out / "compare.json").read_text())
    assert len(rows) == runs and all(math.isnan(r["final_metric"]) for r in rows)
    assert (out / "compare-stats.json").exists()
    assert "(diverged at step 5)" in (out / "compare.md").read_text()
    assert (out / "compare.png").read_bytes().startswith(PNG)
    note = compare.NO_CURVE.format(metric="accuracy")
    assert texts.count(note) == 2, texts  # one note in each panel


def test_one_diverged_configuration_among_learning_ones_gets_no_note_and_no_band(tmp_path, monkeypatch, capsys):
    """A configuration whose seeds all diverged beside one that learns: the plot is written, without the
    note (there is a curve), with a band for the one that learns only."""
    monkeypatch.setattr(train, "run", _diverging({"topk:ratio=0.1"}))
    texts = _texts(monkeypatch)
    bands: list[list[float]] = []
    original = matplotlib.axes.Axes.fill_between

    def fill_between(self, x, y1, y2=0, **kwargs):
        bands.append(list(y1))
        return original(self, x, y1, y2, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "fill_between", fill_between)
    out = tmp_path / "cmp"
    assert cli(["compare", "--compressors", "none,topk:ratio=0.1", "--workload", "digits-mlp", "--steps", "30",
                "--seeds", "2", "--allow-divergence", "--no-progress", "--out", str(out)]) == 0
    assert (out / "compare.png").read_bytes().startswith(PNG)
    assert compare.NO_CURVE.format(metric="accuracy") not in texts
    # the learning configuration's band, in both panels: every end finite
    assert len(bands) == 2 and all(all(math.isfinite(v) for v in b) for b in bands), bands
