"""Training: ``gradpress train`` and the one training loop behind it and the
benchmarks. One process per worker; the algorithm (``--algorithm``, default
``ddp``: DDP with the gradpress comm hook) does the optimizer step and the
exchange; sharded data, metrics, checkpoints, exact resume.

Entry points:

* ``gradpress train [flags]`` / ``python -m gradpress.train [flags]`` (also
  ``torchrun --nproc-per-node N -m gradpress.train ...``);
* ``gradpress.train.run(config) -> summary`` for Python callers (compare,
  benchmarks); ``config`` is a dict, an ``argparse.Namespace`` or a
  :class:`TrainConfig`.

Modules, one job each: :mod:`~gradpress.train.config` (options, TOML,
the merge), :mod:`~gradpress.train.validate` (every field checked),
:mod:`~gradpress.train.checks` (the rules every command's options share),
:mod:`~gradpress.train.args` (flags), :mod:`~gradpress.train.flags` (errors named by
flag), :mod:`~gradpress.train.launch`
(local workers, process group), :mod:`~gradpress.train.algorithm` (what
runs: ``ddp`` or ``gradpress.algorithms``), :mod:`~gradpress.train.optim`
(optimizers, schedules), :mod:`~gradpress.train.loop` (data order, one step,
the loop), :mod:`~gradpress.train.evaluate`, :mod:`~gradpress.train.checkpoint`,
:mod:`~gradpress.train.report` (metrics and summary files),
:mod:`~gradpress.train.session` (one run), :mod:`~gradpress.train.cli`.
"""

from gradpress import workloads
from gradpress.train.args import add_arguments
from gradpress.train.cli import main, run_cli, summary_line
from gradpress.train.config import FIELDS, TrainConfig, make_config
from gradpress.train.evaluate import evaluate
from gradpress.train.launch import run
from gradpress.train.loop import epoch_order, run_steps, train_step
from gradpress.train.optim import OPTIMIZERS, SCHEDULES, make_optimizer

_epoch_order = epoch_order  # the name tests and older callers use

__all__ = ["TrainConfig", "run", "make_config", "add_arguments", "main", "OPTIMIZERS", "SCHEDULES", "FIELDS",
           "make_optimizer", "run_cli", "summary_line", "evaluate", "epoch_order", "train_step", "run_steps",
           "workloads"]
