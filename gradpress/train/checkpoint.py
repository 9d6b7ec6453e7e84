"""Checkpoints of a training run: what they hold, the resume checks, RNG
state.

One file, ``DIR/checkpoint.pt``, written atomically by rank 0 (temporary
file + rename) after every epoch and at the end (format ``gradpress-train/2``):

* ``config``: the settings a resumed run must share (:data:`RESUME_FIXED`
  and the world size; a checkpoint written before ``split`` existed ran
  ``iid``), ``epoch``/``batch``/``step``: the position in the data (with a
  non-IID ``--split``, in this rank's fixed shard: :mod:`gradpress.train.splits`);
* ``model``, ``optimizer``: rank 0's;
* ``ranks``: per rank, ``algorithm`` (its ``state_dict()``: residuals differ
  between ranks) and ``rng``; for algorithms whose replicas may differ
  between synchronizations (every algorithm but ``ddp``, which declares
  ``replicated = True``) also that rank's ``model`` and ``optimizer``
  (restored after the algorithm is built, since building takes rank 0's
  parameters);
* ``step_times``, ``history``, ``diverged_at_step`` (the first step whose
  loss was NaN/Inf, or None: a run goes on past it only with
  ``--allow-divergence``, and a resumed run reports that step, not a later one);
* ``settings``: every setting of the run (:func:`gradpress.train.config.settings`; absent from checkpoints
  written before it existed), which ``gradpress compare --resume`` checks before resuming from it;
* ``reshards``: every change of world size so far, ``{"from", "to", "step",
  "epoch"}``, inside an epoch also ``batch`` and ``left`` (``--resume
  --reshard``, :mod:`gradpress.train.reshard`; absent in a checkpoint
  written before it existed: none); ``steps_per_epoch``: the world's
  batches per epoch (absent before mid-epoch reshards existed: such a
  checkpoint reshards at an epoch boundary only).

Everything is tensors, numbers, strings, lists and dicts, so the file loads
with ``torch.load(..., weights_only=True)``. Checkpoints written before
algorithms existed (``gradpress-train/1``: numpy RNG state, the hook's state
under ``hook``) still load, as algorithm ``ddp``; numpy arrays in them are
the only extra types allowed.
"""

from __future__ import annotations

import os
import pickle
import random
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from gradpress.torch_compat import allows_globals, safe_globals
from gradpress.train.config import RESUME_FIXED, TrainConfig, settings

__all__ = ["CHECKPOINT", "FORMAT", "compat", "verify", "load", "check_resume", "save", "rng_state", "set_rng_state",
           "rank_state", "same_setting"]

CHECKPOINT = "checkpoint.pt"
FORMAT = "gradpress-train/2"
_LEGACY = "gradpress-train/1"
#: what a ``gradpress-train/1`` checkpoint ran, for settings it does not record
_LEGACY_DEFAULTS = {"algorithm": "ddp", "nonfinite": "propagate"}
#: settings added after a checkpoint format, and what a checkpoint without them ran
_ADDED_DEFAULTS = {"split": "iid", "precision": "fp32"}


def compat(cfg: TrainConfig, world: int) -> dict[str, Any]:
    d = {k: getattr(cfg, k) for k in RESUME_FIXED}
    d["world_size"] = world
    return d


