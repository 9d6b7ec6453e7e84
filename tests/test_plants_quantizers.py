"""The wire size of each quantizer (``qsgd``, ``natural``, ``terngrad``,
``dithering``, ``randomk``), computed here from the packet layout its module
docstring states, against both the packet's ``nbytes`` and ``wire_bytes``.
One process, no workers, about a second.

Written for a bug planted by hand (docs/testing.md, "plants2" session) that
the ``quantizers`` group's tests did not notice: dithering's code field
four bytes longer than its packed codes (a header nobody reads), which
decodes correctly but overstates every byte count the strategies and
benchmarks report.
"""

from __future__ import annotations

import math

import pytest
import torch

from gradpress.compress import Context, create

pytestmark = pytest.mark.mutants

SIZES = [1, 7, 8, 100, 1000, 1537]
DTYPES = [torch.float32, torch.float64, torch.float16]


def _ceil_log2(n: int) -> int:
    """ceil(log2 n) for n >= 1, in integers."""
    k = 0
    while (1 << k) < n:
        k += 1
    return k


def _expected(spec: str, d: int, dtype: torch.dtype) -> int:
    """Bytes of one packet by the module docstrings' layouts."""
    name, _, args = spec.partition(":")
    params = dict(a.split("=") for a in args.split(",")) if args else {}
    if name == "qsgd":  # 4 ceil(d/b) + ceil(d bits / 8), bits = ceil(log2(s + 1)) + 1
        s, b = int(params.get("levels", 16)), int(params.get("bucket", 512))
        b = b if b > 0 else max(d, 1)
        return 4 * math.ceil(d / b) + math.ceil(d * (_ceil_log2(s + 1) + 1) / 8)
    if name == "natural":  # d + ceil(d/8)
        return d + math.ceil(d / 8)
    if name == "terngrad":  # 4 + ceil(d/4)
        return 4 + math.ceil(d / 4)
    if name == "dithering":  # 4 (fp64: 8) ceil(d/b) + ceil(d/8) + ceil(d bits / 8), bits = ceil(log2(s + 1))
        s, b = int(params.get("levels", 8)), int(params.get("bucket", 0))
        b = b if 0 < b < d else max(d, 1)
        norm = 8 if dtype == torch.float64 else 4
        return norm * math.ceil(d / b) + math.ceil(d / 8) + math.ceil(d * max(1, _ceil_log2(s + 1)) / 8)
    if name == "randomk":  # k element-size values, k = ceil(ratio d) within [1, d]
        k = min(d, max(1, math.ceil(float(params.get("ratio", 0.01)) * d)))
        return k * torch.empty(0, dtype=dtype).element_size()
    raise AssertionError(spec)


SPECS = ["qsgd", "qsgd:levels=3,bucket=64", "qsgd:levels=255,bucket=0", "natural", "terngrad", "dithering",
         "dithering:levels=3,bucket=64", "dithering:levels=5,natural=true", "dithering:levels=1000,bucket=100",
         "randomk:ratio=0.3", "randomk:ratio=0.3,scale=true"]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: str(t).replace("torch.", ""))
@pytest.mark.parametrize("spec", SPECS)
def test_packet_and_wire_bytes_follow_the_documented_layout(spec: str, dtype: torch.dtype) -> None:
    comp = create(spec)
    for i, d in enumerate(SIZES):
        x = torch.randn(d, generator=torch.Generator().manual_seed(i), dtype=torch.float64).to(dtype)
        packet = comp.encode(x, Context(key=f"t{i}", step=0, rank=0, world_size=1, seed=1))
        want = _expected(spec, d, dtype)
        assert packet.nbytes == want, (spec, d, dtype, packet.nbytes, want)
        assert comp.wire_bytes(d, dtype) == want, (spec, d, dtype)
