"""Wrong kit declarations, as a method author writes them, are refused with an
error that names the declaration, the field or parameter, the value and what
is allowed, at declaration or registration time where the mistake is visible
there; and decoders that need the encoder's shared random numbers can have
them (docs/authoring.md "Mistakes the kit refuses", "Random numbers in
decode"). Each test failed before its fix (a bare KeyError, an
AssertionError deep in the layout, a silently wrong byte count or value)."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

from gradpress.compress import Context, kit
from gradpress.compress.base import Param
from gradpress.compress.registry import _REGISTRY, register

X = torch.randn(100, generator=torch.Generator().manual_seed(0))


def _plain(name: str = "wk", fields: tuple = (kit.Field("vals", "input"),), **attrs: object) -> type:
    """A declaration sending its input as is, with ``attrs`` overriding the class body."""
    body = {
        "name": name,
        "FIELDS": fields,
        "encode_fields": lambda self, flat, dtype, ctx: {"vals": flat.to(dtype)},
        "decode_fields": lambda self, fields, numel, dtype: fields["vals"],
        **attrs,
    }
    return type("Decl", (kit.KitCompressor,), body)


@pytest.fixture()
def registry():
    """Registrations made by a test are dropped after it."""
    before = dict(_REGISTRY.classes)
    yield
    _REGISTRY.classes.clear()
    _REGISTRY.classes.update(before)


# ----------------------------------------------------------------------------- Field: at declaration
@pytest.mark.parametrize("kwargs, needle", [
    ({"dtype": float}, "kit.Field 'v': dtype got <class 'float'>; allowed: a torch dtype"),
    ({"dtype": torch.uint8, "bits": 0}, "kit.Field 'v': bits got 0; allowed: an int 1..24"),
    ({"dtype": torch.uint8, "bits": -1}, "kit.Field 'v': bits got -1; allowed: an int 1..24"),
    ({"dtype": torch.uint8, "bits": 25}, "kit.Field 'v': bits got 25; allowed: an int 1..24"),
    ({"dtype": torch.uint8, "bits": 2.5}, "kit.Field 'v': bits got 2.5; allowed: an int 1..24"),
    ({"dtype": torch.uint8, "bits": True}, "kit.Field 'v': bits got True; allowed: an int 1..24"),
    ({"dtype": torch.float32, "bits": 4}, "kit.Field 'v': bits=4 packs codes into uint8 bytes, but dtype is "
                                          "torch.float32; allowed: dtype=torch.uint8"),
    ({"dtype": torch.float32, "count": -3}, "kit.Field 'v': count got -3; allowed: 'numel', 'chunks', an int >= 0"),
])
def test_a_bad_field_is_refused_where_it_is_written(kwargs: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        kit.Field("v", **kwargs)


@pytest.mark.parametrize("name", ["", 3, None])
def test_a_field_needs_a_name(name: object) -> None:
    with pytest.raises(ValueError, match="kit.Field: name got .*; allowed: a non-empty str"):
        kit.Field(name, torch.float32)


def test_fields_must_be_a_tuple_of_fields() -> None:
    with pytest.raises(TypeError, match=r"Decl.FIELDS\[0\] is \('codes', torch.uint8\); allowed: kit.Field"):
        _plain(fields=(("codes", torch.uint8),))
    with pytest.raises(TypeError, match="Decl.FIELDS is Field.*; allowed: a tuple of kit.Field"):
        _plain(fields=kit.Field("codes", torch.uint8))


def test_a_bit_width_attribute_must_exist() -> None:
    with pytest.raises(TypeError, match="Decl.FIELDS: field 'codes' takes bits from attribute 'nosuch', which "
                                        "Decl does not have; allowed: a parameter or attribute name, or an int"):
        _plain(fields=(kit.Field("codes", torch.uint8, bits="nosuch"),))
    # a parameter of that name is fine (set on the instance)
    _plain(fields=(kit.Field("codes", torch.uint8, bits="width"),), PARAMS=(Param("width", int, 3),))


def test_a_bit_width_attribute_out_of_range_names_the_field() -> None:
    decl = _plain(fields=(kit.Field("codes", torch.uint8, bits="width"),), PARAMS=(Param("width", int, 30),))
    with pytest.raises(ValueError, match="compressor 'wk': field 'codes' has bits = width = 30; allowed: an int 1..24"):
        decl().layout(10)


@pytest.mark.parametrize("count, needle", [
    (lambda c, d: d / 2, "got 5.5"),
    (lambda c, d: -1, "got -1"),
    (lambda c, d: "many", "got 'many'"),
])
def test_a_count_function_must_give_a_count(count: object, needle: str) -> None:
    decl = _plain(fields=(kit.Field("s", torch.float32, count),))
    with pytest.raises(ValueError, match=f"compressor 'wk': field 's' count for 11 elements {needle}; allowed: an int >= 0"):
        decl().layout(11)


def test_chunk_size_must_be_positive() -> None:
    decl = _plain(fields=(kit.Field("s", torch.float32, "chunks"),), chunk_size=lambda self, numel: 0)
    with pytest.raises(ValueError, match="compressor 'wk': chunk_size\\(10\\) got 0; allowed: an int >= 1"):
        decl().layout(10)


# ----------------------------------------------------------------------------- encode and decode
def test_a_declared_field_that_encode_does_not_return_is_named() -> None:
    decl = _plain(fields=(kit.Field("vals", "input"), kit.Field("scale", torch.float32, 1)))
    with pytest.raises(RuntimeError, match=r"compressor 'wk': encode_fields did not return the declared field\(s\) "
                                           r"\['scale'\]; it returned \['vals'\]"):
        decl().encode(X)


def test_encode_fields_must_return_a_dict_of_tensors() -> None:
    decl = _plain(encode_fields=lambda self, flat, dtype, ctx: [flat])
    with pytest.raises(TypeError, match=r"compressor 'wk': encode_fields returned a list; allowed: a dict "
                                        r"\{field name: tensor\} of the fields \['vals'\]"):
        decl().encode(X)
    decl = _plain(encode_fields=lambda self, flat, dtype, ctx: {"vals": 3.0})
    with pytest.raises(TypeError, match="compressor 'wk': field 'vals' is a float; allowed: a torch.Tensor"):
        decl().encode(X)


def test_a_scale_field_of_the_wrong_dtype_points_at_pack_scale() -> None:
    decl = _plain(fields=(kit.Field("s", "scale", 1),), encode_fields=lambda self, flat, dtype, ctx: {
        "s": flat.abs().amax().reshape(1)})
    with pytest.raises(RuntimeError, match="field 's' is 1 x torch.float64; the declared layout says 4 bytes of "
                                           "torch.int32 .*kit.pack_scale"):
        decl().encode(X.double())
    short = _plain(fields=(kit.Field("s", "scale", 1),), encode_fields=lambda self, flat, dtype, ctx: {
        "s": kit.pack_scale(flat.abs().amax().reshape(1)[:0], dtype)})
    with pytest.raises(RuntimeError, match=r"is 0 x torch.float32; the declared layout says 4 bytes of torch.float32$"):
        short().encode(X)  # the right dtype, a wrong count: no pointer at pack_scale


@pytest.mark.parametrize("result, needle", [
    (lambda f: f["vals"][:-1], "99 x torch.float32"),
    (lambda f: f["vals"].double(), "100 x torch.float64"),
])
def test_decode_fields_must_give_numel_entries_of_the_input_dtype(result: object, needle: str) -> None:
    comp = _plain(decode_fields=lambda self, fields, numel, dtype: result(fields))()
    packet = comp.encode(X.view(10, 10))
    msg = f"compressor 'wk': decode_fields returned {needle}; allowed: 100 entries of torch.float32"
    with pytest.raises(RuntimeError, match=msg):
        comp.decode(packet)
    with pytest.raises(RuntimeError, match=msg):
        comp.decode_into(packet, torch.empty(100))


def test_an_error_inside_encode_fields_says_which_declaration_and_input() -> None:
    def encode(self, flat, dtype, ctx):
        return {"vals": flat.max().reshape(1).expand(flat.numel()).to(dtype)}  # max() of an empty tensor fails

    comp = _plain(encode_fields=encode)()
    comp.encode(X)
    with pytest.raises(RuntimeError) as info:
        comp.encode(torch.zeros(0, 3, dtype=torch.float16))
    if hasattr(info.value, "add_note"):
        assert "compressor 'wk' (Decl.encode_fields) on a (0, 3) torch.float16 input" in "".join(info.value.__notes__)


# ----------------------------------------------------------------------------- registration
@pytest.mark.parametrize("param, needle", [
    (Param("tau", float, -1.0, "tau > 0", lambda v: v > 0), "parameter 'tau': default -1.0 .*allowed: tau > 0"),
    (Param("levels", int, "four", "levels >= 1"), "parameter 'levels': default 'four' .*expected int"),
])
def test_a_bad_default_is_refused_at_registration(registry, param: Param, needle: str) -> None:
    with pytest.raises(ValueError, match=f"compressor 'wk': {needle}"):
        register(_plain(PARAMS=(param,)))
    assert "wk" not in _REGISTRY.classes


@pytest.mark.parametrize("params, needle", [
    ((Param("k", int, 2), Param("k", int, 3)), "declares parameter 'k' twice"),
    ((Param("seed", int, 2),), "parameter 'seed' would hide Compressor's attribute 'seed'"),
    ((Param("chunk_size", int, 2),), "parameter 'chunk_size' would hide .*'chunk_size'"),
])
def test_parameter_names_must_be_unique_and_free(registry, params: tuple, needle: str) -> None:
    with pytest.raises(ValueError, match=f"compressor 'wk': {needle}"):
        register(_plain(PARAMS=params))


@pytest.mark.parametrize("name", ["my:comp", "a>b", "a,b", "a=b", "my comp", "tab\t"])
def test_a_name_that_specs_cannot_spell_is_refused(registry, name: str) -> None:
    with pytest.raises(ValueError, match="compressor name .* allowed: letters, digits"):
        register(_plain(name=name))


def test_a_declaration_without_its_hooks_is_refused_at_registration(registry) -> None:
    decl = type("Half", (kit.KitCompressor,), {"name": "wk", "FIELDS": (kit.Field("vals", "input"),),
                                               "encode_fields": lambda self, flat, dtype, ctx: {"vals": flat}})
    with pytest.raises(TypeError, match="compressor 'wk': Half does not define decode_fields"):
        register(decl)


_AUTHOR_MODULE = """
import torch
from gradpress.compress import kit, register
from gradpress.compress.registry import create, names

