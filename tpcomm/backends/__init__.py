"""Symmetric-memory backends: ``loopback``, ``host`` (torch only) and ``nvshmem`` (nvshmem4py).

Nothing here imports CUDA-only packages; ``make_backend`` imports the chosen module.
"""

import importlib.util
import inspect

from tpcomm.symm import BACKENDS, SymmetricBackend

EXTRA = "pip install 'kimi-decode[cu13]'"


def _backend_class(kind):
    if kind == "loopback":
        from tpcomm.backends.loopback import LoopbackBackend

        return LoopbackBackend
    if kind == "host":
        from tpcomm.backends.host import HostBackend

        return HostBackend
    if importlib.util.find_spec("nvshmem") is None:
        raise ImportError(f"the nvshmem backend needs nvshmem4py: {EXTRA}")
    from tpcomm.backends.nvshmem import NvshmemBackend

    return NvshmemBackend


def make_backend(kind: str, **kwargs) -> SymmetricBackend:
    """Build a backend by name: ``nvshmem`` (``device=``, ``launcher=``), ``loopback``
    (``world=``, ``device=``, ``streams=``) or ``host``. ``ValueError`` for an unknown kind
    or arguments the backend does not take; ``ImportError`` naming the extra to install
    when nvshmem4py is missing."""
    if not isinstance(kind, str) or kind not in BACKENDS:
        raise ValueError(f"kind must be one of {BACKENDS}; got {kind!r}")
    cls = _backend_class(kind)
    try:
        inspect.signature(cls).bind(**kwargs)
    except TypeError as e:
        raise ValueError(f"make_backend({kind!r}, ...): bad arguments: {e}") from None
    return cls(**kwargs)
