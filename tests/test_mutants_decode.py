"""Written for survivors of ``make mutants`` (``decode`` group) and for bugs
planted by hand in the same functions (docs/testing.md, "2026-11-28 (15th
session)"): ``Packet.aliases`` against its documented contract (a payload
anywhere in ``t``'s storage), and ``kit.reduce(..., "minmax")`` against
``torch.aminmax`` row by row, bits included, on the rows where amin/amax
and aminmax pick different signed zeros (the first and the last such row),
with each row's extremes in the first and the last column, eager and
compiled (``_row_extremes`` runs only compiled, and the suite runs the kit
eagerly unless a test forces it). The expected values come from the
definitions, not from the code.
"""

from __future__ import annotations

import struct

import pytest
import torch

from gradpress.compress import kit
from gradpress.compress.kit import compiler
from gradpress.compress.packet import Packet

pytestmark = pytest.mark.mutants


def test_packet_aliases_any_payload_in_the_storage_of_t() -> None:
    """Docstring: "Whether a payload tensor lives in ``t``'s storage" -- at
    any offset, whichever of the payloads it is."""
    buf = torch.arange(32, dtype=torch.float32)
    other = torch.zeros(4)
    pk = Packet([other, buf[8:16]], torch.Size([8]), torch.float32)
    assert pk.aliases(buf[8:16])
    assert pk.aliases(buf[:8])  # the same storage, another offset: writing there may reach the payload's bytes
    assert pk.aliases(buf[20:])
    assert pk.aliases(buf)
    assert pk.aliases(other.view(2, 2))
    assert not pk.aliases(buf.clone())
    assert not pk.aliases(torch.zeros(8))
    assert not Packet([], torch.Size([0]), torch.float32).aliases(buf)


