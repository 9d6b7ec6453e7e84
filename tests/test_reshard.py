"""Resharding (``gradpress.exchange.reshard``, ``gradpress.train.reshard``,
``gradpress.ddp.ranks``) without workers: the fold of N saved per-rank
states into one of M against references computed here (float64 means by
the formula, replicated leaves kept bitwise, dtypes kept), its refusals
naming the key path and the piece (integers that differ, shapes, keys, the
ring strategy, leader SGD; ps and hierarchical fold, test_reshard_strategies.py; a ring is refused only by
what a saved rank holds of its world size: a hop residual, compressor state
under a hop key, ring state; one holding none folds; SGP's copies onto a graph of other offsets), a hypothesis property
(the folded residuals' mean over the M new ranks is the N saved ranks' mean,
N and M in 1..5), the train checkpoint's checks (the refusal without
``--reshard`` names both world sizes, the flag and the global batch;
mid-epoch and non-IID checkpoints refused; ``--reshard`` only with
``--resume``), the learning-rate shift (in the loop too), the frameworks'
``rank_entry`` and the option of the Lightning, Accelerate and Trainer
integrations, and ``reshard`` in a --config file (train: yes; compare:
refused). No workers; 25 s at load 8 on the shared 2-core machine (11 s of
it importing Lightning and Transformers). The end-to-end runs are in
test_reshard_train.py."""

from __future__ import annotations

import math
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradpress.algorithms.base import STATE_FORMAT as ALGO_FORMAT
from gradpress.ddp.ranks import RANKS_FORMAT, rank_entry
from gradpress.ddp.state_format import HOOK_FORMAT
from gradpress.exchange.reshard import fold
from gradpress.exchange.state import STATE_FORMAT
from gradpress.train import checkpoint, reshard
from gradpress.train.config import make_config


def _mean64(tensors):
    """The float64 mean by the formula: sum of the float64 values / N."""
    total = torch.zeros(tensors[0].shape, dtype=torch.float64)
    for t in tensors:
        total = total + t.double()
    return total / len(tensors)


