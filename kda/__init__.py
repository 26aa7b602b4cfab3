"""KDA (Kimi Delta Attention) decode: plain-torch reference and fused GPU kernels.

``kda.reference`` is the math (CPU or GPU). The host entries, one module each:
``kda.decode`` (``kda/decode.py``: KdaWide, KdaStream, KdaSplit), ``kda.replay_decode``
(``kda/replay.py``: KdaReplay) and ``kda.recover`` (``kda/recover.py``: the GPU commit of a
recorded verify step). Each calls its torch op (``kda.custom_ops``), whose implementation
is in ``kda.kernels.launch``; the kernels live in ``kda/kernels/``. The CUDA-only packages
are imported on the first launch, so ``import kda`` works on a CPU-only machine.
"""

# custom_ops registers the torch ops kimi::kda_decode, kda_recover and kda_replay_decode.
from . import custom_ops, reference

# The functions bind over their submodules' names: importing a submodule later leaves the
# package attribute alone (the import system sets it only on a submodule's first load).
from .decode import decode
from .recover import recover
from .replay import replay_decode

__all__ = ["custom_ops", "reference", "decode", "recover", "replay_decode"]
