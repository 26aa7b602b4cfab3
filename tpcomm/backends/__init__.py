"""Symmetric-memory backends: ``loopback``, ``host`` (torch only) and ``nvshmem`` (nvshmem4py).

Nothing here imports CUDA-only packages; ``make_backend`` imports the chosen module.
"""

from tpcomm.symm import BACKENDS, SymmetricBackend


def make_backend(kind: str, **kwargs) -> SymmetricBackend:
    """Build a backend by name: ``nvshmem``, ``loopback`` (``world=``) or ``host``."""
    if kind == "loopback":
        from tpcomm.backends.loopback import LoopbackBackend

        return LoopbackBackend(**kwargs)
    if kind == "host":
        from tpcomm.backends.host import HostBackend

        return HostBackend(**kwargs)
    if kind == "nvshmem":
        from tpcomm.backends.nvshmem import NvshmemBackend

        return NvshmemBackend(**kwargs)
    raise ValueError(f"kind must be one of {BACKENDS}; got {kind!r}")
