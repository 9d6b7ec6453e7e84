"""When and how the kit compiles a declaration's element-wise kernel.

``torch.compile`` (Inductor: C++/OpenMP on CPU, Triton on CUDA) turns a
kernel written with ordinary tensor ops into one fused loop: the element
reads, the counter-based random bits, the arithmetic and the bit packing in
one pass instead of one eager pass each.

Policy (``GRADPRESS_COMPILE``, read at every call):

* ``auto`` (default; also the empty string): compile when the tensor has at least
  :data:`MIN_COMPILE_NUMEL` elements (16K: below that a compiled call's
  guards and launch cost about what the eager ops do); eager otherwise.
  One compile per kernel serves every larger size (dynamic shapes); the
  test suite sets ``GRADPRESS_COMPILE=0`` (tests/conftest.py).
* ``1``/``on``/``true``: compile at every size (the dedicated tests).
* ``0``/``off``/``false``: never compile (the eager fallback).

Any case, spaces around ignored (:data:`_MODES`); another value is a
ValueError showing it as given and listing these.

Each kernel is compiled with dynamic shapes, so one compile serves every
size of one (kernel, dtype, device, static parameters) class; the compiled
callables are cached here, one per kernel and signature (the tensors' dtypes
and devices, the static parameters other than numbers, which Dynamo keeps
symbolic where it can), each a code object of its own: Dynamo counts recompiles (at most
8) per code object, so one kernel called with several dtypes and widths in
one process (qsgd at three level counts and four dtypes did) would
otherwise run its later signatures eagerly. A kernel whose
compilation fails (no C++ compiler, an Inductor gap) falls back to eager for
the rest of the process, with one warning. Eager and compiled kernels are
the same ops on the same inputs and give bit-identical results for the
element-wise integer and IEEE arithmetic the declarations use (tested, on
CPU in the suite and on CUDA in tests/test_cuda.py). Two declarations
compute more when compiled: ``onebit``'s side sums and TernGrad's clipping
deviation (``kit.std``) accumulate in fp64 (:func:`will_compile` picks the
path): ``onebit``'s two means may differ from eager's in the last bit
(its sign bits do not), and TernGrad's scale is the exact deviation
rounded once where eager's fp32 passes drift with the size (3.6e-5
relative at 2M entries), so the two differ by more there. Kernels run as one
graph (``fullgraph``): one Dynamo cannot trace whole fails to compile and
runs eagerly. Byte-identity on CUDA needs two
Inductor options (:data:`EAGER_NUMERICS`): by default Triton contracts
``a * b + c`` into one fused multiply-add and lowers ``/`` to an
approximate division. On an H200 the compiled ``minmax8:stochastic``
then differed from eager (codes where ``(x - lo) * (1 / step) + u`` lands
within a rounding of an integer round the other way); with both options
set it matched byte for byte. Where a torch lacks an option, the kernel
compiles without it.
"""

from __future__ import annotations

import contextlib
import os
import types
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["EAGER_NUMERICS", "MIN_COMPILE_NUMEL", "NEEDED", "compiled_count", "compiles", "is_compiled", "cpu_only", "cpu_reduction", "forced", "into",
           "keeps_eager_numerics", "mode", "run", "will_compile"]

#: smallest tensor that ``auto`` compiles for
MIN_COMPILE_NUMEL = 1 << 14

#: Inductor options that keep compiled arithmetic eager's: no FMA contraction (Triton's enable_fp_fusion) and
#: correctly rounded division. On CPU the generated C++ matched eager without them (tests/test_kit_compile.py);
#: ``emulate_precision_casts`` also keeps fp16/bf16 round trips that Inductor would elide, on every device
EAGER_NUMERICS = ("emulate_precision_casts", "eager_numerics.division_rounding")

_MODES = {"auto": "auto", "": "auto", "1": "on", "on": "on", "true": "on", "0": "off", "off": "off", "false": "off"}
_cache: dict[tuple[Callable[..., Any], tuple[Any, ...]], Callable[..., Any]] = {}
_failed: set[Callable[..., Any]] = set()
_forced: list[str] = []


