"""The run, the profile and the command of ``gradpress bench e2e``
(bench/e2e_run.py, e2e_profile.py, e2e.py), pinned where the other bench
tests do not reach: written for survivors of ``make mutants`` (``e2e``
group; the worker is in test_mutants_e2e.py). The emulated cluster is a
stand-in that writes the per-rank results a test chose, so every expected
figure is computed here by its definition (the median of every rank's
compute-only steps, DDP's step time over a configuration's, the load drift
outside [0.9, 1.1]) or is the documented value; the profile's phases are
counted call by call. No namespace, no worker: about 2 s.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import gradpress.cluster as cluster_pkg
from gradpress.bench import e2e, e2e_profile, e2e_report, e2e_run
from gradpress.cli import build_parser
from gradpress.cluster.outcomes import RunResult

pytestmark = pytest.mark.mutants


class FakeCluster:
    """Stands in for EmulatedCluster: ``run`` writes, for the job's tag, the per-rank results of
    ``script[tag]`` (a list per call: the compute-only run is made twice), or fails ranks listed in
    ``fail[tag]``."""

    def __init__(self, script: dict, fail: dict | None = None) -> None:
        self.script, self.fail, self.calls = script, fail or {}, {}

    def __call__(self, nodes, bandwidth, workers_per_node=1, intra_bandwidth=None, logs=None):
        self.nodes, self.world, self.logs = nodes, nodes * workers_per_node, logs
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def link_stats(self, i):
        return {"tx_bytes": 0, "rx_bytes": 0, "tx_drops": 0, "rx_drops": 0}

    def run(self, argv, env, timeout, stream_rank0):
        job = json.loads(Path(argv[-1]).read_text())
        tag = job["tag"]
        k = self.calls[tag] = self.calls.get(tag, -1) + 1
        per_rank = self.script[tag][k] if isinstance(self.script[tag], list) and isinstance(self.script[tag][0], list) \
            else self.script[tag]
        codes = [0] * self.world
        for r in range(self.world):
            if r in self.fail.get(tag, ()):
                codes[r] = 1
                continue
            Path(job["result_dir"], f"{tag}-rank{r}.json").write_text(json.dumps(per_rank[r]))
        return RunResult(codes=codes, log_dir=self.logs, seconds=1.0)


def _args(tmp_path, *argv: str):
    size = [] if "--workload" in argv else ["--params", "200K"]
    return build_parser().parse_args(["bench", "e2e", "--nodes", "2", *size, "--out", str(tmp_path / "out"), *argv])


def _use(monkeypatch, fake: FakeCluster, ok: bool = True) -> None:
    monkeypatch.setattr(cluster_pkg, "EmulatedCluster", fake)
    monkeypatch.setattr(cluster_pkg, "check_support", lambda: SimpleNamespace(ok=ok))


def _compute(steps0, steps1, solo=0.12345):
    return [{"step_s": steps0, "median_step_s": statistics.median(steps0), "solo_median_step_s": solo,
             "parameters": 1234}, {"step_s": steps1, "median_step_s": statistics.median(steps1)}]


def _step(median):
    return [{"median_step_s": median, "step_s": [median], "payload_bytes_per_step": 100.0,
             "link_rx_bytes_per_step": 150.0, "link_tx_bytes_per_step": 125.0}] * 2


# ---------------------------------------------------------------- e2e_run.py
@pytest.mark.parametrize("after, note", [([1.1], False), ([0.9], False), ([1.125], True), ([0.875], True)])
def test_step_run_compute_median_speedups_and_notes(tmp_path, monkeypatch, capsys, after, note):
    """shared_s: the median of every rank's compute-only steps together; solo_s rank 0's alone; the
    speed-up: DDP's median step over the configuration's; a note when the compute-only step measured again
    at the end moved by more than 10%; PyTorch's PowerSGD's single bucket noted."""
    fake = FakeCluster({"compute": [_compute([0.5, 1.0, 3.0], [0.25, 1.5, 1.0]), _compute(after, after)],
                        "c00": _step(2.0), "c01": _step(0.5), "c02": _step(0.25)})
    _use(monkeypatch, fake)
    result = e2e_run.run_e2e(_args(tmp_path, "--baselines", "ddp,powersgd:rank=1", "--configs", "topk:ratio=0.01"))
    comp = result["compute"]
    assert comp["shared_s"] == statistics.median([0.5, 1.0, 3.0, 0.25, 1.5, 1.0]) == 1.0
    assert comp["solo_s"] == 0.12345 and comp["per_rank_s"] == [1.0, 1.0] and comp["parameters"] == 1234
    assert comp["shared_after_s"] == after[0]
    assert [r["speedup"] for r in result["rows"]] == [1.0, 4.0, 8.0]
    assert any("moved from 1.000 s (start) to" in n for n in result["notes"]) == note
    assert any("single DDP bucket" in n for n in result["notes"])
    assert not any("warm-up raised" in n for n in result["notes"])  # start 2 = --warmup 2: nothing raised
    assert result["setup"]["parameters"] == 1234 and result["setup"]["world"] == 2 and result["mode"] == "step"
    assert "e2e: compute-only 1.000 s/step shared, 0.123 s alone" in capsys.readouterr().err


def test_shared_compute_step_is_the_median_over_every_ranks_steps_not_rank_zeros(tmp_path, monkeypatch):
    """shared_s pools every rank's compute-only steps (the other test's data has the same median for rank 0
    alone and for both ranks, so a median of rank 0's steps only passed it)."""
    fake = FakeCluster({"compute": [_compute([0.5, 1.0, 3.0], [0.1, 0.2, 0.3]), _compute([0.4], [0.4])],
                        "c00": _step(2.0), "c01": _step(0.5)})
    _use(monkeypatch, fake)
    result = e2e_run.run_e2e(_args(tmp_path, "--baselines", "ddp", "--configs", "topk:ratio=0.01"))
    want = statistics.median([0.5, 1.0, 3.0, 0.1, 0.2, 0.3])  # 0.4; rank 0's alone: 1.0
    assert result["compute"]["shared_s"] == pytest.approx(want)
    assert result["compute"]["per_rank_s"] == [1.0, 0.2]


