"""The mutants ``scripts/mutants.py`` runs: a find-text in one file, its replacement, the
tests that must then fail (``tests/test_mutants.py``: every find-text still occurs)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Mutant:
    name: str
    path: str  # file, relative to the repository root
    find: str  # text that must occur exactly `count` times
    replace: str
    tests: tuple[str, ...]  # pytest node ids or files
    gpu: bool = False
    count: int = 1  # occurrences replaced (all of them must exist)
    select: str = ""  # pytest -k


def M(name, path, find, replace, *tests, gpu=False, count=1, select=""):
    return Mutant(name, path, find, replace, tuple(tests), gpu, count, select)


KREF = "tests/test_kda_reference.py"
OREF = "tests/test_oproj_reference.py"
PDL_PTX = "tests/test_pdl_order_compile.py"
KGPU = "tests/test_kda_kernels_gpu.py"
CGPU = "tests/test_oproj_consumer_gpu.py"
ONE = "tests/test_oproj_one_launch_gpu.py"
RGPU = "tests/test_kda_recover_gpu.py"
WIDE_CASE = f"{KGPU}::test_decode_matches_reference[s1-H6B3T2-wf-b0-r1-wide]"  # record, padding
WIDE_T1 = f"{KGPU}::test_decode_matches_reference[s2-H12B64T5-df-b1-r0-wide]"
STREAM_CASE = f"{KGPU}::test_decode_matches_reference[s1-H6B3T2-wf-b0-r1-stream]"
SPLIT_ROW = f"{KGPU}::test_steps_in_a_row[split2]"
REPLAY = "tests/test_kda_replay_gpu.py"
STATE = "tests/test_engine_state.py"
SGPU = "tests/test_engine_state_gpu.py"
SCALE = "0.08838834764831845"  # 128 ** -0.5
# KdaWide's (and KdaSplit's) PDL wait: the first line of read_inputs after its docstring.
# KdaReplay's suffix chain: each ring entry's warp sum, then its decay into the product.
RING_SUM = "            ring_parts.append(warp_sum((prod * r_k[j, channel]) * x))\n"
RING_PRODUCT = (
    "            prod = prod * Float32(cutlass.select_(j < entries, r_d[j, channel], "
    "Float32(1.0)))\n"
)
WIDE_NO_WAIT = '        the dependents. Returns (inputs, fragments)."""\n'
WIDE_WAIT = WIDE_NO_WAIT + "        cute.arch.griddepcontrol_wait()\n"

