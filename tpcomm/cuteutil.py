"""Generic CuTe DSL helpers shared by the kernel families (``kda/`` imports them): shared
tensors and addresses, vector loads and stores, ``cp.async``, bf16 pack/unpack, the
``mma.sync`` wrapper, warp sums, cluster exchanges, launch options, and the host side
(``to_cute``, fake tensors for compile-only arguments).

Addresses are ``Int64`` generic addresses of global memory and ``Int32`` shared-window
addresses. Each hand-written PTX wrapper states its memory order in its docstring; unless
it says otherwise it is a weak access ordered only by the barriers around it. Needs the
CuTe DSL (the ``cu13`` extra).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

__all__ = [
    "smem_tensor",
    "gaddr",
    "saddr",
    "cp_async_16",
    "ld_shared_f32x4",
    "ld_global_f32x4",
    "st_global_f32x4",
    "ld_global_nc_b32x2",
    "ld_shared_b32x2",
    "ld_shared_b32x4",
    "ld_global_b32x2",
    "st_global_b32x2",
    "cvt_bf16x2",
    "bf16x2_to_f32",
    "prefetch_l2_bulk",
    "bulk_copy_g2s",
    "xor_sum",
    "warp_sum",
    "launch",
    "ld_global_nc_b32x4",
    "st_global_b32x4",
    "mma_bf16_16816",
    "bits_float",
    "float_bits",
    "unpack_bf16x2",
    "pack_bf16x2",
    "push_words",
    "push_float",
    "arm_exchanges",
    "wait_exchange",
    "to_cute",
    "compile_cached",
    "fake_tensor",
    "fake_like_runtime",
]


def smem_tensor(allocator, dtype, shape, align=16):
    """A row-major shared-memory tensor of static ``shape`` from ``SmemAllocator``."""
    layout = cute.make_layout(tuple(shape), stride=_row_major(tuple(shape)))
    return allocator.allocate_tensor(dtype, layout, byte_alignment=align)


def _row_major(shape):
    strides, running = [], 1
    for extent in reversed(shape):
        strides.append(running)
        running *= extent
    return tuple(reversed(strides))


@cute.jit
def gaddr(tensor: cute.Tensor, coord) -> Int64:
    """Generic byte address (Int64) of ``tensor[coord]`` in global memory."""
    return Int64((tensor.iterator + cute.crd2idx(coord, tensor.layout)).toint())


@cute.jit
def saddr(tensor: cute.Tensor, coord) -> Int32:
    """Shared-window byte address (Int32) of ``tensor[coord]`` in shared memory."""
    return Int32((tensor.iterator + cute.crd2idx(coord, tensor.layout)).toint())


def _vector_load(instruction: str, address, dtype, n: int):
    """``n`` ``dtype`` registers loaded from ``address`` by ``instruction`` (the PTX up to
    its operands)."""
    registers = ", ".join(f"{{$w{i}}}" for i in range(n))
    return cute.arch.inline_ptx(
        f"{instruction} {{{registers}}}, [{{$r0}}];",
        write_only_types=[dtype] * n,
        read_only_args=[address],
    )


def cp_async_16(shared: Int32, source: Int64):
    """16-byte ``cp.async.cg`` global -> shared (L2 only); visible after
    ``cp_async_commit_group`` + ``cp_async_wait_group`` by the issuing thread."""
    cute.arch.inline_ptx(
        "cp.async.cg.shared.global [{$r0}], [{$r1}], 16;", read_only_args=[shared, source]
    )


def ld_shared_f32x4(shared: Int32):
    """Weak 16-byte shared load of four fp32."""
    return _vector_load("ld.shared.v4.f32", shared, Float32, 4)


def ld_global_f32x4(address: Int64):
    """Weak 16-byte global load of four fp32."""
    return _vector_load("ld.global.v4.f32", address, Float32, 4)


def st_global_f32x4(address: Int64, values):
    """Weak 16-byte global store of four fp32."""
    cute.arch.inline_ptx(
        "st.global.v4.f32 [{$r0}], {{$r1}, {$r2}, {$r3}, {$r4}};", read_only_args=[address, *values]
    )


def ld_global_nc_b32x2(address: Int64):
    """8-byte read-only (non-coherent path) global load: data constant for the kernel."""
    return _vector_load("ld.global.nc.v2.b32", address, Uint32, 2)


def ld_global_b32x2(address: Int64):
    """Weak 8-byte global load (data a predecessor kernel may have written)."""
    return _vector_load("ld.global.v2.b32", address, Uint32, 2)


def st_global_b32x2(address: Int64, words):
    """Weak 8-byte global store of two 32-bit words (bits as they are)."""
    cute.arch.inline_ptx(
        "st.global.v2.b32 [{$r0}], {{$r1}, {$r2}};",
        read_only_args=[address, *[Uint32(w) for w in words]],
    )


def cvt_bf16x2(low, high):
    """No memory access: two fp32 rounded to bf16 (nearest even) in one word, ``low`` in the
    low half (the lower address)."""
    return cute.arch.inline_ptx(
        "cvt.rn.bf16x2.f32 {$w0}, {$r0}, {$r1};",
        write_only_types=[Uint32],
        read_only_args=[Float32(high), Float32(low)],
    )


def ld_shared_b32x4(shared: Int32):
    """Weak 16-byte shared load as four 32-bit words."""
    return _vector_load("ld.shared.v4.b32", shared, Uint32, 4)


def ld_global_nc_b32x4(address: Int64):
    """Weak 16-byte read-only load (non-coherent path, no L1 allocation): weights."""
    return _vector_load("ld.global.nc.L1::no_allocate.v4.b32", address, Uint32, 4)


def st_global_b32x4(address: Int64, words):
    """Weak 16-byte global store of four 32-bit words (bits as they are)."""
    cute.arch.inline_ptx(
        "st.global.v4.b32 [{$r0}], {{$r1}, {$r2}, {$r3}, {$r4}};",
        read_only_args=[address, *[Uint32(w) for w in words]],
    )


def mma_bf16_16816(a, b, c):
    """``mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32``: D = A B + C for one warp;
    ``a`` four, ``b`` two 32-bit bf16x2 words, ``c`` four fp32 (fragment order of the PTX
    ISA). Register-only: no memory access."""
    return cute.arch.inline_ptx(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{{$w0}, {$w1}, {$w2}, {$w3}}, {{$r0}, {$r1}, {$r2}, {$r3}}, {{$r4}, {$r5}}, "
        "{{$r6}, {$r7}, {$r8}, {$r9}};",
        write_only_types=[Float32] * 4,
        read_only_args=[*a, *b, *c],
    )


def bf16x2_to_f32(word: Uint32):
    """The two bf16 halves of a 32-bit word as fp32 (low half first); exact."""
    low = cute.arch.inline_ptx(
        "shl.b32 {$w0}, {$r0}, 16;", write_only_types=[Float32], read_only_args=[word]
    )
    high = cute.arch.inline_ptx(
        "and.b32 {$w0}, {$r0}, 0xffff0000;", write_only_types=[Float32], read_only_args=[word]
    )
    return low, high


def ld_shared_b32x2(shared: Int32):
    """Weak 8-byte shared load as two 32-bit words."""
    return _vector_load("ld.shared.v2.b32", shared, Uint32, 2)


def bulk_copy_g2s(shared: Int32, source: Int64, size: int, bar: Int32):
    """``cp.async.bulk`` of ``size`` bytes (a multiple of 16, both addresses 16-byte
    aligned) global -> shared, completing ``size`` bytes of the transaction count of the
    mbarrier at shared address ``bar`` (sm_90+)."""
    cute.arch.inline_ptx(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes"
        f" [{{$r0}}], [{{$r1}}], {int(size)}, [{{$r2}}];",
        read_only_args=[shared, source, bar],
    )


def prefetch_l2_bulk(address: Int64, size: int):
    """Bulk L2 prefetch of ``size`` bytes (multiple of 16) from a 16-byte aligned address;
    a hint with no ordering (sm_90+)."""
    cute.arch.inline_ptx(
        f"cp.async.bulk.prefetch.L2.global [{{$r0}}], {int(size)};", read_only_args=[address]
    )


def xor_sum(value, width: int):
    """Butterfly sum over aligned groups of ``width`` (power of two <= 32) adjacent lanes;
    every lane of the group gets the total (same order on every lane)."""
    shift = width // 2
    while shift >= 1:
        value = value + cute.arch.shuffle_sync_bfly(value, offset=shift)
        shift //= 2
    return value


def warp_sum(value):
    """Sum over the 32 lanes of a warp (butterfly, every lane gets the total)."""
    return xor_sum(value, 32)


def launch(
    kernel_call,
    grid,
    block,
    stream,
    *,
    cluster=None,
    use_pdl=False,
    min_blocks_per_mp=0,
    carveout=-1,
):
    """Launch a ``@cute.kernel`` call on ``stream`` with the cluster / PDL / occupancy
    options (no device query at compile time, so it compiles without a GPU);
    ``carveout``: preferred shared-memory carveout in percent (100: all shared; -1: the
    driver's choice, which may admit fewer than ``min_blocks_per_mp`` CTAs of large shared
    memory)."""
    options = dict(grid=list(grid), block=list(block), stream=stream, use_pdl=use_pdl)
    if cluster is not None:
        options["cluster"] = list(cluster)
    if min_blocks_per_mp > 1:
        options["min_blocks_per_mp"] = min_blocks_per_mp
        # An explicit carveout keeps the compile free of a device query.
        options["preferred_smem_carveout"] = carveout
    kernel_call.launch(**options)


# --- bf16 pairs (llvm form; ``bf16x2_to_f32`` is the inline-PTX form KDA uses) ----


@dsl_user_op
def bits_float(word, *, loc=None, ip=None) -> Float32:
    """No memory access: reinterpret a 32-bit word as fp32."""
    return Float32(llvm.bitcast(T.f32(), Int32(word).ir_value(loc=loc, ip=ip), loc=loc, ip=ip))


@dsl_user_op
def float_bits(value, *, loc=None, ip=None) -> Int32:
    """No memory access: reinterpret an fp32 as a 32-bit word."""
    return Int32(llvm.bitcast(T.i32(), Float32(value).ir_value(loc=loc, ip=ip), loc=loc, ip=ip))


@cute.jit
def unpack_bf16x2(word: Int32):
    """No memory access: a word holding (low, high) bf16 -> two exact fp32 values."""
    return bits_float(word << 16), bits_float(word & Int32(-65536))


@dsl_user_op
def pack_bf16x2(low, high, *, loc=None, ip=None) -> Int32:
    """No memory access: round two fp32 to bf16 (nearest even) into one word, low first."""
    return Int32(
        llvm.inline_asm(
            T.i32(),
            [Float32(high).ir_value(loc=loc, ip=ip), Float32(low).ir_value(loc=loc, ip=ip)],
            "cvt.rn.bf16x2.f32 $0, $1, $2;",
            "=r,f,f",
            has_side_effects=False,
            asm_dialect=0,
            loc=loc,
            ip=ip,
        )
    )


# --- cluster exchanges (DSMEM) -----------------------------------------------------


@cute.jit
def push_words(smem_ptr, words, mbar_ptr, peer: Int32):
    """Release at cluster scope (complete_tx): st.async of 1, 2 or 4 words to a peer CTA."""
    cute.arch.store_async_dsmem(smem_ptr, words, mbar_ptr, peer)


@cute.jit
def push_float(smem_ptr, value: Float32, mbar_ptr, peer: Int32):
    """Release at cluster scope (complete_tx): st.async of one fp32 into a peer CTA's smem."""
    cute.arch.store_async_dsmem(smem_ptr, float_bits(value), mbar_ptr, peer)


