"""OprojConsumer: mailbox all-reduce of the o-projection partials + residual + AttnRes + norm.

Contract (``tpcomm.oproj.reference.consume`` is the math it must match). Grid
``(C, tokens)``, one C-CTA cluster per token, CTA c owning columns ``[c W, (c + 1) W)``
(``plan.slicing``: ``C`` <= 8 CTAs of ``W = HID / C`` columns; 1024 for multiples of
1024); thread ``t`` of a ``W / 8``-thread group owns 8 columns. Group g polls ranks
``g*S .. `` (``S = ceil(TP / groups)``) of the step's parity half of its own mailbox
``[2, TP, tokens, HID]`` and sums them in rank order in fp32; the lead group adds the other
groups' sums in group order (an empty group adds +0.0), rounds once to bf16 and, with
``has_delta``, rounds ``prefix + attn`` once more: ``prefix_new``, bitwise the reference's,
written back to ``prefix``. AttnRes dot products are reduced per warp, per CTA (warps in
order), then across the cluster (``st.async`` into every peer, added in CTA order), so all
CTAs and ranks hold the same bits; ``output`` is within 1 bf16 ulp.

Protocol: a poll that outlives ``budget_ns`` ORs the missing-rank mask (bit r: rank r;
twoshot: bit r of a receive slot, bit 0 of the gather row) into the error word; its CTA
still takes part in the cluster exchanges but writes nothing and re-arms nothing of the
failed group. Otherwise every thread re-arms (sentinel) the groups it read. ``xmoe``:
copies of the output (relaxed gpu-scope stores by the lead group), a lead-group barrier,
then one gpu-scope release increment of ``hints`` per CTA by thread 0 (cumulative: it
orders the group's copies; CUTLASS's ``GenericBarrier::arrive_inc`` order). It was one
fence plus one release per lead warp, 4 x C x tokens same-address releases per rank.
``HintWaiter`` acquires ``hints >= C * tokens``, then the copies are read.

Domain split (``domain`` < TP, a separate compile): before polling a slot of a rank outside
its domain a thread waits (acquire, sys, same budget and error word) on that rank's signal
word (``[2, TP]`` uint64, its address in ``recv``; no twoshot then).

PDL: dependents are triggered at once; the wait comes at the end, or with ``early_wait``
(the fused kernel) before ``prefix`` is read and before any poll. ``ranks`` = TP: grid z
= rank r, its tensors at r times one rank's size past rank 0's (``[TP, ...]`` contiguous).
"""

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64, Uint32

from tpcomm import protocol
from tpcomm.cuteutil import (
    arm_exchanges,
    bf16x2_to_f32,
    compile_cached,
    cp_async_16,
    fake_tensor,
    launch,
    ld_shared_b32x4,
    pack_bf16x2,
    push_float,
    saddr,
    smem_tensor,
    unpack_bf16x2,
    wait_exchange,
)
from tpcomm.oproj.operands import ConsumerAddresses, ConsumerOperands
from tpcomm.oproj.plan import (
    POLL_CHUNK,
    WORD_ROW_BYTES,
    check_config,
    check_domain,
    check_ranks,
    group_ranks,
    min_blocks_per_sm,
    pow2_at_least,
    slicing,
)

Const = cutlass.Constexpr[int]  # a compile-time int parameter
# rows of the per-thread prefetch area (16 bytes per thread and row)
ROW_NORM, ROW_QUERY, ROW_OUT_NORM, ROW_PREFIX, ROW_BLOCK = 0, 1, 2, 3, 4


def transpose_sum(values, lane):
    """Warp sum of K = len(values) fp32 (power of two <= 32): each step halves the list,
    the lanes with the step's bit set keeping the upper half. Returns (index, sum): lane
    ``l`` holds the full warp sum of value ``index``; lanes ``l`` with
    ``l % (32 // K) == 0`` cover each index once. Same order in every warp."""
    vals = list(values)
    index = Int32(0)
    offset = 16
    while len(vals) > 1:
        half = len(vals) // 2
        upper = (lane & offset) != 0
        merged = []
        for j in range(half):
            keep = Float32(cutlass.select_(upper, vals[j + half], vals[j]))
            send = Float32(cutlass.select_(upper, vals[j], vals[j + half]))
            merged.append(keep + cute.arch.shuffle_sync_bfly(send, offset))
        index = index + Int32(cutlass.select_(upper, Int32(half), Int32(0)))
        vals = merged
        offset //= 2
    value = vals[0]
    while offset >= 1:
        value = value + cute.arch.shuffle_sync_bfly(value, offset)
        offset //= 2
    return index, value


