"""The training flags of ``gradpress train`` and ``gradpress compare``."""

from __future__ import annotations

import argparse

from gradpress import workloads

__all__ = ["add_arguments"]


def add_arguments(p: argparse.ArgumentParser, *, compare: bool = False) -> None:
    """Training flags. Defaults are left out of the namespace (SUPPRESS) so
    that a ``--config`` file can sit between built-in defaults and flags.
    ``compare``: the flags of ``gradpress compare``, which sets the algorithm
    and the compressor per run."""
    S = argparse.SUPPRESS
    p.add_argument("--workload", default=S, help=f"built-in workload (default {workloads.DEFAULT}): "
                   + ", ".join(workloads.names()))
    p.add_argument("--data", default=S, metavar="PATH.npz", help="train an MLP classifier on your data (arrays x, y)")
    if not compare:
        p.add_argument("--algorithm", default=S, metavar="SPEC",
                       help="what runs each step (default ddp: DDP with the gradpress hook), e.g. "
                            "localsgd:period=8; see `gradpress algorithms`")
        p.add_argument("--compressor", default=S, metavar="SPEC",
                       help="compressor spec (default: the algorithm's own, none for ddp), e.g. topk:ratio=0.01")
    choices = "collective, allreduce, allgather, ring, ps, hierarchical, cyclic, union"
    if compare:
        p.add_argument("--strategy", default=S, help="every run's strategy (default: each compressor's general one, "
                       "allreduce if summable, else allgather, so every method is exercised); also auto (the planner), " + choices)
    else:
        p.add_argument("--strategy", default=S, help="collective (default: the compressor on every tensor above "
                       "--min-numel, by allreduce if summable, else allgather), allreduce, allgather, ring, ps, hierarchical "
                       "(several workers per host; parameters as NAME:key=value, e.g. "
                       "hierarchical:workers_per_host=2,chunk=262144), cyclic (top-k/threshold on one support that a "
                       "leader cycling over the ranks picks: ScaleCom), union (the exact mean on the union of every rank's "
                       "top-k/threshold support: SparCML), or auto "
                       "(opt-in: a per-tensor plan from costs measured on this cluster; may keep tensors dense "
                       "when compression does not pay)")
        p.add_argument("--plan-costs", dest="plan_costs", default=S, metavar="FILE.json",
                       help="with --strategy auto: plan from this cost file (gradpress bench plan --out FILE) "
                       "instead of measuring, so the same run gives the same plan")
    p.add_argument("--error-feedback", dest="error_feedback", default=S, metavar="on|off|auto",
                   help="residual error feedback (auto: the compressor's default)")
    p.add_argument("--nonfinite", default=S, metavar="propagate|skip|raise",
                   help="a NaN/Inf gradient on some rank: propagate it (default), skip the step on every rank, or fail")
    p.add_argument("--precision", default=S, metavar="fp32|bf16|fp16",
                   help="forward pass under autocast: fp32 (default: none), bf16, or fp16 with a torch.amp.GradScaler "
                        "given to the algorithm or hook; parameters stay fp32 (docs/train.md)")
    p.add_argument("--epochs", type=int, default=S, help="epochs (default: the workload's)")
    p.add_argument("--steps", type=int, default=S, help="cap on the total number of steps")
    p.add_argument("--batch-size", dest="batch_size", type=int, default=S, help="batch size per worker")
    p.add_argument("--lr", type=float, default=S, help="learning rate (default: the workload's)")
    p.add_argument("--optimizer", default=S, metavar="sgd|momentum|adam", help="default: the workload's")
    p.add_argument("--schedule", default=S, metavar="constant|cosine",
                   help="learning rate schedule over epochs x steps per epoch (--steps only truncates it)")
    p.add_argument("--split", default=S, metavar="iid|dirichlet:alpha=A|labels:k=K",
                   help="how the training set is dealt to the workers: iid (default: a new random slice each epoch), "
                        "dirichlet:alpha=A (each worker's class mix drawn from Dir(A p), Hsu et al. 2019; small A: "
                        "few classes per worker) or labels:k=K (about K labels per worker, McMahan et al. 2017); "
                        "non-IID shards are fixed for the run (docs/train.md)")
    p.add_argument("--seed", type=int, default=S, help="seed for weights, data order and shared randomness (default 0)")
    p.add_argument("--out", default=S, metavar="DIR", help="output directory")
    p.add_argument("--config", default=S, metavar="FILE.toml", help="read options from a TOML file; flags override it")
    if not compare:
        p.add_argument("--resume", action="store_true", default=S, help="continue from DIR/checkpoint.pt")
        p.add_argument("--reshard", action="store_true", default=S,
                       help="with --resume: continue a checkpoint of another number of workers, its per-rank state "
                            "folded into this run's (--split iid; inside an epoch when the workers can share its rest evenly; "
                            "docs/train.md)")
    p.add_argument("--device", default=S, metavar="cpu|cuda", help="cpu (gloo, default) or cuda (nccl)")
    p.add_argument("--log-every", dest="log_every", type=int, default=S, help="log every N steps (default 10)")
    p.add_argument("--eval-every", dest="eval_every", type=int, default=S,
                   help="also evaluate every N steps (default 0: at epoch ends only)")
    p.add_argument("--nproc", type=int, default=S, help="start N local workers (torch elastic launcher, gloo on 127.0.0.1)")
    p.add_argument("--min-numel", dest="min_numel", type=int, default=S,
                   help="tensors smaller than this are not compressed (default 1024)")
    p.add_argument("--hidden", type=int, default=S, help="hidden width / channels of the workload's model")
    p.add_argument("--params", default=S, help="wide-mlp parameter count, e.g. 500K, 10M")
    p.add_argument("--samples", type=int, default=S, help="use only the first N training samples (N//4 test)")
    p.add_argument("--text-bytes", dest="text_bytes", type=int, default=S, help="charlm-lstm corpus size in bytes")
    p.add_argument("--no-progress", dest="progress", action="store_false", default=S,
                   help="no progress bar (there is none anyway when stderr is not a terminal: plain log lines instead)")
    p.add_argument("--timeout", type=float, default=S, metavar="SECONDS",
                   help="a collective that waits longer than this fails the run, naming the silent rank when it can "
                        "(default 300)")
    if not compare:
        p.add_argument("--tensorboard", default=S, metavar="DIR",
                       help="also write TensorBoard event files to DIR (loss, metric, bytes per step, compression "
                            "ratio, compress/comm seconds, consensus distance); needs gradpress[tensorboard]")
    p.add_argument("--allow-divergence", dest="allow_divergence", action="store_true", default=S,
                   help="a loss that becomes NaN/Inf is reported but does not make the run fail (exit 0)")
