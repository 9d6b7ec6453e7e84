"""The parameter server's fold onto another world size (``Strategy.reshard_fold`` of ``ps``).

What ``ps`` keeps of its world (:mod:`~gradpress.exchange.strategies.ps`):

* ``roots``: each exchanged key's root rank, assigned round robin in order of
  first appearance (key ``i`` on rank ``i % N``) and the same on every rank;
  ``next_root``, the count of keys assigned so far;
* the roots' re-compression residuals (store keys ``root/<key>#ps``, a
  non-summable compressor with error feedback) and a stateful compressor's
  state under a root's context key (``<key>#ps``): on the key's root only.

A root residual is the server's own state, the error it still owes the
*average*: the update it sends is ``C(avg + e) = avg + e - e'``, so summed
over steps the average owes ``e``, once, whichever rank holds it. It is not
per-worker state and has no mean: the fold takes it from the key's saved root
and puts it, unchanged, on the key's root in the new world, so the server
still owes exactly ``e``. The new roots follow the same rule over the same
keys in the same order (key ``i`` on new rank ``i % M``, ``next_root``
kept), carried in the folded ``roots``: the new run loads them, and keys it
meets first later continue the round robin where it stopped. Everything else
(the workers' own residuals, compressor state under a worker's key) folds by
the generic rule (:mod:`gradpress.exchange.reshard`: the mean, which keeps
``sum / world`` of additive per-worker state).

Refused: saved ranks that disagree on the roots, a root outside the saved
world, a root residual or root compressor state of a key without a root (or
missing on its root while another rank holds it), and a new world of one
rank that would have to hold a root residual (one rank has no server: the
exchange never re-encodes, and the owed error would be lost).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gradpress.exchange.keys import root_key, split_key
from gradpress.exchange.reshard import Fold, refuse

__all__ = ["fold_roots"]

_SUFFIX = root_key("")  # "#ps": a root's context key is the exchanged key and this


def _strip(tree: Any, path: tuple[str, ...], found: list[tuple[tuple[str, ...], str, Any]]) -> Any:
    """``tree`` without the entries under a root context key (``...#ps``), at any depth of nested
    mappings, each recorded in ``found`` as (path of the mapping, key, value)."""
    if not isinstance(tree, Mapping):
        return tree
    out = {}
    for key, value in tree.items():
        if isinstance(key, str) and key.endswith(_SUFFIX):
            found.append((path, key, value))
        else:
            out[key] = _strip(value, (*path, str(key)), found)
    return out


def _put(tree: dict[str, Any], path: tuple[str, ...], key: str, value: Any) -> None:
    for part in path:
        tree = tree.setdefault(part, {})
    tree[key] = value


def fold_roots(saved: list[Mapping[str, Any]], at: Fold, name: str = "ps") -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(the N saved engine states without the server's part, the server's part of new rank ``at.rank``):
    the new ``roots`` and ``next_root``, and the root residuals and root compressor state of the keys
    whose new root is ``at.rank``, each the saved root's own. ValueError (:func:`refuse`) as the module
    docstring says."""
    from gradpress.exchange.strategies.ps import ROOT

    where = at.at("strategies").at(name, f"strategy {name!r}")
    own = [(v.get("strategies") or {}).get(name) or {} for v in saved]
    roots = dict(own[0].get("roots") or {})
    n = len(saved)
    for r, st in enumerate(own):
        if list((st.get("roots") or {}).items()) != list(roots.items()) or st.get("next_root") != own[0].get(
                "next_root"):
            raise refuse(saved, where, f"saved ranks 0 and {r} assigned different roots")
    bad = [k for k, root in roots.items() if isinstance(root, bool) or not isinstance(root, int) or not 0 <= root < n]
    if bad:
        raise refuse(saved, where, f"key {bad[0]!r} has root {roots[bad[0]]!r}, not a rank of the saved {n}")
    order = list(roots)
    new_roots = {k: i % at.world for i, k in enumerate(order)}
    placed: dict[str, Any] = {"strategies": {name: {"roots": new_roots,
                                                      "next_root": int(own[0].get("next_root", len(order)))}}}

    def owner(key: str, what: str, holders: list[int]) -> int:
        base = key[: -len(_SUFFIX)]
        if base not in roots:
            raise refuse(saved, where, f"saved rank {holders[0]} holds {what} of {base!r}, a key without a root")
        if roots[base] not in holders:
            raise refuse(saved, where, f"saved rank {holders[0]} holds {what} of {base!r}, whose root "
                                       f"(saved rank {roots[base]}) does not")
        return roots[base]

    rest = []
    residuals: dict[str, list[int]] = {}
    stripped: list[list[tuple[tuple[str, ...], str, Any]]] = []
    for r, v in enumerate(saved):
        fb = v.get("feedback")
        mine = dict(v)
        mine["strategies"] = {k: s for k, s in (v.get("strategies") or {}).items() if k != name}
        if isinstance(fb, Mapping) and isinstance(fb.get("residuals"), Mapping):
            keep = {}
            for k, t in fb["residuals"].items():
                if isinstance(k, str) and split_key(k)[0] == ROOT:
                    residuals.setdefault(k, []).append(r)
                else:
                    keep[k] = t
            mine["feedback"] = {**fb, "residuals": keep}
        found: list[tuple[tuple[str, ...], str, Any]] = []
        if "compressor" in v:
            mine["compressor"] = _strip(v["compressor"], (), found)
        stripped.append(found)
        rest.append(mine)
    for k, holders in residuals.items():
        root = owner(split_key(k)[1], f"the root residual {k!r}", holders)
        if new_roots[split_key(k)[1][: -len(_SUFFIX)]] == at.rank:
            if at.world == 1:
                raise refuse(saved, where, f"saved rank {root} holds the root residual {k!r}: a world of one "
                                           "rank has no server to send it, and the error it owes would be lost")
            _put(placed, ("feedback", "residuals"), k, saved[root]["feedback"]["residuals"][k])
    holders_of: dict[tuple[tuple[str, ...], str], list[int]] = {}
    for r, found in enumerate(stripped):
        for path, key, _ in found:
            holders_of.setdefault((path, key), []).append(r)
    for (path, key), holders in holders_of.items():
        root = owner(key, f"compressor state {'/'.join((*path, key))!r}", holders)
        if new_roots[key[: -len(_SUFFIX)]] == at.rank:
            value = next(val for p, k, val in stripped[root] if (p, k) == (path, key))
            _put(placed, ("compressor", *path), key, value)
    return rest, placed
