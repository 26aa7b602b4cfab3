"""The o-projection all-reduce's CuTe kernels: ``producer`` (publisher and MMA producer),
``consumer`` (all-reduce + AttnRes + norm), ``fused`` (both in one launch)."""
