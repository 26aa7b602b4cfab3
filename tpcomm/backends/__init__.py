"""Symmetric-memory backends: ``loopback``, ``host`` (torch only) and ``nvshmem`` (nvshmem4py).

Import a backend module directly or use ``tpcomm.symm.make_backend``; nothing here
imports CUDA-only packages.
"""
