"""NVSHMEM backend (nvshmem4py): one PE per process and GPU.

Bootstrap, chosen from the environment:
- torchrun (``RANK``/``WORLD_SIZE``): torch.distributed (gloo, created if absent) broadcasts
  rank 0's unique id (128 bytes), then ``init(initializer_method="uid")``;
- mpirun (``PMI_RANK``, ``OMPI_COMM_WORLD_RANK``, ...): ``initializer_method="emulated_mpi"``
  through mpi4py, which works with any MPI;
- neither: a single PE (uid init, nothing to broadcast).

Views: ``nvshmem.core.tensor`` gives this PE's copy; ``get_peer_tensor`` a peer's inside
this rank's domain (``domain_size``; default: the PEs it maps by load/store, found with a
probe allocation), and a peer of the domain that is not mapped is a clear error naming
both ranks. Peers of other domains get data by ``put_signal``: ``nvshmem.core.put_signal``
(host-initiated, stream-ordered putmem-with-signal, ``SignalOp`` SET to 1);
``get_multicast_tensor`` where NVLS exists, otherwise the per-peer path (said once).
Teardown, in every exit path (``teardown``, context exit, interpreter exit): free every
tensor (collective), ``finalize``, then destroy the process group this backend created.
Device-side NVSHMEM is not used: kernels get peer pointers and use scoped loads/stores,
and wait on signal words with acquire loads.
"""

from __future__ import annotations

import atexit
import logging
import os

import torch

from tpcomm import host
from tpcomm.domain import DomainMap, check_domain_size, domain_of_reachable
from tpcomm.symm import SymmetricBackend

log = logging.getLogger(__name__)
_live: list[NvshmemBackend] = []


def _nvshmem():
    import nvshmem.core

    return nvshmem.core


def _device_class():
    try:
        from cuda.core import Device
    except ImportError:  # cuda.core < 0.6
        from cuda.core.experimental import Device
    return Device


def _buffer_class():
    try:
        from cuda.core import Buffer
    except ImportError:  # cuda.core < 0.6
        from cuda.core.experimental import Buffer
    return Buffer


def _signal_set(nv):
    """NVSHMEM_SIGNAL_SET (``nvshmem.core.SignalOp``, the bindings' ``Signal_op``)."""
    ops = nv.SignalOp
    name = "SIGNAL_SET" if hasattr(ops, "SIGNAL_SET") else "NVSHMEM_SIGNAL_SET"
    return ops[name]


DEFAULT_HEAP = 1 << 30  # NVSHMEM_SYMMETRIC_SIZE's default


def heap_bytes(setting: str | None) -> int:
    """``NVSHMEM_SYMMETRIC_SIZE`` in bytes: an integer with an optional k/m/g/t suffix
    (powers of 1024, as NVSHMEM reads it); unset: 1 GiB."""
    if setting is None or not setting.strip():
        return DEFAULT_HEAP
    text = setting.strip().lower().removesuffix("b")
    scale = 1
    if text and text[-1] in "kmgt":
        scale = 1024 ** ("kmgt".index(text[-1]) + 1)
        text = text[:-1]
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"NVSHMEM_SYMMETRIC_SIZE={setting!r} is not a size") from None
    return int(value * scale)


class TorchStream:
    """A torch stream in the CUDA stream protocol that nvshmem4py accepts."""

    def __init__(self, stream):
        self.stream = stream

    def __cuda_stream__(self):
        return (0, self.stream.cuda_stream)


