"""Exact accounting of what an exchange engine hands to collectives.

``stats`` counts the bytes actually handed to collectives (payload, headers,
padding, size exchanges, NaN/Inf flags), per step and per tensor, never a
theoretical figure. ``dense_bytes`` is what plain DDP would have handed to
its allreduce for the same tensors, so ``ratio`` compares across
compressors, strategies and algorithms. NaN/Inf step flags are kept as
tensors (no host sync on the hot path) and folded into counts when read.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["STATS_KEYS", "ExchangeStats", "check_counters"]

#: Every key of ``stats`` and what it means.
STATS_KEYS: dict[str, str] = {
    "steps": "synchronous steps completed (buckets of one backward pass count once)",
    "bytes_sent": "total bytes this rank handed to collectives, all steps (payload, headers, padding, size exchanges)",
    "dense_bytes": "total bytes plain DDP would have handed to its allreduce for the same steps",
    "host_bytes": "of bytes_sent, the bytes handed to collectives among the workers of one host (strategy "
                  "'hierarchical': its dense reduce and broadcast); they never cross a link between hosts",
    "last_step_bytes": "bytes_sent during the last completed step",
    "last_step_host_bytes": "host_bytes during the last completed step",
    "last_step_dense_bytes": "dense_bytes of the last completed step",
    "ratio": "dense_bytes / bytes_sent (compression ratio on the wire; 1.0 before the first step)",
    "compress_s": "seconds spent in error feedback, encoding and decoding (this rank, all steps)",
    "comm_s": "seconds spent inside collectives (this rank, all steps)",
    "compressed_tensors": "number of tensors per step that go through the compressor",
    "dense_tensors": "number of tensors per step that go through the fused plain allreduce",
    "tensor_bytes": "payload bytes per tensor (parameter name) in the last step",
    "strategy_bytes": "of bytes_sent, the bytes per strategy that handed them to collectives, all steps "
                      "('uncompressed': the plain fused allreduce of the tensors left dense, where it ran on "
                      "its own; a prelude riding inside a strategy's collective counts under that strategy); "
                      "an algorithm's own exchanges are not in it",
    "nonfinite_steps": "steps in which some rank had a NaN/Inf gradient",
    "skipped_steps": "steps skipped on every rank because of a NaN/Inf gradient (nonfinite='skip')",
    "nothing_compressed": "True when the compressor is not the identity yet no tensor went through it in the last "
                          "step (all 1-D, below min_numel, or planned dense by strategy 'auto')",
}

_COUNTERS = ("steps", "bytes_sent", "host_bytes", "dense_bytes", "last_step_bytes", "last_step_host_bytes",
             "last_step_dense_bytes", "compress_s",
             "comm_s", "compressed_tensors", "dense_tensors", "tensor_bytes", "nonfinite_steps", "skipped_steps",
             "strategy_bytes")
#: the counters that are mappings (per tensor, per strategy)
_MAPPINGS = ("tensor_bytes", "strategy_bytes")


def _counter_error(where: str, value: Any, seconds: bool) -> str | None:
    """Why ``value`` cannot be the counter at ``where`` (None: it can): a count is an integer >= 0, seconds
    a finite number >= 0 (an integer too); never a bool."""
    if seconds:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0
        allowed = "a finite number of seconds >= 0"
    else:
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
        allowed = "an integer >= 0"
    return None if ok else f"stats[{where}]: {value!r} ({type(value).__name__}); allowed: {allowed}"


def check_counters(state: Any) -> None:
    """Raise ``ValueError`` naming the key, the value and what is allowed unless ``state`` is a mapping whose
    counters (those it has of :data:`_COUNTERS`; others are ignored) are what :class:`ExchangeStats` keeps:
    ``tensor_bytes`` and ``strategy_bytes`` mappings of string keys to integers >= 0, the ``*_s`` seconds
    finite numbers >= 0, every other counter an integer >= 0. A state that loaded otherwise would break the
    stats later (a sum, a ratio, a summary) far from the load."""
    if not isinstance(state, Mapping):
        raise ValueError(f"stats: {type(state).__name__} {str(state)[:80]!r}; allowed: a dict of counters")
    for key in _COUNTERS:
        if key not in state:
            continue
        value = state[key]
        if key in _MAPPINGS:
            if not isinstance(value, Mapping):
                raise ValueError(f"stats[{key!r}]: {type(value).__name__} {str(value)[:80]!r}; allowed: a dict "
                                 "of byte counts (integers >= 0) by name")
            for name, count in value.items():
                if not isinstance(name, str):
                    raise ValueError(f"stats[{key!r}]: key {name!r} ({type(name).__name__}); allowed: strings")
                if (why := _counter_error(f"{key!r}][{name!r}", count, False)) is not None:
                    raise ValueError(why)
        elif (why := _counter_error(repr(key), value, key.endswith("_s"))) is not None:
            raise ValueError(why)


def _zero(counter: str) -> Any:
    """A counter's value before any call: {} per tensor or strategy, 0.0 seconds, 0 otherwise."""
    return {} if counter in _MAPPINGS else (0.0 if counter.endswith("_s") else 0)


