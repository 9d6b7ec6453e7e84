"""Residual and state keys: the one place where a tensor's name becomes a key.

A tensor (an engine key: a parameter name, ``grad:<name>``, ``diloco/model``)
is keyed by its *escaped* name (:func:`escape`): ``%`` -> ``%25``, ``/`` ->
``%2F``, ``#`` -> ``%23``, as in URLs. Every key built from it appends to
that: the k-th partition ``<escaped>#k`` (and a PS root's ``#ps``, a ring
hop's ``#ring<c>``: compressor contexts), a strategy's residual
``<namespace>/<key>`` (:func:`store_key`). An escaped name holds neither '/'
nor '#', so a key is read back without knowing the names (:func:`split_key`,
:func:`owner`), and two tensors never share one: a parameter called
``root/w#ps`` (``register_parameter`` and ``nn.ParameterDict`` take '/' and
'#') is keyed ``root%2Fw%23ps``, never ``w``'s PS root residual
``root/w#ps``. A name without '%', '/' or '#' is its own key, as before.

States written before the encoding (no ``keys`` entry, :data:`KEYS_FORMAT`)
are read by :func:`upgrade_keys`: a key is re-keyed when exactly one tensor
could have built it; one that two tensors built (they shared it) is dropped,
with a warning, and restarts at zero. Names without those characters keep
their keys, so such a state loads unchanged.
"""

from __future__ import annotations

import functools
import re
import warnings
from collections.abc import Collection, Mapping
from typing import Any

__all__ = ["KEYS_FORMAT", "WORKER", "escape", "unescape", "namespace", "namespaces", "store_key", "part_key",
           "root_key", "hop_key", "split_key", "owner", "owner_among", "tensor_owner", "key_tail", "namespace_tail", "upgrade_keys"]

#: the ``keys`` entry of an engine state whose keys are built from escaped names
KEYS_FORMAT = "escaped/1"
#: the worker's own residuals: keyed by the tensor key itself
WORKER = ""
#: each declared namespace and the suffix every key of it ends with (None: not declared: any store tail)
_NAMESPACES: dict[str, str | None] = {}
_ESCAPES = {"%": "%25", "/": "%2F", "#": "%23"}
_RESERVED = re.compile(r"[%/#]")
_ESCAPED = re.compile(r"%(25|2F|23)")


@functools.lru_cache(maxsize=65536)
def escape(name: str) -> str:
    """The key of the tensor ``name``: '%', '/' and '#' percent-escaped (a name without them unchanged).
    Cached: the engine asks it for every tensor of every call (a dict look-up after the first)."""
    return _RESERVED.sub(lambda m: _ESCAPES[m.group(0)], name)


def unescape(key: str) -> str:
    """The name :func:`escape` made ``key`` from."""
    return _ESCAPED.sub(lambda m: chr(int(m.group(1), 16)), key)


def namespace(name: str, suffix: str | None = None) -> str:
    """Declare a strategy's residual namespace (``"ring"``, ``"root"``) and
    return it; its keys are ``name/key``. ``suffix``: what every exchanged
    key of the namespace ends with after the tensor's partitions and pieces
    (``"#ps"`` for the PS roots', ``""`` for the ring's and the hosts', which
    never end with ``#ps``); None: any tail :func:`key_tail` accepts, or, for a
    namespace already declared, the suffix it was declared with (naming it again
    to read its residuals changes nothing). Another suffix than the declared one:
    ValueError."""
    if not name or _RESERVED.search(name):
        raise ValueError(f"a residual namespace is a non-empty name without '%', '/' or '#', got {name!r}")
    declared = _NAMESPACES.get(name)
    if suffix is None:
        _NAMESPACES.setdefault(name, None)
    elif declared is None or declared == suffix:
        _NAMESPACES[name] = suffix
    else:
        raise ValueError(f"residual namespace {name!r} is declared with the key suffix {declared!r}, "
                         f"got {suffix!r}: one namespace per strategy; choose another name")
    return name


def namespace_tail(space: str, tail: str) -> str | None:
    """None when ``tail`` (what :func:`key_tail` found after a tensor's name) is one that a residual of
    namespace ``space`` has (the suffix it declared, after any ``#k`` partitions and pieces); else the form
    its keys have, in words."""
    suffix = _NAMESPACES.get(space)
    if suffix is None:
        return None
    body = tail[: len(tail) - len(suffix)] if suffix else tail
    if tail.endswith(suffix) and _PARTS.fullmatch(body):
        return None
    return "the parameter's name, its #k partitions and pieces, then " + (repr(suffix) if suffix else "nothing")


