"""gradpress from PyTorch Lightning: ``Trainer(strategy=GradpressStrategy(...),
callbacks=[GradpressCallback()], devices=2, accelerator="cpu")`` on gloo.

One run trains 4 steps with top-k (bytes per step asserted against the
compressor's own packet sizes), saves a checkpoint; a second run resumes
from it: each rank's compression state (residuals, step, stats) is restored
equal to what that rank saved, and training continues from step 4. The stats
reach Lightning's TensorBoard logger at every step (``log_every_n_steps=1``:
tags, steps and values read back from the event files, against the bytes the
test computes).

Both runs share one launch (each process imports Lightning, about 7 s of
CPU; suitespeed session), each with a fresh ``Trainer``, strategy, model and
hook: the second ``fit`` finds ``LOCAL_RANK`` set by Lightning's launcher on
rank 0 (``LightningEnvironment.creates_processes_externally``) and the
process group up, so it starts no process and restores the compression state
from the checkpoint file only (gradpress keeps no state outside the hook).

This file is also the worker script: Lightning's launcher starts it again
for rank 1 with the same arguments.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

LIGHTNING = all(importlib.util.find_spec(m) is not None for m in ("lightning", "tensorboard"))
SPEC = "topk:ratio=0.1"
MIN_NUMEL = 256
BATCH, SAMPLES = 8, 64  # 64 samples / 2 ranks / 8 = 4 steps per epoch


def _model_layers():  # noqa: ANN202
    import torch.nn as nn

    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4))


def _fit_once(out: str, max_steps: int, ckpt: str | None) -> None:
    """One Lightning fit on 2 CPU processes (Lightning launches rank 1 at the first)."""
    import lightning as L
    import torch
    import torch.nn.functional as F
    from lightning.pytorch.loggers import TensorBoardLogger
    from torch.utils.data import DataLoader, TensorDataset

    from gradpress.lightning import GradpressCallback, GradpressStrategy

    torch.set_num_threads(1)

    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = _model_layers()

        def training_step(self, batch, batch_idx):  # noqa: ANN001,ANN201
            x, y = batch
            loss = F.mse_loss(self.net(x), y)
            self.log("loss", loss)
            return loss

        def configure_optimizers(self):  # noqa: ANN201
            return torch.optim.SGD(self.parameters(), lr=0.1)

    class Probe(L.Callback):
        """Saves this rank's hook state as training starts (after the
        restore) and as it ends."""

        def on_train_start(self, trainer, pl_module) -> None:  # noqa: ANN001
            state = trainer.strategy.gradpress_state
            torch.save(state.state_dict(), os.path.join(out, f"start-{max_steps}-rank{trainer.global_rank}.pt"))

        def on_train_end(self, trainer, pl_module) -> None:  # noqa: ANN001
            state = trainer.strategy.gradpress_state
            torch.save({"state": state.state_dict(), "stats": dict(state.stats)},
                       os.path.join(out, f"end-{max_steps}-rank{trainer.global_rank}.pt"))

    g = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, 16, generator=g)
    data = DataLoader(TensorDataset(x, torch.tanh(x[:, :4])), batch_size=BATCH)
    trainer = L.Trainer(
        strategy=GradpressStrategy(SPEC, options={"min_numel": MIN_NUMEL}, timeout=__import__("datetime").timedelta(seconds=60)),
        callbacks=[GradpressCallback(), Probe()], devices=2, accelerator="cpu", max_steps=max_steps,
        logger=TensorBoardLogger(out, name="tb", version=f"steps{max_steps}"), log_every_n_steps=1,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Tiny(), data, ckpt_path=ckpt)
    trainer.save_checkpoint(os.path.join(out, f"steps{max_steps}.ckpt"))


def _worker(out: str) -> None:
    """The test's two fits: 4 steps, then 8 resumed from the 4-step checkpoint."""
    _fit_once(out, 4, None)
    _fit_once(out, 8, os.path.join(out, "steps4.ckpt"))


# --------------------------------------------------------------------------- the test
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not LIGHTNING, reason="PyTorch Lightning or TensorBoard is not "
                                 "installed (pip install 'gradpress[lightning,tensorboard]')")]


def _fit(out) -> None:  # noqa: ANN001
    from integration_helpers import run_command

    run_command([sys.executable, __file__, str(out)], timeout=200)