class Mine(kit.KitCompressor):
    name = "qsgd"
    FIELDS = (kit.Field("vals", "input"),)
    def encode_fields(self, flat, dtype, ctx):
        return {"vals": flat.to(dtype)}
    def decode_fields(self, fields, numel, dtype):
        return fields["vals"]

try:
    register(Mine)
except ValueError as exc:
    print("refused:", exc)
try:
    print("names:", ",".join(names()))
    print("qsgd is:", type(create("qsgd")).__name__)
except ValueError as exc:
    print("later:", exc)
"""


def test_a_built_in_name_taken_before_the_registry_loaded_is_refused_at_once() -> None:
    """An author's module, imported first in a fresh process, registers
    'qsgd' before the package's own modules did: the collision surfaced later,
    inside the registry's loading (blaming the built-in QSGD), which stopped
    half way, so every later lookup missed the compressors after it."""
    run = subprocess.run([sys.executable, "-c", _AUTHOR_MODULE], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert run.returncode == 0, run.stderr
    lines = dict(line.split(": ", 1) for line in run.stdout.splitlines() if ": " in line)
    assert lines.get("refused") == "compressor name 'qsgd' is already registered by QSGD", run.stdout
    assert {"qsgd", "topk", "terngrad", "onebit", "none"} <= set(lines["names"].split(",")), run.stdout
    assert lines["qsgd is"] == "QSGD", run.stdout


# ----------------------------------------------------------------------------- random numbers
def _lowbias32(h: int) -> int:
    h &= 0xFFFFFFFF
    h ^= h >> 16
    h = (h * 0x7FEB352D) & 0xFFFFFFFF
    h ^= h >> 15
    h = (h * 0x846CA68B) & 0xFFFFFFFF
    return h ^ (h >> 16)


def _bits_ref(seed: int, salt: int, i: int) -> int:
    """The counter bits by their definition (gradpress/compress/kit/rng.py), from Python integers."""
    s = (seed ^ (salt * 0x9E3779B97F4A7C15)) & (2 ** 64 - 1)
    return _lowbias32(_lowbias32(i + (s & 0xFFFFFFFF)) ^ (s >> 32))


def test_a_kernel_draws_several_independent_streams_from_one_key() -> None:
    """``stream=s`` inside a kernel is the stream of the key salted with s,
    chunk offsets included (a second key passed as a static parameter was not
    offset per chunk: its draws repeated in every chunk)."""
    seed, n = 12345, 40

    def kernel(v, *, key, drawn):
        return torch.stack([kit.random_bits(v, key, drawn, 8), kit.random_bits(v, key, drawn, 8, stream=3)], -1)

    got = kit.elementwise(kernel, torch.zeros(n), 16, key=kit.seed_words(seed)).view(n, 2)
    want = torch.tensor([[_bits_ref(seed, 0, i) >> 24, _bits_ref(seed, 3, i) >> 24] for i in range(n)])
    assert torch.equal(got.long(), want)
    u = kit.elementwise(lambda v, *, key, drawn: kit.uniform(v, key, drawn, stream=2), torch.zeros(n), 16,
                        key=kit.seed_words(seed))
    assert torch.equal(u.double(), torch.tensor([(_bits_ref(seed, 2, i) >> 8) / 2 ** 24 for i in range(n)]))
    with pytest.raises(ValueError, match="kit.uniform: stream=2 needs the counter stream"):
        kit.uniform(torch.zeros(3), None, torch.zeros(3), stream=2)


def _flip(v, *, key, drawn):
    return v * (1.0 - 2.0 * kit.random_bits(v, key, drawn, 1).to(v.dtype))


class _Flip(kit.KitCompressor):
    """Multiplies x by random signs of the shared seed, undone at decode."""

    name = "wkflip"
    FIELDS = (kit.Field("vals", "compute"),)
    RANDOM = "shared"

    def encode_fields(self, flat, dtype, ctx):
        return {"vals": kit.elementwise(_flip, flat, 16, **self.randomness(flat, ctx))}

    def decode_fields(self, fields, numel, dtype, seed):
        rnd = self.decode_randomness(seed, numel, dtype, fields["vals"].device)
        return kit.elementwise(_flip, fields["vals"], 16, **rnd).to(dtype)


def test_decode_gets_the_encoders_shared_seed() -> None:
    comp = _Flip()
    x = torch.randn(50, dtype=torch.float64)
    ctx = Context(key="w", step=3, rank=1, seed=5)
    packet = comp.encode(x, ctx)
    signs = torch.tensor([1.0 - 2.0 * (_bits_ref(ctx.shared_seed, 0, i) >> 31) for i in range(50)], dtype=torch.float64)
    assert torch.equal(packet.tensors[0], x * signs)  # the wire carries the flipped values
    assert torch.equal(comp.decode(packet), x)
    assert torch.equal(comp.decode_into(packet, torch.empty(50, dtype=torch.float64)), x)
    packet.meta.clear()
    with pytest.raises(ValueError, match="compressor 'wkflip': the packet has no meta\\['seed'\\]"):
        comp.decode(packet)


def _uniform_flip(v, *, key, drawn):
    return v * torch.where(kit.uniform(v, key, drawn) < 0.5, -1.0, 1.0).to(v.dtype)


class _UniformFlip(_Flip):
    """Random signs from uniform draws: the torch stream's draws are fp32 uniforms for an fp16/bf16 input."""

    name = "wkuflip"

    def encode_fields(self, flat, dtype, ctx):
        return {"vals": kit.elementwise(_uniform_flip, flat, 16, **self.randomness(flat, ctx))}

    def decode_fields(self, fields, numel, dtype, seed):
        rnd = self.decode_randomness(seed, numel, dtype, fields["vals"].device)
        return kit.elementwise(_uniform_flip, fields["vals"], 16, **rnd).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_randomness_of_the_torch_stream_draws_in_the_encoders_compute_dtype(dtype: torch.dtype) -> None:
    """``decode_randomness`` gives "the {key, drawn} that randomness gave the encoder": with CONVERT (the
    default) the encoder drew for the fp32 copy of an fp16/bf16 input, so the decoder must draw fp32 uniforms
    too (drawn in the input's dtype, a generator's fp16 uniforms are other numbers: other signs at decode)."""
    comp = _UniformFlip()
    comp.random_stream = "torch"
    n = 300
    x = torch.randn(n, generator=torch.Generator().manual_seed(4)).to(dtype)
    ctx = Context(key="w", step=2, rank=0, seed=9)
    packet = comp.encode(x, ctx)
    u = torch.rand(n, generator=torch.Generator().manual_seed(ctx.shared_seed), dtype=torch.float32)
    signs = torch.where(u < 0.5, -1.0, 1.0).double()
    assert torch.equal(packet.tensors[0].double(), x.double() * signs)  # fp32 draws for the fp32 copy
    assert torch.equal(comp.decode(packet), x)


