"""Per-rank host API of the o-projection all-reduce + AttnRes: buffers, checks, entries.

``OprojAllReduce`` holds the mailboxes (or twoshot rows), error words and hint counters of
one shape; a rank's ``publish``, ``produce``, ``consume`` and ``produce_consume`` go through
the ``kimi::oproj_*`` torch ops (``tpcomm.oproj.custom_ops``, implemented by
``tpcomm.oproj.launcher``). Every rank of a one-GPU backend from one process:
``tpcomm.oproj.all_ranks.AllRanks``. Rows 1..
``MAX_ROWS``: above ``MAX_TOKENS`` the producer is ``OprojGemmProducer`` on an sm_90 GPU (TMA +
wgmma, publishing from its epilogue), elsewhere cuBLAS into a staging partial, then the
publisher (fp32 sums, one rounding, either way). ``ValueError`` before any launch; no CuTe
DSL import.
"""

import contextlib

import torch

from tpcomm.checks import check_is_tensor, check_real, is_int
from tpcomm.checks import mode as validation_mode
from tpcomm.mailbox import Mailbox, TwoshotRows
from tpcomm.oproj import checks, custom_ops, launcher
from tpcomm.oproj.operands import ConsumeTensors
from tpcomm.oproj.plan import (
    DEFAULT_BUDGET_NS,
    MAX_TOKENS,
    PRODUCERS,
    WORD_ROW_BYTES,
    Plan,
    buffer_bytes,
    check_config,
    choose,
    gemm_tile,
    min_blocks_per_sm,
    slicing,
)
from tpcomm.oproj.remote import RemotePuts

__all__ = ["OprojAllReduce", "Plan", "choose"]


