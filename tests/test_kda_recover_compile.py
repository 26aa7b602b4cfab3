"""CPU compile checks: KdaRecover compiles for sm_90a and sm_100a (no GPU)."""

from __future__ import annotations

import pytest
from compile_harness import ARCHS, compile_for, fake_stream, fake_tensor, require_dsl

pytestmark = pytest.mark.compile


def recover_args(heads, tokens, requests=3, slot_columns=None):
    """KdaRecover's arguments: fake ``RecoverKernelOperands`` and a fake stream."""
    require_dsl()
    from cutlass import BFloat16, Float32, Int32

    B, T, H = requests, tokens, heads
    S = 1 + B * T
    from kda.operands import RecoverKernelOperands

    values = [
        fake_tensor(Float32, (S, H, 128, 128)),  # state
        fake_tensor(Int32, (B, slot_columns or T)),  # slots
        fake_tensor(Float32, (B, H, T, 128)),  # v_records
        fake_tensor(BFloat16, (B, H, T, 256)),  # kg_records
        fake_tensor(Float32, (H,)),  # a_log
        fake_tensor(Float32, (H * 128,)),  # dt_bias
        fake_tensor(Int32, (B,)),  # accepted
        fake_tensor(Int32, (B,)),  # checkpoint
        Float32(-5.0),
    ]
    return [RecoverKernelOperands(*values), fake_stream()]


CASES = [(2, 2, False), (3, 5, True), (6, 8, False)]  # heads, tokens, pdl


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "H{}T{}p{}".format(*c))
def test_recover_compiles(arch, case):
    require_dsl()
    from kda.kernels.recover import KdaRecover

    heads, tokens, pdl = case
    kernel = KdaRecover(heads, tokens, arch=arch, pdl=pdl)
    columns = tokens + 1 if pdl else None  # a slot table wider than T
    assert compile_for(arch, kernel, *recover_args(heads, tokens, slot_columns=columns)) is not None


def test_recover_config_errors():
    require_dsl()
    from kda.kernels.recover import KdaRecover

    with pytest.raises(ValueError, match="tokens"):
        KdaRecover(2, 1)
    with pytest.raises(ValueError, match="heads"):
        KdaRecover(0, 2)
