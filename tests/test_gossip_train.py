"""Gossip through ``gradpress train``: evaluation of the consensus model,
the summary's fields and an exact resume with messages in flight."""

from __future__ import annotations

import json

import pytest
import torch

from gradpress.cli import main as cli


def _rows(out):  # noqa: ANN001, ANN202
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_sgp_with_overlap_and_compression_trains_and_resumes_exactly(tmp_path, capsys) -> None:  # noqa: ANN001
    spec = "sgp:peers=1,overlap=1,gamma=0.5"
    common = ["train", "--nproc", "2", "--workload", "digits-mlp", "--hidden", "16", "--samples", "256",
              "--batch-size", "16", "--epochs", "2", "--algorithm", "sgp:overlap=1,gamma=0.5", "--compressor",
              "topk:ratio=0.1", "--min-numel", "64", "--log-every", "1", "--no-progress"]
    full, part = tmp_path / "full", tmp_path / "part"
    assert cli([*common, "--out", str(full)]) == 0
    # the line leaves peers=1 (the default) out; summary.json has the canonical spec
    assert "digits-mlp / sgp:overlap=1,gamma=0.5 / topk:ratio=0.1 on 2 worker(s): 16 steps" in capsys.readouterr().out
    s = json.loads((full / "summary.json").read_text())
    assert (s["algorithm"], s["compressor"], s["strategy"], s["error_feedback"]) == (
        spec, "topk:ratio=0.1", "gossip", True)
    assert s["compression_ratio"] > 2 and s["final_metric"] > 0.15  # 10 classes: chance is 0.1
    assert cli([*common, "--out", str(part), "--steps", "8"]) == 0  # 8 steps per epoch: stop after the first
    ckpt = torch.load(part / "checkpoint.pt", weights_only=True)
    extra = [ckpt["ranks"][r]["algorithm"]["extra"] for r in range(2)]
    assert all(len(e["inflight"]) == 1 for e in extra)  # overlap=1: one round in flight at the checkpoint
    assert not torch.equal(extra[0]["x"][0], extra[1]["x"][0])  # replicas differ: each rank's state is saved
    assert cli([*common, "--out", str(part), "--resume"]) == 0
    assert [r["loss"] for r in _rows(full)] == [r["loss"] for r in _rows(part)]
    assert [r.get("metric") for r in _rows(full)] == [r.get("metric") for r in _rows(part)]
    assert json.loads((part / "summary.json").read_text())["bytes_total"] == s["bytes_total"]
    # metrics.jsonl carries the consensus distance of every evaluation (issue 17); the last one
    # is recomputed here in float64 from the per-rank models of the final checkpoint
    evaluated = [r for r in _rows(full) if "metric" in r]
    assert evaluated and all("consensus_distance" in r for r in evaluated)
    assert [r["consensus_distance"] for r in evaluated] == [r.get("consensus_distance") for r in _rows(part)
                                                             if "metric" in r]
    final = torch.load(full / "checkpoint.pt", weights_only=True)["ranks"]
    names = [k for k in final[0]["model"] if k.endswith(("weight", "bias"))]
    xs = [torch.cat([final[r]["model"][k].double().flatten() for k in names]) for r in range(2)]
    mean = (xs[0] + xs[1]) / 2
    expected = sum(float((x - mean).norm()) for x in xs) / 2 / float(mean.norm())
    # the code's x_bar is the consensus model, averaged in the model's float32: its rounding (6e-8 of |x|
    # per entry) against a distance of ~1e-2 of |x| moves the figure by ~1e-9 relative (seen: 1.3e-9),
    # so 1e-6 bounds rounding; a wrong formula (no square root, no 1/n, another norm) is off by far more
    assert expected > 0 and evaluated[-1]["consensus_distance"] == pytest.approx(expected, rel=1e-6)
