"""Host API of the o-projection all-reduce + AttnRes: buffers, checks and launches.

``OprojAllReduce`` holds the mailboxes (or twoshot rows), error words and hint counters of
one shape and launches the kernels: per rank ``publish``, ``produce``, ``consume``,
``produce_consume`` (through the ``kimi::oproj_*`` torch ops, whose implementations are the
``launch_*`` methods); every rank of a one-GPU backend at once ``publish_all``,
``produce_all``, ``consume_all``; ``run_ranks`` drives every loopback rank. Rows 1..
``MAX_ROWS``: above ``MAX_TOKENS`` the producer is cuBLAS (fp32 sums, one rounding) into a
staging partial, then the publisher. ``ValueError`` before any launch; no CuTe DSL import.
"""

import contextlib

import torch

from tpcomm.checks import check_device_tensor, check_is_tensor, check_real, check_stacked, is_int
from tpcomm.checks import mode as validation_mode
from tpcomm.mailbox import Mailbox, TwoshotRows
from tpcomm.oproj import custom_ops
from tpcomm.oproj.plan import (
    DEFAULT_BUDGET_NS,
    GROUP_THREADS,
    MAX_TOKENS,
    SLICE,
    WORD_ROW_BYTES,
    DeviceLimits,
    Plan,
    buffer_bytes,
    check_config,
    choose,
    min_blocks_per_sm,
    plan_fused,
)
from tpcomm.oproj.reference import check_consume, gemm
from tpcomm.oproj.remote import RemotePuts

__all__ = ["OprojAllReduce", "Plan", "choose"]

RUN_MODES = ("per-rank", "fused", "one-launch")


