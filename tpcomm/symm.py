"""Symmetric memory: one small interface (``SymmetricBackend``) that three backends
implement (``tpcomm.backends``: ``nvshmem``, ``loopback``, ``host``; built by
``tpcomm.backends.make_backend``).

A backend hosts one or more ranks of a TP group of size ``world``: ``allocate(shape,
dtype)``, ``local(t, rank)``, ``peer(t, peer, rank)``, ``multicast(t)`` (or None),
``peer_pointers(t, rank)`` (int64 device tensor of peer base addresses), ``barrier()``,
``teardown()`` (idempotent), ``ranks``, ``world``, ``single_device``,
``check_coresident(ctas, threads, min_blocks_per_sm)``, ``check_fits(nbytes, what)`` (a
buffer set refused before allocation when it does not fit), ``domain`` (a
``tpcomm.domain.DomainMap``: peers outside this rank's domain have no load/store view and
get data by ``put_signal``). Needs only torch.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field

import torch

from tpcomm.domain import DomainMap

BACKENDS = ("nvshmem", "loopback", "host")


@dataclass(eq=False)
class SymmetricTensor:
    """Handle of one symmetric allocation (same shape and dtype on every rank)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    index: int
    payload: object = field(repr=False, default=None)


class SymmetricBackend(abc.ABC):
    name = "abstract"

    def __init__(self, world: int, ranks: tuple[int, ...]):
        if world < 1:
            raise ValueError(f"world must be >= 1; got {world}")
        self.world = world
        self.ranks = tuple(ranks)
        self._tensors: list[SymmetricTensor] = []
        self._closed = False
        self.allocated = 0  # bytes per rank allocated so far
        self.domain = DomainMap(world, world)  # every rank reachable by load/store

    # --- allocation and views ---------------------------------------------------------
    def allocate(self, shape, dtype=torch.bfloat16) -> SymmetricTensor:
        self._require_open()
        shape = tuple(int(s) for s in shape)
        if not shape or any(s <= 0 for s in shape):
            raise ValueError(f"shape must be a non-empty tuple of positive sizes; got {shape}")
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"dtype must be a torch.dtype; got {dtype!r}")
        handle = SymmetricTensor(shape, dtype, len(self._tensors))
        handle.payload = self._allocate(shape, dtype)
        self._tensors.append(handle)
        self.allocated += dtype.itemsize * _numel(shape)
        return handle

    def symmetric_limit(self) -> int | None:
        """Bytes one rank may still allocate in symmetric memory (None: no fixed heap)."""
        return None

    def check_fits(self, nbytes: int, what: str) -> None:
        """ValueError with the limit and the bytes unless ``nbytes`` more per rank fit."""
        limit = self.symmetric_limit()
        if limit is not None and nbytes > limit:
            raise ValueError(
                f"{what}: {nbytes} B of symmetric memory per rank do not fit the "
                f"{limit} B left on {self.name} ({self.allocated} B already allocated); use "
                "fewer rows per step or a larger heap"
            )

    def local(self, t: SymmetricTensor, rank: int | None = None) -> torch.Tensor:
        """This rank's own copy of ``t``."""
        rank = self._rank(rank)
        return self.peer(t, rank, rank)

    @abc.abstractmethod
    def peer(self, t: SymmetricTensor, peer: int, rank: int | None = None) -> torch.Tensor:
        """``peer``'s copy of ``t`` as ``rank`` addresses it (load/store)."""

    def multicast(self, t: SymmetricTensor) -> torch.Tensor | None:
        """A multicast view (stores reach every rank's copy), or None."""
        return None

    def peer_pointers(self, t: SymmetricTensor, rank: int | None = None) -> torch.Tensor:
        """int64 tensor ``[world]`` on this rank's device: base address of each peer's copy
        (0 for a peer outside this rank's domain)."""
        rank = self._rank(rank)
        near = set(self.domain.members(rank))
        addresses = [
            self.peer(t, p, rank).data_ptr() if p in near else 0 for p in range(self.world)
        ]
        return torch.tensor(addresses, dtype=torch.int64, device=self.local(t, rank).device)

    def put_signal(
        self,
        t: SymmetricTensor,
        offset: int,
        nbytes: int,
        signal: SymmetricTensor,
        index: int,
        dst: int,
        rank: int | None = None,
    ):
        """Stream-ordered put with signal on the current stream: bytes ``[offset, offset +
        nbytes)`` of ``rank``'s copy of ``t`` into ``dst``'s copy, then int64 word
        ``index`` of ``dst``'s ``signal`` set to 1 (after the data)."""
        raise ValueError(f"{self.name} backend has no put-with-signal")

    # --- synchronisation and lifetime -------------------------------------------------
    @abc.abstractmethod
    def barrier(self) -> None:
        """Every rank (and its pending device work here) reaches this point."""

    def teardown(self) -> None:
        """Free every tensor, then release the backend; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        try:
            for t in reversed(self._tensors):
                self._free(t)
                t.payload = None
            self._tensors.clear()
            self.allocated = 0
        finally:
            self._shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.teardown()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def single_device(self) -> bool:
        """True when every rank lives on one GPU (kernel boundaries order everything)."""
        return False

    def check_coresident(self, ctas: int, threads: int, min_blocks_per_sm: int) -> None:
        """Raise ValueError unless the kernels run concurrently here can all be resident."""
        return None  # one rank per GPU: a single launch needs no co-residency with others

    # --- backend hooks ----------------------------------------------------------------
    @abc.abstractmethod
    def _allocate(self, shape, dtype): ...

    def _free(self, t: SymmetricTensor) -> None:
        """Release one allocation (default: drop the reference)."""
        return None

    def _shutdown(self) -> None:
        """Release the backend itself after every tensor was freed."""
        return None

    def _rank(self, rank: int | None) -> int:
        if rank is None:
            if len(self.ranks) != 1:
                raise ValueError("rank must be given: this backend hosts several ranks")
            return self.ranks[0]
        if rank not in self.ranks:
            raise ValueError(f"rank {rank} is not hosted here (ranks {self.ranks})")
        return rank

    def _check_peer(self, peer: int) -> None:
        if not 0 <= peer < self.world:
            raise ValueError(f"peer must be in 0..{self.world - 1}; got {peer}")

    def _require_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{self.name} backend was torn down")


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