def test_a_decoder_cannot_ask_for_a_private_seed() -> None:
    with pytest.raises(TypeError, match="_Private.decode_fields takes the encoder's seed, which needs RANDOM = "
                                        "'shared'.*got 'private'"):
        type("_Private", (_Flip,), {"RANDOM": "private"})


# ----------------------------------------------------------------------------- code widths (GRADPRESS_KIT_CHECK)
def _spilling(kernel_pack: bool) -> kit.KitCompressor:
    """A declaration of 2-bit codes whose encode packs a 5 (3 bits) among zeros: by kit.pack, or by a kernel
    that packs its own rows (the fused pack of widths 1, 2, 4)."""
    def codes_of(v, *, key, drawn, bits, fuse):
        c = torch.where(v > 2.5, torch.full_like(v, 5), torch.zeros_like(v)).to(torch.uint8)
        return kit.pack_rows(c, bits, fuse)

    def encode(self, flat, dtype, ctx):
        if kernel_pack:
            return {"codes": kit.elementwise(codes_of, flat, 8, pack=2, fuse_pack=True)}  # its own row packs
        return {"codes": kit.pack(torch.where(flat > 2.5, 5, 0).to(torch.uint8), 2)}

    decl = _plain(fields=(kit.Field("codes", torch.uint8, "numel", bits=2),), encode_fields=encode,
                  decode_fields=lambda self, fields, numel, dtype: kit.unpack(fields["codes"], 2, numel).to(dtype))
    return decl()


