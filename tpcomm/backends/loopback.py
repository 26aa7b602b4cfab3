"""Loopback backend: every TP rank on one GPU, one CUDA stream each, over one allocation.

Symmetric tensor ``[*shape]`` -> one buffer ``[world, *shape]``; rank r's copy is
``buffer[r]`` and a peer view is just another index, so the whole mailbox protocol
(publish to peers, poll, re-arm) runs in one process. Ranks spin on each other, so the
kernels of all ranks must be resident together: ``check_coresident`` refuses a launch
whose CTAs of all ranks do not fit, and the process needs at least ``world`` hardware
work queues (``CUDA_DEVICE_MAX_CONNECTIONS``, which this module defaults to 32 if CUDA
is not initialised yet), else two ranks' kernels could serialise and deadlock.
``domain_size`` < world emulates a domain split: ``put_signal`` is a copy on the stream
then a signal store (so the consumers' signal-wait path runs on one GPU).
"""

from __future__ import annotations

import os

import torch

from tpcomm.checks import is_int
from tpcomm.domain import DomainMap
from tpcomm.symm import SymmetricBackend

MAX_WORLD = 16
_CONNECTIONS = "CUDA_DEVICE_MAX_CONNECTIONS"

if not torch.cuda.is_initialized():
    os.environ.setdefault(_CONNECTIONS, "32")


def coresident_capacity(sms: int, threads: int, min_blocks_per_sm: int, max_threads_per_sm: int):
    """CTAs of ``threads`` threads guaranteed resident on ``sms`` SMs.

    ``min_blocks_per_sm`` is the kernel's compiled occupancy guarantee (launch bound), so
    registers never lower it; threads per SM may.
    """
    if threads <= 0 or min_blocks_per_sm <= 0 or sms <= 0:
        raise ValueError("sms, threads and min_blocks_per_sm must be positive")
    return sms * min(min_blocks_per_sm, max_threads_per_sm // threads)


class LoopbackBackend(SymmetricBackend):
    name = "loopback"

    def __init__(self, world: int, device=None, *, streams: bool = True, domain_size=None):
        if not is_int(world) or not 1 <= world <= MAX_WORLD:
            raise ValueError(f"world must be an int in 1..{MAX_WORLD}; got {world!r}")
        try:
            where = torch.device("cuda" if device is None else device)
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"device must name a torch device; got {device!r} ({e})") from None
        if where.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(
                f"device {where} is not available (no CUDA); device='cpu' runs the "
                "loopback layout on the CPU"
            )
        if where.type not in ("cuda", "cpu", "meta"):  # meta: shapes only (tracing the ops)
            raise ValueError(f"device must be a CUDA device, the CPU or meta; got {where}")
        super().__init__(world, tuple(range(world)))
        if domain_size is not None:
            self.domain = DomainMap(world, domain_size)
        self.device = where
        self.streams = []
        self._owned_streams = []
        if self.device.type == "cuda":
            connections = int(os.environ.get(_CONNECTIONS, "8"))
            if connections < world:
                raise ValueError(
                    f"world={world} ranks need {_CONNECTIONS} >= {world} (is {connections}); "
                    "set it before CUDA initialises"
                )
            if streams:
                self.streams = [self._new_stream() for _ in range(world)]

    def _new_stream(self):
        """A stream of this backend's own: torch's pool hands the same 32 streams to every
        caller (graph capture streams too), and two ranks on one stream would deadlock."""
        try:
            from cuda.bindings import runtime
        except ImportError:
            return torch.cuda.Stream(self.device)
        with torch.cuda.device(self.device):
            err, handle = runtime.cudaStreamCreateWithFlags(runtime.cudaStreamNonBlocking)
        if err != runtime.cudaError_t.cudaSuccess:
            raise RuntimeError(f"cudaStreamCreateWithFlags failed: {err}")
        self._owned_streams.append(handle)
        return torch.cuda.ExternalStream(int(handle), device=self.device)

    @property
    def single_device(self) -> bool:
        return True

    def _allocate(self, shape, dtype):
        return torch.empty((self.world, *shape), dtype=dtype, device=self.device)

    def peer(self, t, peer, rank=None):
        self._require_open()
        self._rank(rank if rank is not None else peer)
        self._check_peer(peer)
        return t.payload[peer]

    def put_signal(self, t, offset, nbytes, signal, index, dst, rank=None):
        """A copy on the current stream, then the signal store (the emulated put)."""
        self._require_open()
        self._rank(rank)
        self._check_peer(dst)
        src = t.payload[rank].view(-1).view(torch.uint8)[offset : offset + nbytes]
        t.payload[dst].view(-1).view(torch.uint8)[offset : offset + nbytes].copy_(src)
        signal.payload[dst].view(-1)[index].fill_(1)

    def local(self, t, rank=None):
        if rank is None:
            raise ValueError("rank must be given: the loopback backend hosts every rank")
        return self.peer(t, rank, rank)

    def barrier(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def symmetric_limit(self) -> int | None:
        """Every rank's copy lives on this GPU: free device memory / ``world`` per rank."""
        if self.device.type != "cuda":
            return None
        free, _ = torch.cuda.mem_get_info(self.device)
        return free // self.world

    def check_coresident(self, ctas: int, threads: int, min_blocks_per_sm: int) -> None:
        """Refuse unless ``world`` launches of ``ctas`` CTAs each can be resident at once."""
        if self.device.type != "cuda":
            return
        props = torch.cuda.get_device_properties(self.device)
        capacity = coresident_capacity(
            props.multi_processor_count,
            threads,
            min_blocks_per_sm,
            props.max_threads_per_multi_processor,
        )
        need = ctas * self.world
        if need > capacity:
            raise ValueError(
                f"loopback: {self.world} ranks x {ctas} CTAs = {need} CTAs cannot all be resident "
                f"({capacity} fit on {props.multi_processor_count} SMs); use fewer tokens or ranks"
            )

    def _shutdown(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.streams = []
        if self._owned_streams:
            from cuda.bindings import runtime

            for handle in self._owned_streams:
                runtime.cudaStreamDestroy(handle)
            self._owned_streams = []
