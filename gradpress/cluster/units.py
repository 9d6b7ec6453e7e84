"""Parse rates, sizes and times the way ``tc(8)`` writes them.

Invariant: every parser returns a positive number in base units (bits per
second, bytes, seconds) or raises ``ValueError`` naming the field, the value
and the accepted forms. Units are case-insensitive, as in tc.

- rate: ``bit`` (or a bare number) = bits/s; ``kbit``/``mbit``/``gbit``/``tbit``
  (SI, x1000); ``kibit``/``mibit``/``gibit``/``tibit`` (IEC, x1024);
  ``bps``/``kbps``/``mbps``/``gbps``/``tbps`` (bytes/s, SI) and ``kibps`` ...
  (bytes/s, IEC). ``100mbit`` = 100,000,000 bit/s; ``1mbps`` = 8,000,000 bit/s.
- size: a bare number or ``b`` = bytes; ``k``/``kb`` = 1024 bytes, ``m``/``mb``
  = 1024**2, ``g``/``gb`` = 1024**3 (tc's convention); ``kbit``/``mbit``/``gbit``
  = 1024/1024**2/1024**3 bits.
- time: ``s``/``sec``/``secs``, ``ms``/``msec``/``msecs``, ``us``/``usec``/``usecs``;
  a bare number is microseconds (tc's convention).
"""

from __future__ import annotations

import math
import re

__all__ = ["parse_rate", "parse_size", "parse_time", "format_rate", "RATE_FORMS", "SIZE_FORMS", "TIME_FORMS"]

_NUMBER = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:e([+-]?[0-9]+))?\s*([a-z]*)\s*$", re.IGNORECASE)

_RATE_UNITS: dict[str, float] = {"": 1.0, "bit": 1.0, "bps": 8.0}
for _p, _m in (("k", 1e3), ("m", 1e6), ("g", 1e9), ("t", 1e12)):
    _RATE_UNITS[f"{_p}bit"] = _m
    _RATE_UNITS[f"{_p}bps"] = 8 * _m
for _i, (_p, _m) in enumerate((("ki", 1024.0), ("mi", 1024.0**2), ("gi", 1024.0**3), ("ti", 1024.0**4))):
    _RATE_UNITS[f"{_p}bit"] = _m
    _RATE_UNITS[f"{_p}bps"] = 8 * _m

_SIZE_UNITS: dict[str, float] = {
    "": 1, "b": 1, "k": 1024, "kb": 1024, "m": 1024**2, "mb": 1024**2, "g": 1024**3, "gb": 1024**3,
    "kbit": 1024 / 8, "mbit": 1024**2 / 8, "gbit": 1024**3 / 8,
}

_TIME_UNITS: dict[str, float] = {
    "": 1e-6, "us": 1e-6, "usec": 1e-6, "usecs": 1e-6,
    "ms": 1e-3, "msec": 1e-3, "msecs": 1e-3,
    "s": 1.0, "sec": 1.0, "secs": 1.0,
}

RATE_FORMS = ("a positive number with a tc rate unit, e.g. 500kbit, 50mbit, 100mbit, 1gbit, 2.5gbit, "
              "10mibit, 12mbps (bytes/s); a bare number is bit/s")
SIZE_FORMS = "a positive size, e.g. 1514, 32kb, 64k, 1mb, 256kbit (k/kb/m/mb are x1024 bytes, as in tc)"
TIME_FORMS = "a positive time, e.g. 50ms, 1s, 500us (a bare number is microseconds, as in tc)"

#: Bounds of what tbf can shape sensibly (kernel rates are 64-bit bytes/s).
MIN_RATE_BITS = 8_000
MAX_RATE_BITS = 1_000_000_000_000


def _split(value: object, field: str, forms: str) -> tuple[float, str]:
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ValueError(f"{field}={value!r} is not allowed: expected {forms}")
    text = str(value)
    m = _NUMBER.match(text)
    if not m:
        raise ValueError(f"{field}={value!r} is not allowed: expected {forms}")
    # float() of the whole literal: 1e400 is inf (refused by the caller's range check), where 10.0 ** 400
    # raised OverflowError
    number = float(m.group(1) + (f"e{m.group(2)}" if m.group(2) else ""))
    return number, m.group(3).lower()


def parse_rate(value: object, field: str = "bandwidth") -> int:
    """Return the rate in bits per second (an int) from ``"100mbit"`` etc."""
    number, unit = _split(value, field, RATE_FORMS)
    if unit not in _RATE_UNITS:
        raise ValueError(f"{field}={value!r}: unknown rate unit {unit!r}; expected {RATE_FORMS}")
    bits = number * _RATE_UNITS[unit]
    if not math.isfinite(bits) or bits < MIN_RATE_BITS or bits > MAX_RATE_BITS:
        raise ValueError(f"{field}={value!r} ({bits:g} bit/s) is out of range: allowed 8kbit .. 1tbit; "
                         f"expected {RATE_FORMS}")
    return int(round(bits))


def parse_size(value: object, field: str = "burst") -> int:
    """Return a size in bytes (an int) from ``"32kb"`` etc."""
    number, unit = _split(value, field, SIZE_FORMS)
    if unit not in _SIZE_UNITS:
        raise ValueError(f"{field}={value!r}: unknown size unit {unit!r}; expected {SIZE_FORMS}")
    size = number * _SIZE_UNITS[unit]
    if not math.isfinite(size) or size < 1 or size > 2**31:
        raise ValueError(f"{field}={value!r} is out of range: allowed 1 byte .. 2gb; expected {SIZE_FORMS}")
    return int(math.ceil(size))


def parse_time(value: object, field: str = "latency") -> float:
    """Return a time in seconds from ``"50ms"`` etc."""
    number, unit = _split(value, field, TIME_FORMS)
    if unit not in _TIME_UNITS:
        raise ValueError(f"{field}={value!r}: unknown time unit {unit!r}; expected {TIME_FORMS}")
    seconds = number * _TIME_UNITS[unit]
    if not math.isfinite(seconds) or seconds <= 0 or seconds > 60:
        raise ValueError(f"{field}={value!r} is out of range: allowed > 0 .. 60s; expected {TIME_FORMS}")
    return seconds


def format_rate(bits_per_s: float) -> str:
    """Human-readable rate, e.g. ``47.8 Mbit/s``."""
    for scale, name in ((1e9, "Gbit/s"), (1e6, "Mbit/s"), (1e3, "kbit/s")):
        if bits_per_s >= scale:
            return f"{bits_per_s / scale:.3g} {name}"
    return f"{bits_per_s:.3g} bit/s"
