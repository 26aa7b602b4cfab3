"""What a serving engine embeds: ``DecodeLayer``, one TP rank's KDA layer and o-projection
all-reduce stepped as registered torch ops (``kimi::kda_*`` from ``kda.custom_ops``,
``kimi::oproj_*`` from ``tpcomm.oproj.custom_ops``), graph-capturable and traceable by
``torch.compile`` without graph breaks; ``AllRanksStep``, every rank of one GPU stepped
from one process (one producer and one consumer launch for all). On a CPU backend the same
calls run the references (``kda.reference``, ``tpcomm.oproj.reference``). The one package that
imports both ``kda`` and ``tpcomm.oproj``; ``launch/`` steps its ranks through it.
``engine.load`` builds a rank's layer from a real one (fla's ``KimiDeltaAttention`` or its
``state_dict``); ``engine.state`` manages its KDA state (slot copies, ring folds, host
swaps, the prefill hand-off).
"""

from .all_ranks import AllRanksStep
from .layer import DecodeLayer, all_reduces
from .load import KIMI_LINEAR_NAMES, RankLayer, admit_prefill, load_rank, step_inputs
from .state import StateBlob, StateLayout, handoff, prefill_state

__all__ = [
    "AllRanksStep",
    "DecodeLayer",
    "all_reduces",
    "KIMI_LINEAR_NAMES",
    "RankLayer",
    "admit_prefill",
    "load_rank",
    "step_inputs",
    "StateBlob",
    "StateLayout",
    "handoff",
    "prefill_state",
]
