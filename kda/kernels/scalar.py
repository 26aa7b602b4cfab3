"""The scalar fp32 math of the KDA kernels (re-exported by ``kda.kernels.device``): the
roundings to bf16, the fast ``exp`` and its exactly rounded form, the SiLU, the sigmoid,
``rsqrt``, and the decay of a raw gate in either gate form (``kda.validate.GATE_FORMS``,
a trace-time choice of each kernel: ``decay``'s ``softplus_gate``), fast (the decode
kernels, KdaRecover, KdaReplay's step) and exact (``decay_exact``: KdaFold, the reference's
rounding points). Accuracy: ``kda.kernels.device``'s module docstring."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Float64, Int32


def to_bf16_f32(value):
    """Round an fp32 value to bf16 (nearest even) and back."""
    return Float32(BFloat16(value))


SILU_MARGIN = 16  # fp32 ulps around a bf16 midpoint where the SiLU takes the exact path


def exp_f32(value):
    """Fast fp32 ``exp`` (CUDA's ``expf``: within 2 ulp)."""
    return cute.math.exp(Float32(value))


def exp_f32_exact(value):
    """``exp`` rounded once to fp32 from an fp64 evaluation: the reference's ``_exp``."""
    return Float32(cute.math.exp(Float64(value)))


def f32_bits(value):
    """The 32 bits of an fp32 value as Int32 (no memory access)."""
    return cute.arch.inline_ptx(
        "mov.b32 {$w0}, {$r0};", write_only_types=[Int32], read_only_args=[Float32(value)]
    )


def add_rn(a, b):
    """``a + b`` as ``add.rn.f32``: never contracted into an FMA with the product that
    feeds it (the reference rounds the product first, e.g. ``1 + exp(-x)``)."""
    return cute.arch.inline_ptx(
        "add.rn.f32 {$w0}, {$r0}, {$r1};",
        write_only_types=[Float32],
        read_only_args=[Float32(a), Float32(b)],
    )


def sigmoid(value):
    """``1 / (1 + exp(-x))``."""
    return Float32(1.0) / add_rn(Float32(1.0), exp_f32(-value))


@cute.jit
def silu_bf16(value: Float32) -> Float32:
    """The convolution's SiLU ``x / (1 + exp(-x))``, rounded to bf16 (returned as fp32),
    bit for bit the reference's (fp64-evaluated exp): the fast quotient is within a few
    ulps of the exact one, so its bf16 rounding can only differ when it lies within
    ``SILU_MARGIN`` ulps of a midpoint (low 16 bits near 0x8000); then recompute exactly."""
    x = Float32(value)
    y = x / add_rn(Float32(1.0), exp_f32(-x))
    low = f32_bits(y) & Int32(0xFFFF)
    near = (low - Int32(0x8000) <= Int32(SILU_MARGIN)) & (Int32(0x8000) - low <= Int32(SILU_MARGIN))
    if near:
        y = x / add_rn(Float32(1.0), exp_f32_exact(-x))
    return to_bf16_f32(y)


def rsqrt_f32(value):
    """``1 / sqrt(x)`` with both operations correctly rounded."""
    return Float32(1.0) / cute.math.sqrt(value)


SOFTPLUS_THRESHOLD = 20.0  # torch's F.softplus (beta 1) and fla's gate: x above it


def softplus(value):
    """``x`` where ``x > 20``, else ``log1p(exp(x))`` (fast ``exp``, libdevice ``log1pf``;
    no branch: the ``exp`` of a larger x may overflow, the select drops it)."""
    x = Float32(value)
    smooth = cute.math.log1p(exp_f32(x))
    return cutlass.select_(x > Float32(SOFTPLUS_THRESHOLD), x, smooth)


def decay(a_log, raw_g, dt, lower_bound, softplus_gate=False):
    """``exp(lower_bound * sigmoid(exp(a_log) * (raw_g + dt_bias)))``; ``softplus_gate``
    (trace time): ``exp(-(exp(a_log) * softplus(raw_g + dt_bias)))``, ``lower_bound``
    unread."""
    if softplus_gate:
        return exp_f32(-(exp_f32(a_log) * softplus(raw_g + dt)))
    return exp_f32(lower_bound * sigmoid(exp_f32(a_log) * (raw_g + dt)))


def sigmoid_exact(value):
    """``1 / (1 + exp(-x))`` evaluated in fp64 and rounded once to fp32 (the reference's
    ``_sigmoid``)."""
    return Float32(Float64(1.0) / (Float64(1.0) + cute.math.exp(-Float64(value))))


def softplus_exact(value):
    """``x`` where ``x > 20``, else ``log1p(exp(x))`` evaluated in fp64 and rounded once to
    fp32 (the reference's ``_softplus``)."""
    x = Float32(value)
    smooth = Float32(cute.math.log1p(cute.math.exp(Float64(x))))
    return cutlass.select_(x > Float32(SOFTPLUS_THRESHOLD), x, smooth)


def decay_exact(a, raw_g, dt, lower_bound, softplus_gate=False):
    """The reference's ``_decay``: ``a = exp(a_log)`` (exactly rounded, given), ``raw_g + dt``
    and the products in fp32, the fp64 sigmoid (or softplus), the exactly rounded ``exp``."""
    if softplus_gate:
        return exp_f32_exact(-(a * softplus_exact(raw_g + dt)))
    return exp_f32_exact(lower_bound * sigmoid_exact(a * (raw_g + dt)))
