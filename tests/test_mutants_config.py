"""Written for survivors of the ``config`` group of ``make mutants``
(train/config.py, train/args.py, train/launch.py), one process, no worker:
the bounds of ``lr`` and ``timeout`` (0 refused naming the field and the
value, the smallest positive float accepted); where ``run`` trains (a
launcher's group needs both RANK and WORLD_SIZE, else ``nproc`` starts
workers); ``--config`` read with ``tomli`` where Python is older than 3.11."""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest

from gradpress.train import config, launch

pytestmark = pytest.mark.mutants

TINY = {"workload": "digits-mlp", "samples": 96, "batch_size": 16, "progress": False}
SMALLEST = 5e-324  # the smallest positive (subnormal) float64


@pytest.mark.parametrize("field,says", [("lr", "lr must be a positive finite number"),
                                        ("timeout", "timeout must be a positive finite number of seconds")])
@pytest.mark.parametrize("value", [0, 0.0, -0.0, -SMALLEST])
def test_zero_and_below_are_refused_naming_the_field_and_the_value(tmp_path, field: str, says: str,
                                                                  value: float) -> None:
    with pytest.raises(ValueError) as err:
        config.make_config(TINY, out=str(tmp_path), **{field: value})
    assert str(err.value) == f"{says}, got {value!r}", err.value


@pytest.mark.parametrize("field", ["lr", "timeout"])
def test_the_smallest_positive_value_is_accepted_as_a_float(tmp_path, field: str) -> None:
    for value in (SMALLEST, 1):
        got = getattr(config.make_config(TINY, out=str(tmp_path), **{field: value}), field)
        assert got == float(value) and type(got) is float, (field, value, got)


def _where_run_goes(monkeypatch: pytest.MonkeyPatch, tmp_path, env: dict[str, str]) -> str:
    """``"launch"`` if ``run(nproc=2)`` starts workers under ``env``, ``"here"`` if it trains in this process."""
    import gradpress.train.session as session

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(launch.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(launch, "_launch", lambda cfg: {"went": "launch", "nproc": cfg.nproc})
    monkeypatch.setattr(session, "train", lambda cfg: {"went": "here", "nproc": cfg.nproc})
    done = launch.run(TINY, nproc=2, out=str(tmp_path))
    assert done["nproc"] == 2
    return done["went"]


@pytest.mark.parametrize("env,where", [({}, "launch"), ({"WORLD_SIZE": "2"}, "launch"), ({"RANK": "0"}, "launch"),
                                       ({"RANK": "0", "WORLD_SIZE": "2"}, "here")])
def test_nproc_starts_workers_unless_a_launcher_set_both_rank_and_world_size(monkeypatch, tmp_path,
                                                                            env: dict[str, str], where: str) -> None:
    """Under torchrun (RANK and WORLD_SIZE) the process joins the launcher's group and trains; a stray
    WORLD_SIZE or RANK alone is no group to join (init_group would make a group of one), so ``nproc``
    still starts its workers."""
    assert _where_run_goes(monkeypatch, tmp_path, env) == where


def test_an_initialized_group_trains_here(monkeypatch, tmp_path) -> None:
    import gradpress.train.session as session

    monkeypatch.setattr(launch.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(launch, "_launch", lambda cfg: pytest.fail("workers started inside a process group"))
    monkeypatch.setattr(session, "train", lambda cfg: {"went": "here"})
    assert launch.run(TINY, nproc=2, out=str(tmp_path)) == {"went": "here"}


def test_python_before_3_11_reads_the_config_file_with_tomli(monkeypatch, tmp_path) -> None:
    """pyproject.toml installs ``tomli`` where Python < 3.11 (no ``tomllib``): load_toml must use it there,
    and ``tomllib`` from 3.11 on. A stand-in ``tomli`` records that it was used."""
    tomllib = pytest.importorskip("tomllib")  # on 3.10 itself every --config test reads with the real tomli
    used: list[str] = []
    fake = types.ModuleType("tomli")
    fake.TOMLDecodeError = tomllib.TOMLDecodeError  # type: ignore[attr-defined]

    def load(f: Any) -> dict[str, Any]:
        used.append("tomli")
        return tomllib.load(f)

    fake.load = load  # type: ignore[attr-defined]
    path = tmp_path / "c.toml"
    path.write_text("log-every = 3\n")
    monkeypatch.setitem(sys.modules, "tomli", fake)
    with monkeypatch.context() as m:
        m.setattr(sys, "version_info", (3, 10, 14, "final", 0))
        assert config.load_toml(str(path)) == {"log_every": 3}
    assert used == ["tomli"]
    assert config.load_toml(str(path)) == {"log_every": 3} and used == ["tomli"]  # 3.11 and later: tomllib


@pytest.mark.parametrize("seed,ok", [(0, True), (2**32 - 1, True), (2**32, False), (-1, False)])
def test_the_seed_range_includes_both_ends(tmp_path, seed: int, ok: bool) -> None:
    """``--seed`` takes 0 .. 2**32 - 1, both ends included (numpy's and torch's seed range): the upper
    bound is inclusive in ``checks._int`` (``value > high`` refuses; ``>=`` would refuse 2**32 - 1)."""
    if ok:
        assert config.make_config(seed=seed, out=str(tmp_path / "r")).seed == seed
    else:
        with pytest.raises(ValueError, match=rf"^seed must be an integer from 0 to 4294967295, got {seed}$"):
            config.make_config(seed=seed, out=str(tmp_path / "r"))