def _ranks(n, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    shared_q = torch.randn(4, 2, generator=g)
    out = []
    for _ in range(n):
        out.append({
            "residuals": {"w": (torch.randn(3, 5, generator=g) * 3).to(dtype), "b": torch.randn(7, generator=g)},
            "q": shared_q.clone(),
            "steps": 12,
            "name": "topk",
            "per_tensor": [torch.randn(2, generator=g), 1.5],
            "scale": float(torch.rand((), generator=g)),
        })
    return out


def test_fold_means_differing_floats_in_float64_and_keeps_replicated_leaves():
    saved = _ranks(3)
    for rank in range(2):
        out = fold(saved, rank, 2)
        for key in ("w", "b"):
            want = _mean64([s["residuals"][key] for s in saved]).to(torch.float32)
            got = out["residuals"][key]
            assert got.dtype == torch.float32 and torch.equal(got, want), key
        assert torch.equal(out["per_tensor"][0], _mean64([s["per_tensor"][0] for s in saved]).float())
        assert out["per_tensor"][1] == 1.5 and out["steps"] == 12 and out["name"] == "topk"
        assert out["scale"] == pytest.approx(sum(s["scale"] for s in saved) / 3, abs=1e-15)
        assert out["q"] is saved[0]["q"]  # equal on every rank: the saved tensor itself, untouched
    # nothing saved was changed in place
    again = _ranks(3)
    assert all(torch.equal(a["residuals"]["w"], b["residuals"]["w"]) for a, b in zip(saved, again))


def test_fold_casts_back_to_a_half_leaf_from_the_float64_mean():
    """fp16 residuals: the mean is taken in float64 (an fp16 sum of 4 large
    values would overflow) and cast back once."""
    saved = [{"r": torch.full((5,), v, dtype=torch.float16)} for v in (60000.0, 60000.0, 50000.0, 58000.0)]
    out = fold(saved, 0, 3)["r"]
    assert out.dtype == torch.float16
    want = torch.full((5,), (60000.0 + 60000.0 + 50000.0 + 58000.0) / 4, dtype=torch.float64).half()
    assert torch.equal(out, want) and torch.isfinite(out).all()


def test_one_saved_rank_is_copied_to_every_new_rank():
    saved = _ranks(1)
    for rank in range(4):
        out = fold(saved, rank, 4)
        assert torch.equal(out["residuals"]["w"], saved[0]["residuals"]["w"])


@pytest.mark.parametrize("change, path", [
    (lambda s: s.update(steps=13), "/steps"),
    (lambda s: s.update(name="dgc"), "/name"),
    (lambda s: s["residuals"].update(w=torch.zeros(3, 6)), "/residuals/w"),
    (lambda s: s["residuals"].update(idx=torch.tensor([1, 2])), "/residuals"),
    (lambda s: s.update(per_tensor=[torch.zeros(2)]), "/per_tensor"),
    (lambda s: s["residuals"].update(b=torch.arange(7)), "/residuals/b"),
])
def test_fold_refuses_what_has_no_mean_naming_the_key_path(change, path):
    saved = _ranks(3)
    change(saved[1])
    with pytest.raises(ValueError) as info:
        fold(saved, 0, 2, owner="compressor 'x'")
    msg = str(info.value)
    assert f"{path} (compressor 'x')" in msg and "3 rank(s) into 2" in msg
    assert "resume on the checkpoint's 3 worker(s)" in msg


def test_engine_refusals_name_the_piece_that_owns_the_key():
    """In the engine's state a refusal names its owner: the error feedback of the compressor for a residual,
    the compressor for its state, plain ``state`` for another part (written for the survivors of ``make
    mutants``: ``key == "feedback"`` -> ``key is not "feedback"`` passed every test)."""
    def saved(part):
        out = [_engine(r, 2, residual=torch.zeros(4)) for r in range(2)]
        part(out[1])
        return out

    cases = [
        (lambda s: s["feedback"]["residuals"].update(w=torch.zeros(5)),
         "/feedback/residuals/w (error feedback of compressor 'topk:ratio=0.05')"),
        (lambda s: s.update(compressor={"count": 3}), "/compressor (compressor 'topk:ratio=0.05')"),
        (lambda s: s.update(plan={"w": 3}), "/plan (state)"),
    ]
    for part, named in cases:
        with pytest.raises(ValueError) as info:
            fold(saved(part), 0, 3)
        assert named in str(info.value), (named, str(info.value))


def test_a_refusal_shows_the_first_four_values():
    """Integers that differ on 6 saved ranks: the message lists the first four and "..." (survivor of ``make
    mutants``: ``vals[:4]`` -> ``vals[:5]``)."""
    with pytest.raises(ValueError) as info:
        fold([{"n": r} for r in range(6)], 0, 2)
    assert "values differ between saved ranks (0, 1, 2, 3, ...)" in str(info.value), str(info.value)


def test_integer_tensors_that_differ_are_refused():
    saved = [{"count": torch.tensor([1, 2])}, {"count": torch.tensor([1, 3])}]
    with pytest.raises(ValueError, match=r"/count .*torch.int64 tensor that differs"):
        fold(saved, 0, 1)


def test_fold_checks_rank_and_world():
    with pytest.raises(ValueError, match="rank must be an integer from 0 to 1"):
        fold(_ranks(2), 2, 2)
    with pytest.raises(ValueError, match="world must be an integer >= 1"):
        fold(_ranks(2), 0, 0)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 5), m=st.integers(1, 5), seed=st.integers(0, 2**31 - 1),
       shape=st.lists(st.integers(1, 4), min_size=1, max_size=3))
def test_folded_residuals_keep_the_saved_mean(n, m, seed, shape):
    """sum_new / M == sum_old / N, residual by residual (float32 tolerance)."""
    g = torch.Generator().manual_seed(seed)
    saved = [{"feedback": {"residuals": {"w": torch.randn(*shape, generator=g) * 10}}} for _ in range(n)]
    new = [fold(saved, r, m)["feedback"]["residuals"]["w"] for r in range(m)]
    want = _mean64([s["feedback"]["residuals"]["w"] for s in saved])
    assert all(t.dtype == torch.float32 for t in new)
    torch.testing.assert_close(_mean64(new), want, rtol=1e-6, atol=1e-6)


