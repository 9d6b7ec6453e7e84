"""What the DDP hook reads from DDP besides the bucket's values: each
gradient in its parameter's own layout, and which parameters got a
gradient (DDP's ``find_unused_parameters`` and ``static_graph`` leave some
without one).

Invariants: :func:`param_layout` gives the view whose element at each index
is that index's gradient (``GradBucket.gradients()`` returns contiguous
views even where DDP laid a gradient out in the parameter's strides:
channels_last, a transposed parameter); :class:`UsedTracker` says a
parameter is used when it got a gradient in any backward since the last
synced one (``no_sync`` included), as DDP's reducer marks it.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = ["Job", "restrided", "param_layout", "UsedTracker", "UnusedWatch", "unused_warning", "sparse_refusal", "SPARSE_BUCKET"]


class Job:
    """One bucket as the hook queues it for its communication thread."""

    __slots__ = ("buffer", "grads", "keys", "params", "step", "is_last", "future", "event", "used")

    def __init__(self, buffer, grads, keys, params, step, is_last, future, event, used=None) -> None:  # noqa: ANN001
        self.used = used  # per parameter: did it get a gradient here since the last synced step (None: unknown)
        self.buffer = buffer
        self.grads = grads
        self.keys = keys
        self.params = params
        self.step = step
        self.is_last = is_last
        self.future = future
        self.event = event


def _dense_layout(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill their storage span without gaps or
    overlaps, in some order of its dimensions (DDP's test for laying a
    gradient out in its bucket with the parameter's own strides)."""
    expected = 1
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def restrided(param: torch.Tensor) -> bool:
    """Whether DDP lays ``param``'s gradient out in ``param``'s own strides, unlike a contiguous tensor's
    (dense in another order of its dimensions: channels_last, a transposed parameter)."""
    return param.numel() > 1 and not param.is_contiguous() and _dense_layout(param)


def param_layout(grad: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``grad`` (a bucket view as ``GradBucket.gradients()`` returns it,
    contiguous strides) with the layout DDP gave it in the bucket: the
    parameter's own strides when :func:`restrided`."""
    return grad.as_strided(param.shape, param.stride()) if restrided(param) else grad


def _note(used: set[int], key: int, param: torch.Tensor) -> None:
    used.add(key)


class UsedTracker:
    """Which of ``params`` got a gradient since they were last taken: a hook
    after each accumulation (autograd thread). ``take`` answers for a
    bucket's parameters and forgets them (the next step starts afresh)."""

    def __init__(self, params: Sequence[torch.nn.Parameter]) -> None:
        self._used: set[int] = set()
        self._handles: list[Any] = [p.register_post_accumulate_grad_hook(functools.partial(_note, self._used, id(p)))
                                    for p in params]

    def take(self, params: Sequence[torch.nn.Parameter]) -> list[bool]:
        flags = [id(p) in self._used for p in params]
        self._used.difference_update(id(p) for p in params)
        return flags

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def unused_warning(keys: Sequence[str], params: Sequence[torch.nn.Parameter], used: Sequence[bool],
                   plan: Mapping[str, Any]) -> str | None:
    """The warning for a hook that cannot tell whether any rank used a
    parameter (it was not given the DDP model) when one the ``plan``
    (decisions by key) compresses got no gradient here (``used`` False),
    named by its key and shape; None when none did."""
    names = [f"{k} ({'x'.join(map(str, p.shape))})" for k, p, u in zip(keys, params, used)
             if not u and k in plan and plan[k].compressed]
    if not names:
        return None
    return (f"gradpress hook: parameter(s) {', '.join(names)} got no gradient on this rank (DDP's "
            "find_unused_parameters=True or static_graph=True), but this hook state does not know the DDP model's "
            "options: a parameter that no rank used is then compressed, and what its residual sends is lost (DDP "
            "discards it). Bind the state to the DDP model before the first backward: gradpress.ddp.register(ddp, "
            "...), make_hook(spec, ddp) or state.bind(ddp)")


class UnusedWatch:
    """Looks, for a hook state that does not know the DDP model's options
    (bound to the bare module, or binding itself at the first backward), for
    a compressed parameter that got no gradient on this rank, and gives the
    text of :func:`unused_warning` once. From the hook's step ``since`` of
    :meth:`start` on it asks a :class:`UsedTracker` (an unused parameter's
    ``.grad`` is not None after ``zero_grad(set_to_none=False)`` or as a
    bucket view); a step before (the first backward of a state binding
    itself) is read from the ``.grad`` attributes that are None."""

    def __init__(self) -> None:
        self._tracker: UsedTracker | None = None
        self._since = 0
        self.warned = False

    def start(self, params: Sequence[torch.nn.Parameter] | None, since: int) -> None:
        """Watch ``params`` (those that require a gradient) unless watching
        or warned already; None: stop watching (the DDP model is known)."""
        if params is None or self.warned:
            if self._tracker is not None:
                self._tracker.close()
            self._tracker = None
        elif self._tracker is None:
            self._tracker, self._since = UsedTracker([p for p in params if p.requires_grad]), since

    def check(self, job: Job, plan: Mapping[str, Any]) -> str | None:
        """The warning for ``job`` (keys set; ``plan``: decisions by key), the first time there is one."""
        if self._tracker is None:
            return None
        used = self._tracker.take(job.params)
        if job.step < self._since:
            used = [p.grad is not None for p in job.params]
        message = unused_warning(job.keys, job.params, used, plan)
        if message is not None:
            self.warned = True
            self.start(None, 0)
        return message


#: why a bucket of sparse gradients is refused (one that binds at the first backward meets it there)
SPARSE_BUCKET = ("gradpress hook: sparse gradients are not supported (DDP hands a sparse bucket: an "
                 "nn.Embedding/EmbeddingBag with sparse=True); use sparse=False, the default (dense gradients)")


def sparse_refusal(model: torch.nn.Module) -> str | None:
    """The refusal of a model whose gradients DDP would hand over sparse
    (``nn.Embedding``/``nn.EmbeddingBag`` with ``sparse=True`` and a trainable
    weight; a frozen one gets no gradient, DDP leaves it out), naming the
    modules; None when there is none."""
    names = [n or "(the model)" for n, m in model.named_modules()
             if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse and m.weight.requires_grad]
    if not names:
        return None
    return (f"gradpress hook: sparse gradients are not supported: {', '.join(names)} has sparse=True; use "
            "sparse=False, the default (dense gradients), or plain DDP for these modules")
