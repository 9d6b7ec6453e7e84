"""The kit's standalone pack/unpack (gradpress.compress.kit.streams): compiled
word groups plus an eager tail, against a bit stream this test builds from
Python integers (LSB first, ``ceil(n * bits / 8)`` bytes), for every width
1..24 and lengths around the word-group size."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from gradpress.compress import Context, create, kit
from gradpress.compress.kit import compiler, packing, streams


def reference_stream(codes: list[int], bits: int) -> torch.Tensor:
    """Code i occupies bits [i * bits, (i + 1) * bits) of one big integer;
    its bytes, little end first."""
    value = sum(c << (i * bits) for i, c in enumerate(codes))
    nbytes = (len(codes) * bits + 7) // 8
    return torch.tensor(list(value.to_bytes(nbytes, "little")), dtype=torch.uint8)


def lengths(bits: int) -> list[int]:
    per = 32 // math.gcd(bits, 32)  # codes per whole group of int32 words, computed here
    return sorted({0, 1, per - 1, per, per + 1, 3 * per, 5 * per + per // 2 + 1})


def codes_for(n: int, bits: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    values = torch.randint(0, 1 << bits, (n,), generator=g, dtype=torch.int64).tolist()
    if n:
        values[-1] = (1 << bits) - 1  # every bit of the last code set: a wrap or mask error shows
    return values


#: compiled: one width of each kind of group (2: 16 codes in 1 word, TernGrad's; 3: 32 codes in 3 words; 4: 8 in 1;
#: 6: 16 in 3; 12: 8 in 3;
#: 24: 4 in 3, a code per 3 bytes) plus the eager widths; each compiled width costs a few compiles
CASES = [(bits, "off") for bits in range(1, 25)] + [(bits, "on") for bits in (2, 3, 4, 6, 12, 24)]


@pytest.mark.parametrize(("bits", "mode"), CASES)
def test_pack_and_unpack_match_the_python_integer_stream(bits: int, mode: str) -> None:
    dtype = torch.uint8 if bits <= 8 else torch.int32
    with compiler.forced(mode), warnings.catch_warnings():
        warnings.filterwarnings("error", message="gradpress kit")  # a failed compile warns, falls back
        for n in lengths(bits):
            values = codes_for(n, bits, seed=bits * 1000 + n)
            codes = torch.tensor(values, dtype=torch.int64).to(dtype)
            want = reference_stream(values, bits)
            packed = kit.pack(codes, bits)
            assert torch.equal(packed, want), (bits, n)
            # a packet inside a received buffer starts at any byte: 3 bytes in, not 4-byte aligned
            buf = torch.zeros(want.numel() + 3, dtype=torch.uint8)
            buf[3:] = want
            back = kit.unpack(buf[3:], bits, n)
            assert back.dtype == dtype and back.tolist() == values, (bits, n)
            # a strided 1-D view (every other byte of a wider buffer)
            spread = torch.zeros(2 * want.numel(), dtype=torch.uint8)
            spread[::2] = want
            assert kit.unpack(spread[::2], bits, n).tolist() == values, (bits, n)


@pytest.mark.parametrize("bits", [3, 5, 6, 7, 12])
def test_the_word_groups_compile_as_one_graph_on_cpu_only(bits: int) -> None:
    n = 32 * 40 + 7  # whole groups and a tail
    codes = torch.tensor(codes_for(n, bits, seed=bits), dtype=torch.int64).to(torch.uint8 if bits <= 8 else torch.int32)
    kernel = streams._kernel("pack", bits)
    with compiler.forced("on"), warnings.catch_warnings():
        warnings.filterwarnings("error", message="gradpress kit")
        packed = kit.pack(codes, bits)
        kit.unpack(packed, bits, n)
    assert compiler.is_compiled(compiler.into(kernel)) and kernel not in compiler._failed
    if bits > 8:  # the widths whose unpack compiles
        unpack = streams._kernel("unpack", bits)
        assert compiler.is_compiled(compiler.into(unpack)) and unpack not in compiler._failed
    with compiler.forced("auto"):
        assert compiler.will_compile(kernel, 1 << 20, "cpu")
        assert not compiler.will_compile(kernel, 1 << 20, "cuda")  # never measured compiled there
    with compiler.forced("on"):
        assert compiler.will_compile(kernel, 1 << 20, "cuda")


def test_widths_where_eager_is_as_fast_stay_eager() -> None:
    with compiler.forced("on"):
        for bits in (1, 8):
            assert streams._whole(1 << 20, bits, torch.device("cpu"), "pack") == 0
        assert streams._whole(1 << 20, 2, torch.device("cpu"), "pack") == 1 << 20  # compiled: TernGrad's codes
        for bits in range(1, 9):
            assert streams._whole(1 << 20, bits, torch.device("cpu"), "unpack") == 0
        assert streams._whole(1 << 20, 6, torch.device("cpu"), "pack") == 1 << 20
        assert streams._whole((1 << 20) + 5, 12, torch.device("cpu"), "unpack") == 1 << 20


def test_word_group_table_and_bad_widths() -> None:
    for bits in range(1, 25):
        per, words = packing.word_group(bits)
        assert per * bits == 32 * words and (per * bits) % 32 == 0
        assert math.gcd(per, 32 // math.gcd(bits, 32)) == per  # the smallest such group
    for bad in (0, 25, 6.0):
        with pytest.raises(ValueError, match="bits"):
            packing.word_group(bad)  # type: ignore[arg-type]
    for mode in ("off", "on"):  # eager, and a length past one word group (the compiled path's check)
        with compiler.forced(mode):
            with pytest.raises(ValueError, match="bytes"):
                kit.unpack(torch.zeros(5, dtype=torch.uint8), 12, 4)
            for wrong in (199, 201):  # 128 codes of 12 bits are 192 bytes
                with pytest.raises(ValueError, match="expected 192"):
                    kit.unpack(torch.zeros(wrong, dtype=torch.uint8), 12, 128)


def test_qsgd_codes_compiled_equal_eager_bytes() -> None:
    """QSGD packs after its kernel at every width on CPU (``fuse_pack=False``):
    whole chunks and tail written into one buffer, then the compiled stream
    pack (6 bits; 4 bits, levels 7, which other kernels pack in-kernel);
    and decode's unpack of a wide width (levels 1000: 11 bits)."""
    x = torch.randn(512 * 70 + 33, generator=torch.Generator().manual_seed(3))
    ctx = Context(key="w", step=2, rank=1, world_size=4, seed=5)
    for spec in ("qsgd", "qsgd:levels=7", "qsgd:levels=1000"):
        c = create(spec)
        with compiler.forced("off"):
            eager = c.encode(x, ctx)
            eager_out = c.decode(eager)
        with compiler.forced("on"):
            compiled = c.encode(x, ctx)
            compiled_out = c.decode(compiled)
        assert all(torch.equal(a, b) for a, b in zip(eager.tensors, compiled.tensors)), spec
        assert torch.equal(eager_out, compiled_out), spec


def test_fuse_pack_false_packs_after_the_kernel_at_a_fused_width() -> None:
    """``fuse_pack=False``: the kernel is never asked to pack its rows (it
    sees ``fuse=False``), and the result is still the LSB-first stream."""
    seen: list[bool] = []

    def codes(v: torch.Tensor, *, key, drawn, bits: int, fuse: bool) -> torch.Tensor:  # noqa: ANN001
        seen.append(fuse)
        return kit.pack_rows((v.abs() * 3).floor().clamp(max=3).to(torch.int32), bits, fuse)

    x = torch.randn(512 * 5 + 9, generator=torch.Generator().manual_seed(7))
    want = reference_stream((x.abs() * 3).floor().clamp(max=3).to(torch.int64).tolist(), 2)
    for fuse_pack in (True, False):
        seen.clear()
        got = kit.elementwise(codes, x, 512, pack=2, fuse_pack=fuse_pack)
        assert torch.equal(got, want)
        assert any(seen) is fuse_pack  # the whole rows fuse only when allowed