@pytest.mark.parametrize("kernel_pack", [False, True])
def test_codes_wider_than_the_declared_bits_are_named_under_kit_check(monkeypatch, kernel_pack: bool) -> None:
    """A 5 packed into 2 bits spilled into its neighbour's code, silently: decode gave 1 there and 1 beside it.
    GRADPRESS_KIT_CHECK=1 checks every pack (kit.pack, and a kernel's own row packs, which it packs apart:
    the same bytes) and names the field, its width and the offending code."""
    x = torch.zeros(32)
    x[9] = 3.0  # code 5 at entry 9; entry 10's code is 0
    comp = _spilling(kernel_pack)
    monkeypatch.delenv("GRADPRESS_KIT_CHECK", raising=False)
    spilled = comp.decode(comp.encode(x))  # unchecked: the pack is not paid for by default (documented)
    assert spilled[9] == 1 and spilled[10] == 1
    monkeypatch.setenv("GRADPRESS_KIT_CHECK", "1")
    with pytest.raises(ValueError) as exc:
        comp.encode(x)
    assert str(exc.value) == ("compressor 'wk': field 'codes' declares 2 bits, but encode_fields packed a code of 5; "
                              "allowed: codes 0..3 (checked by GRADPRESS_KIT_CHECK=1)"), str(exc.value)
    ok = torch.zeros(32)
    monkeypatch.setenv("GRADPRESS_KIT_CHECK", "0")
    assert torch.equal(comp.decode(comp.encode(ok)), ok)