@cute.jit
def arm_exchanges(bars, sizes: cutlass.Constexpr):
    """CTA scope: one thread arms mbarrier i for ``sizes[i]`` bytes of st.async traffic.

    Call before ``cluster_arrive`` so no peer pushes into an unarmed barrier; the fence
    makes the initialisation visible to the cluster.
    """
    tid, _, _ = cute.arch.thread_idx()
    if tid == 0:
        for i in cutlass.range_constexpr(len(sizes)):
            cute.arch.mbarrier_init(bars + i, 1)
        cute.arch.mbarrier_init_fence()
        for i in cutlass.range_constexpr(len(sizes)):
            cute.arch.mbarrier_arrive_and_expect_tx(bars + i, sizes[i])


@cute.jit
def wait_exchange(bar):
    """Acquire at cluster scope: wait for phase 0 of an armed exchange barrier."""
    cute.arch.mbarrier_wait(bar, 0)


# --- host side ------------------------------------------------------------------------


def to_cute(t, align=16, leading_dim=None):
    """A torch tensor as a CuTe tensor of dynamic layout, ``align``-byte aligned (None: its
    element size); ``leading_dim``: its stride-1 dimension (None: the one its strides show)."""
    from cutlass.cute.runtime import from_dlpack

    align = t.element_size() if align is None else align
    return from_dlpack(t.detach(), assumed_align=align).mark_layout_dynamic(leading_dim)