def _minmax_input(rows: int, chunk: int, tail: int) -> torch.Tensor:
    """``rows`` whole chunks of distinct nonzero values, each row's max and
    min placed column by column (the first and the last column included),
    the first and the last row all zeros, +0 in the first half and -0 in the
    second (there ``amin``/``amax`` return -0 and ``aminmax`` +0 on CPU), a
    short tail of ``tail`` entries."""
    g = torch.Generator().manual_seed(rows * chunk + tail)
    x = torch.rand(rows * chunk + tail, generator=g) + 1.0
    x[rows * chunk:] -= 1.5  # the tail: both signs
    r = x[: rows * chunk].view(rows, chunk)
    for i in range(1, rows - 1):
        hi_col = [chunk - 1, 0][i % 2] if i < 5 else (i * 37) % chunk
        lo_col = [0, chunk - 1][i % 2] if i < 5 else (i * 53 + 1) % chunk
        if lo_col == hi_col:
            lo_col = (hi_col + 1) % chunk
        r[i, hi_col] = 10.0 + i
        r[i, lo_col] = -10.0 - i
    for i in (0, rows - 1):
        r[i] = 0.0
        r[i, chunk // 2:] = -0.0
    return x


@pytest.mark.parametrize("mode", ["off", "on"])
@pytest.mark.parametrize("chunk", [100, 1024])
def test_minmax_is_aminmax_on_the_first_and_last_tie_rows_and_every_column(chunk: int, mode: str) -> None:
    rows = 24
    x = _minmax_input(rows, chunk, 5)
    first = x[:chunk].view(1, chunk)  # the premise: amin/amax pick another zero than aminmax here
    assert torch.aminmax(first, dim=1)[0].view(torch.int32).item() != first.amin(dim=1).view(torch.int32).item()
    with compiler.forced(mode):
        assert compiler.will_compile(kit.primitives._row_extremes, rows * chunk, "cpu") == (mode == "on")
        lo, hi = kit.reduce(x, "minmax", chunk)
    want_lo = torch.cat([torch.aminmax(r, dim=1)[0] for r in kit.chunks(x, chunk)])
    want_hi = torch.cat([torch.aminmax(r, dim=1)[1] for r in kit.chunks(x, chunk)])
    assert torch.equal(lo.view(torch.int32), want_lo.view(torch.int32))
    assert torch.equal(hi.view(torch.int32), want_hi.view(torch.int32))
    # and by the definition: the placed extremes
    for i in range(1, rows - 1):
        assert (lo[i].item(), hi[i].item()) == (-10.0 - i, 10.0 + i)


#: the kit's decoders that take ``out``, and the dtypes they decode straight into it (their compute dtypes;
#: natural computes fp32 values only)
INTO = [("natural", torch.float32), ("qsgd", torch.float32), ("qsgd", torch.float64), ("qsgd:bucket=0", torch.float32),
        ("minmax8", torch.float32), ("minmax8", torch.float64), ("onebit", torch.float32), ("onebit", torch.float16),
        ("terngrad", torch.float32), ("terngrad", torch.bfloat16)]


@pytest.mark.parametrize("mode", ["off", "on"])
@pytest.mark.parametrize(("spec", "dtype"), INTO, ids=str)
def test_kit_decoders_write_into_out_without_a_fresh_output(spec: str, dtype: torch.dtype, mode: str) -> None:
    """What ``decode_fields(..., out=)`` is for (docs/bench.md, "Decoding into
    a buffer"): where the decoder computes in the output's dtype it writes the
    values into ``out`` and returns it, so ``decode_into`` copies nothing; the
    values are the code's definition checked elsewhere (tests/test_decode_into.py),
    here the fresh decode's bits."""
    from gradpress.compress import Context, create

    comp = create(spec)
    for n in (1000, 4099):  # one chunk; whole chunks and a short last one
        x = (torch.randn(n, generator=torch.Generator().manual_seed(n)) * 3).to(dtype)
        pk = comp.encode(x, Context(key="w", step=1))
        with compiler.forced(mode):
            want = comp.decode(pk)
            flat = torch.full((n,), float("nan"), dtype=dtype)
            got = comp.decode_fields(comp.fields(pk), n, dtype, out=flat)
        assert got.data_ptr() == flat.data_ptr() and got.numel() == n, (spec, dtype, n)
        assert torch.equal(flat.view(torch.uint8), want.reshape(-1).view(torch.uint8)), (spec, dtype, n)


def _codes(data: torch.Tensor, width: int, n: int) -> list[int]:
    """Code i of the LSB-first stream of ``width``-bit codes in the bytes ``data``."""
    raw = data.tolist()
    return [(raw[i * width // 8] >> (i * width % 8)) & ((1 << width) - 1) for i in range(n)]


def _scales(wire: torch.Tensor, dtype: torch.dtype) -> list[float]:
    """The transmitted scales: fp32 values, or for fp64 inputs the upper words of fp64 values."""
    if dtype != torch.float64:
        return [float(v) for v in wire.tolist()]
    return [struct.unpack("<d", struct.pack("<Q", (w & 0xFFFFFFFF) << 32))[0] for w in wire.tolist()]


def _by_definition(spec: str, pk: Packet, n: int) -> torch.Tensor:
    """The decoded values from the payload by the methods' documented wire formats, in float64."""
    if spec in ("signsgd", "signum"):  # bit i = (x_i >= 0): +1, else -1
        vals = [1.0 if c else -1.0 for c in _codes(pk.tensors[0], 1, n)]
    elif spec.startswith("efsignsgd"):  # [scales per chunk, sign bits]: +-scale of the entry's chunk
        chunk = int(spec.split("=")[1]) if "=" in spec else max(n, 1)
        s = _scales(pk.tensors[0], pk.dtype)
        vals = [(1.0 if c else -1.0) * s[i // chunk] for i, c in enumerate(_codes(pk.tensors[1], 1, n))]
    else:  # terngrad: [scale, 2-bit codes 0 (zero), 1 (+s), 2 (-s)]
        s = _scales(pk.tensors[0], pk.dtype)[0]
        vals = [{0: 0.0, 1: s, 2: -s}[c] for c in _codes(pk.tensors[1], 2, n)]
    return torch.tensor(vals, dtype=torch.float64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("spec", ["signsgd", "signum", "efsignsgd", "efsignsgd:chunk=64", "terngrad"])
def test_sign_and_ternary_decoders_follow_their_wire_format(spec: str, dtype: torch.dtype) -> None:
    """``decode`` and ``decode_into`` against the value each code stands for
    (the modules' docstrings), not against each other: the in-place decoders
    and the fresh ones share their tables."""
    from gradpress.compress import Context, create

    comp = create(spec)
    for n in (1, 1003):
        x = (torch.randn(n, generator=torch.Generator().manual_seed(n)) * 3).to(dtype)
        if n > 3:
            x[1], x[2] = 0.0, -0.0
        pk = comp.encode(x, Context(key=f"w{n}", step=1))
        want = _by_definition(spec, pk, n).to(dtype)
        out = torch.full((n,), float("nan"), dtype=dtype)
        assert comp.decode_into(pk, out) is out
        for got in (out, comp.decode(pk)):
            assert torch.equal(got.reshape(-1).view(torch.uint8), want.view(torch.uint8)), (spec, dtype, n)


@pytest.mark.parametrize("spec", ["qsgd", "natural", "fp16", "signsgd", "efsignsgd", "minmax8", "terngrad", "onebit"])
def test_residual_is_taken_in_place_in_the_inputs_storage(spec: str) -> None:
    """``Compressor.residual``: a contiguous input of the packet's dtype that
    no payload lives in and that needs no grad is reused (its storage holds
    ``p - decode(packet)``, the float64 difference rounded once)."""
    from gradpress.compress import Context, create

    comp = create(spec)
    x = torch.randn(1000, generator=torch.Generator().manual_seed(4)) * 3
    pk = comp.encode(x, Context(key="w", step=1))
    want = (x.to(torch.float64) - comp.decode(pk).to(torch.float64)).to(torch.float32)
    p = x.clone()
    got = comp.residual(p, pk)
    assert got.data_ptr() == p.data_ptr(), spec
    assert torch.equal(got, want), spec


def test_a_declaration_that_repeats_a_field_name_is_refused() -> None:
    with pytest.raises(TypeError, match=r"Twice.FIELDS repeats a field name: \['codes', 'codes'\]"):
        class Twice(kit.KitCompressor):
            FIELDS = (kit.Field("codes", torch.uint8), kit.Field("codes", torch.uint8))


def test_the_focused_functions_of_the_mutation_groups_exist() -> None:
    """tests/mutants.py draws the ``decode`` group from named functions only:
    each must still be defined in a module of its group (a rename would
    otherwise leave it out of every sample), and a line belongs to the
    innermost focused function (``Packet.aliases``, not ``Packet``)."""
    import ast
    from pathlib import Path

    import mutants

    root = Path(mutants.__file__).resolve().parent.parent
    for name, modules in mutants.FOCUS.items():
        assert set(modules) <= set(mutants.GROUPS[name][0]), name
        lines = mutants.focus_lines(root, name)
        for module, wanted in modules.items():
            assert {v.split(":")[1] for v in lines[module].values()} == set(wanted), (name, module)
    tree = ast.parse((root / "gradpress/compress/packet.py").read_text())
    aliases = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "aliases")
    assert mutants.focus_lines(root, "decode")["gradpress/compress/packet.py"][aliases.lineno + 1] == \
        "gradpress/compress/packet.py:Packet.aliases"