def _legacy_globals() -> list[Any]:
    """The numpy types a ``gradpress-train/1`` file pickled (its RNG state)."""
    reconstruct = np.ndarray.__reduce__(np.zeros(0))[0]
    return [reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def _legacy_names() -> set[str]:
    """The qualified names of :func:`_legacy_globals`, as torch's refusal names them."""
    return {f"{o.__module__}.{getattr(o, '__qualname__', o.__name__)}" for o in _legacy_globals()}


def verify(path: Path) -> None:
    """Refuse, with one line naming the file and what is wrong with it, a
    checkpoint that is missing, a directory, empty, not a zip archive
    (truncated or another kind of file), or whose records fail their CRC-32
    (bytes damaged after writing: ``torch.load`` itself never checks them)."""
    import zipfile

    name = str(path)
    if not os.path.exists(path):
        raise ValueError(f"resume: no checkpoint at {name!r}")
    if os.path.isdir(path):
        raise ValueError(f"resume: checkpoint {name!r} is a directory, not a file")
    if os.path.getsize(path) == 0:
        raise ValueError(f"resume: checkpoint {name!r} is empty (0 bytes)")
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()  # reads every record and checks its CRC-32
    except zipfile.BadZipFile as exc:
        raise ValueError(f"resume: checkpoint {name!r} is truncated or not a gradpress training checkpoint "
                         f"(not a complete zip archive: {exc})") from None
    except (OSError, EOFError, ValueError, NotImplementedError) as exc:
        raise ValueError(f"resume: checkpoint {name!r} cannot be read ({type(exc).__name__}: {exc})") from None
    if bad is not None:
        raise ValueError(f"resume: checkpoint {name!r} is corrupt: record {bad!r} fails its CRC check "
                         "(the file was damaged after it was written); refusing to resume from it")


def load(path: Path) -> dict[str, Any]:
    """Verify (:func:`verify`), then read a checkpoint with
    ``weights_only=True``; a ``gradpress-train/1`` one is upgraded in memory
    to the current layout (algorithm ``ddp``)."""
    verify(path)
    with safe_globals(_legacy_globals()):
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            found = re.search(r"(?:GLOBAL|Unsupported class) (\S+)", str(exc))
            if found and found.group(1) in _legacy_names() and not allows_globals():
                raise ValueError(f"resume: {str(path)!r} holds numpy objects, as a {_LEGACY} checkpoint's RNG state "
                                 "does; this torch cannot allow them in torch.load(weights_only=True) (it has no "
                                 "torch.serialization.safe_globals): resume it with a newer torch (2.13 loads it)"
                                 ) from None
            first = f"found {found.group(1)}" if found else type(exc).__name__
            raise ValueError(f"resume: {str(path)!r} is not a gradpress training checkpoint (it does not load with "
                             f"weights_only=True: it holds objects other than tensors, numbers, strings, lists and "
                             f"dicts: {first})") from None
        except Exception as exc:  # noqa: BLE001 - zip / pickle errors all mean "not ours"
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ValueError(f"resume: {str(path)!r} is not a gradpress training checkpoint ({first})") from None
    if isinstance(state, Mapping) and state.get("format") == _LEGACY:
        state = dict(state)
        state["config"] = {**_LEGACY_DEFAULTS, **state["config"]}
        state["ranks"] = [{"algorithm": r["hook"], "rng": r["rng"]} for r in state["ranks"]]
        state["format"] = FORMAT
    return state


def check_resume(state: Any, cfg: TrainConfig, world: int, local_world: int | None = None) -> None:
    """Refuse a checkpoint of another configuration (:data:`RESUME_FIXED`, the world size), naming every
    setting that differs. ``local_world``: the ``LOCAL_WORLD_SIZE`` of the workers a launcher is about to
    start (a host layout from the environment resolves as theirs will). Another world size passes with
    ``cfg.reshard`` when :func:`gradpress.train.reshard.check` allows it; without, its entry names the flag."""
    if not isinstance(state, Mapping) or state.get("format") != FORMAT:
        found = state.get("format") if isinstance(state, Mapping) else None
        raise ValueError(f"resume: {cfg.out}/{CHECKPOINT} is not a gradpress training checkpoint "
                         f"(format {found!r}; allowed: {FORMAT!r}, {_LEGACY!r})")
    from gradpress.train import reshard

    theirs, mine = {**_ADDED_DEFAULTS, **state["config"]}, compat(cfg, world)
    diffs = [f"{k}: checkpoint has {theirs.get(k)!r}, this run has {mine[k]!r}" for k in mine
             if k != "world_size" and not _same(k, theirs.get(k), mine[k], world, local_world)]
    resharding = theirs.get("world_size") != world
    if resharding and not getattr(cfg, "reshard", False):
        diffs.append(reshard.refusal(theirs.get("world_size"), world, cfg.batch_size))
    if diffs:
        raise ValueError("resume: the checkpoint is from a different configuration (" + "; ".join(diffs) + ")")
    if resharding:
        reshard.check(state, cfg.split, world)


def same_setting(key: str, theirs: Any, mine: Any) -> bool:
    """Whether a recorded setting ``key`` is this run's, compressor and strategy specs in their canonical form
    (:func:`_same` without a world size)."""
    return _same(key, theirs, mine)


def _same(key: str, theirs: Any, mine: Any, world: int | None = None, local_world: int | None = None) -> bool:
    """Whether a checkpoint's setting ``key`` is this run's. Compressor and
    strategy specs compare in their canonical form (``topk`` is
    ``topk:ratio=0.01``, ``hierarchical`` is
    ``hierarchical:workers_per_host=0,outer=collective,chunk=262144``): the
    same compressor or strategy spelled another way continues the same run.
    A strategy also compares with its host layout resolved on ``world`` ranks
    (``hierarchical`` under ``GRADPRESS_WORKERS_PER_HOST=2`` is
    ``hierarchical:workers_per_host=2``; the layout the checkpoint's residuals
    were kept for is checked again when the strategy's state loads)."""
    if key in _CANONICAL and isinstance(theirs, str) and isinstance(mine, str) and theirs != mine:
        canonical = _CANONICAL[key]()
        try:
            if canonical(theirs) == canonical(mine):
                return True
        except ValueError:
            return False
        if key != "strategy" or world is None:
            return False
        from gradpress.exchange.base import resolved_strategy

        # this run's own layout first, outside the try: an environment that gives none is its error, named
        ours = resolved_strategy(mine, world, local_world)
        try:
            return resolved_strategy(theirs, world, local_world) == ours
        except ValueError:
            return False
    return theirs == mine


def _compressor_canonical() -> Any:
    from gradpress.compress import create

    return lambda spec: create(spec).spec()


def _strategy_canonical() -> Any:
    from gradpress.exchange.base import canonical_strategy

    return canonical_strategy


#: settings compared in their canonical form: key -> a loader of spec -> canonical spec
_CANONICAL = {"compressor": _compressor_canonical, "strategy": _strategy_canonical}


def rank_state(state: Mapping[str, Any], rank: int, key: str, mine: Mapping[str, Any] | None = None) -> Any:
    """This rank's ``model`` or ``optimizer`` state: its own where the
    checkpoint has one (replicas that may differ), else rank 0's. ``mine``:
    this rank's entry when it is not ``state["ranks"][rank]`` (resharded)."""
    mine = state["ranks"][rank] if mine is None else mine
    return mine[key] if key in mine else state[key]


def _atomic_save(obj: Any, path: Path) -> None:
    """Write to a temporary file beside ``path``, flush it to disk, rename:
    a crash leaves the previous checkpoint or the new one, never half of one."""
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def save(path: Path, cfg: TrainConfig, world: int, rank: int, device: torch.device, model: torch.nn.Module,
         opt: torch.optim.Optimizer, algo: Any, nxt: tuple[int, int], step: int, step_times: list[float],
         history: list[dict[str, Any]], diverged_at: int | None = None,
         reshards: list[dict[str, int]] | None = None, steps_per_epoch: int | None = None) -> None:
    """Gather every rank's algorithm and RNG state on rank 0 (and model and
    optimizer, unless the algorithm keeps replicas identical), which writes
    one file atomically. ``diverged_at``: the first step whose loss was not
    finite (None: none so far). ``reshards``: the run's changes of world size
    (:mod:`gradpress.train.reshard`). ``steps_per_epoch``: this world's (a
    reshard inside the epoch shares out its remaining batches by it)."""
    mine: dict[str, Any] = {"algorithm": algo.state_dict(), "rng": rng_state(device)}
    scaler = getattr(algo, "scaler_state", lambda: None)()
    if scaler is not None:  # ddp under fp16: the GradScaler's state (an algorithm's is in its own state)
        mine["loss_scaler"] = scaler
    if not getattr(algo, "replicated", False):
        mine["model"] = model.state_dict()
        mine["optimizer"] = opt.state_dict()
    gathered: list[Any] | None = [None] * world if rank == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    if rank == 0:
        _atomic_save({
            "format": FORMAT, "config": compat(cfg, world), "epoch": nxt[0], "batch": nxt[1], "step": step,
            "model": model.state_dict(), "optimizer": opt.state_dict(), "ranks": gathered,
            "step_times": list(step_times), "history": list(history), "diverged_at_step": diverged_at,
            "settings": settings(cfg),
            "reshards": [dict(r) for r in reshards or []],
            **({} if steps_per_epoch is None else {"steps_per_epoch": int(steps_per_epoch)}),
        }, path)
    dist.barrier()


# ---------------------------------------------------------------- RNG state
def rng_state(device: torch.device) -> dict[str, Any]:
    """torch, numpy and Python RNG states as tensors, numbers and lists."""
    name, key, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {"name": name, "key": torch.from_numpy(key.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "python": [version, list(internal), gauss],
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: Mapping[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"].cpu())
    npy = state["numpy"]
    if isinstance(npy, Mapping):
        np.random.set_state((npy["name"], npy["key"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"],
                             npy["cached_gaussian"]))
    else:  # gradpress-train/1: numpy's own tuple
        np.random.set_state(npy)
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)
