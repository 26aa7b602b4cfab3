"""Host backend: CPU tensors and torch.distributed (gloo) collectives.

There is no load/store access to a peer's memory: ``peer`` of another rank raises, and
the all-reduce is ``all_gather`` + ``tpcomm.mailbox.rank_order_sum`` on every rank, so
each rank gets the same bits as the reference. Bootstrap: ``tpcomm.host.init_distributed``
(torchrun, mpirun or a single process; ``timeout_s``: the gloo collectives' timeout); an
existing process group is used as is, and a group this backend created is destroyed by
``teardown``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tpcomm import host
from tpcomm.mailbox import rank_order_sum
from tpcomm.symm import SymmetricBackend


class HostBackend(SymmetricBackend):
    name = "host"

    def __init__(self, timeout_s: float = 300.0):
        self._owns_group = not dist.is_initialized()
        info = host.init_distributed(timeout_s=timeout_s)
        super().__init__(info.world, (info.rank,))
        self.rank = info.rank

    def _allocate(self, shape, dtype):
        return torch.empty(shape, dtype=dtype)

    def peer(self, t, peer, rank=None):
        self._require_open()
        rank = self._rank(rank)
        self._check_peer(peer)
        if peer != rank:
            raise ValueError(
                f"host backend: rank {rank} cannot load/store rank {peer}'s memory; "
                "use all_gather / all_reduce"
            )
        return t.payload

    def peer_pointers(self, t, rank=None):
        raise ValueError("host backend has no peer pointers; use all_gather / all_reduce")

    def barrier(self) -> None:
        self._require_open()
        host.barrier()

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """``[world, *tensor.shape]``: every rank's tensor, in rank order."""
        self._require_open()
        if tensor.is_cuda:
            raise ValueError("tensor must be a CPU tensor for the host backend")
        return host.all_gather(tensor)

    def all_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """bf16 rank-order sum over ranks (fp32 accumulate, one rounding), on every rank."""
        if partial.dtype != torch.bfloat16:
            raise ValueError(f"partial must be bf16; got {partial.dtype}")
        return rank_order_sum(self.all_gather(partial))

    def _shutdown(self) -> None:
        if self._owns_group:
            host.finalize()
