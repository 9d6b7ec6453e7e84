"""Which spec string the compressor benchmark uses for each registered name.

``--compressors all`` benchmarks every name of
:func:`gradpress.compressors.names` with the spec below, or the bare name
(the class defaults) when the name has no entry or its entry no longer builds
(a parameter was renamed). Selection methods run at density 0.001, the
setting of the SIDCo/DGC-versus-top-k comparison.

Also parses the ``--compressors`` and ``--sizes`` arguments.
"""

from __future__ import annotations

import math
import re

from gradpress.compress.base import Compressor
from gradpress.compress.registry import create, names
from gradpress.compress.spec import append_piece

__all__ = [
    "BENCH_SPECS",
    "QUANTIZERS",
    "THRESHOLD_SELECTORS",
    "build",
    "density_of",
    "is_selection",
    "parse_compressors",
    "parse_sizes",
]

SELECTION_DENSITY = 0.001

#: registry name -> spec benchmarked by ``--compressors all``
BENCH_SPECS: dict[str, str] = {
    "topk": f"topk:ratio={SELECTION_DENSITY}",
    "randomk": f"randomk:ratio={SELECTION_DENSITY}",
    "dgc": f"dgc:ratio={SELECTION_DENSITY}",
    "dgc_threshold": f"dgc_threshold:ratio={SELECTION_DENSITY}",
    "sidco": f"sidco:ratio={SELECTION_DENSITY}",
    "gaussiank": f"gaussiank:ratio={SELECTION_DENSITY}",
    "redsync": f"redsync:ratio={SELECTION_DENSITY}",
    "threshold": "threshold:tau=3.29",  # P(|x| > 3.29) = 0.001 for N(0, 1) input
    "powersgd": "powersgd:rank=2,start_iter=0",
}

#: quantizers held to the throughput target (>= 25% of the copy roofline)
QUANTIZERS = ("fp16", "bf16", "qsgd", "terngrad", "natural", "minmax8", "signsgd", "onebit")
#: threshold selectors held to the speed target (>= 3x faster than exact top-k)
THRESHOLD_SELECTORS = ("sidco", "dgc", "dgc_threshold")

_DENSITY_PARAMS = ("ratio", "density")


def build(spec: str) -> tuple[Compressor, str]:
    """``(compressor, note)``; for a table spec that no longer builds, the
    bare name is used and ``note`` says why."""
    try:
        return create(spec), ""
    except ValueError as exc:
        name = spec.split(":", 1)[0].split(">", 1)[0].strip()
        if BENCH_SPECS.get(name) != spec:
            raise
        return create(name), f"bench spec {spec!r} rejected ({exc}); using defaults"


def density_of(c: Compressor) -> float | None:
    """Target density of a selection method (its ``ratio``/``density``
    parameter), or None."""
    first = getattr(c, "first", c)  # a composition selects with its first stage
    if first.values_index != 0:
        return None
    for name in _DENSITY_PARAMS:
        value = getattr(first, name, None)
        if isinstance(value, float) and 0 < value <= 1:
            return value
    return None


def is_selection(c: Compressor) -> bool:
    return density_of(c) is not None


def parse_compressors(text: str) -> list[str]:
    """Spec strings from ``--compressors``: ``all`` or a comma-separated list
    of specs. Commas inside a spec's parameter list stay with it
    (``qsgd:levels=4,bucket=512,topk`` is two specs); ``;`` also separates."""
    text = text.strip()
    if not text:
        raise ValueError("--compressors got ''; allowed: 'all' or a comma-separated list of compressor specs")
    if text == "all":
        return [BENCH_SPECS.get(n, n) for n in names()]
    specs: list[str] = []
    for part in text.split(";"):
        for token in part.split(","):
            token = token.strip()
            if token:
                append_piece(specs, token, "--compressors", text)
    if not specs:
        raise ValueError(f"--compressors got {text!r}; allowed: 'all' or at least one compressor spec")
    for spec in specs:
        try:
            create(spec)
        except ValueError as exc:
            raise ValueError(f"--compressors: bad spec {spec!r}: {exc}") from None
    return specs


_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMgG]?)\s*$")
_SUFFIX = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}


def parse_sizes(text: str) -> list[int]:
    """Element counts from ``--sizes``: comma-separated, with optional
    decimal suffix K (1e3), M (1e6), G (1e9): ``4K,1M,25M``, ``2.5e7``."""
    sizes = []
    for token in text.split(","):
        if not token.strip():
            continue
        m = _SIZE_RE.match(token)
        if not m:
            raise ValueError(f"--sizes: bad size {token.strip()!r}; allowed: positive element counts like 4K, 1M, 25M, 1000")
        value = float(m.group(1)) * _SUFFIX[m.group(2).lower()]
        if not math.isfinite(value) or value < 1 or not float(value).is_integer():
            raise ValueError(f"--sizes: bad size {token.strip()!r}; allowed: a whole number of elements >= 1")
        sizes.append(int(value))
    if not sizes:
        raise ValueError(f"--sizes got {text!r}; allowed: comma-separated element counts like 4K,1M,25M")
    return sizes
