"""Mailbox all-reduce: the simplest user of the mailbox layer and its end-to-end check.

``MailboxAllReduce`` launches ``tpcomm.kernels.allreduce.AllReduceKernel`` once per rank and
step: publish, bounded poll, rank-order sum (bitwise ``tpcomm.mailbox.rank_order_sum``),
re-arm. A rank whose poll expires gets the missing-rank mask in its error word. The
kernel's launch bound (8 CTAs per SM) is what the loopback co-residency check uses.
Imports without the CuTe DSL.
"""

import torch

from tpcomm.checks import check_device_tensor
from tpcomm.mailbox import (
    ALLREDUCE_BLOCKS_PER_SM,
    COLUMNS_PER_CTA,
    CTA_THREADS,
    DEFAULT_BUDGET_NS,
    Mailbox,
)


def grid_ctas(hid: int, tokens: int) -> int:
    """CTAs one rank's launch uses."""
    return (hid // COLUMNS_PER_CTA) * tokens


class MailboxAllReduce:
    """Host wrapper: all-reduce of ``[tokens, HID]`` bf16 partials through a ``Mailbox``.

    ``step`` selects the mailbox parity; consecutive calls must use consecutive steps.
    ``budget_ns`` bounds each spin; a timed-out rank's error word (``error(rank)``) holds
    the mask of ranks it never heard from. After an error, call ``reset()``.
    """

    def __init__(self, mailbox: Mailbox, *, budget_ns: int = DEFAULT_BUDGET_NS, fence=None):
        if not isinstance(mailbox, Mailbox):
            raise ValueError("mailbox must be a tpcomm.mailbox.Mailbox")
        if budget_ns <= 0:
            raise ValueError(f"budget_ns must be positive; got {budget_ns}")
        self.mailbox, self.backend = mailbox, mailbox.backend
        self.layout = mailbox.layout
        self.budget_ns = int(budget_ns)
        mc = mailbox.multicast()
        self.multicast_base = 0 if mc is None else mc.data_ptr()
        # across GPUs the next step's publish must follow this step's re-arm at sys scope;
        # on one GPU (loopback) the kernel boundary orders them already
        self.fence = (not self.backend.single_device) if fence is None else bool(fence)
        self.device = mailbox.local(self.backend.ranks[0]).device
        self.peers = {r: mailbox.peer_pointers(r) for r in self.backend.ranks}
        self.errors = torch.zeros(
            (max(self.backend.ranks) + 1, 4), dtype=torch.int32, device=self.device
        )
        self._fn = None
        self.backend.check_coresident(
            grid_ctas(self.layout.hid, self.layout.tokens), CTA_THREADS, ALLREDUCE_BLOCKS_PER_SM
        )

    def function(self):
        if self._fn is None:
            from tpcomm.kernels.allreduce import compiled

            self._fn = compiled(
                self.layout.tp, self.layout.hid, self.multicast_base != 0, self.fence
            )
        return self._fn

    def error(self, rank: int | None = None) -> torch.Tensor:
        return self.errors[self.backend.ranks[0] if rank is None else rank, :1]

    def run(self, partial, out, step: int, rank: int | None = None, stream=None) -> None:
        """Launch rank ``rank``'s all-reduce for ``step`` on ``stream``."""
        rank = self.backend.ranks[0] if rank is None else rank
        if rank not in self.peers:
            raise ValueError(f"rank {rank} is not hosted by this process")
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int; got {step!r}")
        shape = (self.layout.tokens, self.layout.hid)
        check_device_tensor("partial", partial, shape, torch.bfloat16, self.device)
        check_device_tensor("out", out, shape, torch.bfloat16, self.device)
        if self.device.type != "cuda":
            raise ValueError(f"the mailbox must be on a CUDA device to launch; got {self.device}")
        import cuda.bindings.driver as cuda
        from cutlass import Int32, Int64

        from tpcomm.cuteutil import to_cute as dl
        from tpcomm.kernels.allreduce import AllReduceOperands

        if stream is None:
            stream = torch.cuda.current_stream(self.device)

        operands = AllReduceOperands(
            dl(partial),
            dl(out),
            dl(self.mailbox.local(rank)),
            dl(self.peers[rank], 8),
            Int64(self.multicast_base),
            dl(self.error(rank), 4),
            Int32(rank),
            Int32(step & 1),
            Int64(self.budget_ns),
        )
        self.function()(operands, cuda.CUstream(stream.cuda_stream))

    def run_ranks(self, partials, outs, step: int, *, ranks=None, delays=None) -> None:
        """Loopback: every hosted rank (or ``ranks``) on its own stream, joined back.

        ``partials``/``outs`` are ``[TP, tokens, HID]``; ``delays`` maps a rank to GPU
        cycles its stream sleeps before launching (a late producer). Graph-capturable.
        """
        streams = getattr(self.backend, "streams", None)
        if not streams:
            raise ValueError("run_ranks needs a backend with one stream per rank (loopback)")
        ranks = self.backend.ranks if ranks is None else tuple(ranks)
        delays = delays or {}
        for name, t in (("partials", partials), ("outs", outs)):
            if not isinstance(t, torch.Tensor) or t.dim() != 3 or t.shape[0] != self.layout.tp:
                raise ValueError(f"{name} must be a [TP={self.layout.tp}, tokens, HID] tensor")
        current = torch.cuda.current_stream(self.device)
        # one fork point recorded before any launch: no rank may wait for another's kernel,
        # even when a rank's stream is the current (capture) stream
        fork = torch.cuda.Event()
        fork.record(current)
        for r in ranks:
            streams[r].wait_event(fork)
            with torch.cuda.stream(streams[r]):
                if delays.get(r):
                    torch.cuda._sleep(int(delays[r]))
                self.run(partials[r], outs[r], step, rank=r, stream=streams[r])
        for r in ranks:
            current.wait_stream(streams[r])

    def reset(self) -> None:
        """Clear error words and re-arm every mailbox (after a timeout)."""
        torch.cuda.synchronize(self.device)
        self.errors.zero_()
        self.mailbox.arm()
