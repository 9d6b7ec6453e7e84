"""Resharding the parameter server's and hierarchical's state (``Strategy.reshard_fold``:
``gradpress.exchange.strategies.ps_reshard``, ``hierarchical_reshard``) without workers, against
references computed here from the saved per-rank states:

* ``ps``: key ``i`` (in order of first appearance) is rooted on saved rank ``i % N`` and on new rank
  ``i % M``; each root residual (``root/<key>#ps``) and each root compressor state (``<key>#ps``) is the
  saved root's tensor, on the new root only, every key's exactly once over the new world (the server's
  owed error kept whole: no mean); the workers' own residuals and compressor state the float64 mean; the
  new ``roots``/``next_root``; refusals (ranks that disagree on the roots, a root residual on a rank that
  is not its key's root, a root residual in a world of one);
* ``hierarchical``: every new rank gets the float64 mean over the saved *leaders* of the ``host/``
  residuals (a stale copy on a non-leader ignored) and of the compressor state, so the mean over any new
  hosts of their residuals is the saved hosts' mean (the error the average owes); the saved
  ``workers_per_host`` dropped from the folded strategy state; refusals (an outer ring holding hop state,
  naming the layouts that fold; a layout that does not divide the saved world).

No workers; about 2 s. The end-to-end runs are in test_reshard_train.py."""

from __future__ import annotations

import pytest
import torch

from gradpress.exchange.reshard import fold
from gradpress.exchange.state import STATE_FORMAT

KEYS = ["a", "b%2Fx#0", "b%2Fx#1", "c"]  # exchanged keys in order of first appearance (a partitioned, escaped one)
WHOLE = {"a": "a", "b%2Fx#0": "b%2Fx", "b%2Fx#1": "b%2Fx", "c": "c"}  # a worker residual is per whole tensor


def _mean64(tensors):
    total = torch.zeros(tensors[0].shape, dtype=torch.float64)
    for t in tensors:
        total = total + t.double()
    return total / len(tensors)


def _engine(rank, world, strategy, residuals, compressor, own):
    return {"format": STATE_FORMAT,
            "config": {"compressor": "topk:ratio=0.05", "strategy": strategy, "world_size": world, "seed": 0},
            "feedback": {"beta": 1.0, "gamma": 1.0, "residuals": residuals}, "compressor": compressor,
            "strategies": {strategy: own}, "plan": None, "stats": {"bytes_sent": 7 * rank}, "rank": rank,
            "keys": "escaped/1"}


def _ps_saved(n, seed=0):
    """N saved ranks of a ps run: key i rooted on rank i % n (its root residual and root momentum there
    only), every rank with its own worker residuals and worker momentum."""
    g = torch.Generator().manual_seed(seed)
    saved = []
    for r in range(n):
        residuals = {w: torch.randn(3, generator=g) for w in sorted(set(WHOLE.values()))}
        momentum = {w: torch.randn(3, generator=g) for w in sorted(set(WHOLE.values()))}
        for i, k in enumerate(KEYS):
            if i % n == r:
                residuals[f"root/{k}#ps"] = torch.randn(2, generator=g) * (i + 1)
                momentum[f"{k}#ps"] = torch.randn(2, generator=g)
        saved.append(_engine(r, n, "ps", residuals, {"momentum": momentum, "steps": 5},
                             {"roots": {k: i % n for i, k in enumerate(KEYS)}, "next_root": len(KEYS)}))
    return saved