def _engine(rank, world, strategy="allgather", residual=None, stats_bytes=0):
    return {
        "format": STATE_FORMAT,
        "config": {"compressor": "topk:ratio=0.05", "strategy": strategy, "world_size": world, "seed": 0},
        "feedback": {"beta": 1.0, "gamma": 1.0, "residuals": {} if residual is None else {"w": residual}},
        "compressor": {}, "strategies": {strategy: {}}, "plan": None,
        "stats": {"bytes_sent": stats_bytes, "comm_s": 0.1 * (rank + 1)}, "rank": rank, "keys": "escaped/1",
    }


def test_engine_state_gets_the_new_world_and_rank_and_rank_0s_counters():
    res = [torch.randn(6) for _ in range(4)]
    saved = [_engine(r, 4, residual=res[r], stats_bytes=100 + r) for r in range(4)]
    for rank in range(2):
        out = fold(saved, rank, 2)
        assert out["rank"] == rank and out["config"]["world_size"] == 2 and out["format"] == STATE_FORMAT
        assert out["stats"] == saved[0]["stats"]
        assert torch.equal(out["feedback"]["residuals"]["w"], _mean64(res).float())
    # the hook's format folds by the same rule (its step, layout and loss scale kept)
    hooks = [{**s, "format": HOOK_FORMAT, "step": 9, "layout": "parameter", "loss_scale": None} for s in saved]
    out = fold(hooks, 1, 3)
    assert (out["rank"], out["config"]["world_size"], out["step"]) == (1, 3, 9)


def test_strategies_cut_by_the_world_size_are_refused_by_name():
    """The ring with a hop residual (a non-summable compressor with error feedback) on rank 1. ``ps`` and
    ``hierarchical`` fold their own state (test_reshard_strategies.py)."""
    saved = [_engine(r, 2, "ring") for r in range(2)]
    saved[1]["feedback"]["residuals"]["ring/w"] = torch.ones(3)
    with pytest.raises(ValueError, match=r"/strategies/ring \(strategy 'ring'\): its "):
        fold(saved, 0, 3)


def test_a_ring_that_holds_nothing_of_its_world_size_folds():
    """A ring checkpoint of a summable compressor, or error feedback off: no hop residual (ring/), no ring
    state, no compressor state under a hop key. It folds by the generic rule (the worker residual: the float64
    mean by the formula), onto a larger and a smaller world."""
    res = [torch.randn(6, generator=torch.Generator().manual_seed(r)) for r in range(3)]
    saved = [_engine(r, 3, "ring", residual=res[r]) for r in range(3)]
    for world in (2, 5):
        for rank in range(world):
            out = fold(saved, rank, world)
            assert out["rank"] == rank and out["config"]["world_size"] == world
            assert out["config"]["strategy"] == "ring" and out["strategies"] == {"ring": {}}
            assert torch.equal(out["feedback"]["residuals"]["w"], _mean64(res).float())


@pytest.mark.parametrize("where", ["hop residual", "compressor state", "ring state"])
def test_a_ring_that_holds_state_of_its_world_size_is_refused_naming_it(where):
    """Any one piece of world-size dependent ring state refuses the fold, naming the first saved rank that
    holds it and the piece: a hop residual or ring state on rank 2 only; compressor state under a hop's key on
    every rank (floats that differ: the generic rule alone would average them)."""
    saved = [_engine(r, 3, "ring", residual=torch.zeros(6)) for r in range(3)]
    rank = 2
    if where == "hop residual":
        saved[2]["feedback"]["residuals"]["ring/w"], named = torch.ones(6), "residual 'ring/w'"
    elif where == "compressor state":  # a stateful compressor's state under a hop's key (keys.hop_key)
        for r, s in enumerate(saved):
            s["compressor"] = {"momentum": {"w#ring1": torch.full((2,), float(r))}}
        named, rank = "compressor state of 'w#ring1'", 0
    else:
        saved[2]["strategies"]["ring"] = {"residuals": {}}
        named = "ring state ['residuals']"
    with pytest.raises(ValueError, match=r"/strategies/ring \(strategy 'ring'\): its per-hop residuals .*: saved "
                                         rf"rank {rank} holds {re.escape(named)}; resume on the checkpoint's 3"):
        fold(saved, 0, 2)


