"""More mutants for ``scripts/mutants.py`` (``scripts/mutants_table.py`` is full): KdaPipe's
guards."""

from __future__ import annotations

from mutants_table import KGPU, PDL_PTX, M

PIPE = "kda/kernels/pipe.py"

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
        "        if (item < end) & (item // requests != head):",
        "        if (item < end) & (item // requests != head) & (item < 0):",
        KGPU,
        gpu=True,
        select="pipe",
    ),
    M(
        "gpu-pipe-no-swizzle",
        PIPE,
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
]
