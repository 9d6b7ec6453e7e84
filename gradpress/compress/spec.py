"""Named classes and their specs, shared by every registry: compressors
(``"qsgd:levels=16,bucket=512"``), strategies, algorithms
(``"localsgd:period=8"``).

* :func:`parse_stage`: one stage of a spec string, ``name[:key=value,...]``
  (values stay strings);
* :func:`coerce_params`: the typed, validated values of a class's
  ``PARAMS`` (:class:`~gradpress.compress.base.Param`);
* :class:`Registry`: name -> class, filled by a decorator, with the
  package's modules imported on first use.
"""

from __future__ import annotations

import difflib
import importlib
import pkgutil
import re
from collections.abc import Iterable, Mapping
from typing import Any, Generic, TypeVar

__all__ = ["NAME_PATTERN", "parse_stage", "coerce_params", "append_piece", "Registry", "spelled_as", "close_to",
           "without_defaults"]

#: what a registered name may be: spec strings (``name:key=value>name``) and comma-separated lists must spell it
NAME_PATTERN = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*")

T = TypeVar("T", bound=type)


def coerce_params(declared: Iterable[Any], given: Mapping[str, Any], owner: str, kind: str,
                  defaults: bool = True) -> dict[str, Any]:
    """``{name: value}`` for ``given`` against the ``Param``s ``declared``:
    an unknown name raises ValueError naming it, its near miss
    (:func:`close_to`) and the allowed ones; each value is coerced and
    validated by its ``Param``. ``defaults``: also fill every parameter not
    given with its default."""
    known = {p.name: p for p in declared}
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise ValueError(f"{kind} {owner!r}: unknown parameter {unknown[0]!r}{close_to(unknown[0], known)}; "
                         f"allowed parameters: {', '.join(known) or 'none'}")
    out = {}
    for p in known.values():
        if p.name not in given and not defaults:
            continue
        value = given.get(p.name, p.default)
        out[p.name] = p.coerce(value, owner, kind=kind) if value is not None else None
    return out


class Registry(Generic[T]):
    """Name -> class for one ``kind`` of thing; the classes live in the
    modules of ``package`` (all but ``skip``), imported on first lookup."""

    def __init__(self, kind: str, package: str, skip: Iterable[str] = (), plugins: bool = False) -> None:
        self.kind = kind
        self.package = package
        self.skip = frozenset(skip)
        #: also import the plugin modules of ``$GRADPRESS_PLUGINS`` (:meth:`load_plugins`)
        self.plugins = plugins
        self.classes: dict[str, T] = {}
        self._loaded = False

    def register(self, cls: T) -> T:
        """Class decorator: add ``cls`` under ``cls.name``. A class from
        outside the package loads the package's own classes first, so a name
        it would take from one of them is refused here, naming both."""
        name = getattr(cls, "name", "")
        if not name:
            raise ValueError(f"{cls.__name__} has no registry name")
        if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
            raise ValueError(f"{self.kind} name {name!r} ({cls.__name__}) cannot be written in a spec; allowed: "
                             "letters, digits, '_', '-' and '.' (not first), e.g. 'my_method'")
        if not self._loaded and not cls.__module__.startswith(self.package + "."):
            self.load()
        existing = self.classes.get(name)
        if existing is not None and existing is not cls:
            raise ValueError(f"{self.kind} name {name!r} is already registered by {existing.__name__}")
        self.classes[name] = cls
        return cls

    def load(self) -> None:
        """Import every module of the package once (each registers its classes);
        a module that fails to import leaves the registry to load again."""
        if self._loaded:
            return
        self._loaded = True
        try:
            pkg = importlib.import_module(self.package)
            for mod in pkgutil.iter_modules(pkg.__path__):
                if mod.name not in self.skip:
                    importlib.import_module(f"{self.package}.{mod.name}")
        except BaseException:
            self._loaded = False
            raise

    def load_plugins(self) -> None:
        """With ``plugins``: import the modules of ``$GRADPRESS_PLUGINS`` not
        imported yet (:mod:`gradpress.compress.plugins`; ValueError naming one that
        fails). Not for the strategies, which gradpress looks up while its
        own modules import (a plugin importing gradpress would then meet a
        partly imported package)."""
        if self.plugins:
            from gradpress.compress import plugins

            plugins.load()

    def names(self) -> list[str]:
        """Every registered name, sorted (the plugins' too)."""
        self.load()
        self.load_plugins()
        return sorted(self.classes)

    def get(self, name: str) -> T:
        """The class registered as ``name`` (a name not known yet: after
        importing the plugins); ValueError listing the allowed names."""
        self.load()
        if name not in self.classes:
            self.load_plugins()
        if name not in self.classes:
            raise ValueError(f"unknown {self.kind} {name!r}{spelled_as(name, self.classes)}"
                             + f"; allowed: {', '.join(sorted(self.classes))}"
                             + (PLUGIN_HINT if self.plugins else ""))
        return self.classes[name]