def test_algorithm_state_refusal_names_the_algorithm():
    def algo(rank, name):
        return {"format": ALGO_FORMAT, "config": {"algorithm": name, "world_size": 2}, "steps": 4, "exchanges": 1,
                "exchange": _engine(rank, 2), "extra": {"x": torch.full((2,), float(rank))}}

    with pytest.raises(ValueError, match=r"/extra \(algorithm 'lsgd:tau=4'\): its leaders are ranks"):
        fold([algo(r, "lsgd:tau=4") for r in range(2)], 0, 4)
    out = fold([algo(r, "localsgd:period=2") for r in range(2)], 3, 4)
    assert out["config"]["world_size"] == 4 and out["exchange"]["config"]["world_size"] == 4
    assert out["exchange"]["rank"] == 3 and torch.equal(out["extra"]["x"], torch.full((2,), 0.5))


def _sgp(rank, world, offsets, compressed=True):
    """SGP's state as it saves it: per-offset public copies (``out_copy``/``in_copy``) only when it compresses."""
    copies = {str(o): [torch.full((3,), float(rank + o))] for o in offsets} if compressed else {}
    return {"format": ALGO_FORMAT, "config": {"algorithm": "sgp:peers=1,overlap=0,gamma=1.0", "world_size": world},
            "steps": 4, "exchanges": 4, "exchange": _engine(rank, world),
            "extra": {"x": [torch.full((3,), float(rank))], "w": torch.tensor(1.0 + rank, dtype=torch.float64),
                      "out_copy": copies, "in_copy": copies, "inflight": []}}


def test_sgp_copies_fold_only_onto_a_graph_of_the_same_offsets():
    """The exponential graph has offsets [1, 2] on 3 or 4 workers, [1] on 2, [1, 2, 4] on 5..8: SGP's copies per
    offset fold onto the same offsets (4 -> 3: every copy the float64 mean), and are refused, naming the
    algorithm, both offset lists and the sizes that keep them, onto others (4 -> 2 loaded the fold and failed
    in the workers: 'out_copy has offsets ['1', '2'], this run [1]'). Uncompressed there are no copies: 4 -> 2
    folds."""
    saved = [_sgp(r, 4, [1, 2]) for r in range(4)]
    out = fold(saved, 2, 3)
    assert sorted(out["extra"]["out_copy"]) == ["1", "2"]
    want = _mean64([torch.full((3,), float(r + 2)) for r in range(4)]).float()
    assert torch.equal(out["extra"]["in_copy"]["2"][0], want)
    assert float(out["extra"]["w"]) == 2.5 and out["config"]["world_size"] == 3
    for world in (2, 5):
        with pytest.raises(ValueError) as info:
            fold(saved, 0, world)
        text = str(info.value)
        assert "/extra (algorithm 'sgp:peers=1,overlap=0,gamma=1.0'): its compressed pushes keep a public copy" in text
        assert f"offsets [1, 2] on 4 worker(s), {[1] if world == 2 else [1, 2, 4]} on {world}" in text
        assert "(the same offsets: 3 to 4 workers)" in text
    plain = fold([_sgp(r, 4, [1, 2], compressed=False) for r in range(4)], 1, 2)
    assert plain["extra"]["out_copy"] == {} and float(plain["extra"]["w"]) == 2.5


# ------------------------------------------------------------------ the train checkpoint's checks
def _checkpoint(cfg, world, epoch=1, batch=0, split="iid"):
    return {"format": checkpoint.FORMAT, "config": {**checkpoint.compat(cfg, world), "split": split},
            "epoch": epoch, "batch": batch, "step": 8, "ranks": [{} for _ in range(world)]}


