"""gradpress from Hugging Face Accelerate and the Transformers ``Trainer``
(``pip install gradpress[accelerate]``).

Accelerate (launched by ``torchrun``, also on CPU with ``Accelerator(cpu=True)``, or
``accelerate launch --multi_gpu`` on GPUs; ``accelerate launch --cpu`` starts one
process unless MPI is configured)::

    model, optimizer, data = accelerator.prepare(model, optimizer, data)
    hook = gradpress.accelerate.register(accelerator, model, "topk:ratio=0.01")
    ...
    gradpress.accelerate.log_stats(accelerator, hook, step)   # with log_with="tensorboard" etc.

:func:`register` puts the gradpress comm hook on the DDP model Accelerate
prepared (Accelerate's own ``DistributedDataParallelKwargs(comm_hook=...)``
takes only PyTorch's fp16/bf16/PowerSGD hooks) and registers its state for
checkpointing, so ``accelerator.save_state`` / ``load_state`` keep every
rank's compression state (:mod:`gradpress.ddp.ranks`).

Transformers ``Trainer``::

    gradpress.accelerate.attach_trainer(trainer, "topk:ratio=0.01")
    trainer.train()

:func:`attach_trainer` adds a ``TrainerCallback`` that registers the hook on
the DDP model the Trainer builds (at ``on_train_begin``), adds the stats to
every log (so ``report_to="tensorboard"`` and other reporters get them),
writes every rank's state to ``checkpoint-N/gradpress.pt`` at each save, and
loads it back when training resumes from ``checkpoint-N`` (the Trainer's own
naming; another folder: pass ``resume_from``).

Neither Accelerate nor Transformers is imported at ``import gradpress``; this
module imports Transformers only when a Trainer callback is made.
"""

from __future__ import annotations

import functools
import os
import warnings
from typing import Any

import torch
import torch.distributed as dist

import gradpress.ddp
from gradpress.ddp import GradpressHook
from gradpress.ddp.loss_scale import framework_scaler
from gradpress.ddp.ranks import gather_states, load_rank_state
from gradpress.tensorboard import stats_scalars

__all__ = ["register", "log_stats", "CheckpointedHook", "attach_trainer", "trainer_callback", "TRAINER_FILE"]

#: the file of the compression state inside a Trainer checkpoint folder
TRAINER_FILE = "gradpress.pt"


