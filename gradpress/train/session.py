"""One training run in this process, on the process group around it:
:func:`train` builds the workload, the optimizer and the algorithm, resumes
from a checkpoint, runs :func:`gradpress.train.loop.run_steps` and logs,
evaluates and checkpoints as it goes.

Invariants:

* Resume is exact: the checkpoint holds the model, the optimizer, every
  rank's algorithm state and RNG states, and the data position; on CPU the
  losses after resuming equal, bit for bit, those of a run that never stopped.
* All ranks agree on every number in the history: losses and metrics are
  all-reduced (metrics over a sharded test set); byte counts are rank 0's
  algorithm ``stats`` (the bytes that rank actually handed to collectives);
  a history entry's ``seconds`` (the training clock at that evaluation, the
  sum of the step times so far, evaluations not counted) is rank 0's,
  broadcast. Step times themselves are each rank's own.
"""

from __future__ import annotations

import math
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from gradpress import workloads
from gradpress.torch_compat import destroy_process_group
from gradpress.train import algorithm, checkpoint, precision, report, reshard, splits
from gradpress.train.config import TrainConfig
from gradpress.train.evaluate import evaluate
from gradpress.train.launch import init_group
from gradpress.train.loop import Tick, run_steps, shard_batches, steps_per_epoch
from gradpress.train.optim import make_optimizer

__all__ = ["train"]

_EF = {"on": True, "off": False, "auto": None}


def _device(cfg: TrainConfig) -> torch.device:
    if cfg.device != "cuda":
        return torch.device("cpu")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    return device