class OprojAllReduce:
    """Mailbox, error words and hints for one (TP, rows, HID, nb) shape on ``backend``.

    ``step`` picks the mailbox parity (consecutive calls, consecutive steps). ``error(rank)``
    holds the mask of ranks it never heard from within ``budget_ns`` (then ``reset()``);
    ``hints(rank)`` counts the consumer's release increments (4 per CTA and step with
    ``xmoe_reps``). ``groups``, ``twoshot`` and ``producer`` default to ``choose``'s plan
    of the path run (``plan``): twoshot from the measured crossover of per-rank launches
    with a rank per GPU; one-shot on one GPU unless asked (``RowChunks`` asks for it where
    the crossover says), with a split domain and with ``one_launch``. ``fence`` (a sys
    fence before each publish) to on unless every rank shares one GPU. ``one_launch``: for
    the ``*_all`` launches only (no co-residency of the ranks' consumers needed; one-shot
    only, which beat chunked twoshot at every measured row). Buffers (``plan.bytes`` per
    rank) that do not fit the symmetric memory are refused before allocation.
    """

    def __init__(self, backend, tokens, hid, nb, *, has_delta=True, groups=None,
                 xmoe_reps=0, eps=1e-6, out_eps=1e-6, budget_ns=DEFAULT_BUDGET_NS,
                 fence=None, twoshot=None, one_launch=False, producer=None):  # fmt: skip
        split = backend.domain.split  # other domains by put-with-signal: per rank, one-shot
        if split and (twoshot or one_launch):
            raise ValueError("domain_size < TP needs twoshot=False, one_launch=False")
        if twoshot is None and (one_launch or backend.single_device or split):
            # one launch: one-shot only (and it beat chunked twoshot at every measured row);
            # per-rank on one GPU: twoshot only when asked for (RowChunks); a split domain
            twoshot = False
        # the plan of the path this all-reduce runs (its groups, bytes and reason): the
        # measured twoshot crossover applies to per-rank launches across GPUs
        plan = choose(backend.world, tokens, hid, one_launch=bool(one_launch),
                      twoshot=None if twoshot is None else bool(twoshot))  # fmt: skip
        twoshot = plan.twoshot
        producer = plan.producer if producer is None else producer
        if producer not in ("mma", "cublas") or (producer == "mma" and tokens > MAX_TOKENS):
            raise ValueError(f"producer must be 'cublas', or 'mma' for <= {MAX_TOKENS} rows; "
                             f"got {producer!r} for {tokens} rows")  # fmt: skip
        groups = plan.groups if groups is None else groups
        check_config(backend.world, hid, nb, groups, xmoe_reps, twoshot)
        if not is_int(budget_ns) or budget_ns <= 0:
            raise ValueError(f"budget_ns must be a positive int; got {budget_ns!r}")
        check_real("eps", eps, low=0.0)
        check_real("out_eps", out_eps, low=0.0)
        self.bytes = buffer_bytes(backend.world, tokens, hid, twoshot)
        backend.check_fits(self.bytes, f"o-projection buffers for {tokens} rows "
                           f"({'twoshot' if twoshot else 'one-shot'}, TP {backend.world}, "
                           f"HID {hid})")  # fmt: skip
        if not one_launch:  # per-rank consumers spin side by side (loopback: on one GPU)
            backend.check_coresident(
                (hid // SLICE) * tokens, GROUP_THREADS * groups, min_blocks_per_sm(groups)
            )
        self.backend, self.plan = backend, plan
        self.tp, self.tokens, self.hid, self.nb = backend.world, tokens, hid, nb
        self.has_delta, self.groups, self.xmoe_reps = bool(has_delta), groups, xmoe_reps
        self.eps, self.out_eps, self.budget_ns = float(eps), float(out_eps), budget_ns
        self.twoshot, self.producer = twoshot, producer
        self.fence = (not backend.single_device) if fence is None else bool(fence)
        self.remote = None  # RemotePuts with a split domain
        if twoshot:  # hop 1 to the owner's receive view, hop 2 fan-out into gather rows
            self.mailbox, self.rows = None, TwoshotRows(backend, tokens, hid)
            self.multicast_base = 0
            self.device = self.rows.gather_row(backend.ranks[0]).device
            self.peers = {r: backend.peer_pointers(self.rows.receive, r) for r in backend.ranks}
            self.gather_peers = {
                r: backend.peer_pointers(self.rows.gather, r) for r in backend.ranks
            }
        else:
            self.mailbox, self.rows = Mailbox(backend, tokens, hid), None
            mc = self.mailbox.multicast()
            self.multicast_base = 0 if mc is None else mc.data_ptr()
            self.device = self.mailbox.local(backend.ranks[0]).device
            self.peers = {r: self.mailbox.peer_pointers(r) for r in backend.ranks}
            if split:  # other domains' entries: this rank's own mailbox (then put_signal)
                self.remote = RemotePuts(backend, self.mailbox)
                self.peers = {r: self.remote.peers(r, p) for r, p in self.peers.items()}
            self.gather_peers = self.peers  # unused without twoshot
        # what check_consume sees of the mailbox (shape and dtype only)
        self._probe = torch.empty((self.tp, tokens, hid), dtype=torch.bfloat16, device="meta")
        n = max(backend.ranks) + 1
        words = WORD_ROW_BYTES // 4  # a rank's row (the one-launch kernels' stride)
        self.errors = torch.zeros((n, words), dtype=torch.int32, device=self.device)
        self.hint_words = torch.zeros((n, words), dtype=torch.int32, device=self.device)
        bf = dict(dtype=torch.bfloat16, device=self.device)
        self._no_blocks = torch.zeros((tokens, 1, hid), **bf)
        self._no_xmoe = torch.zeros((1, tokens, hid), **bf)
        self._no_recv = torch.zeros((8,), **bf)
        self._fns = None
        self._staging = None  # [ranks, tokens, HID]: the GEMM's partials above MAX_TOKENS
        self._fused_plans = {}
        self.one_launch, self._one_launch_checked = bool(one_launch), False
        self.handle = custom_ops.register(self)  # how the kimi::oproj_* ops find it
        if self.one_launch:  # consumers start after every partial: no co-residency needed
            self._check_one_launch()

    # --- compiled kernels -------------------------------------------------------------
    def functions(self):
        """(publisher, consumer) compiled for this all-reduce's per-rank launches."""
        if self._fns is None:
            from tpcomm.oproj.kernels.consumer import compiled

            consumer = compiled(
                self.tp, self.hid, self.nb, self.has_delta, self.groups, self.xmoe_reps,
                twoshot=self.twoshot, fence=self.fence, domain=self.backend.domain.size,
            )  # fmt: skip
            self._fns = (self._publisher(), consumer)
        return self._fns

    def error(self, rank=None):
        return self.errors[self.backend.ranks[0] if rank is None else rank, :1]

    def hints(self, rank=None):
        return self.hint_words[self.backend.ranks[0] if rank is None else rank, :1]

    # --- validation -------------------------------------------------------------------
    def _rank(self, rank):
        rank = self.backend.ranks[0] if rank is None else rank
        if rank not in self.peers:
            raise ValueError(f"rank {rank} is not hosted by this process")
        return rank

    @staticmethod
    def _step(step):
        if not is_int(step) or step < 0:
            raise ValueError(f"step must be a non-negative int; got {step!r}")
        return step

    def check(self, prefix, blocks, norm, query, out_norm, output, xmoe=None, validate=None,
              *, launch=True):  # fmt: skip
        """ValueError naming the argument unless the consumer can take these tensors
        (``validate="full"``: also refuse non-finite inputs; ``launch``: and the mailbox is
        on a GPU; the fake ops check shapes only)."""
        _, n, _, nb = check_consume(
            self._probe, prefix, blocks, norm, query, out_norm,
            groups=self.groups, eps=self.eps, out_eps=self.out_eps, device=self.device,
            full=validation_mode(validate) == "full",
        )  # fmt: skip
        if nb != self.nb:
            raise ValueError(
                f"blocks holds nb = {nb} snapshots; this all-reduce has nb = {self.nb}"
            )
        shape = (self.tokens, self.hid)
        for name, t in (("prefix", prefix), ("output", output)):
            check_device_tensor(name, t, shape, torch.bfloat16, self.device)
        for name, t in (("norm", norm), ("query", query), ("out_norm", out_norm)):
            check_device_tensor(name, t, (self.hid,), torch.bfloat16, self.device)
        if blocks is not None:
            check_device_tensor("blocks", blocks, blocks.shape, torch.bfloat16, self.device)
        if self.xmoe_reps:
            want = (self.xmoe_reps, self.tokens, self.hid)
            check_device_tensor("xmoe", xmoe, want, torch.bfloat16, self.device)
        elif xmoe is not None:
            raise ValueError("xmoe given, but this all-reduce was built with xmoe_reps = 0")
        if launch:
            self._require_cuda()

    def _require_cuda(self):
        if self.device.type != "cuda":
            raise ValueError(f"the mailbox must be on a CUDA device to launch; got {self.device}")

    def check_publish_args(self, partial, step, rank):
        """``publish``'s checks (the fake ``kimi::oproj_publish``)."""
        self._rank(rank)
        self._step(step)
        shape = (self.tokens, self.hid)
        check_device_tensor("partial", partial, shape, torch.bfloat16, self.device)

    def check_produce_args(self, attn_out, w_o, step, rank):
        """``produce``'s checks (the fake ``kimi::oproj_produce``); returns D_local."""
        self._rank(rank)
        self._step(step)
        return self._check_projection(attn_out, w_o)

    def check_consume_args(self, prefix, blocks, norm, query, out_norm, output, step, xmoe, rank,
                           validate=None):  # fmt: skip
        """``consume``'s checks but the device's (the fake ``kimi::oproj_consume``)."""
        self._rank(rank)
        self._step(step)
        self.check(prefix, blocks, norm, query, out_norm, output, xmoe, validate, launch=False)

    # --- per-rank launches: the entry points call the ops, the ops the launch_* methods --
    def publish(self, partial, step, rank=None, stream=None):
        """Rank ``rank``'s partial [tokens, HID] into every rank's mailbox slot."""
        rank, step = self._rank(rank), self._step(step)
        check_is_tensor(partial=partial)
        with _on(stream):
            torch.ops.kimi.oproj_publish(self.handle, rank, step, partial)

    def launch_publish(self, partial, step, rank):
        """``kimi::oproj_publish``'s implementation: check, launch on the current stream."""
        self.check_publish_args(partial, step, rank)
        self._launch(self._publisher(), (partial,), rank, step)

    def produce(self, attn_out, w_o, step, rank=None, stream=None):
        """Rank ``rank``'s ``bf16(attn_out @ w_o^T)`` straight into every rank's mailbox slot."""
        rank, step = self._rank(rank), self._step(step)
        check_is_tensor(attn_out=attn_out, w_o=w_o)
        with _on(stream):
            torch.ops.kimi.oproj_produce(self.handle, rank, step, attn_out, w_o)

    def launch_produce(self, attn_out, w_o, step, rank):
        """``kimi::oproj_produce``'s implementation: check, launch on the current stream
        (above ``MAX_TOKENS`` rows, or with ``producer="cublas"``: cuBLAS, then the
        publisher)."""
        d_local = self.check_produce_args(attn_out, w_o, step, rank)
        self._require_cuda()
        if self.producer == "cublas":
            partial = self.staging()[rank]
            gemm(attn_out, w_o.t(), partial)
            self._launch(self._publisher(), (partial,), rank, step)
            return
        self._launch(self._producer(d_local), (attn_out, w_o), rank, step)

    def staging(self):
        """The GEMM's partials ``[ranks, tokens, HID]`` (row r: rank r's), allocated once."""
        if self._staging is None:
            n = max(self.backend.ranks) + 1
            shape = (n, self.tokens, self.hid)
            self._staging = torch.empty(shape, dtype=torch.bfloat16, device=self.device)
        return self._staging

    def consume(self, prefix, blocks, norm, query, out_norm, output, step, *, xmoe=None,
                rank=None, stream=None, checked=False, validate=None):  # fmt: skip
        """Rank ``rank``'s consumer: ``prefix`` is updated in place to ``prefix_new``
        (``validate``: ``check``'s; ``checked``: the caller ran ``check``)."""
        rank, step = self._rank(rank), self._step(step)
        validation_mode(validate)
        check_is_tensor(prefix=prefix, norm=norm, query=query, out_norm=out_norm, output=output,
                 blocks=blocks, xmoe=xmoe, optional=("blocks", "xmoe"))  # fmt: skip
        with _on(stream):
            torch.ops.kimi.oproj_consume(self.handle, rank, step, prefix, blocks, norm, query,
                                         out_norm, output, xmoe, bool(checked),
                                         validate)  # fmt: skip

    def launch_consume(self, prefix, blocks, norm, query, out_norm, output, step, *, xmoe,
                       rank, checked, validate=None):  # fmt: skip
        """``kimi::oproj_consume``'s implementation (``checked``: the caller checked)."""
        rank, step = self._rank(rank), self._step(step)
        if not checked:
            self.check(prefix, blocks, norm, query, out_norm, output, xmoe, validate)
        import cuda.bindings.driver as cuda

        stream = torch.cuda.current_stream(self.device)
        args = self._consumer_args(rank, prefix, blocks, norm, query, out_norm, output, step, xmoe)
        self.functions()[1](*args, cuda.CUstream(stream.cuda_stream))
        if self.remote is not None:  # this parity's signal words, after every CTA read
            self.remote.rearm(rank, step)

    # the compiled launches, one key each: ``ranks`` = TP launches every rank at once
    def _publisher(self, pdl=False, ranks=1):
        from tpcomm.oproj.kernels.producer import compiled_publisher

        return compiled_publisher(self.tp, self.hid, self.multicast_base != 0, self.fence, pdl,
                                  twoshot=self.twoshot, ranks=ranks)  # fmt: skip

    def _producer(self, d_local, pdl=False, ranks=1):
        from tpcomm.oproj.kernels.producer import compiled_producer

        return compiled_producer(self.tp, self.hid, d_local, self.multicast_base != 0,
                                 self.fence, pdl, twoshot=self.twoshot, ranks=ranks)  # fmt: skip

    def _launch(self, fn, tensors, rank, step):
        """A publisher or producer launch: ``tensors`` (partial, or attn_out and w_o) of
        ``rank``, its peer table, then rank and parity, on the current stream."""
        import cuda.bindings.driver as cuda
        from cutlass import Int32, Int64

        from tpcomm.cuteutil import to_cute

        stream = torch.cuda.current_stream(self.device)
        fn(*(to_cute(t) for t in tensors), to_cute(self.peers[rank], 8),
           Int64(self.multicast_base), Int32(rank), Int32(step & 1),
           cuda.CUstream(stream.cuda_stream))  # fmt: skip
        if self.remote is not None:  # the slot to the other domains, after the stores
            self.remote.put(rank, step)

    def _check_projection(self, attn_out, w_o):
        """ValueError naming the argument unless ``attn_out`` [tokens, D_local] and ``w_o``
        [HID, D_local] fit; returns D_local."""
        if not isinstance(attn_out, torch.Tensor) or attn_out.dim() != 2:
            raise ValueError("attn_out must be a 2-D [tokens, D_local] torch.Tensor")
        d_local = attn_out.shape[1]
        if d_local <= 0 or d_local % 128:
            raise ValueError(f"attn_out width D_local must be a multiple of 128; got {d_local}")
        check_device_tensor(
            "attn_out", attn_out, (self.tokens, d_local), torch.bfloat16, self.device
        )
        check_device_tensor("w_o", w_o, (self.hid, d_local), torch.bfloat16, self.device)
        return d_local

    def _consumer_args(self, rank, prefix, blocks, norm, query, out_norm, output, step, xmoe):
        """The consumer's launch arguments (``OprojConsumerKernel.__call__`` less the stream)."""
        from cutlass import Float32, Int32, Int64

        from tpcomm.cuteutil import to_cute

        if self.twoshot:
            box = self.rows.gather_row(rank).view(2, 1, self.tokens, self.hid)
            recv = self.rows.receive_view(rank).view(-1)
        else:
            box, recv = self.mailbox.local(rank), self._no_recv
            if self.remote is not None:  # the consumer's signal words travel as ``recv``
                recv = self.remote.words(rank)
        return (
            to_cute(box), to_cute(prefix),
            to_cute(self._no_blocks if blocks is None else blocks),
            to_cute(norm), to_cute(query), to_cute(out_norm), to_cute(output),
            to_cute(self._no_xmoe if xmoe is None else xmoe), to_cute(self.hints(rank), 4),
            Float32(self.eps), Float32(self.out_eps), to_cute(self.error(rank), 4),
            Int32(step & 1), Int64(self.budget_ns), to_cute(recv),
            to_cute(self.gather_peers[rank], 8), Int32(rank),
        )  # fmt: skip

    # --- fused producer + consumer ------------------------------------------------------
    def fused_plan(self, tiles=None, limits=None, launches=None):
        """The fused launch on this GPU (``tpcomm.oproj.plan.plan_fused``): ValueError when
        its CTAs cannot all be resident. ``launches``: launches sharing the GPU at once;
        default every rank's on a one-GPU backend (loopback), else 1 (a benchmark of one
        loopback rank alone passes 1). ``limits`` (``DeviceLimits``) overrides the
        device's."""
        key = (tiles, limits, launches)
        if key not in self._fused_plans:
            if limits is None:
                if self.device.type != "cuda":
                    raise ValueError(f"the fused plan needs a CUDA device; got {self.device}")
                limits = DeviceLimits.of(self.device)
            shared = self.backend.world if self.backend.single_device else 1
            plan = plan_fused(
                self.tp, self.tokens, self.hid, self.nb, self.groups, limits,
                launches=shared if launches is None else launches, tiles=tiles,
                xmoe_reps=self.xmoe_reps,
            )  # fmt: skip
            if launches is None:  # the backend's own rule too (loopback: world launches)
                self.backend.check_coresident(plan.ctas, plan.threads, plan.launch_bound)
            self._fused_plans[key] = plan
        return self._fused_plans[key]

    def fused_function(self, d_local, tiles=None, pdl=False, launches=None):
        """The compiled ``OprojFused`` for this all-reduce (plans first: may refuse)."""
        from tpcomm.oproj.kernels.fused import compiled_fused

        plan = self.fused_plan(tiles, launches=launches)
        return compiled_fused(
            self.tp, self.hid, self.nb, d_local, plan.tiles, self.has_delta, self.groups,
            self.xmoe_reps, self.multicast_base != 0, self.fence, bool(pdl), self.twoshot,
        )  # fmt: skip

    def produce_consume(self, attn_out, w_o, prefix, blocks, norm, query, out_norm, output,
                        step, *, xmoe=None, rank=None, stream=None, tiles=None, pdl=False,
                        launches=None, checked=False):  # fmt: skip
        """Rank ``rank``'s ``produce`` + ``consume`` in one launch (``OprojFused``): its
        ``bf16(attn_out @ w_o^T)`` into every rank's mailbox, then the all-reduce, AttnRes
        and norm; ``prefix`` updated in place. Bitwise what ``produce`` then ``consume``
        give. ``tiles`` overrides the plan's tiles per producer group, ``launches`` its
        count of launches sharing the GPU (``fused_plan``); ``pdl`` launches with
        programmatic dependent launch (waits for the previous kernel in-kernel)."""
        rank, step = self._rank(rank), self._step(step)
        check_is_tensor(attn_out=attn_out, w_o=w_o, prefix=prefix, norm=norm, query=query,
                 out_norm=out_norm, output=output, blocks=blocks, xmoe=xmoe,
                 optional=("blocks", "xmoe"))  # fmt: skip
        with _on(stream):
            torch.ops.kimi.oproj_produce_consume(
                self.handle, rank, step, attn_out, w_o, prefix, blocks, norm, query, out_norm,
                output, xmoe, tiles, bool(pdl), launches, bool(checked),
            )  # fmt: skip

    def launch_produce_consume(self, attn_out, w_o, prefix, blocks, norm, query, out_norm,
                               output, step, *, xmoe, rank, tiles, pdl, launches,
                               checked):  # fmt: skip
        """``kimi::oproj_produce_consume``'s implementation: check, plan, launch."""
        d_local = self.check_produce_args(attn_out, w_o, step, rank)
        if self.remote is not None:
            raise ValueError("the fused producer + consumer needs every rank in one domain")
        if not checked:
            self.check(prefix, blocks, norm, query, out_norm, output, xmoe)
        fn = self.fused_function(d_local, tiles, pdl, launches)
        import cuda.bindings.driver as cuda
        from cutlass import Int64

        from tpcomm.cuteutil import to_cute

        stream = torch.cuda.current_stream(self.device)
        args = self._consumer_args(rank, prefix, blocks, norm, query, out_norm, output, step, xmoe)
        fn(
            to_cute(attn_out), to_cute(w_o), to_cute(self.peers[rank], 8),
            Int64(self.multicast_base), *args, cuda.CUstream(stream.cuda_stream),
        )  # fmt: skip

    # --- every loopback rank -----------------------------------------------------------
    def run_ranks(self, inputs, prefixes, blocks, norm, query, out_norm, outputs, step, *,
                  xmoes=None, w_os=None, ranks=None, publishers=None, mode="per-rank",
                  pdl=False):  # fmt: skip
        """Loopback: one step of every rank, bitwise the same in every ``mode``; ``inputs``
        [TP, tokens, HID] partials, or with ``w_os`` [TP, HID, D_local] the ranks' attn_out.
        ``mode``: ``"per-rank"`` (publish or produce, then consume, on each rank's stream;
        ``ranks`` limits the consumers, ``publishers`` the ranks that publish),
        ``"fused"`` (``produce_consume`` per rank; needs ``w_os``), ``"one-launch"``
        (the ``*_all`` launches on the current stream). ``pdl``: fused and one-launch."""
        if mode not in RUN_MODES:
            raise ValueError(f"mode must be one of {RUN_MODES}; got {mode!r}")
        if mode == "one-launch":
            if ranks is not None or publishers is not None:
                raise ValueError("run_ranks(mode='one-launch') runs every rank: leave ranks "
                                 "and publishers out")  # fmt: skip
            step = self._step(step)
            self._check_all(prefixes, blocks, norm, query, out_norm, outputs, xmoes)
            if w_os is not None:
                self.produce_all(inputs, w_os, step, pdl=pdl)
            else:
                self.publish_all(inputs, step, pdl=pdl)
            self.consume_all(prefixes, blocks, norm, query, out_norm, outputs, step,
                             xmoes=xmoes, pdl=pdl, checked=True)  # fmt: skip
            return
        if self.one_launch:
            raise ValueError(
                "this all-reduce was built with one_launch=True (its ranks' consumers need "
                "not fit the GPU together): run_ranks(..., mode='one-launch')"
            )
        streams = getattr(self.backend, "streams", None)
        if not streams:
            raise ValueError("run_ranks needs a backend with one stream per rank (loopback)")
        fused = mode == "fused"
        ranks = self.backend.ranks if ranks is None else tuple(ranks)
        publishers = ranks if publishers is None else tuple(publishers)
        if fused and w_os is None:
            raise ValueError("run_ranks(mode='fused') needs w_os: the fused kernel projects")
        if fused and set(publishers) != set(ranks):
            raise ValueError("run_ranks(mode='fused'): a rank publishes exactly when it "
                             "consumes; limit both with ranks, not publishers")  # fmt: skip
        for r in ranks:
            x = None if xmoes is None else xmoes[r]
            self.check(prefixes[r], blocks, norm, query, out_norm, outputs[r], x)
            if fused:
                self._check_projection(inputs[r], w_os[r])
        if fused:  # plan (may refuse) and compile before the first rank starts polling
            self.fused_function(inputs.shape[-1], pdl=pdl)
        current = torch.cuda.current_stream(self.device)
        fork = torch.cuda.Event()
        fork.record(current)
        # every publisher or producer is enqueued before any consumer, so no consumer's
        # poll budget covers the host's launches of later ranks
        for r in sorted(set(ranks) | set(publishers)):
            streams[r].wait_event(fork)
            x = None if xmoes is None else xmoes[r]
            with torch.cuda.stream(streams[r]):
                if fused:
                    self.produce_consume(inputs[r], w_os[r], prefixes[r], blocks, norm, query,
                                         out_norm, outputs[r], step, xmoe=x, rank=r,
                                         stream=streams[r], pdl=pdl, checked=True)  # fmt: skip
                elif r in publishers and w_os is not None:
                    self.produce(inputs[r], w_os[r], step, rank=r, stream=streams[r])
                elif r in publishers:
                    self.publish(inputs[r], step, rank=r, stream=streams[r])
        for r in () if fused else sorted(ranks):
            x = None if xmoes is None else xmoes[r]
            with torch.cuda.stream(streams[r]):
                self.consume(prefixes[r], blocks, norm, query, out_norm, outputs[r], step,
                             xmoe=x, rank=r, stream=streams[r], checked=True)  # fmt: skip
        for r in sorted(set(ranks) | set(publishers)):
            current.wait_stream(streams[r])

    # --- every rank of a one-GPU backend in one launch ----------------------------------
    def _check_one_launch(self):
        """ValueError unless one launch can serve every rank: a one-GPU backend hosting
        ranks 0..TP-1 whose mailboxes are consecutive slices of one allocation (checked once:
        the layout is fixed at construction)."""
        if self._one_launch_checked:
            return
        if self.twoshot:
            raise ValueError("one launch for every rank is one-shot only: twoshot=False")
        if not self.backend.single_device or tuple(self.backend.ranks) != tuple(range(self.tp)):
            raise ValueError("one launch for every rank needs one GPU hosting ranks 0..TP-1")
        base = self.mailbox.local(0)
        for r in range(self.tp):
            box = self.mailbox.local(r)
            if box.data_ptr() != base.data_ptr() + r * base.nbytes or not box.is_contiguous():
                raise ValueError("one launch for every rank needs the ranks' mailboxes "
                                 "consecutive in one allocation")  # fmt: skip
        self._one_launch_checked = True

    def produce_all(self, attn_outs, w_os, step, *, pdl=False):
        """Every rank's ``bf16(attn_out @ w_o^T)`` into every mailbox in one launch on the
        current stream (grid y = rank): ``attn_outs`` [TP, tokens, D_local], ``w_os``
        [TP, HID, D_local], contiguous. ``pdl``: waits for the previous kernel in-kernel and
        lets the next (``consume_all(..., pdl=True)``) launch early."""
        step = self._step(step)
        self._check_one_launch()
        if not isinstance(attn_outs, torch.Tensor) or attn_outs.dim() != 3:
            raise ValueError("attn_outs must be a 3-D [TP, tokens, D_local] torch.Tensor")
        if not isinstance(w_os, torch.Tensor) or w_os.dim() != 3:
            raise ValueError("w_os must be a 3-D [TP, HID, D_local] torch.Tensor")
        d_local = self._check_projection(attn_outs[0], w_os[0])
        check_stacked("attn_outs", attn_outs, (self.tp, self.tokens, d_local))
        check_stacked("w_os", w_os, (self.tp, self.hid, d_local))
        self._require_cuda()
        if self.producer == "cublas":  # one batched cuBLAS GEMM, then one publisher launch
            partials = self.staging()[: self.tp]
            gemm(attn_outs, w_os.transpose(1, 2), partials)
            self._launch(self._publisher(pdl, ranks=self.tp), (partials[0],), 0, step)
            return
        fn = self._producer(d_local, pdl, ranks=self.tp)
        self._launch(fn, (attn_outs[0], w_os[0]), 0, step)

    def publish_all(self, partials, step, *, pdl=False):
        """Every rank's ready partial (``partials`` [TP, tokens, HID], contiguous) into every
        mailbox in one launch on the current stream (grid z = rank)."""
        step = self._step(step)
        self._check_one_launch()
        check_stacked("partials", partials, (self.tp, self.tokens, self.hid))
        check_device_tensor("partials", partials[0], (self.tokens, self.hid), torch.bfloat16,
                             self.device)  # fmt: skip
        self._launch(self._publisher(pdl, ranks=self.tp), (partials[0],), 0, step)

    def _check_all(self, prefixes, blocks, norm, query, out_norm, outputs, xmoes):
        self._check_one_launch()
        shape = (self.tokens, self.hid)
        for name, t in (("prefixes", prefixes), ("outputs", outputs)):
            check_stacked(name, t, (self.tp, *shape))
        if xmoes is not None:
            check_stacked("xmoes", xmoes, (self.tp, self.xmoe_reps, *shape))
        for r in range(self.tp):
            self.check(prefixes[r], blocks, norm, query, out_norm, outputs[r],
                       None if xmoes is None else xmoes[r])  # fmt: skip

    def consume_all(self, prefixes, blocks, norm, query, out_norm, outputs, step, *,
                    xmoes=None, pdl=False, checked=False):  # fmt: skip
        """Every rank's consumer in one launch on the current stream (grid z = rank):
        ``prefixes``/``outputs`` [TP, tokens, HID], ``xmoes`` [TP, reps, tokens, HID], all
        contiguous; every rank's partials published before (or by the PDL primary)."""
        step = self._step(step)
        if not checked:
            self._check_all(prefixes, blocks, norm, query, out_norm, outputs, xmoes)
        import cuda.bindings.driver as cuda

        from tpcomm.oproj.kernels.consumer import compiled

        consumer = compiled(self.tp, self.hid, self.nb, self.has_delta, self.groups,
                            self.xmoe_reps, pdl, fence=self.fence, ranks=self.tp)  # fmt: skip
        args = self._consumer_args(0, prefixes[0], blocks, norm, query, out_norm, outputs[0],
                                   step, None if xmoes is None else xmoes[0])  # fmt: skip
        stream = torch.cuda.current_stream(self.device)
        consumer(*args, cuda.CUstream(stream.cuda_stream))

    def buffers(self, rank):
        """The protocol buffers hosted for ``rank`` (mailbox, or receive view + gather row)."""
        if self.twoshot:
            return [self.rows.receive_view(rank), self.rows.gather_row(rank)]
        return [self.mailbox.local(rank)]

    def armed(self):
        """True when every hosted protocol buffer is all sentinel (nothing left unconsumed)."""
        return all(
            bool((b.view(torch.int32) == -1).all())
            for r in self.backend.ranks
            for b in self.buffers(r)
        )

    def reset(self):
        """Clear error words and hints and re-arm every mailbox (after a timeout)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.errors.zero_()
        self.hint_words.zero_()
        (self.rows if self.twoshot else self.mailbox).arm()
        if self.remote is not None:
            self.remote.arm()


def _on(stream):
    """``stream`` as the current stream (the ops launch on it); None: the current one."""
    return contextlib.nullcontext() if stream is None else torch.cuda.stream(stream)
