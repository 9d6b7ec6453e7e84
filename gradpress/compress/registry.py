"""Name -> compressor class registry and spec-string parsing.

Spec grammar (like timm's ``create_model("name", **kw)``; a stage is parsed by
:func:`gradpress.compress.spec.parse_stage`)::

    spec   := stage (">" stage)*
    stage  := name [":" key "=" value ("," key "=" value)*]

``"topk:ratio=0.01>natural"`` builds top-k whose kept values are then
quantized by natural compression.
"""

from __future__ import annotations

from typing import Any

from gradpress.compress.base import Compressor
from gradpress.compress.spec import Registry, parse_stage, without_defaults

_REGISTRY: Registry[type[Compressor]] = Registry("compressor", "gradpress.compress", skip=("base", "registry", "compose", "plugins"), plugins=True)


def register(cls: type[Compressor]) -> type[Compressor]:
    """Class decorator: add ``cls`` to the registry under ``cls.name``, once
    its declaration holds: a name a spec can spell, distinct parameter names
    that hide no attribute of the compressor, every default allowed by its
    own parameter, and (kit declarations) both hooks defined. ValueError or
    TypeError naming what is wrong."""
    check_params(cls)
    check = getattr(cls, "_check_declaration", None)
    if check is not None:
        check()
    return _REGISTRY.register(cls)


def check_params(cls: type[Compressor]) -> None:
    """ValueError unless ``cls.PARAMS`` have distinct names, none hiding an
    attribute of :class:`Compressor` or of ``cls``'s bases (``seed``, which
    ``__init__`` sets after the parameters, or a method), and each default
    passes its own check."""
    owner = cls.name or cls.__name__
    seen: set[str] = set()
    for p in cls.PARAMS:
        if p.name in seen:
            raise ValueError(f"compressor {owner!r}: declares parameter {p.name!r} twice")
        seen.add(p.name)
        for base in cls.__mro__[1:]:
            if p.name in vars(base) or (base is Compressor and p.name in ("seed", "_calls")):
                raise ValueError(f"compressor {owner!r}: parameter {p.name!r} would hide {base.__name__}'s attribute "
                                 f"{p.name!r}; allowed: another name")
        if p.default is not None:
            try:
                p.coerce(p.default, owner)
            except ValueError as exc:
                raise ValueError(f"compressor {owner!r}: parameter {p.name!r}: default {p.default!r} is refused by "
                                 f"its own declaration ({exc})") from None


def names() -> list[str]:
    """All registered compressor names, sorted."""
    return _REGISTRY.names()


def get_class(name: str) -> type[Compressor]:
    return _REGISTRY.get(name)


def create(spec: str | Compressor, **params: Any) -> Compressor:
    """Build a compressor from a name, a spec string or keywords.

    ``create("qsgd:levels=16,bucket=512")``, ``create("qsgd", levels=16)``,
    ``create("topk:ratio=0.01>natural")``. Keywords apply to the first stage.
    Raises ``ValueError`` naming the unknown name, parameter or bad value and
    listing what is allowed.
    """
    if isinstance(spec, Compressor):
        if params:
            raise ValueError("keywords cannot be combined with an already built compressor")
        return spec
    if not isinstance(spec, str):
        raise ValueError(f"compressor spec must be a string, got {type(spec).__name__}")
    stages = spec.split(">")
    built = []
    for i, stage in enumerate(stages):
        name, stage_params = parse_stage(stage)
        kwargs: dict[str, Any] = dict(stage_params)
        if i == 0:
            overlap = set(kwargs) & set(params)
            if overlap:
                raise ValueError(f"compressor {name!r}: parameter {sorted(overlap)[0]!r} given in the spec and as a keyword")
            kwargs.update(params)
        built.append(get_class(name)(**kwargs))
    if len(built) == 1:
        return built[0]
    from gradpress.compress.compose import Composed

    result = built[0]
    for nxt in built[1:]:
        result = Composed(result, nxt)
    return result


def short_spec(spec: str | Compressor) -> str:
    """The compressor's canonical spec (:meth:`Compressor.spec`) without the parameters at their defaults,
    stage by stage (``qsgd:levels=4,bucket=512>fp16`` -> ``qsgd:levels=4>fp16``): for people (progress
    lines, tables); it builds the same compressor. ValueError as :func:`create`."""
    comp = create(spec)
    first, second = getattr(comp, "first", None), getattr(comp, "second", None)
    if isinstance(first, Compressor) and isinstance(second, Compressor):
        return f"{short_spec(first)}>{short_spec(second)}"
    return without_defaults(comp.name, comp.config(), type(comp)().config())


def describe() -> list[dict[str, Any]]:
    """One row per registered compressor: name, params (name, type, default,
    allowed, doc), traits and summary."""
    rows = []
    for name in names():
        cls = _REGISTRY.get(name)
        inst = cls()
        rows.append(
            {
                "name": name,
                "summary": cls.summary,
                "params": [
                    {
                        "name": p.name,
                        "type": p.type.__name__,
                        "default": p.default,
                        "allowed": p.allowed,
                        "doc": p.doc,
                    }
                    for p in cls.PARAMS
                ],
                "summable": inst.is_summable,
                "unbiased": inst.is_unbiased,
                "variable_size": cls.variable_size,
                "stateful": cls.stateful,
                "error_feedback_default": inst.default_error_feedback,
            }
        )
    return rows
