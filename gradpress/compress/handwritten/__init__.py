"""The hand-written compressors that the authoring kit's declarations
replaced (``qsgd``, ``terngrad``, ``natural``, ``onebit``, ``minmax8``,
``topk``), frozen as they were before the kit, *not registered*.

They are kept for two jobs only: the reference the kit declarations are
tested against bit for bit (with the kit's ``random_stream = "torch"``, the
same torch generator draws; tests/test_kit_identity.py), and the
"hand-written" rows of ``gradpress bench compressors --variants``. Nothing
else imports them; the registered names resolve to the kit declarations.
"""

from __future__ import annotations

from gradpress.compress.base import Compressor

__all__ = ["HANDWRITTEN", "handwritten"]


def _classes() -> dict[str, type[Compressor]]:
    from gradpress.compress.handwritten.minmax8 import MinMax8
    from gradpress.compress.handwritten.natural import Natural
    from gradpress.compress.handwritten.onebit import OneBit
    from gradpress.compress.handwritten.qsgd import QSGD
    from gradpress.compress.handwritten.terngrad import TernGrad
    from gradpress.compress.handwritten.topk import TopK

    return {c.name: c for c in (QSGD, TernGrad, Natural, OneBit, MinMax8, TopK)}


#: registry names that have a frozen hand-written reference here
HANDWRITTEN = ("qsgd", "terngrad", "natural", "onebit", "minmax8", "topk")


def handwritten(name: str, **params: object) -> Compressor:
    """The frozen hand-written compressor ``name`` built with ``params``."""
    classes = _classes()
    if name not in classes:
        raise ValueError(f"no hand-written reference for compressor {name!r}; allowed: {', '.join(HANDWRITTEN)}")
    return classes[name](**params)
