"""CPU compile checks of KdaReplay (kda.replay) for sm_90a and sm_100a (its ptxas register
and spill report: test_kda_replay_resources.py)."""

from __future__ import annotations

import pytest
from compile_harness import ARCHS, compile_for, fake_stream, fake_tensor, require_dsl

pytestmark = pytest.mark.compile


def replay_args(heads, size, tokens=1, *, has_bias=True, conv_dim_first=True):
    """KdaReplay's arguments: fake ``ReplayKernelOperands`` and a fake stream."""
    require_dsl()
    from cutlass import BFloat16, Float32, Int32

    B, T, D, S = 3, tokens, heads * 128, 1 + 3 * tokens
    N, W = B * T, T + 2
    conv_order = (2, 1, 0) if conv_dim_first else (2, 0, 1)
    from kda.operands import ReplayKernelOperands

    values = [
        fake_tensor(BFloat16, (N, 3 * D)),  # x
        fake_tensor(BFloat16, (3, 4, D)),  # conv_weight
        fake_tensor(BFloat16, (3 * D,) if has_bias else (1,)),  # conv_bias
        fake_tensor(BFloat16, (S, 3 * D, W), stride_order=conv_order),  # conv_state
        fake_tensor(BFloat16, (N, 128)),  # f_a
        fake_tensor(BFloat16, (N, heads)),  # beta
        fake_tensor(Float32, (heads,)),  # a_log
        fake_tensor(Float32, (D,)),  # dt_bias
        fake_tensor(Int32, (B,) if T == 1 else (B, T)),  # slots
        fake_tensor(Float32, (S, heads, 128, 128)),  # state
        fake_tensor(BFloat16, (N, D)),  # output
        fake_tensor(BFloat16, (N, D)),  # gate
        fake_tensor(BFloat16, (128,)),  # norm_weight
        Float32(-5.0),
        Float32(128**-0.5),
        Float32(1e-6),
        fake_tensor(BFloat16, (D, 128)),  # f_b
        fake_tensor(Int32, (B,)),  # accepted
        fake_tensor(Float32, (S, size, heads, 128)),  # ring_v
        fake_tensor(BFloat16, (S, size, heads, 256)),  # ring_kg
        fake_tensor(Int32, (S, heads, 2)),  # ring_length
    ]
    return [ReplayKernelOperands(*values), fake_stream()]


CASES = [
    # heads, size, tokens, gate_mode, has_bias, conv_dim_first, pdl
    (2, 8, 1, 0, True, True, False),
    (3, 2, 1, 3, False, False, True),
    (6, 16, 1, 1, True, False, True),
    (96, 4, 1, 3, True, True, False),
    (3, 4, 4, 0, True, False, True),
    (6, 16, 8, 3, False, True, False),
    (2, 2, 2, 1, True, True, True),
    (2, 8, 1, 3, True, True, True),  # gate mode 3 (the default): bounded mma + exact recompute
    (96, 16, 1, 3, False, False, False),
    (3, 4, 4, 3, True, False, True),
    (6, 8, 8, 3, True, True, False),
]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "H{}R{}T{}g{}b{}d{}p{}".format(*c))
def test_replay_compiles(arch, case):
    require_dsl()
    from kda.kernels.replay import KdaReplay

    heads, size, tokens, gate_mode, has_bias, dim_first, pdl = case
    kernel = KdaReplay(heads, size, tokens, gate_mode, has_bias, arch=arch, pdl=pdl)
    args = replay_args(heads, size, tokens, has_bias=has_bias, conv_dim_first=dim_first)
    assert compile_for(arch, kernel, *args) is not None


def test_refuses_removed_gate_mode():
    """Gate mode 2 is gone (as KdaWide's): KdaReplay refuses it."""
    require_dsl()
    from kda.kernels.replay import KdaReplay

    with pytest.raises(ValueError, match="gate_mode must be 0, 1 or 3"):
        KdaReplay(3, 8, 1, 2)
