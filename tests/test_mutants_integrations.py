"""Written for survivors of the ``integrations`` group of ``make mutants``
(docs/testing.md): one process, a 1-rank gloo group where a DDP model is
needed, stand-ins for the accelerator and the Trainer (the attributes
gradpress reads), no worker.

* The Transformers Trainer callback: a run that starts at step 0 loads
  nothing (no warning); at step N >= 1 it loads ``checkpoint-N/gradpress.pt``
  (or ``resume_from``'s) equal to what ``on_save`` wrote, and warns naming the
  path where there is none; a second ``on_train_begin`` on the same DDP model
  keeps its hook, a new DDP wrapper gets a new one and the old one is closed;
  without Transformers the error names the extra.
* ``gradpress.accelerate.log_stats``: one ``accelerator.log`` of the stats'
  tags at the step it is given.
* ``GradpressStrategy``: constructs without the reserved keywords, refuses
  each of them by name, hands ``options`` to the hook, takes a ready hook
  state as it is (and refuses options beside it).
* ``charlm-transformer``: the parameter count of the documented architecture
  (MLP 4 x hidden), and the forward pass equal to a float64 reference written
  from the module doc (pre-norm, causal 4-head attention, GELU).
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys
import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from gradpress import torch_compat

pytestmark = pytest.mark.mutants

HAVE_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
HAVE_LIGHTNING = importlib.util.find_spec("lightning") is not None
SPEC = "topk:ratio=0.1"


@pytest.fixture
def one_rank(tmp_path):  # noqa: ANN001,ANN201
    """A 1-rank gloo default group in this process."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        torch_compat.destroy_process_group()


def _ddp(seed: int = 0) -> torch.nn.parallel.DistributedDataParallel:
    torch.manual_seed(seed)
    return torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4)))


def _backward(ddp: torch.nn.parallel.DistributedDataParallel, seed: int) -> None:
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(seed))
    ddp(x).square().sum().backward()


# ---------------------------------------------------------------- the Trainer callback

def _callback(ddp, **kw):  # noqa: ANN001,ANN003,ANN202
    import gradpress.accelerate

    trainer = SimpleNamespace(model_wrapped=ddp, callback_handler=SimpleNamespace(callbacks=[]))
    cb = gradpress.accelerate.attach_trainer(trainer, SPEC, min_numel=64, **kw)
    assert trainer.callback_handler.callbacks == [cb]
    return cb


def _args(out) -> SimpleNamespace:  # noqa: ANN001
    return SimpleNamespace(parallel_mode="ParallelMode.DISTRIBUTED", output_dir=str(out))


@pytest.mark.skipif(not HAVE_TRANSFORMERS, reason="needs transformers")
def test_trainer_callback_loads_the_saved_state_at_step_n_and_nothing_at_step_0(one_rank, tmp_path) -> None:  # noqa: ANN001
    from gradpress.accelerate import TRAINER_FILE

    out = tmp_path / "out"
    first = _callback(_ddp())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # step 0: nothing to load, nothing to warn about
        first.on_train_begin(_args(out), SimpleNamespace(global_step=0), None)
    assert first.hook is not None and first.hook.step == 0
    for seed in (1, 2):
        _backward(first._ddp, seed)
    saved = first.hook.state_dict()
    residuals = saved["feedback"]["residuals"]
    assert saved["step"] == 2 and residuals and any(t.abs().sum() > 0 for t in residuals.values())
    logs = {"loss": 1.0}
    first.on_log(_args(out), None, None, logs=logs)
    stats = first.hook.stats
    assert logs["gradpress/bytes_per_step"] == float(stats["last_step_bytes"])
    assert logs["gradpress/compression_ratio"] == float(stats["ratio"]) and logs["loss"] == 1.0

    for step in (1, 2):  # the Trainer makes the folder before on_save; 1 is the first step that can resume
        state = SimpleNamespace(global_step=step, is_world_process_zero=True)
        first.on_save(_args(out), state, None)
        assert not (out / f"checkpoint-{step}" / TRAINER_FILE).exists()  # no folder: nothing written
        (out / f"checkpoint-{step}").mkdir(parents=True)
        first.on_save(_args(out), state, None)
        assert (out / f"checkpoint-{step}" / TRAINER_FILE).is_file()
    first.hook.close()

    for step in (1, 2):
        again = _callback(_ddp())
        again.on_train_begin(_args(out), SimpleNamespace(global_step=step), None)
        restored = again.hook.state_dict()
        assert restored["step"] == 2
        for key, tensor in residuals.items():
            assert torch.equal(restored["feedback"]["residuals"][key], tensor), key
        again.hook.close()

    other = tmp_path / "elsewhere"
    os.rename(out / "checkpoint-2", other)
    moved = _callback(_ddp(), resume_from=str(other))
    moved.on_train_begin(_args(out), SimpleNamespace(global_step=2), None)
    assert moved.hook.state_dict()["step"] == 2
    moved.hook.close()

    lost = _callback(_ddp())
    missing = os.path.join(str(out), "checkpoint-2", TRAINER_FILE)
    with pytest.warns(UserWarning, match=f"resuming at step 2 but {missing} does not exist.*resume_from"):
        lost.on_train_begin(_args(out), SimpleNamespace(global_step=2), None)
    assert lost.hook.state_dict()["step"] == 0
    lost.hook.close()