def test_lightning_trains_compresses_and_resumes_with_its_compression_state(tmp_path) -> None:
    import torch
    from integration_helpers import expected_step_bytes, scalar_events

    _fit(tmp_path)
    first = [torch.load(tmp_path / f"end-4-rank{r}.pt", weights_only=True) for r in range(2)]
    for r in range(2):
        stats = first[r]["stats"]
        sent, dense = expected_step_bytes(_model_layers(), SPEC, MIN_NUMEL)
        assert stats["steps"] == 4
        assert stats["last_step_bytes"] == sent and stats["last_step_dense_bytes"] == dense
        assert stats["ratio"] == pytest.approx(dense / sent)
        assert stats["ratio"] > 3
    ckpt = torch.load(tmp_path / "steps4.ckpt", weights_only=True)  # loads without pickle
    assert ckpt["gradpress"]["world_size"] == 2 and len(ckpt["gradpress"]["ranks"]) == 2

    for r in range(2):
        saved, restored = first[r]["state"], torch.load(tmp_path / f"start-8-rank{r}.pt", weights_only=True)
        assert restored["step"] == 4
        residuals = saved["feedback"]["residuals"]
        assert residuals and any(t.abs().sum() > 0 for t in residuals.values())
        assert residuals.keys() == restored["feedback"]["residuals"].keys()
        for key, tensor in residuals.items():
            assert torch.equal(tensor, restored["feedback"]["residuals"][key]), key
        if r == 1:  # ranks keep their own residuals
            assert any(not torch.equal(t, first[0]["state"]["feedback"]["residuals"][k]) for k, t in residuals.items())
        end = torch.load(tmp_path / f"end-8-rank{r}.pt", weights_only=True)
        assert end["state"]["step"] == 8 and end["stats"]["steps"] == 8  # counts continue across the resume

    # log_every_n_steps=1: Lightning logs every step (rank 0's), the first run steps 0-3, the resumed one 4-7
    sent, dense = expected_step_bytes(_model_layers(), SPEC, MIN_NUMEL)
    for run, steps in (("steps4", range(4)), ("steps8", range(4, 8))):
        events = scalar_events(tmp_path / "tb" / run)
        for tag in ("gradpress/bytes_per_step", "gradpress/compression_ratio", "gradpress/compress_s",
                    "gradpress/comm_s"):
            assert tag in events, sorted(events)
        assert events["gradpress/bytes_per_step"] == [(s, float(sent)) for s in steps], (run, sent)
        assert events["gradpress/dense_bytes_per_step"] == [(s, float(dense)) for s in steps], (run, dense)
        ratios = events["gradpress/compression_ratio"]  # all steps so far: every step sends the same
        assert [s for s, _ in ratios] == list(steps) and all(r == pytest.approx(dense / sent) for _, r in ratios)


def test_callback_refuses_another_strategy_a_foreign_world_size_and_warns_without_state() -> None:
    from types import SimpleNamespace

    from gradpress.ddp import make_hook
    from gradpress.lightning import GradpressCallback

    with pytest.raises(ValueError, match="not GradpressStrategy"):
        GradpressCallback().on_save_checkpoint(SimpleNamespace(strategy=object()), None, {})
    state, _ = make_hook(SPEC)
    trainer = SimpleNamespace(strategy=SimpleNamespace(gradpress_state=state), global_rank=0, world_size=2)
    callback = GradpressCallback()
    checkpoint: dict = {}
    callback.on_save_checkpoint(trainer, None, checkpoint)
    assert "gradpress" not in checkpoint  # never bound: nothing exchanged, nothing to keep
    with pytest.warns(UserWarning, match="no 'gradpress' entry"):
        callback.on_load_checkpoint(trainer, None, {})
    saved = {"format": "gradpress-ranks/1", "world_size": 4, "ranks": [{}] * 4}
    with pytest.raises(ValueError, match="world_size: the checkpoint has 4, this run has 2"):
        callback.on_load_checkpoint(trainer, None, {"gradpress": saved})
    with pytest.raises(ValueError, match="format 'x'"):
        callback.on_load_checkpoint(trainer, None, {"gradpress": {"format": "x"}})
    state.close()


if __name__ == "__main__":
    _worker(sys.argv[1])
    from integration_helpers import leave

    leave()
