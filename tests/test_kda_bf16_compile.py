"""CPU compile checks of every state kernel with bf16 pages (``state_dtype="bf16"``) for
sm_90a and sm_100a: KdaWide, KdaStream, KdaPipe, KdaSplit, KdaReplay, KdaRecover, KdaFold;
the PTX stores a bf16 page by ``cvt.rn.bf16x2.f32`` (its one rounding), never as fp32
vectors. KdaPipe's bf16 stages: as many as fit, a warp barrier each side of a stage's read."""

from __future__ import annotations

import re

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
    from kda.kernels.pipe import KdaPipe
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
    if which == "pipe_T1":
        kernel = KdaPipe(3, 1, 3, True, True, 4, 8, pdl=True, **bf16)
        return kernel, step_args(3, 1, conv_dim_first=True, window=4)
    if which == "pipe_T2":
        kernel = KdaPipe(2, 2, 0, False, False, 5, 8, **bf16)
        return kernel, step_args(2, 2, has_bias=False, conv_dim_first=False, window=5)
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
    "pipe_T1",
    "pipe_T2",
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


@pytest.mark.parametrize("which", ["pipe_T1", "pipe_T2"])
def test_pipe_bf16_stages_and_pair_barriers(which, tmp_path):
    """KdaPipe on bf16 pages (sm_90a PTX): four 32 KB stages at T <= 2 (the prologue stages
    four pages, 8 cp.asyncs each, the loop one); in the state loop, after the stage's
    ``cp.async.wait_group 3``, a warp barrier (the pair's 16-byte copies landed), the
    page's 16 reads of 8 bytes, a warp barrier (the partner has read its slots), then the
    re-staging cp.asyncs; each token's page stored as 16 rounded 8-byte stores."""
    cute = require_dsl()
    kernel, args = build(which, "sm_90a")
    tokens = kernel.tokens
    assert (kernel.stages, kernel.chunk_words) == (4, 2)
    options = f"--gpu-arch sm_90a --keep-ptx --dump-dir {tmp_path}"
    ptx = cute.compile(kernel, *args, options=options).__ptx__
    assert ptx.count("cvt.rn.bf16x2.f32") == 2 * 16 * tokens
    assert ptx.count("st.global.v2.b32") == 16 * tokens
    assert "st.global.v4.b32" not in ptx, "an fp32 page store"
    loop = ptx[ptx.index("cp.async.wait_group \t3;") :]
    ops = re.findall(r"bar\.warp\.sync|ld\.shared\.v2\.b32|cp\.async\.cg|bar\.sync", loop)
    assert ops[:19] == ["bar.warp.sync"] + ["ld.shared.v2.b32"] * 16 + ["bar.warp.sync"] + [
        "cp.async.cg"
    ], ops[:20]
    assert ops.count("bar.warp.sync") == 2


def test_pipe_layout_counts_the_page_dtype():
    """bf16 pages: 32 KB stages, up to four (fp32: two of 64 KB); a window whose fp32
    stages overflow KdaPipe's shared memory fits with bf16 ones."""
    require_dsl()
    from kda.kernels.pipe import SMEM_LIMIT, KdaPipe, pipe_layout, pipe_smem_bytes
    from kda.kernels.stream import SMEM_LIMIT as STREAM_LIMIT
    from kda.kernels.stream import stream_smem_bytes

    for tokens in (1, 2):
        assert pipe_layout(tokens, tokens + 2, 4, True, 4) == (2, 3)
        assert pipe_layout(tokens, tokens + 2, 4, True, 2) == (4, 3)
    # (T 2: both page dtypes batch the gate there, ``batches_gate``)
    assert pipe_smem_bytes(2, 4, 4, True, 3, 4, 2) == pipe_smem_bytes(2, 4, 4, True, 3, 2, 4)
    window = next(
        w
        for w in range(4, 400)
        if pipe_layout(1, w, 4, True, 4)[0] == 0 < pipe_layout(1, w, 4, True, 2)[0]
    )
    assert pipe_smem_bytes(1, window, 4, True) > SMEM_LIMIT
    with pytest.raises(ValueError, match="KdaPipe needs"):
        KdaPipe(2, 1, 3, False, True, window, 8)
    assert KdaPipe(2, 1, 3, False, True, window, 8, state_dtype="bf16").stages >= 2
    # KdaPipe's budget is its own, not KdaStream's (two CTAs per SM): bf16 windows past
    # KdaStream's shared memory still fit it
    wide = max(w for w in range(4, 400) if pipe_layout(1, w, 4, True, 2)[0])
    assert stream_smem_bytes(1, wide, 4, True, 2) > STREAM_LIMIT
    assert KdaPipe(2, 1, 3, False, True, wide, 8, state_dtype="bf16").stages >= 2
    with pytest.raises(ValueError, match="KdaPipe needs"):
        KdaPipe(2, 1, 3, False, True, wide + 1, 8, state_dtype="bf16")
