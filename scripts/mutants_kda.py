"""More mutants for ``scripts/mutants.py`` (``scripts/mutants_table.py`` is full): KdaPipe's
guards."""

from __future__ import annotations

from mutants_table import KGPU, PDL_PTX, M

PIPE = "kda/kernels/pipe.py"
PIPE_PREP = "kda/kernels/pipe_prep.py"
BF16_PTX = "tests/test_kda_bf16_compile.py"
INDEX = "tests/test_kda_pipe_index.py"
BATCH = "tests/test_kda_pipe_batch.py"

KDA_MUTANTS = [
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
