"""KDA (Kimi Delta Attention) decode: plain-torch reference and fused GPU kernels.

``kda.reference`` is the math (CPU or GPU); ``kda.decode`` is the host entry of the
GPU kernels (KdaWide, KdaStream, KdaSplit), ``kda.recover`` the GPU commit of a
recorded verify step and ``kda.replay_decode`` the replay step (KdaReplay), all importing
the CUDA-only packages lazily so that ``import kda`` works on a CPU-only machine.
"""

# custom_ops registers the torch ops kimi::kda_decode, kda_recover and kda_replay_decode.
from . import custom_ops, reference

# kda/recover.py imports only torch; importing it now keeps the package's ``recover``
# the function (a submodule imported later would rebind the name to the module).
from .recover import recover
from .replay_ops import replay_decode

__all__ = ["custom_ops", "reference", "decode", "recover", "replay_decode"]


def decode(*args, **kwargs):
    """GPU KDA decode step: ``kda.reference.decode``'s arguments plus ``kernel=``."""
    from .ops import decode as _decode

    return _decode(*args, **kwargs)
