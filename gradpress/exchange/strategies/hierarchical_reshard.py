"""Hierarchical's fold onto another world size or host layout (``Strategy.reshard_fold`` of ``hierarchical``).

What ``hierarchical`` keeps of its layout (:mod:`~gradpress.exchange.strategies.hierarchical`): the
saved ``workers_per_host`` L (hosts of L consecutive ranks, H = N / L, leaders the ranks ``h L``), and on
each leader its host residuals ``e_h`` (``host/<key>``) and the compressor's state (only leaders encode).
Workers' own residuals are zero (their values enter the host sum exactly).

The fold. Leader ``h`` sends ``C(q_h)`` with ``q_h = m_h + e_h`` (``m_h``: its host mean) and keeps
``e_h' = q_h - C(q_h)``; the average the hosts apply is

    (1/H) sum_h C(q_h) = (1/H) sum_h m_h + E - E',    E = (1/H) sum_h e_h,

so over steps the applied updates sum to the true means plus ``E_0 - E_T``: the additive quantity the
run owes is ``E``, the *mean over hosts* of the host residuals (not a host's own, nor a sum over
ranks). A new layout of H' hosts keeps it when its hosts' residuals have mean ``E``; the fold gives every
new host the same ``E`` (the float64 mean over the H saved leaders, cast back), so
``(1/H') sum_h' E = E`` for any H' and L': 2 hosts x 2 -> 1 x 2 (one host: the leader sends ``E`` once in
full with the exact mean, nothing is lost), 2 x 2 -> 2 x 1, 4 x 1 -> 2 x 2, 2 x 2 -> 3 x 1 alike. The
compressor's state folds the same way over the saved leaders only (equal: kept, PowerSGD's Q; differing
floats: the mean, DGC's momentum; the rest refused). The new layout is the new run's own (its spec or
environment), unknown to the fold: every new rank gets the fold, and only the new leaders read it (a
non-leader never reads ``host/``: its copy is dead weight until the run's next reshard, which reads the
saved leaders only). The workers' own residuals fold by the generic rule.

Refused: an outer ``ring`` that holds hop state (its ``ring/`` residuals or compressor state under a hop
key on some saved leader: a ring of H leaders' chunk positions; a summable compressor or error feedback
off holds none), and a saved layout that does not divide the saved world.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gradpress.exchange.keys import split_key
from gradpress.exchange.reshard import Fold, fold_leaves, refuse

__all__ = ["fold_hosts", "FOLDS"]

#: the layouts that fold, as a refusal names them
FOLDS = ("every host layout folds (each new host starts from the mean of the saved hosts' residuals) when the "
         "leaders exchange by collective, allreduce, allgather, or a ring that holds no hop state (a summable "
         "compressor, or error feedback off)")


def fold_hosts(saved: list[Mapping[str, Any]], at: Fold,
               name: str = "hierarchical") -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(the N saved engine states without the hosts' part, the hosts' part of new rank ``at.rank``): the
    ``host/`` residuals and the compressor state folded over the saved leaders, and the strategy state
    without the saved ``workers_per_host`` (the new run's layout is its own). ``name``: the strategy's key in
    the engine state (``hierarchical:workers_per_host=2``). ValueError (:func:`refuse`) as the module
    docstring says."""
    from gradpress.exchange.strategies.hierarchical import HOST
    from gradpress.exchange.strategies.ring import Ring

    where = at.at("strategies").at(name, f"strategy {name!r}")
    own = [(v.get("strategies") or {}).get(name) or {} for v in saved]
    n, per = len(saved), own[0].get("workers_per_host")
    if any(st.get("workers_per_host") != per for st in own) or isinstance(per, bool) or not isinstance(per, int) \
            or per < 1 or n % per:
        raise refuse(saved, where, f"saved layouts {[st.get('workers_per_host') for st in own]} (workers_per_host) "
                                   f"do not cut the saved {n} ranks into equal hosts")
    leaders = list(range(0, n, per))
    for r in leaders:
        held = Ring.reshard_held(saved[r])
        if held is not None:
            raise refuse(saved, where, f"its leaders' ring of {n // per} host(s) keeps per-hop state (saved rank "
                                       f"{r} holds {held}); {FOLDS}")
    rest: list[dict[str, Any]] = []
    hosts: list[dict[str, Any]] = []
    for v in saved:
        mine = dict(v)
        mine["strategies"] = {k: s for k, s in (v.get("strategies") or {}).items() if k != name}
        fb = v.get("feedback")
        if isinstance(fb, Mapping) and isinstance(fb.get("residuals"), Mapping):
            parts = {k: isinstance(k, str) and split_key(k)[0] == HOST for k in fb["residuals"]}
            mine["feedback"] = {**fb, "residuals": {k: t for k, t in fb["residuals"].items() if not parts[k]}}
            hosts.append({k: t for k, t in fb["residuals"].items() if parts[k]})
        else:
            hosts.append({})
        if "compressor" in v:
            mine["compressor"] = {}  # only the leaders' is folded (below)
        rest.append(mine)
    state = {k: val for k, val in own[0].items() if k != "workers_per_host"}
    placed: dict[str, Any] = {"strategies": {name: state}}
    folded = fold_leaves([hosts[r] for r in leaders], at.at("feedback").at("residuals", "host residuals"))
    if folded:
        placed["feedback"] = {"residuals": folded}
    if "compressor" in saved[0]:
        placed["compressor"] = fold_leaves([saved[r]["compressor"] for r in leaders],
                                           at.at("compressor", "compressor state of the saved leaders"))
    return rest, placed
