"""Bit packing and flat-buffer packing (gradpress.compress.bits, gradpress.transport.wire)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradpress.compress import Packet
from gradpress.compress import bits as bitpack
from gradpress.transport import wire


@settings(max_examples=120, deadline=None)
@given(bits=st.integers(1, 24), n=st.integers(0, 70), seed=st.integers(0, 2**31 - 1))
def test_pack_bits_round_trip(bits: int, n: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, (n,), generator=gen, dtype=torch.int64)
    if n:
        codes[0] = (1 << bits) - 1  # the widest code must survive
    packed = bitpack.pack_bits(codes, bits)
    assert packed.dtype == torch.uint8
    assert packed.numel() == bitpack.packed_nbytes(n, bits) == (n * bits + 7) // 8
    out = bitpack.unpack_bits(packed, bits, n)
    assert out.numel() == n
    assert torch.equal(out.to(torch.int64), codes)


@pytest.mark.parametrize("bits", range(1, 25))
def test_pack_bits_odd_lengths_every_width(bits: int) -> None:
    for n in (1, 3, 7, 9, 13):
        codes = torch.arange(n, dtype=torch.int64) * 2654435761 % (1 << bits)
        out = bitpack.unpack_bits(bitpack.pack_bits(codes, bits), bits, n)
        assert torch.equal(out.to(torch.int64), codes), (bits, n)


def _bit_stream(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Reference: every code expanded into its bits, LSB first, regrouped 8 per byte."""
    stream = ((codes.long().unsqueeze(1) >> torch.arange(bits)) & 1).reshape(-1)
    stream = torch.cat([stream, stream.new_zeros(-stream.numel() % 8)])
    return (stream.view(-1, 8) << torch.arange(8)).sum(1).to(torch.uint8)


@pytest.mark.parametrize("bits", range(1, 25))
def test_bits_and_kit_packers_write_the_reference_bit_stream(bits: int) -> None:
    """Both packers (compress/bits.py's word-wide and byte-column paths, and
    the kit's compile-friendly one) against the bit-expansion reference,
    and back."""
    from gradpress.compress.kit import packing

    gen = torch.Generator().manual_seed(bits)
    for n in (0, 1, 7, 37, 1000):
        codes = torch.randint(0, 1 << bits, (n,), generator=gen, dtype=torch.int64)
        want = _bit_stream(codes, bits)
        for pack, unpack in ((bitpack.pack_bits, bitpack.unpack_bits), (packing.pack, packing.unpack)):
            got = pack(codes, bits)
            assert torch.equal(got, want), (pack.__module__, bits, n)
            assert torch.equal(unpack(got, bits, n).to(torch.int64), codes), (unpack.__module__, bits, n)


def test_pack_bits_is_dense_lsb_first() -> None:
    # 1-bit: bit i of byte 0 is code i
    packed = bitpack.pack_bits(torch.tensor([1, 0, 1, 1, 0, 0, 0, 1, 1]), 1)
    assert packed.tolist() == [0b10001101, 0b1]
    # 3-bit codes straddle byte boundaries
    packed = bitpack.pack_bits(torch.tensor([7, 0, 5]), 3)
    assert packed.tolist() == [0b01000111, 0b1]


def test_bad_widths_and_sizes() -> None:
    for bits in (0, 25):
        with pytest.raises(ValueError, match="bits"):
            bitpack.pack_bits(torch.zeros(3, dtype=torch.int64), bits)
    with pytest.raises(ValueError, match="expected"):
        bitpack.unpack_bits(torch.zeros(3, dtype=torch.uint8), 4, 9)