def wgmma_device(device=None) -> bool:
    """Whether ``OprojGemmProducer`` (``wgmma``, sm_90 only) runs on this CUDA device (the
    current one by default): what the plan's producer above ``MAX_TOKENS`` rows follows."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability(device) == (9, 0)


class OprojAllReduce:
    """Mailbox, error words and hints for one (TP, rows, HID, nb) shape on ``backend``.

    ``step`` picks the mailbox parity (consecutive calls, consecutive steps). ``error(rank)``
    holds the mask of ranks it never heard from within ``budget_ns`` (then ``reset()``);
    ``hints(rank)`` counts the consumer's release increments (one per CTA and step with
    ``xmoe_reps``). ``groups``, ``twoshot`` and ``producer`` default to ``choose``'s plan
    of the path run (``plan``): twoshot from the measured crossover of per-rank launches
    with a rank per GPU; one-shot on one GPU unless asked (``RowChunks`` asks for it where
    the crossover says), with a split domain and with ``one_launch``. ``fence`` (a sys
    fence before each publish) to on unless every rank shares one GPU. ``one_launch``: for
    the ``*_all`` launches only (no co-residency of the ranks' consumers needed; one-shot
    only, which beat chunked twoshot at every measured row). Buffers (``plan.bytes`` per
    rank) that do not fit the symmetric memory are refused before allocation.
    """

    def __init__(
        self,
        backend,
        tokens,
        hid,
        nb,
        *,
        has_delta=True,
        groups=None,
        xmoe_reps=0,
        eps=1e-6,
        out_eps=1e-6,
        budget_ns=DEFAULT_BUDGET_NS,
        fence=None,
        twoshot=None,
        one_launch=False,
        producer=None,
    ):
        split = backend.domain.split  # other domains by put-with-signal: per rank, one-shot
        if split and (twoshot or one_launch):
            raise ValueError("domain_size < TP needs twoshot=False, one_launch=False")
        if twoshot is None and (one_launch or backend.single_device or split):
            # one launch: one-shot only (and it beat chunked twoshot at every measured row);
            # per-rank on one GPU: twoshot only when asked for (RowChunks); a split domain
            twoshot = False
        # the plan of the path this all-reduce runs (its groups, bytes and reason): the
        # measured twoshot crossover applies to per-rank launches across GPUs
        device = getattr(backend, "device", None)
        cuda = device is not None and torch.device(device).type == "cuda"
        sm90 = cuda and wgmma_device(device)
        plan = choose(
            backend.world,
            tokens,
            hid,
            one_launch=bool(one_launch),
            twoshot=None if twoshot is None else bool(twoshot),
            wgmma=sm90,
        )
        twoshot = plan.twoshot
        producer = plan.producer if producer is None else producer
        if producer not in PRODUCERS or (producer == "mma" and tokens > MAX_TOKENS):
            raise ValueError(
                f"producer must be 'cublas', 'wgmma' (sm_90), or 'mma' for <= {MAX_TOKENS} "
                f"rows; got {producer!r} for {tokens} rows"
            )
        tile = gemm_tile(tokens) if producer == "wgmma" else None
        if tile is not None and cuda and not sm90:
            capability = torch.cuda.get_device_capability(device)
            raise ValueError(
                f"producer='wgmma' needs an sm_90 GPU; got sm_{capability[0]}{capability[1]}"
            )
        groups = plan.groups if groups is None else groups
        check_config(backend.world, hid, nb, groups, xmoe_reps, twoshot)
        if not is_int(budget_ns) or budget_ns <= 0:
            raise ValueError(f"budget_ns must be a positive int; got {budget_ns!r}")
        check_real("eps", eps, low=0.0)
        check_real("out_eps", out_eps, low=0.0)
        self.bytes = buffer_bytes(backend.world, tokens, hid, twoshot)
        backend.check_fits(
            self.bytes,
            f"o-projection buffers for {tokens} rows "
            f"({'twoshot' if twoshot else 'one-shot'}, TP {backend.world}, "
            f"HID {hid})",
        )
        if not one_launch:  # per-rank consumers spin side by side (loopback: on one GPU)
            cut = slicing(hid)
            backend.check_coresident(
                cut.ctas * tokens, cut.threads * groups, min_blocks_per_sm(groups, cut.threads)
            )
        self.backend, self.plan = backend, plan
        self.tp, self.tokens, self.hid, self.nb = backend.world, tokens, hid, nb
        self.has_delta, self.groups, self.xmoe_reps = bool(has_delta), groups, xmoe_reps
        self.eps, self.out_eps, self.budget_ns = float(eps), float(out_eps), budget_ns
        self.twoshot, self.producer, self.gemm_tile = twoshot, producer, tile
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
        self.probe = torch.empty((self.tp, tokens, hid), dtype=torch.bfloat16, device="meta")
        n = max(backend.ranks) + 1
        words = WORD_ROW_BYTES // 4  # a rank's row (the one-launch kernels' stride)
        self.errors = torch.zeros((n, words), dtype=torch.int32, device=self.device)
        self.hint_words = torch.zeros((n, words), dtype=torch.int32, device=self.device)
        bf = dict(dtype=torch.bfloat16, device=self.device)
        # stand-ins for absent consumer operands (the kernels read none of them)
        self.no_blocks = torch.zeros((tokens, 1, hid), **bf)
        self.no_xmoe = torch.zeros((1, tokens, hid), **bf)
        self.no_recv = torch.zeros((8,), **bf)
        self.compiled = None  # (publisher, consumer) of the per-rank launches
        self._staging = None  # [ranks, tokens, HID]: the GEMM's partials above MAX_TOKENS
        self.fused_plans = {}  # (tiles, limits, launches) -> plan
        self.one_launch, self.one_launch_checked = bool(one_launch), False
        self.handle = custom_ops.register(self)  # how the kimi::oproj_* ops find it
        if self.one_launch:  # consumers start after every partial: no co-residency needed
            checks.one_launch(self)

    # --- compiled kernels -------------------------------------------------------------
    def functions(self):
        """(publisher, consumer) compiled for this all-reduce's per-rank launches."""
        return launcher.functions(self)

    def error(self, rank=None):
        return self.errors[self.backend.ranks[0] if rank is None else rank, :1]

    def hints(self, rank=None):
        return self.hint_words[self.backend.ranks[0] if rank is None else rank, :1]

    # --- validation (``tpcomm.oproj.checks``) -------------------------------------------
    def check(
        self,
        prefix,
        blocks,
        norm,
        query,
        out_norm,
        output,
        xmoe=None,
        validate=None,
        *,
        launch=True,
    ):
        """ValueError naming the argument unless the consumer can take these tensors
        (``validate="full"``: also refuse non-finite inputs; ``launch``: and the mailbox is
        on a GPU; the fake ops check shapes only)."""
        tensors = ConsumeTensors(prefix, blocks, norm, query, out_norm, output, xmoe)
        checks.consumer_tensors(self, *tensors, validate, launch=launch)

    def check_publish_args(self, partial, step, rank):
        """``publish``'s checks (the fake ``kimi::oproj_publish``)."""
        checks.publish_args(self, rank, step, partial)

    def check_produce_args(self, attn_out, w_o, step, rank):
        """``produce``'s checks (the fake ``kimi::oproj_produce``); returns D_local."""
        return checks.produce_args(self, rank, step, attn_out, w_o)

    def staging(self):
        """The GEMM's partials ``[ranks, tokens, HID]`` (row r: rank r's), allocated once."""
        if self._staging is None:
            n = max(self.backend.ranks) + 1
            shape = (n, self.tokens, self.hid)
            self._staging = torch.empty(shape, dtype=torch.bfloat16, device=self.device)
        return self._staging

    # --- per-rank launches: through the kimi::oproj_* ops ---------------------------------
    def publish(self, partial, step, rank=None, stream=None):
        """Rank ``rank``'s partial [tokens, HID] into every rank's mailbox slot."""
        rank, step = checks.hosted_rank(self, rank), checks.check_step(step)
        check_is_tensor(partial=partial)
        with _on(stream):
            torch.ops.kimi.oproj_publish(self.handle, rank, step, partial)

    def produce(self, attn_out, w_o, step, rank=None, stream=None):
        """Rank ``rank``'s ``bf16(attn_out @ w_o^T)`` straight into every rank's mailbox slot
        (mma.sync up to ``MAX_TOKENS`` rows, wgmma above on sm_90; with ``producer="cublas"``
        or another GPU above ``MAX_TOKENS``: cuBLAS, then the publisher)."""
        rank, step = checks.hosted_rank(self, rank), checks.check_step(step)
        check_is_tensor(attn_out=attn_out, w_o=w_o)
        with _on(stream):
            torch.ops.kimi.oproj_produce(self.handle, rank, step, attn_out, w_o)

    def consume(
        self,
        prefix,
        blocks,
        norm,
        query,
        out_norm,
        output,
        step,
        *,
        xmoe=None,
        rank=None,
        stream=None,
        checked=False,
        validate=None,
    ):
        """Rank ``rank``'s consumer: ``prefix`` is updated in place to ``prefix_new``
        (``validate``: ``check``'s; ``checked``: the caller ran ``check``)."""
        rank, step = checks.hosted_rank(self, rank), checks.check_step(step)
        validation_mode(validate)
        tensors = ConsumeTensors(prefix, blocks, norm, query, out_norm, output, xmoe)
        check_is_tensor(**tensors._asdict(), optional=("blocks", "xmoe"))
        with _on(stream):
            torch.ops.kimi.oproj_consume(self.handle, rank, step, *tensors, bool(checked), validate)

    # --- fused producer + consumer ------------------------------------------------------
    def fused_plan(self, tiles=None, limits=None, launches=None):
        """The fused launch on this GPU (``tpcomm.oproj.plan.plan_fused``): ValueError when
        its CTAs cannot all be resident. ``launches``: launches sharing the GPU at once;
        default every rank's on a one-GPU backend (loopback), else 1 (a benchmark of one
        loopback rank alone passes 1). ``limits`` (``DeviceLimits``) overrides the
        device's."""
        return launcher.fused_plan(self, tiles, limits, launches)

    def fused_function(self, d_local, tiles=None, pdl=False, launches=None):
        """The compiled ``OprojFused`` for this all-reduce (plans first: may refuse)."""
        return launcher.fused(self, d_local, tiles, pdl, launches)

    def produce_consume(
        self,
        attn_out,
        w_o,
        prefix,
        blocks,
        norm,
        query,
        out_norm,
        output,
        step,
        *,
        xmoe=None,
        rank=None,
        stream=None,
        tiles=None,
        pdl=False,
        launches=None,
        checked=False,
    ):
        """Rank ``rank``'s ``produce`` + ``consume`` in one launch (``OprojFused``): its
        ``bf16(attn_out @ w_o^T)`` into every rank's mailbox, then the all-reduce, AttnRes
        and norm; ``prefix`` updated in place. Bitwise what ``produce`` then ``consume``
        give. ``tiles`` overrides the plan's tiles per producer group, ``launches`` its
        count of launches sharing the GPU (``fused_plan``); ``pdl`` launches with
        programmatic dependent launch (waits for the previous kernel in-kernel)."""
        rank, step = checks.hosted_rank(self, rank), checks.check_step(step)
        tensors = ConsumeTensors(prefix, blocks, norm, query, out_norm, output, xmoe)
        check_is_tensor(
            attn_out=attn_out, w_o=w_o, **tensors._asdict(), optional=("blocks", "xmoe")
        )
        flags = (tiles, bool(pdl), launches, bool(checked))
        with _on(stream):
            torch.ops.kimi.oproj_produce_consume(
                self.handle, rank, step, attn_out, w_o, *tensors, *flags
            )

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
