"""Contracts of hierarchical's helpers, the process groups, the strategy
catalog and the probe (``exchange/strategies/hierarchical_{abort,costs,layout}.py``,
``transport/groups.py``, ``exchange/catalog.py``, ``exchange/probe.py``) that
the end-to-end tests do not pin. Written for survivors of ``make mutants``
(``layout`` group); every expected value is the test's own (float64, by the
module doc's formula, IEEE 754 bit layouts, the documented probe), never
the code's output. One process; the groups are a 1-rank gloo group.

* ``predict_seconds`` on one host (``H = 1``): one dense allreduce of the
  ``e d`` bytes among its ranks, read off ``intra_allreduce`` (else the
  group's ``allreduce``), 0 on a single rank; a ``per_host`` that does not
  divide the world is one worker per host (the flat formula).
* The abort marker: a *signaling* NaN (exponent all ones, quiet bit clear,
  payload nonzero) in every entry of every float dtype, all-ones bits in
  other dtypes; ``is_marked`` true only for it (never for an arithmetic NaN,
  an empty buffer or plain data); the worker's error names the leader, the
  host, the key, the step and the other tensors' count.
* ``workers_per_host_from_env``: ``GRADPRESS_WORKERS_PER_HOST`` before
  ``LOCAL_WORLD_SIZE``, ``local_world`` in place of the latter only; a bad
  value names the variable.
* ``timeout_of``/``own_group``: the caller's timeout, else the base group's
  (the default group's too when ``group`` is None; an NCCL group's read
  from its CUDA backend); the new group has the base group's ranks.
* ``measure``: probes the documented sizes (1 KB-1 MB of bytes, 1 K-512 K
  elements), 5 repetitions each; ``wire`` is the compressor's packet bytes,
  fitted exactly (no overhead).
"""

from __future__ import annotations

import datetime
import re
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from gradpress import torch_compat
from gradpress.compress.none import NoCompression
from gradpress.exchange.costs import CostModel
from gradpress.exchange.probe import measure
from gradpress.exchange.strategies.hierarchical_abort import is_marked, leader_failed, mark_failed
from gradpress.exchange.strategies.hierarchical_costs import predict_seconds
from gradpress.exchange.strategies.hierarchical_layout import (
    check_divides,
    resolved_workers_per_host,
    workers_per_host_from_env,
)
from gradpress.transport.groups import device_of, own_group, timeout_of

pytestmark = pytest.mark.mutants

# ---------------------------------------------------------------- hierarchical_costs

FITS = {  # steep and distinct: reading the wrong fit, or at the wrong bytes, changes the seconds
    "allreduce": (1e-4, 3e-4, 7e-7), "allgather": (1e-4, 5e-4, 3e-7), "broadcast": (1e-4, 2e-4, 1e-7),
    "p2p": (1e-4, 2e-4, 1e-7), "encode": (1e-5, 4e-5, 6e-9), "decode": (1e-5, 2e-5, 2e-9),
    "wire": (0.0, 0.0, 0.5), "root_wire": (0.0, 0.0, 0.5),
}
INTRA = (1e-6, 1e-5, 1e-9)


def _fit(coeffs: tuple[float, float, float], x: float) -> float:
    overhead, a, b = coeffs
    return max(overhead, a + b * x)


def _costs(intra: bool) -> CostModel:
    return CostModel.from_mapping(dict(FITS, intra_allreduce=INTRA) if intra else FITS)


@pytest.mark.parametrize("intra", [True, False])
@pytest.mark.parametrize("elem_size", [2, 4, 8])
@pytest.mark.parametrize("per", [2, 3, 4])
def test_one_host_is_one_dense_allreduce_of_its_bytes(per: int, elem_size: int, intra: bool) -> None:
    numel = 12_345
    # an allreduce of x bytes among the host's ranks: intra_allreduce(x), else the group's allreduce (N = per)
    expected = _fit(INTRA if intra else FITS["allreduce"], float(numel * elem_size))
    got = predict_seconds(_costs(intra), numel, per, True, per, elem_size)
    assert got == pytest.approx(expected, rel=1e-12)
    assert predict_seconds(_costs(intra), numel, per, False, per, elem_size) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("world", [0, 1])
