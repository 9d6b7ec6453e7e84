"""Written for the ``plots`` group of ``make mutants`` (gradpress/bench/plot.py, gradpress/bench/compressors.py,
gradpress/demo.py; gradpress/cluster/processes.py has its own file, test_mutants_plots_processes.py): one
process, no benchmark, no worker, a few seconds.

The plot is drawn for real (Agg) and read back from its figure: which rows it shows (the largest size,
finite positive throughput and ratio, no zero-copy row), their coordinates and labels, the axes' limits and
the two roofline lines, each computed here from the rows; the labels' estimated boxes (6.2 px a character,
11 px high, as the module documents its estimate) never overlap one another or a marker. The command's
arguments reach the benchmark (a stand-in recorder) parsed and in order, its JSON and its command line are
checked against what was asked; the demo's choice of compressors against its preference list.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import matplotlib
import pytest
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from gradpress import demo  # noqa: E402
from gradpress.bench import plot  # noqa: E402
from gradpress.cli import main  # noqa: E402

pytestmark = pytest.mark.mutants


def _row(name: str, numel: int, gbps: float, ratio: float, roof: float = 10.0, kind: str = "method",
         compressor: str | None = None, peak: int | None = 100) -> dict:
    r = {"name": name, "compressor": compressor or name, "kind": kind, "numel": numel, "encode_gbps": gbps,
         "ratio": ratio, "roofline_gbps": roof}
    if peak is not None:
        r["peak_temp_bytes"] = peak
    return r


@pytest.fixture
def figures(monkeypatch):
    """The figures ``plot_throughput`` draws, kept open to be read (it closes them)."""
    kept: list = []
    close = plt.close
    monkeypatch.setattr(plt, "close", kept.append)
    yield kept
    for fig in kept:
        close(fig)


def _boxes(ax, ann) -> tuple[float, float, float, float]:
    """A label's estimated box relative to its point, in display pixels, as the module estimates it."""
    assert ann.anncoords == "offset points" and ann.get_ha() == "left" and ann.get_va() == "bottom"
    dx, dy = (v * ax.figure.dpi / 72 for v in ann.xyann)
    w = 6.2 * len(ann.get_text())
    return dx, dy, dx + w, dy + 11.0


def _overlap(a, b) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def test_the_plot_shows_the_largest_size_finite_positive_rows_with_their_labels(tmp_path, figures):
    size = 4000
    rows = [_row("small", 1000, 3.0, 2.0, roof=99.0),  # another size: left out (and its roofline not used)
            _row("fp16", size, 2.0, 2.0, roof=8.0),
            _row("none", size, 50.0, 1.0, peak=0),  # zero-copy: left out
            _row("ref", size, 0.5, 400.0, kind="reference", compressor="ref:topk@0.01"),
            _row("nopeak", size, 1.0, 32.0, peak=None),  # no peak measured: shown
            _row("nan", size, math.nan, 2.0), _row("inf", size, 1.0, math.inf), _row("zero", size, 0.0, 2.0),
            _row("neg", size, 1.0, -2.0), _row("none-gbps", size, None, 2.0), _row("text", size, "1", 2.0)]
    path = tmp_path / "new" / "dir" / "bench.png"
    assert plot.plot_throughput(rows, path) == path
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (fig,) = figures
    (ax,) = fig.axes
    shown = [("fp16", 2.0, 2.0), ("ref:topk@0.01", 400.0, 0.5), ("nopeak", 32.0, 1.0)]
    xs, ys, roof = [s[1] for s in shown], [s[2] for s in shown], 8.0
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
    assert ax.get_xlim() == pytest.approx((min(xs) / 1.6, max(xs) * 2.5))
    assert ax.get_ylim() == pytest.approx((min(ys + [roof / 4]) / 2, max(ys + [roof]) * 2))
    points = [tuple(c.get_offsets()[0]) for c in ax.collections]
    assert points == [(x, y) for _, x, y in shown]
    assert [a.get_text() for a in ax.texts] == [s[0] for s in shown]
    assert [tuple(a.xy) for a in ax.texts] == [(x, y) for _, x, y in shown]
    # the reference row: grey cross, grey label; the methods: coloured circles, black labels
    grey = matplotlib.colors.to_rgba("0.4")
    assert [tuple(c.get_edgecolor()[0]) == grey for c in ax.collections] == [False, True, False]
    assert [matplotlib.colors.to_rgba(a.get_color()) for a in ax.texts] == \
        [matplotlib.colors.to_rgba(c) for c in ("black", "0.35", "black")]
    lines = {tuple(line.get_ydata()): line.get_label() for line in ax.lines}
    assert lines == {(roof, roof): f"copy roofline {roof:.2f} GB/s (read+write)",
                     (roof / 4, roof / 4): "25% of roofline"}
    assert [t.get_text() for t in ax.get_legend().get_texts()] == list(lines.values())
    assert ax.get_title() == f"compressor encode throughput, {size:,} elements"
    assert "compression ratio" in ax.get_xlabel() and "encode throughput" in ax.get_ylabel()