def _ddp(model: Any, where: str, distributed_type: Any, cpu_option: str) -> torch.nn.parallel.DistributedDataParallel:
    """``model`` if it is the DDP model, else a ValueError saying how to get one. ``cpu_option`` is
    the framework's switch to a multi-process CPU run (``Accelerator(cpu=True)``, ...): under
    ``torchrun`` without it, Accelerate and the Trainer stay single-process on a machine without GPUs."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return model
    head = (f"{where}: the model is {type(model).__name__}, not DistributedDataParallel (distributed type "
            f"{distributed_type}); gradpress compresses DDP's gradients")
    world = os.environ.get("WORLD_SIZE", "")
    if world.isdigit() and int(world) > 1:
        raise ValueError(f"{head}: this process is one of WORLD_SIZE={world}, but the framework did not start a "
                         f"distributed run; on CPU create it with {cpu_option}")
    raise ValueError(f"{head}: launch 2 or more processes (torchrun --nproc_per_node N, also on CPU with "
                     f"{cpu_option}; accelerate launch --multi_gpu --num_processes N on GPUs)")


class CheckpointedHook:
    """A hook state as Accelerate checkpoints custom objects: ``state_dict``
    (collective: every rank's state) and ``load_state_dict`` (this rank's;
    from a checkpoint of another world size only with ``reshard``: the saved
    ranks' states folded, :mod:`gradpress.exchange.reshard`)."""

    def __init__(self, hook: GradpressHook, reshard: bool = False) -> None:
        self.hook = hook
        self.reshard = reshard

    def state_dict(self) -> dict[str, Any]:
        return gather_states(self.hook)

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        group = self.hook.group
        load_rank_state(self.hook, saved, dist.get_rank(group), dist.get_world_size(group),
                        where="accelerator.load_state", reshard=self.reshard,
                        option="reshard=True to gradpress.accelerate.register")


def _with_scaler(options: dict[str, Any], framework: Any, where: str, source: str) -> dict[str, Any]:
    """``options`` with ``scaler`` set to the framework's loss scaler when none was given (see
    :func:`gradpress.ddp.loss_scale.framework_scaler`)."""
    scaler = framework_scaler(options.get("scaler"), framework, options.get("nonfinite", "propagate"), where, source)
    return {**options, "scaler": scaler} if scaler is not None else options


def register(accelerator: Any, model: Any, spec: Any = "none", *, reshard: bool = False,
             **options: Any) -> GradpressHook:
    """Register gradpress on ``model`` as returned by ``accelerator.prepare``
    (collective: every process calls it, before the first backward) and its
    state for ``accelerator.save_state``/``load_state``. ``options``: those
    of :func:`gradpress.ddp.register`; ``scaler`` defaults to the
    accelerator's (``accelerator.scaler``: fp16 mixed precision), which
    scales the loss in ``accelerator.backward``, and then needs
    ``nonfinite='propagate'``. ``reshard``: ``accelerator.load_state`` of a
    checkpoint written on another number of processes folds the saved ranks'
    compression state into this run's (docs/integrations.md); refused
    otherwise. Returns the hook (``stats``, ...)."""
    ddp = _ddp(model, "gradpress.accelerate.register", getattr(accelerator, "distributed_type", "?"),
               "Accelerator(cpu=True)")
    options = _with_scaler(options, getattr(accelerator, "scaler", None), "gradpress.accelerate.register",
                           "the accelerator's loss scaler (accelerator.scaler, mixed_precision='fp16')")
    hook = gradpress.ddp.register(ddp, spec, **options)
    accelerator.register_for_checkpointing(CheckpointedHook(hook, reshard=bool(reshard)))
    return hook


def log_stats(accelerator: Any, hook: GradpressHook, step: int) -> None:
    """``accelerator.log`` the hook's stats (tags of :data:`gradpress.tensorboard.STATS_TAGS`)."""
    accelerator.log(stats_scalars(hook.stats), step=step)


@functools.cache
def _callback_class() -> type:
    try:
        from transformers import TrainerCallback
    except ImportError as exc:
        raise ImportError("the Trainer callback needs Transformers: pip install 'gradpress[accelerate]'") from exc

    class GradpressTrainerCallback(TrainerCallback):
        """Registers gradpress on the Trainer's DDP model, logs its stats,
        keeps its state in the Trainer's checkpoints."""

        def __init__(self, spec: Any = "none", *, resume_from: str | None = None, reshard: bool = False,
                     **options: Any) -> None:
            self.spec, self.options, self.resume_from, self.reshard = spec, options, resume_from, bool(reshard)
            self.trainer: Any = None
            self.hook: GradpressHook | None = None
            self._ddp: Any = None

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if self.trainer is None:
                raise ValueError("GradpressTrainerCallback needs its trainer: add it with "
                                 "gradpress.accelerate.attach_trainer(trainer, spec)")
            ddp = _ddp(self.trainer.model_wrapped, "GradpressTrainerCallback", args.parallel_mode,
                       "TrainingArguments(use_cpu=True)")
            if ddp is not self._ddp:  # a new DDP wrapper (a new train() call): register on it
                if self.hook is not None:
                    self.hook.close()
                options = _with_scaler(self.options, getattr(getattr(self.trainer, "accelerator", None), "scaler", None),
                                       "GradpressTrainerCallback", "the Trainer's loss scaler "
                                       "(trainer.accelerator.scaler, TrainingArguments(fp16=True))")
                self.hook, self._ddp = gradpress.ddp.register(ddp, self.spec, **options), ddp
            if state.global_step > 0:
                folder = self.resume_from or os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
                path = os.path.join(folder, TRAINER_FILE)
                if os.path.exists(path):
                    load_rank_state(self.hook, torch.load(path, map_location="cpu", weights_only=True),
                                    dist.get_rank(self.hook.group), dist.get_world_size(self.hook.group), where=path,
                                    reshard=self.reshard, option="reshard=True to the Trainer callback")
                else:
                    warnings.warn(f"GradpressTrainerCallback: resuming at step {state.global_step} but {path} does "
                                  "not exist; compression starts with empty residuals (pass resume_from=FOLDER)",
                                  stacklevel=2)

        def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None,
                   **kwargs: Any) -> None:
            if self.hook is not None and logs is not None:
                logs.update(stats_scalars(self.hook.stats))

        def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if self.hook is None:
                return
            saved = gather_states(self.hook)  # collective: the Trainer calls on_save on every process
            folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
            if state.is_world_process_zero and os.path.isdir(folder):
                torch.save(saved, os.path.join(folder, TRAINER_FILE))

    return GradpressTrainerCallback


def trainer_callback(spec: Any = "none", *, resume_from: str | None = None, **options: Any) -> Any:
    """A ``GradpressTrainerCallback`` (a ``transformers.TrainerCallback``);
    :func:`attach_trainer` adds it to a Trainer."""
    return _callback_class()(spec, resume_from=resume_from, **options)


def attach_trainer(trainer: Any, spec: Any = "none", *, resume_from: str | None = None, **options: Any) -> Any:
    """Add gradpress to a ``transformers.Trainer`` (before ``trainer.train()``).
    The callback goes first, so reporters (TensorBoard, ...) see the stats it
    adds to each log. ``reshard=True`` (among ``options``): resuming from a checkpoint
    written on another number of processes folds the saved ranks' compression state
    into this run's (docs/integrations.md); refused otherwise. Returns the callback
    (its ``hook`` once training began)."""
    callback = trainer_callback(spec, resume_from=resume_from, **options)
    callback.trainer = trainer
    trainer.callback_handler.callbacks.insert(0, callback)
    return callback