def test_a_single_rank_costs_nothing(world: int) -> None:
    for per in (0, 1, 2):
        assert predict_seconds(_costs(True), 5000, world, True, per) == 0.0


@pytest.mark.parametrize("summable", [True, False])
@pytest.mark.parametrize(("world", "per_host"), [(6, 4), (5, 2), (6, 0), (3, 1)])
def test_a_host_size_that_does_not_divide_is_one_worker_per_host(world: int, per_host: int, summable: bool) -> None:
    numel = 40_000
    d = float(numel)
    c = _fit(FITS["wire"], d)  # the packet of d elements
    codec = _fit(FITS["encode"], d)
    if summable:  # N leaders ring-allreduce c: 2 (N - 1) / N c per link = an allreduce of c among N
        expected = max(_fit(FITS["allreduce"], c), codec + _fit(FITS["decode"], d))
    else:  # (N - 1) c per link = an allgather of c per rank; every leader decodes N packets
        expected = max(_fit(FITS["allgather"], c), codec + world * _fit(FITS["decode"], d))
    got = predict_seconds(_costs(True), numel, world, summable, per_host)
    assert got == pytest.approx(expected, rel=1e-12)


# ---------------------------------------------------------------- hierarchical_abort

#: IEEE 754 binary layouts: (dtype, integer dtype, exponent bits, fraction bits)
FLOATS = [(torch.float16, torch.int16, 5, 10), (torch.bfloat16, torch.int16, 8, 7),
          (torch.float32, torch.int32, 8, 23), (torch.float64, torch.int64, 11, 52)]


@pytest.mark.parametrize(("dtype", "ints", "exp_bits", "frac_bits"), FLOATS)
def test_the_marker_is_a_signaling_nan_in_every_entry(dtype: torch.dtype, ints: torch.dtype, exp_bits: int,
                                                      frac_bits: int) -> None:
    buffer = torch.arange(7, dtype=torch.float32).to(dtype)
    mark_failed(buffer)
    assert bool(torch.isnan(buffer.float()).all())
    for word in buffer.view(ints).tolist():
        word &= (1 << (1 + exp_bits + frac_bits)) - 1  # as unsigned
        exponent = (word >> frac_bits) & ((1 << exp_bits) - 1)
        fraction = word & ((1 << frac_bits) - 1)
        assert exponent == (1 << exp_bits) - 1 and fraction != 0  # a NaN
        assert not fraction >> (frac_bits - 1) & 1, hex(word)  # quiet bit clear: signaling
    assert is_marked(buffer)


@pytest.mark.parametrize(("dtype", "ints", "exp_bits", "frac_bits"), FLOATS)
def test_no_arithmetic_result_is_the_marker(dtype: torch.dtype, ints: torch.dtype, exp_bits: int,
                                            frac_bits: int) -> None:
    plain = torch.tensor([0.5, -3.0, 0.0], dtype=dtype)
    assert not is_marked(plain)
    zero = torch.zeros(4, dtype=dtype)
    assert not is_marked(zero / zero)  # an arithmetic NaN is quiet
    assert not is_marked(torch.full((3,), float("inf"), dtype=dtype))
    marked = torch.zeros(3, dtype=dtype)
    mark_failed(marked)
    assert not is_marked(marked + 0)  # arithmetic quiets a signaling NaN
    assert not is_marked(torch.empty(0, dtype=dtype))
    mark_failed(torch.empty(0, dtype=dtype))  # nothing to fill, no error


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64])
def test_other_dtypes_are_marked_with_all_ones(dtype: torch.dtype) -> None:
    buffer = torch.arange(5, dtype=dtype)
    mark_failed(buffer)
    bits = 8 * buffer.element_size()
    unsigned = [w & ((1 << bits) - 1) for w in buffer.tolist()]
    assert unsigned == [(1 << bits) - 1] * 5
    assert is_marked(buffer) and not is_marked(torch.arange(5, dtype=dtype))