def test_the_plot_takes_its_title_and_limits_from_the_roofline_when_it_bounds_the_points(tmp_path, figures):
    rows = [_row("a", 10, 100.0, 4.0, roof=2.0), _row("b", 10, 200.0, 8.0, roof=3.0)]
    assert plot.plot_throughput(rows, str(tmp_path / "p.png"), title="mine") == tmp_path / "p.png"
    (ax,) = figures[0].axes
    assert ax.get_title() == "mine"
    assert ax.get_ylim() == pytest.approx((0.5 / 2, 200.0 * 2))  # 25% of the first row's roofline, 2.0
    rows = [_row("a", 10, 0.001, 4.0, roof=2.0)]
    assert plot.plot_throughput(rows, tmp_path / "q.png") is not None
    assert figures[1].axes[0].get_ylim() == pytest.approx((0.001 / 2, 2.0 * 2))


@pytest.mark.parametrize("rows", [[], [_row("none", 10, 5.0, 1.0, peak=0)], [_row("nan", 10, math.nan, 2.0)],
                                  [_row("a", 10, 1.0, 0.0)]])
def test_nothing_to_plot_writes_nothing(tmp_path, figures, rows):
    assert plot.plot_throughput(rows, tmp_path / "p.png") is None
    assert not (tmp_path / "p.png").exists() and figures == []


def test_labels_of_one_place_take_the_free_offsets_and_the_first_when_none_is_free(tmp_path, figures):
    """Eleven points at one place: the first label right of and above its marker, the next nine where no
    label or marker is (ten offsets), the eleventh back at the first offset."""
    rows = [_row(f"m{i:02d}", 10, 1.0, 2.0) for i in range(11)]
    plot.plot_throughput(rows, tmp_path / "p.png")
    (ax,) = figures[0].axes
    boxes = [_boxes(ax, a) for a in ax.texts]
    assert boxes[0][:2] == pytest.approx((6, 4))
    marker = (-5, -5, 5, 5)
    for i, b in enumerate(boxes[:10]):
        assert not _overlap(b, marker), (i, b)
        assert not any(_overlap(b, o) for o in boxes[:i]), (i, b, boxes[:i])
    assert boxes[10] == pytest.approx(boxes[0])


def test_finite_positive_means_a_number_above_zero():
    assert [plot._finite_positive(v) for v in (1, 0.5, 1e-300, 0, -1.0, math.inf, math.nan, None, "3")] == \
        [True, True, True, False, False, False, False, False, False]


# -- gradpress bench compressors --------------------------------------------------------------------------------------
@pytest.fixture
def bench(monkeypatch):
    """The benchmark and the plot replaced by recorders; the benchmark returns one finite and one
    non-finite row."""
    import gradpress.bench.compressors as cmd

    seen: dict = {}

    def run_benchmark(*args):
        seen["args"] = args
        seen["threads_during"] = torch.get_num_threads()
        args[7]("a log line")
        row = {"compressor": "fp16", "numel": 1000, "encode_gbps": 1.5, "decode_gbps": math.inf,
               "encode_roofline_fraction": 0.5, "ratio": 2.0, "wire_bytes": 2000, "rel_error": math.nan,
               "density_quality": None, "speedup_vs_topk": None, "peak_temp_ratio": 1.0}
        return {"rows": [row], "roofline": {"1000": 3.0}, "targets": [], "skipped": []}

    def plot_throughput(rows, path, title=""):
        seen["plot"] = (rows, Path(path), title)
        return seen.get("png")

    threads = torch.get_num_threads()
    monkeypatch.setattr(cmd, "run_benchmark", run_benchmark)
    monkeypatch.setattr(plot, "plot_throughput", plot_throughput)
    yield seen
    torch.set_num_threads(threads)


def test_the_command_hands_its_parsed_arguments_to_the_benchmark(tmp_path, capsys, bench, monkeypatch):
    torch.set_num_threads(2)
    out, js = tmp_path / "o", tmp_path / "r.json"
    rc = main(["bench", "compressors", "--compressors", "fp16,topk:ratio=0.01", "--sizes", "2K,1000",
               "--data", "laplace", "--repeats", "3", "--warmup", "2", "--seed", "7", "--threads", "1",
               "--variants", " eager, ,hand", "--out", str(out), "--json", str(js)])
    assert rc == 0
    specs, sizes, device, data, repeats, warmup, seed, log, variants, all_threads = bench["args"]
    assert (specs, sizes, device, data, repeats, warmup, seed) == (
        ["fp16", "topk:ratio=0.01"], [2000, 1000], "cpu", "laplace", 3, 2, 7)
    assert variants == ("eager", "hand") and all_threads == 2 and bench["threads_during"] == 1
    captured = capsys.readouterr()
    assert "a log line\n" in captured.err and "a log line" not in captured.out
    assert bench["plot"][1:] == (out / "bench.png", "encode throughput vs ratio, 2,000 elements, laplace, cpu")
    assert [r["compressor"] for r in bench["plot"][0]] == ["fp16"]
    assert "plot:" not in captured.out  # nothing drawn
    assert captured.out.splitlines()[-1] == f"json: {js}"
    assert "fp16" in captured.out and "copy roofline at 1,000 elements: 3.00 GB/s" in captured.out
    saved = json.loads(js.read_text())
    assert saved["rows"][0]["decode_gbps"] == "inf" and saved["rows"][0]["rel_error"] is None
    assert saved["command"] == ("gradpress bench compressors --compressors fp16,topk:ratio=0.01 --sizes 2K,1000 "
                                "--device cpu --data laplace --repeats 3 --threads 1 --variants  eager, ,hand")


