"""LGC through ``gradpress train`` on 2 workers: every phase runs in the
training loop, the summary carries LGC's fields, and a run resumed from the
checkpoint taken in phase 2 (autoencoder mid-training) logs exactly the
losses and bytes of the uninterrupted run, through phase 3."""

from __future__ import annotations

import json
from pathlib import Path

from gradpress.cli import main as cli

SPEC = "lgc:dense_steps=3,ae_steps=6,ratio=0.05,innovation=0.01,variant=ps"


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_lgc_trains_and_resumes_exactly_from_phase_2(tmp_path: Path) -> None:
    common = ["train", "--nproc", "2", "--workload", "digits-mlp", "--hidden", "16", "--samples", "256",
              "--batch-size", "16", "--epochs", "2", "--algorithm", SPEC, "--log-every", "1", "--no-progress"]
    full, part = tmp_path / "full", tmp_path / "part"
    assert cli([*common, "--out", str(full)]) == 0
    s = json.loads((full / "summary.json").read_text())
    assert s["steps"] == 16 and s["compressor"] == "none"  # LGC's own default: phase 1 dense
    assert s["ae_bytes"] > 0 and s["ae_loss"] is not None and s["ae_rel_error"] is not None
    rows = _rows(full)
    assert rows[0]["bytes"] > 10 * rows[-1]["bytes"]  # dense phase 1 vs latent phase 3
    assert cli([*common, "--out", str(part), "--steps", "8"]) == 0  # the checkpoint: step 8, in phase 2
    assert cli([*common, "--out", str(part), "--resume"]) == 0
    assert [r["loss"] for r in _rows(full)] == [r["loss"] for r in _rows(part)]
    assert json.loads((part / "summary.json").read_text())["bytes_total"] == s["bytes_total"]
