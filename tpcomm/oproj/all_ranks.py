"""Every rank of a one-GPU backend (loopback) driven from one process.

``AllRanks`` runs a step of every rank of an ``OprojAllReduce``: ``run_ranks`` in three
modes, bitwise alike (per-rank launches on the ranks' streams, the fused launch per rank,
or one launch for every rank), and the one-launch kernels themselves: ``publish_all``,
``produce_all`` (grid y or z = rank), ``consume_all`` (grid z = rank), each on the current
stream. Per-rank launches go through the ``OprojAllReduce``'s entries (the torch ops); the
one-launch ones through ``tpcomm.oproj.launcher``. ``ValueError`` before any launch.
"""

from __future__ import annotations

import torch

from tpcomm.checks import check_device_tensor, check_stacked
from tpcomm.oproj import checks, launcher
from tpcomm.oproj.gemm import gemm
from tpcomm.oproj.operands import ConsumeTensors

RUN_MODES = ("per-rank", "fused", "one-launch")


class AllRanks:
    """The one-GPU all-ranks driver of ``comm`` (an ``OprojAllReduce``; the one-launch
    kernels need ``one_launch=True`` or a layout ``checks.one_launch`` accepts)."""

    def __init__(self, comm):
        self.comm = comm

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
        xmoes=None,
        w_os=None,
        ranks=None,
        publishers=None,
        mode="per-rank",
        pdl=False,
    ):
        """Loopback: one step of every rank, bitwise the same in every ``mode``; ``inputs``
        [TP, tokens, HID] partials, or with ``w_os`` [TP, HID, D_local] the ranks' attn_out.
        ``mode``: ``"per-rank"`` (publish or produce, then consume, on each rank's stream;
        ``ranks`` limits the consumers, ``publishers`` the ranks that publish),
        ``"fused"`` (``produce_consume`` per rank; needs ``w_os``), ``"one-launch"``
        (the ``*_all`` launches on the current stream). ``pdl``: fused and one-launch."""
        comm = self.comm
        if mode not in RUN_MODES:
            raise ValueError(f"mode must be one of {RUN_MODES}; got {mode!r}")
        shared = (blocks, norm, query, out_norm)
        if mode == "one-launch":
            if ranks is not None or publishers is not None:
                raise ValueError(
                    "run_ranks(mode='one-launch') runs every rank: leave ranks and publishers out"
                )
            step = checks.check_step(step)
            checks.stacked(comm, prefixes, *shared, outputs, xmoes)
            if w_os is not None:
                self.produce_all(inputs, w_os, step, pdl=pdl)
            else:
                self.publish_all(inputs, step, pdl=pdl)
            stacked = (prefixes, *shared, outputs)
            self.consume_all(*stacked, step, xmoes=xmoes, pdl=pdl, checked=True)
            return
        if comm.one_launch:
            raise ValueError(
                "this all-reduce was built with one_launch=True (its ranks' consumers need "
                "not fit the GPU together): run_ranks(..., mode='one-launch')"
            )
        streams = getattr(comm.backend, "streams", None)
        if not streams:
            raise ValueError("run_ranks needs a backend with one stream per rank (loopback)")
        fused = mode == "fused"
        ranks = comm.backend.ranks if ranks is None else tuple(ranks)
        publishers = ranks if publishers is None else tuple(publishers)
        if fused and w_os is None:
            raise ValueError("run_ranks(mode='fused') needs w_os: the fused kernel projects")
        if fused and set(publishers) != set(ranks):
            raise ValueError(
                "run_ranks(mode='fused'): a rank publishes exactly when it consumes; limit "
                "both with ranks, not publishers"
            )

        def tensors(r):  # rank r's consumer tensors
            x = None if xmoes is None else xmoes[r]
            return ConsumeTensors(prefixes[r], *shared, outputs[r], x)

        for r in ranks:
            comm.check(*tensors(r))
            if fused:
                checks.projection(comm, inputs[r], w_os[r])
        if fused:  # plan (may refuse) and compile before the first rank starts polling
            comm.fused_function(inputs.shape[-1], pdl=pdl)
        current = torch.cuda.current_stream(comm.device)
        fork = torch.cuda.Event()
        fork.record(current)
        # every publisher or producer is enqueued before any consumer, so no consumer's
        # poll budget covers the host's launches of later ranks
        for r in sorted(set(ranks) | set(publishers)):
            streams[r].wait_event(fork)
            on = dict(rank=r, stream=streams[r])
            with torch.cuda.stream(streams[r]):
                if fused:
                    *t, x = tensors(r)
                    comm.produce_consume(
                        inputs[r], w_os[r], *t, step, xmoe=x, pdl=pdl, checked=True, **on
                    )
                elif r in publishers and w_os is not None:
                    comm.produce(inputs[r], w_os[r], step, **on)
                elif r in publishers:
                    comm.publish(inputs[r], step, **on)
        for r in () if fused else sorted(ranks):
            *t, x = tensors(r)
            with torch.cuda.stream(streams[r]):
                comm.consume(*t, step, xmoe=x, rank=r, stream=streams[r], checked=True)
        for r in sorted(set(ranks) | set(publishers)):
            current.wait_stream(streams[r])

    def produce_all(self, attn_outs, w_os, step, *, pdl=False):
        """Every rank's ``bf16(attn_out @ w_o^T)`` into every mailbox in one launch on the
        current stream (grid y = rank): ``attn_outs`` [TP, tokens, D_local], ``w_os``
        [TP, HID, D_local], contiguous. ``pdl``: waits for the previous kernel in-kernel and
        lets the next (``consume_all(..., pdl=True)``) launch early."""
        comm = self.comm
        step = checks.check_step(step)
        checks.one_launch(comm)
        if not isinstance(attn_outs, torch.Tensor) or attn_outs.dim() != 3:
            raise ValueError("attn_outs must be a 3-D [TP, tokens, D_local] torch.Tensor")
        if not isinstance(w_os, torch.Tensor) or w_os.dim() != 3:
            raise ValueError("w_os must be a 3-D [TP, HID, D_local] torch.Tensor")
        d_local = checks.projection(comm, attn_outs[0], w_os[0])
        check_stacked("attn_outs", attn_outs, (comm.tp, comm.tokens, d_local))
        check_stacked("w_os", w_os, (comm.tp, comm.hid, d_local))
        checks.require_cuda(comm)
        if comm.producer == "cublas":  # one batched cuBLAS GEMM, then one publisher launch
            partials = comm.staging()[: comm.tp]
            gemm(attn_outs, w_os.transpose(1, 2), partials)
            fn = launcher.publisher(comm, pdl, ranks=comm.tp)
            launcher.launch_partial(comm, fn, (partials[0],), 0, step)
            return
        fn = launcher.producer(comm, d_local, pdl, ranks=comm.tp)
        launcher.launch_partial(comm, fn, (attn_outs[0], w_os[0]), 0, step)

    def publish_all(self, partials, step, *, pdl=False):
        """Every rank's ready partial (``partials`` [TP, tokens, HID], contiguous) into every
        mailbox in one launch on the current stream (grid z = rank)."""
        comm = self.comm
        step = checks.check_step(step)
        checks.one_launch(comm)
        shape = (comm.tokens, comm.hid)
        check_stacked("partials", partials, (comm.tp, *shape))
        check_device_tensor("partials", partials[0], shape, torch.bfloat16, comm.device)
        fn = launcher.publisher(comm, pdl, ranks=comm.tp)
        launcher.launch_partial(comm, fn, (partials[0],), 0, step)

    def consume_all(
        self,
        prefixes,
        blocks,
        norm,
        query,
        out_norm,
        outputs,
        step,
        *,
        xmoes=None,
        pdl=False,
        checked=False,
    ):
        """Every rank's consumer in one launch on the current stream (grid z = rank):
        ``prefixes``/``outputs`` [TP, tokens, HID], ``xmoes`` [TP, reps, tokens, HID], all
        contiguous; every rank's partials published before (or by the PDL primary)."""
        comm = self.comm
        step = checks.check_step(step)
        shared = (blocks, norm, query, out_norm)
        if not checked:
            checks.stacked(comm, prefixes, *shared, outputs, xmoes)
        consumer = launcher.consumer(comm, pdl, ranks=comm.tp)
        x = None if xmoes is None else xmoes[0]
        tensors = ConsumeTensors(prefixes[0], *shared, outputs[0], x)
        consumer(launcher.consumer_operands(comm, 0, step, tensors), launcher.stream(comm))
