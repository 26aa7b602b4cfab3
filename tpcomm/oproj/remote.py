"""The o-projection mailbox across domains: puts with signal to the ranks of other domains.

With ``backend.domain`` split, the producer (or publisher) still stores its partial into
every peer of its own domain; the peer-table entries of other domains point at the rank's
own mailbox, so those stores land in its own slot ``[parity, rank]`` (the same bits, no
kernel change). Then, on the same stream, ``put`` sends that slot to every rank of another
domain with ``backend.put_signal`` (signal word ``[parity, rank]`` of a symmetric
``[2, TP]`` int64 array set to 1), and the consumer (``domain`` configuration) waits on
that word before it reads the slot. After the consumer, ``rearm`` zeroes this parity's
signal words on the stream: the parity double-buffering that protects the re-armed slots
protects them too. Plain torch (no CuTe DSL import).
"""

from __future__ import annotations

import torch

from tpcomm.domain import SIGNAL_BYTES


class RemotePuts:
    """Signal words and the puts of one mailbox on a split ``backend``."""

    def __init__(self, backend, mailbox):
        self.backend, self.mailbox, self.domain = backend, mailbox, backend.domain
        self.tp = backend.world
        self.signals = backend.allocate((2, self.tp), torch.int64)
        self.arm()

    def peers(self, rank: int, pointers: torch.Tensor) -> torch.Tensor:
        """``pointers`` with every rank of another domain replaced by ``rank``'s own mailbox."""
        out = pointers.clone()
        own = self.mailbox.local(rank).data_ptr()
        for p in self.domain.remote(rank):
            out[p] = own
        return out

    def words(self, rank: int) -> torch.Tensor:
        """``rank``'s signal words ``[2, TP]`` as the consumer's ``recv`` (flat bf16)."""
        return self.backend.local(self.signals, rank).view(torch.bfloat16).view(-1)

    def put(self, rank: int, step: int) -> None:
        """On the current stream: ``rank``'s slot of ``step`` to every rank of another domain,
        each followed by its signal word."""
        layout = self.mailbox.layout
        nbytes = layout.tokens * layout.hid * 2
        offset = layout.offset(step, rank, 0, 0) * 2
        index = (step & 1) * self.tp + rank
        for dst in self.domain.remote(rank):
            self.backend.put_signal(
                self.mailbox.buffer, offset, nbytes, self.signals, index, dst, rank
            )

    def rearm(self, rank: int, step: int) -> None:
        """On the current stream: zero ``rank``'s signal words of ``step``'s parity."""
        self.backend.local(self.signals, rank)[step & 1].zero_()

    def arm(self) -> None:
        """Zero every hosted rank's signal words, then barrier (start, or after an error)."""
        for rank in self.backend.ranks:
            self.backend.local(self.signals, rank).zero_()
        self.backend.barrier()

    @staticmethod
    def nbytes(tp: int) -> int:
        return 2 * tp * SIGNAL_BYTES
