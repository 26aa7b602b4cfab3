"""More mutants for ``scripts/mutants.py`` (``scripts/mutants_table.py`` is full): KdaPipe's
guards, the softplus gate's (reference and kernels)."""

from __future__ import annotations

from mutants_table import KGPU, KREF, PDL_PTX, REPLAY, RGPU, SGPU, SPLIT_ROW, M

PIPE = "kda/kernels/pipe.py"
PIPE_PREP = "kda/kernels/pipe_prep.py"
BF16_PTX = "tests/test_kda_bf16_compile.py"
INDEX = "tests/test_kda_pipe_index.py"
SOFTPLUS = "tests/test_kda_softplus.py"
SCALAR = "kda/kernels/scalar.py"
# KdaWide / KdaPipe cases of SCALARS[3] (the softplus gate): T 8 (KdaPipe's gate_decays), T 2
# (KdaPipe's gate batch)
WIDE_SOFTPLUS = f"{KGPU}::test_decode_matches_reference[s3-H96B130T8-wf-b1-r0-wide]"
PIPE_SOFTPLUS = f"{KGPU}::test_decode_matches_reference[s3-H96B130T8-wf-b1-r0-pipe]"
PIPE_SOFTPLUS_BATCH = f"{KGPU}::test_decode_matches_reference[s7-H1B64T2-df-b0-r0-pipe]"
BATCH = "tests/test_kda_pipe_batch.py"

