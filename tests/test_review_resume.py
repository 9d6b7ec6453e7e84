"""Review D: what a resumed training run must carry over from its checkpoint
besides the model (the divergence step)."""

from __future__ import annotations

from gradpress import train


def test_resume_keeps_the_step_the_loss_first_became_non_finite(tmp_path):
    """--allow-divergence: the run goes on past a NaN loss and checkpoints;
    a resumed run must report the step the loss *first* became non-finite,
    as the uninterrupted run does, not the first one after the resume."""
    common = dict(workload="digits-mlp", hidden=8, samples=64, batch_size=16, epochs=2, optimizer="sgd", lr=1e30,
                  log_every=1, progress=False, allow_divergence=True)
    full = train.run(dict(common, out=str(tmp_path / "full")))
    assert full["diverged_at_step"] is not None and full["diverged_at_step"] <= 4  # within the first epoch
    first = train.run(dict(common, out=str(tmp_path / "part"), steps=4))  # one epoch (64 // 16), checkpointed
    assert first["diverged_at_step"] == full["diverged_at_step"]
    resumed = train.run(dict(common, out=str(tmp_path / "part"), resume=True))
    assert resumed["steps"] == full["steps"]
    assert resumed["diverged_at_step"] == full["diverged_at_step"]
