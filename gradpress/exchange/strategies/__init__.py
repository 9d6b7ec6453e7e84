"""The strategies: how compressed tensors travel between ranks.

One file per strategy, registered with
:func:`gradpress.exchange.base.register_strategy`; adding a file here is all
a new strategy needs (its traits ``order``, ``general``, ``planned`` place it
in the engine's fixed exchange order and among the planner's candidates).
Shared pieces: :mod:`.rounds` (multi-round protocols inside allreduce) and
:mod:`.recompress` (re-compression on the way: ring hops, PS roots).
"""
