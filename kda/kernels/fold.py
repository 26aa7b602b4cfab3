"""KdaFold: fold replay rings into their checkpoint pages, the device side of ``kda.fold``
(math: ``kda.reference.materialize``, whose fold it equals bit for bit).

One CTA per (head, listed slot) in ``kda.kernels.device``'s thread layout. Per item, with
``n`` the entries it applies (``ring.length[slot, head]``: the committed ones, plus
``min(accepted[i], pending)`` when ``accepted`` is given; the rest are dropped):

- KdaReplay's ``copy_entries`` stages the entries ``j < n`` (k | raw gate bf16, v_new fp32)
  in shared memory by cp.async, while the page is prefetched into L2;
- the per-entry scalars are the reference's, rounding point for rounding point (not the
  decode kernels' fast ones, which are a few fp32 ulps away): ``k^ = k * rsqrt(sum k^2 +
  1e-6)`` with the sum of the (exact) squares in fp64 rounded to fp32, the fp32 add, and
  ``1 / sqrt`` in fp64 rounded to fp32; the decay ``exp(lower_bound * sigmoid(exp(a_log) *
  (raw_g + dt_bias)))`` (or ``exp(-exp(a_log) * softplus(raw_g + dt_bias))``, the
  ``gate_form`` "softplus") with each ``exp``, the sigmoid and the softplus evaluated in
  fp64 and rounded once to fp32, the products and the sum in fp32 (``scalar.decay_exact``).
  An fp64 result that a different order or library could change rounds to the same fp32
  value but for a vanishing fraction of inputs (one in ~2^28);
- KdaReplay's ``fold_page`` applies the R staged entries (neutral past ``n``: decay 1,
  ``k^ = -0.0``, ``v_new = +0``, exact) to the page where it lies, ``S * d_j`` then
  ``fma(k^_j, v_j, .)`` per key, and writes it back;
- the slot's counters of the head become ``(0, 0)``.

An item with ``n = 0`` leaves its page as it is (only the counters are reset). Padding
(``slots[i] <= 0``): nothing read or written. Listed slots must be unique (checked by
``kda.fold`` outside graph capture). No PDL: it runs between steps. bf16 pages
(``state_dtype``): widened on load, all entries applied in fp32, rounded to nearest-even
once when the page is written back (``materialize``'s one rounding per fold).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Float64, Int32, Int64

from tpcomm.cuteutil import launch, prefetch_l2_bulk, smem_tensor, warp_sum

from ..operands import FoldKernelOperands
from . import device as dev
from .device import HEAD_DIM, THREADS
from .replay import KdaReplay
from .scalar import decay_exact


class KdaFold(KdaReplay):
    """``heads`` H, ring ``size`` R (2..16); ``has_accepted``: ``accepted`` commits pending
    entries (else they are dropped); ``arch``: the target; ``state_dtype``: "fp32" or
    "bf16" pages; ``gate_form``: the decay's form (compiled in)."""

    def __init__(
        self,
        heads,
        size,
        has_accepted=False,
        *,
        arch="sm_90a",
        state_dtype="fp32",
        gate_form="lower-bound",
    ):
        options = dict(arch=arch, pdl=False, state_dtype=state_dtype, gate_form=gate_form)
        super().__init__(heads, size, 1, **options)
        self.has_accepted = bool(has_accepted)

    @cute.jit
    def __call__(self, op: FoldKernelOperands, stream):
        """Launch on ``stream`` (``op``: ``kda.operands.FoldKernelOperands``)."""
        items = op.slots.shape[0]
        launch(self.kernel(op), (self.heads, items, 1), (THREADS, 1, 1), stream)

    # ---------------------------------------------------------------- device side
    @cute.jit
    def stage_exact(self, op, held, ring, r_raw, sums, head):
        """The copied entries j < ``held`` decoded in shared: k as fp32 with the four
        warps' fp64 sums of k^2 (threads 0-127), the reference's decay (threads 128-255);
        past ``held`` the neutral entry (decay 1, v_new +0)."""
        tid, _, _ = cute.arch.thread_idx()
        lane, warp = tid % 32, tid // 32
        channel, section = tid % 128, tid // 128
        r_k, r_d, r_v = ring
        if section == 0:
            for j in cutlass.range_constexpr(self.size):
                k = Float32(0.0)
                if j < held:
                    k = Float32(r_raw[j, channel])
                r_k[j, channel] = k
                squares = warp_sum(Float64(k) * Float64(k))  # bf16 squares: exact in fp64
                if lane == 0:
                    sums[j, warp] = squares
        else:
            a = dev.exp_f32_exact(op.a_log[head])
            dt = Float32(op.dt_bias[head * HEAD_DIM + channel])
            for j in cutlass.range_constexpr(self.size):
                if j < held:
                    raw_g = Float32(r_raw[j, HEAD_DIM + channel])
                    r_d[j, channel] = decay_exact(a, raw_g, dt, op.lower_bound, self.softplus_gate)
                else:
                    r_d[j, channel] = Float32(1.0)
                    r_v[j, channel] = Float32(0.0)

    @cute.jit
    def normalize_exact(self, r_k, sums, held):
        """``r_k[j] *= rsqrt(sum k^2 + 1e-6)`` as the reference rounds it (threads 0-127);
        ``-0.0`` past ``held``."""
        tid, _, _ = cute.arch.thread_idx()
        channel, section = tid % 128, tid // 128
        if section == 0:
            for j in cutlass.range_constexpr(self.size):
                if j < held:
                    total = Float32((sums[j, 0] + sums[j, 2]) + (sums[j, 1] + sums[j, 3]))
                    shifted = Float64(total + Float32(1.0e-6))
                    scale = Float32(Float64(1.0) / cute.math.sqrt(shifted))
                    r_k[j, channel] = r_k[j, channel] * scale
                else:
                    r_k[j, channel] = Float32(-0.0)

    @cute.kernel
    def kernel(self, op):
        R = self.size
        tid, _, _ = cute.arch.thread_idx()
        head, index, _ = cute.arch.block_idx()
        slot = Int32(op.slots[index])
        if slot > 0:
            smem = cutlass.memory.SmemAllocator()
            r_k = smem_tensor(smem, Float32, (R, HEAD_DIM))
            r_d = smem_tensor(smem, Float32, (R, HEAD_DIM))
            r_v = smem_tensor(smem, Float32, (R, HEAD_DIM))
            r_raw = smem_tensor(smem, BFloat16, (R, 2 * HEAD_DIM))
            sums = smem_tensor(smem, Float64, (R, 4))
            held = Int32(op.ring_length[Int64(slot), head, 0])
            if cutlass.const_expr(self.has_accepted):
                pending = Int32(op.ring_length[Int64(slot), head, 1])
                accepted = Int32(op.accepted[index])
                if accepted < pending:
                    pending = accepted
                held = held + pending
            if held > 0:
                if tid == 0:
                    page = (Int64(slot) * self.heads + head) * (HEAD_DIM * HEAD_DIM)
                    address = Int64(op.state.iterator.toint()) + page * self.state_bytes
                    prefetch_l2_bulk(address, self.page_bytes)
                self.copy_entries(op, r_raw, r_v, held, slot, head)
                cute.arch.cp_async_commit_group()
                cute.arch.cp_async_wait_group(0)
                cute.arch.barrier()
                self.stage_exact(op, held, (r_k, r_d, r_v), r_raw, sums, head)
                cute.arch.barrier()
                self.normalize_exact(r_k, sums, held)
                cute.arch.barrier()
                self.fold_page(op.state, (r_k, r_d, r_v, None), slot, head)
            cute.arch.barrier()  # every thread has read the counters
            if tid == 0:
                op.ring_length[Int64(slot), head, 0] = Int32(0)
                op.ring_length[Int64(slot), head, 1] = Int32(0)
