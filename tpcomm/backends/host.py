"""Host backend: CPU tensors and torch.distributed (gloo) collectives.

There is no load/store access to a peer's memory: ``peer`` of another rank raises, and
the all-reduce is ``all_gather`` + ``tpcomm.mailbox.rank_order_sum`` on every rank, so
each rank gets the same bits as the reference. Bootstrap: ``tpcomm.host.init_distributed``
(torchrun, mpirun or a single process; ``timeout_s``: the gloo collectives' timeout); an
existing process group is used as is, and a group this backend created is destroyed by
``teardown``.

Domain split (``domain_size`` < world, ``tpcomm.domain``): ``exchange`` gathers the own
domain's partials by a domain all_gather (the stand-in for load/store) and the other
domains' through ``StoreChannel``, a put-with-signal emulation over the rendezvous store
(data key, then signal key; the reader waits on the signal within a budget, then reads).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from tpcomm import host
from tpcomm.domain import DomainMap, check_domain_size, missing_message
from tpcomm.mailbox import rank_order_sum
from tpcomm.symm import SymmetricBackend


class HostBackend(SymmetricBackend):
    name = "host"

    def __init__(self, timeout_s: float = 300.0, domain_size: int | None = None):
        if domain_size is not None:
            check_domain_size(domain_size, domain_size, "domain_size")  # an int >= 1
        self._owns_group = not dist.is_initialized()
        info = host.init_distributed(timeout_s=timeout_s)
        if domain_size is not None and info.world % domain_size:
            if self._owns_group:
                host.finalize()
            check_domain_size(domain_size, info.world, "domain_size")
        super().__init__(info.world, (info.rank,))
        self.rank = info.rank
        self.budget_s = float(timeout_s)
        self.error_word = 0  # missing-rank mask of the last exchange that ran out
        self.domain = DomainMap(info.world, info.world if domain_size is None else domain_size)
        self._group, self._channel = None, None
        if self.domain.split:
            for members in self.domain.groups():  # every rank creates every group, in order
                group = dist.new_group(list(members)) if len(members) > 1 else None
                if self.rank in members:
                    self._group = group
            store = host.store_client(timeout_s)
            if store is None:
                raise ValueError("domain_size: a split domain needs the job's rendezvous store")
            self._channel = StoreChannel(store, self.rank, self.domain)

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

    def exchange(self, partial: torch.Tensor, step: int) -> torch.Tensor:
        """``[world, *shape]``: every rank's partial of ``step`` in rank order; across
        domains by put-with-signal (RuntimeError naming the ranks not heard from within
        ``budget_s``, their mask OR-ed into ``error_word``)."""
        if not self.domain.split:
            return self.all_gather(partial)
        self._channel.put(partial, step)
        members = self.domain.members(self.rank)
        rows = {self.rank: partial}
        if self._group is not None:
            bits = partial.contiguous().view(torch.uint8)  # gloo has no int16
            got = [torch.empty_like(bits) for _ in members]
            dist.all_gather(got, bits, group=self._group)
            rows.update({r: g.view(partial.dtype) for r, g in zip(members, got, strict=True)})
        try:
            rows.update(self._channel.take(step, partial, self.budget_s))
        except TimeoutError as e:
            self.error_word |= e.args[0]
            raise RuntimeError(missing_message(self.rank, e.args[0], self.budget_s)) from None
        return torch.stack([rows[r] for r in range(self.world)])

    def all_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """bf16 rank-order sum over ranks (fp32 accumulate, one rounding), on every rank."""
        if partial.dtype != torch.bfloat16:
            raise ValueError(f"partial must be bf16; got {partial.dtype}")
        return rank_order_sum(self.all_gather(partial))

    def _shutdown(self) -> None:
        if self._owns_group:
            host.finalize()


class StoreChannel:
    """Put-with-signal between domains over a key-value store (``torch.distributed.Store``):
    ``put`` writes rank ``rank``'s partial for every rank of another domain (data key,
    then its signal key); ``take`` waits for the signals of every other domain's rank (a
    bounded wait), then reads and deletes their data."""

    POLL_S = 0.002

    def __init__(self, store, rank: int, domain: DomainMap):
        self.store, self.rank, self.domain = store, rank, domain

    @staticmethod
    def key(step: int, src: int, dst: int) -> str:
        return f"xdomain/{step}/{src}>{dst}"

    def put(self, partial: torch.Tensor, step: int) -> None:
        data = partial.contiguous().view(torch.uint8).numpy().tobytes()
        for dst in self.domain.remote(self.rank):
            key = self.key(step, self.rank, dst)
            self.store.set(key, data)
            self.store.set(key + "/signal", b"1")  # after the data: the store keeps order

    def take(self, step: int, like: torch.Tensor, budget_s: float) -> dict:
        """{source rank: partial} of every rank outside this domain; TimeoutError(mask)
        when some signal did not come within ``budget_s`` (bit r: rank r)."""
        pending = set(self.domain.remote(self.rank))
        deadline = time.monotonic() + budget_s
        while True:
            pending = {
                r
                for r in pending
                if not self.store.check([self.key(step, r, self.rank) + "/signal"])
            }
            if not pending:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(sum(1 << r for r in pending))
            time.sleep(self.POLL_S)
        out = {}
        for src in self.domain.remote(self.rank):
            key = self.key(step, src, self.rank)
            raw = bytearray(self.store.get(key))
            flat = torch.frombuffer(raw, dtype=torch.uint8).view(like.dtype)
            out[src] = flat.view(like.shape).clone()
            self.store.delete_key(key)
            self.store.delete_key(key + "/signal")
        return out