class _Logger:
    """What happens after each step: the loss window, metrics lines,
    evaluation, progress (a bar on a terminal, else plain lines) and
    checkpoints; it watches for a loss that becomes NaN/Inf."""

    def __init__(self, run: _Run, start_step: int, total: int) -> None:
        from tqdm import tqdm

        self.r = run
        self.total = total
        cfg = run.cfg
        # for people: the specs without their defaults (summary.json keeps the canonical algorithm spec)
        comp = algorithm.shown_compressor(cfg.compressor)
        desc = comp if cfg.algorithm == "ddp" else f"{algorithm.shown(cfg.algorithm)}/{comp}"
        self.desc = f"{cfg.workload} {desc}"
        show = run.rank == 0 and cfg.progress
        # a bar's carriage-return refreshes would fill a log file with one huge line: on a
        # non-terminal stderr, plain lines about every 5% of the run (whole log intervals)
        self.tty = show and sys.stderr.isatty()
        self.lines = show and not self.tty
        self.line_every = cfg.log_every * max(1, math.ceil(total / 20 / cfg.log_every))
        self.bar = tqdm(total=total, initial=min(start_step, total), unit="step", dynamic_ncols=True,
                        desc=self.desc, disable=not self.tty)
        self.win_loss = torch.zeros((), dtype=torch.float64, device=run.device)
        self.win_n = 0
        self.win_time = 0.0
        #: the training clock: the sum of the step times so far (a resumed run's restored ones included); it
        #: stops while evaluating, as ``bench e2e --train-to``'s does
        self.clock = sum(run.step_times)
        self.last_bytes = run.algo.stats["bytes_sent"]
        #: first step (on any rank) whose loss was not finite; inf while none (no host sync per step)
        self.bad_step = torch.full((), math.inf, dtype=torch.float64, device=run.device)
        #: the first non-finite step of the whole run (restored on resume: it may precede the checkpoint)
        self.diverged_at: int | None = run.diverged_at
        self.seen_bad = False  # a non-finite loss seen since this process started
        self.events: Any = None  # TensorBoard event files (rank 0, --tensorboard)
        if cfg.tensorboard is not None and run.rank == 0:
            from gradpress.tensorboard import EventWriter

            # resumed: the interrupted run's events after the checkpoint go (as metrics.jsonl's rows do)
            self.events = EventWriter(cfg.tensorboard, purge_step=start_step + 1 if start_step else None)

    def close(self) -> None:
        self.bar.close()
        if self.events is not None:
            self.events.close()

    def _plain_line(self, row: dict[str, Any]) -> None:
        parts = [f"{self.desc}: step {row['step']}/{self.total}", f"loss {row['loss']:.4f}",
                 f"{report.human_bytes(row['bytes'])}/step", f"{row['step_s'] * 1e3:.1f} ms/step"]
        if self.r.metric_value is not None:
            parts.append(f"{self.r.wl.metric} {self.r.metric_value:.4f}")
        print(", ".join(parts), file=sys.stderr, flush=True)

    def __call__(self, t: Tick) -> bool:
        r, cfg = self.r, self.r.cfg
        r.step_times.append(t.seconds)
        loss = t.loss.detach().double()
        self.win_loss += loss
        self.bad_step = torch.where(torch.isfinite(loss) | (self.bad_step <= t.step), self.bad_step,
                                    torch.full_like(self.bad_step, t.step))
        self.win_n += 1
        self.win_time += t.seconds
        self.clock += t.seconds
        self.bar.update(1)
        epoch_end = t.batch == r.steps_per_epoch - 1
        last = t.step == self.total
        evaluating = epoch_end or last or (cfg.eval_every > 0 and t.step % cfg.eval_every == 0)
        if not (evaluating or t.step % cfg.log_every == 0):
            return False
        mean_loss = self.win_loss / self.win_n
        dist.all_reduce(mean_loss)
        bad = self.bad_step.clone()
        dist.all_reduce(bad, op=dist.ReduceOp.MIN)
        diverged_now = not self.seen_bad and math.isfinite(float(bad))
        if diverged_now:
            self.seen_bad = True
            if self.diverged_at is None:
                self.diverged_at = int(bad)
        stats = r.algo.stats
        row: dict[str, Any] = {
            "step": t.step, "epoch": t.epoch + (t.batch + 1) / r.steps_per_epoch,
            "loss": float(mean_loss) / r.world,
            "bytes": (stats["bytes_sent"] - self.last_bytes) / self.win_n,
            "bytes_total": stats["bytes_sent"],
            "step_s": self.win_time / self.win_n,
        }
        self.last_bytes = stats["bytes_sent"]
        self.win_loss.zero_()
        self.win_n, self.win_time = 0, 0.0
        if evaluating:
            r.metric_value = evaluate(r.wl, r.algo.eval_model(), r.device, r.rank, r.world)
            row["metric"] = r.metric_value
            distance = r.algo.stats.get("consensus_distance")  # gossip: measured by this evaluation
            if distance is not None:
                row["consensus_distance"] = distance
            clock = torch.tensor(self.clock, dtype=torch.float64, device=r.device)
            dist.broadcast(clock, 0)  # rank 0's clock, so every rank's history is the same
            r.history.append({"step": t.step, "bytes_total": stats["bytes_sent"], "metric": r.metric_value,
                              "loss": row["loss"], "seconds": float(clock)})
        r.metrics.write(row)
        if self.events is not None:
            # read again: an evaluation (gossip) has just measured the consensus distance
            self.events.write(t.step, stats=r.algo.stats, loss=row["loss"], metric=row.get("metric"),
                              bytes_per_step=row["bytes"])
        if r.rank == 0:
            post = {"loss": f"{row['loss']:.4f}", "bytes/step": report.human_bytes(row["bytes"]),
                    "step": f"{row['step_s'] * 1e3:.1f}ms"}
            if r.metric_value is not None:
                post[r.wl.metric] = f"{r.metric_value:.4f}"
            self.bar.set_postfix(post, refresh=False)
            if self.lines and (evaluating or t.step % self.line_every == 0):
                self._plain_line(row)
        if diverged_now and not cfg.allow_divergence:
            return True  # stop; no checkpoint of the diverged state: the last good one stays
        if epoch_end or last:
            nxt = (t.epoch + 1, 0) if epoch_end else (t.epoch, t.batch + 1)
            checkpoint.save(r.out / checkpoint.CHECKPOINT, cfg, r.world, r.rank, r.device, r.model, r.opt, r.algo,
                            nxt, t.step, r.step_times, r.history, self.diverged_at, r.reshards, r.steps_per_epoch)
        return False