@pytest.mark.skipif(not HAVE_TRANSFORMERS, reason="needs transformers")
def test_trainer_callback_registers_once_per_ddp_wrapper(one_rank, tmp_path) -> None:  # noqa: ANN001
    ddp = _ddp()
    cb = _callback(ddp)
    begin = SimpleNamespace(global_step=0)
    cb.on_train_begin(_args(tmp_path), begin, None)
    hook = cb.hook
    cb.on_train_begin(_args(tmp_path), begin, None)  # a second train() on the same wrapper: the same hook
    assert cb.hook is hook and hook._thread.is_alive()
    _backward(ddp, 1)
    assert hook.step == 1
    cb.trainer.model_wrapped = fresh = _ddp()
    cb.on_train_begin(_args(tmp_path), begin, None)
    assert cb.hook is not hook and cb._ddp is fresh
    assert not hook._thread.is_alive()  # the replaced hook was closed (its communication thread stopped)
    _backward(fresh, 1)
    assert cb.hook.step == 1
    cb.hook.close()


def test_trainer_callback_without_transformers_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import gradpress.accelerate

    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    gradpress.accelerate._callback_class.cache_clear()
    try:
        with pytest.raises(ImportError, match=r"needs Transformers: pip install 'gradpress\[accelerate\]'"):
            gradpress.accelerate.trainer_callback(SPEC)
    finally:
        gradpress.accelerate._callback_class.cache_clear()


def test_log_stats_logs_the_stats_tags_once_at_the_step_it_is_given() -> None:
    """``gradpress.accelerate.log_stats(accelerator, hook, step)``: one
    ``accelerator.log`` of the hook's stats under the tags of
    ``STATS_TAGS`` (the value of each stat, as a float), at ``step`` itself
    (the plants3 session's ``step + 1`` went unnoticed: the Accelerate run
    reads the tags' values, not their steps)."""
    import gradpress.accelerate

    calls = []
    accelerator = SimpleNamespace(log=lambda values, step=None: calls.append((values, step)))
    hook = SimpleNamespace(stats={"last_step_bytes": 120, "last_step_dense_bytes": 480, "ratio": 4.0,
                                  "compress_s": 0.25, "comm_s": 0.5, "steps": 7})
    gradpress.accelerate.log_stats(accelerator, hook, 7)
    assert calls == [({"gradpress/bytes_per_step": 120.0, "gradpress/dense_bytes_per_step": 480.0,
                       "gradpress/compression_ratio": 4.0, "gradpress/compress_s": 0.25, "gradpress/comm_s": 0.5},
                      7)]


# ---------------------------------------------------------------- Lightning's strategy

