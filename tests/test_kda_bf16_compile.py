"""CPU compile checks of every state kernel with bf16 pages (``state_dtype="bf16"``) for
sm_90a and sm_100a: KdaWide, KdaStream, KdaSplit, KdaReplay, KdaRecover, KdaFold; the PTX
stores a bf16 page by ``cvt.rn.bf16x2.f32`` (its one rounding), never as fp32 vectors."""

from __future__ import annotations

import pytest
from compile_harness import ARCHS, compile_for, fake_tensor, require_dsl

pytestmark = pytest.mark.compile


def bf16_pool(args):
    """The kernel's fake arguments with the ``state`` pool as bf16 pages."""
    from cutlass import BFloat16

    operands, stream = args
    pool = fake_tensor(BFloat16, tuple(operands.state.shape))
    return [operands._replace(state=pool), stream]


def step_args(heads, tokens, **kw):
    from test_kda_compile import fake_args

    return bf16_pool(fake_args(heads, tokens, **kw))


def build(which, arch):
    """(kernel, fake arguments) of one bf16 configuration."""
    from kda.kernels.fold import KdaFold
    from kda.kernels.recover import KdaRecover
    from kda.kernels.replay import KdaReplay
    from kda.kernels.split import KdaSplit
    from kda.kernels.stream import KdaStream
    from kda.kernels.wide import KdaWide

    bf16 = dict(arch=arch, state_dtype="bf16")
    if which == "wide_T1":
        return KdaWide(3, 1, False, 3, True, 264, pdl=True, **bf16), step_args(3, 1)
    if which == "wide_T4_record":
        return KdaWide(2, 4, True, 3, False, 0, **bf16), step_args(2, 4, record=True)
    if which == "stream_T1":
        kernel = KdaStream(3, 1, False, 3, True, True, 4, 8, pdl=True, **bf16)
        return kernel, step_args(3, 1, conv_dim_first=True, window=4)
    if which == "stream_T4":
        kernel = KdaStream(2, 4, False, 3, False, False, 6, 8, **bf16)
        return kernel, step_args(2, 4, has_bias=False, conv_dim_first=False, window=6)
    if which == "split_C2_T1":
        return KdaSplit(3, 1, False, 3, True, 2, pdl=True, **bf16), step_args(3, 1)
    if which == "split_C8_T4_record":
        return KdaSplit(2, 4, True, 3, True, 8, **bf16), step_args(2, 4, record=True)
    if which == "replay_T4":
        from test_kda_replay_compile import replay_args

        kernel = KdaReplay(3, 4, 4, 3, True, pdl=True, **bf16)
        return kernel, bf16_pool(replay_args(3, 4, 4))
    if which == "recover_T3":
        from test_kda_recover_compile import recover_args

        return KdaRecover(2, 3, pdl=True, **bf16), bf16_pool(recover_args(2, 3))
    from test_kda_state_compile import fold_args

    return KdaFold(3, 4, True, **bf16), bf16_pool(fold_args(3, 4))


KERNELS = [
    "wide_T1",
    "wide_T4_record",
    "stream_T1",
    "stream_T4",
    "split_C2_T1",
    "split_C8_T4_record",
    "replay_T4",
    "recover_T3",
    "fold_R4",
]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("which", KERNELS)
def test_bf16_state_compiles(arch, which, tmp_path):
    """Each kernel compiles with bf16 pages; on sm_90a its PTX rounds the stored page with
    ``cvt.rn.bf16x2.f32`` and stores no fp32 state vector (only the replay's fp32 ring
    entries are fp32 stores there)."""
    cute = require_dsl()
    kernel, args = build(which, arch)
    if arch != "sm_90a":
        assert compile_for(arch, kernel, *args) is not None
        return
    options = f"--gpu-arch {arch} --keep-ptx --dump-dir {tmp_path}"
    ptx = cute.compile(kernel, *args, options=options).__ptx__
    record = "record" in which
    if not record:  # record mode writes no page
        assert "cvt.rn.bf16x2.f32" in ptx
    assert "st.global.v4.f32" not in ptx, "an fp32 vector store of a bf16 page"


def test_state_dtype_errors():
    require_dsl()
    from kda.kernels.recover import KdaRecover
    from kda.kernels.stream import SMEM_LIMIT, KdaStream, stream_smem_bytes
    from kda.kernels.wide import KdaWide

    with pytest.raises(ValueError, match="state_dtype"):
        KdaWide(2, 1, state_dtype="fp16")
    with pytest.raises(ValueError, match="state_dtype"):
        KdaRecover(2, 2, state_dtype=None)
    # the staged page halves: a window that overflows KdaStream's shared memory with fp32
    # pages fits with bf16 ones
    window = next(
        w
        for w in range(4, 400)
        if stream_smem_bytes(1, w, 4, True, 4) > SMEM_LIMIT >= stream_smem_bytes(1, w, 4, True, 2)
    )
    with pytest.raises(ValueError, match="shared memory"):
        KdaStream(2, 1, False, 3, False, True, window, 8)
    assert KdaStream(2, 1, False, 3, False, True, window, 8, state_dtype="bf16").state_bytes == 2