class _Run:
    """The state of one run, built (and resumed) by :meth:`setup`."""

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        if cfg.nproc is not None and cfg.nproc != self.world:
            raise ValueError(f"nproc={cfg.nproc} but the process group already has world_size={self.world}")
        self.device = _device(cfg)
        self.out = Path(cfg.out)
        self.algo: Any = None
        self.step_times: list[float] = []
        self.history: list[dict[str, Any]] = []
        self.metric_value: float | None = None
        self.diverged_at: int | None = None  # restored from the checkpoint (--allow-divergence)
        self.reshards: list[dict[str, int]] = []  # the run's changes of world size (--reshard)

    def setup(self) -> dict[str, Any] | None:
        cfg, device = self.cfg, self.device
        state: dict[str, Any] | None = None
        if cfg.resume:
            path = self.out / checkpoint.CHECKPOINT
            if not path.exists():
                raise ValueError(f"resume: no checkpoint at {str(path)!r}")
            state = checkpoint.load(path)
            checkpoint.check_resume(state, cfg, self.world)
            self.reshards = reshard.reshards(state, self.world)
        resharded = state is not None and reshard.saved_world(state) != self.world
        # this rank's entry: its own, or the saved ranks' folded into this world (no RNG: seeded afresh)
        mine = None if state is None else (reshard.entry(state, self.rank, self.world) if resharded
                                           else state["ranks"][self.rank])
        torch.manual_seed(cfg.seed)
        np.random.seed(cfg.seed)
        random.seed(cfg.seed)
        self.wl = workloads.build(cfg.workload, data=cfg.data, hidden=cfg.hidden, params=cfg.params,
                                  samples=cfg.samples, text_bytes=cfg.text_bytes)
        self.model = self.wl.model.to(device)
        if state is not None:
            self.model.load_state_dict(checkpoint.rank_state(state, self.rank, "model", mine))
        self.opt = make_optimizer(cfg.optimizer, self.model.parameters(), cfg.lr)
        self.precision = precision.make(cfg.precision, device)
        self.algo = algorithm.create(cfg.algorithm, self.model, self.opt, compressor=cfg.compressor,
                                     error_feedback=_EF[cfg.error_feedback], strategy=cfg.strategy,
                                     min_numel=cfg.min_numel, seed=cfg.seed, nonfinite=cfg.nonfinite,
                                     plan_costs=cfg.plan_costs, timeout=cfg.timeout,
                                     scaler=None if self.precision is None else self.precision.scaler)
        if state is not None and mine is not None:
            if "model" in mine:  # replicas differ: building took rank 0's parameters
                self.model.load_state_dict(mine["model"])
            self.opt.load_state_dict(checkpoint.rank_state(state, self.rank, "optimizer", mine))
            for group in self.opt.param_groups:  # lr may be changed on resume
                group["lr"] = cfg.lr
            self.algo.load_state_dict(mine["algorithm"])
            if "loss_scaler" in mine and getattr(self.algo, "scaler", None) is not None:
                self.algo.load_scaler_state(mine["loss_scaler"])  # ddp under fp16 (precision is fixed on resume)
            if resharded:
                reshard.seed_fresh(cfg.seed, state["step"])
            else:
                checkpoint.set_rng_state(mine["rng"], device)
            self.step_times = list(state["step_times"])
            self.history = list(state["history"])
            self.metric_value = self.history[-1]["metric"] if self.history else None
            self.diverged_at = state.get("diverged_at_step")
        return state

    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        state = self.setup()
        x_train, y_train = (t.to(self.device) for t in self.wl.train)
        shards = splits.assign(splits.parse_split(cfg.split), self.wl.train[1], self.world, cfg.seed)
        shard = None if shards is None else shards[self.rank]  # every rank computes every shard, keeps its own
        self.steps_per_epoch = steps_per_epoch(len(y_train), self.world, cfg.batch_size, cfg.workload,
                                               shard=None if shard is None else len(shard), split=cfg.split)
        horizon = cfg.epochs * self.steps_per_epoch  # the schedule's length; --steps only stops early
        shift = reshard.schedule_shift(self.reshards, self.steps_per_epoch)  # 0 unless resharded
        total = horizon - shift if cfg.steps is None else min(horizon - shift, cfg.steps)
        start, step = (reshard.start(state, self.world, self.steps_per_epoch), state["step"]) if state is not None \
            else ((0, 0), 0)
        # a reshard inside this epoch dealt its rest anew: this rank's share of it
        rows = reshard.epoch_rows(len(y_train), cfg.seed, start[0], cfg.batch_size, self.reshards)
        self.metrics = report.MetricsLog(self.out, self.rank, step if state is not None else None)
        logger = _Logger(self, step, total)
        t_start = time.perf_counter()
        batches = shard_batches(x_train, y_train, seed=cfg.seed, rank=self.rank, world=self.world,
                                batch_size=cfg.batch_size, epochs=cfg.epochs, start=start, count=max(total - step, 0),
                                shard=shard, resumed=None if rows is None else (rows[0][self.rank], rows[1]))
        step = run_steps(self.algo, self.opt, self.wl.loss, batches, lr=cfg.lr, schedule=cfg.schedule,
                         horizon=horizon, step=step, device=self.device, after=logger, schedule_shift=shift,
                         precision=self.precision)
        logger.close()
        summary = report.summarize(
            cfg=cfg, described=self.algo.describe(), stats=self.algo.stats, world=self.world, steps=step,
            steps_per_epoch=self.steps_per_epoch, n_params=sum(p.numel() for p in self.model.parameters()),
            wl=self.wl, metric_value=self.metric_value, history=self.history, step_times=self.step_times,
            train_s=time.perf_counter() - t_start, out=self.out, diverged_at_step=logger.diverged_at,
            reshards=self.reshards)
        if self.rank == 0:
            report.write_summary(self.out, summary)
        return summary


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Train ``cfg`` (validated) in this process and return the summary."""
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0 and torch.get_num_threads() != int(threads):
        # forked workers inherit the parent's thread pool size, not the variable
        torch.set_num_threads(int(threads))
    created = init_group(cfg.device, cfg.timeout)
    run: _Run | None = None
    try:
        run = _Run(cfg)
        return run.run()
    finally:
        if run is not None and run.algo is not None:
            run.algo.close()
        if created and dist.is_initialized():
            destroy_process_group()