def mode() -> str:
    """``"auto"``, ``"on"`` or ``"off"``: :func:`forced` if active, else
    ``GRADPRESS_COMPILE``; ValueError naming an unknown value."""
    if _forced:
        return _forced[-1]
    given = os.environ.get("GRADPRESS_COMPILE", "auto")
    raw = given.strip().lower()
    if raw not in _MODES:
        raise ValueError(f"GRADPRESS_COMPILE got {given!r}; allowed: {_allowed_modes()}")
    return _MODES[raw]


def _allowed_modes() -> str:
    """Every value :data:`_MODES` accepts, grouped by the mode it selects
    (the error message's list: from the parser's own table)."""
    groups: dict[str, list[str]] = {}
    for value, m in _MODES.items():
        groups.setdefault(m, []).append(repr(value))
    return "; ".join(f"{', '.join(values)} ({m})" for m, values in groups.items()) + \
        " (any case, spaces around ignored)"


@contextlib.contextmanager
def forced(value: str) -> Iterator[None]:
    """Within the block, use compile mode ``value`` ("auto", "on", "off")
    whatever the environment says (benchmarks and tests)."""
    if value not in ("auto", "on", "off"):
        raise ValueError(f"compile mode got {value!r}; allowed: auto, on, off")
    _forced.append(value)
    try:
        yield
    finally:
        _forced.pop()


def compiles(numel: int, device_type: str) -> bool:
    """Whether the policy compiles a kernel over ``numel`` elements on
    ``device_type``: always under ``on``; under ``auto`` from
    :data:`MIN_COMPILE_NUMEL` elements, where :func:`keeps_eager_numerics`."""
    m = mode()
    return m == "on" or (m == "auto" and numel >= MIN_COMPILE_NUMEL and keeps_eager_numerics(device_type))


#: the :data:`EAGER_NUMERICS` options ``auto`` needs per device type. CUDA: both (Triton's FMA and approximate
#: division differ from eager without them, docs/results/cuda-h200.md). CPU: ``emulate_precision_casts``, as a
#: marker of the Inductor releases whose C++ matched eager where measured (2.6.0 and 2.13.0: the five kit codes
#: byte for byte; the releases between were not run); 2.2.2, which lacks it, gave other ``minmax8:stochastic``
#: bytes (its C++ flags differ: -ffast-math as a whole, no -ffp-contract=off; which flag matters is not known)
NEEDED = {"cuda": EAGER_NUMERICS, "cpu": ("emulate_precision_casts",)}


def keeps_eager_numerics(device_type: str = "cpu") -> bool:
    """Whether this torch's Inductor knows the options :data:`NEEDED` on
    ``device_type`` (another device type: every :data:`EAGER_NUMERICS` one)."""
    return set(NEEDED.get(device_type, EAGER_NUMERICS)) <= set(_options())


def compiled_count() -> int:
    """Number of (kernel, signature) variants compiled so far in this process."""
    return len(_cache)


def is_compiled(kernel: Callable[..., Any]) -> bool:
    """Whether some signature of ``kernel`` has been compiled in this process
    (kernels compare equal, as the cache's keys do: each ``obj.method`` is a
    new bound-method object, equal to the one cached, never identical)."""
    return any(k == kernel for k, _ in _cache)


