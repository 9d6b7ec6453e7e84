"""Written for survivors of ``make mutants`` (``codecs`` group: the
``a>b`` composition, FFT sparsification, rangefloat and the kit's stream
packs). Expected values are the test's own: traits of a composition from
its stages by the rules its docstring states, parameter ranges as the
parameters declare them, rangefloat's decoded values by its definition in
float64 over a tensor of several spans, and the widths whose word groups are
compiled as ``kit/streams.py`` lists them.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

from gradpress.compress import create, kit
from gradpress.compress.kit import compiler, streams
from gradpress.compress.spans import span_length

pytestmark = pytest.mark.mutants


# ----------------------------------------------------------------------------- compose
@pytest.mark.parametrize("spec", ["topk:ratio=0.1>natural", "dgc>natural", "threshold>fp16",
                                  "randomk:ratio=0.25,scale=true>natural", "fft:theta=0.5>rangefloat"])
def test_composed_traits_come_from_the_stages(spec: str) -> None:
    """``first>second``: error memory, variable size and state are the first
    stage's, unbiased iff both are, error feedback by default iff either
    wants it, never summable; each a bool (a plain method would be truthy)."""
    first_spec, second_spec = spec.split(">")
    comp, first, second = create(spec), create(first_spec), create(second_spec)
    want = {
        "own_error_memory": bool(first.own_error_memory),
        "variable_size": bool(first.variable_size),
        "stateful": bool(first.stateful),
        "is_unbiased": bool(first.is_unbiased and second.is_unbiased),
        "default_error_feedback": bool(first.default_error_feedback or second.default_error_feedback),
        "is_summable": False,
    }
    got = {name: getattr(comp, name) for name in want}
    assert all(type(v) is bool for v in got.values()), got
    assert got == want


@pytest.mark.parametrize("spec", ["topk:ratio=0.1>natural", "dgc>natural", "threshold>qsgd"])
def test_composed_state_layout_is_the_first_stages(spec: str) -> None:
    """The state_dict entries a layout upgrade re-indexes (``element_state``, ``matrix_state``) are the
    first stage's (its state_dict is the first stage's), tuples of names: a plain method would not be one,
    and loading an old hook state would iterate it (TypeError)."""
    comp, first = create(spec), create(spec.split(">")[0])
    for name in ("element_state", "matrix_state"):
        got = getattr(comp, name)
        assert type(got) is tuple and got == getattr(first, name), (name, got)
    if spec.startswith("dgc"):
        assert comp.element_state == ("momentums", "velocities")


def test_composed_error_memory_is_the_sparsifiers() -> None:
    assert create("topk:ratio=0.1>natural").own_error_memory is False
    assert create("dgc>natural").own_error_memory is True  # DGC keeps its own residual


# ----------------------------------------------------------------------------- fft parameters
@pytest.mark.parametrize("name", ["theta", "theta_end"])
def test_fft_theta_ranges_are_closed_at_zero_and_open_at_one(name: str) -> None:
    """``0 <= theta < 1`` and ``0 <= theta_end < 1``: both ends tested, and
    a refusal names the parameter, the value and the allowed range."""
    for ok in ("0", "0.0", "0.999"):
        assert getattr(create(f"fft:{name}={ok}"), name) == float(ok)
    for bad in ("-0.1", "-1e-9", "1", "1.0", "1.5"):
        with pytest.raises(ValueError, match=rf"'{name}' got {re.escape(repr(float(bad)))}; allowed: 0 <= {name} < 1"):
            create(f"fft:{name}={bad}")
    # the linear schedule: theta_end may equal theta, not exceed it
    assert create("fft:theta=0.4,schedule=linear,theta_end=0.4").theta_at(10**9) == pytest.approx(0.4)
    assert create("fft:theta=0,schedule=linear,theta_end=0").theta_at(5) == 0.0


# ----------------------------------------------------------------------------- rangefloat across spans
def rangefloat_reference(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Decoded values by the definition, in float64, for an input without
    zeros whose exponent range fits: e = ceil(log2(E_max - E_min + 1)),
    m = bits - 1 - e, |v| rounded to the nearest multiple of 2^(E - m)
    (E = floor(log2 |v|)), clamped to the largest code (2 - 2^-m) 2^E_max."""
    v = x.to(torch.float64)
    ex = torch.floor(torch.log2(v.abs()))
    e_max, e_min = int(ex.max()), int(ex.min())
    e = math.ceil(math.log2(e_max - e_min + 1)) if e_max > e_min else 0
    m = bits - 1 - e
    assert m >= 1
    unit = torch.exp2(ex - m)
    mag = torch.round(v.abs() / unit) * unit
    mag = mag.clamp(max=(2 - 2.0**-m) * 2.0**e_max)
    return torch.where(v < 0, -mag, mag)


@pytest.mark.parametrize("bits", [5, 19])  # 19: wider than the decode table (16)
def test_rangefloat_decodes_by_definition_over_several_spans(bits: int) -> None:
    """Encode and decode work span by span (2^16 entries on CPU), each
    span's codes at byte ``start * bits / 8``: a tensor of three spans,
    the last one short, decodes to the definition's values everywhere."""
    d = 2 * span_length(torch.device("cpu")) + 77
    gen = torch.Generator().manual_seed(bits)
    mags = torch.exp2(torch.rand(d, generator=gen, dtype=torch.float64) * 3 - 2)  # 3 octaves: e = 2
    x = torch.where(torch.rand(d, generator=gen) < 0.5, -mags, mags).to(torch.float32)
    comp = create(f"rangefloat:bits={bits}")
    packet = comp.encode(x)
    assert packet.tensors[0].tolist() == [0, 2, 0]  # E_max, e, no zero code
    assert packet.tensors[1].numel() == math.ceil(d * bits / 8)
    out = comp.decode(packet).to(torch.float64)
    want = rangefloat_reference(x, bits)
    bad = (out != want).nonzero().reshape(-1)
    assert bad.numel() == 0, (bits, bad[:5].tolist(), out[bad[:5]].tolist(), want[bad[:5]].tolist())


# ----------------------------------------------------------------------------- kit streams
def test_compiled_widths_are_the_documented_ones() -> None:
    """Under a policy that compiles: packing compiles every width 1..24 but 1
    and 8, unpacking every width above 8; a width outside 1..24 is refused
    naming ``bits`` (never a KeyError from the word-group table)."""
    cpu = torch.device("cpu")
    n = 1 << 20
    with compiler.forced("on"):
        packed = {b for b in range(1, 25) if streams._whole(n, b, cpu, "pack") == n}
        unpacked = {b for b in range(1, 25) if streams._whole(n, b, cpu, "unpack") == n}
        assert packed == set(range(2, 25)) - {8}
        assert unpacked == set(range(9, 25))
        for bad in (0, 25, 32):
            assert streams._whole(n, bad, cpu, "pack") == 0 and streams._whole(n, bad, cpu, "unpack") == 0
            with pytest.raises(ValueError, match="bits"):
                kit.pack(torch.zeros(64, dtype=torch.int32), bad)
            with pytest.raises(ValueError, match="bits"):
                kit.unpack(torch.zeros(200, dtype=torch.uint8), bad, 64)
