"""A minimal kernel that proves the compile harness works (axpy over a 1-D tensor)."""

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute


@cute.kernel
def _axpy_kernel(x: cute.Tensor, y: cute.Tensor, alpha: cutlass.Float32):
    tid, _, _ = cute.arch.thread_idx()
    bid, _, _ = cute.arch.block_idx()
    i = bid * 128 + tid
    if i < x.shape[0]:
        y[i] = alpha * x[i] + y[i]


@cute.jit
def axpy(x: cute.Tensor, y: cute.Tensor, alpha: cutlass.Float32, stream: cuda.CUstream):
    blocks = (x.shape[0] + 127) // 128
    _axpy_kernel(x, y, alpha).launch(grid=(blocks, 1, 1), block=(128, 1, 1), stream=stream)