def test_another_world_size_is_refused_naming_both_sizes_and_the_flag(tmp_path):
    cfg = make_config(workload="mnist1d-cnn", batch_size=16, out=str(tmp_path), resume=True)
    with pytest.raises(ValueError) as info:
        checkpoint.check_resume(_checkpoint(cfg, 4), cfg, 2)
    assert ("world_size: checkpoint has 4, this run has 2; pass --reshard to fold the per-rank state into 2 ranks "
            "(the global batch becomes 32)") in str(info.value)
    # with --reshard: passes at an epoch boundary with iid data
    cfg = make_config(workload="mnist1d-cnn", batch_size=16, out=str(tmp_path), resume=True, reshard=True)
    checkpoint.check_resume(_checkpoint(cfg, 4), cfg, 2)
    with pytest.raises(ValueError, match=r"stopped inside epoch 2 \(after batch 3 of it, step 8\)"):
        checkpoint.check_resume(_checkpoint(cfg, 4, batch=3), cfg, 2)
    non_iid = make_config(workload="mnist1d-cnn", batch_size=16, out=str(tmp_path), resume=True, reshard=True,
                          split="labels:k=2")
    with pytest.raises(ValueError, match=r"split 'labels:k=2' deals fixed shards to the checkpoint's 4 workers"):
        checkpoint.check_resume(_checkpoint(non_iid, 4, split="labels:k=2"), non_iid, 2)
    # another change is still refused, world size or not
    with pytest.raises(ValueError, match="seed: checkpoint has 0, this run has 3"):
        checkpoint.check_resume(_checkpoint(cfg, 4), make_config(cfg, seed=3), 2)


def test_reshard_needs_resume(tmp_path):
    with pytest.raises(ValueError, match="reshard: true without resume"):
        make_config(workload="mnist1d-cnn", out=str(tmp_path), reshard=True)
    with pytest.raises(ValueError, match="reshard must be true or false, got 'yes'"):
        make_config(workload="mnist1d-cnn", out=str(tmp_path), resume=True, reshard="yes")


def test_schedule_continues_at_the_fraction_of_epochs_done():
    """4 -> 2 workers after epoch 1 of 3 at step 4 (4 steps per epoch on 4 workers, 8 on 2): the first
    step of the new world has schedule position 1 * 8 = 8 of horizon 24, i.e. a third of the run."""
    done = reshard.reshards({"config": {"world_size": 4}, "ranks": [{}] * 4, "step": 4, "epoch": 1}, 2)
    assert done == [{"from": 4, "to": 2, "step": 4, "epoch": 1}]
    shift = reshard.schedule_shift(done, 8)
    assert 4 + shift == 8
    assert reshard.schedule_shift([], 8) == 0
    # a plain resume of that run's later checkpoint keeps the shift
    later = reshard.reshards({"config": {"world_size": 2}, "ranks": [{}] * 2, "step": 12, "epoch": 2,
                              "reshards": done}, 2)
    assert later == done and 12 + reshard.schedule_shift(later, 8) == 16


# ------------------------------------------------------------------ the frameworks' entry
def test_rank_entry_refuses_another_world_size_unless_resharding():
    res = [torch.randn(5) for _ in range(3)]
    saved = {"format": RANKS_FORMAT, "world_size": 3,
             "ranks": [{**_engine(r, 3, residual=res[r]), "format": HOOK_FORMAT, "step": 2} for r in range(3)]}
    assert rank_entry(saved, 1, 3) is saved["ranks"][1]
    with pytest.raises(ValueError, match=r"where: world_size: the checkpoint has 3, this run has 2; .*pass "
                                         r"GradpressCallback\(reshard=True\) to fold the per-rank state into 2"):
        rank_entry(saved, 0, 2, where="where", option="GradpressCallback(reshard=True)")
    out = rank_entry(saved, 1, 2, reshard=True)
    assert out["rank"] == 1 and out["config"]["world_size"] == 2
    assert torch.equal(out["feedback"]["residuals"]["w"], _mean64(res).float())
    ring = {**saved, "ranks": [{**s, "strategies": {"ring": {}}} for s in saved["ranks"]]}
    assert torch.equal(rank_entry(ring, 0, 2, reshard=True)["feedback"]["residuals"]["w"], _mean64(res).float())
    ring["ranks"][0] = {**ring["ranks"][0], "feedback": {"residuals": {"ring/w": torch.ones(5)}}}  # a hop residual
    with pytest.raises(ValueError, match=r"ckpt: cannot reshard 3 rank\(s\) into 2: .*strategy 'ring'"):
        rank_entry(ring, 0, 2, reshard=True, where="ckpt")


