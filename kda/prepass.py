"""KdaPrepare: the per-(request, head) prologue of KdaWide as its own kernel, the first
of the two launches of ``kda.decode(..., kernel="lean")`` (KdaLean runs the recurrence).

One CTA of 256 threads per (request, head) item runs KdaWide's prologue call for call
(``item_slots``, the conv taps / weights / gate loads, ``conv_phase``, ``write_conv``,
``gate_phase`` / ``gate_phase_exact``, ``normalize_qk``: the same rounding points and fp32
reduction orders, so the values are bitwise Wide's) and writes, per token t, the fp32
vectors Wide keeps in shared memory to ``scratch[b, t, h, :]`` ([B, T, H, SCRATCH_WIDTH]
fp32): q^ (normalised, scaled), k^ (normalised), v (bf16-valued), decay, sigmoid(gate)
(the output gate, which Wide applies as ``dev.sigmoid(gate)``), and sigmoid(beta) at
``BETA`` (3 fp32 of padding after it keep rows 16-byte aligned). Record mode: the k and
raw-gate records (``kg_records``) are written here, exactly as Wide writes them; the
v records by KdaLean. The conv page is updated as Wide updates it.

Padding (state slot <= 0): the item writes nothing (no conv page, no scratch row, no
record); KdaLean writes its zero output rows.

PDL: the conv window and the weights are read before ``griddepcontrol.wait``; x, f_a,
beta and the gate after it. Dependents (KdaLean) are released at the start: they read
the scratch only after their own ``griddepcontrol.wait`` (the whole prepass complete).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32

from tpcomm.cuteutil import launch, smem_tensor

from . import device as dev
from .device import HEAD_DIM, THREADS
from .wide import KdaWide

# Scratch row of one (request, token, head): fp32 offsets of each field.
SCRATCH_Q, SCRATCH_K, SCRATCH_V, SCRATCH_DECAY, SCRATCH_GATE = (HEAD_DIM * i for i in range(5))
SCRATCH_FIELDS = 5  # the 128-wide fields above, in this order
SCRATCH_BETA = SCRATCH_FIELDS * HEAD_DIM
SCRATCH_WIDTH = SCRATCH_BETA + 4  # beta + 3 padding fp32: rows stay 16-byte aligned


class KdaPrepare(KdaWide):
    """KdaWide's prologue for ``heads`` heads, ``tokens`` T, ``record``, ``gate_mode``,
    ``has_bias``; ``arch``; ``pdl``: launch with programmatic dependent launch;
    ``ctas_per_sm``: ``__launch_bounds__`` minimum CTAs per SM (0: none)."""

    def __init__(
        self,
        heads,
        tokens=1,
        record=False,
        gate_mode=0,
        has_bias=False,
        *,
        arch="sm_90a",
        pdl=False,
        ctas_per_sm=0,
    ):
        super().__init__(heads, tokens, record, gate_mode, has_bias, 0, arch=arch, pdl=pdl)
        # Register cap (0: none; ptxas gives 80 / 100 / 128 registers at T = 1 / 4 / 8 and
        # spills under a cap of 64, 4 CTAs per SM).
        self.ctas_per_sm = ctas_per_sm

    @cute.jit
    def __call__(
        self,
        x: cute.Tensor,
        conv_weight: cute.Tensor,
        conv_bias: cute.Tensor,
        conv_state: cute.Tensor,
        f_a: cute.Tensor,
        beta: cute.Tensor,
        a_log: cute.Tensor,
        dt_bias: cute.Tensor,
        slots: cute.Tensor,
        gate: cute.Tensor,
        lower_bound: Float32,
        scale: Float32,
        f_b: cute.Tensor,
        accepted: cute.Tensor,
        kg_records: cute.Tensor,
        scratch: cute.Tensor,
        stream,
    ):
        requests = gate.shape[0] // self.tokens
        call = self.kernel(
            x, conv_weight, conv_bias, conv_state, f_a, beta, a_log, dt_bias, slots, gate,
            lower_bound, scale, f_b, accepted, kg_records, scratch,
        )  # fmt: skip
        grid, block = self.launch_shape(requests)
        launch(call, grid, block, stream, use_pdl=self.pdl, min_blocks_per_mp=self.ctas_per_sm)

    def launch_shape(self, requests):
        """(grid, block): one CTA per (head, request) item."""
        return (self.heads, requests, 1), (THREADS, 1, 1)

    @cute.jit
    def write_scratch(self, shared, gate, beta, scratch, request, head):
        """The item's vectors into its scratch rows: threads 0-127 q^, k^ of their channel
        (the values they normalised: no barrier), 128-255 v (theirs from the conv), decay
        (after the barrier that follows the gate phase), sigmoid(gate); sigmoid(beta)."""
        tid, _, _ = cute.arch.thread_idx()
        channel, section = tid % 128, tid // 128
        s_q, s_k, s_v, s_decay = shared
        token = request * self.tokens
        for t in cutlass.range_constexpr(self.tokens):
            if section == 0:
                scratch[request, t, head, SCRATCH_Q + channel] = s_q[t, channel]
                scratch[request, t, head, SCRATCH_K + channel] = s_k[t, channel]
            else:
                scratch[request, t, head, SCRATCH_V + channel] = s_v[t, channel]
                scratch[request, t, head, SCRATCH_DECAY + channel] = s_decay[t, channel]
                g = Float32(gate[token + t, head * HEAD_DIM + channel])
                scratch[request, t, head, SCRATCH_GATE + channel] = dev.sigmoid(g)
        if (section == 1) & (channel < self.tokens):
            b = dev.sigmoid(Float32(beta[token + channel, head]))
            scratch[request, channel, head, SCRATCH_BETA] = b

    @cute.kernel
    def kernel(
        self,
        x: cute.Tensor,
        conv_weight: cute.Tensor,
        conv_bias: cute.Tensor,
        conv_state: cute.Tensor,
        f_a: cute.Tensor,
        beta: cute.Tensor,
        a_log: cute.Tensor,
        dt_bias: cute.Tensor,
        slots: cute.Tensor,
        gate: cute.Tensor,
        lower_bound: Float32,
        scale: Float32,
        f_b: cute.Tensor,
        accepted: cute.Tensor,
        kg_records: cute.Tensor,
        scratch: cute.Tensor,
    ):
        T = self.tokens
        tid, _, _ = cute.arch.thread_idx()
        head, request, _ = cute.arch.block_idx()
        lane, warp = tid % 32, tid // 32
        channel, section = tid % 128, tid // 128
        dim = self.heads * HEAD_DIM
        token = request * T
        # KdaLean only reads the scratch after its own wait (this grid complete).
        cute.arch.griddepcontrol_launch_dependents()
        slot, conv_slot, offset = self.item_slots(slots, accepted, request)
        if slot <= 0:
            # Nothing to write; the wait keeps the completion order of a PDL chain.
            cute.arch.griddepcontrol_wait()
        else:
            smem = cutlass.memory.SmemAllocator()
            s_q = smem_tensor(smem, Float32, (T, HEAD_DIM))
            s_k = smem_tensor(smem, Float32, (T, HEAD_DIM))
            s_v = smem_tensor(smem, Float32, (T, HEAD_DIM))
            s_decay = smem_tensor(smem, Float32, (8, HEAD_DIM))
            fas = smem_tensor(smem, BFloat16, (T, HEAD_DIM), align=16)
            sums = smem_tensor(smem, Float32, (T, 2, 8))

            # Predecessor-independent: the conv window and the weights (as KdaWide).
            parts = (2 * section, 1)  # s = 0: q or v; s = 1: k (used by threads 0-127)
            taps, coeff, bias = self.conv_operands(
                conv_state, conv_weight, conv_bias, conv_slot, offset,
                [parts[s] * dim + head * HEAD_DIM + channel for s in range(2)],
                parts, [head * HEAD_DIM + channel] * 2,
            )  # fmt: skip
            a = Float32(a_log[head])
            group = lane // 4
            dt = [Float32(dt_bias[head * HEAD_DIM + 16 * warp + group + 8 * i]) for i in range(2)]
            exact_gate = self.gate_mode == 2
            if cutlass.const_expr(not exact_gate):
                weights = self.load_gate_weights(f_b, head)

            cute.arch.griddepcontrol_wait()
            inputs = []
            for s in cutlass.range_constexpr(2):
                col = parts[s] * dim + head * HEAD_DIM + channel
                inputs.append([x[token + t, col] for t in range(T)])
            if cutlass.const_expr(exact_gate):
                self.load_fa_rows(f_a, fas, token)
            else:
                activations = self.load_activations(f_a, token)

            self.conv_phase(
                taps, coeff, bias, inputs, (s_q, s_k, s_v), sums, kg_records, request, head
            )
            self.write_conv(conv_state, conv_slot, head, taps, inputs)
            if cutlass.const_expr(exact_gate):
                cute.arch.barrier()  # the f_a rows
                self.gate_phase_exact(
                    f_b, fas, a_log, dt_bias, lower_bound, s_decay, kg_records, request, head
                )
            else:
                self.gate_phase(
                    weights, activations, a, dt, lower_bound, s_decay, kg_records, request, head
                )
            cute.arch.barrier()  # the q^2 / k^2 warp sums and the decay
            self.normalize_qk(s_q, s_k, sums, scale)
            self.write_scratch((s_q, s_k, s_v, s_decay), gate, beta, scratch, request, head)
