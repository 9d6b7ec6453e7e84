"""Public view of the compressor registry: ``gradpress.compressors.names()``."""

from gradpress.compress.registry import create, describe, get_class, names, register

__all__ = ["create", "describe", "get_class", "names", "register"]
