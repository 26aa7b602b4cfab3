"""CPU compile checks: KdaWide and KdaStream compile for sm_90a and sm_100a (no GPU)."""

from __future__ import annotations

import pytest
from compile_harness import ARCHS, compile_for, fake_stream, fake_tensor, require_dsl

pytestmark = pytest.mark.compile


def fake_args(heads, tokens, *, record=False, has_bias=True, conv_dim_first=True, window=None):
    """The kernels' arguments: fake ``KernelOperands`` and a fake stream."""
    require_dsl()
    from cutlass import BFloat16, Float32, Int32

    B, T, D = 3, tokens, heads * 128
    W = window or T + 2
    S = 1 + B * T
    conv_shape = (S, 3 * D, W)
    conv_order = (2, 1, 0) if conv_dim_first else (2, 0, 1)
    from kda.operands import KernelOperands

    values = [
        fake_tensor(BFloat16, (B * T, 3 * D)),  # x
        fake_tensor(BFloat16, (3, 4, D)),  # conv_weight
        fake_tensor(BFloat16, (3 * D,) if has_bias else (1,)),  # conv_bias
        fake_tensor(BFloat16, conv_shape, stride_order=conv_order),  # conv_state
        fake_tensor(BFloat16, (B * T, 128)),  # f_a
        fake_tensor(BFloat16, (B * T, heads)),  # beta
        fake_tensor(Float32, (heads,)),  # a_log
        fake_tensor(Float32, (D,)),  # dt_bias
        fake_tensor(Int32, (B,) if T == 1 else (B, T)),  # slots
        fake_tensor(Float32, (S, heads, 128, 128)),  # state
        fake_tensor(BFloat16, (B * T, D)),  # output
        fake_tensor(BFloat16, (B * T, D)),  # gate
        fake_tensor(BFloat16, (128,)),  # norm_weight
        Float32(-5.0),
        Float32(128**-0.5),
        Float32(1e-6),
        fake_tensor(BFloat16, (D, 128)),  # f_b
        fake_tensor(Int32, (B,)),  # accepted
        fake_tensor(Float32, (B, heads, T, 128) if record else (1,)),  # v_records
        fake_tensor(BFloat16, (B, heads, T, 256) if record else (1,)),  # kg_records
    ]
    return [KernelOperands(*values), fake_stream()]


def dynamic_args(heads, tokens, state_dtype="fp32", **kw):
    """``fake_args`` with the batch's extents dynamic, as the launcher compiles (``to_cute``
    views): rows (B * T), requests (B) and the pools' slots (S). ``fake_args``' static
    extents let the compiler fold ``// requests`` into multiplies, so its PTX (and ptxas'
    registers and spills) is not the launched kernel's."""
    cute = require_dsl()
    from cutlass import BFloat16, Float32, Int32

    operands, stream = fake_args(heads, tokens, **kw)
    rows, batch, pool = cute.sym_int(), cute.sym_int(), cute.sym_int()
    D, W = heads * 128, operands.conv_state.shape[2]
    conv_order = (2, 1, 0) if kw.get("conv_dim_first", True) else (2, 0, 1)
    page = BFloat16 if state_dtype == "bf16" else Float32
    operands = operands._replace(
        x=fake_tensor(BFloat16, (rows, 3 * D)),
        conv_state=fake_tensor(BFloat16, (pool, 3 * D, W), stride_order=conv_order),
        f_a=fake_tensor(BFloat16, (rows, 128)),
        beta=fake_tensor(BFloat16, (rows, heads)),
        slots=fake_tensor(Int32, (batch,) if tokens == 1 else (batch, tokens)),
        state=fake_tensor(page, (pool, heads, 128, 128)),
        output=fake_tensor(BFloat16, (rows, D)),
        gate=fake_tensor(BFloat16, (rows, D)),
        accepted=fake_tensor(Int32, (batch,)),
    )
    return [operands, stream]


WIDE_CASES = [
    # heads, tokens, record, gate_mode, has_bias, ahead, pdl
    (2, 1, False, 0, True, 0, False),
    (2, 5, False, 3, True, 0, False),
    (2, 8, True, 3, False, 264, True),
    (3, 4, False, 1, False, 264, True),
    (2, 8, True, 0, True, 0, True),
    (2, 1, False, 3, True, 0, False),
    (3, 4, True, 3, False, 264, True),
]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("case", WIDE_CASES, ids=lambda c: "H{}T{}r{}g{}b{}a{}p{}".format(*c))
def test_wide_compiles(arch, case):
    require_dsl()
    from kda.kernels.wide import KdaWide

    heads, tokens, record, gate_mode, has_bias, ahead, pdl = case
    kernel = KdaWide(heads, tokens, record, gate_mode, has_bias, ahead, arch=arch, pdl=pdl)
    args = fake_args(heads, tokens, record=record, has_bias=has_bias)
    assert compile_for(arch, kernel, *args) is not None


STREAM_CASES = [
    # heads, tokens, record, gate_mode, has_bias, conv_dim_first, window
    (2, 1, False, 0, True, True, 4),
    (3, 5, False, 1, False, False, 8),
    (2, 8, True, 0, True, False, 10),
    (2, 2, True, 1, False, True, 6),
    (2, 3, True, 3, False, True, 6),
    (3, 1, False, 3, True, False, 3),
    (2, 1, False, 3, True, True, 4),
    (3, 3, True, 3, False, False, 6),
]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("case", STREAM_CASES, ids=lambda c: "H{}T{}r{}g{}b{}d{}W{}".format(*c))
def test_stream_compiles(arch, case):
    require_dsl()
    from kda.kernels.stream import KdaStream

    heads, tokens, record, gate_mode, has_bias, dim_first, window = case
    kernel = KdaStream(
        heads, tokens, record, gate_mode, has_bias, dim_first, window, ctas=8, arch=arch
    )
    args = fake_args(
        heads, tokens, record=record, has_bias=has_bias, conv_dim_first=dim_first, window=window
    )
    assert compile_for(arch, kernel, *args) is not None


def test_packed_fma_switch():
    from kda import dispatch

    assert dispatch.has_packed_fma("sm_100a")
    assert not dispatch.has_packed_fma("sm_90a")


PIPE_CASES = [
    # heads, tokens, gate_mode, has_bias, conv_dim_first, window
    (2, 1, 3, True, True, 3),
    (3, 1, 0, False, False, 4),
    (2, 2, 3, False, False, 5),
    (3, 4, 3, True, True, 6),
]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("case", PIPE_CASES, ids=lambda c: "H{}T{}g{}b{}d{}W{}".format(*c))
def test_pipe_compiles(arch, case):
    require_dsl()
    from kda.kernels.pipe import KdaPipe

    heads, tokens, gate_mode, has_bias, dim_first, window = case
    kernel = KdaPipe(heads, tokens, gate_mode, has_bias, dim_first, window, ctas=8, arch=arch)
    args = fake_args(heads, tokens, has_bias=has_bias, conv_dim_first=dim_first, window=window)
    assert compile_for(arch, kernel, *args) is not None
