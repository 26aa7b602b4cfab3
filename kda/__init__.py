"""KDA (Kimi Delta Attention) decode: plain-torch reference and fused GPU kernels.

``kda.reference`` is the math (CPU or GPU); ``kda.decode`` is the host entry of the
GPU kernels (KdaWide, KdaStream, KdaSplit), importing the CUDA-only packages lazily so
that ``import kda`` works on a CPU-only machine.
"""

from . import reference

__all__ = ["reference", "decode"]


def decode(*args, **kwargs):
    """GPU KDA decode step: ``kda.reference.decode``'s arguments plus ``kernel=``."""
    from .ops import decode as _decode

    return _decode(*args, **kwargs)
