"""``gradpress train --precision fp32|bf16|fp16``: the refusals before any worker starts, the step's autocast
and loss scaling in one process, and exact resume on 2 workers under bf16 and fp16 (the DDP hook and
local SGD, whose GradScaler state travels in the checkpoint).

In-process tests: the refusals (by message) and :func:`gradpress.train.loop.train_step` with a forward hook
recording the dtype a Linear layer computed in, and the gradient fp16 leaves against a float64 reference
times the scaler's scale. Then 9 launches of 2 gloo workers on a tiny mnist1d-cnn (about 2-3 min on a
shared machine): for bf16 and fp16 with ``ddp`` and fp16 with ``localsgd``, 8 steps straight == 4 steps,
stop, ``--resume`` for 4 (losses bit-identical, final parameters equal), the scaler's state in the
checkpoint, a resume with another precision refused naming it, and bf16's losses differing from fp32's.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn

from gradpress.cli import main as cli
from gradpress.train import precision as precision_mod
from gradpress.train.loop import train_step
from gradpress.train.precision import Precision


# ------------------------------------------------------------------ refusals, before any worker starts
@pytest.mark.parametrize("argv,needle", [
    (["--precision", "fp8"], "--precision must be one of fp32, bf16, fp16, got 'fp8'"),
    (["--precision", "fp16", "--nonfinite", "skip"], "precision 'fp16' needs nonfinite 'propagate', got nonfinite 'skip'"),
    (["--precision", "fp16", "--nonfinite", "raise"], "precision 'fp16' needs nonfinite 'propagate', got nonfinite 'raise'"),
    (["--precision", "fp16", "--algorithm", "comprex"], "GradScaler, which algorithm 'comprex' refuses: the gradient "
                                                        "exchange of step t is applied at step t + s"),
    (["--precision", "fp16", "--algorithm", "lgc"], "GradScaler, which algorithm 'lgc' refuses: its compressed phase"),
])
def test_refused_before_workers_start(capsys, tmp_path, argv, needle):
    assert cli(["train", "--out", str(tmp_path), "--nproc", "2", *argv]) == 2
    err = capsys.readouterr().err
    assert "gradpress train: error:" in err and needle in err, err
    assert not (tmp_path / "metrics.jsonl").exists()


def test_bf16_is_allowed_where_fp16_is_refused():
    from gradpress.train.config import make_config

    for extra in ({"algorithm": "comprex"}, {"nonfinite": "skip"}):
        assert make_config(precision="bf16", **extra).precision == "bf16"
    assert make_config().precision == "fp32"  # the default


def test_fp16_refused_on_a_torch_without_gradscaler(monkeypatch, capsys, tmp_path):
    import gradpress.train.precision as p

    monkeypatch.setattr(p, "_scaler_class", lambda: None)
    assert cli(["train", "--out", str(tmp_path), "--precision", "fp16"]) == 2
    err = capsys.readouterr().err
    assert "precision 'fp16' needs torch.amp.GradScaler('cpu'), which this torch" in err, err
    assert "allowed here: --precision fp32 or bf16" in err


def test_toml_key(tmp_path):
    from gradpress.train.config import make_config

    cfg = tmp_path / "c.toml"
    cfg.write_text('precision = "bf16"\n')
    assert make_config({"config": str(cfg)}).precision == "bf16"
    cfg.write_text('precision = "half"\n')
    with pytest.raises(ValueError, match="precision must be one of fp32, bf16, fp16, got 'half'"):
        make_config({"config": str(cfg)})


# ------------------------------------------------------------------ the step, in one process
class _Algo:
    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.steps = 0

    def step(self) -> None:
        self.steps += 1


@pytest.mark.parametrize("name,dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_train_step_autocasts_and_scales(name, dtype):
    torch.manual_seed(0)
    model = nn.Linear(6, 3)
    seen: list[torch.dtype] = []
    model.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    x, y = torch.randn(5, 6), torch.tensor([0, 1, 2, 0, 1])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    prec = precision_mod.make(name, torch.device("cpu"))
    assert (prec is None) == (name == "fp32")
    algo = _Algo(model)
    loss = train_step(algo, opt, nn.functional.cross_entropy, x, y, prec)
    assert seen == [dtype] and algo.steps == 1
    assert all(p.dtype == torch.float32 for p in model.parameters())  # parameters stay fp32
    # the reference: the float64 gradient of the mean cross entropy, by the formula (softmax - onehot) / n
    w, b = model.weight.detach().double(), model.bias.detach().double()
    probs = torch.softmax(x.double() @ w.T + b, dim=1)
    dz = (probs - nn.functional.one_hot(y, 3).double()) / len(y)
    ref_w = dz.T @ x.double()
    ref_loss = nn.functional.cross_entropy(x.double() @ w.T + b, y)
    scale = 1.0 if prec is None or prec.scaler is None else prec.scaler.get_scale()
    assert scale == (2.0 ** 16 if name == "fp16" else 1.0)  # fp16: GradScaler's initial scale; the others: none
    tol = {"fp32": 1e-6, "bf16": 3e-2, "fp16": 3e-3}[name]
    assert model.weight.grad is not None and model.weight.grad.dtype == torch.float32
    torch.testing.assert_close(model.weight.grad.double() / scale, ref_w, atol=tol, rtol=tol)
    assert abs(float(loss.detach()) - float(ref_loss)) < tol  # the loss returned is the unscaled one


def test_precision_backward_without_scaler_is_plain():
    t = torch.tensor([2.0], requires_grad=True)
    Precision("bf16", torch.device("cpu")).backward((t * 3).sum())
    assert t.grad is not None and float(t.grad) == 3.0


# ------------------------------------------------------------------ end to end, 2 workers
COMMON = ["train", "--nproc", "2", "--workload", "mnist1d-cnn", "--hidden", "8", "--samples", "128",
          "--batch-size", "16", "--epochs", "2", "--min-numel", "64", "--log-every", "1", "--no-progress"]


def _losses(out):
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def _params(out):
    return torch.load(out / "checkpoint.pt", weights_only=True)["model"]


@pytest.mark.parametrize("prec,algo", [("bf16", "ddp"), ("fp16", "ddp"), ("fp16", "localsgd:period=3")])
def test_resume_is_exact(tmp_path, capsys, prec, algo):
    """8 steps (2 epochs of 4) straight == 4 steps, stop, resume for 4: the same losses, bit for bit, and the
    same final parameters; the GradScaler's state (fp16) is in the checkpoint."""
    common = [*COMMON, "--precision", prec, "--algorithm", algo,
              *(["--compressor", "topk:ratio=0.1", "--strategy", "allgather"] if algo == "ddp" else [])]
    full, part = tmp_path / "full", tmp_path / "part"
    assert cli([*common, "--out", str(full)]) == 0
    assert cli([*common, "--out", str(part), "--steps", "4"]) == 0
    ck = torch.load(part / "checkpoint.pt", weights_only=True)
    assert ck["step"] == 4 and ck["settings"]["precision"] == prec and ck["config"]["precision"] == prec
    for r in ck["ranks"]:
        scaler = r.get("loss_scaler") if algo == "ddp" else r["algorithm"].get("loss_scaler")
        if prec == "fp16":  # a scaler was given, and update() ran once per step (no overflow in this run)
            assert scaler is not None and scaler["scale"] == 2.0 ** 16 and scaler["_growth_tracker"] == 4, scaler
        else:
            assert scaler is None and "loss_scaler" not in r["algorithm"]
    other = "fp16" if prec == "bf16" else "bf16"
    capsys.readouterr()
    assert cli([*[a if a != prec else other for a in common], "--out", str(part), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "precision" in err and repr(prec) in err and repr(other) in err, err
    assert cli([*common, "--out", str(part), "--resume"]) == 0
    assert _losses(full) == _losses(part) and len(_losses(full)) == 8
    a, b = _params(full), _params(part)
    assert all(torch.equal(a[k], b[k]) for k in a)
    summary = json.loads((part / "summary.json").read_text())
    assert summary["settings"]["precision"] == prec
    if prec == "bf16":  # bf16 really computed in bf16: an fp32 run of the same settings logs other losses
        fp32 = tmp_path / "fp32"
        assert cli([*[a if a != prec else "fp32" for a in common], "--out", str(fp32)]) == 0
        la, lb = _losses(fp32), _losses(full)
        assert la != lb and max(abs(u - v) for u, v in zip(la, lb)) < 0.05  # close, not equal