def test_step_run_notes_a_raised_warmup_and_gives_no_speedup_without_ddp(tmp_path, monkeypatch):
    fake = FakeCluster({"compute": _compute([1.0], [1.0]), "c00": _step(2.0), "c01": _step(0.5), "c02": _step(0.5)},
                       fail={"c00": [1]})
    _use(monkeypatch, fake)
    result = e2e_run.run_e2e(_args(tmp_path, "--baselines", "ddp,powersgd:rank=1", "--configs", "topk:ratio=0.1",
                                   "--warmup", "1"))
    assert [r["ok"] for r in result["rows"]] == [False, True, True]
    assert all(r.get("speedup") is None for r in result["rows"])  # the reference failed
    assert "warm-up raised to the compression start for: torch powersgd r=1 (2 steps)" in result["notes"]


def test_compute_failure_and_missing_support(tmp_path, monkeypatch):
    _use(monkeypatch, FakeCluster({"compute": _compute([1.0], [1.0])}, fail={"compute": [1]}))
    with pytest.raises(RuntimeError, match="compute-only run failed: exit code 1"):
        e2e_run.run_e2e(_args(tmp_path, "--baselines", "ddp", "--configs", "topk:ratio=0.1"))
    _use(monkeypatch, FakeCluster({}), ok=False)
    with pytest.raises(ValueError, match="the emulated cluster is not available here"):
        e2e_run.run_e2e(_args(tmp_path, "--baselines", "ddp", "--configs", "topk:ratio=0.1"))


def _train(time, parameters=None):
    r = {"reached": time is not None, "time_to_target_s": time, "metric": "bits_per_char", "higher_is_better": False}
    if parameters is not None:
        r["parameters"] = parameters
    return [r, r]


def test_train_run_speedups_where_both_reached_and_the_first_parameter_count(tmp_path, monkeypatch):
    """Train mode: the speed-up is DDP's time to target over the configuration's where both reached; the
    parameter count and the metric come from the first configuration whose rank 0 reported them."""
    fake = FakeCluster({"c00": _train(10.0), "c01": _train(4.0, parameters=777), "c02": _train(None, 5)})
    _use(monkeypatch, fake)
    result = e2e_run.run_e2e(_args(tmp_path, "--workload", "digits-mlp", "--train-to", "0.5", "--baselines", "ddp",
                                   "--configs", "topk:ratio=0.1,randomk:ratio=0.1"))
    assert [r.get("speedup") for r in result["rows"]] == [1.0, 2.5, None]
    assert result["compute"] is None and result["setup"]["parameters"] == 777
    assert result["setup"]["metric"] == "bits_per_char" and result["setup"]["higher_is_better"] is False
    fake = FakeCluster({"c00": _train(None, 9), "c01": _train(4.0)})
    _use(monkeypatch, fake)
    result = e2e_run.run_e2e(_args(tmp_path, "--workload", "digits-mlp", "--train-to", "0.5", "--baselines", "ddp",
                                   "--configs", "topk:ratio=0.1"))
    assert [r.get("speedup") for r in result["rows"]] == [None, None]  # DDP never reached: no ratio


