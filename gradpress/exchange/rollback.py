"""All-or-nothing ``load_state_dict``: the one mechanism the exchange engine
(:class:`~gradpress.exchange.state.EngineState`), the DDP hook (through its
engine) and the algorithms (:class:`~gradpress.algorithms.base.Algorithm`)
load a state with.

Invariant: a load either succeeds, or raises ``ValueError`` naming the part
that failed ("nothing was loaded") and leaves the object as it was before
the call: a state found bad part-way (a strategy's state after the
compressor's had loaded, a list of the wrong length after the engine's
state had loaded) is undone by loading back the backup taken before the
first part changed. The backup is the object's own earlier state (its
``state_dict``, owned: no tensor shared with what the load overwrites), so
the object after a failed load steps exactly as one that never saw it.
"""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType
from typing import Any, Generic, TypeVar

__all__ = ["Rollback", "NOTHING_LOADED"]

NOTHING_LOADED = "nothing was loaded"

T = TypeVar("T")


class Rollback(Generic[T]):
    """``with Rollback(backup, restore, what) as rb:`` load the parts, setting
    ``rb.part`` to the one being loaded. ``backup()`` is taken on entry; an
    exception inside the block calls ``restore(saved)`` and becomes a
    ``ValueError`` "``what``: ``part``: ..." (an exception that is not an
    ``Exception``, e.g. ``KeyboardInterrupt``, is re-raised as it is, after
    the restore)."""

    def __init__(self, backup: Callable[[], T], restore: Callable[[T], None], what: str) -> None:
        self._backup, self._restore, self.what = backup, restore, what
        self.part = ""
        self._saved: Any = None

    def __enter__(self) -> Rollback[T]:
        self._saved = self._backup()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> bool:
        saved, self._saved = self._saved, None
        if exc is None:
            return False
        self._restore(saved)
        if not isinstance(exc, Exception):
            return False
        where = f"{self.what}: {self.part}" if self.part else self.what
        if isinstance(exc, ValueError):
            message = str(exc) if NOTHING_LOADED in str(exc) else f"{exc} ({NOTHING_LOADED})"
            raise ValueError(f"{where}: {message}") from None
        raise ValueError(f"{where} is malformed ({type(exc).__name__}: {exc}); {NOTHING_LOADED}") from None
