"""The CPU compile-check harness itself: a small kernel compiles for sm_90a and sm_100a."""

import pytest
from compile_harness import ARCHS, compile_for, fake_stream, fake_tensor, require_dsl


@pytest.mark.compile
@pytest.mark.parametrize("arch", ARCHS)
def test_harness_compiles_for(arch):
    require_dsl()
    import _harness_kernel as k
    import cutlass

    x = fake_tensor(cutlass.Float32, (1024,))
    y = fake_tensor(cutlass.Float32, (1024,))
    compiled = compile_for(arch, k.axpy, x, y, cutlass.Float32(2.0), fake_stream())
    assert compiled is not None


def test_harness_rejects_unknown_arch():
    with pytest.raises(ValueError, match="arch"):
        compile_for("sm_75", None)