def test_kit_pack_checks_its_codes_under_kit_check(monkeypatch) -> None:
    monkeypatch.setenv("GRADPRESS_KIT_CHECK", "1")
    for codes, bits, bad in ((torch.tensor([0, 4, 1]), 2, 4), (torch.tensor([3, -1], dtype=torch.int32), 2, -1),
                             (torch.full((100,), 4096, dtype=torch.int32), 12, 4096)):
        with pytest.raises(ValueError, match=rf"kit.pack: a code of {bad} does not fit {bits} bits; allowed: codes "
                                             rf"0..{2 ** bits - 1}"):
            kit.pack(codes, bits)
    assert torch.equal(kit.unpack(kit.pack(torch.tensor([0, 3, 1]), 2), 2, 3), torch.tensor([0, 3, 1], dtype=torch.uint8))
    monkeypatch.setenv("GRADPRESS_KIT_CHECK", "yes")
    with pytest.raises(ValueError, match=r"GRADPRESS_KIT_CHECK got 'yes'; allowed: 0, 1 \(or unset\)"):
        kit.pack(torch.tensor([1]), 2)


#: every registered kit declaration at its default, and parameterizations that change a code width
_WIDTH_SPECS = ["qsgd:levels=1", "qsgd:levels=3,bucket=7", "qsgd:levels=127,bucket=0", "qsgd:levels=1000",
                "terngrad:clip=0", "minmax8:chunk=64,stochastic=true"]