@pytest.mark.parametrize("n, m", [(4, 2), (2, 4), (4, 3), (3, 5), (1, 2), (2, 1)])
def test_ps_roots_take_the_saved_roots_residual_onto_the_new_root(n, m):
    saved = _ps_saved(n)
    if m == 1:  # a world of one has no server: only root-residual-free states fold (test below)
        for s in saved:
            s["feedback"]["residuals"] = {k: v for k, v in s["feedback"]["residuals"].items() if "/" not in k}
    news = [fold(saved, r, m) for r in range(m)]
    total_root = {}
    for r, out in enumerate(news):
        assert out["rank"] == r and out["config"]["world_size"] == m and out["stats"] == saved[0]["stats"]
        assert out["strategies"]["ps"] == {"roots": {k: i % m for i, k in enumerate(KEYS)}, "next_root": len(KEYS)}
        res, mom = out["feedback"]["residuals"], out["compressor"]["momentum"]
        for w in set(WHOLE.values()):  # the workers' own: the float64 mean of every saved rank's, cast back
            assert torch.equal(res[w], _mean64([s["feedback"]["residuals"][w] for s in saved]).float()), w
            assert torch.equal(mom[w], _mean64([s["compressor"]["momentum"][w] for s in saved]).float()), w
        assert out["compressor"]["steps"] == 5
        mine = [k for i, k in enumerate(KEYS) if i % m == r]
        want_res = {f"root/{k}#ps": saved[i % n]["feedback"]["residuals"].get(f"root/{k}#ps")
                    for i, k in enumerate(KEYS) if i % m == r}
        got_res = {k: v for k, v in res.items() if k.startswith("root/")}
        if m > 1:
            assert set(got_res) == set(want_res)
            for k, t in got_res.items():  # the saved root's tensor: bitwise, not a mean
                assert torch.equal(t, want_res[k]), k
                total_root[k] = t
        want_mom = {f"{k}#ps": saved[KEYS.index(k) % n]["compressor"]["momentum"][f"{k}#ps"] for k in mine}
        assert {k: v for k, v in mom.items() if k.endswith("#ps")}.keys() == want_mom.keys()
        for k, t in want_mom.items():
            assert torch.equal(mom[k], t), k
    if m > 1:  # every key's root residual exactly once over the new world: the server owes what it owed
        assert sorted(total_root) == sorted(f"root/{k}#ps" for k in KEYS)


def test_ps_keeps_each_root_residual_where_it_is_on_the_same_world():
    """N -> N: the fold gives every rank its own root residuals back (the assignment is the same)."""
    saved = _ps_saved(3)
    for r in range(3):
        out = fold(saved, r, 3)
        for k, t in saved[r]["feedback"]["residuals"].items():
            if k.startswith("root/"):
                assert torch.equal(out["feedback"]["residuals"][k], t)
        assert sum(k.startswith("root/") for k in out["feedback"]["residuals"]) == sum(
            k.startswith("root/") for k in saved[r]["feedback"]["residuals"])


def test_ps_refusals_name_the_strategy_and_what_is_wrong():
    saved = _ps_saved(2)
    saved[1]["strategies"]["ps"] = {"roots": {k: (i + 1) % 2 for i, k in enumerate(KEYS)}, "next_root": 4}
    with pytest.raises(ValueError, match=r"/strategies/ps \(strategy 'ps'\): saved ranks 0 and 1 assigned "
                                         r"different roots; resume on the checkpoint's 2"):
        fold(saved, 0, 3)
    saved = _ps_saved(2)
    moved = saved[0]["feedback"]["residuals"].pop("root/a#ps")
    saved[1]["feedback"]["residuals"]["root/a#ps"] = moved
    with pytest.raises(ValueError, match=r"saved rank 1 holds the root residual 'root/a#ps' of 'a', whose root "
                                         r"\(saved rank 0\) does not"):
        fold(saved, 0, 3)
    saved = _ps_saved(2)
    with pytest.raises(ValueError, match=r"2 rank\(s\) into 1: /strategies/ps .*a world of one rank has no server"):
        fold(saved, 0, 1)
    saved = _ps_saved(2)
    saved[0]["compressor"]["momentum"]["z#ps"] = torch.zeros(2)
    with pytest.raises(ValueError, match=r"saved rank 0 holds compressor state 'momentum/z#ps' of 'z', a key "
                                         r"without a root"):
        fold(saved, 0, 3)


