"""Mailbox all-reduce: publish, bounded poll, rank-order sum, re-arm.

The simplest user of the mailbox layer and its end-to-end check. One launch per rank and
step; rank ``r`` of a TP group:

1. loads its partial ``[tokens, HID]`` bf16 (16 bytes per thread);
2. publishes it (sentinel words canonicalised) into slot ``[step & 1, r]`` of every
   rank's mailbox: one relaxed sys-scope store per peer through the peer pointer table,
   or one multicast store when the platform has NVLink multicast;
3. polls its own mailbox slots ``[step & 1, 0..TP-1]`` four ranks at a time with a
   bounded spin (``globaltimer`` budget per group of four); on expiry it ORs the mask of
   missing ranks (bit r = rank r) into the error word and exits without writing the
   output or re-arming;
4. sums the slots in rank order in fp32, starting from rank 0's value, rounds once to
   bf16 (nearest even) and writes the output, so every rank's output is bitwise equal to
   ``tpcomm.mailbox.rank_order_sum`` of the partials;
5. re-arms the slots it read (relaxed sys-scope sentinel stores).

Grid ``(HID / 1024, tokens)``, 128 threads, each thread one 16-byte group per slot.
The kernel is compiled with ``min_blocks_per_mp=8`` (at most 64 registers a thread), so
at least 8 of its CTAs fit on an SM: the loopback backend's co-residency check uses that.

Host entry: ``MailboxAllReduce(mailbox, ...)``; the kernel class is ``AllReduceKernel``.
The CuTe DSL is imported lazily: this module imports on a CPU-only machine.
"""

import functools

import torch

from tpcomm.checks import check_tensor
from tpcomm.mailbox import COLUMNS_PER_CTA, MAX_TP, Mailbox

THREADS = 128
MIN_BLOCKS_PER_SM = 8
POLL_CHUNK = 4
DEFAULT_BUDGET_NS = 50_000_000  # 50 ms: far above any healthy step, far below a hang


