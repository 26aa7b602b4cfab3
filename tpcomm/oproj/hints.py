"""``HintWaiter``: the stand-in for the MoE dispatch that reads the consumer's latent copies.

The consumer (``xmoe_reps`` > 0) writes ``xmoe`` [reps, rows, HID] with relaxed gpu-scope
stores, a gpu-scope acq_rel fence, a warp sync, then one gpu-scope release increment of
the rank's hint counter per lead warp: ``quota = 4 * (HID / 1024) * rows`` increments per
step. The waiter, on another stream of the same GPU: thread 0 of each CTA spins (acquire,
gpu scope, bounded by ``budget_ns``) until the counter reaches ``quota``, a CTA barrier,
and only then its threads read their share of the copies (plain loads, not the
non-coherent path) into ``dest``. The last CTA to finish takes the quota back off the
counter (and clears its own done count), so each step starts from zero and graph replays
need no host state; the next step's consumer must be ordered after the waiter (join its
stream). A budget that runs out sets the waiter's error word and the CTA reads nothing;
the budget runs from the waiter's start, so enqueue it after the consumers it waits for
(forked from before them): launched first, it would spin while the host still launches
them. Its CTAs spin, so a GPU hosts at most ``WAITER_GPU_CTAS`` of them over all its ranks
(``waiter_ctas``): more kept the one-launch consumer's clusters off the GPU until the
waiters gave up (measured, ``waiter_ctas``' docstring); the consumer never waits on the
waiter (the GPU test reports when the consumer and the waiter ended should one time out).

Hint row of a rank (int32 [4], ``WORD_ROW_BYTES`` apart per rank): word 0 the counter,
word 1 the waiter CTAs done, word 2 the waiter's error word.

Rows travel as their own argument and the kernel reads only the tensors' addresses: a
compiled function reads a tensor's extents from the descriptor slots of its compile-time
layout, so a fake ``(reps, ?, HID)`` read ``rows`` from the slot where ``to_cute``'s fully
dynamic ``(?, ?, ?)`` keeps ``reps`` (the waiter read reps rows). The fake arguments are
``to_cute``'s layouts all the same (``fake_like_runtime``).
"""

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Int32, Int64

from tpcomm import protocol
from tpcomm.cuteutil import compile_cached, fake_like_runtime, launch, smem_tensor
from tpcomm.oproj.plan import MAX_ROWS, THREADS, WORD_ROW_BYTES, check_hidden, hint_quota

WAITER_GPU_CTAS = 8  # spinning waiter CTAs per GPU, over every rank it hosts