def _packets(gen: torch.Generator, sizes: list[int]) -> list[Packet]:
    out = []
    for i, n in enumerate(sizes):
        tensors = [
            torch.randn(n, generator=gen, dtype=torch.float64),
            torch.randint(0, 1000, (n // 2 + 1,), generator=gen, dtype=torch.int32),
            torch.randn(n, generator=gen).half(),
            torch.randint(0, 255, (n + i,), generator=gen, dtype=torch.uint8),
            torch.randn(3, generator=gen).bfloat16(),
        ]
        out.append(Packet(tensors, torch.Size([n]), torch.float32))
    return out


@settings(max_examples=30, deadline=None)
@given(sizes=st.lists(st.integers(0, 20), min_size=1, max_size=4), seed=st.integers(0, 1000))
def test_pack_packets_round_trip_fixed(sizes: list[int], seed: int) -> None:
    packets = _packets(torch.Generator().manual_seed(seed), sizes)
    buf = wire.pack_packets(packets, variable=False)
    assert buf.dtype == torch.uint8
    assert buf.numel() == sum(p.nbytes for p in packets)
    back = wire.unpack_packets(buf, packets, variable=False)
    for a, b in zip(packets, back):
        assert len(a.tensors) == len(b.tensors)
        for ta, tb in zip(a.tensors, b.tensors):
            assert ta.dtype == tb.dtype and torch.equal(ta, tb)


@settings(max_examples=30, deadline=None)
@given(sizes=st.lists(st.integers(0, 20), min_size=1, max_size=4), other=st.lists(st.integers(0, 20), min_size=4, max_size=4),
       seed=st.integers(0, 1000))
def test_pack_packets_round_trip_variable(sizes: list[int], other: list[int], seed: int) -> None:
    """A receiver parses a variable-size buffer whose sizes differ from its own packets."""
    gen = torch.Generator().manual_seed(seed)
    sent = _packets(gen, sizes)
    mine = _packets(gen, other[: len(sizes)])  # this rank's templates: same layout, other sizes
    buf = wire.pack_packets(sent, variable=True)
    n_tensors = sum(len(p.tensors) for p in sent)
    assert buf.numel() == sum(p.nbytes for p in sent) + 4 * n_tensors
    back = wire.unpack_packets(buf, mine, variable=True)
    for a, b in zip(sent, back):
        for ta, tb in zip(a.tensors, b.tensors):
            assert ta.dtype == tb.dtype and torch.equal(ta, tb)


def test_pack_packets_empty() -> None:
    buf = wire.pack_packets([Packet([torch.zeros(0)], torch.Size([0]), torch.float32)], variable=False)
    assert buf.numel() == 0
    back = wire.unpack_packets(buf, [Packet([torch.zeros(0)], torch.Size([0]), torch.float32)], variable=False)
    assert back[0].tensors[0].numel() == 0


def test_sixteen_byte_tensors_are_laid_out_first_and_come_back() -> None:
    """complex128 (torch's one 16-byte dtype) was left out of the layout:
    packed into nothing and parsed back as None. By hand: the tensors by
    element size, 16 then 8, 4, 2, 1 bytes, packet by packet within a size;
    each slice starts at a multiple of its element size."""
    c = torch.tensor([1 + 2j, -3.5 + 0.25j, 4j], dtype=torch.complex128)
    d = torch.tensor([1.5, -2.0], dtype=torch.float64)
    i = torch.tensor([7, -8, 9], dtype=torch.int32)
    h = torch.tensor([0.5], dtype=torch.float16)
    b = torch.tensor([True, False, True])
    c2 = torch.tensor([5 - 1j], dtype=torch.complex128)
    u = torch.tensor([1, 2, 3], dtype=torch.uint8)
    packets = [Packet([d, c, i, b], torch.Size([3]), torch.complex128),
               Packet([h, u, c2], torch.Size([1]), torch.complex128)]
    # (packet, tensor, byte offset): 16-byte c (48 B) and c2 (16 B), 8-byte d (16 B), i (12 B), h (2 B), b, u
    want = [(0, 1, 0), (1, 2, 48), (0, 0, 64), (0, 2, 80), (1, 0, 92), (0, 3, 94), (1, 1, 97)]
    assert wire.buffer_layout(packets) == [(p, t) for p, t, _ in want]
    for variable in (False, True):
        buf = wire.pack_packets(packets, variable)
        assert buf.numel() == 100 + (4 * 7 if variable else 0)
        for p, t, offset in want:
            src = packets[p].tensors[t]
            raw = (src.to(torch.uint8) if src.dtype == torch.bool else src).view(torch.uint8)
            assert offset % src.element_size() == 0
            assert torch.equal(buf[offset: offset + raw.numel()], raw), (p, t)
        back = wire.unpack_packets(buf, packets, variable)
        for a, got in zip(packets, back):
            for ta, tb in zip(a.tensors, got.tensors):
                assert tb is not None and tb.dtype == ta.dtype and torch.equal(ta, tb)