MUTANTS: list[Mutant] = [
    # --- CPU: the references (kda.reference, tpcomm.oproj.reference, tpcomm.mailbox) ---------
    M(
        "kref-eps-hardcoded",
        "kda/reference.py",
        "_rsqrt(_dot(o, o) * (1.0 / HEAD_DIM) + op.eps)",
        "_rsqrt(_dot(o, o) * (1.0 / HEAD_DIM) + 1e-6)",
        KREF,
        select="float64",
    ),
    M(
        "kref-lower-bound-hardcoded",
        "kda/reference.py",
        "decay = _decay(raw_g, op.a_log, op.dt_bias, op.lower_bound, op.gate_form)",
        "decay = _decay(raw_g, op.a_log, op.dt_bias, -5.0, op.gate_form)",
        KREF,
        select="float64",
    ),
    M(
        "kref-scale-hardcoded",
        "kda/reference.py",
        "q_hat = q * _l2(q) * op.scale",
        f"q_hat = q * _l2(q) * {SCALE}",
        KREF,
        select="float64",
    ),
    M(
        "kref-conv-tap-off-by-one",
        "kda/reference.py",
        "new = torch.cat([pre.taps[:, :, 1:], pre.inputs",
        "new = torch.cat([pre.taps[:, :, :2], pre.inputs",
        KREF,
        select="float64",
    ),
    M(
        "kref-conv-window-offset",
        "kda/reference.py",
        "positions = off_l[:, None] + torch.arange(3, device=device)",
        "positions = off_l[:, None] * 0 + torch.arange(3, device=device)",
        KREF,
        select="float64 or single_token_steps",
    ),
    M(
        "kref-state-written-in-record-mode",
        "kda/reference.py",
        "        if records is None:\n            keep = targets[:, t] > 0",
        "        if records is None or True:\n            keep = targets[:, t] > 0",
        KREF,
        select="record_and_recover",
    ),
    M(
        "kref-padding-rows-live",
        "kda/reference.py",
        "    live = (slot > 0).nonzero()[:, 0]\n    if live.numel() == 0:\n"
        "        return output\n    L =",
        "    live = (slot != 0).nonzero()[:, 0]\n    if live.numel() == 0:\n"
        "        return output\n    L =",
        KREF,
        select="padding",
    ),
    M(
        "kref-recover-lower-bound-hardcoded",
        "kda/reference.py",
        "decay = _decay(kg[..., HEAD_DIM:], a_log, dt_bias, lower_bound, gate_form)",
        "decay = _decay(kg[..., HEAD_DIM:], a_log, dt_bias, -5.0, gate_form)",
        KREF,
        select="record_and_recover",
    ),
    M(
        "oref-out-eps-is-eps",
        "tpcomm/oproj/reference.py",
        "scale = _rstd(quad, out_eps * den * den, hidden)",
        "scale = _rstd(quad, eps * den * den, hidden)",
        OREF,
        select="float64",
    ),
    M(
        "oref-eps-zero",
        "tpcomm/oproj/reference.py",
        "logits = _dot(V, w) * _rstd(_dot(V, V), eps, hidden)",
        "logits = _dot(V, w) * _rstd(_dot(V, V), 0.0, hidden)",
        OREF,
        select="float64",
    ),
    M(
        "oref-nb0-out-eps-zero",
        "tpcomm/oproj/reference.py",
        "final = _rstd(_dot(P, P), out_eps, hidden)",
        "final = _rstd(_dot(P, P), 0.0, hidden)",
        OREF,
        select="float64",
    ),
    M(
        "rank-order-reversed",
        "tpcomm/mailbox.py",
        "            part = p[first]\n            for r in range(first + 1, first + count):",
        "            part = p[first + count - 1]\n"
        "            for r in reversed(range(first, first + count - 1)):",
        OREF,
        select="float64 or group_order",
    ),
    M(
        "rank-order-grouped-by-floor",
        "tpcomm/mailbox.py",
        "per = -(-tp // groups)",
        "per = max(1, tp // groups)",
        OREF,
        select="float64 or group_order",
    ),
    M(
        "empty-group-adds-minus-zero",
        "tpcomm/mailbox.py",
        "part = torch.zeros_like(p[0])",
        "part = -torch.zeros_like(p[0])",
        OREF,
        select="empty_group",
    ),
    M(
        "host-canonicalisation-removed",
        "tpcomm/mailbox.py",
        "w[w == -1] = CANONICAL_NAN_WORD",
        "w[w == -1] = -1",
        "tests/test_tpcomm_layout.py",
        select="canonicalize",
    ),
    M(
        "kernel-groups-by-floor",
        "tpcomm/oproj/plan.py",
        "return -(-tp // groups)",
        "return max(1, tp // groups)",
        "tests/test_oproj_api.py",
        select="group_ranks",
    ),
    # --- CPU: validation and the job ---------------------------------------------------------
    M(
        "conv-pool-check-dropped",
        "kda/validate.py",
        "past = live & (conv_slot >= conv_pages)",
        "past = live & (conv_slot < 0)",
        KREF,
        select="bad_inputs",
    ),
    M(
        "live-conv-check-dropped",
        "kda/validate.py",
        "dead_conv = live & (conv_slot <= 0)",
        "dead_conv = live & (conv_slot < -9)",
        KREF,
        select="bad_inputs",
    ),
    M(
        "cli-tokens-range",
        "launch/layer.py",
        "if not 1 <= self.tokens <= 8:",
        "if not 1 <= self.tokens <= 9:",
        "tests/test_launch_refusals.py",
    ),
    M(
        "step-bytes-decode-pages",
        "launch/report.py",
        '{"decode": 2,',
        '{"decode": 1,',
        "tests/test_launch_gpu.py::test_step_bytes",
    ),
    # --- CPU: state management (kda.state, kda.reference.copy_state, engine.state) ----------
    M(
        "ref-copy-ring-skipped",
        "kda/reference.py",
        "    pools = (state, conv_state) + (tuple(ring) if ring is not None else ())",
        "    pools = (state, conv_state)",
        STATE,
        select="copies_whole_slots or prefix_cache",
    ),
    M(
        "copy-overlap-check-dropped",
        "kda/state.py",
        "both = seen.intersection(s)",
        "both = set()",
        STATE,
        select="refuses",
    ),
    M(
        "blob-layout-check-dropped",
        "engine/state.py",
        "        if got != mine:",
        "        if False:",
        STATE,
        select="round_trip",
    ),
    M(
        "handoff-not-transposed",
        "engine/state.py",
        "source = source if state_v_first else source.transpose(-1, -2)",
        "source = source",
        STATE,
        select="handoff",
    ),
    # --- CPU: each PDL kernel's wait removed (the PTX order check) ----------------------------
    M(
        "pdl-wait-wide",
        "kda/kernels/wide.py",
        WIDE_WAIT,
        WIDE_NO_WAIT,
        PDL_PTX,
        select="wide or split",
    ),
    M(
        "pdl-wait-stream",
        "kda/kernels/stream.py",
        "        cute.arch.griddepcontrol_wait()\n        if count > 0:",
        "        if count > 0:",
        PDL_PTX,
        select="stream",
    ),
    M(
        "pdl-wait-late-stream",
        "kda/kernels/stream.py",
        "        cute.arch.griddepcontrol_wait()\n        if count > 0:\n"
        "            self.stage_item(op, buffers, head, request, 0, True)\n",
        "        if count > 0:\n            self.stage_item(op, buffers, head, request, 0, True)\n"
        "        cute.arch.griddepcontrol_wait()\n",
        PDL_PTX,
        select="stream",
    ),
    M(
        "pdl-wait-late-recover",
        "kda/kernels/recover.py",
        "            cute.arch.griddepcontrol_wait()\n"
        "        source = Int32(op.slots[request, Int32(op.checkpoint[request]) - 1])\n",
        "            pass\n"
        "        source = Int32(op.slots[request, Int32(op.checkpoint[request]) - 1])\n"
        "        cute.arch.griddepcontrol_wait()\n",
        PDL_PTX,
        select="recover",
    ),
    M(
        "pdl-wait-recover",
        "kda/kernels/recover.py",
        "        if cutlass.const_expr(self.pdl):\n            cute.arch.griddepcontrol_wait()\n",
        "",
        PDL_PTX,
        select="recover",
    ),
    M(
        "pdl-wait-producer",
        "tpcomm/oproj/kernels/producer.py",
        "        if cutlass.const_expr(wait):\n            cute.arch.griddepcontrol_wait()\n",
        "",
        PDL_PTX,
        select="producer_reads",
    ),
    M(
        "pdl-wait-publisher",
        "tpcomm/oproj/kernels/producer.py",
        "        if cutlass.const_expr(self.pdl):\n            cute.arch.griddepcontrol_wait()\n"
        "        column",
        "        column",
        PDL_PTX,
        select="publisher",
    ),
    M(
        "pdl-wait-fused-producer",
        "tpcomm/oproj/kernels/fused.py",
        "            cute.arch.griddepcontrol_wait()  # attn_out is the previous kernel's\n",
        "",
        PDL_PTX,
        select="fused",
    ),
    M(
        "pdl-early-wait-fused-consumer",
        "tpcomm/oproj/kernels/consumer.py",
        "            # everything above reads only what no kernel of this step writes\n"
        "            cute.arch.griddepcontrol_wait()\n",
        "",
        PDL_PTX,
        select="fused",
    ),
    # --- GPU: the kernels' scalars ----------------------------------------------------------
    M(
        "gpu-wide-eps-hardcoded",
        "kda/kernels/wide.py",
        "self.write_output(s_o, out_sums, op.gate, nw, op.eps,",
        "self.write_output(s_o, out_sums, op.gate, nw, Float32(1e-6),",
        WIDE_CASE,
        gpu=True,
    ),
    M(
        "gpu-stream-eps-hardcoded",
        "kda/kernels/stream.py",
        "nw, op.eps, op.output, token, head)",
        "nw, Float32(1e-6), op.output, token, head)",
        STREAM_CASE,
        gpu=True,
    ),
    M(
        "gpu-split-eps-hardcoded",
        "kda/kernels/split.py",
        "(1.0 / HEAD_DIM) + op.eps)",
        "(1.0 / HEAD_DIM) + 1e-6)",
        SPLIT_ROW,
        gpu=True,
    ),
    M(
        "gpu-wide-lower-bound-hardcoded",
        "kda/kernels/wide.py",
        "lower_bound, kg_records = op.lower_bound, op.kg_records",
        "lower_bound, kg_records = Float32(-5.0), op.kg_records",
        WIDE_CASE,
        gpu=True,
    ),
    M(
        "gpu-wide-scale-hardcoded",
        "kda/kernels/wide.py",
        "self.normalize_qk(s_q, s_k, sums, op.scale)",
        f"self.normalize_qk(s_q, s_k, sums, Float32({SCALE}))",
        WIDE_CASE,
        gpu=True,
    ),
    M(
        "gpu-split-scale-hardcoded",
        "kda/kernels/split.py",
        "self.normalize_cluster(s_q, s_k, qk_pairs, op.scale)",
        f"self.normalize_cluster(s_q, s_k, qk_pairs, Float32({SCALE}))",
        SPLIT_ROW,
        gpu=True,
    ),
    M(
        "gpu-recover-lower-bound-hardcoded",
        "kda/kernels/device.py",  # dev.stage_records (KdaRecover's and KdaReplay's decays)
        "s_decay[j, channel] = decay(a, raw_g, dt, op.lower_bound, softplus_gate)",
        "s_decay[j, channel] = decay(a, raw_g, dt, Float32(-5.0), softplus_gate)",
        RGPU,
        gpu=True,
        select="H1B1T2 or pdl",
    ),
    # --- GPU: KDA state, conv and padding ----------------------------------------------------
    M(
        "gpu-wide-conv-tap-off-by-one",
        "kda/kernels/wide.py",
        "conv_state[Int64(conv_slot), ch, 0] = conv_type(taps[s][1])",
        "conv_state[Int64(conv_slot), ch, 0] = conv_type(taps[s][0])",
        WIDE_T1,
        gpu=True,
    ),
    M(
        "gpu-wide-state-written-in-record-mode",
        "kda/kernels/wide.py",
        "        if self.record:\n            return None\n        if self.tokens == 1:",
        "        if False:\n            return None\n        if self.tokens == 1:",
        WIDE_CASE,
        gpu=True,
    ),
    M(
        "gpu-wide-padding-rows-written",
        "kda/kernels/wide.py",  # KdaWide.write_padding
        "                output[token + t, head * HEAD_DIM + row] = BFloat16(0.0)",
        "                output[token + t, head * HEAD_DIM + row] = BFloat16(1.0)",
        WIDE_CASE,
        gpu=True,
    ),
    # --- GPU: KdaReplay's ring --------------------------------------------------------------
    M(
        "gpu-replay-fold-threshold",
        "kda/kernels/replay.py",
        "fold = held + T > R",
        "fold = held + T > R + 1",
        REPLAY,
        gpu=True,
        select="replay_matches_reference",
    ),
    M(
        "gpu-replay-suffix-order",
        "kda/kernels/replay.py",
        RING_SUM + RING_PRODUCT,
        RING_PRODUCT + RING_SUM,
        REPLAY,
        gpu=True,
        select="replay_matches_reference",
    ),
    M(
        "gpu-replay-pending-commit-count",
        "kda/kernels/replay.py",
        "            if accepted < pending:\n                pending = accepted\n",
        "            if accepted < pending:\n                pending = pending\n",
        REPLAY,
        gpu=True,
        select="replay_matches_reference and T4",
    ),
    M(
        "gpu-replay-padding-rows-written",
        "kda/kernels/wide.py",  # KdaWide.write_padding, KdaReplay's too
        "                output[token + t, head * HEAD_DIM + row] = BFloat16(0.0)",
        "                output[token + t, head * HEAD_DIM + row] = BFloat16(1.0)",
        REPLAY,
        gpu=True,
        select="replay_matches_reference",
    ),
    # --- GPU: the state kernels (KdaCopy, KdaFold) -------------------------------------------
    M(
        "gpu-copy-counters-skipped",
        "kda/kernels/copy.py",
        "op.ring_length[Int64(dst), tid] = op.ring_length[Int64(src), tid]",
        "op.ring_length[Int64(dst), tid] = op.ring_length[Int64(dst), tid]",
        SGPU,
        gpu=True,
        select="copy_kernel_is_the_reference",
    ),
    M(
        "gpu-copy-tail-past-the-page",
        "kda/kernels/copy.py",
        "            if v < vectors:",
        "            if v <= vectors:",
        SGPU,
        gpu=True,
        select="copy_kernel_is_the_reference",
    ),
    M(
        "gpu-fold-fast-exp",
        "kda/kernels/fold.py",
        "a = dev.exp_f32_exact(op.a_log[head])",
        "a = dev.exp_f32(op.a_log[head])",
        SGPU,
        gpu=True,
        select="fold_kernel_is_the_reference",
    ),
    M(
        "gpu-fold-accepted-ignored",
        "kda/kernels/fold.py",
        "                if accepted < pending:\n                    pending = accepted\n",
        "                if accepted < pending:\n                    pending = pending\n",
        SGPU,
        gpu=True,
        select="fold_kernel_is_the_reference and aTrue",
    ),
    # --- GPU: each PDL wait removed, against an early-releasing predecessor ------------------
    M(
        "gpu-pdl-wait-wide",
        "kda/kernels/wide.py",
        WIDE_WAIT,
        WIDE_NO_WAIT,
        KGPU,
        gpu=True,
        select="early_releasing and (wide or split2)",
    ),
    M(
        "gpu-pdl-wait-stream",
        "kda/kernels/stream.py",
        "        cute.arch.griddepcontrol_wait()\n        if count > 0:",
        "        if count > 0:",
        KGPU,
        gpu=True,
        select="early_releasing and stream",
    ),
    M(
        "gpu-pdl-wait-late-stream",
        "kda/kernels/stream.py",
        "        cute.arch.griddepcontrol_wait()\n        if count > 0:\n"
        "            self.stage_item(op, buffers, head, request, 0, True)\n",
        "        if count > 0:\n            self.stage_item(op, buffers, head, request, 0, True)\n"
        "        cute.arch.griddepcontrol_wait()\n",
        KGPU,
        gpu=True,
        select="early_releasing and stream",
    ),
    M(
        "gpu-pdl-wait-recover",
        "kda/kernels/recover.py",
        "        if cutlass.const_expr(self.pdl):\n            cute.arch.griddepcontrol_wait()\n",
        "",
        RGPU,
        gpu=True,
        select="early_releasing",
    ),
    M(
        "gpu-pdl-wait-producer",
        "tpcomm/oproj/kernels/producer.py",
        "        if cutlass.const_expr(wait):\n            cute.arch.griddepcontrol_wait()\n",
        "",
        ONE,
        gpu=True,
        select="early_releasing and producer",
    ),
    M(
        "gpu-pdl-wait-publisher",
        "tpcomm/oproj/kernels/producer.py",
        "        if cutlass.const_expr(self.pdl):\n            cute.arch.griddepcontrol_wait()\n"
        "        column",
        "        column",
        ONE,
        gpu=True,
        select="early_releasing and publisher",
    ),
    # --- GPU: the consumer --------------------------------------------------------------------
    M(
        "gpu-consumer-eps-swapped",
        "tpcomm/oproj/kernels/consumer.py",
        "eps, out_eps = op.eps, op.out_eps",
        "eps, out_eps = op.out_eps, op.eps",
        f"{CGPU}::test_consumer_matches_reference[c1-tp2]",
        gpu=True,
    ),
    M(
        "gpu-consumer-out-eps-zero",
        "tpcomm/oproj/kernels/consumer.py",
        "quad / Float32(self.hid) + out_eps * den * den)",
        "quad / Float32(self.hid) + 0.0 * den * den)",
        f"{CGPU}::test_consumer_matches_reference[c1-tp2]",
        gpu=True,
    ),
    M(
        "gpu-consumer-nb0-out-eps-zero",
        "tpcomm/oproj/kernels/consumer.py",
        "tot_post[0] / Float32(self.hid) + out_eps)",
        "tot_post[0] / Float32(self.hid) + 0.0)",
        f"{CGPU}::test_consumer_matches_reference[c0-tp2]",
        gpu=True,
    ),
    M(
        "gpu-consumer-rearm-skipped",
        "tpcomm/oproj/kernels/consumer.py",
        "            protocol.rearm(slot0 + (first + i) * slot_bytes)",
        "            pass",
        f"{CGPU}::test_consumer_matches_reference[c0-tp2]",
        gpu=True,
    ),
    M(
        "gpu-consumer-wrong-parity",
        "tpcomm/oproj/kernels/consumer.py",
        "parity = Int64(op.step & 1)",
        "parity = Int64(0)",
        f"{CGPU}::test_consumer_matches_reference[c0-tp2]",
        gpu=True,
    ),
    M(
        "gpu-publish-canonicalisation-removed",
        "tpcomm/protocol.py",
        "clean = [canonicalize(w) for w in words]",
        "clean = list(words)",
        f"{CGPU}::test_consumer_matches_reference[c0-tp2]",
        gpu=True,
    ),
    M(
        "gpu-consumer-rank-order-reversed",
        "tpcomm/oproj/kernels/consumer.py",
        "addresses = [slot0 + (first + lo + i) * slot_bytes for i in range(n)]",
        "addresses = [slot0 + (first + lo + n - 1 - i) * slot_bytes for i in range(n)]",
        f"{CGPU}::test_consumer_matches_reference[c4-tp8]",
        f"{CGPU}::test_consumer_matches_reference[c13-tp3]",
        gpu=True,
    ),
]
