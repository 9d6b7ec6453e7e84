"""Resharding inside an epoch (``gradpress.train.reshard``: ``check``, ``reshards``, ``start``,
``epoch_rows``, ``schedule_shift``; ``gradpress.train.loop.shard_batches(resumed=)``) without workers: the
data each rank trains on, recorded as sample indices (the data set is ``arange(n)``, so a batch *is* its
indices), over runs that change world size inside an epoch, once or twice, and resume plainly in between.

The reference, computed here by the formula: epoch e is the permutation ``epoch_order(n, seed, e)`` (a
function of (seed, e) alone) dealt to the W0 workers that started it, rank r's slice ``perm[r P:(r+1) P]``
(P = n // W0) of which its first ``(P // B) B`` samples are used. Whatever the reshards inside it, the
epoch's samples are exactly that set, each once: none twice, none skipped; every step gives every rank a
full batch; the epoch ends at batch ``steps_per_epoch - 1`` of the last world (where the session checkpoints
and evaluates); later epochs are dealt as a fresh run of that world deals them; the schedule's position at
the new world's first step is ``e * steps_per_epoch + its first batch``. Refused: remaining batches that the
new world cannot share evenly (the message names the batch that would work), a checkpoint that does not
record its epoch's length. About 2 s."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from gradpress.train import reshard
from gradpress.train.loop import epoch_order, shard_batches, steps_per_epoch

SEED = 5


def _epoch_set(n, world, batch, epoch):
    """The samples epoch ``epoch`` of ``world`` workers trains on, by the formula (module docstring)."""
    perm = epoch_order(n, SEED, epoch).tolist()
    per = n // world
    used = per // batch * batch
    return Counter(perm[r * per + j] for r in range(world) for j in range(used))


def _run(n, batch, epochs, plan):
    """Run ``plan``, a list of (world, steps: None to the end), as the session does: each segment resumes
    the previous one's checkpoint (resharding when the world changes). Returns the seen batches
    ``(world, rank, epoch, b, indices)``, the checkpoints and each segment's (start, shift)."""
    data = torch.arange(n)
    seen, states, starts = [], [], []
    state = None
    for world, steps in plan:
        spe = steps_per_epoch(n, world, batch)
        done: list = []
        if state is not None:
            reshard.check(state, "iid", world)
            done = reshard.reshards(state, world)
        start = reshard.start(state, world, spe) if state is not None else (0, 0)
        step = state["step"] if state is not None else 0
        shift = reshard.schedule_shift(done, spe)
        starts.append((start, shift, step))
        rows = reshard.epoch_rows(n, SEED, start[0], batch, done)
        total = epochs * spe - shift
        count = (total - step) if steps is None else steps
        last = None
        for rank in range(world):
            got = list(shard_batches(data, data, seed=SEED, rank=rank, world=world, batch_size=batch, epochs=epochs,
                                     start=start, count=count,
                                     resumed=None if rows is None else (rows[0][rank], rows[1])))
            assert got, (world, rank, start)
            for e, b, xb, yb in got:
                assert xb.numel() == batch and torch.equal(xb, yb)  # a full batch on every rank
                seen.append((world, rank, e, b, xb.tolist()))
            ticks = [(e, b) for e, b, _, _ in got]
            assert last is None or ticks == last  # every rank takes the same steps
            last = ticks
        e, b = last[-1]
        nxt = (e + 1, 0) if b == spe - 1 else (e, b + 1)
        state = {"config": {"world_size": world}, "ranks": [{}] * world, "epoch": nxt[0], "batch": nxt[1],
                 "step": step + len(last), "reshards": done, "steps_per_epoch": spe}
        states.append(state)
    return seen, states, starts


def _check_epochs(seen, n, batch, first_world_of):
    """Each epoch trained on exactly the samples of the world that started it, each once."""
    for epoch, world in first_world_of.items():
        got = Counter(i for _, _, e, _, idx in seen if e == epoch for i in idx)
        want = _epoch_set(n, world, batch, epoch)
        assert got == want, (epoch, sorted((got - want).items())[:5], sorted((want - got).items())[:5])


