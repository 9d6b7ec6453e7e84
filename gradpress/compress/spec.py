"""One stage of a spec string, ``name[:key=value,...]``.

Shared by every registry whose entries take typed :class:`~gradpress.compress.base.Param`
parameters (compressors: ``"qsgd:levels=16,bucket=512"``; algorithms:
``"localsgd:period=8"``). Values stay strings here; ``Param.coerce`` converts
and validates them.
"""

from __future__ import annotations

__all__ = ["parse_stage"]


def parse_stage(text: str, kind: str = "compressor") -> tuple[str, dict[str, str]]:
    """``(name, {key: value})`` of one stage ``name[:key=value,...]``.

    Whitespace around names, keys and values is dropped. Raises
    ``ValueError`` for an empty stage, an item without ``=`` or a key, and a
    key given twice; ``kind`` names what is parsed in those messages
    (``"compressor 'qsgd': malformed parameter 'x'; expected key=value"``).
    """
    text = text.strip()
    if not text:
        raise ValueError(f"empty {kind} spec stage; expected 'name' or 'name:key=value,...'")
    name, _, rest = text.partition(":")
    name = name.strip()
    params: dict[str, str] = {}
    if rest.strip():
        for item in rest.split(","):
            key, sep, value = item.partition("=")
            key = key.strip()
            if not sep or not key:
                raise ValueError(f"{kind} {name!r}: malformed parameter {item!r}; expected key=value")
            if key in params:
                raise ValueError(f"{kind} {name!r}: parameter {key!r} given twice")
            params[key] = value.strip()
    return name, params