def test_the_command_defaults_and_the_plot_line(tmp_path, capsys, bench, monkeypatch):
    monkeypatch.chdir(tmp_path)
    bench["png"] = tmp_path / "bench-results" / "bench.png"
    torch.set_num_threads(1)
    assert main(["bench", "compressors"]) == 0
    specs, sizes, device, data, repeats, warmup, seed, _, variants, all_threads = bench["args"]
    assert (sizes, device, data, repeats, warmup, seed, variants, all_threads) == (
        [10**6, 25 * 10**6], "cpu", "gaussian", 5, 1, 0, ("default",), 1)
    assert len(specs) > 10  # all
    assert bench["plot"][1:] == (Path("bench-results") / "bench.png",
                                 "encode throughput vs ratio, 25,000,000 elements, gaussian, cpu")
    out = capsys.readouterr().out
    assert out.splitlines()[-1] == f"plot: {bench['png']}" and "json:" not in out


@pytest.mark.parametrize(("argv", "message"), [
    (["--variants", "fast"], "--variants got 'fast'; allowed: comma-separated default, compiled, eager, hand"),
    (["--variants", ","], "--variants got ','; allowed: comma-separated"),
    (["--variants", "eager,fast"], "--variants got 'eager,fast'"),
    (["--json", ""], "--json got ''; allowed: a file path"),
])
def test_bad_variants_and_outputs_are_refused_naming_the_option(tmp_path, capsys, bench, argv, message):
    assert main(["bench", "compressors", "--out", str(tmp_path / "o"), *argv]) == 2
    assert message in capsys.readouterr().err and "args" not in bench


def test_an_out_that_is_a_file_is_refused(tmp_path, capsys, bench):
    (tmp_path / "f").write_text("x")
    assert main(["bench", "compressors", "--out", str(tmp_path / "f")]) == 2
    assert "which is a file; allowed: a directory" in capsys.readouterr().err and "args" not in bench


def test_cuda_is_refused_where_there_is_none(tmp_path, capsys, bench, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["bench", "compressors", "--device", "cuda", "--out", str(tmp_path)]) == 2
    assert "--device got 'cuda' but CUDA is not available" in capsys.readouterr().err and "args" not in bench
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert main(["bench", "compressors", "--device", "cuda", "--out", str(tmp_path)]) == 0
    assert bench["args"][2] == "cuda"


# -- the demo ---------------------------------------------------------------------------------------------------------
def test_the_demo_picks_the_first_registered_of_its_preferences(monkeypatch):
    monkeypatch.setattr(demo, "names", lambda: ["bf16", "natural", "qsgd", "topk", "fp16", "other"])
    assert demo.pick() == ["fp16", "topk:ratio=0.01", "qsgd", "natural"]
    assert demo.pick(2) == ["fp16", "topk:ratio=0.01"]
    monkeypatch.setattr(demo, "names", lambda: ["bf16", "none", "powersgd"])
    assert demo.pick() == ["none", "powersgd", "bf16"]


def test_the_demo_runs_compare_and_says_where_the_results_are(tmp_path, capsys, monkeypatch):
    calls = []
    result = [{"metric": "test_acc", "target": 0.123456}, {"metric": "test_acc", "target": 0.123456}]

    def run(specs, options, *, out):
        calls.append((specs, options, out))
        return result

    monkeypatch.setattr(demo.compare, "run", run)
    monkeypatch.setattr(demo.compare, "table", lambda r: "THE TABLE" if r is result else "another")
    monkeypatch.setattr(demo, "names", lambda: ["none", "fp16", "qsgd"])
    assert demo.main(["--out", str(tmp_path / "d"), "--nproc", "3"]) == 0
    assert calls == [(["none", "fp16", "qsgd"], {"nproc": 3, "eval_every": 50}, str(tmp_path / "d"))]
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "gradpress demo: mnist1d-cnn on 3 workers with none, fp16, qsgd"
    assert "THE TABLE" in lines
    assert "target test_acc 0.1235 = 95% of the none run's final value" in lines
    assert lines[-1] == f"table: {tmp_path}/d/compare.md   plot: {tmp_path}/d/compare.png   data: {tmp_path}/d/compare.json"
    calls.clear()
    assert demo.main([]) == 0
    assert calls[0][1:] == ({"nproc": 2, "eval_every": 50}, "runs/demo")