def dot8(a, b):
    acc = a[0] * b[0]
    for j in range(1, 8):
        acc = cute.math.fma(a[j], b[j], acc)
    return acc


class OprojConsumerKernel:
    """Compile-time configuration: TP, HID, nb, has_delta, groups, xmoe reps, PDL,
    twoshot (and its sys fence before the gather publish)."""

    def __init__(
        self,
        tp,
        hid,
        nb,
        *,
        has_delta=True,
        groups=4,
        xmoe_reps=0,
        pdl=False,
        twoshot=False,
        fence=False,
        early_wait=False,
        ranks=1,
        domain=None,
    ):
        check_config(tp, hid, nb, groups, xmoe_reps, twoshot)
        check_ranks(tp, ranks, twoshot)
        self.domain = tp if domain is None else check_domain(tp, domain, twoshot, ranks)
        self.signal = self.domain < tp  # remote slots: wait on their signal words first
        self.ranks = ranks
        self.tp, self.hid, self.nb = tp, hid, nb
        self.twoshot, self.fence = bool(twoshot), bool(fence)
        self.slots = 1 if twoshot else tp  # mailbox slots polled: the gather row alone
        self.has_delta, self.groups = bool(has_delta), groups
        self.xmoe_reps, self.pdl = xmoe_reps, bool(pdl)
        # PDL wait before the polls and the prefix read (the fused kernel), else at the end
        self.wait_before_poll = self.pdl and bool(early_wait)
        cut = slicing(hid)
        self.ctas, self.columns = cut.ctas, cut.columns
        self.group_threads, self.warps = cut.threads, cut.warps
        self.kpre = pow2_at_least(2 * nb) if nb else 0
        self.kpost = 4 if nb else 1
        self.threads = self.group_threads * groups

    # --- launch ---------------------------------------------------------------
    @cute.jit
    def __call__(self, op: ConsumerOperands, stream: cuda.CUstream):
        launch(
            self.kernel(self.addresses(op)),
            (self.ctas, op.prefix.shape[0], self.ranks),
            (self.threads, 1, 1),
            stream,
            cluster=(self.ctas, 1, 1),
            use_pdl=self.pdl,
            min_blocks_per_mp=min_blocks_per_sm(self.groups, self.group_threads),
            carveout=100,
        )

    @staticmethod
    def addresses(op: ConsumerOperands) -> ConsumerAddresses:
        """``kernel``'s argument from ``__call__``'s (traced; the fused kernel's consumer
        part): tensors as addresses, tokens from ``prefix``."""
        tensors = (*op[: op._fields.index("hints") + 1], op.error)  # a_mailbox .. a_error
        scalars = (op.prefix.shape[0], op.eps, op.out_eps, op.step, op.budget_ns)
        recv = Int64(op.recv.iterator.toint())
        return ConsumerAddresses(
            *(Int64(t.iterator.toint()) for t in tensors), *scalars, recv, op.gather_peers, op.rank
        )

    # --- phases -----------------------------------------------------------------
    @cute.jit
    def allocate(self):
        smem = cutlass.memory.SmemAllocator()
        bars = smem.allocate_array(Int64, 2, byte_alignment=8)
        rows = ROW_BLOCK + self.nb
        pf = smem_tensor(smem, Uint32, (rows, self.group_threads, 4))
        parts = None  # the helper groups' sums (none with one group)
        if cutlass.const_expr(self.groups > 1):
            parts = smem_tensor(smem, Float32, (self.groups - 1, self.group_threads, 8))
        kpre = max(1, self.kpre)
        warp_pre = smem_tensor(smem, Float32, (self.warps, kpre))
        warp_post = smem_tensor(smem, Float32, (self.warps, self.kpost))
        ex_pre = smem_tensor(smem, Float32, (self.ctas * kpre,))
        ex_post = smem_tensor(smem, Float32, (self.ctas * self.kpost,))
        tot_pre = smem_tensor(smem, Float32, (kpre,))
        tot_post = smem_tensor(smem, Float32, (self.kpost,))
        flag = smem_tensor(smem, Int32, (4,))
        return bars, pf, parts, warp_pre, warp_post, ex_pre, ex_post, tot_pre, tot_post, flag

    def row(self, pf, r, tid):
        """The 8 fp32 of this thread's 16 bytes in prefetch row ``r``."""
        words = ld_shared_b32x4(saddr(pf, (r, tid, 0)))
        values = []
        for j in range(4):
            lo, hi = bf16x2_to_f32(words[j])
            values.append(Float32(lo))
            values.append(Float32(hi))
        return values

    def weight(self, pf, tid):
        n, q = self.row(pf, ROW_NORM, tid), self.row(pf, ROW_QUERY, tid)
        return [n[j] * q[j] for j in range(8)]

    @cute.jit
    def prefetch(
        self, pf, tid, col_bytes, token, tokens, a_prefix, a_blocks, a_norm, a_query, a_out_norm
    ):
        """cp.async of this thread's rows; the prefix row waits for the PDL wait when
        ``wait_before_poll`` (``prefetch_prefix`` then)."""
        if cutlass.const_expr(self.nb > 0):
            cp_async_16(saddr(pf, (ROW_NORM, tid, 0)), a_norm + col_bytes)
            cp_async_16(saddr(pf, (ROW_QUERY, tid, 0)), a_query + col_bytes)
        cp_async_16(saddr(pf, (ROW_OUT_NORM, tid, 0)), a_out_norm + col_bytes)
        hid_bytes = Int64(self.hid * 2)
        if cutlass.const_expr(self.has_delta and not self.wait_before_poll):
            self.prefetch_prefix(pf, tid, col_bytes, token, a_prefix)
        for b in cutlass.range_constexpr(self.nb):
            src = a_blocks + (token * self.nb + b) * hid_bytes + col_bytes
            cp_async_16(saddr(pf, (ROW_BLOCK + b, tid, 0)), src)
        cute.arch.cp_async_commit_group()

    @cute.jit
    def prefetch_prefix(self, pf, tid, col_bytes, token, a_prefix):
        hid_bytes = Int64(self.hid * 2)
        cp_async_16(saddr(pf, (ROW_PREFIX, tid, 0)), a_prefix + token * hid_bytes + col_bytes)

    @cute.jit
    def exchange(self, values, k: Const, warp_sums, ex, total, bar, tid, cta):
        """Cluster-wide sums of ``k`` per-thread values of the lead group, into ``total``
        (identical bits in every CTA). Ends with a lead-group barrier."""
        lane, warp = tid % 32, tid // 32
        index, value = transpose_sum(values, lane)
        if (lane & (32 // k - 1)) == 0:
            warp_sums[warp, index] = value
        cute.arch.barrier(barrier_id=1, number_of_threads=self.group_threads)
        if cutlass.const_expr(k * self.ctas <= self.group_threads):
            if tid < k * self.ctas:
                self.push_sum(warp_sums, ex, k, tid, bar, cta)
        else:  # fewer lead threads than (value, peer) pairs: several pushes a thread
            for j in cutlass.range_constexpr(-(-k * self.ctas // self.group_threads)):
                pair = tid + j * self.group_threads
                if pair < k * self.ctas:
                    self.push_sum(warp_sums, ex, k, pair, bar, cta)
        wait_exchange(bar)
        if tid < k:
            acc = ex[tid]
            for p in cutlass.range_constexpr(1, self.ctas):
                acc = acc + ex[p * k + tid]
            total[tid] = acc
        cute.arch.barrier(barrier_id=1, number_of_threads=self.group_threads)

    @cute.jit
    def push_sum(self, warp_sums, ex, k: Const, pair, bar, cta):
        """The CTA's sum of value ``pair % k`` (warps in order) into peer ``pair // k``."""
        i, peer = pair % k, pair // k
        s = warp_sums[0, i]
        for w in cutlass.range_constexpr(1, self.warps):
            s = s + warp_sums[w, i]
        push_float(ex.iterator + cta * k + i, s, bar, peer)

    @cute.jit
    def poll(
        self, acc, raw, slot0, slot_bytes, budget_ns, a_error, first: Const, count: Const, sig=None
    ):
        """Rank-order fp32 sum of ranks first..first+count-1 into ``acc`` (from the first
        rank's value); returns the missing-rank mask (0: all published). ``sig``: (signal
        words of this parity, rank) with a domain split."""
        failed = Int32(0)
        for c in cutlass.range_constexpr((count + POLL_CHUNK - 1) // POLL_CHUNK):
            lo: cutlass.Constexpr = c * POLL_CHUNK
            n: cutlass.Constexpr = min(POLL_CHUNK, count - lo)
            if failed == 0:
                addresses = [slot0 + (first + lo + i) * slot_bytes for i in range(n)]
                if cutlass.const_expr(self.signal):
                    missing = self.wait_remote(sig, first + lo, n, budget_ns, a_error)
                    if missing == 0:
                        missing = protocol.poll_groups(
                            raw, addresses, n, budget_ns, a_error, first + lo
                        )
                else:
                    missing = protocol.poll_groups(
                        raw, addresses, n, budget_ns, a_error, first + lo
                    )  # ORs the rank-numbered mask into the error word on expiry
                failed = missing << (first + lo)
                protocol.add_in_rank_order(acc, raw, n, lo)
        return failed

    @cute.jit
    def wait_remote(self, sig, first: Const, n: Const, budget_ns, a_error):
        """Bounded wait on the signals of ranks first.. first+n-1 outside this domain."""
        signals, rank = sig
        mine = rank // self.domain
        remote = Int32(0)
        for i in cutlass.range_constexpr(n):
            far = Int32((first + i) // self.domain) != mine
            remote = remote | Int32(cutlass.select_(far, Int32(1 << i), Int32(0)))
        return protocol.wait_signals(signals + first * 8, remote, n, budget_ns, a_error, first)

    @cute.jit
    def rearm(self, slot0, slot_bytes, first: Const, count: Const):
        for i in cutlass.range_constexpr(count):
            protocol.rearm(slot0 + (first + i) * slot_bytes)

    @cute.jit
    def helper(self, group, parts, flag, slot0, slot_bytes, budget_ns, a_error, tid, sig=None):
        """Groups 1..: poll their slots, park the fp32 sum for the lead, re-arm."""
        if cutlass.const_expr(self.wait_before_poll):
            cute.arch.griddepcontrol_wait()
        acc = cute.make_rmem_tensor(8, Float32)
        raw = cute.make_rmem_tensor(POLL_CHUNK * 4, Int32)
        for g in cutlass.range_constexpr(1, self.groups):
            first, count = group_ranks(self.slots, self.groups, g)
            if cutlass.const_expr(count > 0):
                if group == g:
                    failed = self.poll(
                        acc, raw, slot0, slot_bytes, budget_ns, a_error, first, count, sig
                    )
                    for j in cutlass.range_constexpr(8):
                        parts[g - 1, tid, j] = acc[j]
                    if failed != 0:
                        flag[0] = Int32(1)
                    cute.arch.barrier_arrive(barrier_id=2, number_of_threads=self.threads)
                    if failed == 0:
                        self.rearm(slot0, slot_bytes, first, count)
            else:
                if group == g:
                    cute.arch.barrier_arrive(barrier_id=2, number_of_threads=self.threads)

    @cute.jit
    def reduce_shard(self, op, parity, token, tokens, column, flag):
        """Twoshot, threads owning this rank's columns: rank-order sum of the receive
        slots, one bf16 rounding, published into every rank's gather row; re-arm."""
        a_recv, gather_peers, rank = op.a_recv, op.gather_peers, op.rank
        budget_ns, a_error = op.budget_ns, op.a_error
        width: cutlass.Constexpr = self.hid // self.tp
        if column // width == rank:
            recv_bytes = tokens * (width * 2)
            recv0 = a_recv + parity * self.tp * recv_bytes + token * (width * 2)
            recv0 = recv0 + Int64(column - rank * width) * 2
            acc = cute.make_rmem_tensor(8, Float32)
            raw = cute.make_rmem_tensor(POLL_CHUNK * 4, Int32)
            failed = self.poll(acc, raw, recv0, recv_bytes, budget_ns, a_error, 0, self.tp)
            if failed == 0:
                words = [pack_bf16x2(acc[2 * j], acc[2 * j + 1]) for j in range(4)]
                offset = (parity * tokens + token) * (self.hid * 2) + Int64(column) * 2
                if cutlass.const_expr(self.fence):
                    protocol.fence_sys()
                for p in cutlass.range_constexpr(self.tp):
                    protocol.publish(gather_peers[p] + offset, words)
                self.rearm(recv0, recv_bytes, 0, self.tp)
            else:
                flag[0] = Int32(1)

    @cute.jit
    def lead(self, smem, op, cta, token, tokens, tid, slot0, slot_bytes, col_bytes, parity, sig):
        """The lead group: AttnRes, its slots' sum plus the other groups', the residual,
        the norm and the results (``op``: the kernel's ``ConsumerAddresses``; ``token`` and
        ``tokens`` as Int64)."""
        a_prefix, a_error, budget_ns = op.a_prefix, op.a_error, op.budget_ns
        eps, out_eps = op.eps, op.out_eps
        bars, pf, parts, warp_pre, warp_post, ex_pre, ex_post, tot_pre, tot_post, flag = smem
        # 1. AttnRes over the block snapshots: independent of the mailbox
        mix = cute.make_rmem_tensor(8, Float32)
        top, esum, qpart = Float32(0), Float32(0), Float32(0)
        cute.arch.cp_async_wait_group(0)
        if cutlass.const_expr(self.nb > 0):
            w = self.weight(pf, tid)
            vals = []
            for b in cutlass.range_constexpr(self.nb):
                v = self.row(pf, ROW_BLOCK + b, tid)
                vals.append(dot8(v, v))
            for b in cutlass.range_constexpr(self.nb):
                v = self.row(pf, ROW_BLOCK + b, tid)
                vals.append(dot8(v, w))
            vals += [Float32(0)] * (self.kpre - len(vals))
            self.exchange(vals, self.kpre, warp_pre, ex_pre, tot_pre, bars, tid, cta)
            logits = []
            for b in cutlass.range_constexpr(self.nb):
                ss = tot_pre[b] / Float32(self.hid)
                logits.append(tot_pre[self.nb + b] * cute.math.rsqrt(ss + eps))
            top = logits[0]
            for b in cutlass.range_constexpr(1, self.nb):
                top = cute.math.max(top, logits[b])
            expo = [cute.math.exp(x - top) for x in logits]
            esum = expo[0]
            for b in cutlass.range_constexpr(1, self.nb):
                esum = esum + expo[b]
            for b in cutlass.range_constexpr(self.nb):
                v = self.row(pf, ROW_BLOCK + b, tid)
                for j in cutlass.range_constexpr(8):
                    if cutlass.const_expr(b == 0):
                        mix[j] = expo[0] * v[j]
                    else:
                        mix[j] = cute.math.fma(expo[b], v[j], mix[j])
            qpart = dot8(mix, mix)
        if cutlass.const_expr(self.wait_before_poll):
            # everything above reads only what no kernel of this step writes
            cute.arch.griddepcontrol_wait()
            if cutlass.const_expr(self.has_delta):
                self.prefetch_prefix(pf, tid, col_bytes, token, a_prefix)
                cute.arch.cp_async_commit_group()
        # 2. (twoshot: reduce this rank's shard into every gather row first) this group's
        # mailbox slots, then the other groups' sums in group order
        if cutlass.const_expr(self.twoshot):
            column = cta * self.columns + tid * 8
            self.reduce_shard(op, parity, token, tokens, column, flag)
        acc = cute.make_rmem_tensor(8, Float32)
        raw = cute.make_rmem_tensor(POLL_CHUNK * 4, Int32)
        first, count = group_ranks(self.slots, self.groups, 0)
        failed = self.poll(acc, raw, slot0, slot_bytes, budget_ns, a_error, first, count, sig)
        if cutlass.const_expr(self.groups > 1):
            cute.arch.barrier(barrier_id=2, number_of_threads=self.threads)
        for g in cutlass.range_constexpr(1, self.groups):
            _, gcount = group_ranks(self.slots, self.groups, g)
            for j in cutlass.range_constexpr(8):
                if cutlass.const_expr(gcount > 0):
                    acc[j] = acc[j] + parts[g - 1, tid, j]
                else:
                    acc[j] = acc[j] + Float32(0.0)
        if failed == 0:
            self.rearm(slot0, slot_bytes, first, count)
        else:
            flag[0] = Int32(1)
        # 3. prefix_new = bf16(prefix + bf16(attn)) (or bf16(attn))
        words = [pack_bf16x2(acc[2 * j], acc[2 * j + 1]) for j in range(4)]
        if cutlass.const_expr(self.has_delta):
            if cutlass.const_expr(self.wait_before_poll):
                cute.arch.cp_async_wait_group(0)
            old = self.row(pf, ROW_PREFIX, tid)
            summed = []
            for j in cutlass.range_constexpr(4):
                x, y = unpack_bf16x2(words[j])
                summed.append(pack_bf16x2(old[2 * j] + x, old[2 * j + 1] + y))
            words = summed
        p = []
        for j in cutlass.range_constexpr(4):
            x, y = unpack_bf16x2(words[j])
            p.append(x)
            p.append(y)
        # 4. the post-sum dot products across the cluster
        if cutlass.const_expr(self.nb > 0):
            w = self.weight(pf, tid)
            mixed = [mix[j] for j in range(8)]
            vals = [dot8(mixed, p), qpart, dot8(p, p), dot8(p, w)]
        else:
            vals = [dot8(p, p)]
        self.exchange(vals, self.kpost, warp_post, ex_post, tot_post, bars + 1, tid, cta)
        # 5. output norm
        gamma = self.row(pf, ROW_OUT_NORM, tid)
        final = cute.make_rmem_tensor(8, Float32)
        if cutlass.const_expr(self.nb > 0):
            t0, t1, t2, t3 = tot_post[0], tot_post[1], tot_post[2], tot_post[3]
            lp = t3 * cute.math.rsqrt(t2 / Float32(self.hid) + eps)
            mx = cute.math.max(top, lp)
            alpha = cute.math.exp(top - mx)
            ep = cute.math.exp(lp - mx)
            den = cute.math.fma(alpha, esum, ep)
            quad = cute.math.fma(
                alpha * alpha, t1, cute.math.fma(Float32(2.0) * alpha * ep, t0, ep * ep * t2)
            )
            scale = cute.math.rsqrt(quad / Float32(self.hid) + out_eps * den * den)
            ca, cp = alpha * scale, ep * scale
            for j in cutlass.range_constexpr(8):
                final[j] = cute.math.fma(ca, mix[j], cp * p[j]) * gamma[j]
        else:
            cp = cute.math.rsqrt(tot_post[0] / Float32(self.hid) + out_eps)
            for j in cutlass.range_constexpr(8):
                final[j] = cp * p[j] * gamma[j]
        # 6. results (nothing when any poll of this CTA expired)
        if flag[0] == 0:
            hid_bytes = Int64(self.hid * 2)
            row_bytes = token * hid_bytes + col_bytes
            protocol.store16(a_prefix + row_bytes, words)
            out = [pack_bf16x2(final[2 * j], final[2 * j + 1]) for j in range(4)]
            protocol.store16(op.a_output + row_bytes, out)
            if cutlass.const_expr(self.xmoe_reps > 0):
                for r in cutlass.range_constexpr(self.xmoe_reps):
                    addr = op.a_xmoe + r * tokens * hid_bytes + row_bytes
                    protocol.store16(addr, out, "relaxed.gpu")
        if cutlass.const_expr(self.xmoe_reps > 0):
            # the lead group's copies before thread 0's release (cumulative): one hint per CTA
            cute.arch.barrier(barrier_id=1, number_of_threads=self.group_threads)
            if tid == 0:  # noqa: SIM102 (a DSL condition: no short-circuit and)
                if flag[0] == 0:
                    protocol.release_increment(op.a_hints)

    @cute.kernel
    def kernel(self, op: ConsumerAddresses):
        thread, _, _ = cute.arch.thread_idx()
        cta, token, r = cute.arch.block_idx()
        if cutlass.const_expr(self.ranks > 1):  # rank ``rank + r``'s tensors (one launch)
            r64 = Int64(r)
            per_rank = Int64(op.tokens) * (self.hid * 2)  # one [tokens, HID] bf16 tensor
            op = op._replace(
                a_mailbox=op.a_mailbox + r64 * (2 * self.slots) * per_rank,
                a_prefix=op.a_prefix + r64 * per_rank,
                a_output=op.a_output + r64 * per_rank,
            )
            if cutlass.const_expr(self.xmoe_reps > 0):
                op = op._replace(a_xmoe=op.a_xmoe + r64 * self.xmoe_reps * per_rank)
            op = op._replace(
                a_hints=op.a_hints + r64 * WORD_ROW_BYTES,
                a_error=op.a_error + r64 * WORD_ROW_BYTES,
                rank=op.rank + r,
            )
        self.body(self.allocate(), thread, cta, token, op)

    @cute.jit
    def body(self, smem, thread, cta, token, op: ConsumerAddresses):
        """One CTA of token ``token``'s cluster (CTA ``cta`` of it), ``smem`` from
        ``allocate``: what ``kernel`` runs, and the fused kernel's consumer CTAs."""
        a_prefix, a_error, budget_ns, rank = op.a_prefix, op.a_error, op.budget_ns, op.rank
        group, tid = thread // self.group_threads, thread % self.group_threads
        bars, pf, flag = smem[0], smem[1], smem[9]
        arm_exchanges(bars, (4 * self.ctas * max(1, self.kpre), 4 * self.ctas * self.kpost))
        if thread == 0:
            flag[0] = Int32(0)
        if cutlass.const_expr(self.pdl):
            cute.arch.griddepcontrol_launch_dependents()
        col_bytes = Int64(cta * self.columns + tid * 8) * 2
        token64 = Int64(token)
        tokens64 = Int64(op.tokens)
        if group == 0:
            rows = (a_prefix, op.a_blocks, op.a_norm, op.a_query, op.a_out_norm)
            self.prefetch(pf, tid, col_bytes, token64, tokens64, *rows)
        # peers' barriers are armed and the flag is cleared before anyone touches them
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()
        slot_bytes = tokens64 * (self.hid * 2)
        parity = Int64(op.step & 1)
        slot0 = op.a_mailbox + parity * self.slots * slot_bytes + token64 * (self.hid * 2)
        slot0 = slot0 + col_bytes
        sig = None  # the signal words of this parity ([2, TP] uint64, in ``recv``)
        if cutlass.const_expr(self.signal):
            sig = (op.a_recv + parity * (self.tp * 8), rank)
        if group == 0:
            self.lead(
                smem, op, cta, token64, tokens64, tid, slot0, slot_bytes, col_bytes, parity, sig
            )
        else:
            self.helper(group, smem[2], flag, slot0, slot_bytes, budget_ns, a_error, tid, sig)
        if cutlass.const_expr(self.pdl):
            cute.arch.griddepcontrol_wait()


def fake_arguments(tp: int, hid: int, nb: int, xmoe_reps: int = 0, twoshot: bool = False):
    """Compile-only arguments of ``OprojConsumerKernel.__call__``: ``ConsumerOperands``
    (tokens dynamic) and a stream; with ``twoshot`` the mailbox is the one-slot gather row
    ``[2, 1, tokens, HID]``. The receive view travels flattened (1-D, any length; a dummy
    without twoshot)."""
    tokens = cute.sym_int()
    rows, vector = (tokens, hid), (hid,)
    operands = ConsumerOperands(
        mailbox=fake_tensor(BFloat16, (2, 1 if twoshot else tp, tokens, hid)),
        prefix=fake_tensor(BFloat16, rows),
        blocks=fake_tensor(BFloat16, (tokens, max(1, nb), hid)),
        norm=fake_tensor(BFloat16, vector),
        query=fake_tensor(BFloat16, vector),
        out_norm=fake_tensor(BFloat16, vector),
        output=fake_tensor(BFloat16, rows),
        xmoe=fake_tensor(BFloat16, (max(1, xmoe_reps), tokens, hid)),
        hints=fake_tensor(Int32, (1,), align=4),
        eps=Float32(1e-6),
        out_eps=Float32(1e-6),
        error=fake_tensor(Int32, (1,), align=4),
        step=Int32(0),
        budget_ns=Int64(0),
        recv=fake_tensor(BFloat16, (cute.sym_int(divisibility=8),)),
        gather_peers=fake_tensor(Int64, (tp,), align=8),
        rank=Int32(0),
    )
    return operands, cute.runtime.make_fake_stream()


def compiled(tp, hid, nb, has_delta=True, groups=4, xmoe_reps=0, pdl=False, arch=None, **kw):
    """One compile per configuration and arch; tokens are dynamic. ``kw``: the kernel's
    ``twoshot``, ``fence``, ``ranks`` (TP: one launch for every rank of a one-GPU backend,
    rank r's mailbox, prefix, output, xmoe, error and hint rows at r times their size past
    the first rank's) and ``domain`` (< TP: the signal-wait configuration, ``recv``
    carrying the signal words)."""
    config = dict(has_delta=has_delta, groups=groups, xmoe_reps=xmoe_reps, pdl=pdl, **kw)
    twoshot = kw.get("twoshot", False)

    def build():
        kernel = OprojConsumerKernel(tp, hid, nb, **config)
        return kernel, fake_arguments(tp, hid, nb, xmoe_reps, twoshot)

    key = ("oproj_consumer", tp, hid, nb, *sorted(config.items()))
    return compile_cached(key, build, arch=arch)
