"""``gradpress train --tensorboard DIR``: event files with the loss, the
metric, bytes per step (equal to ``metrics.jsonl``'s), the compression ratio
(equal to the summary's), compress/comm seconds, and the consensus distance
of a gossip algorithm; read back with TensorBoard's ``EventAccumulator``.
Also: the tag vocabulary of :func:`gradpress.tensorboard.stats_scalars`, and
a clear error when TensorBoard is not installed."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

from gradpress import train
from gradpress.cli import main as cli
from gradpress.tensorboard import STATS_TAGS, stats_scalars

HAVE_TB = importlib.util.find_spec("tensorboard") is not None
needs_tb = pytest.mark.skipif(not HAVE_TB, reason="TensorBoard is not installed (pip install 'gradpress[tensorboard]')")
COMMON = ["train", "--nproc", "2", "--workload", "digits-mlp", "--hidden", "16", "--samples", "256",
          "--batch-size", "16", "--steps", "4", "--log-every", "1", "--no-progress", "--min-numel", "64"]


def test_stats_scalars_names_every_stat_and_drops_what_is_missing_or_not_finite() -> None:
    stats = {"last_step_bytes": 100, "last_step_dense_bytes": 400, "ratio": 4.0, "compress_s": 0.5,
             "comm_s": 0.25, "consensus_distance": 0.1, "steps": 3}
    assert stats_scalars(stats) == {
        "gradpress/bytes_per_step": 100.0, "gradpress/dense_bytes_per_step": 400.0,
        "gradpress/compression_ratio": 4.0, "gradpress/compress_s": 0.5, "gradpress/comm_s": 0.25,
        "gradpress/consensus_distance": 0.1}
    assert set(stats_scalars(stats)) == set(STATS_TAGS)
    assert stats_scalars(stats, bytes_per_step=50.5)["gradpress/bytes_per_step"] == 50.5
    assert stats_scalars({"ratio": math.nan, "comm_s": None, "compress_s": True}) == {}


def test_tensorboard_flag_fails_clearly_without_tensorboard(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # import tensorboard -> ImportError
    with pytest.raises(ValueError, match=r"gradpress\[tensorboard\]"):
        train.make_config({"workload": "digits-mlp", "tensorboard": "tb"})
    with pytest.raises(ValueError, match="tensorboard must be a directory path"):
        train.make_config({"workload": "digits-mlp", "tensorboard": 3})


@pytest.mark.slow
@needs_tb
def test_train_writes_loss_metric_bytes_ratio_and_seconds(tmp_path) -> None:
    from integration_helpers import scalar_tags

    tb = tmp_path / "tb"
    assert cli([*COMMON, "--compressor", "topk:ratio=0.1", "--out", str(tmp_path / "run"), "--tensorboard", str(tb)]) == 0
    tags = scalar_tags(tb)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert tags["gradpress/loss"] == pytest.approx([r["loss"] for r in rows])
    assert tags["gradpress/bytes_per_step"] == [r["bytes"] for r in rows]
    assert tags["gradpress/metric"] == pytest.approx([summary["final_metric"]])
    assert tags["gradpress/compression_ratio"][-1] == pytest.approx(summary["compression_ratio"])
    assert summary["compression_ratio"] > 3
    assert tags["gradpress/compress_s"][-1] == pytest.approx(summary["compress_s"])
    assert tags["gradpress/comm_s"][-1] == pytest.approx(summary["comm_s"])
    assert "gradpress/consensus_distance" not in tags  # synchronous DDP has none


@pytest.mark.slow
@needs_tb
def test_train_writes_the_consensus_distance_of_a_gossip_algorithm(tmp_path) -> None:
    from integration_helpers import scalar_tags

    tb = tmp_path / "tb"
    assert cli([*COMMON, "--algorithm", "dpsgd", "--out", str(tmp_path / "run"), "--tensorboard", str(tb)]) == 0
    tags = scalar_tags(tb)
    assert len(tags["gradpress/loss"]) == 4 and len(tags["gradpress/bytes_per_step"]) == 4
    distance = tags["gradpress/consensus_distance"]
    assert distance and all(math.isfinite(d) and d >= 0 for d in distance)


def _dir_scalars(logdir: Path, tag: str) -> list[tuple[int, float]]:
    """(step, value) of ``tag`` over the whole log directory, read as
    TensorBoard reads it (event files in order, purges applied)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


@needs_tb
def test_a_resumed_run_purges_the_events_the_interrupted_run_wrote_past_its_checkpoint(tmp_path) -> None:
    """The interrupted run checkpointed at step 4 and logged steps 5 and 6
    before it died; the resumed run logs 5..8 again. TensorBoard must show
    each step once, with the resumed run's values (as metrics.jsonl does)."""
    from torch.utils.tensorboard import SummaryWriter

    common = dict(workload="digits-mlp", hidden=8, samples=64, batch_size=16, epochs=2, optimizer="sgd", lr=0.1,
                  log_every=1, progress=False)
    tb, out = tmp_path / "tb", str(tmp_path / "run")
    train.run(dict(common, out=out, steps=4, tensorboard=str(tb)))  # one epoch, checkpointed at step 4
    stale = SummaryWriter(log_dir=str(tb))  # what the interrupted run wrote after its checkpoint
    for step in (5, 6):
        stale.add_scalar("gradpress/loss", 1e6, step)
    stale.close()
    train.run(dict(common, out=out, resume=True, tensorboard=str(tb)))
    rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    got = _dir_scalars(tb, "gradpress/loss")
    assert [s for s, _ in got] == [r["step"] for r in rows] == list(range(1, 9))
    assert [v for _, v in got] == pytest.approx([r["loss"] for r in rows])