def _numeric(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _signature(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """What a compiled graph specializes on besides shapes: every tensor's
    dtype and device type, and the static parameters but numbers. Dynamo
    keeps an int or a float symbolic unless the kernel branches on it (then
    it recompiles within the variant): a variant per value would compile
    anew for every value, every step for a kernel handed the step number."""
    def part(v: Any) -> Any:
        return (v.dtype, v.device.type) if isinstance(v, torch.Tensor) else v

    key = tuple(part(a) for a in args if not _numeric(a)) + tuple(
        (k, part(v)) for k, v in sorted(kwargs.items()) if not _numeric(v))
    try:
        hash(key)
    except TypeError:  # an unhashable static parameter: one variant for all of them
        return ("unhashable",)
    return key


def _variant(kernel: Callable[..., Any], index: int) -> Callable[..., Any]:
    """``kernel`` as a function over a copy of its code object (its own Dynamo
    cache and recompile count); a callable without one is used as is."""
    code = getattr(kernel, "__code__", None)
    if code is None or not isinstance(kernel, types.FunctionType):
        return kernel
    fn = types.FunctionType(code.replace(co_name=f"{code.co_name}_v{index}"), kernel.__globals__, kernel.__name__,
                            kernel.__defaults__, kernel.__closure__)
    fn.__kwdefaults__ = kernel.__kwdefaults__
    fn.__qualname__ = kernel.__qualname__
    return fn


_known_options: list[dict[str, bool]] = []


def _options() -> dict[str, bool]:
    """The :data:`EAGER_NUMERICS` options this torch knows (read once)."""
    if not _known_options:
        try:
            from torch._inductor import config

            known = set(config.get_config_copy())
        except Exception:  # noqa: BLE001 - no Inductor: torch.compile fails and the kernel runs eagerly
            known = set()
        _known_options.append({name: True for name in EAGER_NUMERICS if name in known})
    return dict(_known_options[0])


_warned_numerics: list[bool] = []


def _warn_missing_numerics(options: dict[str, bool], device_type: str) -> None:
    """Once per process: a kernel compiled on ``device_type`` without an
    option :data:`NEEDED` there (``options``: those it gets; only under
    ``on``, see :func:`compiles`) may differ from eager in the last bit of a
    code."""
    missing = [n for n in NEEDED.get(device_type, EAGER_NUMERICS) if n not in options]
    if missing and not _warned_numerics:
        _warned_numerics.append(True)
        warnings.warn(f"gradpress kit: this torch's Inductor lacks {', '.join(missing)}; compiled {device_type} "
                      "kernels may round a few codes differently from eager (unset GRADPRESS_COMPILE=on for "
                      "eager's bytes)", RuntimeWarning, stacklevel=3)


def _device_type(args: tuple[Any, ...]) -> str:
    return next((a.device.type for a in args if isinstance(a, torch.Tensor)), "cpu")


_cpu_only: set[Callable[..., Any]] = set()


def cpu_only(kernel: Callable[..., Any]) -> Callable[..., Any]:
    """Mark ``kernel`` as one that ``auto`` compiles on CPU only (``on``
    compiles it everywhere): a kernel measured faster compiled on CPU and
    either measured slower or never measured compiled on an accelerator,
    where the eager ops then run."""
    _cpu_only.add(kernel)
    return kernel


def cpu_reduction(kernel: Callable[..., Any]) -> Callable[..., Any]:
    """:func:`cpu_only` for a whole-tensor reduction. On an H200, Inductor's
    dynamic-shape reductions over a whole 25M-entry tensor ran about ten
    times slower than the eager ops (onebit's fp64 side sums 2.1 ms per call
    against 0.2 ms for the whole eager encode; a sign pack 1.9 ms),
    docs/results/cuda-h200.md; on CPU the same kernels are the fast path."""
    return cpu_only(kernel)


def _policy_allows(kernel: Callable[..., Any], numel: int, device_type: str) -> bool:
    if _BASE.get(kernel, kernel) in _failed or not compiles(numel, device_type):
        return False
    return device_type == "cpu" or kernel not in _cpu_only or mode() == "on"


def will_compile(kernel: Callable[..., Any], numel: int, device_type: str) -> bool:
    """Whether :func:`run` would run ``kernel`` compiled over ``numel``
    elements on ``device_type`` (the policy says so and its compilation has
    not failed in this process): for a declaration whose compiled kernel
    computes more than eager could afford, e.g. ``onebit``'s one-pass fp64
    side sums (:func:`cpu_reduction` kernels: on CPU only, under ``auto``)."""
    return _policy_allows(kernel, numel, device_type)


def run(kernel: Callable[..., Any], numel: int, *args: Any, **kwargs: Any) -> Any:
    """``kernel(*args, **kwargs)``, compiled when the policy says so for a
    tensor of ``numel`` elements, eager otherwise."""
    device_type = _device_type(args)
    if not _policy_allows(kernel, numel, device_type):
        return kernel(*args, **kwargs)
    key = (kernel, _signature(args, kwargs))
    fn = _cache.get(key)
    if fn is None:
        options = _options()
        _warn_missing_numerics(options, device_type)
        # fullgraph: a kernel Dynamo cannot trace whole fails here (eager, one warning) instead of running as
        # several graphs with eager code between them (math.gcd in the packing once split every fused pack so)
        fn = _cache[key] = torch.compile(_variant(kernel, len(_cache)), dynamic=True, fullgraph=True,
                                         options=options)
    try:
        return fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - any compiler failure falls back to the same ops, eager
        if _recompile_limit(exc):  # this call's shapes only: the ones compiled before stay compiled
            _warn_recompile_limit(kernel)
            return kernel(*args, **kwargs)
        base = _BASE.get(kernel, kernel)  # a kernel and its ``into`` variant fail together: one warning
        _failed.add(base)
        for k in [k for k in _cache if _BASE.get(k[0], k[0]) == base]:  # equal, as in _failed (bound methods)
            del _cache[k]
        warnings.warn(f"gradpress kit: compiling {kernel.__qualname__} failed ({type(exc).__name__}: {exc}); "
                      "running it eagerly from now on", RuntimeWarning, stacklevel=2)
        return kernel(*args, **kwargs)


def _recompile_limit(exc: BaseException) -> bool:
    """Dynamo's recompile limit (at most 8 compiled graphs per code object
    by default: here per kernel and signature), which ``fullgraph`` turns
    into an exception: the call runs eagerly, the kernel is not marked
    failed."""
    return type(exc).__name__ in ("FailOnRecompileLimitHit", "FailOnCacheLimitHit")


_warned_limit: set[Callable[..., Any]] = set()


def _warn_recompile_limit(kernel: Callable[..., Any]) -> None:
    if kernel not in _warned_limit:
        _warned_limit.add(kernel)
        warnings.warn(f"gradpress kit: {kernel.__qualname__} reached Dynamo's recompile limit (torch._dynamo.config."
                      "recompile_limit) for one signature (dtypes and static parameters); calls that need another "
                      "graph there run eagerly, the compiled ones stay compiled", RuntimeWarning, stacklevel=3)


_INTO: dict[Callable[..., Any], Callable[..., None]] = {}
#: each ``into`` variant's kernel (a compile failure of either marks the kernel failed)
_BASE: dict[Callable[..., Any], Callable[..., Any]] = {}


def into(kernel: Callable[..., torch.Tensor]) -> Callable[..., None]:
    """``kernel`` writing its result into a given ``out`` (one per kernel, so
    the compiler caches it): compiled, the kernel stores straight into the
    caller's buffer, with no result tensor to copy afterwards."""
    fn = _INTO.get(kernel)
    if fn is None:
        def fn(out: torch.Tensor, *args: Any, **kwargs: Any) -> None:
            out.copy_(kernel(*args, **kwargs).reshape(out.shape))

        name = getattr(kernel, "__qualname__", type(kernel).__name__)
        fn.__qualname__ = f"{name}[into]"
        # a code object of its own: Dynamo caches compiled graphs (and counts recompiles, at most 8) per code
        # object, so wrappers sharing one would share that limit and later kernels would silently run eagerly
        fn.__code__ = fn.__code__.replace(co_name=f"into_{len(_INTO)}")
        fn = _INTO.setdefault(kernel, fn)
        _BASE[fn] = kernel
    return fn