def _width_inputs(dtype: torch.dtype) -> list[torch.Tensor]:
    """Random and extreme inputs: Gaussian at several sizes (fused rows and ragged tails), constants, zeros,
    the dtype's largest and smallest magnitudes, mixed magnitudes, NaN and Inf among finite entries."""
    gen = torch.Generator().manual_seed(7)
    fin = torch.finfo(dtype)
    out = [torch.randn(n, generator=gen, dtype=torch.float64).to(dtype) for n in (1, 7, 64, 1000, 4099)]
    out += [torch.zeros(100, dtype=dtype), torch.full((100,), 3.0, dtype=dtype), torch.full((100,), -fin.max, dtype=dtype),
            torch.full((100,), fin.tiny, dtype=dtype)]
    mixed = torch.randn(1000, generator=gen, dtype=torch.float64) * torch.logspace(-30, 30, 1000, dtype=torch.float64)
    out.append(mixed.clamp(-fin.max, fin.max).to(dtype))
    for bad in (math.nan, math.inf, -math.inf):
        x = torch.randn(1000, generator=gen, dtype=torch.float64).to(dtype)
        x[::97] = bad
        out.append(x)
    return out


def test_every_kit_declaration_packs_codes_within_their_declared_widths(monkeypatch) -> None:
    """The generic check behind GRADPRESS_KIT_CHECK: every registered kit declaration, on random and extreme
    inputs of every dtype, packs only codes that fit their fields' declared widths (a wider one spills into
    its neighbour). A new declaration in gradpress/compress/ is checked here once registered."""
    from gradpress.compress import create, names

    monkeypatch.setenv("GRADPRESS_KIT_CHECK", "1")
    specs = [n for n in names() if isinstance(create(n), kit.KitCompressor)] + _WIDTH_SPECS
    assert {"qsgd", "terngrad", "natural", "onebit", "minmax8", "topk"} <= set(specs)
    for spec in specs:
        comp = create(spec)
        for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
            for i, x in enumerate(_width_inputs(dtype)):
                comp.encode(x, Context(key=f"w{i}", step=i, rank=0, world_size=1, seed=3))
