"""docs/integrations.md: on CPU, Accelerate and the Transformers Trainer start
a distributed (gloo) run under ``torchrun`` only when told to use the CPU
(``Accelerator(cpu=True)``, ``TrainingArguments(use_cpu=True)``; Accelerate
1.x and Transformers 5 otherwise stay single-process, distributed type NO).
A user who launched several processes and forgot it gets an error that says
so, instead of one telling them to launch several processes. No framework
is needed: the accelerator and the trainer are stand-ins with the attributes
gradpress reads."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch

import gradpress.accelerate


def test_register_under_a_multi_process_launch_names_cpu_true(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    accelerator = SimpleNamespace(distributed_type="NO")
    with pytest.raises(ValueError) as err:
        gradpress.accelerate.register(accelerator, torch.nn.Linear(4, 4), "topk:ratio=0.01")
    msg = str(err.value)
    assert "WORLD_SIZE=2" in msg and "Accelerator(cpu=True)" in msg, msg
    assert "distributed type NO" in msg and "not DistributedDataParallel" in msg, msg


def test_register_single_process_keeps_the_launch_advice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match=r"launch 2 or more processes \(torchrun --nproc_per_node N") as err:
        gradpress.accelerate.register(SimpleNamespace(distributed_type="NO"), torch.nn.Linear(4, 4))
    assert "cpu=True" in str(err.value)  # the CPU hint is part of the advice either way


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")
def test_trainer_callback_under_a_multi_process_launch_names_use_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    trainer = SimpleNamespace(model_wrapped=torch.nn.Linear(4, 4),
                              callback_handler=SimpleNamespace(callbacks=[]))
    callback = gradpress.accelerate.attach_trainer(trainer, "topk:ratio=0.01")
    args = SimpleNamespace(parallel_mode="ParallelMode.NOT_PARALLEL", output_dir="unused")
    with pytest.raises(ValueError) as err:
        callback.on_train_begin(args, SimpleNamespace(global_step=0), None)
    msg = str(err.value)
    assert "WORLD_SIZE=2" in msg and "TrainingArguments(use_cpu=True)" in msg, msg
