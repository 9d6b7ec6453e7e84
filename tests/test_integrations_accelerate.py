"""gradpress from Hugging Face Accelerate and the Transformers Trainer, 2 CPU
processes under ``torchrun`` (gloo), one launch per framework.

* Accelerate: a run trains 4 steps with top-k registered by
  ``gradpress.accelerate.register`` (bytes per step asserted against the
  compressor's own packet sizes), ``accelerator.save_state``; a later run
  ``load_state``s it: each rank's compression state is restored equal to what
  it saved, and the next 4 steps equal those of a run that never stopped
  (losses, parameters and residuals, bit for bit). The stats reach Accelerate's
  TensorBoard tracker (tags read back from the event files).
* Trainer: a tiny GPT-2 built from a config (nothing downloaded) trains 4
  steps with ``attach_trainer``; the stats are in every log (and in
  TensorBoard through ``report_to="tensorboard"``), every step's bytes equal
  to the compressor's packets plus, as the Trainer's DDP finds unused
  parameters, one float32 used-flag per tensor; the checkpoint folder
  holds every rank's compression state, and a run resumed from it starts
  with that state.

The runs of one framework share one launch (a torchrun and its two workers
cost seconds of imports each; suitespeed session), each run with a fresh
``Accelerator`` or ``Trainer``, model, optimizer and hook, in this order:
Accelerate: 4 steps and ``save_state``, the 8 uninterrupted steps, then the
resume from the 4-step state; Trainer: 4 steps, then the resume from
``checkpoint-4`` to step 6. What a resumed run starts with is compared with
what the earlier run saved, and between the Accelerate save and its resume
the uninterrupted run trained further, so state kept in the process rather
than loaded from the checkpoint would show as a mismatch, not pass.
``accelerator.end_training()`` (which destroys the process group) ends the
last run only.

This file is also the worker script (``torchrun ... this_file MODE OUT``).
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

HAVE = all(importlib.util.find_spec(m) is not None for m in ("accelerate", "transformers", "tensorboard"))
SPEC = "topk:ratio=0.1"
MIN_NUMEL = 256


def _model_layers():  # noqa: ANN202
    import torch
    import torch.nn as nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4))


def _gpt2():  # noqa: ANN202
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2))


def _accelerate_run(out: str, steps: int, resume: str | None, last: bool) -> None:
    """One Accelerate run of ``steps`` steps (resumed from the state folder ``resume``)."""
    import torch
    import torch.nn.functional as F
    from accelerate import Accelerator
    from torch.utils.data import DataLoader, TensorDataset

    import gradpress.accelerate

    torch.set_num_threads(1)
    accelerator = Accelerator(cpu=True, log_with="tensorboard", project_dir=out)
    accelerator.init_trackers(f"acc{steps}")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 16, generator=g)
    data = DataLoader(TensorDataset(x, torch.tanh(x[:, :4])), batch_size=8)
    model = _model_layers()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, data = accelerator.prepare(model, opt, data)
    hook = gradpress.accelerate.register(accelerator, model, SPEC, min_numel=MIN_NUMEL, timeout=60)
    rank = accelerator.process_index
    if resume:
        accelerator.load_state(resume)
        torch.save(hook.state_dict(), os.path.join(out, f"acc-start-{steps}-rank{rank}.pt"))
    step, losses = hook.step, []
    while step < steps:
        for xb, yb in data:
            loss = F.mse_loss(model(xb), yb)
            accelerator.backward(loss)
            losses.append(loss.item())
            opt.step()
            opt.zero_grad()
            step += 1
            gradpress.accelerate.log_stats(accelerator, hook, step)
            if step == steps:
                break
    torch.save({"state": hook.state_dict(), "stats": dict(hook.stats), "losses": losses,
                "params": [p.detach().clone() for p in model.parameters()]},
               os.path.join(out, f"acc-end-{steps}-rank{rank}.pt"))
    accelerator.save_state(os.path.join(out, f"acc-state-{steps}"))
    if last:
        accelerator.end_training()
    else:  # the next run of this launch needs the process group: only the trackers end
        for tracker in accelerator.trackers:
            tracker.finish()


def _accelerate_worker(out: str) -> None:
    """The three Accelerate runs of the test, in one launch (see the module docstring for the order)."""
    straight = os.path.join(out, "straight")
    os.makedirs(straight, exist_ok=True)
    _accelerate_run(out, 4, None, last=False)
    _accelerate_run(straight, 8, None, last=False)
    _accelerate_run(out, 8, os.path.join(out, "acc-state-4"), last=True)


def _trainer_run(out: str, steps: int, resume: str | None) -> None:
    """One Trainer run of ``steps`` steps (resumed from the checkpoint folder ``resume``)."""
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    import gradpress.accelerate

    torch.set_num_threads(1)
    model = _gpt2()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 64, (64, 16), generator=g)
    data = [{"input_ids": row, "labels": row} for row in ids]
    args = TrainingArguments(output_dir=out, use_cpu=True, ddp_backend="gloo", max_steps=steps,
                             per_device_train_batch_size=4, learning_rate=1e-3, logging_steps=1, save_steps=4,
                             save_strategy="steps", report_to=["tensorboard"], disable_tqdm=True, seed=0,
                             dataloader_num_workers=0)
    trainer = Trainer(model=model, args=args, train_dataset=data)
    logged: list[dict] = []

    class Keep(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):  # noqa: ANN001,ANN201
            logged.append(dict(logs or {}))

        def on_step_begin(self, args, state, control, **kw):  # noqa: ANN001,ANN201
            if not keep.get("start") and cb.hook is not None:
                keep["start"] = cb.hook.state_dict()

    keep: dict = {}
    cb = gradpress.accelerate.attach_trainer(trainer, SPEC, min_numel=MIN_NUMEL, timeout=60)
    trainer.add_callback(Keep())
    trainer.train(resume_from_checkpoint=resume)
    rank = torch.distributed.get_rank()
    torch.save({"logs": logged, "start": keep.get("start"), "state": cb.hook.state_dict(), "stats": dict(cb.hook.stats),
                "find_unused": bool(trainer.model_wrapped.find_unused_parameters)},
               os.path.join(out, f"hf-{steps}-rank{rank}.pt"))


def _trainer_worker(out: str) -> None:
    """The two Trainer runs of the test, in one launch: 4 steps, then the resume from ``checkpoint-4`` to 6."""
    import torch

    _trainer_run(out, 4, None)
    if torch.distributed.get_rank() == 0 and os.path.isdir(os.path.join(out, "runs")):  # rank 0 writes TensorBoard
        os.rename(os.path.join(out, "runs"), os.path.join(out, "runs-4"))  # the test reads the first run's alone
    _trainer_run(out, 6, os.path.join(out, "checkpoint-4"))


# --------------------------------------------------------------------------- the tests
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not HAVE, reason="Accelerate, Transformers or TensorBoard is not installed "
                                 "(pip install 'gradpress[accelerate,tensorboard]')")]


def _torchrun(*args: str) -> None:
    from distributed import free_port
    from integration_helpers import run_command

    run_command([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
                 "127.0.0.1", "--master_port", str(free_port()), __file__, *args], timeout=150)


def _assert_restored(saved: dict, restored: dict) -> None:
    import torch

    assert restored["step"] == saved["step"] > 0
    residuals = saved["feedback"]["residuals"]
    assert residuals and any(t.abs().sum() > 0 for t in residuals.values())
    assert residuals.keys() == restored["feedback"]["residuals"].keys()
    for key, tensor in residuals.items():
        assert torch.equal(tensor, restored["feedback"]["residuals"][key]), key
    # every differing counter named with both values and both states' ranks (pytest's dict diff is cut at a few
    # lines): a count that differs means a step recorded on one side only, times alone a state of another process
    a, b = saved["stats"], restored["stats"]
    differ = {k: (a.get(k), b.get(k)) for k in sorted(a.keys() | b.keys()) if a.get(k) != b.get(k)}
    assert not differ, f"stats (saved, restored) of ranks {saved.get('rank')}, {restored.get('rank')}: {differ}"


def test_accelerate_trains_compresses_and_resumes_with_its_compression_state(tmp_path) -> None:
    import torch
    from integration_helpers import expected_step_bytes, scalar_tags

    _torchrun("accelerate", str(tmp_path))
    sent, dense = expected_step_bytes(_model_layers(), SPEC, MIN_NUMEL)
    first = [torch.load(tmp_path / f"acc-end-4-rank{r}.pt", weights_only=True) for r in range(2)]
    for r in range(2):
        stats = first[r]["stats"]
        assert stats["steps"] == 4 and stats["last_step_bytes"] == sent and stats["last_step_dense_bytes"] == dense
        assert stats["ratio"] == pytest.approx(dense / sent) and stats["ratio"] > 3
    custom = torch.load(tmp_path / "acc-state-4" / "custom_checkpoint_0.pkl", weights_only=True)  # no pickle needed
    assert custom["world_size"] == 2 and len(custom["ranks"]) == 2

    for r in range(2):
        _assert_restored(first[r]["state"], torch.load(tmp_path / f"acc-start-8-rank{r}.pt", weights_only=True))
        end = torch.load(tmp_path / f"acc-end-8-rank{r}.pt", weights_only=True)
        assert end["state"]["step"] == 8 and end["stats"]["steps"] == 8
    r0, r1 = (first[r]["state"]["feedback"]["residuals"] for r in range(2))
    assert any(not torch.equal(r0[k], r1[k]) for k in r0)  # each rank got its own residuals back
    # resuming gives the same next steps as not stopping (4 steps are one epoch here: the data restarts alike)
    straight = tmp_path / "straight"
    for r in range(2):
        end, ref = (torch.load(d / f"acc-end-8-rank{r}.pt", weights_only=True) for d in (tmp_path, straight))
        assert end["losses"] == ref["losses"][4:]
        assert all(torch.equal(a, b) for a, b in zip(end["params"], ref["params"]))
        for key, tensor in ref["state"]["feedback"]["residuals"].items():
            assert torch.equal(end["state"]["feedback"]["residuals"][key], tensor), key

    tags = scalar_tags(tmp_path / "acc4")
    assert {"gradpress/bytes_per_step", "gradpress/compression_ratio", "gradpress/compress_s",
            "gradpress/comm_s"} <= set(tags), sorted(tags)
    assert tags["gradpress/bytes_per_step"] == [float(sent)] * 4


def _transformers_uses_this_torch() -> bool:
    """Whether transformers enables its PyTorch models beside this torch
    (transformers 5 disables them below torch 2.6)."""
    from transformers.utils import is_torch_available

    return bool(is_torch_available())


def test_trainer_callback_registers_logs_and_checkpoints_the_compression_state(tmp_path) -> None:
    if not _transformers_uses_this_torch():
        pytest.skip("the installed transformers does not support this torch (it disables its PyTorch models)")
    import torch
    from integration_helpers import expected_step_bytes, scalar_tags

    _torchrun("trainer", str(tmp_path))
    runs = [torch.load(tmp_path / f"hf-4-rank{r}.pt", weights_only=True) for r in range(2)]
    model = _gpt2()
    sent, dense = expected_step_bytes(model, SPEC, MIN_NUMEL)
    for run in runs:
        # the Trainer wraps a PreTrainedModel without gradient checkpointing with find_unused_parameters=True:
        # every step then also allreduces one float32 used-flag per tensor (gradpress/exchange/plans.py)
        want = sent + (4 * len(list(model.parameters())) if run["find_unused"] else 0)
        stats = run["stats"]
        assert stats["steps"] == 4 and stats["compressed_tensors"] > 0 and stats["ratio"] > 3
        assert stats["last_step_bytes"] == want and stats["last_step_dense_bytes"] == dense
        steps_logged = [row for row in run["logs"] if "loss" in row]
        assert len(steps_logged) == 4
        assert [row["gradpress/bytes_per_step"] for row in steps_logged] == [want] * 4, (sent, run["find_unused"])
        assert [row["gradpress/dense_bytes_per_step"] for row in steps_logged] == [dense] * 4
    saved = torch.load(tmp_path / "checkpoint-4" / "gradpress.pt", weights_only=True)
    assert saved["world_size"] == 2
    for r in range(2):
        _assert_restored(runs[r]["state"], saved["ranks"][r])
    tags = scalar_tags(tmp_path / "runs-4")
    assert any(t.endswith("gradpress/bytes_per_step") for t in tags) and any(
        t.endswith("gradpress/compression_ratio") for t in tags), sorted(tags)

    for r in range(2):
        resumed = torch.load(tmp_path / f"hf-6-rank{r}.pt", weights_only=True)
        _assert_restored(runs[r]["state"], resumed["start"])
        assert resumed["stats"]["steps"] == 6


if __name__ == "__main__":
    {"accelerate": _accelerate_worker, "trainer": _trainer_worker}[sys.argv[1]](sys.argv[2])
    from integration_helpers import leave

    leave()
