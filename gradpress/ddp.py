"""DDP communication hook: ``gradpress.ddp.register(ddp_model, "topk:ratio=0.01")``.

The hook (modelled on ``torch.distributed.algorithms.ddp_comm_hooks``: a small
hook function plus an explicit state object) hands each bucket to a single
communication thread and returns a ``torch.futures.Future`` that the thread
completes. Because DDP calls the hook for buckets in the same order on every
rank and the thread works through them first-in first-out, every rank issues
its collectives in the same order even with several buckets and multi-round
protocols (PyTorch's own PowerSGD hook mixes them up on gloo). gradpress
talks on its own process group, so DDP's own collectives never interleave
with ours.

Per bucket: tensors below ``min_numel`` and 1-D tensors go through one fused
plain allreduce; the others are error-compensated, encoded, exchanged by the
strategy, decoded and averaged; the residual is updated; the result is
written back into the bucket.

State is keyed by parameter name (stable across DDP's bucket rebuild after
the first iteration), never by ``bucket.index()``.
"""

from __future__ import annotations

import hashlib
import json
import queue
import threading
import time
from typing import Any, Mapping

import torch
import torch.distributed as dist

from gradpress.comm import get_strategy
from gradpress.comm.allreduce import fused_allreduce
from gradpress.comm.base import Strategy
from gradpress.compress import Compressor, Context, create
from gradpress.feedback import ResidualMemory

__all__ = ["register", "GradpressHook", "STATS_KEYS"]

#: Every key of ``handle.stats`` and what it means.
STATS_KEYS: dict[str, str] = {
    "steps": "synchronous steps completed (buckets of one backward pass count once)",
    "bytes_sent": "total bytes this rank handed to collectives, all steps (payload, headers, padding, size exchanges)",
    "dense_bytes": "total bytes plain DDP would have handed to its allreduce for the same buckets",
    "last_step_bytes": "bytes_sent during the last completed step",
    "last_step_dense_bytes": "dense_bytes of the last completed step",
    "ratio": "dense_bytes / bytes_sent (compression ratio on the wire; 1.0 before the first step)",
    "compress_s": "seconds spent in error feedback, encoding and decoding (this rank, all steps)",
    "comm_s": "seconds spent inside collectives (this rank, all steps)",
    "compressed_tensors": "number of tensors per step that go through the compressor",
    "dense_tensors": "number of tensors per step that go through the fused plain allreduce",
    "tensor_bytes": "payload bytes per tensor (parameter name) in the last step",
}


def _strip_module(name: str) -> str:
    return name[len("module."):] if name.startswith("module.") else name


class _Job:
    __slots__ = ("buffer", "grads", "keys", "step", "is_last", "future", "event")

    def __init__(self, buffer, grads, keys, step, is_last, future, event) -> None:
        self.buffer = buffer
        self.grads = grads
        self.keys = keys
        self.step = step
        self.is_last = is_last
        self.future = future
        self.event = event