@pytest.mark.parametrize("n, steps", [(256, 6), (250, 4)])
def test_four_workers_to_two_inside_an_epoch_see_its_remaining_samples_once(n, steps):
    """n = 256: 4 workers take 6 steps (epoch 0, then 2 batches of epoch 1), 2 workers the rest of epoch 1
    (the 4 ranks' 2 unseen batches each, 8 batches: 4 per new rank, numbered 4..7 of the 2-world's 8), then
    epoch 2 as a fresh 2-worker run deals it. n = 250: 62 samples per rank of 4, 3 batches used, stopped
    after batch 1 of epoch 1; the continued epoch is the 4-worker epoch's 192 samples, not the 224 a
    2-worker epoch would use."""
    seen, states, starts = _run(n, 16, 3, [(4, steps), (2, None)])
    spe4, spe2 = steps_per_epoch(n, 4, 16), steps_per_epoch(n, 2, 16)
    b = steps - spe4  # the batch of epoch 1 the 4 workers stopped at
    left = 4 * (spe4 - b) // 2
    assert states[0]["batch"] == b
    assert states[1]["reshards"] == [{"from": 4, "to": 2, "step": steps, "epoch": 1, "batch": b, "left": left}]
    (start, shift, step) = starts[1]
    assert start == (1, spe2 - left) and step + shift == 1 * spe2 + (spe2 - left)  # the schedule's position
    ends = [bb for w, _, e, bb, _ in seen if w == 2 and e == 1]
    assert max(ends) == spe2 - 1 and len(ends) == 2 * left  # the epoch ends at its last batch, on both ranks
    _check_epochs(seen, n, 16, {0: 4, 1: 4, 2: 2})
    assert states[-1]["step"] == steps + left + spe2 and (states[-1]["epoch"], states[-1]["batch"]) == (3, 0)


def test_twice_inside_one_epoch_and_a_plain_resume_in_between():
    """4 -> 2 after batch 1 (the 12 batches left: 6 per rank, numbered 2..7), a plain resume on 2 after one
    step, then 2 -> 4 after batch 4 of the 2-world's numbering (8 batches left: 2 per rank, numbered 2, 3),
    then epoch 1 on 4."""
    seen, states, starts = _run(256, 16, 2, [(4, 1), (2, 1), (2, 1), (4, None)])
    assert states[0]["batch"] == 1 and starts[1][0] == (0, 2) and states[1]["batch"] == 3
    assert starts[2][0] == (0, 3) and states[2]["batch"] == 4  # plain resume: the checkpoint's position
    assert states[3]["reshards"][-1] == {"from": 2, "to": 4, "step": 3, "epoch": 0, "batch": 4, "left": 2}
    assert starts[3][0] == (0, 2)
    _check_epochs(seen, 256, 16, {0: 4, 1: 4})
    assert states[-1]["step"] == 3 + 2 + 4


def test_a_share_that_does_not_divide_is_refused_naming_the_batch_that_would():
    """2 workers after batch 1 of 8 have 14 batches left: 3 workers cannot share them; after batch 2 (12)
    they could."""
    state = {"config": {"world_size": 2}, "ranks": [{}, {}], "epoch": 0, "batch": 1, "step": 1,
             "steps_per_epoch": 8}
    with pytest.raises(ValueError) as info:
        reshard.check(state, "iid", 3)
    text = str(info.value)
    assert "stopped inside epoch 1 (after batch 1 of it, step 1); its 2 workers have 14 batches of it left" in text
    assert "resume on 2 workers until after batch 2 of it (--steps 2), then reshard" in text
    reshard.check({**state, "batch": 2, "step": 2}, "iid", 3)
    with pytest.raises(ValueError, match=r"until at its end \(--steps 8\)"):  # 2 x 1 left, 4 workers: none fits
        reshard.check({**state, "batch": 7, "step": 7}, "iid", 4)
    old = {k: v for k, v in state.items() if k != "steps_per_epoch"}
    with pytest.raises(ValueError, match="does not record the epoch's length"):
        reshard.check(old, "iid", 2)
    with pytest.raises(ValueError, match=r"split 'labels:k=2' deals fixed shards"):
        reshard.check(state, "labels:k=2", 2)
