"""More mutants for ``scripts/mutants.py`` (``scripts/mutants_table.py`` is full): the
o-projection's wgmma producer and its hidden-width geometry (``plan.slicing``)."""

from __future__ import annotations

from mutants_table import M

GEMM = "tpcomm/oproj/kernels/gemm.py"
PRODUCER = "tpcomm/oproj/kernels/producer.py"
GEMM_PTX = "tests/test_oproj_gemm_compile.py"
GEMM_GPU = "tests/test_oproj_gemm_gpu.py"
PLAN = "tpcomm/oproj/plan.py"
CONSUMER = "tpcomm/oproj/kernels/consumer.py"

OPROJ_MUTANTS = [
    # --- OprojGemmProducer (TMA + wgmma, publishing from its epilogue) ----------------------
    M(  # the publish shared with PartialPublisher (GroupPublisher.publish_group)
        "gemm-one-shot-one-peer",
        PRODUCER,
        "            for p in cutlass.range_constexpr(self.tp):\n"
        "                protocol.publish(peers[p] + offset, words)",
        "            for p in cutlass.range_constexpr(1):\n"
        "                protocol.publish(peers[p] + offset, words)",
        f"{GEMM_PTX}::test_gemm_producer_ptx",
    ),
    M(  # the bug the first GPU run found: every thread of a warp group its first thread's C
        "gemm-coords-per-warp-group",
        GEMM,
        "    return tiled_mma.get_slice(tid).partition_C(",
        "    return tiled_mma.get_slice(tid // 128 * 128).partition_C(",
        f"{GEMM_PTX}::test_every_thread_publishes_its_own_accumulators",
    ),
    M(
        "gemm-pdl-wait-removed",
        GEMM,
        "            cute.arch.griddepcontrol_wait()  # attn_out comes from the previous kernel\n",
        "",
        f"{GEMM_PTX}::test_gemm_producer_ptx",
    ),
    M(
        "gpu-gemm-pair-order",
        GEMM,
        "out[m, n // 2] = pack_bf16x2(acc[i], acc[i + 1])",
        "out[m, n // 2] = pack_bf16x2(acc[i + 1], acc[i])",
        f"{GEMM_GPU}::test_one_launch_publishes_the_projection",
        gpu=True,
        select="9",
    ),
    M(
        "gpu-gemm-row-tile",
        GEMM,
        "            token = bm * self.tile_m + row\n",
        "            token = row\n",
        f"{GEMM_GPU}::test_per_rank_publishes_the_projection",
        gpu=True,
        select="300",
    ),
    M(
        "gpu-gemm-twoshot-owner",
        PRODUCER,
        "        if cutlass.const_expr(self.twoshot):\n"
        "            owner = column // (self.hid // self.tp)\n",
        "        if cutlass.const_expr(self.twoshot):\n            owner = column // self.hid\n",
        f"{GEMM_GPU}::test_per_rank_publishes_the_projection",
        gpu=True,
        select="True",
    ),
    # --- hidden widths: multiples of 256 -------------------------------------------------
    M(  # the most CTAs instead of the fewest: 4096 would split into 8 x 512
        "slicing-most-ctas",
        PLAN,
        "    n = min(narrow) if narrow else max(ctas)",
        "    n = max(narrow) if narrow else max(ctas)",
        "tests/test_oproj_slicing.py::test_slicing_rule",
    ),
    M(  # one producer team per consumer group whatever the group's threads
        "fused-teams-are-groups",
        PLAN,
        "    return threads // THREADS\n",
        "    return groups\n",
        "tests/test_oproj_fused.py::test_tiles_cover_every_feature_once",
    ),
    M(  # a CTA's dot products from its first four warps only (2816: eleven)
        "gpu-consumer-four-warps",
        CONSUMER,
        "        for w in cutlass.range_constexpr(1, self.warps):",
        "        for w in cutlass.range_constexpr(1, min(self.warps, 4)):",
        "tests/test_oproj_consumer_gpu.py::test_consumer_matches_reference",
        gpu=True,
        select="hid2816",
    ),
]