def waiter_ctas(ranks: int) -> int:
    """CTAs per rank of a waiter launch hosting ``ranks`` ranks on one GPU: the GPU's budget
    ``WAITER_GPU_CTAS`` shared out (at least one each). Measured on the H200 (loopback TP 8,
    16 to 1024 rows): 8 CTAs per rank (64 spinning before the one-launch consumer) kept the
    consumer's 7-CTA clusters off the GPU until the waiters' budget ran out (the consumer
    ended after 2 s, error word 1), with the driver's carveout and with carveout 100 alike;
    1 CTA per rank (8 in all) never did."""
    return max(1, WAITER_GPU_CTAS // ranks)


class HintWaiter:
    """Compile-time configuration: HID, reps, CTAs per rank (default ``waiter_ctas(ranks)``),
    ``ranks`` (1, or every rank of a one-GPU backend in one launch: rank r's operands r
    times one rank's past rank 0's)."""

    def __init__(self, hid, reps, *, ctas=None, ranks=1):
        check_hidden(hid)
        if not isinstance(reps, int) or not 1 <= reps <= 8:
            raise ValueError(f"reps must be an int in 1..8; got {reps!r}")
        if not isinstance(ranks, int) or not 1 <= ranks <= 16:
            raise ValueError(f"ranks must be an int in 1..16; got {ranks!r}")
        ctas = waiter_ctas(ranks) if ctas is None else ctas
        if not isinstance(ctas, int) or not 1 <= ctas <= 1024:
            raise ValueError(f"ctas must be an int in 1..1024; got {ctas!r}")
        self.hid, self.reps, self.ctas, self.ranks = hid, reps, ctas, ranks

    @cute.jit
    def __call__(
        self,
        xmoe: cute.Tensor,
        dest: cute.Tensor,
        hints: cute.Tensor,
        rows: Int32,
        quota: Int32,
        budget_ns: Int64,
        stream: cuda.CUstream,
    ):
        call = self.kernel(
            Int64(xmoe.iterator.toint()),
            Int64(dest.iterator.toint()),
            Int64(hints.iterator.toint()),
            rows,
            quota,
            budget_ns,
        )
        launch(call, (self.ctas, 1, self.ranks), (THREADS, 1, 1), stream)

    @cute.kernel
    def kernel(
        self,
        a_xmoe: Int64,
        a_dest: Int64,
        a_hints: Int64,
        rows: Int32,
        quota: Int32,
        budget_ns: Int64,
    ):
        tid, _, _ = cute.arch.thread_idx()
        cta, _, r = cute.arch.block_idx()
        per_rank = Int64(rows) * (self.reps * self.hid * 2)  # bytes of one rank's copies
        if cutlass.const_expr(self.ranks > 1):
            a_xmoe = a_xmoe + Int64(r) * per_rank
            a_dest = a_dest + Int64(r) * per_rank
            a_hints = a_hints + Int64(r) * WORD_ROW_BYTES
        smem = cutlass.memory.SmemAllocator()
        flag = smem_tensor(smem, Int32, (4,))
        if tid == 0:
            flag[0] = protocol.wait_count(a_hints, quota, budget_ns, a_hints + 8)
        cute.arch.barrier()  # the acquire of thread 0 before every thread's reads
        if flag[0] != 0:
            groups = rows * (self.reps * self.hid // 8)  # 16-byte groups of the copies
            for g in cutlass.range(cta * THREADS + tid, groups, self.ctas * THREADS):
                offset = Int64(g) * 16
                protocol.store16(a_dest + offset, protocol.load16(a_xmoe + offset))
        cute.arch.barrier()
        if tid == 0:
            done = cute.make_ptr(Int32, a_hints + 4, cute.AddressSpace.gmem, assumed_align=4)
            old = cute.arch.atomic_add(done.llvm_ptr, Int32(1), sem="acq_rel", scope="gpu")
            if old == self.ctas - 1:  # every CTA read: the quota back off, the count cleared
                if flag[0] != 0:
                    count = cute.make_ptr(Int32, a_hints, cute.AddressSpace.gmem, assumed_align=4)
                    cute.arch.red(
                        count.llvm_ptr,
                        Int32(0) - quota,
                        op="add",
                        dtype="s32",
                        sem="relaxed",
                        scope="gpu",
                    )
                cute.arch.atomic_exch(done.llvm_ptr, Int32(0), sem="relaxed", scope="gpu")


def fake_arguments(hid: int, reps: int):
    """Compile-only arguments of ``HintWaiter.__call__``: the layouts ``to_cute`` gives
    ``wait_hints``' operands (every extent dynamic; rows travel as an argument)."""
    return (
        fake_like_runtime(BFloat16, 3),
        fake_like_runtime(BFloat16, 3),
        fake_like_runtime(Int32, 1, align=4),
        Int32(1),
        Int32(1),
        Int64(1),
        cute.runtime.make_fake_stream(),
    )


def compiled(hid, reps, ctas=None, ranks=1, arch=None):
    """One compile per configuration and arch; rows are dynamic (1..``MAX_ROWS``)."""

    def build():
        return HintWaiter(hid, reps, ctas=ctas, ranks=ranks), fake_arguments(hid, reps)

    return compile_cached(("hint_waiter", hid, reps, ctas, ranks), build, arch=arch)


def launch_values(comm, xmoes, dests, *, rank=None, every_rank=False, budget_ns=None):
    """``wait_hints``' launch in plain values, validated (ValueError naming the argument):
    ``(ranks, xmoe, dest, hint_row, rows, quota, budget_ns)``, ``ranks`` the launch's grid z
    and the tensors rank ``first``'s (rank r's at r times their size past them)."""
    import torch

    from tpcomm.checks import check_device_tensor

    if not comm.xmoe_reps:
        raise ValueError("wait_hints needs an all-reduce built with xmoe_reps > 0")
    if not 1 <= comm.tokens <= MAX_ROWS:
        raise ValueError(f"rows must be in 1..{MAX_ROWS}; got {comm.tokens}")
    shape = (comm.xmoe_reps, comm.tokens, comm.hid)
    if every_rank:
        if rank is not None or tuple(comm.backend.ranks) != tuple(range(comm.tp)):
            raise ValueError("every_rank needs one GPU hosting ranks 0..TP-1 and no rank")
        shape, first = (comm.tp, *shape), 0
    else:
        first = comm.backend.ranks[0] if rank is None else rank
        if first not in comm.backend.ranks:
            raise ValueError(f"rank {first} is not hosted by this process")
    for name, t in (("xmoes", xmoes), ("dests", dests)):
        check_device_tensor(name, t, shape, torch.bfloat16, comm.device)
    budget = comm.budget_ns if budget_ns is None else budget_ns
    if not isinstance(budget, int) or budget <= 0:
        raise ValueError(f"budget_ns must be a positive int; got {budget!r}")
    x, d = (xmoes[0], dests[0]) if every_rank else (xmoes, dests)
    ranks = comm.tp if every_rank else 1
    quota = hint_quota(comm.hid, comm.tokens)
    return ranks, x, d, comm.hint_words[first], comm.tokens, quota, budget


def wait_hints(comm, xmoes, dests, *, rank=None, every_rank=False, budget_ns=None, ctas=None):
    """Launch the waiter on the current stream for ``comm`` (an ``OprojAllReduce`` with
    ``xmoe_reps``): rank ``rank``'s copies ``xmoes`` [reps, rows, HID] into ``dests``, or
    with ``every_rank`` (one GPU hosting ranks 0..TP-1) every rank's, ``[TP, reps, rows,
    HID]`` contiguous, in one launch; ``ctas`` per rank, default ``waiter_ctas``. ValueError
    naming the argument before any launch."""
    import torch

    from tpcomm.cuteutil import to_cute

    if comm.device.type != "cuda":
        raise ValueError(f"wait_hints needs a CUDA device; got {comm.device}")
    ranks, x, d, hint_row, rows, quota, budget = launch_values(
        comm, xmoes, dests, rank=rank, every_rank=every_rank, budget_ns=budget_ns
    )
    fn = compiled(comm.hid, comm.xmoe_reps, ctas, ranks)
    stream = torch.cuda.current_stream(comm.device)
    fn(
        to_cute(x),
        to_cute(d),
        to_cute(hint_row, 4),
        Int32(rows),
        Int32(quota),
        Int64(budget),
        cuda.CUstream(stream.cuda_stream),
    )