def namespaces() -> frozenset[str]:
    """Every residual namespace a strategy declared (:func:`namespace`): ``ring``, ``root``, ``host``."""
    from gradpress.exchange import strategies  # noqa: F401 - declares every strategy's namespace

    return frozenset(_NAMESPACES)


def store_key(space: str, key: str) -> str:
    """The store key of the (escaped, exchanged) ``key`` in namespace ``space`` (the worker's own: the key)."""
    return f"{space}/{key}" if space else key


def part_key(key: str, part: int) -> str:
    """The exchanged key of part ``part`` of the tensor keyed ``key`` (a plan partition; a hierarchical piece)."""
    return f"{key}#{part}"


def root_key(key: str) -> str:
    """The exchanged key of ``key``'s re-encoding at its parameter-server root."""
    return f"{key}#ps"


def hop_key(key: str, chunk: int) -> str:
    """The exchanged key of chunk ``chunk`` of ``key`` re-compressed on a ring hop."""
    return f"{key}#ring{chunk}"


def split_key(key: str) -> tuple[str, str]:
    """The namespace (:data:`WORKER` for the worker's own) and exchanged key of the store key ``key``:
    the inverse of :func:`store_key` (an exchanged key holds no '/')."""
    head, sep, tail = key.partition("/")
    return (head, tail) if sep else (WORKER, key)


def owner(key: str) -> str:
    """The tensor name a store key (or an exchanged key: ``<escaped>#k``,
    ``#ps``, ``#ring<c>``) was built from: its escaped name unescaped."""
    return unescape(split_key(key)[1].partition("#")[0])


def owner_among(key: str, names: Collection[str]) -> str | None:
    """The name of ``names`` whose residual the store key ``key`` is, or None."""
    name = owner(key)
    return name if name in names else None


def tensor_owner(tensor_key: str, names: Collection[str]) -> str | None:
    """The name of ``names`` the exchanged key ``tensor_key`` (a compressor's
    context: ``<escaped>``, ``#k``, ``#ps``, ``#k#ps``) was built from, or None."""
    name = unescape(tensor_key.partition("#")[0])
    return name if name in names else None


#: what follows a tensor's escaped name in an exchanged key: plan partitions and hierarchical pieces
#: ``#k`` (any depth), then a PS root's ``#ps``, or in a compressor context a ring hop's ``#ring<c>``
_PARTS = re.compile(r"(?:#[0-9]+)*")
_STORE_TAIL = re.compile(r"(?:#[0-9]+)*(?:#ps)?")
_CONTEXT_TAIL = re.compile(r"(?:#[0-9]+)*(?:#ps|#ring[0-9]+)?")


def key_tail(key: str, names: Collection[str], context: bool = False) -> tuple[str, str] | None:
    """``(name, tail)`` when the exchanged ``key`` (a store key's part after its namespace; a compressor
    context key when ``context``) is one the exchange builds from the tensor ``name`` of ``names``: its
    escaped name then ``tail`` (``""``: the whole tensor; else :func:`part_key`'s, :func:`root_key`'s,
    :func:`hop_key`'s suffixes); None when no tensor of ``names`` builds it."""
    head, sep, rest = key.partition("#")
    name = unescape(head)
    tail = sep + rest
    if name not in names or escape(name) != head:
        return None
    return (name, tail) if (_CONTEXT_TAIL if context else _STORE_TAIL).fullmatch(tail) else None


# ---------------------------------------------------------------- states written before the encoding
#: what followed a name in a key built before the encoding: a store key of a namespace, a context key
_OLD_STORE_SUFFIX = re.compile(r"(#[0-9]+)?(#ps)?")
_OLD_CONTEXT_SUFFIX = re.compile(r"((?:#[0-9]+)*)(#ring[0-9]+|#ps)?")


def _numbers_fit(numbers: list[int], parts: int, pieces: bool) -> bool:
    """Whether the ``#n`` suffixes of an old context key are what the exchange appended to a tensor of
    ``parts`` plan partitions: ``#k`` (k < parts) when it has several, then a hierarchical piece ``#j``
    when its strategy pipelines (``pieces``; any j, the pieces depend on ``chunk`` and the shapes)."""
    lead = 1 if parts > 1 else 0
    if len(numbers) not in ((lead, lead + 1) if pieces else (lead,)):
        return False
    return not lead or numbers[0] < parts