class GradpressHook:
    """State of the gradpress comm hook; returned by :func:`register`.

    Attributes: ``compressor``, ``strategy``, ``error_feedback`` (bool),
    ``memory`` (the residuals), ``stats`` (see ``STATS_KEYS``).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        compressor: Compressor,
        *,
        error_feedback: bool | None,
        strategy: str,
        min_numel: int,
        seed: int,
        process_group: dist.ProcessGroup | None,
    ) -> None:
        if not isinstance(min_numel, int) or isinstance(min_numel, bool) or min_numel < 0:
            raise ValueError(f"min_numel must be an integer >= 0, got {min_numel!r}")
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise ValueError(f"seed must be an integer, got {seed!r}")
        if error_feedback is not None and not isinstance(error_feedback, bool):
            raise ValueError(f"error_feedback must be True, False or None (compressor default), got {error_feedback!r}")
        self.compressor = compressor
        self.compressor.seed = seed
        self.error_feedback = compressor.default_error_feedback if error_feedback is None else error_feedback
        self.min_numel = min_numel
        self.seed = seed
        self.group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self.strategy_name = self._resolve_strategy(strategy)
        self.strategy: Strategy | None = (
            None if compressor.rounds > 1 else get_strategy(self.strategy_name, process_group)
        )
        if self.strategy is not None:
            reason = self.strategy.supports(compressor)
            if reason:
                raise ValueError(f"strategy {strategy!r}: {reason}")
        self.memory = ResidualMemory()
        self._names = {id(p): _strip_module(n) for n, p in model.named_parameters()}
        self._param_info = [
            (_strip_module(n), list(p.shape), str(p.dtype)) for n, p in model.named_parameters() if p.requires_grad
        ]
        self._step = 0  # hook-side step (main thread)
        self._stats: dict[str, Any] = {
            "steps": 0, "bytes_sent": 0, "dense_bytes": 0, "last_step_bytes": 0,
            "last_step_dense_bytes": 0, "compress_s": 0.0, "comm_s": 0.0,
            "compressed_tensors": 0, "dense_tensors": 0, "tensor_bytes": {},
        }
        self._cur = {"bytes": 0, "dense": 0, "compressed": 0, "plain": 0, "tensor_bytes": {}}
        self._lock = threading.Lock()
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._thread = threading.Thread(target=self._worker, name="gradpress-comm", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ config
    def _resolve_strategy(self, strategy: str) -> str:
        if not isinstance(strategy, str):
            raise ValueError(f"strategy must be a string, got {strategy!r}")
        if self.compressor.rounds > 1:
            if strategy not in ("auto", "allreduce"):
                raise ValueError(
                    f"strategy {strategy!r}: compressor {self.compressor.name!r} runs its own "
                    f"{self.compressor.rounds}-round allreduce protocol; allowed: auto, allreduce"
                )
            return "allreduce"
        if strategy == "auto":
            return "allreduce" if self.compressor.is_summable else "allgather"
        from gradpress.comm import available

        if strategy not in available():
            raise ValueError(f"unknown strategy {strategy!r}; allowed: {', '.join(available())}")
        return strategy

    def config(self) -> dict[str, Any]:
        """Everything that must agree across ranks and across a resume."""
        return {
            "compressor": self.compressor.spec(),
            "error_feedback": self.error_feedback,
            "strategy": self.strategy_name,
            "min_numel": self.min_numel,
            "seed": self.seed,
            "world_size": self.world_size,
            "parameters": self._param_info,
        }

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.config(), sort_keys=True).encode()).hexdigest()

    def check_consistent(self) -> None:
        """Exchange configurations; raise on every rank if any differ."""
        _agree(self.config(), None, self.group)


    # ------------------------------------------------------------------- hook
    def submit(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """Queue ``bucket`` for the communication thread; return its Future."""
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        buffer = bucket.buffer()
        keys = [self._names.get(id(p), f"param{i}") for i, p in enumerate(bucket.parameters())]
        event = None
        if buffer.is_cuda:
            event = torch.cuda.Event()
            event.record()
        is_last = bucket.is_last()
        job = _Job(buffer, bucket.gradients(), keys, self._step, is_last, future, event)
        if is_last:
            self._step += 1
        self._queue.put(job)
        return future

    def _worker(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                if job.event is not None:
                    torch.cuda.current_stream(job.buffer.device).wait_event(job.event)
                self._process(job)
                if job.buffer.is_cuda:
                    torch.cuda.current_stream(job.buffer.device).synchronize()
                job.future.set_result(job.buffer)
            except BaseException as exc:  # noqa: BLE001 - forwarded to the training thread
                job.future.set_exception(exc)

    def _is_compressed(self, grad: torch.Tensor) -> bool:
        return grad.dim() > 1 and grad.numel() >= self.min_numel and self.compressor.name != "none"

    def _process(self, job: _Job) -> None:
        n = self.world_size
        dense_idx = [i for i, g in enumerate(job.grads) if not self._is_compressed(g)]
        comp_idx = [i for i, g in enumerate(job.grads) if self._is_compressed(g)]
        tensor_bytes: dict[str, int] = {}
        sent = 0
        t0 = time.perf_counter()
        if not comp_idx:
            # nothing to compress: exactly what DDP's built-in reduction does
            # (the reducer multiplies by 1/N while filling the bucket, then sums)
            job.buffer.mul_(1.0 / n)
            t_comm = time.perf_counter()
            if n > 1:
                dist.all_reduce(job.buffer, group=self.group)
            comm = time.perf_counter() - t_comm
            sent += job.buffer.numel() * job.buffer.element_size()
            for i in dense_idx:
                tensor_bytes[job.keys[i]] = job.grads[i].numel() * job.grads[i].element_size()
            self._account(job, sent, tensor_bytes, 0.0, comm, 0, len(dense_idx))
            return
        comm = 0.0
        if dense_idx:
            plain = [job.grads[i].div(n) for i in dense_idx]
            t_comm = time.perf_counter()
            summed, nbytes = fused_allreduce(plain, self.group)
            comm += time.perf_counter() - t_comm
            sent += nbytes
            for i, s in zip(dense_idx, summed):
                job.grads[i].copy_(s)
                tensor_bytes[job.keys[i]] = job.grads[i].numel() * job.grads[i].element_size()
        if self.compressor.rounds > 1:
            c_time, m_time, nbytes = self._run_rounds(job, comp_idx, tensor_bytes)
        else:
            c_time, m_time, nbytes = self._run_single(job, comp_idx, tensor_bytes)
        sent += nbytes
        comm += m_time
        total = time.perf_counter() - t0
        self._account(job, sent, tensor_bytes, min(c_time, total), comm, len(comp_idx), len(dense_idx))

    def _ctx(self, key: str, step: int) -> Context:
        return Context(key=key, step=step, rank=self.rank, world_size=self.world_size, seed=self.seed)

    def _compensate(self, key: str, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not self.error_feedback:
            return grad, None
        return self.memory.compensate(key, grad)

    def _run_single(self, job: _Job, comp_idx: list[int], tensor_bytes: dict[str, int]) -> tuple[float, float, int]:
        assert self.strategy is not None
        t0 = time.perf_counter()
        compensated = [self._compensate(job.keys[i], job.grads[i]) for i in comp_idx]
        ctxs = [self._ctx(job.keys[i], job.step) for i in comp_idx]
        t1 = time.perf_counter()
        result = self.strategy.exchange(self.compressor, [p for p, _ in compensated], ctxs, self.error_feedback)
        t2 = time.perf_counter()
        for pos, i in enumerate(comp_idx):
            p, finite = compensated[pos]
            if finite is not None and result.estimates is not None:
                self.memory.update(job.keys[i], p, result.estimates[pos], finite)
            job.grads[i].copy_(result.tensors[pos].reshape(job.grads[i].shape))
            tensor_bytes[job.keys[i]] = result.tensor_bytes[pos]
        t3 = time.perf_counter()
        own = (t1 - t0) + (t3 - t2)
        return own + result.compress_s, max(0.0, (t2 - t1) - result.compress_s), result.bytes_sent

    def _run_rounds(self, job: _Job, comp_idx: list[int], tensor_bytes: dict[str, int]) -> tuple[float, float, int]:
        n = self.world_size
        comp_time = comm_time = 0.0
        sent = 0
        states: list[Any] = []
        outgoing: list[torch.Tensor | None] = []
        comps: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        dense: list[int] = []
        t = time.perf_counter()
        for pos, i in enumerate(comp_idx):
            key = job.keys[i]
            p, finite = self._compensate(key, job.grads[i])
            comps.append((p, finite))
            state, out = self.compressor.begin(p, self._ctx(key, job.step))
            states.append(state)
            outgoing.append(out)
            if out is None:
                dense.append(pos)
                outgoing[pos] = p.div(n)
        comp_time += time.perf_counter() - t
        active = list(range(len(comp_idx)))
        first = True
        while active:
            t = time.perf_counter()
            summed, nbytes = fused_allreduce([outgoing[j] for j in active], self.group)  # type: ignore[misc]
            comm_time += time.perf_counter() - t
            sent += nbytes
            for j, s in zip(active, summed):
                key = job.keys[comp_idx[j]]
                tensor_bytes[key] = tensor_bytes.get(key, 0) + s.numel() * s.element_size()
            t = time.perf_counter()
            nxt = []
            for j, s in zip(active, summed):
                if first and j in dense:
                    outgoing[j] = None
                    states[j] = ("dense", s)
                    continue
                out = self.compressor.advance(states[j], s, self._ctx(job.keys[comp_idx[j]], job.step))
                outgoing[j] = out
                if out is not None:
                    nxt.append(j)
            comp_time += time.perf_counter() - t
            active = nxt
            first = False
        t = time.perf_counter()
        for j, i in enumerate(comp_idx):
            state = states[j]
            approx = state[1].view_as(job.grads[i]) if isinstance(state, tuple) and state[0] == "dense" else self.compressor.finish(state)
            p, finite = comps[j]
            if finite is not None:
                # a tensor that travelled dense dropped nothing: its residual is zero
                self.memory.update(job.keys[i], p, p if j in dense else approx, finite)
            job.grads[i].copy_(approx.reshape(job.grads[i].shape))
        comp_time += time.perf_counter() - t
        return comp_time, comm_time, sent

    def _account(self, job: _Job, sent: int, tensor_bytes: dict[str, int], comp: float, comm: float, n_comp: int, n_dense: int) -> None:
        dense = job.buffer.numel() * job.buffer.element_size()
        with self._lock:
            s = self._stats
            s["bytes_sent"] += sent
            s["dense_bytes"] += dense
            s["compress_s"] += comp
            s["comm_s"] += comm
            cur = self._cur
            cur["bytes"] += sent
            cur["dense"] += dense
            cur["compressed"] += n_comp
            cur["plain"] += n_dense
            cur["tensor_bytes"].update(tensor_bytes)
            if job.is_last:
                s["steps"] += 1
                s["last_step_bytes"] = cur["bytes"]
                s["last_step_dense_bytes"] = cur["dense"]
                s["compressed_tensors"] = cur["compressed"]
                s["dense_tensors"] = cur["plain"]
                s["tensor_bytes"] = dict(cur["tensor_bytes"])
                self._cur = {"bytes": 0, "dense": 0, "compressed": 0, "plain": 0, "tensor_bytes": {}}

    # ------------------------------------------------------------------ public
    @property
    def stats(self) -> dict[str, Any]:
        """A plain mapping; see ``STATS_KEYS`` for every key."""
        with self._lock:
            out = dict(self._stats)
            out["tensor_bytes"] = dict(self._stats["tensor_bytes"])
        out["ratio"] = out["dense_bytes"] / out["bytes_sent"] if out["bytes_sent"] else 1.0
        return out

    @property
    def step(self) -> int:
        return self._step

    def state_dict(self) -> dict[str, Any]:
        """All compression state: config, step, residuals, compressor state."""
        with self._lock:
            stats = dict(self._stats)
        return {
            "format": "gradpress-hook/1",
            "config": self.config(),
            "step": self._step,
            "memory": self.memory.state_dict(),
            "compressor": self.compressor.state_dict(),
            "stats": stats,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore from :meth:`state_dict`. Refuses a state of another
        configuration (compressor, strategy, world size, parameters...)."""
        if not isinstance(state, Mapping) or state.get("format") != "gradpress-hook/1":
            raise ValueError("not a gradpress hook state dict (missing format 'gradpress-hook/1')")
        theirs, mine = state["config"], self.config()
        if theirs != mine:
            fields = [f for f in sorted(set(theirs) | set(mine)) if theirs.get(f) != mine.get(f)]
            details = "; ".join(
                f"{f}: checkpoint has {theirs.get(f)!r}, this run has {mine.get(f)!r}"
                for f in fields if f != "parameters"
            ) or "parameters: names or shapes differ"
            raise ValueError(f"gradpress state dict is from a different configuration ({details})")
        self._step = int(state["step"])
        self.memory.load_state_dict(state["memory"])
        self.compressor.load_state_dict(state["compressor"])
        with self._lock:
            self._stats.update(state.get("stats", {}))

    def close(self) -> None:
        """Stop the communication thread (the hook must not be used after)."""
        self._queue.put(None)
        self._thread.join(timeout=5)

