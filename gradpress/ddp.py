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

Per bucket: tensors below ``min_numel`` and 1-D tensors, and tensors the
plan leaves uncompressed, go through one fused plain allreduce; the others
are error-compensated (on the whole tensor), cut into the plan's K
partitions (keys ``name#k``), grouped by planned strategy and exchanged,
strategy by strategy in a fixed order (allreduce, allgather, ring, ps); the
residual is updated; the result is written back into the bucket.

``strategy="auto"`` plans per tensor with :mod:`gradpress.plan` (cost model
fitted on the live group at registration, ``handle.replan()`` on request);
a named strategy forces it for every eligible tensor (with ``none`` too, so
the transports can be compared on exact data).

State is keyed by parameter name (stable across DDP's bucket rebuild after
the first iteration), never by ``bucket.index()``.
"""

from __future__ import annotations

import atexit
import copy
import datetime
import math
import queue
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from gradpress.comm import get_strategy
from gradpress.comm.allreduce import fused_allreduce
from gradpress.comm.base import Strategy
from gradpress.compress import Compressor, Context, create
from gradpress.feedback import ResidualMemory, all_finite
from gradpress.plan import CostModel, Decision, Plan, Planner, log_plan, measure

#: order in which a bucket's strategy groups are exchanged (same on every rank)
STRATEGY_ORDER = ("allreduce", "allgather", "ring", "ps")

__all__ = ["register", "GradpressHook", "STATS_KEYS", "NONFINITE_MODES"]

#: What the hook does when a rank's gradient has a NaN/Inf (in a bucket that is compressed):
#: ``propagate`` marks the affected tensors NaN on every rank (so every rank's GradScaler skips
#: the same step) and leaves residuals as they were; ``skip`` zeroes the bucket on every rank,
#: leaves residuals as they were and counts the step in ``stats["skipped_steps"]`` (check
#: ``handle.last_step_skipped`` before ``optimizer.step()``); ``raise`` fails on every rank
#: naming the tensor.
NONFINITE_MODES = ("propagate", "skip", "raise")

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
    "nonfinite_steps": "steps in which some rank had a NaN/Inf gradient",
    "skipped_steps": "steps skipped on every rank because of a NaN/Inf gradient (nonfinite='skip')",
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
        plan_costs: CostModel | Mapping[str, Any] | None = None,
        nonfinite: str = "propagate",
    ) -> None:
        if nonfinite not in NONFINITE_MODES:
            raise ValueError(f"nonfinite must be one of {', '.join(NONFINITE_MODES)}, got {nonfinite!r}")
        self.nonfinite = nonfinite
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
        self.requested_strategy = strategy
        self.strategy_name = self._resolve_strategy(strategy)
        self.strategies: dict[str, Strategy] = {}
        if compressor.rounds == 1:
            for name in self._candidates():
                strat = get_strategy(name, process_group)
                reason = strat.supports(compressor)
                if reason and self.strategy_name != "auto":
                    raise ValueError(f"strategy {strategy!r}: {reason}")
                if not reason:
                    self.strategies[name] = strat
        #: the forced strategy (None with "auto" or multi-round compressors)
        self.strategy: Strategy | None = self.strategies.get(self.strategy_name)
        if plan_costs is not None and strategy != "auto":
            raise ValueError(f"plan_costs is only used with strategy 'auto', got strategy {strategy!r}")
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
            "nonfinite_steps": 0, "skipped_steps": 0,
        }
        # OR over the buckets of the step in flight: did any rank see a NaN/Inf? (tensor: no host sync)
        self._step_bad: torch.Tensor | None = None
        self._bad_steps: list[torch.Tensor] = []
        self._last_skipped: torch.Tensor | None = None
        self._step_started = False
        self._snapshot: dict[str, Any] | None = None
        self._cur = {"bytes": 0, "dense": 0, "compressed": 0, "plain": 0, "tensor_bytes": {}}
        self._lock = threading.Lock()
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        #: the cost model the plan came from (None until one is measured or injected)
        self.cost_model: CostModel | None = CostModel.from_mapping(plan_costs) if plan_costs is not None else None
        self.plan: Plan = self._initial_plan()
        self._thread = threading.Thread(target=self._worker, name="gradpress-comm", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ config
    def _resolve_strategy(self, strategy: str) -> str:
        if not isinstance(strategy, str):
            raise ValueError(f"strategy must be a string, got {strategy!r}")
        if self.compressor.rounds > 1:
            if strategy not in ("auto", "allreduce", "collective"):
                raise ValueError(
                    f"strategy {strategy!r}: compressor {self.compressor.name!r} runs its own "
                    f"{self.compressor.rounds}-round allreduce protocol; allowed: auto, allreduce, collective"
                )
            return "allreduce"
        if strategy == "collective":
            # the pre-planner default: every eligible tensor compressed, by one collective
            return self._general_strategy
        from gradpress.comm import available

        if strategy not in available():
            raise ValueError(f"unknown strategy {strategy!r}; allowed: {', '.join(available())}")
        return strategy

    @property
    def _general_strategy(self) -> str:
        """The strategy any compressor can use: allreduce if its packets are
        summable, else allgather."""
        return "allreduce" if self.compressor.is_summable else "allgather"

    def _candidates(self) -> list[str]:
        """Strategies this hook may use: the forced one, or for "auto" the
        general one (allreduce if summable, else allgather) plus ring and ps."""
        if self.strategy_name != "auto":
            return [self.strategy_name]
        if self.compressor.name == "none":
            return []
        return [self._general_strategy, "ring", "ps"]

    def _eligible(self, shape: list[int] | torch.Size) -> bool:
        return len(shape) > 1 and math.prod(shape) >= self.min_numel

    def _plan_params(self) -> list[tuple[str, int, int, bool]]:
        out = []
        for name, shape, dtype in self._param_info:
            numel = math.prod(shape)
            elem = torch.empty(0, dtype=getattr(torch, dtype.replace("torch.", ""))).element_size()
            out.append((name, numel, elem, self._eligible(shape)))
        return out

    def _default_decision(self, key: str, numel: int, eligible: bool) -> Decision:
        if not eligible:
            return Decision(key, numel, "uncompressed", 1, reason="1-D or below min_numel")
        if self.compressor.rounds > 1:
            return Decision(key, numel, "allreduce", 1, reason=f"{self.compressor.rounds}-round protocol")
        if self.requested_strategy == "collective" and self.compressor.name == "none":
            return Decision(key, numel, "uncompressed", 1, reason="nothing to compress")
        if self.strategy_name != "auto":
            return Decision(key, numel, self.strategy_name, 1, reason="forced")
        if self.compressor.name == "none":
            return Decision(key, numel, "uncompressed", 1, reason="nothing to compress")
        return Decision(key, numel, self._general_strategy, 1, reason="not planned yet")

    def _planner(self, costs: CostModel) -> Planner:
        return Planner(costs, self.world_size, self.compressor.is_summable, [s for s in self.strategies])

    def _initial_plan(self) -> Plan:
        params = self._plan_params()
        if self.strategy_name == "auto" and self.strategies and self.cost_model is not None:
            return self._planner(self.cost_model).plan(params, "injected costs")
        source = "forced" if self.strategy_name != "auto" else "default"
        return Plan({k: self._default_decision(k, n, ok) for k, n, _, ok in params}, source)

    def replan(self, costs: CostModel | Mapping[str, Any] | None = None) -> Plan:
        """Measure the group (or use ``costs``) and rebuild the plan.

        Collective: call on every rank, between steps (no bucket in flight).
        Only "auto" plans; a forced strategy keeps its plan. Residuals the
        strategies keep for partitions of the old plan stay unused.
        """
        if self.strategy_name != "auto" or not self.strategies:
            return self.plan
        if costs is None:
            device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(self.group) == "nccl" else torch.device("cpu")
            model = measure(self.group, self.compressor, device=device)
            source = "measured"
        else:
            model = CostModel.from_mapping(costs)
            source = "injected costs"
        self.plan = self._planner(model).plan(self._plan_params(), source)
        self.cost_model = model
        log_plan(self.plan, self.rank)
        return self.plan

    def config(self) -> dict[str, Any]:
        """Everything that must agree across ranks and across a resume."""
        return {
            "compressor": self.compressor.spec(),
            "error_feedback": self.error_feedback,
            "strategy": self.strategy_name,
            "min_numel": self.min_numel,
            "nonfinite": self.nonfinite,
            "seed": self.seed,
            "world_size": self.world_size,
            "parameters": self._param_info,
        }



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

    def _decision(self, key: str, grad: torch.Tensor) -> Decision:
        d = self.plan.decisions.get(key)
        if d is None or d.numel != grad.numel():
            d = self._default_decision(key, grad.numel(), self._eligible(grad.shape))
        return d

    def _process(self, job: _Job) -> None:
        try:
            self._process_bucket(job)
        finally:
            if job.is_last:
                self._finish_step()

    def _finish_step(self) -> None:
        """Commit the step's staged residuals unless some rank saw a NaN/Inf;
        with ``skip``, also put back the state other buckets advanced."""
        bad = self._step_bad
        self._step_bad = None
        self._step_started = False
        snapshot, self._snapshot = self._snapshot, None
        if snapshot is not None and bad is not None and bool(bad):
            self.compressor.load_state_dict(snapshot["compressor"])
            for name, st in snapshot["strategies"].items():
                self.strategies[name].load_state_dict(st)
        if bad is None:
            self.memory.commit(True)
            self._last_skipped = None
            return
        self.memory.commit(~bad)
        with self._lock:
            self._bad_steps.append(bad)
        self._last_skipped = bad if self.nonfinite == "skip" else None

    def _local_flags(self, job: _Job) -> torch.Tensor:
        """One flag per bucket tensor, 1 where this rank's gradient is not
        finite; summed with the plain allreduce, every rank learns the same
        set of bad tensors through the exchange itself."""
        ref = job.buffer
        dtype = ref.dtype if ref.is_floating_point() else torch.float32
        return torch.stack([~all_finite(g) for g in job.grads]).to(dtype)

    def _drop_bucket(self, job: _Job, names: list[str]) -> None:
        """``raise``: fail (on every rank: all saw the same flags); ``skip``:
        every rank zeroes this bucket; residuals and state stay as they were."""
        if self.nonfinite == "raise":
            raise FloatingPointError(
                f"gradpress: non-finite gradient (NaN/Inf) in {', '.join(repr(k) for k in names)} at step "
                f"{job.step} on at least one rank (nonfinite='raise'; use 'skip' to drop such steps)"
            )
        job.buffer.zero_()

    def _snapshot_state(self) -> dict[str, Any] | None:
        """With ``nonfinite='skip'``: the compressor's and strategies' state at
        the start of a step, restored if the step is dropped (a copy per step,
        made only in that mode and only when there is state)."""
        comp = self.compressor.state_dict()
        strats = {n: st.state_dict() for n, st in self.strategies.items() if hasattr(st, "state_dict")}
        if not comp and not any(strats.values()):
            return None
        return copy.deepcopy({"compressor": comp, "strategies": strats})

    def _process_bucket(self, job: _Job) -> None:
        if not self._step_started:
            self._step_started = True
            if self.nonfinite == "skip":
                self._snapshot = self._snapshot_state()
        n = self.world_size
        decisions = [self._decision(k, g) for k, g in zip(job.keys, job.grads)]
        dense_idx = [i for i, d in enumerate(decisions) if not d.compressed]
        comp_idx = [i for i, d in enumerate(decisions) if d.compressed]
        tensor_bytes: dict[str, int] = {}
        sent = 0
        t0 = time.perf_counter()
        if not comp_idx:
            # nothing to compress: exactly what DDP's built-in reduction does
            # (the reducer multiplies by 1/N while filling the bucket, then sums);
            # a NaN/Inf travels as it does in plain DDP
            job.buffer.mul_(1.0 / n)
            t_comm = time.perf_counter()
            if n > 1:
                dist.all_reduce(job.buffer, group=self.group)
            comm = time.perf_counter() - t_comm
            sent += job.buffer.numel() * job.buffer.element_size()
            for i in dense_idx:
                tensor_bytes[job.keys[i]] = job.grads[i].numel() * job.grads[i].element_size()
            # a NaN/Inf survives the sum, so every rank sees the same thing: no flag exchange
            any_bad = ~all_finite(job.buffer)
            self._step_bad = any_bad if self._step_bad is None else (self._step_bad | any_bad)
            if self.nonfinite != "propagate" and bool(any_bad):
                self._drop_bucket(job, [k for k, g in zip(job.keys, job.grads) if not bool(all_finite(g))])
            self._account(job, sent, tensor_bytes, 0.0, comm, 0, len(dense_idx))
            return
        plain = [job.grads[i].mul(1.0 / n) for i in dense_idx]  # as DDP's reducer scales
        outcome: dict[str, Any] = {}

        def after_plain(summed: list[torch.Tensor]) -> bool:
            """Write back the plain tensors, learn every rank's NaN/Inf flags;
            True when this bucket is dropped (skip) — raise mode raises here."""
            for i, s_ in zip(dense_idx, summed[:-1]):
                job.grads[i].copy_(s_)
                tensor_bytes[job.keys[i]] = job.grads[i].numel() * job.grads[i].element_size()
            bad = summed[-1] > 0
            self._step_bad = bad.any() if self._step_bad is None else (self._step_bad | bad.any())
            outcome["bad"] = bad
            if self.nonfinite != "propagate" and bool(bad.any()):  # one host sync per bucket, in these modes only
                self._drop_bucket(job, [job.keys[i] for i in range(len(job.grads)) if bool(bad[i])])
                return True
            return False

        plain.append(self._local_flags(job))
        if self.compressor.rounds > 1:
            # the plain tensors and the flags ride in the first round: one collective fewer per bucket
            c_time, m_time, nbytes, dropped = self._run_rounds(job, comp_idx, tensor_bytes, plain, after_plain)
            comm = 0.0
        else:
            t_comm = time.perf_counter()
            summed, nbytes = fused_allreduce(plain, self.group)
            comm = time.perf_counter() - t_comm
            sent += nbytes
            dropped = after_plain(summed)
            c_time = m_time = 0.0
            nbytes = 0
            if not dropped:
                c_time, m_time, nbytes = self._run_planned(
                    job, comp_idx, [decisions[i] for i in comp_idx], tensor_bytes
                )
        if dropped:
            self._account(job, sent + nbytes, tensor_bytes, 0.0, comm + m_time, 0, len(dense_idx))
            return
        if self.nonfinite == "propagate":
            for i in comp_idx:  # every rank sees the NaN, so every rank's GradScaler skips alike
                job.grads[i].masked_fill_(outcome["bad"][i], float("nan"))
        sent += nbytes
        comm += m_time
        total = time.perf_counter() - t0
        self._account(job, sent, tensor_bytes, min(c_time, total), comm, len(comp_idx), len(dense_idx))

    def _ctx(self, key: str, step: int) -> Context:
        return Context(key=key, step=step, rank=self.rank, world_size=self.world_size, seed=self.seed)

    def _compensate(self, key: str, grad: torch.Tensor) -> torch.Tensor:
        """``grad`` + residual (a fresh tensor) with error feedback, else
        ``grad`` itself."""
        return self.memory.compensate(key, grad) if self.error_feedback else grad

    def _run_planned(
        self, job: _Job, comp_idx: list[int], decisions: list[Decision], tensor_bytes: dict[str, int]
    ) -> tuple[float, float, int]:
        """Compensate each tensor whole, cut it into its planned partitions,
        exchange each strategy's group (fixed order), reassemble."""
        t0 = time.perf_counter()
        compensated = [self._compensate(job.keys[i], job.grads[i]) for i in comp_idx]
        groups: dict[str, list[tuple[int, torch.Tensor, Context]]] = {}
        for pos, (i, d) in enumerate(zip(comp_idx, decisions)):
            p, key = compensated[pos], job.keys[i]
            if d.parts <= 1:
                groups.setdefault(d.strategy, []).append((pos, p, self._ctx(key, job.step)))
            else:
                for k, part in enumerate(torch.tensor_split(p.reshape(-1), d.parts)):
                    groups.setdefault(d.strategy, []).append((pos, part, self._ctx(f"{key}#{k}", job.step)))
        outs: list[list[torch.Tensor]] = [[] for _ in comp_idx]
        resids: list[list[torch.Tensor]] = [[] for _ in comp_idx]
        nbytes = [0] * len(comp_idx)
        sent = 0
        comp_s = time.perf_counter() - t0
        comm_s = 0.0
        for name in STRATEGY_ORDER:
            items = groups.get(name)
            if not items:
                continue
            strat = self.strategies.get(name)
            if strat is None:
                raise RuntimeError(f"plan uses strategy {name!r}, which this hook cannot use with {self.compressor.name!r}")
            t1 = time.perf_counter()
            # p is the hook's own (not a gradient view): strategies may turn it into the residual in place
            t_items = [t for _, t, _ in items]
            result = strat.exchange(self.compressor, t_items, [c for _, _, c in items], self.error_feedback)
            dt = time.perf_counter() - t1
            comp_s += result.compress_s
            comm_s += max(0.0, dt - result.compress_s)
            sent += result.bytes_sent
            for j, (pos, _, _) in enumerate(items):
                outs[pos].append(result.tensors[j])
                if result.residuals is not None:
                    resids[pos].append(result.residuals[j])
                elif result.estimates is not None:
                    resids[pos].append(t_items[j] - result.estimates[j].reshape(t_items[j].shape))
                nbytes[pos] += result.tensor_bytes[j]
        t2 = time.perf_counter()
        for pos, i in enumerate(comp_idx):
            grad, key = job.grads[i], job.keys[i]
            avg = outs[pos][0] if len(outs[pos]) == 1 else torch.cat([o.reshape(-1) for o in outs[pos]])
            if self.error_feedback and len(resids[pos]) == len(outs[pos]):
                r = resids[pos][0] if len(resids[pos]) == 1 else torch.cat([e.reshape(-1) for e in resids[pos]])
                self.memory.stage(key, r.reshape(grad.shape))
            grad.copy_(avg.reshape(grad.shape))
            tensor_bytes[key] = nbytes[pos]
        comp_s += time.perf_counter() - t2
        return comp_s, comm_s, sent

    def _run_rounds(
        self, job: _Job, comp_idx: list[int], tensor_bytes: dict[str, int],
        first_extra: list[torch.Tensor], after_first: Callable[[list[torch.Tensor]], bool],
    ) -> tuple[float, float, int, bool]:
        """The multi-round protocol for the bucket's compressed tensors;
        ``first_extra`` rides in the first allreduce and ``after_first`` gets
        its sums (True from it drops the bucket: no further round)."""
        n = self.world_size
        comp_time = comm_time = 0.0
        sent = 0
        states: list[Any] = []
        outgoing: list[torch.Tensor | None] = []
        comps: list[torch.Tensor] = []
        dense: list[int] = []
        t = time.perf_counter()
        for pos, i in enumerate(comp_idx):
            key = job.keys[i]
            p = self._compensate(key, job.grads[i])
            comps.append(p)
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
            extra = first_extra if first else []
            summed, nbytes = fused_allreduce([*(outgoing[j] for j in active), *extra], self.group)  # type: ignore[misc]
            comm_time += time.perf_counter() - t
            sent += nbytes
            if first:
                if after_first(summed[len(active):]):
                    return comp_time, comm_time, sent, True
                summed = summed[: len(active)]
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
            state, grad = states[j], job.grads[i]
            if j in dense:
                grad.copy_(state[1].view_as(grad))
            else:
                approx = self.compressor.finish(state, out=grad)  # written into the bucket when it can
                if approx is not grad:
                    grad.copy_(approx.reshape(grad.shape))
            if self.error_feedback:
                # p is the hook's own tensor: it becomes the residual in place
                # (a tensor that travelled dense dropped nothing: its residual is zero)
                p = comps[j]
                self.memory.stage(job.keys[i], p.zero_() if j in dense else p.sub_(grad.reshape(p.shape).to(p.dtype)))
        comp_time += time.perf_counter() - t
        return comp_time, comm_time, sent, False

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
            self._fold_bad_steps()
            out = dict(self._stats)
            out["tensor_bytes"] = dict(self._stats["tensor_bytes"])
        out["ratio"] = out["dense_bytes"] / out["bytes_sent"] if out["bytes_sent"] else 1.0
        return out

    def _fold_bad_steps(self) -> None:
        """Turn the per-step NaN/Inf flags (tensors, kept to avoid host syncs
        on the hot path) into counts. Called with the lock held."""
        bad = [bool(b) for b in self._bad_steps]
        self._bad_steps = []
        self._stats["nonfinite_steps"] += sum(bad)
        if self.nonfinite == "skip":
            self._stats["skipped_steps"] += sum(bad)

    @property
    def last_step_skipped(self) -> bool:
        """True when the last completed step was dropped on every rank
        (``nonfinite='skip'``): do not call ``optimizer.step()`` then."""
        flag = self._last_skipped
        return bool(flag) if flag is not None else False

    @property
    def step(self) -> int:
        return self._step

    def memory_bytes(self) -> dict[str, int]:
        """Extra memory this hook keeps, in bytes: ``residuals`` (error
        feedback: one copy of each compressed gradient), ``compressor``
        (its own state: momentum, factors...), ``strategies`` (ring/ps
        residuals) and their ``total``."""

        def size(obj: Any) -> int:
            if isinstance(obj, torch.Tensor):
                return obj.numel() * obj.element_size()
            if isinstance(obj, Mapping):
                return sum(size(v) for v in obj.values())
            if isinstance(obj, (list, tuple)):
                return sum(size(v) for v in obj)
            return 0

        out = {
            "residuals": self.memory.nbytes(),
            "compressor": size(self.compressor.state_dict()),
            "strategies": size([st.state_dict() for st in self.strategies.values() if hasattr(st, "state_dict")]),
        }
        out["total"] = sum(out.values())
        return out

    def state_dict(self) -> dict[str, Any]:
        """All compression state: config, step, residuals, compressor state."""
        with self._lock:
            self._fold_bad_steps()
            stats = dict(self._stats)
        return {
            "format": "gradpress-hook/1",
            "config": self.config(),
            "step": self._step,
            "memory": self.memory.state_dict(),
            "compressor": self.compressor.state_dict(),
            "strategies": {n: st.state_dict() for n, st in self.strategies.items() if hasattr(st, "state_dict")},
            "plan": self.plan.to_dict(),
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
        for name, st in state.get("strategies", {}).items():
            if name in self.strategies and hasattr(self.strategies[name], "load_state_dict"):
                self.strategies[name].load_state_dict(st)
        saved = state.get("plan")
        if saved and self.strategy_name == "auto":
            # keep the partitions the strategies' residuals are keyed by
            self.plan = Plan({
                k: Decision(k, self.plan[k].numel if k in self.plan.decisions else 0, v["strategy"], int(v["parts"]), reason="checkpoint")
                for k, v in saved.items()
            }, "checkpoint")
        with self._lock:
            self._stats.update(state.get("stats", {}))

    def close(self) -> None:
        """Stop the communication thread (the hook must not be used after).
        Called at interpreter exit for every hook still open."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout=5)
        _OPEN_HOOKS.discard(self)


_OPEN_HOOKS: weakref.WeakSet[GradpressHook] = weakref.WeakSet()


@atexit.register
def _close_open_hooks() -> None:
    for hook in list(_OPEN_HOOKS):
        hook.close()


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
    plan_costs: CostModel | Mapping[str, Any] | None = None,
    nonfinite: str = "propagate",
    timeout: float | datetime.timedelta | None = None,
    **params: Any,
) -> GradpressHook:
    """Register the gradpress comm hook on ``ddp_model`` and return its handle.

    ``spec``: a compressor spec (``"topk:ratio=0.01"``) or instance; extra
    keywords are compressor parameters. ``error_feedback``: None uses the
    compressor's default (on for biased methods). ``strategy``: ``auto``
    (per-tensor plan from a cost model measured on the live group, see
    :mod:`gradpress.plan`; ``handle.plan.table()`` shows it) or a name from
    ``gradpress.comm.available()`` forced for every eligible tensor, or
    ``collective`` (allreduce for summable compressors, allgather otherwise:
    every eligible tensor compressed whatever the link, as before the planner).
    ``plan_costs``: inject the cost model for ``auto`` instead of measuring
    (a :class:`~gradpress.plan.CostModel` or a mapping of its fields to
    ``(overhead, a, b)``). Tensors with fewer than ``min_numel``
    elements and 1-D tensors go through one fused plain allreduce. ``seed``
    derives shared randomness. Every rank must call this with the same
    arguments: a mismatch raises ``ValueError`` on every rank.
    ``nonfinite``: what to do when a rank's gradient has a NaN/Inf, one of
    ``NONFINITE_MODES`` (see there). ``timeout``: seconds (or a timedelta)
    after which a collective that a dead or stuck peer never joins fails
    with an error instead of hanging; default: the timeout of the DDP
    model's process group.
    """
    if not isinstance(ddp_model, torch.nn.parallel.DistributedDataParallel):
        raise ValueError(f"ddp_model must be torch.nn.parallel.DistributedDataParallel, got {type(ddp_model).__name__}")
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized; call dist.init_process_group first (torchrun does)")
    base_group = process_group if process_group is not None else ddp_model.process_group
    ranks = dist.get_process_group_ranks(base_group)
    own_group = dist.new_group(ranks=ranks, backend=dist.get_backend(base_group), timeout=_timeout_of(base_group, timeout))
    hook: GradpressHook | None = None
    error = None
    try:
        hook = GradpressHook(
            ddp_model.module, create(spec, **params), error_feedback=error_feedback, strategy=strategy,
            min_numel=min_numel, seed=seed, process_group=own_group, plan_costs=plan_costs,
            nonfinite=nonfinite,
        )
    except Exception as exc:  # noqa: BLE001 - every rank must reach _agree, or the others hang
        error = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
    try:
        _agree(hook.config() if hook is not None else None, error, own_group)
    except ValueError:
        if hook is not None:
            hook.close()
        raise
    assert hook is not None
    if hook.strategy_name == "auto" and plan_costs is None:
        hook.replan()  # collective: every rank measures together, rank 0 fits
    else:
        log_plan(hook.plan, hook.rank)
    ddp_model.register_comm_hook(hook, gradpress_hook)
    _OPEN_HOOKS.add(hook)
    return hook


def _timeout_of(group: dist.ProcessGroup, timeout: float | datetime.timedelta | None) -> datetime.timedelta | None:
    """The timeout for gradpress's own group: the caller's, else the base
    group's (``new_group`` would otherwise fall back to 30 minutes)."""
    if timeout is not None:
        if isinstance(timeout, datetime.timedelta):
            return timeout
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds or a timedelta, got {timeout!r}")
        return datetime.timedelta(seconds=float(timeout))
    try:
        device = torch.device("cuda") if dist.get_backend(group) == "nccl" else torch.device("cpu")
        return group._get_backend(device).options._timeout
    except Exception:  # noqa: BLE001 - private API; fall back to torch's default
        return None


def gradpress_hook(state, bucket):  # noqa: ANN001,ANN201 - DDP inspects these annotations; leave them off
    """The DDP comm hook function; ``state`` is the :class:`GradpressHook`."""
    return state.submit(bucket)