def _new_keys(key: str, names: Mapping[str, tuple[int, bool]], store: bool) -> set[str]:
    """Every key today's encoding gives to what the old ``key`` may have been
    (a store key when ``store``, else a compressor context key); ``names``:
    each tensor's plan partitions (a ``#k`` suffix is partition k of it) and
    whether its strategy pipelines in pieces (``hierarchical``: ``#j``)."""
    heads = [""] + ([f"{ns}/" for ns in _NAMESPACES if key.startswith(f"{ns}/")] if store else [])
    out = set()
    for head in heads:
        rest = key[len(head):]
        for name, (parts, pieces) in names.items():
            if not rest.startswith(name):
                continue
            tail = rest[len(name):]
            if store and not head:
                ok = not tail  # the worker's own residual: the whole name
            elif store:
                m = _OLD_STORE_SUFFIX.fullmatch(tail)
                part = None if m is None or m.group(1) is None else int(m.group(1)[1:])
                ok = m is not None and (part is None or part < parts and parts > 1)
            else:
                m = _OLD_CONTEXT_SUFFIX.fullmatch(tail)
                ok = m is not None and _numbers_fit([int(n) for n in m.group(1).split("#")[1:]], parts, pieces)
            if ok:
                out.add(head + escape(name) + tail)
    return out


def _rekeyed(entries: Mapping[Any, Any], names: Mapping[str, tuple[int, bool]], store: bool,
             shared: list[str]) -> dict:
    """``entries`` under today's keys; a key with two readings goes to ``shared`` (and is left out)."""
    out = {}
    for key, value in entries.items():
        new = _new_keys(key, names, store) if isinstance(key, str) else set()
        if len(new) > 1:
            shared.append(key)
        else:
            out[new.pop() if new else key] = value
    return out


def _rekeyed_maps(state: Mapping[str, Any], names: Mapping[str, tuple[int, bool]], shared: list[str]) -> dict:
    """A compressor's or strategy's state with its per-tensor maps (by context key) re-keyed, at any depth
    (a threshold selector's ``correction``: ``scales``, ``slopes``). A structural key (``q``, ``scales``)
    holds no '%', '/' or '#', so no reading changes it."""
    return {k: _rekeyed_maps(_rekeyed(v, names, False, shared), names, shared) if isinstance(v, Mapping) else v
            for k, v in state.items()}


def _parts(decision: Any) -> tuple[int, bool]:
    """The partitions of a saved plan's decision (1 when there is none to read), and whether its strategy
    cuts a call in pieces (``hierarchical``, when it pipelines)."""
    value = decision.get("parts", 1) if isinstance(decision, Mapping) else 1
    strategy = decision.get("strategy") if isinstance(decision, Mapping) else None
    pieces = isinstance(strategy, str) and strategy.split(":", 1)[0] == "hierarchical"
    return (value if isinstance(value, int) and not isinstance(value, bool) else 1), pieces


def upgrade_keys(state: Mapping[str, Any], names: Collection[str]) -> Mapping[str, Any]:
    """``state`` (an engine state, or a hook's) with today's keys, for the
    engine keys ``names``: unchanged when it has them (``keys`` is
    :data:`KEYS_FORMAT`) or when no name needs escaping. Otherwise each
    residual key, and each key of the compressor's and the strategies'
    per-tensor maps (DGC's momentum, PowerSGD's Q, the PS roots...), that
    one tensor built is re-keyed; one that two tensors built (``root/w#ps``:
    the parameter ``root/w#ps``'s residual or ``w``'s PS root's; ``w#0``:
    the parameter ``w#0`` or partition 0 of ``w``) held whichever was
    written last: it is dropped, with a warning, and restarts at zero."""
    if state.get("keys") == KEYS_FORMAT:
        return state
    out = {**state, "keys": KEYS_FORMAT}
    if not any(_RESERVED.search(n) for n in names):
        return out
    from gradpress.exchange import strategies  # noqa: F401 - declares every strategy's namespace

    plan = state.get("plan")
    plan = plan if isinstance(plan, Mapping) else {}
    parts = {n: _parts(plan.get(n)) for n in names}
    shared: list[str] = []
    feedback = state.get("feedback")
    if isinstance(feedback, Mapping) and isinstance(feedback.get("residuals"), Mapping):
        out["feedback"] = {**feedback, "residuals": _rekeyed(feedback["residuals"], parts, True, shared)}
    compressor = state.get("compressor")
    if isinstance(compressor, Mapping):
        out["compressor"] = _rekeyed_maps(compressor, parts, shared)
    strategies_state = state.get("strategies")
    if isinstance(strategies_state, Mapping):
        out["strategies"] = {k: _rekeyed_maps(v, parts, shared) if isinstance(v, Mapping) else v
                             for k, v in strategies_state.items()}
    if shared:
        warnings.warn(f"gradpress state written before residual keys were escaped: the entries {', '.join(shared)} "
                      "were shared by two tensors (a parameter named like another's residual or partition key) and "
                      "restart at zero; the others were re-keyed", stacklevel=3)
    return out