def test_run_steps_puts_the_schedule_at_the_shifted_position():
    """After a reshard the cosine schedule is at (step + shift) / horizon: the loop's lr, recorded before each
    step, against the formula written out here."""
    from gradpress.train.loop import run_steps

    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    class Plain:
        def __init__(self):
            self.model = model

        def step(self):
            opt.step()

    seen = []
    batches = [(1, b, torch.randn(2, 3), torch.randn(2, 1)) for b in range(3)]
    run_steps(Plain(), opt, torch.nn.functional.mse_loss, batches, lr=0.1, schedule="cosine", horizon=24, step=4,
              after=lambda tick: seen.append(opt.param_groups[0]["lr"]), schedule_shift=4)
    want = [0.1 * 0.5 * (1 + math.cos(math.pi * s / 24)) for s in (8, 9, 10)]
    assert seen == pytest.approx(want, rel=1e-12)


def _hook_ranks(n, res):
    return {"format": RANKS_FORMAT, "world_size": n,
            "ranks": [{**_engine(r, n, residual=res[r]), "format": HOOK_FORMAT, "step": 2, "layout": "parameter",
                       "loss_scale": None} for r in range(n)]}


def test_the_integrations_pass_reshard_through(monkeypatch):
    """Lightning's callback and Accelerate's checkpointed hook: refused by default naming their own option,
    folded with ``reshard=True`` (the unbound hook keeps the folded state until it binds)."""
    from types import SimpleNamespace

    import gradpress.accelerate as acc
    from gradpress.ddp import make_hook
    from gradpress.lightning import GradpressCallback

    res = [torch.randn(6) for _ in range(3)]
    saved = _hook_ranks(3, res)
    state, _ = make_hook("topk:ratio=0.05")
    trainer = SimpleNamespace(strategy=SimpleNamespace(gradpress_state=state), global_rank=1, world_size=2)
    with pytest.raises(ValueError, match=r"has 3, this run has 2; .*pass GradpressCallback\(reshard=True\)"):
        GradpressCallback().on_load_checkpoint(trainer, None, {"gradpress": saved})
    GradpressCallback(reshard=True).on_load_checkpoint(trainer, None, {"gradpress": saved})
    pending = state.state_dict()
    assert (pending["rank"], pending["config"]["world_size"]) == (1, 2)
    assert torch.equal(pending["feedback"]["residuals"]["w"], _mean64(res).float())

    state.close()

    class Hook:  # what CheckpointedHook uses of a bound hook: its group, load_state_dict
        group = None
        loaded = None

        def load_state_dict(self, mine):
            self.loaded = mine

    monkeypatch.setattr(acc.dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(acc.dist, "get_world_size", lambda group=None: 4)
    hook = Hook()
    with pytest.raises(ValueError, match=r"accelerator.load_state: .*pass reshard=True to gradpress.accelerate"):
        acc.CheckpointedHook(hook).load_state_dict(saved)
    assert hook.loaded is None
    acc.CheckpointedHook(hook, reshard=True).load_state_dict(saved)
    assert (hook.loaded["rank"], hook.loaded["config"]["world_size"]) == (0, 4)
    assert torch.equal(hook.loaded["feedback"]["residuals"]["w"], _mean64(res).float())
    assert acc.trainer_callback("none", reshard=True).reshard is True


def test_a_config_file_may_ask_train_to_reshard_but_not_compare(tmp_path, monkeypatch, capsys):
    """``reshard = true`` in a --config TOML is a train option like ``resume``; compare starts every run afresh
    and refuses it, naming the key and the file, before anything trains."""
    from gradpress import compare, train
    from gradpress.cli import main as cli

    toml = tmp_path / "run.toml"
    toml.write_text('workload = "digits-mlp"\nresume = true\nreshard = true\n')
    assert make_config({"config": str(toml), "out": str(tmp_path / "o")}).reshard is True
    monkeypatch.setattr(train, "run", lambda cfg: pytest.fail("trained with reshard in compare's options"))
    assert cli(["compare", "--compressors", "none", "--config", str(toml), "--out", str(tmp_path / "c")]) == 2
    assert "not a compare option" in capsys.readouterr().err
    toml.write_text('workload = "digits-mlp"\nreshard = true\n')
    assert cli(["compare", "--compressors", "none", "--config", str(toml), "--out", str(tmp_path / "c")]) == 2
    assert f"reshard: not a compare option (config file {str(toml)!r} sets reshard = true)" in capsys.readouterr().err
    with pytest.raises(ValueError, match="reshard: not a compare option"):
        compare.run("none", {"reshard": True}, out=str(tmp_path / "c"))
