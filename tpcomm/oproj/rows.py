"""``RowChunks``: a step's rows as chunks that per-rank launches on one GPU can hold.

Per-rank launches of every rank on one GPU (loopback) spin side by side, so every rank's
consumer CTAs (``slicing(hid).ctas`` per row) must be resident together, and while they spin
they must leave room for the publisher CTAs they wait on (as many again: a consumer CTA
in the slot a publisher needs would spin until its poll budget ran out). Above that (TP
8, HID 7168: about 4 rows one-shot, 8 twoshot) per-rank runs take the step's rows in
chunks. Each chunk is an ``OprojAllReduce`` of its own rows (its own mailbox, or receive
views and gather rows: the chunks' bytes add up to one bucket's), run on the current
stream one after another: chunk ``c + 1`` forks only after every rank of chunk ``c``
joined; in a chunk every publisher is enqueued before any consumer, and with ``w_os``
every rank's producer (a cuBLAS GEMM above 8 rows, whose CTAs no count of slots can
vouch for) finishes before any consumer starts. A row's math is the unchunked one
(rank-order sum, one rounding; twoshot's gather), bitwise.
"""

from __future__ import annotations

import torch

from tpcomm.checks import is_int
from tpcomm.oproj.all_ranks import AllRanks
from tpcomm.oproj.allreduce import OprojAllReduce
from tpcomm.oproj.plan import MAX_GROUPS, MAX_ROWS, choose, min_blocks_per_sm, slicing


def chunk_ctas(hid: int, rows: int) -> int:
    """CTAs of one rank's chunk that must fit the GPU together with every other rank's:
    its consumer's (``slicing(hid).ctas`` per row) and the publisher's it waits on (as many,
    of one group's threads, each counted as a consumer CTA: at least its threads and
    registers)."""
    return 2 * slicing(hid).ctas * rows


