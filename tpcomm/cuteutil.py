"""Generic CuTe DSL helpers shared by the kernel families (``kda/`` imports them).

Addresses are plain integers: ``Int64`` generic addresses of global memory (identical to
the global-window address on sm_90 / sm_100) and ``Int32`` shared-window addresses. Each
hand-written PTX wrapper states its memory order and scope in its docstring; unless it
says otherwise it is a weak (non-atomic) access ordered only by the CTA barriers and
``cp.async`` waits around it.

Import only from code that runs with the ``cu13`` extra: this module imports ``cutlass``.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32

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
    "ld_global_b32x4",
    "st_shared_b32x4",
    "ld_shared_b32x4",
    "bf16x2_to_f32",
    "prefetch_l2_bulk",
    "xor_sum",
    "warp_sum",
    "launch",
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


def cp_async_16(shared: Int32, source: Int64):
    """16-byte ``cp.async.cg`` global -> shared (L2 only); visible after
    ``cp_async_commit_group`` + ``cp_async_wait_group`` by the issuing thread."""
    cute.arch.inline_ptx(
        "cp.async.cg.shared.global [{$r0}], [{$r1}], 16;", read_only_args=[shared, source]
    )


def ld_shared_f32x4(shared: Int32):
    """Weak 16-byte shared load of four fp32."""
    return cute.arch.inline_ptx(
        "ld.shared.v4.f32 {{$w0}, {$w1}, {$w2}, {$w3}}, [{$r0}];",
        write_only_types=[Float32] * 4,
        read_only_args=[shared],
    )


def ld_global_f32x4(address: Int64):
    """Weak 16-byte global load of four fp32."""
    return cute.arch.inline_ptx(
        "ld.global.v4.f32 {{$w0}, {$w1}, {$w2}, {$w3}}, [{$r0}];",
        write_only_types=[Float32] * 4,
        read_only_args=[address],
    )


def st_global_f32x4(address: Int64, values):
    """Weak 16-byte global store of four fp32."""
    cute.arch.inline_ptx(
        "st.global.v4.f32 [{$r0}], {{$r1}, {$r2}, {$r3}, {$r4}};",
        read_only_args=[address, *values],
    )


def ld_global_nc_b32x2(address: Int64):
    """8-byte read-only (non-coherent path) global load: data constant for the kernel."""
    return cute.arch.inline_ptx(
        "ld.global.nc.v2.b32 {{$w0}, {$w1}}, [{$r0}];",
        write_only_types=[Uint32] * 2,
        read_only_args=[address],
    )


def ld_global_b32x2(address: Int64):
    """Weak 8-byte global load (data a predecessor kernel may have written)."""
    return cute.arch.inline_ptx(
        "ld.global.v2.b32 {{$w0}, {$w1}}, [{$r0}];",
        write_only_types=[Uint32] * 2,
        read_only_args=[address],
    )


def ld_global_b32x4(address: Int64):
    """Weak 16-byte global load as four 32-bit words."""
    return cute.arch.inline_ptx(
        "ld.global.v4.b32 {{$w0}, {$w1}, {$w2}, {$w3}}, [{$r0}];",
        write_only_types=[Uint32] * 4,
        read_only_args=[address],
    )


def st_shared_b32x4(shared: Int32, words):
    """Weak 16-byte shared store of four 32-bit words."""
    cute.arch.inline_ptx(
        "st.shared.v4.b32 [{$r0}], {{$r1}, {$r2}, {$r3}, {$r4}};",
        read_only_args=[shared, *words],
    )


def ld_shared_b32x4(shared: Int32):
    """Weak 16-byte shared load as four 32-bit words."""
    return cute.arch.inline_ptx(
        "ld.shared.v4.b32 {{$w0}, {$w1}, {$w2}, {$w3}}, [{$r0}];",
        write_only_types=[Uint32] * 4,
        read_only_args=[shared],
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
    return cute.arch.inline_ptx(
        "ld.shared.v2.b32 {{$w0}, {$w1}}, [{$r0}];",
        write_only_types=[Uint32] * 2,
        read_only_args=[shared],
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


_ = cutlass  # the DSL must be importable wherever this module is
