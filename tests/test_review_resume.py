"""Review D: what a resumed training run must carry over from its checkpoint
besides the model (the divergence step), and which resumes are the same run
(a compressor spelled another way)."""

from __future__ import annotations

import pytest
from refusals import forbid

from gradpress import train
from gradpress.train import checkpoint


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


@pytest.mark.parametrize("saved,given", [("topk", "topk:ratio=0.01"), ("qsgd:levels=16,bucket=512", "qsgd"),
                                         ("topk:ratio=0.01", "topk:ratio=1e-2")])
def test_resume_accepts_the_same_compressor_spelled_another_way(tmp_path, saved, given):
    """Defaults written out or not, the compressor is the same and the run
    continues exactly: resuming must not be refused."""
    ck = train.make_config({"workload": "digits-mlp", "out": str(tmp_path), "compressor": saved})
    cfg = train.make_config({"workload": "digits-mlp", "out": str(tmp_path), "compressor": given})
    state = {"format": checkpoint.FORMAT, "config": checkpoint.compat(ck, 2)}
    checkpoint.check_resume(state, cfg, 2)
    other = train.make_config({"workload": "digits-mlp", "out": str(tmp_path), "compressor": "topk:ratio=0.02"})
    with pytest.raises(ValueError, match=r"compressor: checkpoint has .*, this run has 'topk:ratio=0.02'"):
        checkpoint.check_resume(state, other, 2)


def test_a_batch_larger_than_a_workers_shard_fails_before_any_worker_starts(tmp_path, monkeypatch):
    """docs/train.md: bad values fail before any worker starts. 256 samples
    over 2 workers leave 128 per worker: batch 200 gives no full batch."""
    import torch.distributed.launcher.api as elastic

    forbid(monkeypatch, "workers were started", (elastic, "elastic_launch"))
    with pytest.raises(ValueError, match=r"batch_size 200 x 2 workers exceeds the 256 training samples"):
        train.run({"workload": "digits-mlp", "hidden": 8, "samples": 256, "batch_size": 200, "nproc": 2,
                   "out": str(tmp_path), "progress": False})


def test_resume_keeps_the_metrics_lines_before_a_torn_last_line(tmp_path):
    """A run that died while rank 0 appended a metrics line (disk full, power
    loss) leaves half a line at the end of metrics.jsonl. Resuming keeps the
    complete lines up to the checkpoint's step and drops the torn one; it
    raised json.JSONDecodeError on rank 0 alone, and the other ranks then
    waited in a collective for --timeout (a 2-worker resume hung)."""
    import json

    from gradpress.train.report import METRICS, MetricsLog

    rows = [{"step": s, "loss": 2.0 - s / 10, "bytes": 100.0} for s in range(1, 6)]
    text = "".join(json.dumps(r) + "\n" for r in rows)
    (tmp_path / METRICS).write_text(text + '{"step": 6, "loss": 1.4, "by')
    MetricsLog(tmp_path, 0, resumed_at=4)
    kept = [json.loads(line) for line in (tmp_path / METRICS).read_text().splitlines()]
    assert kept == rows[:4]


@pytest.mark.parametrize("saved,given", [
    ("hierarchical", "hierarchical:chunk=262144"),
    ("hierarchical:chunk=262144,outer=collective", "hierarchical:outer=collective,chunk=262144"),
    ("hierarchical:workers_per_host=0,outer=collective,chunk=262144", "hierarchical"),
    ("hierarchical:chunk=2.62144e5", "hierarchical:chunk=262144"),
    ("ring", "ring:"),
])
def test_resume_accepts_the_same_strategy_spelled_another_way(tmp_path, saved, given):
    """As for compressors: defaults written out or not, parameters in another
    order, the strategy is the same and the run continues exactly, so the
    resume must not be refused (it compared the raw text)."""
    from gradpress.exchange.strategies.hierarchical import CHUNK

    assert CHUNK == 262144  # the default the specs above spell out
    ck = train.make_config({"workload": "digits-mlp", "out": str(tmp_path), "strategy": saved})
    cfg = train.make_config({"workload": "digits-mlp", "out": str(tmp_path), "strategy": given})
    state = {"format": checkpoint.FORMAT, "config": checkpoint.compat(ck, 2)}
    checkpoint.check_resume(state, cfg, 2)
    checkpoint.check_resume({"format": checkpoint.FORMAT, "config": checkpoint.compat(cfg, 2)}, ck, 2)


@pytest.mark.parametrize("saved,given", [
    ("hierarchical", "hierarchical:chunk=0"),
    ("hierarchical:outer=ring", "hierarchical"),
    ("hierarchical", "ring"),
    ("collective", "allgather"),
])
def test_resume_still_refuses_a_different_strategy(tmp_path, saved, given):
    """A real change of strategy (or of one of its parameters) is refused,
    naming the field and both values as given."""
    ck = train.make_config({"workload": "digits-mlp", "out": str(tmp_path), "strategy": saved})
    cfg = train.make_config({"workload": "digits-mlp", "out": str(tmp_path), "strategy": given})
    state = {"format": checkpoint.FORMAT, "config": checkpoint.compat(ck, 2)}
    with pytest.raises(ValueError, match=rf"strategy: checkpoint has {saved!r}, this run has {given!r}"):
        checkpoint.check_resume(state, cfg, 2)