class RowChunks:
    """``rows`` rows on ``backend`` as chunks of at most ``chunk`` rows (default: the
    largest ``ceil(rows / 2^k)`` whose ``chunk_ctas`` of every rank can all be resident);
    ``twoshot`` defaults to the plan of the whole ``rows``; other keywords go to every
    chunk's ``OprojAllReduce`` (no ``xmoe_reps``: a chunk of the copies is not contiguous)."""

    def __init__(self, backend, rows, hid, nb, *, chunk=None, twoshot=None, **kw):
        if not is_int(rows) or not 1 <= rows <= MAX_ROWS:
            raise ValueError(f"rows must be an int in 1..{MAX_ROWS}; got {rows!r}")
        if chunk is not None and (not is_int(chunk) or not 1 <= chunk <= rows):
            raise ValueError(f"chunk must be an int in 1..rows = {rows}; got {chunk!r}")
        if kw.get("xmoe_reps") or kw.get("one_launch"):
            raise ValueError("RowChunks runs per-rank launches without xmoe copies")
        # per-rank launches: the measured crossover of chunked one-shot vs chunked twoshot
        asked = None if twoshot is None else bool(twoshot)
        self.plan = choose(backend.world, rows, hid, twoshot=asked)
        twoshot = self.plan.twoshot
        self.rows, self.twoshot = rows, twoshot
        kw = dict(kw, twoshot=twoshot)
        n = rows if chunk is None else chunk
        first = None
        while first is None:
            groups = kw.get("groups")
            if not is_int(groups) or not 1 <= groups <= MAX_GROUPS:  # OprojAllReduce's pick
                groups = choose(backend.world, n, hid, twoshot=twoshot).groups
            try:  # refused before anything is allocated
                threads = slicing(hid).threads
                backend.check_coresident(
                    chunk_ctas(hid, n), threads * groups, min_blocks_per_sm(groups, threads)
                )
            except ValueError as e:  # halve while the chunk's CTAs cannot all be resident
                if chunk is not None or n == 1:
                    why = "every rank's consumer CTAs and the publisher CTAs they wait on"
                    raise ValueError(f"chunk of {n} rows: {why} must fit together: {e}") from None
                n = -(-n // 2)
                continue
            first = OprojAllReduce(backend, n, hid, nb, **kw)
        self.chunk = n
        self.parts = [(0, n, first)]
        for a in range(n, rows, n):
            b = min(rows, a + n)
            self.parts.append((a, b, OprojAllReduce(backend, b - a, hid, nb, **kw)))
        self.groups = first.groups
        self.bytes = sum(c.bytes for _, _, c in self.parts)

    def run_ranks(
        self,
        inputs,
        prefixes,
        blocks,
        norm,
        query,
        out_norm,
        outputs,
        step,
        *,
        w_os=None,
        ranks=None,
        publishers=None,
    ):
        """``AllRanks.run_ranks`` (per-rank mode) chunk by chunk: ``inputs`` [TP,
        rows, HID] partials (or [TP, rows, D_local] ``attn_out`` with ``w_os``),
        ``prefixes``/``outputs`` [TP, rows, HID], ``blocks`` [rows, nb, HID] or None. Every
        refusal comes before the first chunk's launches."""
        for name, t in (("inputs", inputs), ("prefixes", prefixes), ("outputs", outputs)):
            if t is not None and (t.dim() != 3 or t.shape[1] != self.rows):
                raise ValueError(f"{name} must be [TP, rows = {self.rows}, ...]")
        backend = self.parts[0][2].backend
        if not getattr(backend, "streams", None):
            raise ValueError("run_ranks needs a backend with one stream per rank (loopback)")
        ranks = tuple(backend.ranks if ranks is None else ranks)
        publishers = ranks if publishers is None else tuple(publishers)
        if publishers and inputs is None:
            raise ValueError("inputs must be given: the publishers' partials or attn_out")
        for a, b, comm in {b - a: (a, b, c) for a, b, c in self.parts}.values():  # each size
            for r in ranks:
                comm.check(
                    prefixes[r, a:b],
                    None if blocks is None else blocks[a:b],
                    norm,
                    query,
                    out_norm,
                    outputs[r, a:b],
                    launch=False,
                )
            for r in publishers:
                if w_os is None:
                    comm.check_publish_args(inputs[r, a:b], step, r)
                else:
                    comm.check_produce_args(inputs[r, a:b], w_os[r], step, r)
        device = self.parts[0][2].device
        if device.type != "cuda":
            raise ValueError(f"the mailbox must be on a CUDA device to launch; got {device}")
        for a, b, comm in self.parts:
            args = (
                prefixes[:, a:b],
                None if blocks is None else blocks[a:b],
                norm,
                query,
                out_norm,
                outputs[:, a:b],
                step,
            )
            if w_os is None:  # run_ranks enqueues every publisher before any consumer
                AllRanks(comm).run_ranks(inputs[:, a:b], *args, ranks=ranks, publishers=publishers)
                continue
            _produce(comm, inputs[:, a:b], w_os, step, publishers)
            AllRanks(comm).run_ranks(None, *args, ranks=ranks, publishers=())

    def error_masks(self) -> list[int]:
        """Per hosted rank, the OR of its error words over the chunks (0: none)."""
        ranks = self.parts[0][2].backend.ranks
        masks = [0] * len(ranks)
        for _, _, comm in self.parts:
            for i, r in enumerate(ranks):
                masks[i] |= int(comm.error(r).item())
        return masks

    def armed(self) -> bool:
        return all(comm.armed() for _, _, comm in self.parts)

    def reset(self) -> None:
        for _, _, comm in self.parts:
            comm.reset()


def _produce(comm, attn, w_os, step, publishers):
    """Every publisher's producer on its rank stream, all joined into the current stream:
    the consumers, forked after, never spin in the SMs a GEMM's CTAs wait for."""
    current = torch.cuda.current_stream(comm.device)
    fork = torch.cuda.Event()
    fork.record(current)
    streams = comm.backend.streams
    for r in publishers:
        streams[r].wait_event(fork)
        comm.produce(attn[r], w_os[r], step, rank=r, stream=streams[r])
    for r in publishers:
        current.wait_stream(streams[r])