def grid_ctas(hid: int, tokens: int) -> int:
    """CTAs one rank's launch uses."""
    return (hid // COLUMNS_PER_CTA) * tokens


@functools.cache
def _kernel_class():
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32, Int64

    from tpcomm import ptx
    from tpcomm.cuteutil import launch

    class AllReduceKernel:
        """Compile-time configuration: TP, HID, publish path, optional sys fence."""

        def __init__(self, tp: int, hid: int, *, multicast: bool = False, fence: bool = False):
            if not 1 <= tp <= MAX_TP:
                raise ValueError(f"tp must be in 1..{MAX_TP}; got {tp}")
            if hid <= 0 or hid % COLUMNS_PER_CTA:
                raise ValueError(f"hid must be a positive multiple of {COLUMNS_PER_CTA}; got {hid}")
            self.tp, self.hid = tp, hid
            self.multicast, self.fence = bool(multicast), bool(fence)

        @cute.jit
        def __call__(
            self,
            partial: cute.Tensor,
            out: cute.Tensor,
            mailbox: cute.Tensor,
            peers: cute.Tensor,
            multicast_base: Int64,
            error: cute.Tensor,
            rank: Int32,
            step: Int32,
            budget_ns: Int64,
            stream: cuda.CUstream,
        ):
            grid = (self.hid // COLUMNS_PER_CTA, partial.shape[0], 1)
            call = self.kernel(
                partial, out, mailbox, peers, multicast_base, error, rank, step, budget_ns
            )
            launch(call, grid, (THREADS, 1, 1), stream, min_blocks_per_mp=MIN_BLOCKS_PER_SM)

        @cute.jit
        def publish_all(self, words, peers, multicast_base, offset):
            if cutlass.const_expr(self.multicast):
                ptx.publish(multicast_base + offset, words, multicast=True)
            else:
                for p in cutlass.range_constexpr(self.tp):
                    ptx.publish(peers[p] + offset, words)

        @cute.jit
        def poll_sum(self, acc, raw, base, slot0, slot_bytes, budget_ns, error_address):
            """Rank-order fp32 sum of all slots into ``acc``; returns the missing mask."""
            failed = Int32(0)
            for c in cutlass.range_constexpr((self.tp + POLL_CHUNK - 1) // POLL_CHUNK):
                first: cutlass.Constexpr = c * POLL_CHUNK
                count: cutlass.Constexpr = min(POLL_CHUNK, self.tp - first)
                if failed == 0:
                    addresses = [base + slot0 + (first + i) * slot_bytes for i in range(count)]
                    missing = ptx.poll_groups(
                        raw, addresses, count, budget_ns, error_address, first
                    )
                    failed = missing << first
                    if missing == 0:
                        for i in cutlass.range_constexpr(count):
                            for j in cutlass.range_constexpr(4):
                                lo, hi = ptx.unpack_bf16x2(raw[i * 4 + j])
                                if cutlass.const_expr(first + i == 0):
                                    acc[2 * j], acc[2 * j + 1] = lo, hi
                                else:
                                    acc[2 * j] = acc[2 * j] + lo
                                    acc[2 * j + 1] = acc[2 * j + 1] + hi
            return failed

        @cute.kernel
        def kernel(
            self,
            partial: cute.Tensor,
            out: cute.Tensor,
            mailbox: cute.Tensor,
            peers: cute.Tensor,
            multicast_base: Int64,
            error: cute.Tensor,
            rank: Int32,
            step: Int32,
            budget_ns: Int64,
        ):
            tid, _, _ = cute.arch.thread_idx()
            cta, token, _ = cute.arch.block_idx()
            tokens = partial.shape[0]
            column = cta * COLUMNS_PER_CTA + tid * 8
            row = Int64(token * self.hid + column) * 2  # byte offset inside one slot
            slot_bytes = Int64(tokens) * (self.hid * 2)
            half = Int64(step & 1) * self.tp
            words = ptx.load16(Int64(partial.iterator.toint()) + row)
            if cutlass.const_expr(self.fence):
                ptx.fence_sys()
            self.publish_all(words, peers, multicast_base, (half + rank) * slot_bytes + row)
            acc = cute.make_rmem_tensor(8, Float32)
            raw = cute.make_rmem_tensor(POLL_CHUNK * 4, Int32)
            base = Int64(mailbox.iterator.toint())
            slot0 = half * slot_bytes + row
            error_address = Int64(error.iterator.toint())
            failed = self.poll_sum(acc, raw, base, slot0, slot_bytes, budget_ns, error_address)
            if failed == 0:
                result = [ptx.pack_bf16x2(acc[2 * j], acc[2 * j + 1]) for j in range(4)]
                ptx.store16(Int64(out.iterator.toint()) + row, result)
                for src in cutlass.range_constexpr(self.tp):
                    ptx.rearm(base + slot0 + src * slot_bytes)

    return AllReduceKernel


def kernel_class():
    """The ``AllReduceKernel`` class (imports the CuTe DSL)."""
    return _kernel_class()


def fake_arguments(tp: int, hid: int):
    """Compile-only arguments of ``AllReduceKernel.__call__`` (tokens dynamic)."""
    import cutlass.cute as cute
    from cutlass import BFloat16, Int32, Int64

    tokens = cute.sym_int()

    def fake(dtype, shape, align=16):
        return cute.runtime.make_fake_compact_tensor(dtype, shape, assumed_align=align)

    return (
        fake(BFloat16, (tokens, hid)),
        fake(BFloat16, (tokens, hid)),
        fake(BFloat16, (2, tp, tokens, hid)),
        fake(Int64, (tp,), align=8),
        Int64(0),
        fake(Int32, (1,), align=4),
        Int32(0),
        Int32(0),
        Int64(0),
        cute.runtime.make_fake_stream(),
    )


@functools.cache
def compiled(tp: int, hid: int, multicast: bool = False, fence: bool = False, arch=None):
    """One compile per (TP, HID, publish path, fence, arch); tokens are dynamic."""
    import cutlass.cute as cute

    kernel = kernel_class()(tp, hid, multicast=multicast, fence=fence)
    options = None if arch is None else f"--gpu-arch {arch}"
    return cute.compile(kernel, *fake_arguments(tp, hid), options=options)


def _check_tensor(name, t, shape, dtype, device):
    check_tensor(name, t, dtype, shape=shape, device=device, align=16)


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
            grid_ctas(self.layout.hid, self.layout.tokens), THREADS, MIN_BLOCKS_PER_SM
        )

    def function(self):
        if self._fn is None:
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
        _check_tensor("partial", partial, shape, torch.bfloat16, self.device)
        _check_tensor("out", out, shape, torch.bfloat16, self.device)
        if self.device.type != "cuda":
            raise ValueError(f"the mailbox must be on a CUDA device to launch; got {self.device}")
        import cuda.bindings.driver as cuda
        from cutlass import Int32, Int64
        from cutlass.cute.runtime import from_dlpack

        if stream is None:
            stream = torch.cuda.current_stream(self.device)

        def dl(t, align=16):
            return from_dlpack(t, assumed_align=align).mark_layout_dynamic()

        self.function()(
            dl(partial),
            dl(out),
            dl(self.mailbox.local(rank)),
            dl(self.peers[rank], 8),
            Int64(self.multicast_base),
            dl(self.error(rank), 4),
            Int32(rank),
            Int32(step & 1),
            Int64(self.budget_ns),
            cuda.CUstream(stream.cuda_stream),
        )

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