_COMPILED: dict = {}  # (key, arch) -> the compiled function


def compile_cached(key, build, *, arch=None):
    """The compiled function of ``key`` (hashable: kernel family, configuration, dtypes,
    static shapes) for ``arch`` (``"sm_90a"``; None: the current device's): ``build()`` ->
    ``(kernel object, compile arguments)``, run and ``cute.compile``d on the first call only.
    A ``ValueError`` of ``build`` caches nothing."""
    compiled = _COMPILED.get((key, arch))
    if compiled is None:
        kernel, args = build()
        options = None if arch is None else f"--gpu-arch {arch}"
        compiled = _COMPILED[key, arch] = cute.compile(kernel, *args, options=options)
    return compiled


def fake_tensor(dtype, shape, align=16):
    """A compact fake tensor for compile-only arguments (``cute.sym_int()`` extents).
    Column-major: its descriptor is not ``to_cute``'s, so a kernel compiled with it must
    not read the runtime tensor's extents past the first dynamic one."""
    return cute.runtime.make_fake_compact_tensor(dtype, shape, assumed_align=align)


def fake_like_runtime(dtype, rank, align=16):
    """The compile-time twin of ``to_cute(t)`` for a contiguous ``rank``-D ``t``: every
    extent and every stride but the last (1) dynamic, as ``mark_layout_dynamic`` marks
    them, so the compiled code reads each extent from the slot where the runtime keeps it."""
    shape = tuple(cute.sym_int() for _ in range(rank))
    stride = (*(cute.sym_int64() for _ in range(rank - 1)), 1)
    return cute.runtime.make_fake_tensor(dtype, shape, stride=stride, assumed_align=align)