KDA_MUTANTS = [
    # --- the softplus gate: the reference ------------------------------------------------------
    M(
        "kref-softplus-threshold",
        "kda/reference.py",
        "torch.where(d > SOFTPLUS_THRESHOLD, d,",
        "torch.where(d > 10.0, d,",
        SOFTPLUS,
        select="torchs",
    ),
    M(
        "kref-softplus-without-a",
        "kda/reference.py",
        "        return -a * _softplus(x)\n",
        "        return -_softplus(x)\n",
        KREF,
        select="float64",
    ),
    M(
        "kref-replay-ring-decay-lower-bound",
        "kda/reference.py",
        "d_j = _decay(kg[..., HEAD_DIM:], op.a_log, op.dt_bias, op.lower_bound, op.gate_form)",
        'd_j = _decay(kg[..., HEAD_DIM:], op.a_log, op.dt_bias, -5.0, "lower-bound")',
        "tests/test_kda_replay.py",
        select="decode_matches_per_step and None",
    ),
    # --- the softplus gate: the kernels (the compile-time switch, the threshold) ---------------
    M(
        "gpu-softplus-threshold",
        SCALAR,
        "    return cutlass.select_(x > Float32(SOFTPLUS_THRESHOLD), x, smooth)\n\n\ndef decay(",
        "    return cutlass.select_(x > Float32(0.0), x, smooth)\n\n\ndef decay(",
        WIDE_SOFTPLUS,
        gpu=True,
    ),
    M(
        "gpu-wide-softplus-off",
        "kda/kernels/wide.py",
        "dev.decay(a, raw_g, dt[e // 2], lower_bound, self.softplus_gate)",
        "dev.decay(a, raw_g, dt[e // 2], lower_bound, False)",
        WIDE_SOFTPLUS,
        gpu=True,
    ),
    M(
        "gpu-pipe-softplus-off",
        PIPE_PREP,
        "dev.decay(a, raw_g, dt_f, op.lower_bound, self.softplus_gate)",
        "dev.decay(a, raw_g, dt_f, op.lower_bound, False)",
        PIPE_SOFTPLUS,
        gpu=True,
    ),
    M(
        "gpu-pipe-batch-softplus-off",
        PIPE_PREP,
        "decays[j, feature] = dev.decay(a, raw_g, dt[e // 2], op.lower_bound, self.softplus_gate)",
        "decays[j, feature] = dev.decay(a, raw_g, dt[e // 2], op.lower_bound, False)",
        PIPE_SOFTPLUS_BATCH,
        gpu=True,
    ),
    M(
        "gpu-split-softplus-off",
        "kda/kernels/split.py",
        "dev.decay(a, raw_g, dt[e // 2], op.lower_bound, self.softplus_gate)",
        "dev.decay(a, raw_g, dt[e // 2], op.lower_bound, False)",
        SPLIT_ROW,
        gpu=True,
    ),
    M(
        "gpu-recover-softplus-off",
        "kda/kernels/device.py",  # dev.stage_records (KdaRecover's and KdaReplay's decays)
        "s_decay[j, channel] = decay(a, raw_g, dt, op.lower_bound, softplus_gate)",
        "s_decay[j, channel] = decay(a, raw_g, dt, op.lower_bound, False)",
        RGPU,
        gpu=True,
        select="H6B1T8 or H96B3T8",
    ),
    M(
        "gpu-replay-ring-softplus-off",
        "kda/kernels/replay.py",
        "gate = dict(keys_past=False, softplus_gate=self.softplus_gate)",
        "gate = dict(keys_past=False, softplus_gate=False)",
        REPLAY,
        gpu=True,
        select="replay_matches_reference and s3",
    ),
    M(
        "gpu-fold-softplus-fast",
        SCALAR,
        "return exp_f32_exact(-(a * softplus_exact(raw_g + dt)))",
        "return exp_f32_exact(-(a * softplus(raw_g + dt)))",
        SGPU,
        gpu=True,
        select="fold_kernel_is_the_reference and lbNone",
    ),
    M(
        "pdl-wait-pipe",
        PIPE,
        "        cute.arch.griddepcontrol_wait()\n        if slot_a > 0:",
        "        if slot_a > 0:",
        PDL_PTX,
        select="pipe",
    ),
    M(
        "gpu-pipe-head-cache-stale",
        PIPE,
        "        if (n < count) & (new_head != head):",
        "        if (n < count) & (new_head != head) & (n < 0):",
        KGPU,
        gpu=True,
        select="pipe",
    ),
    M(
        "gpu-pipe-no-swizzle",
        PIPE_PREP,
        "            swizzled = (granule & 8) | ((granule ^ row) & 7)\n",
        "            swizzled = granule\n",
        KGPU,
        gpu=True,
        select="pipe",
    ),
    M(
        "gpu-pipe-slot-parity",
        PIPE,
        "            slot = v_slot[s]\n",
        "            slot = v_slot[1 - s]\n",
        KGPU,
        gpu=True,
        select="pipe",
    ),
    # KdaPipe's item indices: the stepped (head, request) pairs, no division per item
    M(
        "pipe-index-no-wrap",
        "kda/kernels/pipe_index.py",
        "        wrap = request + 1 == requests\n",
        "        wrap = request == requests\n",
        INDEX,
        select="divmod",
    ),
    M(
        "pipe-divides-per-item",
        PIPE,
        "            token = request * T\n",
        "            token = (request + n // requests) * T\n",
        INDEX,
        select="divides",
    ),
    # KdaPipe's decays of the tokens in use (gate_decays, fp32 T 1): the lane holding
    # (t, f), the accumulator chosen there
    M(
        "gpu-pipe-decay-lane",
        PIPE_PREP,
        "            source = (f % 8) * 4 + t // 2",
        "            source = (f % 8) * 4",
        KGPU,
        gpu=True,
        select="pipe",
    ),
    M(
        "gpu-pipe-decay-accumulator",
        PIPE_PREP,
        "            e = t % 2 + 2 * (f // 8)",
        "            e = t % 2 + 2 * (f % 2)",
        KGPU,
        gpu=True,
        select="pipe",
    ),
    # KdaPipe at T <= 4: the gate batch's decays rows of the item, and its batches' limits
    M(
        "gpu-pipe-batch-row",
        "kda/kernels/pipe.py",
        "batch[1][place * T + t, feature]",
        "batch[1][t, feature]",
        KGPU,
        gpu=True,
        select="pipe",
    ),
    M(
        "pipe-batch-past-head",
        PIPE_PREP,
        "size = cutlass.select_(requests - request < items, requests - request, items)",
        "size = Int32(items)",
        BATCH,
        select="batches",
    ),
    # KdaPipe at T >= 3 (prep_output): the prep group's output rows of a padding item
    M(
        "gpu-pipe-prep-output-padding",
        PIPE_PREP,
        "                if live <= 0:\n",
        "                if live < 0:\n",
        KGPU,
        gpu=True,
        select="pipe",
    ),
    # KdaPipe's bf16 pages: a pair's 16-byte copies meet at a warp barrier each side of the
    # stage's read (the PTX order test; a missing one is a rare race on the GPU)
    M(
        "pipe-bf16-no-sync-after-wait",
        PIPE,
        "  # the partner's copies have landed\n                cute.arch.sync_warp()\n",
        "  # the partner's copies have landed\n                pass\n",
        BF16_PTX,
        select="pair_barriers",
    ),
    M(
        "pipe-bf16-no-sync-before-restage",
        PIPE,
        "  # the partner has read its slots\n                cute.arch.sync_warp()\n",
        "  # the partner has read its slots\n                pass\n",
        BF16_PTX,
        select="pair_barriers",
    ),
    M(
        "pipe-bf16-two-stages",
        PIPE,
        "    most = STAGES if state_bytes == 4 else MAX_STAGES\n",
        "    most = STAGES\n",
        BF16_PTX,
        select="pair_barriers or layout",
    ),
]
