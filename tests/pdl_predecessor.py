"""An early-releasing PDL predecessor for the tests: ``griddepcontrol.launch_dependents``
first, then a ``globaltimer`` spin of ``spin_ns``, then a copy of clean values into the
(poisoned) inputs of the kernel launched after it.

A kernel launched with PDL right after this one may start during the spin; only its
``griddepcontrol.wait`` keeps it from reading the poison. A torch ``copy_`` as predecessor
cannot show that: it never releases its dependents early.

    pred = Predecessor(4)                    # up to 4 (source, destination) pairs
    pred(pairs, spin_ns=100_000)             # on the current stream, then the PDL launch

Pairs are CUDA tensors of equal byte size, copied byte for byte.
"""

from __future__ import annotations

import functools

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass import Int64, Uint8

from tpcomm.cuteutil import launch

PAIRS = 4
CTAS, THREADS = 8, 128


class PredecessorKernel:
    """``pairs`` (source, destination) byte tensors, copied after the spin."""

    def __init__(self, pairs=PAIRS):
        if not 1 <= pairs <= PAIRS:
            raise ValueError(f"pairs must be 1..{PAIRS}; got {pairs}")
        self.pairs = pairs

    @cute.jit
    def __call__(self, tensors: list, spin_ns: Int64, stream: cuda.CUstream):
        launch(self.kernel(tensors, spin_ns), (CTAS, 1, 1), (THREADS, 1, 1), stream)

    @cute.kernel
    def kernel(self, tensors: list, spin_ns: Int64):
        cute.arch.griddepcontrol_launch_dependents()
        tid, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        start = cute.arch.globaltimer()
        now = start
        while now - start < spin_ns:
            now = cute.arch.globaltimer()
        first = cta * THREADS + tid
        stride = CTAS * THREADS
        for p in cutlass.range_constexpr(self.pairs):
            src, dst = tensors[2 * p], tensors[2 * p + 1]
            n = cute.size(src)
            count = (n + stride - 1) // stride
            for k in cutlass.range(count, unroll=1):
                i = first + k * stride
                if i < n:
                    dst[i] = src[i]


def _flat(t: torch.Tensor):
    from cutlass.cute.runtime import from_dlpack

    if not t.is_contiguous():
        raise ValueError("predecessor tensors must be contiguous")
    return from_dlpack(t.view(-1).view(torch.uint8), assumed_align=1).mark_layout_dynamic()


@functools.cache
def _compiled(pairs, arch):
    return cute.compile(PredecessorKernel(pairs), *fake_arguments(pairs),
                        options=f"--gpu-arch {arch}")  # fmt: skip


def fake_arguments(pairs=PAIRS):
    """Compile-only arguments of ``PredecessorKernel.__call__``."""
    tensors = [
        cute.runtime.make_fake_compact_tensor(Uint8, (cute.sym_int(),), assumed_align=1)
        for _ in range(2 * pairs)
    ]
    return tensors, Int64(0), cute.runtime.make_fake_stream()


def run(pairs, spin_ns=100_000):
    """Launch the predecessor on the current stream: ``pairs`` [(source, destination)]."""
    if not 1 <= len(pairs) <= PAIRS:
        raise ValueError(f"1..{PAIRS} pairs; got {len(pairs)}")
    tensors = []
    for src, dst in pairs:
        if src.numel() * src.element_size() != dst.numel() * dst.element_size():
            raise ValueError("source and destination must have the same byte size")
        tensors += [_flat(src), _flat(dst)]
    major, minor = torch.cuda.get_device_capability()
    arch = f"sm_{major}{minor}a"
    fn = _compiled(len(pairs), arch)
    stream = cuda.CUstream(torch.cuda.current_stream().cuda_stream)
    fn(tensors, Int64(spin_ns), stream)


__all__ = ["PredecessorKernel", "fake_arguments", "run"]
