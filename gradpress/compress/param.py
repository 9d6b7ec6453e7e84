"""A typed, validated parameter of a compressor, strategy or algorithm spec (``PARAMS``): its type, default,
the words that say what is allowed (every error and ``gradpress compressors`` show them) and the check.
Re-exported by :mod:`gradpress.compress.base` and :mod:`gradpress.compress`."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["Param"]


@dataclass(frozen=True)
class Param:
    """A typed, validated compressor parameter.

    ``check`` returns True for allowed values; ``allowed`` says in words what
    is allowed (used in error messages and in ``gradpress compressors``).
    """

    name: str
    type: type
    default: Any
    allowed: str = "any"
    check: Callable[[Any], bool] | None = None
    doc: str = ""

    def coerce(self, value: Any, owner: str, kind: str = "compressor") -> Any:
        """Convert ``value`` (possibly a spec-string token) and validate it.

        ``owner`` is the name of what the parameter belongs to and ``kind``
        what that is (``"compressor"``, ``"algorithm"``, ...): errors read
        ``"<kind> '<owner>': parameter ..."``."""
        try:
            if self.type is bool and isinstance(value, str):
                low = value.strip().lower()
                if low in ("1", "true", "yes", "on"):
                    value = True
                elif low in ("0", "false", "no", "off"):
                    value = False
                else:
                    raise ValueError(value)
            elif self.type is int and isinstance(value, str):
                as_float = float(value)
                if not as_float.is_integer():
                    raise ValueError(value)
                value = int(as_float)
            elif self.type is int and isinstance(value, float):
                if not value.is_integer():
                    raise ValueError(value)
                value = int(value)
            elif self.type is int and isinstance(value, bool):
                raise ValueError(value)
            elif value is not None and not isinstance(value, self.type):
                value = self.type(value)
        except (TypeError, ValueError):
            raise ValueError(
                f"{kind} {owner!r}: parameter {self.name!r} got {value!r}; "
                f"expected {self.type.__name__} ({self.allowed})"
            ) from None
        if self.type is float and isinstance(value, float) and not math.isfinite(value):
            raise ValueError(
                f"{kind} {owner!r}: parameter {self.name!r} got {value!r}; allowed: {self.allowed}"
            )
        if self.check is not None and not self.check(value):
            raise ValueError(
                f"{kind} {owner!r}: parameter {self.name!r} got {value!r}; allowed: {self.allowed}"
            )
        return value
