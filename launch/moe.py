"""The launcher's MoE dispatch stand-in (``--xmoe``): hint waiters on a stream of their own.

``xmoe`` > 0: the consumer also writes that many latent copies of each output row and its
ready hints; per hosted rank (or once for every rank of a one-GPU backend) a waiting kernel
and a reader (``tpcomm.oproj.hints``), forked at the step's start but enqueued after the
consumers (the waiter's poll budget runs from its start, which must not cover the host's
consumer launches): the waiter acquires the rank's hints, then the reader (PDL after it,
a full grid) reads the copies into the bucket's ``moe_in``; the step joins them at the
end, so the next step's consumers come after this step's readers. The waiter spins with
one CTA per rank, which cannot starve a consumer (a consumer never waits on a waiter).
"""

from __future__ import annotations

import torch

from tpcomm.oproj.plan import hint_quota

MAX_XMOE = 8  # latent copies per output row
POISON_BITS = 0x7F81  # int16 bits the copies and waiter reads are poisoned with (a NaN)


def check_xmoe(xmoe) -> None:
    if not isinstance(xmoe, int) or isinstance(xmoe, bool) or not 0 <= xmoe <= MAX_XMOE:
        raise ValueError(
            f"xmoe must be an int in 0..{MAX_XMOE} (latent copies per row); got {xmoe!r}"
        )


class MoeWaiters:
    """The hint waiters of ``ranks`` (the runner's hosted ranks, in order); ``reps`` = 0:
    none (every method does nothing). ``every_rank``: one launch for all of them."""

    def __init__(self, reps: int, device, ranks, *, every_rank: bool):
        check_xmoe(reps)
        self.reps, self.device, self.ranks = reps, device, tuple(ranks)
        self.every_rank = every_rank
        on_gpu = torch.device(device).type == "cuda"  # CPU: the checks alone (tests)
        self.stream = torch.cuda.Stream(device) if reps and on_gpu else None

    def buffers(self, n: int, rows: int, hid: int):
        """A bucket's ``(xmoe, moe_in)`` [n, reps, rows, HID] (the consumer's copies, what
        the waiters read), or ``(None, None)``."""
        if not self.reps:
            return None, None
        shape = (n, self.reps, rows, hid)
        return tuple(torch.zeros(shape, dtype=torch.bfloat16, device=self.device) for _ in "ab")

    def mark(self):
        """Where the waiters fork (an event on the current stream), or None."""
        if not self.reps:
            return None
        fork = torch.cuda.Event()
        fork.record(torch.cuda.current_stream(self.device))
        return fork

    def launch(self, bk, fork) -> None:
        """The waiters of bucket ``bk`` on the MoE stream, forked at ``fork``: enqueue after
        the consumers they wait for."""
        if fork is None:
            return
        from tpcomm.oproj.hints import wait_hints

        self.stream.wait_event(fork)
        with torch.cuda.stream(self.stream):
            if self.every_rank:
                wait_hints(bk.comm, bk.xmoe, bk.moe_in, every_rank=True)
            else:
                for i, r in enumerate(self.ranks):
                    wait_hints(bk.comm, bk.xmoe[i], bk.moe_in[i], rank=r)

    def join(self) -> None:
        """The current stream after the waiters (the next step's consumers after them)."""
        if self.reps:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def problems(self, bk) -> str:
        """Empty when every copy and what the waiters read are bitwise the output and the hint
        words [counter, unused, timed out] zero (each waiter took its quota back); else the
        rows that differ (how many still hold the poison) and the hint words."""
        problems = []
        poison = torch.tensor(POISON_BITS, dtype=torch.int16, device=bk.output.device)
        for i, r in enumerate(self.ranks):
            want = bk.output[i].view(torch.int16)
            for rep in range(self.reps):
                for what, t in (("copies", bk.xmoe[i, rep]), ("waiter read", bk.moe_in[i, rep])):
                    bits = t.view(torch.int16)
                    bad = (bits != want).any(dim=-1)
                    if bool(bad.any()):
                        poisoned = int(((bits == poison).all(dim=-1) & bad).sum())
                        problems.append(
                            f"rank {r} copy {rep}: {what} != output in "
                            f"{int(bad.sum())}/{bad.numel()} rows "
                            f"({poisoned} still poison)"
                        )
        words = bk.comm.hint_words[list(self.ranks), :3]
        if int(words.abs().sum()) != 0:
            quota = hint_quota(bk.output.shape[-1], bk.rows)
            problems.append(
                f"hint words [counter, unused, timed out] per rank {words.tolist()} (quota {quota})"
            )
        return "; ".join(problems)

    def poison(self, bk) -> None:
        """Copies and waiter reads poisoned: a copy read before its hint would show."""
        for t in (bk.xmoe, bk.moe_in):
            if t is not None:
                t.view(torch.int16).fill_(POISON_BITS)