def _fresh_step() -> dict[str, Any]:
    return {"bytes": 0, "host": 0, "dense": 0, "compressed": 0, "plain": 0, "tensor_bytes": {}}


class ExchangeStats:
    """Thread-safe counters (the DDP hook fills them on its communication
    thread while the training thread reads them)."""

    def __init__(self, count_skipped: bool) -> None:
        self.count_skipped = count_skipped
        self._lock = threading.Lock()
        self._totals: dict[str, Any] = {k: _zero(k) for k in _COUNTERS}
        self._cur = _fresh_step()
        self._bad_steps: list[torch.Tensor] = []

    def record(self, *, sent: int, dense: int, compress_s: float, comm_s: float, compressed: int, plain: int,
               tensor_bytes: Mapping[str, int], end_of_step: bool, host: int = 0,
               by_strategy: Mapping[str, int] | None = None) -> None:
        """Account one call (one bucket); ``end_of_step`` closes the step;
        ``host``: the part of ``sent`` that stayed inside a host;
        ``by_strategy``: ``sent`` per strategy that handed it over."""
        with self._lock:
            s, cur = self._totals, self._cur
            s["bytes_sent"] += sent
            for name, nbytes in (by_strategy or {}).items():
                s["strategy_bytes"][name] = s["strategy_bytes"].get(name, 0) + nbytes
            s["host_bytes"] += host
            s["dense_bytes"] += dense
            s["compress_s"] += compress_s
            s["comm_s"] += comm_s
            cur["bytes"] += sent
            cur["host"] += host
            cur["dense"] += dense
            cur["compressed"] += compressed
            cur["plain"] += plain
            cur["tensor_bytes"].update(tensor_bytes)
            if end_of_step:
                s["steps"] += 1
                s["last_step_bytes"] = cur["bytes"]
                s["last_step_host_bytes"] = cur["host"]
                s["last_step_dense_bytes"] = cur["dense"]
                s["compressed_tensors"] = cur["compressed"]
                s["dense_tensors"] = cur["plain"]
                s["tensor_bytes"] = dict(cur["tensor_bytes"])
                self._cur = _fresh_step()

    def flag_step(self, bad: torch.Tensor) -> None:
        """Remember a step's NaN/Inf flag (0-d bool tensor, folded when read)."""
        with self._lock:
            self._bad_steps.append(bad)

    def _fold(self) -> None:
        bad = [bool(b) for b in self._bad_steps]
        self._bad_steps = []
        self._totals["nonfinite_steps"] += sum(bad)
        if self.count_skipped:
            self._totals["skipped_steps"] += sum(bad)

    def snapshot(self) -> dict[str, Any]:
        """A plain mapping of every key of :data:`STATS_KEYS`."""
        with self._lock:
            self._fold()
            out = dict(self._totals)
            for key in _MAPPINGS:
                out[key] = dict(self._totals[key])
        out["ratio"] = out["dense_bytes"] / out["bytes_sent"] if out["bytes_sent"] else 1.0
        return out

    def state_dict(self) -> dict[str, Any]:
        out = self.snapshot()
        out.pop("ratio")
        return out

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the counters; one a state lacks (written before it
        existed, e.g. ``host_bytes``) restarts at zero: it counts from the
        resume, never this object's earlier figure. Every counter is checked
        first (:func:`check_counters`: ``ValueError``, nothing changed)."""
        check_counters(state)
        with self._lock:
            self._totals.update({k: (dict(state[k]) if k in _MAPPINGS else state[k]) if k in state else _zero(k)
                                 for k in _COUNTERS})