class NvshmemBackend(SymmetricBackend):
    name = "nvshmem"

    def __init__(
        self,
        device: int | None = None,
        *,
        launcher: str | None = None,
        domain_size: int | None = None,
    ):
        nv = _nvshmem()
        if domain_size is not None:
            check_domain_size(domain_size, domain_size, "domain_size")  # an int >= 1
        launcher = launcher or host.launcher()
        if launcher not in ("torchrun", "mpirun", "single"):
            raise ValueError(f"launcher must be torchrun, mpirun or single; got {launcher!r}")
        self._owns_group = False
        self.launcher = launcher
        local = int(os.environ.get("LOCAL_RANK", os.environ.get("MPI_LOCALRANKID", "0")))
        index = local % max(1, torch.cuda.device_count()) if device is None else int(device)
        torch.cuda.set_device(index)
        self.device = torch.device("cuda", index)
        self._dev = _device_class()(index)
        self._dev.set_current()
        if launcher == "torchrun":
            rank, world = self._init_uid_torchrun(nv)
        elif launcher == "mpirun":
            nv.init(device=self._dev, initializer_method="emulated_mpi")
            rank, world = nv.my_pe(), nv.n_pes()
        else:
            uid = nv.get_unique_id(empty=False)
            nv.init(device=self._dev, uid=uid, rank=0, nranks=1, initializer_method="uid")
            rank, world = 0, 1
        super().__init__(world, (rank,))
        self.rank = rank
        self._multicast_ok: bool | None = None
        self._peers: dict[int, list[torch.Tensor | None]] = {}
        _live.append(self)
        reach = self.reachable_domain_size()
        if domain_size is not None:
            check_domain_size(domain_size, world, "domain_size")
            if domain_size > reach:
                raise ValueError(
                    f"domain_size {domain_size}: rank {rank} reaches only "
                    f"{reach} ranks by load/store"
                )
        self.domain = DomainMap(world, reach if domain_size is None else domain_size)

    def reachable_domain_size(self) -> int:
        """The aligned block of PEs this PE maps by load/store (``nvshmem_ptr`` non-null,
        through ``get_peer_tensor`` on a probe allocation; collective)."""
        nv = _nvshmem()
        probe = nv.tensor((8,), dtype=torch.int64)
        reachable = []
        try:
            for p in range(self.world):
                try:
                    nv.get_peer_tensor(probe, p)
                    reachable.append(p)
                except Exception:
                    continue
        finally:
            nv.free_tensor(probe)
        return domain_of_reachable(self.world, self.rank, reachable)

    def _init_uid_torchrun(self, nv):
        import numpy as np
        import torch.distributed as dist

        self._owns_group = not dist.is_initialized()
        info = host.init_distributed()
        rank, world = info.rank, info.world
        uid = nv.get_unique_id(empty=rank != 0)
        raw = host.broadcast(torch.from_numpy(uid._data.view(np.uint8).copy()), src=0)
        uid._data[:] = raw.numpy().view(uid._data.dtype)
        nv.init(device=self._dev, uid=uid, rank=rank, nranks=world, initializer_method="uid")
        return rank, world

    @property
    def single_device(self) -> bool:
        return self.world == 1

    def symmetric_limit(self) -> int | None:
        """The heap (``NVSHMEM_SYMMETRIC_SIZE``, NVSHMEM's default 1 GiB) less what this
        backend allocated (NVSHMEM's own reservations come on top)."""
        return heap_bytes(os.environ.get("NVSHMEM_SYMMETRIC_SIZE")) - self.allocated

    def _allocate(self, shape, dtype):
        nv = _nvshmem()
        local = nv.tensor(shape, dtype=dtype)
        peers = []
        near = set(self.domain.members(self.rank))
        for p in range(self.world):
            if p == self.rank or p not in near:  # other domains: put_signal only
                peers.append(local if p == self.rank else None)
                continue
            try:
                peers.append(nv.get_peer_tensor(local, p))
            except Exception as exc:
                nv.free_tensor(local)
                raise RuntimeError(
                    f"nvshmem: rank {self.rank} cannot reach rank {p} of its domain by "
                    f"load/store (domain size {self.domain.size}); pass a smaller --domain-size"
                ) from exc
        self._peers[id(local)] = peers
        return local

    def peer(self, t, peer, rank=None):
        self._require_open()
        self._rank(rank)
        self._check_peer(peer)
        view = self._peers[id(t.payload)][peer]
        if view is None:
            raise ValueError(
                f"nvshmem: rank {peer} is outside rank {self.rank}'s domain; use put_signal"
            )
        return view

    def put_signal(self, t, offset, nbytes, signal, index, dst, rank=None):
        """``nvshmem.core.put_signal`` on the current stream: this PE's bytes ``[offset,
        offset + nbytes)`` of ``t`` into ``dst``'s, then ``dst``'s signal word ``index``
        set to 1 (NVSHMEM orders the signal after the data)."""
        self._require_open()
        self._rank(rank)
        self._check_peer(dst)
        nv, buffer = _nvshmem(), _buffer_class()
        base = t.payload.data_ptr() + offset
        data = buffer.from_handle(base, nbytes)  # symmetric: the same address names dst's
        word = buffer.from_handle(signal.payload.data_ptr() + 8 * index, 8)
        stream = TorchStream(torch.cuda.current_stream(self.device))
        nv.put_signal(data, data, word, 1, _signal_set(nv), remote_pe=dst, stream=stream)

    def multicast(self, t):
        self._require_open()
        if self._multicast_ok is False:
            return None
        nv = _nvshmem()
        try:
            view = nv.get_multicast_tensor(nv.Teams.TEAM_NODE, t.payload)
        except Exception as exc:
            self._multicast_ok = False
            log.warning("nvshmem: no NVLink multicast (%s); publishing per peer", exc)
            return None
        self._multicast_ok = True
        return view

    def barrier(self) -> None:
        self._require_open()
        torch.cuda.synchronize(self.device)
        stream = TorchStream(torch.cuda.current_stream(self.device))
        try:
            _nvshmem().barrier_all(stream)
        except Exception:
            if self.world > 1:
                raise
            log.debug("nvshmem barrier_all failed with one PE; synchronising instead")
        torch.cuda.synchronize(self.device)

    def _free(self, t) -> None:
        self._peers.pop(id(t.payload), None)
        _nvshmem().free_tensor(t.payload)

    def _shutdown(self) -> None:
        try:
            torch.cuda.synchronize(self.device)
            _nvshmem().finalize()
        finally:
            if self in _live:
                _live.remove(self)
            if self._owns_group:
                host.finalize()


@atexit.register
def _teardown_live() -> None:
    for backend in list(_live):
        try:
            backend.teardown()
        except Exception as exc:  # interpreter exit: report, never raise
            log.warning("nvshmem teardown at exit failed: %s", exc)