#: what an unknown compressor or algorithm name adds to its error: where a name of one's own comes from
PLUGIN_HINT = (" (one of your own: load its module with --plugin MODULE or GRADPRESS_PLUGINS=MODULE, "
               "docs/authoring.md)")


def _folded(name: str) -> str:
    """``name`` as the hints compare it: lower case, ``_`` as ``-``."""
    return name.lower().replace("_", "-")


def spelled_as(name: str, names: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` when ``name`` is one of ``names`` spelled another way (``TopK``, ``QSGD``,
    ``streaming_diloco``, ``dgc-threshold``: case, and ``-`` for ``_``), else ``""``: a hint for an
    unknown-name error."""
    same = sorted(n for n in names if _folded(n) == _folded(name))
    return f" (did you mean {same[0]!r}?)" if same else ""


#: how alike (difflib's ratio, of the case- and ``-``/``_``-folded names) a misspelling must be to get a guess:
#: ``ration``/``ratio`` 0.91, ``level``/``levels`` 0.91, ``perio``/``period`` 0.91; ``H``/``period`` 0.
CLOSE_CUTOFF = 0.8


def close_to(name: str, names: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for a parameter name ``name`` that is not one of ``names``: the one spelled
    the same but for case and ``-``/``_`` (:func:`spelled_as`), else the closest by :mod:`difflib` at
    :data:`CLOSE_CUTOFF` or above (one guess at most), else ``""``."""
    names = list(names)
    same = spelled_as(name, names)
    if same:
        return same
    by_folded = {_folded(n): n for n in names}
    close = difflib.get_close_matches(_folded(name), list(by_folded), n=1, cutoff=CLOSE_CUTOFF)
    return f" (did you mean {by_folded[close[0]]!r}?)" if close else ""


def without_defaults(name: str, values: Mapping[str, Any], defaults: Mapping[str, Any]) -> str:
    """``name[:key=value,...]`` with only the ``values`` whose text differs from their default's: the
    canonical spec (every parameter, ``key=value`` as the class prints it) less what the reader need not
    read. Parsed, it gives back the same canonical spec, since a parameter left out takes its default."""
    kept = [f"{k}={v}" for k, v in values.items() if k not in defaults or str(v) != str(defaults[k])]
    return name + (":" + ",".join(kept) if kept else "")


def append_piece(specs: list[str], piece: str, what: str, text: str) -> None:
    """Add ``piece`` (one comma-separated item of the list ``text``) to
    ``specs``: a ``key=value`` (``=`` and no ``:`` before its first ``>``)
    continues the parameter list of the spec before it, so that
    ``qsgd:levels=4,bucket=512,topk`` is two specs; anything else starts a
    spec. ValueError naming ``what`` for a parameter after a spec (or last
    stage) with no parameter list (``fp16,ratio=0.1``) and for a piece that
    is neither (``topk:ratio=0.1,0.2``: a value without its key)."""
    head = piece.split(">", 1)[0]
    if specs and "=" in head and ":" not in head:
        if ":" not in specs[-1].rsplit(">", 1)[-1]:
            raise ValueError(f"{what}: {piece!r} in {text!r} is a parameter, but {specs[-1]!r} has no parameter "
                             "list; allowed: NAME:key=value,key=value")
        specs[-1] += "," + piece
    elif specs and _is_number(piece):  # 'topk:ratio=0.1,0.2': a value without its key, not a name
        raise ValueError(f"{what}: {piece!r} in {text!r} is neither a NAME[:key=value,...] spec nor a key=value "
                         f"parameter of {specs[-1]!r}; a parameter after a comma is key=value "
                         f"({specs[-1]},KEY={piece}), and ';' separates specs")
    else:
        specs.append(piece)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


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