def test_only_the_first_entry_is_read() -> None:
    buffer = torch.ones(4)
    mark_failed(buffer[:1])
    assert is_marked(buffer)
    mark_failed(buffer)
    buffer[0] = 1.0
    assert not is_marked(buffer)


@pytest.mark.parametrize(("count", "others"), [(1, None), (2, 1), (5, 4)])
def test_leader_failed_names_leader_host_key_step_and_the_others(count: int, others: int | None) -> None:
    err = leader_failed(6, 3, "layer.weight", 17, count)
    text = str(err)
    assert isinstance(err, RuntimeError)
    assert "host 3, rank 6," in text and "'layer.weight'" in text and "at step 17" in text
    if others is None:
        assert "other tensor" not in text
    else:
        assert f"and {others} other tensor(s) of this call" in text


# ---------------------------------------------------------------- hierarchical_layout

@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for var in ("GRADPRESS_WORKERS_PER_HOST", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_workers_per_host_env_order(clean_env: pytest.MonkeyPatch) -> None:
    assert workers_per_host_from_env() == 1
    assert workers_per_host_from_env(local_world=3) == 3
    clean_env.setenv("LOCAL_WORLD_SIZE", " 4 ")
    assert workers_per_host_from_env() == 4
    assert workers_per_host_from_env(local_world=2) == 2  # the workers about to start, not this process
    clean_env.setenv("GRADPRESS_WORKERS_PER_HOST", "")  # empty: not set
    assert workers_per_host_from_env() == 4
    clean_env.setenv("GRADPRESS_WORKERS_PER_HOST", "8")
    assert workers_per_host_from_env() == 8 and workers_per_host_from_env(local_world=2) == 8
    assert resolved_workers_per_host(0, 16) == 8 and resolved_workers_per_host(2, 16) == 2
    assert resolved_workers_per_host(0, 1) == 1 and resolved_workers_per_host(4, 0) == 1


@pytest.mark.parametrize("var", ["GRADPRESS_WORKERS_PER_HOST", "LOCAL_WORLD_SIZE"])
@pytest.mark.parametrize("text", ["0", "-2", "two", "1.5"])
def test_bad_workers_per_host_names_the_variable(clean_env: pytest.MonkeyPatch, var: str, text: str) -> None:
    clean_env.setenv(var, text)
    with pytest.raises(ValueError, match=f"environment {var}={text!r}: allowed: a positive integer"):
        workers_per_host_from_env()


def test_check_divides() -> None:
    for world, per in [(8, 1), (8, 2), (8, 8), (9, 3)]:
        check_divides(world, per)
    with pytest.raises(ValueError, match="workers_per_host=3 does not divide the group's 8 ranks; allowed: a divisor of 8"):
        check_divides(8, 3)


# ---------------------------------------------------------------- groups

GROUP_TIMEOUT = datetime.timedelta(seconds=77)


@pytest.fixture
def one_rank(tmp_path):  # noqa: ANN001,ANN201
    """A 1-rank gloo default group of ``GROUP_TIMEOUT``, in this process."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1,
                            timeout=GROUP_TIMEOUT)
    try:
        yield dist.group.WORLD
    finally:
        torch_compat.destroy_process_group()


def test_timeout_of_validates_and_converts() -> None:
    given = datetime.timedelta(minutes=3)
    assert timeout_of(None, given) is given
    assert timeout_of(None, 7) == datetime.timedelta(seconds=7)
    for bad in (0, -1.0, float("nan"), True, "5", [5]):
        with pytest.raises(ValueError, match=re.escape(f"timeout must be a positive number of seconds or a timedelta, got {bad!r}")):
            timeout_of(None, bad)  # type: ignore[arg-type]


def test_own_group_takes_the_callers_timeout_else_the_base_groups(one_rank: dist.ProcessGroup) -> None:
    assert timeout_of(one_rank, None) == GROUP_TIMEOUT
    assert timeout_of(None, None) == GROUP_TIMEOUT  # None is the default group, as everywhere in torch
    group, error = own_group(None, 12.5)
    assert error is None and timeout_of(group, None) == datetime.timedelta(seconds=12.5)
    assert dist.get_process_group_ranks(group) == [0] and device_of(group) == torch.device("cpu")
    group, error = own_group(one_rank, -1)  # refused: reported, and the base group's timeout used
    assert error and "got -1" in error and timeout_of(group, None) == GROUP_TIMEOUT
    inner, error = own_group(group, None)
    assert error is None and timeout_of(inner, None) == GROUP_TIMEOUT


def test_an_nccl_groups_timeout_is_read_from_its_cuda_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """An NCCL group has a backend for CUDA only (torch's backend config ``cuda:nccl``; a CPU read
    raises), while gloo answers for both: a stand-in NCCL group, so the check needs no GPU."""
    timeout = datetime.timedelta(seconds=41)

    class Nccl:
        def _get_backend(self, device: torch.device) -> SimpleNamespace:
            if device.type != "cuda":
                raise RuntimeError(f"No backend type associated with device type {device.type}")
            return SimpleNamespace(options=SimpleNamespace(_timeout=timeout))

    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    assert timeout_of(Nccl(), None) == timeout  # type: ignore[arg-type]


def test_own_group_before_init_process_group_says_so() -> None:
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="torch.distributed is not initialized"):
        own_group(None)


# ---------------------------------------------------------------- probe

class _Recorded(NoCompression):
    """``none``, recording the sizes it encodes (a class list: the probe deep-copies it)."""

    sizes: list[int] = []

    def _encode(self, x, ctx):  # noqa: ANN001,ANN202
        type(self).sizes.append(x.numel())
        return super()._encode(x, ctx)


def test_probe_measures_the_documented_points(one_rank: dist.ProcessGroup, monkeypatch: pytest.MonkeyPatch) -> None:
    reduced: list[int] = []
    real = dist.all_reduce
    monkeypatch.setattr(dist, "all_reduce", lambda t, *a, **k: (reduced.append(t.numel() * t.element_size()),
                                                                 real(t, *a, **k))[1])
    reps_seen: set[int] = set()

    def timer(fn, reps):  # noqa: ANN001,ANN202
        reps_seen.add(reps)
        fn()
        return 1e-3

    _Recorded.sizes = []
    fits = measure(one_rank, _Recorded(), timer=timer).fits()
    # docs/strategies.md: the collectives at 1 KB-1 MB, encode/decode at 1 K-512 K elements, median of 5 timings
    assert reps_seen == {5}
    assert min(reduced) == 1 << 10 and max(reduced) == 1 << 20 and len(set(reduced)) == len(reduced) >= 3
    encoded = sorted(set(_Recorded.sizes))
    assert encoded[0] == 1 << 10 and encoded[-1] == 1 << 19 and len(encoded) >= 3
    # none's packet is 4 bytes per float32 element: wire and root_wire exactly 4 d (no overhead, no intercept)
    for field in ("wire", "root_wire"):
        assert fits[field] == pytest.approx([0.0, 0.0, 4.0], abs=1e-9), (field, fits[field])
    assert fits["p2p"] == [0.0, 0.0, 0.0]  # one rank: no neighbour


def test_probe_leaves_the_compressor_and_the_random_streams_alone(one_rank: dist.ProcessGroup) -> None:
    torch.manual_seed(5)
    before = torch.get_rng_state()
    compressor = NoCompression()
    state = dict(vars(compressor))
    measure(one_rank, compressor, timer=lambda fn, reps: (fn(), 1e-3)[1], comm_sizes=(1024, 4096),
            compute_sizes=(1024, 4096), reps=1)
    assert torch.equal(torch.get_rng_state(), before) and vars(compressor) == state

