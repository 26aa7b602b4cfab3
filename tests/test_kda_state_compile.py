"""CPU compile checks of the state kernels (KdaCopy, KdaFold) for sm_90a and sm_100a, their
configuration errors, KdaCopy's split of the x-blocks between the pools, and KdaFold's PTX:
the per-entry scalars in fp64 (``sqrt.rn.f64``, the division's ``rcp.rn.f64``), no fast
``ex2.approx`` on the fold's path."""

from __future__ import annotations

import pytest
from compile_harness import ARCHS, compile_for, fake_stream, fake_tensor, require_dsl

pytestmark = pytest.mark.compile


def copy_words(heads, window, conv_bytes=2, size=0, state_bytes=4):
    return (
        heads * 128 * 128 * state_bytes // 4,
        3 * heads * 128 * window * conv_bytes // 4,
        size * heads * 128,
        size * heads * 128,
    )


def copy_args(words, counters, pages=7, pairs=5):
    require_dsl()
    from cutlass import Int32

    from kda.operands import CopyKernelOperands

    pools = [fake_tensor(Int32, (pages, w if w else 4)) for w in words]
    values = [fake_tensor(Int32, (pairs,)), fake_tensor(Int32, (pairs,)), *pools]
    values.append(fake_tensor(Int32, (pages, counters if counters else 4)))
    return [CopyKernelOperands(*values), fake_stream()]


COPY_CASES = [  # heads, window, conv bytes, ring size, state bytes (2: bf16 pages)
    (1, 3, 2, 0, 4),
    (3, 10, 4, 4, 4),
    (12, 10, 2, 16, 4),
    (6, 5, 2, 0, 2),
]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("case", COPY_CASES, ids=lambda c: "H{}W{}c{}R{}s{}".format(*c))
def test_copy_compiles(arch, case):
    from kda.kernels.copy import KdaCopy

    heads, window, conv_bytes, size, state_bytes = case
    words = copy_words(heads, window, conv_bytes, size, state_bytes)
    counters = 2 * heads if size else 0
    kernel = KdaCopy(words, counters, arch=arch)
    assert compile_for(arch, kernel, *copy_args(words, counters)) is not None


def test_copy_plan_covers_every_vector():
    require_dsl()
    from kda.kernels.copy import VECTORS_PER_CTA, KdaCopy, plan

    spans, blocks = plan((4096 * 12, 5760, 1536, 0))
    assert spans == [(0, 48), (48, 6), (54, 2), (56, 0)] and blocks == 56
    for (_, count), n in zip(spans, (4096 * 12, 5760, 1536, 0), strict=True):
        assert count * VECTORS_PER_CTA >= n > (count - 1) * VECTORS_PER_CTA or n == count == 0
    with pytest.raises(ValueError, match="words"):
        KdaCopy((4, 6, 0, 0))
    with pytest.raises(ValueError, match="words"):
        KdaCopy((0, 4, 0, 0))
    with pytest.raises(ValueError, match="counters"):
        KdaCopy((4, 4, 0, 0), 2)


def fold_args(heads, size, pages=7, items=5):
    require_dsl()
    from cutlass import BFloat16, Float32, Int32

    from kda.operands import FoldKernelOperands

    values = [
        fake_tensor(Float32, (pages, heads, 128, 128)),  # state
        fake_tensor(Float32, (pages, size, heads, 128)),  # ring_v
        fake_tensor(BFloat16, (pages, size, heads, 256)),  # ring_kg
        fake_tensor(Int32, (pages, heads, 2)),  # ring_length
        fake_tensor(Float32, (heads,)),  # a_log
        fake_tensor(Float32, (heads * 128,)),  # dt_bias
        fake_tensor(Int32, (items,)),  # slots
        fake_tensor(Int32, (items,)),  # accepted
        Float32(-5.0),
    ]
    return [FoldKernelOperands(*values), fake_stream()]


FOLD_CASES = [(1, 2, False), (3, 4, True), (12, 8, False), (6, 16, True)]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("case", FOLD_CASES, ids=lambda c: "H{}R{}a{}".format(*c))
def test_fold_compiles(arch, case):
    from kda.kernels.fold import KdaFold

    heads, size, has_accepted = case
    kernel = KdaFold(heads, size, has_accepted, arch=arch)
    assert compile_for(arch, kernel, *fold_args(heads, size)) is not None


def test_fold_scalars_in_fp64(tmp_path):
    """The fold's decay and k^ go through fp64 (the reference's rounding points): the PTX
    has fp64 square roots and divisions and no fast fp32 exp."""
    cute = require_dsl()
    from kda.kernels.fold import KdaFold

    kernel = KdaFold(3, 4, True, arch="sm_90a")
    options = f"--gpu-arch sm_90a --keep-ptx --dump-dir {tmp_path}"
    ptx = cute.compile(kernel, *fold_args(3, 4), options=options).__ptx__
    assert "sqrt.rn.f64" in ptx and "rcp.rn.f64" in ptx
    assert "ex2.approx" not in ptx, "a fast exp on the fold's path"


def test_fold_config_errors():
    require_dsl()
    from kda.kernels.fold import KdaFold

    with pytest.raises(ValueError, match="size"):
        KdaFold(3, 1)
    with pytest.raises(ValueError, match="size"):
        KdaFold(3, 17)
    with pytest.raises(ValueError, match="heads"):
        KdaFold(0, 4)
