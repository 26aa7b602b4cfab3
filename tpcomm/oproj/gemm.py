"""The producer's cuBLAS path: ``gemm``, a rank's partial above ``MAX_TOKENS`` rows (or
with ``producer="cublas"``) before the publisher sends it."""

import torch


def gemm(a, b, out):
    """``out = bf16(a @ b)`` by cuBLAS on the current stream (2-D or batched): fp32
    accumulation with reduced-precision split-K reduction off, one rounding, as
    ``reference.project`` up to the order of the fp32 sums."""
    flags = torch.backends.cuda.matmul
    saved = flags.allow_bf16_reduced_precision_reduction
    flags.allow_bf16_reduced_precision_reduction = False
    try:
        torch.matmul(a, b, out=out)
    finally:
        flags.allow_bf16_reduced_precision_reduction = saved