# ------------------------------------------------------------------ hierarchical
def _hier_saved(n, per, seed=0, outer="collective"):
    """N saved ranks of hosts of ``per``: host residuals and compressor state on the leaders (a stale host
    residual on rank 1 too, as a non-leader keeps after an earlier fold), zero worker residuals."""
    g = torch.Generator().manual_seed(seed)
    saved = []
    for r in range(n):
        residuals = {"w": torch.zeros(4), "v": torch.zeros(2, 2)}
        compressor = {}
        if r % per == 0:
            residuals.update({"host/w": torch.randn(4, generator=g) * 5, "host/v": torch.randn(2, 2, generator=g)})
            compressor = {"momentum": {"w": torch.randn(4, generator=g)}, "q": {"v": torch.ones(2, 1)}}
        elif r == 1:
            residuals["host/w"], residuals["host/v"] = torch.full((4,), 1e6), torch.full((2, 2), 1e6)
        # the engine keys a strategy by its spec's parameters (strategy_key): found by its name's head
        saved.append(_engine(r, n, f"hierarchical:workers_per_host={per}", residuals, compressor,
                             {"workers_per_host": per, "outer": outer}))
    return saved


@pytest.mark.parametrize("n, per, m", [(4, 2, 2), (4, 2, 4), (4, 1, 2), (4, 2, 3), (2, 2, 4), (6, 3, 1)])
def test_hierarchical_gives_every_new_rank_the_mean_of_the_saved_hosts(n, per, m):
    """2 x 2 -> 1 x 2 (or 2 x 1), 2 x 2 -> 4 ranks, 4 x 1 -> 2, 2 x 2 -> 3, 1 x 2 -> 4, 2 x 3 -> 1: the
    float64 mean over the saved leaders only (ranks 0, per, 2 per, ...), whatever the new layout, so any
    new hosts' mean residual is the saved hosts' mean."""
    saved = _hier_saved(n, per)
    leaders = list(range(0, n, per))
    want = {k: _mean64([saved[r]["feedback"]["residuals"][k] for r in leaders]).float() for k in ("host/w", "host/v")}
    want_mom = _mean64([saved[r]["compressor"]["momentum"]["w"] for r in leaders]).float()
    for r in range(m):
        out = fold(saved, r, m)
        # the new layout is the run's own
        assert out["strategies"] == {f"hierarchical:workers_per_host={per}": {"outer": "collective"}}
        assert out["config"]["world_size"] == m and out["rank"] == r
        for k, t in want.items():
            assert torch.equal(out["feedback"]["residuals"][k], t), k
        assert torch.equal(out["feedback"]["residuals"]["w"], torch.zeros(4))
        assert torch.equal(out["compressor"]["momentum"]["w"], want_mom)
        assert out["compressor"]["q"]["v"] is saved[0]["compressor"]["q"]["v"]  # equal on the leaders: kept
    # the owed error: the mean over new hosts (every new rank could lead one) equals the mean over saved hosts
    for k in want:
        new_hosts = [fold(saved, r, m)["feedback"]["residuals"][k] for r in range(m)]
        torch.testing.assert_close(_mean64(new_hosts), _mean64([saved[r]["feedback"]["residuals"][k]
                                                                for r in leaders]), rtol=1e-6, atol=1e-6)


def test_hierarchical_refuses_an_outer_ring_holding_hop_state_naming_the_layouts_that_fold():
    saved = _hier_saved(4, 2, outer="ring")
    saved[2]["feedback"]["residuals"]["ring/w"] = torch.ones(4)
    with pytest.raises(ValueError) as info:
        fold(saved, 0, 2)
    text = str(info.value)
    assert ("/strategies/hierarchical:workers_per_host=2 (strategy 'hierarchical:workers_per_host=2'): its leaders' "
            "ring of 2 host(s) keeps per-hop") in text
    assert "saved rank 2 holds residual 'ring/w'" in text
    assert "every host layout folds" in text and "a ring that holds no hop state" in text
    saved[2]["feedback"]["residuals"].pop("ring/w")  # a ring holding nothing folds
    assert torch.equal(fold(saved, 1, 2)["feedback"]["residuals"]["host/w"],
                       _mean64([saved[0]["feedback"]["residuals"]["host/w"],
                                saved[2]["feedback"]["residuals"]["host/w"]]).float())
    bad = _hier_saved(4, 2)
    bad[3]["strategies"]["hierarchical:workers_per_host=2"]["workers_per_host"] = 4
    with pytest.raises(ValueError, match=r"saved layouts \[2, 2, 2, 4\] \(workers_per_host\) do not cut"):
        fold(bad, 0, 2)