@pytest.mark.skipif(not HAVE_LIGHTNING, reason="needs PyTorch Lightning")
def test_strategy_refuses_the_reserved_keywords_and_hands_options_to_the_hook(one_rank) -> None:  # noqa: ANN001
    from gradpress.ddp import make_hook
    from gradpress.lightning import GradpressStrategy

    plain = GradpressStrategy()
    assert not plain.gradpress_state.bound
    plain.gradpress_state.close()
    for reserved in ("ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper"):
        with pytest.raises(ValueError, match=f"GradpressStrategy: {reserved} is set by gradpress"):
            GradpressStrategy(SPEC, **{reserved: None})

    strategy = GradpressStrategy(SPEC, options={"min_numel": 64, "strategy": "allgather", "seed": 7})
    strategy.gradpress_state.bind(_ddp())
    config = strategy.gradpress_state.engine.config()
    assert (config["compressor"], config["min_numel"], config["strategy"], config["seed"]) == (SPEC, 64, "allgather", 7)
    strategy.gradpress_state.close()

    ready, _ = make_hook(SPEC, min_numel=64)
    assert GradpressStrategy(ready).gradpress_state is ready
    with pytest.raises(ValueError, match="options apply to a spec, not to a ready hook state"):
        GradpressStrategy(ready, options={"min_numel": 8})
    ready.close()


# ---------------------------------------------------------------- charlm-transformer

def _layer_norm(x: torch.Tensor, ln: torch.nn.LayerNorm) -> torch.Tensor:
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + ln.eps) * ln.weight.double() + ln.bias.double()


def _reference(model, x: torch.Tensor, heads: int = 4) -> torch.Tensor:  # noqa: ANN001
    """The module doc's transformer in float64: token + position embedding,
    pre-norm blocks (causal multi-head attention, then a GELU MLP), LayerNorm,
    linear head."""
    n, hidden = x.shape[1], model.embed.weight.shape[1]
    d = hidden // heads
    h = model.embed.weight.double()[x] + model.pos.weight.double()[:n]
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    for block in model.blocks.layers:
        a = _layer_norm(h, block.norm1)
        qkv = a @ block.self_attn.in_proj_weight.double().T + block.self_attn.in_proj_bias.double()
        q, k, v = (t.reshape(*t.shape[:2], heads, d).transpose(1, 2) for t in qkv.split(hidden, dim=-1))
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(d)
        att = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v
        att = att.transpose(1, 2).reshape(*h.shape)
        h = h + att @ block.self_attn.out_proj.weight.double().T + block.self_attn.out_proj.bias.double()
        m = _layer_norm(h, block.norm2)
        m = m @ block.linear1.weight.double().T + block.linear1.bias.double()
        m = 0.5 * m * (1 + torch.erf(m / math.sqrt(2)))  # exact GELU
        h = h + m @ block.linear2.weight.double().T + block.linear2.bias.double()
    return _layer_norm(h, model.norm) @ model.head.weight.double().T + model.head.bias.double()


def test_charlm_transformer_has_the_documented_size_and_forward_pass() -> None:
    from gradpress.workloads.charlm_transformer import CharTransformer

    for hidden in (16, 128):
        h, v, ctx = hidden, 256, 64
        block = 2 * h + (3 * h * h + 3 * h) + (h * h + h) + 2 * h + (h * 4 * h + 4 * h) + (4 * h * h + h)
        expected = v * h + ctx * h + 2 * block + 2 * h + (h * v + v)
        assert sum(p.numel() for p in CharTransformer(hidden).parameters()) == expected, hidden
    assert round(expected / 1e6, 2) == 0.47  # the module doc's figure for hidden = 128

    torch.manual_seed(0)
    model = CharTransformer(16).eval()
    with torch.no_grad():  # so that the float32 model is not the only thing with weights of this size
        for p in model.parameters():
            p.normal_(0, 0.3)
    x = torch.randint(0, 256, (3, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = model(x).double()
    want = _reference(model, x)
    assert got.shape == (3, 20, 256)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4), (got - want).abs().max()
    assert F.cross_entropy(want.reshape(-1, 256), x.reshape(-1)).isfinite()
