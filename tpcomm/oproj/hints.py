"""The stand-in for the MoE dispatch that reads the consumer's latent copies after their
ready hints: ``HintWaiter`` (acquires the hints) then ``HintReader`` (reads the copies).

The consumer (``xmoe_reps`` > 0) writes ``xmoe`` [reps, rows, HID] with relaxed gpu-scope
stores, a lead-group barrier, then one gpu-scope release increment of the rank's hint
counter per CTA: ``quota = C * rows`` increments per step (``C = plan.slicing(HID).ctas``).
On another stream of the same GPU, ``wait_hints`` launches two kernels:

- ``HintWaiter``, one 32-thread CTA per rank: thread 0 spins (acquire, gpu scope, a
  ``nanosleep`` between polls, bounded by ``budget_ns``) until the counter reaches
  ``quota``, takes the quota back off the counter (each step starts from zero, graph
  replays need no host state), then triggers the dependent launch. A budget that runs
  out sets the rank's waiter error word (hint word 2) instead.
- ``HintReader`` (PDL after the waiter; ``reader_ctas`` CTAs per rank, up to
  ``READER_CTAS_PER_SM`` a SM over the GPU): ``griddepcontrol.wait`` (the waiter grid
  complete and its memory visible: the copies happened before the acquire it saw), then
  the rank's waiter error word; zero: its threads copy the rank's copies into ``dest``
  (plain coherent loads, ``UNROLL`` 16-byte groups in flight per thread); else nothing.

Why two kernels: the copies are the MoE's input bytes (``3 x reps x rows x HID x 2`` with
the consumer's stores), which only a full grid moves at HBM speed, while spinning CTAs
must stay few (a GPU hosts at most one spinning CTA per rank: 8 per rank of the old
one-kernel waiter kept the one-launch consumer's 7-CTA clusters off the GPU until the
budget ran out, measured at TP 8). The old waiter copied with those few CTAs (one per rank
at TP 8, one 16-byte load in flight per thread): 3.7 MB per rank at 128 rows took about
0.7 ms, the "consumer stage 106 -> 831 us" of ``--xmoe 2`` (issue 33). The next step's
consumer must be ordered after the reader (join its stream). The waiter's budget runs from
its start: enqueue it after the consumers it waits for (forked from before them).

Hint row of a rank (int32 [4], ``WORD_ROW_BYTES`` apart per rank): word 0 the counter,
word 1 unused (zero), word 2 the waiter's error word.

Rows travel as their own argument and the kernels read only the tensors' addresses: a
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
from tpcomm.cuteutil import compile_cached, fake_like_runtime, launch
from tpcomm.oproj.plan import MAX_ROWS, WORD_ROW_BYTES, check_hidden, hint_quota

SLEEP_NS = 128  # the waiter's back-off between polls of the hint counter
READER_THREADS = 256
UNROLL = 4  # 16-byte groups in flight per reader thread
READER_CTAS_PER_SM = 4  # the reader's grid over every rank: at most this many CTAs a SM


def reader_ctas(rows: int, reps: int, hid: int, ranks: int, sms: int) -> int:
    """Reader CTAs per rank: enough for one pass of ``UNROLL`` groups a thread over the
    rank's copies, at most ``READER_CTAS_PER_SM x sms`` over the ``ranks`` (at least one)."""
    groups = rows * reps * hid // 8
    need = -(-groups // (READER_THREADS * UNROLL))
    return max(1, min(need, READER_CTAS_PER_SM * sms // ranks))


def _check_ranks(ranks):
    if not isinstance(ranks, int) or not 1 <= ranks <= 16:
        raise ValueError(f"ranks must be an int in 1..16; got {ranks!r}")


class HintWaiter:
    """Compile-time configuration: ``ranks`` (1, or every rank of a one-GPU backend in one
    launch: rank r's hint row r rows past rank 0's). One 32-thread CTA per rank."""

    def __init__(self, *, ranks=1):
        _check_ranks(ranks)
        self.ranks = ranks

    @cute.jit
    def __call__(self, hints: cute.Tensor, quota: Int32, budget_ns: Int64, stream: cuda.CUstream):
        call = self.kernel(Int64(hints.iterator.toint()), quota, budget_ns)
        launch(call, (1, 1, self.ranks), (32, 1, 1), stream)

    @cute.kernel
    def kernel(self, a_hints: Int64, quota: Int32, budget_ns: Int64):
        tid, _, _ = cute.arch.thread_idx()
        _, _, r = cute.arch.block_idx()
        if cutlass.const_expr(self.ranks > 1):
            a_hints = a_hints + Int64(r) * WORD_ROW_BYTES
        if tid == 0:
            if protocol.wait_count(a_hints, quota, budget_ns, a_hints + 8, SLEEP_NS) != 0:
                # every increment of the step seen: the quota back off the counter
                count = cute.make_ptr(Int32, a_hints, cute.AddressSpace.gmem, assumed_align=4)
                back = Int32(0) - quota
                cute.arch.red(
                    count.llvm_ptr, back, op="add", dtype="s32", sem="relaxed", scope="gpu"
                )
            cute.arch.griddepcontrol_launch_dependents()


class HintReader:
    """Compile-time configuration: HID, reps, ``ranks`` (as ``HintWaiter``). Launched with
    PDL after the waiter; rows and CTAs per rank are runtime arguments."""

    def __init__(self, hid, reps, *, ranks=1):
        check_hidden(hid)
        if not isinstance(reps, int) or not 1 <= reps <= 8:
            raise ValueError(f"reps must be an int in 1..8; got {reps!r}")
        _check_ranks(ranks)
        self.hid, self.reps, self.ranks = hid, reps, ranks

    @cute.jit
    def __call__(
        self,
        xmoe: cute.Tensor,
        dest: cute.Tensor,
        hints: cute.Tensor,
        rows: Int32,
        ctas: Int32,
        stream: cuda.CUstream,
    ):
        call = self.kernel(
            Int64(xmoe.iterator.toint()),
            Int64(dest.iterator.toint()),
            Int64(hints.iterator.toint()),
            rows,
            ctas,
        )
        launch(call, (ctas, 1, self.ranks), (READER_THREADS, 1, 1), stream, use_pdl=True)

    @cute.kernel
    def kernel(self, a_xmoe: Int64, a_dest: Int64, a_hints: Int64, rows: Int32, ctas: Int32):
        tid, _, _ = cute.arch.thread_idx()
        cta, _, r = cute.arch.block_idx()
        cute.arch.griddepcontrol_wait()  # the waiter grid done: its acquire before any read
        per_rank = Int64(rows) * (self.reps * self.hid * 2)  # bytes of one rank's copies
        if cutlass.const_expr(self.ranks > 1):
            a_xmoe = a_xmoe + Int64(r) * per_rank
            a_dest = a_dest + Int64(r) * per_rank
            a_hints = a_hints + Int64(r) * WORD_ROW_BYTES
        error = cute.make_ptr(Int32, a_hints + 8, cute.AddressSpace.gmem, assumed_align=4)
        if cute.arch.load(error.llvm_ptr, Int32, sem="relaxed", scope="gpu") == 0:
            groups = rows * (self.reps * self.hid // 8)  # 16-byte groups of the copies
            stride = ctas * READER_THREADS
            for g0 in cutlass.range(cta * READER_THREADS + tid, groups, stride * UNROLL):
                words = []
                for j in cutlass.range_constexpr(UNROLL):  # loads first: UNROLL in flight
                    g = cutlass.min(g0 + j * stride, groups - 1)
                    words.append(protocol.load16(a_xmoe + Int64(g) * 16))
                for j in cutlass.range_constexpr(UNROLL):
                    g = g0 + j * stride
                    if g < groups:
                        protocol.store16(a_dest + Int64(g) * 16, words[j])


def fake_waiter_arguments():
    """Compile-only arguments of ``HintWaiter.__call__`` (the hint row as ``to_cute``)."""
    hints = fake_like_runtime(Int32, 1, align=4)
    return (hints, Int32(1), Int64(1), cute.runtime.make_fake_stream())


def fake_arguments(hid: int, reps: int):
    """Compile-only arguments of ``HintReader.__call__``: the layouts ``to_cute`` gives
    ``wait_hints``' operands (every extent dynamic; rows travel as an argument)."""
    return (
        fake_like_runtime(BFloat16, 3),
        fake_like_runtime(BFloat16, 3),
        fake_like_runtime(Int32, 1, align=4),
        Int32(1),
        Int32(1),
        cute.runtime.make_fake_stream(),
    )


def compiled_waiter(ranks=1, arch=None):
    """One compile per ``ranks`` and arch."""

    def build():
        return HintWaiter(ranks=ranks), fake_waiter_arguments()

    return compile_cached(("hint_waiter", ranks), build, arch=arch)


def compiled(hid, reps, ranks=1, arch=None):
    """The reader: one compile per configuration and arch; rows are dynamic (1..``MAX_ROWS``)."""

    def build():
        return HintReader(hid, reps, ranks=ranks), fake_arguments(hid, reps)

    return compile_cached(("hint_reader", hid, reps, ranks), build, arch=arch)


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
    """Launch the waiter and the reader on the current stream for ``comm`` (an
    ``OprojAllReduce`` with ``xmoe_reps``): rank ``rank``'s copies ``xmoes`` [reps, rows, HID]
    into ``dests``, or with ``every_rank`` (one GPU hosting ranks 0..TP-1) every rank's,
    ``[TP, reps, rows, HID]`` contiguous, in one launch each; ``ctas``: reader CTAs per
    rank, default ``reader_ctas``. ValueError naming the argument before any launch."""
    import torch

    from tpcomm.cuteutil import to_cute

    if comm.device.type != "cuda":
        raise ValueError(f"wait_hints needs a CUDA device; got {comm.device}")
    ranks, x, d, hint_row, rows, quota, budget = launch_values(
        comm, xmoes, dests, rank=rank, every_rank=every_rank, budget_ns=budget_ns
    )
    if ctas is None:
        sms = torch.cuda.get_device_properties(comm.device).multi_processor_count
        ctas = reader_ctas(rows, comm.xmoe_reps, comm.hid, ranks, sms)
    if not isinstance(ctas, int) or not 1 <= ctas <= 65535:
        raise ValueError(f"ctas must be an int in 1..65535; got {ctas!r}")
    stream = cuda.CUstream(torch.cuda.current_stream(comm.device).cuda_stream)
    hints = to_cute(hint_row, 4)
    compiled_waiter(ranks)(hints, Int32(quota), Int64(budget), stream)
    reader = compiled(comm.hid, comm.xmoe_reps, ranks)
    reader(to_cute(x), to_cute(d), hints, Int32(rows), Int32(ctas), stream)