# ---------------------------------------------------------------- e2e_profile.py
def test_median_s_is_the_median_of_each_calls_own_duration(monkeypatch):
    readings = [0.0, 0.5, 1.0, 1.25, 2.0, 2.125]  # 0.5, 0.25, 0.125 s
    monkeypatch.setattr(e2e_profile, "time", SimpleNamespace(perf_counter=lambda: readings.pop(0)))
    calls = []
    assert e2e_profile._median_s(lambda: calls.append(1), 3) == 0.25
    assert len(calls) == 3 and not readings


def test_profile_runs_each_phase_for_every_rank_and_averages_by_the_world(monkeypatch):
    """Every phase timed ``repeats`` times; per repeat: ``world - 1`` unpacks, ``world`` decodes of each
    packet, the finiteness check 3 times per gradient; the sparse average of ``world`` copies of a packet,
    divided by ``world``, is that packet decoded (the mean of equal terms)."""
    from gradpress.compress import create
    from gradpress.transport import wire

    counts = {"decode": 0, "unpack": 0, "finite": 0}
    sums = []
    comp = create("topk:ratio=0.1")
    real_decode, real_unpack, real_sum = comp.decode, wire.unpack_packets, e2e_profile.sparse_sum

    def decode(k):
        counts["decode"] += 1
        return real_decode(k)

    def unpack(*a):
        counts["unpack"] += 1
        return real_unpack(*a)

    def finite(t):
        counts["finite"] += 1
        return torch.tensor(True)

    def sparse_sum(values, indices, numel, dtype, out):
        assert len(indices) == len(values) == 3
        sums.append((indices[0], values[0], numel, real_sum(values, indices, numel, dtype, out)))
        return sums[-1][-1]

    comp.decode = decode
    monkeypatch.setattr(e2e_profile, "create", lambda spec: comp)
    monkeypatch.setattr(wire, "unpack_packets", unpack)
    monkeypatch.setattr(e2e_profile, "all_finite", finite)
    monkeypatch.setattr(e2e_profile, "sparse_sum", sparse_sum)
    shapes = [(20, 10), (4, 5)]
    phases = e2e_profile.profile("topk:ratio=0.1", shapes, world=3, repeats=2)
    assert list(phases) == ["compensate (g + e)", "encode", "residual", "pack", "unpack x2",
                            "average: decode x3 + dense fold", "average: sparse_sum of 3 packets",
                            "copy back (dense fold only)", "finite checks x3 (flags, output, residual)"]
    assert counts == {"decode": 2 * 3 * 2, "unpack": 2 * 2, "finite": 2 * 3 * 2}
    assert len(sums) == 2 * 2
    for idx, vals, numel, out in sums:
        want = torch.zeros(numel, dtype=torch.float64)
        want[idx.long()] = vals.double()  # 3 copies summed, / 3
        assert torch.allclose(out.double(), want, rtol=1e-6, atol=0)


# ---------------------------------------------------------------- e2e.py
def test_command_defaults_are_the_documented_ones():
    """docs/e2e.md and the options' help: 4 nodes of 1 worker at 100mbit, 5 measured steps after 2 warm-up,
    evaluation every 10 steps, 600 s per configuration, seed 0, out bench-results/e2e."""
    a = build_parser().parse_args(["bench", "e2e"])
    assert (a.nodes, a.workers_per_node, a.bandwidth, a.steps, a.warmup, a.eval_every, a.timeout, a.seed, a.out) == \
        (4, 1, "100mbit", 5, 2, 10, 600.0, 0, "bench-results/e2e")
    assert a.configs == "topk:ratio=0.001@allgather,powersgd:rank=4,start_iter=2"
    assert a.baselines == "ddp,fp16,powersgd:rank=1,powersgd:rank=4"
    assert (a.train_to, a.max_steps, a.time_limit, a.seeds, a.threads, a.workload) == (None,) * 6