def test_a_resumed_run_accepts_the_strategy_with_its_defaults_spelled_out(tmp_path):
    """End to end: `gradpress train --strategy hierarchical`, then
    `--resume --strategy hierarchical:chunk=<default>` continues the run."""
    from gradpress.exchange.strategies.hierarchical import CHUNK

    common = dict(workload="digits-mlp", hidden=8, samples=64, batch_size=16, optimizer="sgd", lr=0.1,
                  log_every=1, progress=False, nproc=1, out=str(tmp_path))
    first = train.run(dict(common, epochs=1, strategy="hierarchical"))
    resumed = train.run(dict(common, epochs=2, strategy=f"hierarchical:outer=collective,chunk={CHUNK}", resume=True))
    assert resumed["steps"] == 2 * first["steps"]


@pytest.mark.parametrize("saved,given,env", [
    ("hierarchical:workers_per_host=2", "hierarchical", {"GRADPRESS_WORKERS_PER_HOST": "2"}),
    ("hierarchical:workers_per_host=2", "hierarchical", {"LOCAL_WORLD_SIZE": "2"}),
    ("hierarchical", "hierarchical:workers_per_host=2,outer=collective", {"LOCAL_WORLD_SIZE": "2"}),
])
def test_resume_compares_the_resolved_host_layout(tmp_path, monkeypatch, saved, given, env):
    """`hierarchical:workers_per_host=2` and `hierarchical` with the environment saying 2 ranks per host run one
    layout; the resume compared workers_per_host=2 with 0 and refused. Another layout is still refused."""
    from gradpress.exchange.strategies.hierarchical_layout import ENV_VARS

    for var in ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    ck = train.make_config({"workload": "digits-mlp", "out": str(tmp_path), "strategy": saved})
    cfg = train.make_config({"workload": "digits-mlp", "out": str(tmp_path), "strategy": given})
    checkpoint.check_resume({"format": checkpoint.FORMAT, "config": checkpoint.compat(ck, 4)}, cfg, 4)
    checkpoint.check_resume({"format": checkpoint.FORMAT, "config": checkpoint.compat(cfg, 4)}, ck, 4)
    other = train.make_config({"workload": "digits-mlp", "out": str(tmp_path), "strategy": "hierarchical:workers_per_host=4"})
    with pytest.raises(ValueError, match=r"strategy: checkpoint has 'hierarchical:workers_per_host=4'"):
        checkpoint.check_resume({"format": checkpoint.FORMAT, "config": checkpoint.compat(other, 4)}, cfg, 4)


def test_a_resumed_local_run_takes_the_layout_its_workers_will_have(tmp_path, monkeypatch):
    """End to end: `train --nproc 2 --strategy hierarchical:workers_per_host=2`, then `--resume --strategy
    hierarchical`, whose workers get LOCAL_WORLD_SIZE=2 from the launcher: the same layout, so the run continues
    (the launcher refused it before any worker started)."""
    from gradpress.exchange.strategies.hierarchical_layout import ENV_VARS

    for var in ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    common = dict(workload="digits-mlp", hidden=8, samples=64, batch_size=16, optimizer="sgd", lr=0.1,
                  log_every=1, progress=False, nproc=2, out=str(tmp_path), timeout=60.0)
    first = train.run(dict(common, epochs=1, strategy="hierarchical:workers_per_host=2"))
    resumed = train.run(dict(common, epochs=2, strategy="hierarchical", resume=True))
    assert resumed["steps"] == 2 * first["steps"]


def test_a_bad_host_layout_environment_on_resume_is_named(tmp_path, monkeypatch):
    """A resume whose environment gives no host layout (`GRADPRESS_WORKERS_PER_HOST=two`) is refused
    naming the variable and what is allowed, not as a checkpoint of a different configuration (the
    comparison swallowed the environment's error and reported 'strategy: checkpoint has ...')."""
    from gradpress.exchange.strategies.hierarchical_layout import ENV_VARS

    for var in ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    ck = train.make_config({"workload": "digits-mlp", "out": str(tmp_path), "strategy": "hierarchical:workers_per_host=2"})
    cfg = train.make_config({"workload": "digits-mlp", "out": str(tmp_path), "strategy": "hierarchical"})
    monkeypatch.setenv("GRADPRESS_WORKERS_PER_HOST", "two")
    with pytest.raises(ValueError, match=r"GRADPRESS_WORKERS_PER_HOST='two': allowed: a positive integer"):
        checkpoint.check_resume({"format": checkpoint.FORMAT, "config": checkpoint.compat(ck, 4)}, cfg, 4)
