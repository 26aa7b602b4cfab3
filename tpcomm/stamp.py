"""``StampKernel``: one thread stores ``%globaltimer`` into a trace buffer (a diagnostic).

A trace buffer is int64 ``[lanes, rows, slots]`` (a lane per rank, a row per step, a slot
per point of the step) with an int32 cursor per lane (the lane's current row). A stamp
writes the GPU's nanosecond clock into slot ``slot`` of the cursor's row of lanes
``first .. first + count - 1`` (one value for all of them) and, with ``advance``, moves
their cursors to the next row; a row past the buffer is not written. The row comes from
the cursor in device memory, so one captured CUDA graph replayed step after step writes a
new row each time. Compiled once: lanes, slot and flags are runtime arguments. Stamps are
kernels of their own, ordered by their stream (no PDL): each one costs a kernel boundary.
``%globaltimer`` is per GPU; across GPUs its offset is what the driver set.
"""

from __future__ import annotations

from typing import NamedTuple

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass import Int32, Int64

from tpcomm.cuteutil import compile_cached, fake_tensor, to_cute


class StampOperands(NamedTuple):
    """The kernel's parameters: the flat trace buffer, the cursors, the buffer's rows and
    slots, the lanes ``first .. first + count - 1``, the slot, and ``advance`` (0 or 1)."""

    trace: cute.Tensor
    cursor: cute.Tensor
    rows: Int32
    slots: Int32
    first: Int32
    count: Int32
    slot: Int32
    advance: Int32


class StampKernel:
    """One CTA of one thread (no configuration)."""

    @cute.jit
    def __call__(self, op: StampOperands, stream: cuda.CUstream):
        self.kernel(op).launch(grid=[1, 1, 1], block=[1, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, op: StampOperands):
        trace, cursor, rows, slots, first, count, slot, advance = op
        now = cute.arch.globaltimer()  # first, before any memory access
        for i in cutlass.range(count, unroll=1):
            lane = first + i
            row = cursor[lane]
            if row < rows:
                trace[(Int64(lane) * rows + row) * slots + slot] = now
                if advance != 0:
                    cursor[lane] = row + 1


def fake_arguments():
    """Compile-only arguments of ``StampKernel.__call__`` (buffer sizes dynamic)."""
    trace = fake_tensor(Int64, (cute.sym_int(),), align=8)
    cursor = fake_tensor(Int32, (cute.sym_int(),), align=4)
    scalars = (Int32(1), Int32(1), Int32(0), Int32(1), Int32(0), Int32(0))
    return StampOperands(trace, cursor, *scalars), cute.runtime.make_fake_stream()


def compiled(arch=None):
    """The one compile (per arch; None: the current GPU's)."""
    return compile_cached("stamp", lambda: (StampKernel(), fake_arguments()), arch=arch)


def stamp(
    trace: torch.Tensor,
    cursor: torch.Tensor,
    slot: int,
    *,
    first: int = 0,
    count: int = 1,
    advance: bool = False,
    stream=None,
) -> None:
    """Enqueue one stamp on ``stream`` (default: the current stream; graph-capturable):
    ``trace[first:first + count, cursor, slot] = %globaltimer``, then with ``advance``
    ``cursor[first:first + count] += 1``. ``trace`` int64 ``[lanes, rows, slots]`` and
    ``cursor`` int32 ``[lanes]``, contiguous, on one CUDA device."""
    if not isinstance(trace, torch.Tensor) or trace.dtype != torch.int64 or trace.dim() != 3:
        raise ValueError("trace must be an int64 [lanes, rows, slots] tensor")
    lanes, rows, slots = trace.shape
    if (
        not isinstance(cursor, torch.Tensor)
        or cursor.dtype != torch.int32
        or tuple(cursor.shape) != (lanes,)
        or cursor.device != trace.device
    ):
        raise ValueError(f"cursor must be an int32 [{lanes}] tensor on {trace.device}")
    if not 0 <= slot < slots:
        raise ValueError(f"slot must be in 0..{slots - 1}; got {slot}")
    if count < 1 or first < 0 or first + count > lanes:
        raise ValueError(f"first, count must pick lanes of 0..{lanes - 1}; got {first}, {count}")
    if trace.device.type != "cuda" or not (trace.is_contiguous() and cursor.is_contiguous()):
        raise ValueError(f"trace and cursor must be contiguous CUDA tensors; got {trace.device}")
    if stream is None:
        stream = torch.cuda.current_stream(trace.device)
    scalars = (Int32(rows), Int32(slots), Int32(first), Int32(count), Int32(slot))
    advance = Int32(int(bool(advance)))
    operands = StampOperands(to_cute(trace.view(-1), 8), to_cute(cursor, 4), *scalars, advance)
    compiled()(operands, cuda.CUstream(stream.cuda_stream))
