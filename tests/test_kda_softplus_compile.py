"""CPU compile checks of every KDA kernel with the softplus gate (``gate_form="softplus"``,
Kimi-Linear's) for sm_90a and sm_100a: KdaWide, KdaStream, KdaPipe, KdaSplit, KdaReplay,
KdaRecover, KdaFold. On sm_90a the PTX has softplus's threshold select (``x > 20``) at
each decay site and the lower-bound kernel has none: the form is compiled in, not a
runtime branch. A bad ``gate_form`` is refused naming it."""

from __future__ import annotations

import pytest
from compile_harness import ARCHS, compile_for, require_dsl

pytestmark = pytest.mark.compile

THRESHOLD = "0f41A00000"  # 20.0, softplus's threshold, as PTX writes an fp32 immediate


def build(which, arch, gate_form="softplus"):
    """(kernel, fake arguments) of one configuration with ``gate_form``."""
    from test_kda_compile import fake_args

    from kda.kernels.fold import KdaFold
    from kda.kernels.pipe import KdaPipe
    from kda.kernels.recover import KdaRecover
    from kda.kernels.replay import KdaReplay
    from kda.kernels.split import KdaSplit
    from kda.kernels.stream import KdaStream
    from kda.kernels.wide import KdaWide

    form = dict(arch=arch, gate_form=gate_form)
    if which == "wide_T1":
        return KdaWide(3, 1, False, 3, True, 264, pdl=True, **form), fake_args(3, 1)
    if which == "wide_T4_record_g0":
        return KdaWide(2, 4, True, 0, False, 0, **form), fake_args(2, 4, record=True)
    if which == "stream_T3_record":
        kernel = KdaStream(2, 3, True, 3, False, False, 6, 8, **form)
        return kernel, fake_args(2, 3, record=True, has_bias=False, conv_dim_first=False, window=6)
    if which == "pipe_T1":
        kernel = KdaPipe(3, 1, 3, True, True, 4, 8, pdl=True, **form)
        return kernel, fake_args(3, 1, conv_dim_first=True, window=4)
    if which == "pipe_T2_batched":
        kernel = KdaPipe(2, 2, 3, False, False, 5, 8, **form)
        return kernel, fake_args(2, 2, has_bias=False, conv_dim_first=False, window=5)
    if which == "split_C4_T2_record":
        return KdaSplit(2, 2, True, 3, True, 4, **form), fake_args(2, 2, record=True)
    if which == "replay_T2":
        from test_kda_replay_compile import replay_args

        return KdaReplay(3, 4, 2, 3, True, pdl=True, **form), replay_args(3, 4, 2)
    if which == "recover_T3":
        from test_kda_recover_compile import recover_args

        return KdaRecover(2, 3, pdl=True, **form), recover_args(2, 3)
    from test_kda_state_compile import fold_args

    return KdaFold(3, 4, True, **form), fold_args(3, 4)


KERNELS = [
    "wide_T1",
    "wide_T4_record_g0",
    "stream_T3_record",
    "pipe_T1",
    "pipe_T2_batched",
    "split_C4_T2_record",
    "replay_T2",
    "recover_T3",
    "fold_R4",
]


def ptx_of(kernel, args, tmp_path):
    cute = require_dsl()
    options = f"--gpu-arch sm_90a --keep-ptx --dump-dir {tmp_path}"
    return cute.compile(kernel, *args, options=options).__ptx__


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("which", KERNELS)
def test_softplus_gate_compiles(arch, which, tmp_path):
    """Each kernel compiles with the softplus gate; on sm_90a its PTX selects ``x`` above
    the threshold (``setp.gt.f32`` against 20.0) and has no fast ``lg2`` (softplus is
    ``log1pf``, fp64 ``log1p`` in KdaFold)."""
    require_dsl()
    kernel, args = build(which, arch)
    assert kernel.softplus_gate and kernel.gate_form == "softplus"
    if arch != "sm_90a":
        assert compile_for(arch, kernel, *args) is not None
        return
    ptx = ptx_of(kernel, args, tmp_path)
    assert f", {THRESHOLD};" in ptx, "no softplus threshold in the PTX"
    assert "lg2.approx" not in ptx, "a fast log on the softplus path"
    if which == "fold_R4":  # the reference's rounding points: fp64 exp and log1p
        assert "ex2.approx" not in ptx and "rcp.rn.f64" in ptx


@pytest.mark.parametrize("which", ["wide_T1", "recover_T3", "fold_R4"])
def test_lower_bound_kernel_has_no_softplus(which, tmp_path):
    """The lower-bound form (the default) compiles no softplus: the switch is trace time."""
    require_dsl()
    kernel, args = build(which, "sm_90a", gate_form="lower-bound")
    assert not kernel.softplus_gate
    assert THRESHOLD not in ptx_of(kernel, args, tmp_path)


def test_gate_form_errors():
    require_dsl()
    from kda.kernels.fold import KdaFold
    from kda.kernels.recover import KdaRecover
    from kda.kernels.split import KdaSplit
    from kda.kernels.wide import KdaWide

    for make in (
        lambda: KdaWide(2, 1, gate_form="relu"),
        lambda: KdaSplit(2, 1, cluster=2, gate_form=None),
        lambda: KdaRecover(2, 2, gate_form="Softplus"),
        lambda: KdaFold(2, 4, gate_form="lower_bound"),
    ):
        with pytest.raises(ValueError, match="gate_form must be one of"):
            make()