def _result(ok=(True, True)):
    rows = [{"label": f"torch ddp {i}", "kind": "ddp", "ok": o, "error": None if o else "exit code 1"}
            for i, o in enumerate(ok)]
    return {"mode": "step", "command": "gradpress bench e2e --nodes 2", "rows": rows, "notes": [], "setup": {},
            "compute": None}


def test_main_exit_status_and_outputs(tmp_path, monkeypatch, capsys):
    """0 when every configuration ran, 1 when one failed or the run failed (one line on stderr); the
    outputs: e2e.json (the result), e2e.md (printed), e2e.png."""
    out = tmp_path / "out"
    drawn = []
    monkeypatch.setattr(e2e_report, "markdown", lambda r: "TABLE " + r["command"] + "\n")
    monkeypatch.setattr(e2e_report, "plot", lambda r, p: drawn.append(p) or p.write_bytes(b"png"))
    for ok, code in (((True, True), 0), ((True, False), 1)):
        monkeypatch.setattr(e2e, "run_e2e", lambda args, ok=ok: _result(ok))
        assert e2e.main(_args(tmp_path, "--configs", "fp16")) == code
        assert json.loads((out / "e2e.json").read_text()) == _result(ok)
        printed = capsys.readouterr().out
        assert printed.startswith("TABLE gradpress bench e2e --nodes 2\n")
        assert (out / "e2e.md").read_text() == "TABLE gradpress bench e2e --nodes 2\n"
        assert drawn[-1] == out / "e2e.png" and (out / "e2e.png").read_bytes() == b"png"
        assert f"written: {out / 'e2e.json'}, {out / 'e2e.md'}, {out / 'e2e.png'}" in printed

    def broken(args):
        raise RuntimeError("compute-only run failed: exit code 1")

    monkeypatch.setattr(e2e, "run_e2e", broken)
    assert e2e.main(_args(tmp_path, "--configs", "fp16")) == 1
    assert capsys.readouterr().err == "gradpress bench e2e: error: compute-only run failed: exit code 1\n"


def test_main_runs_every_seed_from_seed_on(tmp_path, monkeypatch, capsys):
    """--seeds N: N runs at --seed, --seed + 1, ...; the exit status the seeds' run reports."""
    import gradpress.bench.e2e_seeds as e2e_seeds

    out = tmp_path / "out"
    calls = []

    def run_seeds(args, seeds, command, ok=True):
        calls.append((seeds, command))
        out.mkdir(exist_ok=True)
        (out / "e2e.md").write_text("SEEDS\n")
        return None, calls[0][0] != seeds or len(calls) == 1

    monkeypatch.setattr(e2e_seeds, "run_seeds", run_seeds)
    argv = ("--workload", "digits-mlp", "--train-to", "0.5", "--seed", "5", "--seeds", "3")
    assert e2e.main(_args(tmp_path, *argv)) == 0
    assert calls[0][0] == [5, 6, 7] and calls[0][1].startswith("gradpress bench e2e")
    assert capsys.readouterr().out.startswith("SEEDS\n")
    assert e2e.main(_args(tmp_path, *argv)) == 1  # a seed's configuration failed

    def broken(*a):
        raise RuntimeError("seed 6 failed")

    monkeypatch.setattr(e2e_seeds, "run_seeds", broken)
    assert e2e.main(_args(tmp_path, *argv)) == 1
    assert capsys.readouterr().err == "gradpress bench e2e: error: seed 6 failed\n"


def test_a_step_row_without_link_counters_logs_no_ideal_instead_of_failing(tmp_path, monkeypatch, capsys):
    """A worker that reports no link counters (no GLOO_SOCKET_IFNAME: EmulatedCluster always sets it, a cluster
    of another kind may not) has no ideal step time; the progress line formatted it as a float (TypeError)."""
    bare = [{"median_step_s": 0.5, "step_s": [0.5], "payload_bytes_per_step": 100.0}] * 2
    _use(monkeypatch, FakeCluster({"compute": _compute([1.0], [1.0]), "c00": bare, "c01": bare}))
    result = e2e_run.run_e2e(_args(tmp_path, "--baselines", "ddp", "--configs", "topk:ratio=0.1"))
    assert [r["ok"] for r in result["rows"]] == [True, True]
    assert all(r["ideal_s"] is None and r["measured_over_ideal"] is None for r in result["rows"])
    assert "0.500 s/step, 100 B payload, ideal n/a" in capsys.readouterr().err
