"""CPU compile tests: the device primitives for sm_90a and sm_100a.

Multicast paths compile here although the H200 cannot run them (no NVLink multicast).
"""

import pytest
from compile_harness import ARCHS, compile_for, fake_stream, fake_tensor, require_dsl

pytestmark = pytest.mark.compile


def _primitives_kernel_fn():
    """A kernel calling every primitive of ``tpcomm.protocol`` (and the exchanges of
    ``tpcomm.cuteutil``) once (compile coverage only)."""
    require_dsl()
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32, Int64

    from tpcomm import cuteutil as cu
    from tpcomm import protocol

    @cute.kernel
    def kernel(words: cute.Tensor, error: cute.Tensor, hints: cute.Tensor, mc: Int64):
        tid, _, _ = cute.arch.thread_idx()
        smem = cutlass.memory.SmemAllocator()
        bars = smem.allocate_array(cutlass.Int64, 2)
        slots = smem.allocate_array(Int32, 8 * 4, byte_alignment=16)
        cu.arm_exchanges(bars, (16, 4))
        cute.arch.cluster_arrive_relaxed()
        cute.arch.cluster_wait()
        base = Int64(words.iterator.toint()) + tid * 16
        a = protocol.load16(base, "relaxed.sys")
        b = protocol.load16(base + 4096, "acquire.sys")
        c = protocol.load16(base + 8192)
        lo, hi = cu.unpack_bf16x2(a[0])
        packed = cu.pack_bf16x2(lo + hi, Float32(1.0))
        protocol.store16(base, [packed, b[1], c[2], protocol.canonicalize(a[3])])
        protocol.store16(base + 16, [b[0], b[1], b[2], b[3]], "release.sys")
        protocol.publish(base + 32, [a[0], a[1], a[2], a[3]])
        protocol.publish(mc + tid * 16, [a[0], a[1], a[2], a[3]], multicast=True)
        raw = cute.make_rmem_tensor(8, Int32)
        failed = protocol.poll_groups(
            raw, [base + 64, base + 80], 2, Int64(1000), Int64(error.iterator.toint())
        )
        if failed == 0:
            protocol.rearm(base + 64)
        peer = cute.arch.block_idx_in_cluster() ^ 1
        if tid == 0:
            cu.push_words(slots + 4, (a[0], a[1], a[2], a[3]), bars, peer)
            cu.push_float(slots + 1, cu.bits_float(cu.float_bits(lo)), bars + 1, peer)
        cu.wait_exchange(bars)
        cu.wait_exchange(bars + 1)
        protocol.fence_sys()
        if protocol.published(raw[0], raw[1], raw[2], raw[3]):
            protocol.release_increment(Int64(hints.iterator.toint()))

    @cute.jit
    def launch(
        words: cute.Tensor, error: cute.Tensor, hints: cute.Tensor, mc: Int64, stream: cuda.CUstream
    ):
        kernel(words, error, hints, mc).launch(
            grid=(2, 1, 1), block=(128, 1, 1), cluster=(2, 1, 1), stream=stream
        )

    return launch


@pytest.mark.parametrize("arch", ARCHS)
def test_primitives_compile(arch):
    require_dsl()
    from cutlass import Int32, Int64

    fn = _primitives_kernel_fn()
    compiled = compile_for(
        arch,
        fn,
        fake_tensor(Int32, (8192,)),
        fake_tensor(Int32, (1,), align=4),
        fake_tensor(Int32, (1,), align=4),
        Int64(0),
        fake_stream(),
    )
    assert compiled is not None
