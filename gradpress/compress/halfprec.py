"""``fp16`` and ``bf16``: cast to 16 bits, exchange, cast back.

Summable (the half-precision payloads add elementwise). The strategies scale
summable packets by 1/N before encoding (as PyTorch's ``fp16_compress_hook``
does), and bound each summand (:meth:`_Cast.bound_summand`) so that the sum
of N payloads, added in 16 bits, saturates near the format's maximum
instead of overflowing to inf: an average of fp32 gradients beyond 65504
is finite (about +-65504), not inf. The cast saturates at the target's
largest finite value instead of overflowing to inf.

Under a loss scaler (``Context.loss_scaler``: the DDP hook following a
``GradScaler``) neither holds: the cast is the plain one (round to nearest,
Inf beyond the format's range: fp16 from 65520) and the summands are not
bounded (:func:`gradpress.exchange.base.bound_summand`), so an overflow of
the scaled gradient or of its 16-bit sum is Inf, as in plain fp16 AMP with
PyTorch's ``fp16_compress_hook``: the scaler skips the step and lowers the
scale. Saturating would hide it: the scaler would never back off and every
update beyond the range would be silently clipped. Deterministic
round-to-nearest, so not exactly unbiased; error feedback is off by default
because the error is at the rounding level.

Range (the format's, documented rather than worked around): decode(encode(x))
is exactly ``x.clamp(-max, max)`` rounded to nearest-even in the target and
converted back. fp16: max 65504; normal down to 6.1e-5, subnormal (fewer
significant bits) down to 6.0e-8 = 2^-24; magnitudes below 2^-25 (half the
smallest subnormal) flush to zero, so an fp32 gradient of 1e-8 decodes to
all zeros. bf16: max 3.39e38, fp32's range (normal down to 1.2e-38,
subnormal down to 9.2e-41 = 2^-133); fp64 inputs beyond it saturate or flush
the same way. NaN stays NaN; +-inf saturates to +-max (stays +-inf under a
loss scaler).
"""

from __future__ import annotations

import functools
import weakref

import torch

from gradpress.compress.base import Compressor, Context, Packet, check_decode_out
from gradpress.compress.numerics import compute_dtype, summand_limit
from gradpress.compress.registry import register


class _Cast(Compressor):
    summable = True
    contractive = True  # relative rounding error below 1
    unbiased = False
    target: torch.dtype = torch.float16
    uses_context = False  # a pure function of x (and of ctx.loss_scaler)

    @property
    def default_error_feedback(self) -> bool:
        return False

    def _encode(self, x: torch.Tensor, ctx: Context) -> Packet:
        flat = x.reshape(-1)
        limit = torch.finfo(self.target).max
        # under a loss scaler (ctx.loss_scaler) the plain cast: an overflow is Inf, which the scaler must see
        if not ctx.loss_scaler and x.dtype != self.target and torch.finfo(x.dtype).max > limit \
                and not self._is_bounded(x) and self._may_overflow(flat, limit):
            # saturate instead of overflowing to inf; clamped in fp32 (fp64 inputs in fp64: one rounding)
            flat = flat.to(compute_dtype(x.dtype)).clamp(-limit, limit)
        return Packet([flat.to(self.target).contiguous()], x.shape, x.dtype)

    def bound_summand(self, x: torch.Tensor, summands: int) -> torch.Tensor:
        """Entries beyond :func:`~gradpress.compress.numerics.summand_limit`
        clamped, so the sum of ``summands`` payloads saturates near the
        format's maximum instead of overflowing to inf; ``x`` itself when
        nothing is beyond it (then the packet is bit for bit the unbounded
        one). Clamped in ``x``'s own dtype (exact), at the limit rounded
        toward zero in that dtype: the packet, and so the decoded average,
        keeps the input's dtype on a rank that was bounded as on one that
        was not."""
        if summands <= 1:
            return x
        limit = summand_limit(self.target, summands)
        version = _version(x)  # read before the check: a write after it (another thread's) is not noted as bounded
        if self._may_overflow(x.reshape(-1), limit):
            bound = _toward_zero(limit, x.dtype)
            x = x.clamp(-bound, bound)
            version = _version(x)  # a new tensor, not yet handed to anyone
        self._remember_bounded(x, version)
        return x

    def _remember_bounded(self, x: torch.Tensor, version: int | None) -> None:
        """Note that every entry of ``x`` at ``version`` (its version counter when it was checked or made) is
        within a summand bound (below the format's maximum) or NaN, so that :meth:`_encode` of this very
        tensor, unchanged since, neither reads nor clamps it again: on an accelerator it was a second full
        clamp pass, on CPU a second ``aminmax``. ``version`` None (an inference-mode tensor has no version
        counter): nothing noted."""
        self._bounded = None if version is None else (weakref.ref(x), version)

    def __getstate__(self) -> dict:
        """Pickled and deep-copied without the note of :meth:`_remember_bounded` (a weak reference)."""
        state = dict(self.__dict__)
        state.pop("_bounded", None)
        return state

    def _is_bounded(self, x: torch.Tensor) -> bool:
        """Whether ``x`` is the tensor :meth:`bound_summand` last returned, unchanged since."""
        noted = getattr(self, "_bounded", None)  # one tuple, read once: safe beside another thread's bound
        if noted is None or noted[0]() is not x:
            return False
        return _version(x) == noted[1]

    @staticmethod
    def _may_overflow(flat: torch.Tensor, limit: float) -> bool:
        """False when every entry is finite and within +-limit (then the plain
        cast equals the saturating one). On CPU one fused min/max read decides
        it and saves two full passes; on other devices the clamp is cheap next
        to a host sync, so it always runs."""
        if flat.device.type != "cpu" or flat.numel() == 0:
            return flat.numel() > 0
        lo, hi = torch.aminmax(flat)
        return not bool((lo >= -limit) & (hi <= limit))  # NaN compares False: clamp path

    def decode(self, packet: Packet) -> torch.Tensor:
        return packet.tensors[0].to(packet.dtype).reshape(packet.shape)

    def decode_into(self, packet: Packet, out: torch.Tensor) -> torch.Tensor:
        check_decode_out(packet, out)
        out.view(-1).copy_(packet.tensors[0])
        return out


def _version(x: torch.Tensor) -> int | None:
    """``x``'s version counter (bumped by every in-place write to it or a view of it); None without one."""
    try:
        return x._version
    except (RuntimeError, TypeError):  # inference-mode tensors have none
        return None


@functools.lru_cache(maxsize=64)
def _toward_zero(limit: float, dtype: torch.dtype) -> float:
    """The largest value of ``dtype`` not above ``limit`` (> 0, finite)."""
    value = torch.tensor(limit, dtype=torch.float64).to(dtype)
    if float(value) > limit:  # rounded up: one step toward zero (the next smaller positive value)
        ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[value.element_size()]
        value = (value.view(ints) - 1).view(dtype)
    return float(value)


@register
class Float16(_Cast):
    name = "fp16"
    target = torch.float16
    summary = "IEEE half precision cast (2 bytes/element), summable"


@register
class BFloat16(_Cast):
    name = "bf16"
    target = torch.bfloat16
    summary = "bfloat16 cast (2 bytes/element), summable, fp32 range"
