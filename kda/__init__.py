"""KDA (Kimi Delta Attention) decode: plain-torch reference and fused GPU kernels.

``kda.reference`` is the math (CPU or GPU). The host entries, one module each:
``kda.decode`` (``kda/decode.py``: KdaWide, KdaPipe, KdaStream, KdaSplit), ``kda.replay_decode``
(``kda/replay.py``: KdaReplay), ``kda.recover`` (``kda/recover.py``: the GPU commit of a
recorded verify step), ``kda.copy_state`` and ``kda.fold`` (``kda/state.py``: slot copies
and ring folds, KdaCopy and KdaFold). Each calls its torch op (``kda.custom_ops``), whose
implementation is in ``kda.kernels.launch`` (the state ops run the references on a CPU
pool); the kernels live in ``kda/kernels/``. The CUDA-only packages
are imported on the first launch, so ``import kda`` works on a CPU-only machine.
"""

# custom_ops registers the torch ops kimi::kda_decode, kda_recover, kda_replay_decode,
# kda_copy_state and kda_fold.
from . import custom_ops, reference

# The functions bind over their submodules' names: importing a submodule later leaves the
# package attribute alone (the import system sets it only on a submodule's first load).
from .decode import decode
from .recover import recover
from .replay import replay_decode
from .state import copy_state, fold

__all__ = ["custom_ops", "reference", "decode", "recover", "replay_decode", "copy_state", "fold"]
