"""Compressors: encode a tensor into a Packet and decode it back.

One method per file; each registers itself with :func:`register`.
Build one with :func:`create` (``gradpress.compressor``).
"""

from gradpress.compress.base import Compressor, Context, Packet, Param, derive_seed
from gradpress.compress.registry import create, describe, get_class, names, register

__all__ = [
    "Compressor",
    "Context",
    "Packet",
    "Param",
    "create",
    "derive_seed",
    "describe",
    "get_class",
    "names",
    "register",
]