def _agree(mine: dict[str, Any] | None, error: str | None, group: dist.ProcessGroup) -> None:
    """All ranks exchange their configuration (or the error that stopped them
    building one) and all raise the same ``ValueError`` if any rank failed or
    any configuration differs. Runs once at registration, off the hot path."""
    world = dist.get_world_size(group)
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, {"config": mine, "error": error}, group=group)
    errors = [f"rank {r}: {e['error']}" for r, e in enumerate(everyone) if e["error"]]
    if errors:
        raise ValueError("gradpress registration failed: " + "; ".join(errors))
    configs = [e["config"] for e in everyone]
    if all(c == configs[0] for c in configs):
        return
    base = configs[0]
    diffs = []
    for r, cfg in enumerate(configs):
        for field in sorted(set(base) | set(cfg)):
            if cfg.get(field) != base.get(field):
                if field == "parameters":
                    diffs.append(f"rank {r} has different parameter names/shapes/dtypes than rank 0")
                else:
                    diffs.append(f"rank {r} has {field}={cfg.get(field)!r} but rank 0 has {base.get(field)!r}")
    raise ValueError("gradpress configuration differs between ranks: " + "; ".join(diffs))



def register(
    ddp_model: torch.nn.parallel.DistributedDataParallel,
    spec: str | Compressor = "none",
    *,
    error_feedback: bool | None = None,
    strategy: str = "auto",
    min_numel: int = 1024,
    seed: int = 0,
    process_group: dist.ProcessGroup | None = None,
    **params: Any,
) -> GradpressHook:
    """Register the gradpress comm hook on ``ddp_model`` and return its handle.

    ``spec``: a compressor spec (``"topk:ratio=0.01"``) or instance; extra
    keywords are compressor parameters. ``error_feedback``: None uses the
    compressor's default (on for biased methods). ``strategy``: ``auto``
    (allreduce for summable compressors, allgather otherwise) or a name from
    ``gradpress.comm.available()``. Tensors with fewer than ``min_numel``
    elements and 1-D tensors go through one fused plain allreduce. ``seed``
    derives shared randomness. Every rank must call this with the same
    arguments: a mismatch raises ``ValueError`` on every rank.
    """
    if not isinstance(ddp_model, torch.nn.parallel.DistributedDataParallel):
        raise ValueError(f"ddp_model must be torch.nn.parallel.DistributedDataParallel, got {type(ddp_model).__name__}")
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized; call dist.init_process_group first (torchrun does)")
    base_group = process_group if process_group is not None else ddp_model.process_group
    ranks = dist.get_process_group_ranks(base_group)
    own_group = dist.new_group(ranks=ranks, backend=dist.get_backend(base_group))
    hook: GradpressHook | None = None
    error = None
    try:
        hook = GradpressHook(
            ddp_model.module, create(spec, **params), error_feedback=error_feedback, strategy=strategy,
            min_numel=min_numel, seed=seed, process_group=own_group,
        )
    except ValueError as exc:
        error = str(exc)
    _agree(hook.config() if hook is not None else None, error, own_group)
    assert hook is not None
    ddp_model.register_comm_hook(hook, gradpress_hook)
    return hook


def gradpress_hook(state, bucket):  # noqa: ANN001,ANN201 - DDP inspects these annotations; leave them off
    """The DDP comm hook function; ``state`` is the :class:`GradpressHook`."""
    return state.submit(bucket)
