"""A compressor declared from kit primitives: :class:`KitCompressor`.

A declaration is a subclass that states, besides the usual ``name``,
``PARAMS`` (typed, validated) and ``summary``:

* ``FIELDS``: the packet's fields in wire order (:class:`Field`);
* ``RANDOM``: ``"private"`` (independent per rank), ``"shared"`` (equal on
  every rank) or None (a pure function of x);
* ``encode_fields(flat, dtype, ctx) -> {field: tensor}`` and
  ``decode_fields(fields, numel, dtype) -> flat tensor`` (``numel`` entries
  of ``dtype``, checked), written with the
  primitives of :mod:`gradpress.compress.kit.primitives` (``flat`` is the
  input in its compute dtype, fp32 or fp64; ``dtype`` the input's own).
  A ``decode_fields`` that also takes ``out`` (a flat contiguous tensor of
  ``numel`` entries of ``dtype``, or None) may write its result there and
  return it: :meth:`KitCompressor.decode_into` then decodes without a fresh
  output (what it returns elsewhere is copied into ``out``). One that takes
  ``seed`` (``RANDOM = "shared"`` only) gets the encoder's shared seed, kept
  in ``packet.meta``, for :meth:`KitCompressor.decode_randomness`.

From that the kit derives: the wire layout and the exact byte count for an
input (:meth:`KitCompressor.layout`, :meth:`wire_bytes`, checked against
every packet it builds), ``variable_size`` (a field of data-dependent
count), ``uses_context`` (randomness), the random stream (counter-based and
fused by default; :attr:`random_stream` ``"torch"`` draws from a torch
generator instead, the stream of the hand-written compressors), and the
compiled element-wise kernels (:mod:`gradpress.compress.kit.compiler`).
``summable`` and ``unbiased`` are declared and held by the generic
property tests (tests/test_unbiased.py, tests/test_compressors.py).
Registration is the ordinary ``@register`` of the compressor registry.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from gradpress.compress.base import Compressor, Context, Packet, check_decode_out, generator_for
from gradpress.compress.kit.layout import Field, FieldSize, nbytes, sizes
from gradpress.compress.kit.rng import MAX_NUMEL, seed_words
from gradpress.compress.kit.streams import CodeWidthError
from gradpress.compress.numerics import compute_dtype

__all__ = ["KitCompressor"]

_STREAMS = ("counter", "torch")


def _size_hint(decl: Field, want: FieldSize, t: torch.Tensor, numel: int, comp: KitCompressor) -> str:
    """What to fix when an encoded field is not its declared layout: a scale not written by
    ``kit.pack_scale``, codes not packed, a per-chunk field whose chunk is not ``chunk_size``."""
    if decl.dtype == "scale" and t.dtype != want.dtype:
        return " (write a 'scale' field with kit.pack_scale(t, dtype))"
    if want.bits is not None and t.dtype == want.dtype and t.numel() == want.count and want.count != want.nbytes:
        return (f" (a field with bits={want.bits} holds packed codes: kit.pack(codes, {want.bits}) or "
                f"kit.elementwise(..., pack={want.bits}))")
    if decl.count == "chunks" and t.dtype == want.dtype:
        return (f" (count='chunks': one per chunk_size({numel}) = {comp.chunk_size(numel)} entries; define "
                "chunk_size(numel) to return the chunk encode_fields uses)")
    return ""


class KitCompressor(Compressor):
    """Base class of kit declarations (see the module doc)."""

    FIELDS: ClassVar[tuple[Field, ...]] = ()
    RANDOM: ClassVar[str | None] = None
    #: encode on the input converted to fp32 (fp64 stays fp64); False: as is
    CONVERT: ClassVar[bool] = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.RANDOM not in (None, "private", "shared"):
            raise TypeError(f"{cls.__name__}.RANDOM got {cls.RANDOM!r}; allowed: None, 'private', 'shared'")
        if not isinstance(cls.FIELDS, tuple):
            raise TypeError(f"{cls.__name__}.FIELDS is {cls.FIELDS!r}; allowed: a tuple of kit.Field")
        for i, f in enumerate(cls.FIELDS):
            if not isinstance(f, Field):
                raise TypeError(f"{cls.__name__}.FIELDS[{i}] is {f!r}; allowed: kit.Field(name, dtype, count, bits)")
            params = {p.name for p in cls.PARAMS}
            if isinstance(f.bits, str) and f.bits not in params and not hasattr(cls, f.bits):
                raise TypeError(f"{cls.__name__}.FIELDS: field {f.name!r} takes bits from attribute {f.bits!r}, which "
                                f"{cls.__name__} does not have; allowed: a parameter or attribute name, or an int")
        names = [f.name for f in cls.FIELDS]
        if len(set(names)) != len(names):
            raise TypeError(f"{cls.__name__}.FIELDS repeats a field name: {names}")
        cls.uses_context = cls.RANDOM is not None
        cls.variable_size = any(f.count is None for f in cls.FIELDS)
        decode_params = inspect.signature(cls.decode_fields).parameters
        cls._decodes_into = "out" in decode_params
        cls._decode_seed = "seed" in decode_params
        if cls._decode_seed and cls.RANDOM != "shared":
            raise TypeError(f"{cls.__name__}.decode_fields takes the encoder's seed, which needs RANDOM = 'shared' "
                            f"(a rank decoding another's packet cannot know its private seed); got {cls.RANDOM!r}")

    @classmethod
    def _check_declaration(cls) -> None:
        """At registration: the declaration defines both hooks."""
        for hook in ("encode_fields", "decode_fields"):
            if getattr(cls, hook) is getattr(KitCompressor, hook):
                raise TypeError(f"compressor {cls.name!r}: {cls.__name__} does not define {hook}; allowed: a "
                                "declaration with encode_fields(flat, dtype, ctx) and "
                                "decode_fields(fields, numel, dtype[, out][, seed])")

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        self._stream = "counter"

    # ----- the declaration's hooks ---------------------------------------------
    def chunk_size(self, numel: int) -> int:
        """Entries per chunk (per-chunk statistics, ``count="chunks"``
        fields); the whole tensor by default."""
        return max(numel, 1)

    def encode_fields(self, flat: torch.Tensor, dtype: torch.dtype, ctx: Context) -> dict[str, torch.Tensor]:
        raise NotImplementedError(f"{type(self).__name__} does not define encode_fields")

    def decode_fields(self, fields: dict[str, torch.Tensor], numel: int, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} does not define decode_fields")

    def torch_draw(self, gen: torch.Generator, flat: torch.Tensor) -> torch.Tensor:
        """The ``random_stream="torch"`` draws for ``flat``: one uniform per
        element in its dtype (override for integer draws)."""
        return torch.rand(flat.numel(), generator=gen, device=flat.device, dtype=flat.dtype)

    # ----- derived -----------------------------------------------------------------
    @property
    def random_stream(self) -> str:
        """``"counter"`` (fused counter-based bits, the default) or
        ``"torch"`` (a torch generator seeded like the hand-written
        compressors: their exact draws, one eager pass)."""
        return self._stream

    @random_stream.setter
    def random_stream(self, value: str) -> None:
        if value not in _STREAMS:
            raise ValueError(f"compressor {self.name!r}: random_stream got {value!r}; allowed: {', '.join(_STREAMS)}")
        self._stream = value

    def layout(self, numel: int, dtype: torch.dtype = torch.float32) -> list[FieldSize]:
        """The fields of a packet for ``numel`` elements of ``dtype``."""
        return sizes(self.FIELDS, self, numel, dtype)

    def wire_bytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        """Exact payload bytes from the layout (variable-size declarations:
        the base class's probe)."""
        n = nbytes(self.FIELDS, self, numel, dtype)
        return super().wire_bytes(numel, dtype) if n is None else n

    def randomness(self, flat: torch.Tensor, ctx: Context, salt: int = 0) -> dict[str, torch.Tensor | None]:
        """``{"key": ..., "drawn": ...}`` for :func:`~gradpress.compress.kit.primitives.elementwise`:
        a counter key from the declared seed, or torch-generator draws."""
        if self.RANDOM is None:
            raise TypeError(f"compressor {self.name!r} declares RANDOM = None but asked for random numbers")
        seed = ctx.private_seed if self.RANDOM == "private" else ctx.shared_seed
        return self._draws(seed, flat.device, salt, lambda: flat)

    def decode_randomness(self, seed: int, numel: int, dtype: torch.dtype, device: torch.device | str,
                          salt: int = 0) -> dict[str, torch.Tensor | None]:
        """In ``decode_fields(..., seed)``: the ``{"key", "drawn"}`` that
        :meth:`randomness` gave the encoder (``salt`` alike) for an input of
        ``numel`` elements of ``dtype``, so the decoder regenerates its draws
        (random signs, rotations, indices)."""
        return self._draws(seed, device, salt, lambda: torch.empty(
            numel, dtype=compute_dtype(dtype) if self.CONVERT else dtype, device=device))

    def _draws(self, seed: int, device: torch.device | str, salt: int,
               like: Callable[[], torch.Tensor]) -> dict[str, torch.Tensor | None]:
        """``{"key", "drawn"}`` of ``seed``: the counter key (``salt``'s
        stream), or the torch generator's draws for the tensor ``like()``
        gives (built only for that stream)."""
        if self._stream == "torch":
            flat = like()
            return {"key": None, "drawn": self.torch_draw(generator_for(flat.device, seed), flat)}
        return {"key": seed_words(seed, device, salt), "drawn": None}

    def _encode(self, x: torch.Tensor, ctx: Context) -> Packet:
        if x.numel() > MAX_NUMEL:
            raise ValueError(f"compressor {self.name!r}: {x.numel()} elements; allowed: at most {MAX_NUMEL} per tensor")
        flat = x.reshape(-1)
        if self.CONVERT:
            flat = flat.to(compute_dtype(x.dtype))
        try:
            fields = self.encode_fields(flat, x.dtype, ctx)
        except CodeWidthError as exc:  # GRADPRESS_KIT_CHECK: which declared field that width packs
            named = " or ".join(repr(f.name) for f in self.layout(x.numel(), x.dtype) if f.bits == exc.bits)
            field = f"field {named} declares" if named else "no field declares"
            raise CodeWidthError(exc.code, exc.bits, f"compressor {self.name!r}: {field} {exc.bits} bits, but "
                                 f"encode_fields packed a code of {exc.code}") from None
        except Exception as exc:
            if hasattr(exc, "add_note"):  # Python 3.11+: the author's traceback, plus which declaration and input
                exc.add_note(f"in compressor {self.name!r} ({type(self).__name__}.encode_fields) on a "
                             f"{tuple(x.shape)} {x.dtype} input")
            raise
        layout = self.layout(x.numel(), x.dtype)
        if not isinstance(fields, dict):
            raise TypeError(f"compressor {self.name!r}: encode_fields returned a {type(fields).__name__}; allowed: a "
                            f"dict {{field name: tensor}} of the fields {[f.name for f in layout]}")
        missing = [f.name for f in layout if f.name not in fields]
        if missing:
            raise RuntimeError(f"compressor {self.name!r}: encode_fields did not return the declared field(s) "
                               f"{missing}; it returned {list(fields)}")
        fields = dict(fields)
        tensors = []
        for want, decl in zip(layout, self.FIELDS):
            t = fields.pop(want.name)
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"compressor {self.name!r}: field {want.name!r} is a {type(t).__name__}; "
                                "allowed: a torch.Tensor")
            t = t.reshape(-1).contiguous()
            if t.dtype != want.dtype or (want.count is not None and t.numel() * t.element_size() != want.nbytes):
                hint = _size_hint(decl, want, t, x.numel(), self)
                raise RuntimeError(f"compressor {self.name!r}: field {want.name!r} is {t.numel()} x {t.dtype}; "
                                   f"the declared layout says {want.nbytes} bytes of {want.dtype}{hint}")
            tensors.append(t)
        if fields:
            raise RuntimeError(f"compressor {self.name!r}: encode_fields returned undeclared fields {sorted(fields)}")
        meta = {"seed": ctx.shared_seed} if self._decode_seed else {}
        return Packet(tensors, x.shape, x.dtype, meta)

    def fields(self, packet: Packet) -> dict[str, torch.Tensor]:
        """``{field name: payload tensor}`` of ``packet`` (``extract``)."""
        return {f.name: t for f, t in zip(self.FIELDS, packet.tensors)}

    def _decode_kwargs(self, packet: Packet) -> dict[str, Any]:
        if not self._decode_seed:
            return {}
        if "seed" not in packet.meta:
            raise ValueError(f"compressor {self.name!r}: the packet has no meta['seed']; decode_fields needs the "
                             "encoder's shared seed, which a packet rebuilt from the wire carries only when given "
                             "the local packet's meta")
        return {"seed": packet.meta["seed"]}

    def _checked(self, got: Any, packet: Packet) -> torch.Tensor:
        """``decode_fields``' result, refused unless ``packet.numel`` entries of ``packet.dtype``."""
        if not isinstance(got, torch.Tensor) or got.numel() != packet.numel or got.dtype != packet.dtype:
            what = f"{got.numel()} x {got.dtype}" if isinstance(got, torch.Tensor) else f"a {type(got).__name__}"
            raise RuntimeError(f"compressor {self.name!r}: decode_fields returned {what}; allowed: {packet.numel} "
                               f"entries of {packet.dtype} (the input's numel and dtype)")
        return got

    def decode(self, packet: Packet) -> torch.Tensor:
        out = self.decode_fields(self.fields(packet), packet.numel, packet.dtype, **self._decode_kwargs(packet))
        return self._checked(out, packet).reshape(packet.shape)

    def decode_into(self, packet: Packet, out: torch.Tensor) -> torch.Tensor:
        if not self._decodes_into:
            return super().decode_into(packet, out)
        check_decode_out(packet, out)
        flat = out.view(-1)
        got = self._checked(self.decode_fields(self.fields(packet), packet.numel, packet.dtype, out=flat,
                                               **self._decode_kwargs(packet)), packet)
        if got.data_ptr() != flat.data_ptr() or got.numel() != flat.numel():  # wrote elsewhere: copy
            flat.copy_(got.reshape(-1))
        return out
